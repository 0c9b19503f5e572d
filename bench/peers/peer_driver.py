"""Replay a trace's block chains through a peer's own cache code, in the peer's environment.

Run as a script by the trace benchmark (``python peer_driver.py WORK.npz OUT.json --peer ...``),
possibly with another Python (a virtual environment that holds vLLM or LMCache), so it imports
nothing from kvoffload: only the standard library and numpy at module level, the peer inside
its runner. The result is JSON: per capacity, the hit blocks and seconds of every request; or
an `error` saying why the peer could not run (not importable, failed), never a silent omission.

- ``vllm_lru`` / ``vllm_arc``: vLLM's `CPUOffloadingManager` (`vllm.v1.kv_offload.cpu`) with its
  LRU or ARC `CachePolicy`, driven the way vLLM's offloading scheduler drives it: per request
  positions of its keys, `lookup` until the first miss, `prepare_load`/`complete_load` of the
  hits, `prepare_store`/`complete_store` of the rest, `on_request_finished`. Bookkeeping only:
  vLLM's worker copies need CUDA, so no bytes move and the times are the manager's alone.
- ``lmcache``: LMCache's `LMCacheEngine` with its LocalCPU backend (and LocalDisk when a disk
  capacity is given), chunk size = the trace's block size, fed token ids and CPU tensors
  through a connector that really copies: `lookup`, `retrieve` of the hit prefix (checked
  against the stamp each block was stored with), `store` of the rest.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Work = dict[str, npt.NDArray[Any]]
Runner = Callable[[Work, int, int, argparse.Namespace], dict[str, object]]


def _chains(work: Work) -> list[npt.NDArray[np.int64]]:
    chain, offsets = work["chain"], work["offsets"]
    return [chain[offsets[i] : offsets[i + 1]] for i in range(offsets.size - 1)]


def _run_vllm(policy: str) -> Runner:
    def run(
        work: Work, blocks: int, disk_blocks: int, args: argparse.Namespace
    ) -> dict[str, object]:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        if disk_blocks:
            return {"error": "vLLM's CPU offloading manager has no disk tier in this comparison"}
        keys = [make_offload_key(bytes(k), 0) for k in work["keys"]]
        manager = CPUOffloadingManager(num_chunks=blocks, cache_policy=policy)
        bt = args.block_tokens
        hits, seconds = [], []
        for i, chain in enumerate(_chains(work)):
            req = [keys[k] for k in chain]
            t0 = time.perf_counter()
            ctx = ReqContext(req_id=str(i))
            manager.on_new_request(ctx)
            for j, key in enumerate(req):
                ctx.set_offload_key_position(key, (j + 1) * bt)
            hit = 0
            for key in req:
                if manager.lookup(key, ctx) is not LookupResult.HIT:
                    break
                hit += 1
            if hit:
                manager.prepare_load(req[:hit], ctx)
                manager.complete_load(req[:hit], ctx)
            out = manager.prepare_store(req[hit:], ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            seconds.append(time.perf_counter() - t0)
            hits.append(hit)
        return {"hit_blocks": hits, "seconds": seconds, "verified_blocks": 0}

    return run


def _lmcache_connector(base: type) -> type:
    """A connector over CPU tensors: `kv` is the request's KV [2, layers, tokens, dim] to store
    from, `out` the tensor to load into."""

    class CPUTensorConnector(base):  # type: ignore[misc]
        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["out"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kwargs)

    return CPUTensorConnector


def _run_lmcache(
    work: Work, blocks: int, disk_blocks: int, args: argparse.Namespace
) -> dict[str, object]:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # usage telemetry is on by default
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    import logging

    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)
    bt = args.block_tokens
    # One chunk = [K/V, 1 layer, bt tokens, dim] fp16, as close to the payload as that allows.
    dim = max(8, args.payload // (4 * bt))
    chunk_bytes = 4 * bt * dim
    slot = -(-chunk_bytes // 4096) * 4096
    disk_dir = Path(args.dir) / f"lmcache-disk-{os.getpid()}-{blocks}"
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=bt,
        local_cpu=True,
        max_local_cpu_size=blocks * slot / 2**30,
        local_disk=f"{disk_dir}/" if disk_blocks else None,
        max_local_disk_size=disk_blocks * slot / 2**30,
        save_unfull_chunk=False,
        cache_policy="LRU",
    )
    shape = (1, 2, bt, 1, dim)
    metadata = LMCacheMetadata(
        model_name="kvoffload-trace", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float16, kv_shape=shape, chunk_size=bt,
    )  # fmt: skip
    connector = _lmcache_connector(MockGPUConnector)(kv_shape=shape)
    instance = f"kvoffload-{os.getpid()}-{blocks}-{disk_blocks}"
    keys16 = work["keys"].view(np.int16)  # a key's 16 bytes as 8 fp16-sized stamps
    tokens, tok_off = work["tokens"], work["token_offsets"]
    hits, seconds = [], []
    verified = 0
    try:
        engine = LMCacheEngineBuilder.get_or_create(
            instance, config, metadata, connector, lambda t, r: None, lambda o, r: o
        )
        engine.post_init()
        for i, chain in enumerate(_chains(work)):
            ids = torch.from_numpy(tokens[tok_off[i] : tok_off[i + 1]].astype(np.int64))
            n = int(ids.numel())
            kv = torch.zeros((2, 1, n, dim), dtype=torch.float16)
            stamps = kv.view(torch.int16)[0, 0, ::bt, :8]
            stamps.copy_(torch.from_numpy(keys16[chain]))
            t0 = time.perf_counter()
            hit_tokens = int(engine.lookup(ids)) if n else 0
            if disk_blocks:
                # LMCache stages every disk hit in its CPU pool at once and waits (forever) for
                # room, so a request can load at most a CPU pool's worth of blocks.
                hit_tokens = min(hit_tokens, blocks * bt)
            loaded = 0
            if hit_tokens:
                out = torch.zeros_like(kv)
                mask = engine.retrieve(ids[:hit_tokens], out=out)
                got = int(mask.sum())
                loaded = got // bt
            if loaded < n // bt:
                mask = torch.ones(n, dtype=torch.bool)
                mask[: loaded * bt] = False
                engine.store(ids, mask=mask, kv=kv)
            seconds.append(time.perf_counter() - t0)
            if loaded:
                back = out.view(torch.int16)[0, 0, ::bt, :8][:loaded]
                if not torch.equal(back, stamps[:loaded]):
                    raise RuntimeError(f"request {i}: LMCache returned a block with other bytes")
                verified += loaded
            hits.append(loaded)
        return {
            "hit_blocks": hits,
            "seconds": seconds,
            "verified_blocks": verified,
            "chunk_bytes": chunk_bytes,
        }
    finally:
        # Free this capacity's pools and threads before the next one is built.
        LMCacheEngineBuilder.destroy(instance)
        shutil.rmtree(disk_dir, ignore_errors=True)


NOTES = {
    "lmcache": "LMCache stages a request's disk hits in its CPU pool all at once, so with a disk "
    "tier a request loads at most the CPU pool's blocks (the rest count as misses)",
}

RUNNERS: dict[str, tuple[str, Runner]] = {
    "vllm_lru": ("vllm", _run_vllm("lru")),
    "vllm_arc": ("vllm", _run_vllm("arc")),
    "lmcache": ("lmcache", _run_lmcache),
}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("work", help="npz: keys, chain, offsets, tokens, token_offsets")
    parser.add_argument("out", help="where to write the JSON result")
    parser.add_argument("--peer", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--capacities", required=True, help="blocks per run, comma-separated")
    parser.add_argument("--disk", default="", help="disk blocks per run (0 = none)")
    parser.add_argument("--block-tokens", type=int, required=True)
    parser.add_argument("--payload", type=int, required=True, help="bytes per block")
    parser.add_argument("--dir", default=".", help="scratch directory for disk tiers")
    args = parser.parse_args(argv)
    package, runner = RUNNERS[args.peer]
    capacities = [int(c) for c in args.capacities.split(",")]
    disks = [int(d) for d in args.disk.split(",")] if args.disk else [0] * len(capacities)
    result: dict[str, object] = {"peer": args.peer, "python": sys.executable}
    version = _version(package)
    result["version"] = version
    if args.peer in NOTES and any(int(d) for d in args.disk.split(",") if d):
        result["note"] = NOTES[args.peer]
    runs: list[dict[str, object]] = []
    result["runs"] = runs
    try:
        __import__(package)
    except Exception as exc:  # any import failure means "peer absent", with its reason
        result["error"] = f"{package} is not importable by {sys.executable}: {exc!r}"
    else:
        with np.load(args.work) as data:
            work = {name: data[name] for name in data.files}
        for blocks, disk in zip(capacities, disks, strict=True):
            try:
                run = runner(work, blocks, disk, args)
            except Exception:  # reported to the caller as a failed run, with its traceback
                run = {"error": traceback.format_exc(limit=3)}
            run.update(capacity_blocks=blocks, disk_blocks=disk)
            runs.append(run)
    Path(args.out).write_text(json.dumps(result))
    # LMCache leaves non-daemon threads behind; the result is written, so leave now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
