"""The backend's keys of SGLang's extra config, and the namespaces its pages are stored under."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvoffload.client_sdk import Namespace
from kvoffload.client_sdk.keys import DTYPE_BYTES
from kvoffload.errors import ConfigError, InvalidArgumentError

__all__ = ["STATE_POOLS", "Settings", "page_namespace", "pool_namespace"]

# Keys of the extra config that SGLang itself reads.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})

# Pools that hold a recurrent or compressor state rather than attention KV: a state is the
# sum of every earlier token, so a quantisation error in it compounds over all later tokens.
STATE_POOLS = frozenset(
    {"mamba", "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state", "deepseek_v4_c128_state"}
)


@dataclass(frozen=True)
class Settings:
    """Our keys of ``--hicache-storage-backend-extra-config``."""

    # The store, e.g. kv://127.0.0.1:7480.
    url: str = ""
    # Deployment salt mixed into every key.
    salt: str = ""
    # Concurrent page reads per batch.
    io_threads: int = 8
    # Codec every pool's pages are written with ("" = none); lossless only.
    codec: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> Settings:
        """Raises: ConfigError for an unknown key, a missing url or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - _SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown HiCache extra config key(s) {unknown}; kvoffload reads "
                f"{sorted(known)}, SGLang reads {sorted(_SGLANG_KEYS)}"
            )
        url, salt, threads = extra.get("url", ""), extra.get("salt", ""), extra.get("io_threads", 8)
        codec = extra.get("codec", "")
        if not isinstance(url, str) or not url:
            raise ConfigError('the HiCache extra config needs "url" (e.g. "kv://host:7480")')
        if not isinstance(salt, str):
            raise ConfigError("salt must be a string")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
            raise ConfigError("io_threads must be a positive integer")
        if not isinstance(codec, str):
            raise ConfigError("codec must be a string naming a lossless codec")
        _check_codec(codec)
        return cls(url=url, salt=salt, io_threads=threads, codec=codec)


def _check_codec(codec: str) -> None:
    """Raises: ConfigError for an unknown or a lossy codec."""
    if not codec:
        return
    try:
        lossy = Namespace(model="codec-check", codec=codec).lossy_codec
    except InvalidArgumentError as exc:
        raise ConfigError(f"HiCache extra config: {exc}") from None
    if lossy:
        raise ConfigError(
            f"codec {codec!r} is lossy and refused: hybrid models' MAMBA (recurrent state) pages "
            "must come back bit-exact, since an error in a state compounds over every later "
            "token, and SGLang's KV pages are stored as the parts its host pool reports, not "
            "the whole [layer][k/v][head][token][dim] blocks the lossy codecs quantise; use "
            "none, lz4, zstd, split-lz4 or split-zstd"
        )


def _dtype(value: Any) -> str:
    return str(value).removeprefix("torch.")


def page_namespace(
    config: HiCacheStorageConfig, pool: Any, parts: int, salt: str, codec: str = ""
) -> Namespace:
    """The namespace of this rank's KV pages (the v1 and generic interfaces): everything that
    changes a page's bytes."""
    dtype = _dtype(pool.dtype)
    mla = bool(config.is_mla_model)
    layout = (
        f"sglang:{type(pool).__name__}:{pool.layout}:parts={parts}:dtype={dtype}"
        f":pp={config.pp_rank}/{config.pp_size}:cp={config.attn_cp_rank}/{config.attn_cp_size}"
        f":dcp={config.dcp_rank}/{config.dcp_size}"
    )
    return Namespace(
        model=config.model_name or "unknown",
        dtype=dtype if dtype in DTYPE_BYTES else "uint8",
        block_tokens=int(pool.page_size),
        num_layers=int(pool.layer_num),
        num_kv_heads=int(getattr(pool, "head_num", 1)),
        head_size=int(getattr(pool, "head_dim", 0) or getattr(pool, "kv_cache_dim", 1)),
        layout=layout,
        # MLA pages are the same on every TP rank: all ranks share one copy.
        tp_rank=0 if mla else int(config.tp_rank),
        tp_size=1 if mla else int(config.tp_size),
        hash_algo="sglang:sha256",
        salt=salt,
        codec=codec,
    )


# Host pool attributes that describe a page's bytes (whichever a pool has); its capacity and
# addresses are left out, they differ between engines that share pages.
_GEOMETRY = (
    "layout", "page_size", "dtype", "layer_num", "head_num", "head_dim", "kv_lora_rank",
    "qk_rope_head_dim", "num_mamba_layers", "temporal_dtype", "conv_dtype",
    "temporal_state_shape", "conv_state_shapes", "size_per_token",
)  # fmt: skip


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):  # shapes (torch.Size is a tuple) and lists of them
        return "(" + ",".join(_text(v) for v in value) + ")"
    return _dtype(value)


def _geometry(pool: Any) -> str:
    return ",".join(
        f"{name}={_text(getattr(pool, name))}"
        for name in _GEOMETRY
        if getattr(pool, name, None) is not None
    )


def pool_namespace(
    config: HiCacheStorageConfig,
    name: str,
    pool: Any,
    part_sizes: list[int],
    zero_copy: bool,
    settings: Settings,
) -> Namespace:
    """The namespace of one v2 pool's pages: the pool kind, its host pool's geometry (dtypes,
    shapes, page size), how a page is cut into parts and this rank's shard, so a page of
    another pool or layout is never read as this one's."""
    dtypes = {_dtype(getattr(pool, a)) for a in ("dtype", "temporal_dtype", "conv_dtype")
              if getattr(pool, a, None) is not None}  # fmt: skip
    dtype = dtypes.pop() if len(dtypes) == 1 else "uint8"
    # A recurrent state is split across TP ranks even where the KV is not (MLA).
    shared = bool(config.is_mla_model) and name not in STATE_POOLS
    layout = (
        f"sglang:v2:{name}:{type(pool).__name__}:{'parts' if zero_copy else 'flat'}"
        f"={'/'.join(map(str, part_sizes))}:{_geometry(pool)}"
        f":pp={config.pp_rank}/{config.pp_size}:cp={config.attn_cp_rank}/{config.attn_cp_size}"
        f":dcp={config.dcp_rank}/{config.dcp_size}"
    )
    layers = getattr(pool, "layer_num", None) or getattr(pool, "num_mamba_layers", None) or 1
    return Namespace(
        model=config.model_name or "unknown",
        dtype=dtype if dtype in DTYPE_BYTES else "uint8",
        block_tokens=int(getattr(pool, "page_size", 1) or 1),
        num_layers=int(layers),
        layout=layout,
        tp_rank=0 if shared else int(config.tp_rank),
        tp_size=1 if shared else int(config.tp_size),
        hash_algo="sglang:sha256",
        salt=settings.salt,
        codec=settings.codec,
    )
