"""`KVOffloadECConnector`: vLLM's encoder-cache (EC) connector over a kvoffload store, for
encode/prefill/decode (E/P/D) disaggregation of multimodal models.

An encoder instance (``ec_producer``) saves each multimodal item's encoder output; prefill
instances (``ec_consumer``) load it instead of running the vision encoder. Both name an entry
by vLLM's item identifier (``mm_feature.identifier``, the mm hash) under a namespace that
fingerprints the model and its encoder, so a different encoder never reads another's outputs.

How vLLM 0.33 drives an EC connector decides where the bytes move. The scheduler commits to
loading an item as soon as `has_cache_item` says yes, and the model runner has no recovery if
the worker's `start_load_caches` then fails to fill ``encoder_cache[mm_hash]`` (it raises
"Encoder cache miss" and the engine dies). A store, however, may evict or find damaged an entry
at any time. So the scheduler side reads and verifies an entry before it answers yes, and the
verified tensor travels to the workers in the step's connector metadata; a damaged, evicted or
half-evicted entry is a plain miss and vLLM runs the encoder. Items the store does not hold are
ruled out with one batched lookup per request (`ensure_cache_available`), not a read each.

Saves run on the worker that computed the output, in a background thread that the end of the
same step waits for: vLLM may hand the finished request ids over only with the next request, so
nothing may wait for them, and `request_finished` never delays freeing (only a KV connector can
release such a request).

Stored form: an entry is a manifest value (shape, dtype, size) that carries the payload inline
when it fits in one value; larger outputs are split into chunks named by a random nonce the
manifest records, written before the manifest. Every value carries the store's header and CRC,
so a read that misses or fails verification on any chunk is a miss, never partial data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import blake3
import numpy as np
import torch

# vLLM's EC connector API: the names this module uses (vLLM 0.33.0 and 0.32.0 alike).
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from kvoffload.client_sdk import BlockHash, Client, Namespace, engine_hashes
from kvoffload.connectors.vllm import _compat
from kvoffload.errors import (
    ConfigError,
    InvalidArgumentError,
    KVOffloadError,
)

__all__ = [
    "ECSettings",
    "ECStats",
    "EncoderOutputStore",
    "KVOffloadECConnector",
    "KVOffloadECMetadata",
    "ec_namespace",
]

log = logging.getLogger(__name__)

# Element types an entry may hold; the manifest names one, and only these are read back.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    )
}  # fmt: skip

_MAGIC = b"KVEC"
_VERSION = 1
# magic, version, ndim, dtype name length, chunk count, chunk bytes, payload bytes, nonce.
_MANIFEST = struct.Struct("<4sHHHIQQ16s")
_MAX_NDIM = 8
_HEADER_ROOM = 4096
# hf_config keys that name where or by what the model was saved, not what it computes.
_NOT_ENCODER = ("_name_or_path", "transformers_version", "_commit_hash")


@dataclass(frozen=True)
class ECSettings:
    """``ec_connector_extra_config`` of `KVOffloadECConnector`; one comment per key."""

    # The store every instance shares: kv://host:port, cluster://..., nvme+tcp://... (a
    # local:// store is private to one process: only for tests and single-process engines).
    url: str = ""
    # Deployment salt mixed into every key: deployments that must never share encoder outputs
    # use different salts.
    salt: str = ""
    # Largest chunk of a split entry, in bytes; 0 = the largest value the store accepts.
    chunk_bytes: int = 0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ECSettings:
        """Parse and check the connector's extra config.

        Raises:
            ConfigError: an unknown key, a missing url or a bad value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown ec_connector_extra_config key(s) {unknown}; valid: {sorted(known)}"
            )
        url, salt, chunk = extra.get("url", ""), extra.get("salt", ""), extra.get("chunk_bytes", 0)
        if not isinstance(url, str) or not url:
            raise ConfigError('ec_connector_extra_config needs "url" (e.g. "kv://host:7480")')
        if not isinstance(salt, str):
            raise ConfigError(f"salt must be a string, got {salt!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ConfigError(f"chunk_bytes must be a non-negative integer, got {chunk!r}")
        return cls(url=url, salt=salt, chunk_bytes=chunk)


def ec_namespace(vllm_config: Any, salt: str) -> Namespace:
    """The namespace of a model's encoder outputs.

    It covers what changes an encoder's output for the same item: the model, its revision and
    dtype, its quantization and its whole HF config (vision tower and projector included), plus
    the deployment salt. Tensor parallelism is left out: every rank holds the whole output, so
    a producer and a consumer of different TP sizes share entries.
    """
    model = vllm_config.model_config
    described = {k: v for k, v in model.hf_config.to_dict().items() if k not in _NOT_ENCODER}
    described["quantization"] = model.quantization
    # Canonical JSON (sorted at every level), so equal configs hash alike in every process.
    text = json.dumps(described, sort_keys=True, default=str)
    digest = blake3.blake3(text.encode()).hexdigest()[:32]
    dtype = str(model.dtype).removeprefix("torch.")
    return Namespace(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=dtype if dtype in ("bfloat16", "float16", "float32") else "uint8",
        hash_algo=f"vllm-ec/{_VERSION}",
        salt=f"{salt}|encoder={digest}",
    )


@dataclass
class ECStats:
    """What one connector instance did (counters only ever grow)."""

    lookups: int = 0  # store round trips asking which items exist
    hits: int = 0  # entries read and verified whole
    misses: int = 0  # entries absent, half-evicted, damaged or unreadable
    saved: int = 0  # entries written
    save_failures: int = 0  # entries a save could not write (store full or unreachable)
    chunks_saved: int = 0  # values written for entries split into chunks


@dataclass(frozen=True)
class _Manifest:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    n_chunks: int  # 0: the payload follows the manifest in the same value
    chunk_bytes: int
    nonce: bytes


def _pack_manifest(m: _Manifest) -> bytes:
    name = str(m.dtype).removeprefix("torch.").encode()
    head = _MANIFEST.pack(
        _MAGIC, _VERSION, len(m.shape), len(name), m.n_chunks, m.chunk_bytes, m.nbytes, m.nonce
    )
    return head + name + struct.pack(f"<{len(m.shape)}Q", *m.shape)


def _unpack_manifest(value: bytes) -> tuple[_Manifest, memoryview] | None:
    """The manifest and its inline payload; None for anything this version did not write."""
    if len(value) < _MANIFEST.size:
        return None
    magic, version, ndim, name_len, n_chunks, chunk, nbytes, nonce = _MANIFEST.unpack_from(value)
    if magic != _MAGIC or version != _VERSION or ndim > _MAX_NDIM:
        return None
    at = _MANIFEST.size
    dtype = _DTYPES.get(bytes(value[at : at + name_len]).decode("ascii", "replace"))
    at += name_len
    if dtype is None or len(value) < at + 8 * ndim:
        return None
    shape = struct.unpack_from(f"<{ndim}Q", value, at)
    at += 8 * ndim
    itemsize = torch.empty((), dtype=dtype).element_size()
    inline = memoryview(value)[at:]
    if math.prod(shape) * itemsize != nbytes:
        return None
    if n_chunks == 0 and len(inline) != nbytes:
        return None
    if n_chunks and (chunk == 0 or n_chunks != -(-nbytes // chunk) or len(inline)):
        return None
    return _Manifest(dtype, tuple(shape), nbytes, n_chunks, chunk, nonce), inline


class EncoderOutputStore:
    """Encoder outputs in a kvoffload store, keyed by vLLM's item identifiers.

    Thread-safe as far as the client is (counters are locked): the connector saves from a
    background thread while its scheduler side reads.
    """

    def __init__(self, client: Client, namespace: Namespace, chunk_bytes: int = 0) -> None:
        self._client = client
        self._ns = namespace
        # The store's limit covers its block header too (96 bytes; the wire layer that defines
        # it is not the connectors' to import), so leave room for any header size.
        largest = client.transport.max_value_bytes - _HEADER_ROOM
        self._chunk = min(chunk_bytes, largest) if chunk_bytes > 0 else largest
        self._largest = largest
        self._lock = threading.Lock()
        self._stats = ECStats()

    def stats(self) -> ECStats:
        with self._lock:
            return ECStats(**vars(self._stats))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def manifest_key(self, identifier: str) -> bytes:
        # "m" and "c" prefixes keep manifest and chunk names apart whatever the identifier is.
        return engine_hashes(self._ns, [b"m\0" + identifier.encode()])[0]

    def _chunk_keys(self, nonce: bytes, n: int) -> list[BlockHash]:
        return engine_hashes(self._ns, [b"c\0" + nonce + i.to_bytes(4, "little") for i in range(n)])

    def entry_keys(self, identifier: str) -> list[bytes]:
        """The store keys of an entry: its manifest's, then its chunks' (none when the payload
        is inline or the manifest cannot be read) — for tools that inspect or drop entries."""
        key = self.manifest_key(identifier)
        value = self._client.get(key)
        opened = _unpack_manifest(value) if value is not None else None
        if opened is None:
            return [key]
        return [key, *self._chunk_keys(opened[0].nonce, opened[0].n_chunks)]

    def present(self, identifiers: Sequence[str]) -> list[bool]:
        """Which entries the store has a manifest of, in as few lookups as it allows (one when
        all are there; each absent one costs a lookup of the rest). A store that cannot be
        reached answers "absent"."""
        keys = [self.manifest_key(i) for i in identifiers]
        found: list[bool] = []
        while len(found) < len(keys):
            self._count(lookups=1)
            try:
                n = self._client.lookup(keys[len(found) :])
            except KVOffloadError as exc:  # a store error is "absent", never a crash
                log.warning("encoder output lookup failed (%s); treated as absent", exc)
                return found + [False] * (len(keys) - len(found))
            found += [True] * n
            if len(found) < len(keys):
                found.append(False)
        return found

    def save(self, identifier: str, output: torch.Tensor) -> bool:
        """Store a CPU tensor (any dtype and shape this module knows); False if the store could
        not take it (full, unreachable): a later read is then a miss.

        Raises:
            InvalidArgumentError: a dtype or rank the manifest cannot describe.
        """
        name = str(output.dtype).removeprefix("torch.")
        if name not in _DTYPES or output.dim() > _MAX_NDIM:
            raise InvalidArgumentError(
                f"cannot store a {output.dim()}-d {name} encoder output "
                f"(dtypes: {sorted(_DTYPES)}, at most {_MAX_NDIM} dimensions)"
            )
        raw = output.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        nonce = os.urandom(16)
        head = _Manifest(output.dtype, tuple(output.shape), nbytes, 0, 0, nonce)
        try:
            if nbytes <= self._chunk and len(_pack_manifest(head)) + nbytes <= self._largest:
                value = _pack_manifest(head) + raw.numpy().tobytes()
                self._client.put(self.manifest_key(identifier), value)
                self._count(saved=1)
                return True
            n = -(-nbytes // self._chunk)
            keys = self._chunk_keys(nonce, n)
            parts = [raw[i * self._chunk : (i + 1) * self._chunk] for i in range(n)]
            # Chunks first: a reader that finds the manifest finds every chunk (or a miss).
            self._client.put_many(zip(keys, parts, strict=True))
            manifest = _Manifest(output.dtype, tuple(output.shape), nbytes, n, self._chunk, nonce)
            self._client.put(self.manifest_key(identifier), _pack_manifest(manifest))
        except KVOffloadError as exc:  # full, unreachable, refused: a later miss, not an error
            log.warning("encoder output %s not saved: %s", identifier, exc)
            self._count(save_failures=1)
            return False
        self._count(saved=1, chunks_saved=n)
        return True

    def load(self, identifier: str) -> torch.Tensor | None:
        """The verified CPU tensor stored for `identifier` with its dtype and shape, or None:
        absent, a chunk evicted or damaged, a manifest this version did not write, or a store
        that cannot be reached."""
        try:
            value = self._client.get(self.manifest_key(identifier))
            opened = _unpack_manifest(value) if value is not None else None
            if opened is None:
                if value is not None:
                    log.warning("encoder output %s: unreadable manifest; a miss", identifier)
                self._count(misses=1)
                return None
            manifest, inline = opened
            out = torch.empty(manifest.nbytes, dtype=torch.uint8)
            if manifest.n_chunks == 0:
                out.numpy()[:] = np.frombuffer(inline, dtype=np.uint8)
            else:
                keys = self._chunk_keys(manifest.nonce, manifest.n_chunks)
                size = manifest.chunk_bytes
                views = [out[i * size : (i + 1) * size] for i in range(manifest.n_chunks)]
                got = self._client.get_many_into(keys, views)
                expected = [v.numel() for v in views]
                if got != expected:
                    self._count(misses=1)
                    return None
        except KVOffloadError as exc:
            # Unreachable, a store error, a chunk larger than its manifest says: a miss either
            # way (raising here would end vLLM's scheduler).
            log.warning("encoder output %s not loaded (%s); a miss", identifier, exc)
            self._count(misses=1)
            return None
        self._count(hits=1)
        return out.view(manifest.dtype).reshape(manifest.shape)

    def close(self) -> None:
        self._client.close()


@dataclass
class KVOffloadECMetadata(ECConnectorMetadata):
    """One step's verified encoder outputs, by identifier, for the workers to install."""

    loads: dict[str, torch.Tensor] = field(default_factory=dict)


class KVOffloadECConnector(ECConnectorBase):
    """Encoder outputs in a kvoffload store, for vLLM 0.33.0 (and 0.32.0).

    Load it with ``--ec-transfer-config '{"ec_connector":"KVOffloadECConnector",
    "ec_connector_module_path":"kvoffload.connectors.vllm","ec_role":"ec_producer",
    "ec_connector_extra_config":{"url":"kv://host:7480"}}'`` on encoder instances and
    ``"ec_role":"ec_consumer"`` on prefill instances (``ec_both`` does both).

    Raises:
        ConfigError: bad extra config.
    """

    namespace: Namespace

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        settings = ECSettings.from_extra_config(
            vllm_config.ec_transfer_config.ec_connector_extra_config or {}
        )
        self.namespace = ec_namespace(vllm_config, settings.salt)
        self._store: EncoderOutputStore | None = None
        # Only one worker writes: every tensor-parallel rank computes the same output.
        needs_store = role == ECConnectorRole.SCHEDULER or (
            self.is_producer and _compat.tensor_parallel_rank() == 0
        )
        if needs_store:
            client = Client.connect(settings.url, namespace=self.namespace)
            self._store = EncoderOutputStore(client, self.namespace, settings.chunk_bytes)
        # Scheduler side: per step, what the store was found to hold, the verified outputs
        # `has_cache_item` read, and those vLLM allocated (this step's loads).
        self._present: dict[str, bool] = {}
        self._verified: dict[str, torch.Tensor] = {}
        self._loads: dict[str, torch.Tensor] = {}
        # Worker side: saves of this step still in flight.
        self._saver: ThreadPoolExecutor | None = None
        self._pending: list[Future[bool]] = []
        self._device = _worker_device() if role == ECConnectorRole.WORKER else "cpu"

    @property
    def store(self) -> EncoderOutputStore | None:
        """The store this instance reads or writes (None on a consumer's workers, which only
        install what the scheduler side read)."""
        return self._store

    def stats(self) -> ECStats:
        """This instance's counters (all zero where it has no store)."""
        return self._store.stats() if self._store is not None else ECStats()

    # -- scheduler side -------------------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Ask the store once which of a request's items it holds (never defers it)."""
        features = request.mm_features or ()
        ids = [f.identifier for f in features if f.identifier not in self._present]
        if ids and self._store is not None:
            self._present.update(zip(ids, self._store.present(ids), strict=True))
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """A consumer: whether the store holds the item whole and verified (it is read now and
        sent with this step). A producer only: whether it is stored, so it is not encoded
        again."""
        store = self._store
        if store is None:
            return False
        if identifier in self._verified:
            return True
        if not self._present.get(identifier, True):
            return False  # ruled out by this step's batched lookup
        if not self.is_consumer:
            found = self._present.get(identifier)
            return found if found is not None else store.present([identifier])[0]
        output = store.load(identifier)
        self._present[identifier] = output is not None
        if output is None:
            return False
        self._verified[identifier] = output
        return True

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        identifier = request.mm_features[index].identifier
        output = self._verified.get(identifier)
        if output is not None and self.is_consumer:
            self._loads[identifier] = output

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadECMetadata:
        """This step's verified loads. What was read for requests vLLM did not schedule is
        dropped (it is read again when they are), and existence answers expire with the step:
        a producer may store an item at any moment."""
        meta = KVOffloadECMetadata(loads=self._loads)
        self._loads = {}
        self._verified.clear()
        self._present.clear()
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # Saves land within the step that computed them: nothing is left to wait for here.
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Install this step's outputs; they were verified before vLLM scheduled them, so
        every one is in `encoder_cache` when this returns."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVOffloadECMetadata)
        for identifier, output in meta.loads.items():
            if identifier not in encoder_cache:
                encoder_cache[identifier] = output.to(self._device)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Start saving a freshly computed output; the step waits for it in `get_finished`."""
        store = self._store
        if store is None or not self.is_producer:
            return
        # A host copy now: the device tensor may be freed or reused once the step ends.
        output = encoder_cache[mm_hash].detach().to("cpu")
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-ec-save")
        self._pending.append(self._saver.submit(store.save, mm_hash, output))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """End of the step: wait until its saves have landed (none is left for later)."""
        self._wait_for_saves()
        return None, None

    def _wait_for_saves(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except KVOffloadError as exc:  # an output the manifest cannot describe
                log.warning("encoder output not saved: %s", exc)

    def shutdown(self) -> None:
        self._wait_for_saves()
        if self._saver is not None:
            self._saver.shutdown()
        if self._store is not None:
            self._store.close()


def _worker_device() -> str:
    """Where vLLM keeps this worker's encoder outputs."""
    from vllm.platforms import current_platform

    device = str(current_platform.device_type) or "cpu"
    if current_platform.is_cuda_alike():
        device = f"{device}:{torch.cuda.current_device()}"
    return device
