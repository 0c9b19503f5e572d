from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.client_sdk import Namespace, block_hashes, block_keys, engine_hashes, engine_keys
from kvoffload.errors import InvalidArgumentError

NS = Namespace(
    "org/model", dtype="bfloat16", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8
)
# NS.fingerprint as computed before Namespace had a codec field (commit 23f3dea).
GOLDEN_FINGERPRINT = "cf81f3ab09f3922bc04e035bbe710184"


def test_one_key_per_full_block_and_16_bytes() -> None:
    keys = block_keys(NS, list(range(11)))
    assert len(keys) == 2  # the partial tail block gets no key
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 2


def test_keys_chain_on_their_prefix() -> None:
    a = block_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = block_keys(NS, [9, 9, 9, 9, 5, 6, 7, 8])
    assert a[1] != b[1]  # same block tokens, different prefix
    # Continuing a chain from its parent equals hashing the whole sequence.
    assert block_keys(NS, [5, 6, 7, 8], parent=a[0]) == a[1:]
    assert block_keys(NS, list(range(8)))[:1] == block_keys(NS, list(range(4)))


def test_input_forms_agree() -> None:
    ids = list(range(100, 116))
    expected = block_keys(NS, ids)
    assert block_keys(NS, np.array(ids, dtype=np.int64)) == expected
    assert block_keys(NS, np.array(ids, dtype=np.uint32)) == expected
    torch = pytest.importorskip("torch")
    assert block_keys(NS, torch.tensor(ids)) == expected


def test_extra_keys_and_namespace_change_keys() -> None:
    ids = list(range(8))
    base = block_keys(NS, ids)
    assert block_keys(NS, ids, extra_keys=["lora-a"]) != base
    assert block_keys(NS, ids, extra_keys=["lora-a"]) != block_keys(NS, ids, extra_keys=["lora-b"])
    assert block_keys(NS, ids, extra_keys=[b"x"]) != block_keys(NS, ids, extra_keys=["x"])
    for f in dataclasses.fields(Namespace):
        if f.name == "model":
            changed = dataclasses.replace(NS, model="other/model")
        elif f.type in ("int", int):
            value = getattr(NS, f.name)
            changed = (
                dataclasses.replace(NS, **{f.name: value + 1})
                if f.name != "tp_rank"
                else dataclasses.replace(NS, tp_rank=1, tp_size=2)
            )
        elif f.name == "dtype":
            changed = dataclasses.replace(NS, dtype="float16")
        elif f.name == "codec":
            changed = dataclasses.replace(NS, codec="fp8")  # lossy; lossless: see below
        else:
            changed = dataclasses.replace(NS, **{f.name: "x"})
        assert changed.fingerprint != NS.fingerprint, f.name
        assert block_keys(changed, ids) != base, f.name


def test_hashes_are_full_digests_of_keys() -> None:
    hashes = block_hashes(NS, list(range(8)))
    assert [h[:16] for h in hashes] == block_keys(NS, list(range(8)))
    assert all(len(h) == 32 for h in hashes)


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [[1, 2], [3, 4]], [0.5] * 4])
def test_bad_token_ids(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        block_keys(NS, bad)  # type: ignore[arg-type]


def test_bad_namespace_and_parent() -> None:
    with pytest.raises(InvalidArgumentError):
        Namespace("m", block_tokens=0)
    with pytest.raises(InvalidArgumentError):
        Namespace("m", tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgumentError):
        Namespace("m", dtype="complex64")
    with pytest.raises(InvalidArgumentError):
        block_keys(NS, list(range(4)), parent=b"short")
    with pytest.raises(InvalidArgumentError):
        block_keys(NS, list(range(4)), extra_keys=[1.5])  # type: ignore[list-item]


def test_sizes_follow_the_shape() -> None:
    assert NS.bytes_per_token == 2 * 2 * 2 * 8 * 2
    assert NS.block_bytes == NS.bytes_per_token * 4
    smol = Namespace("smollm2", num_layers=30, num_kv_heads=3, head_size=64)
    assert smol.bytes_per_token == 23_040


SCRIPT = """
import json
from kvoffload.client_sdk import Namespace, block_keys
ns = Namespace("org/model", dtype="bfloat16", block_tokens=4, num_layers=2, num_kv_heads=2,
               head_size=8, tenant="t1")
keys = block_keys(ns, range(40), extra_keys=["a"])
print(json.dumps([ns.fingerprint.hex()] + [k.hex() for k in keys]))
"""


def test_identical_in_fresh_interpreters_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 11


def test_lossless_codecs_keep_block_identity_lossy_ones_change_it() -> None:
    ids = list(range(8))
    base = block_keys(NS, ids)
    for lossless in ("none", "zstd", "split-zstd", "lz4", "split-lz4"):
        same = dataclasses.replace(NS, codec=lossless)
        assert same.fingerprint == NS.fingerprint and block_keys(same, ids) == base, lossless
    fp8 = dataclasses.replace(NS, codec="fp8")
    int4 = dataclasses.replace(NS, codec="int4")
    assert len({NS.fingerprint, fp8.fingerprint, int4.fingerprint}) == 3
    assert fp8.lossy_codec == "fp8" and dataclasses.replace(NS, codec="zstd").lossy_codec == ""


def test_fingerprint_is_unchanged_by_the_codec_field() -> None:
    # Fingerprints of namespaces without a lossy codec must stay what they were before the
    # field existed: stored blocks and keys of existing deployments keep matching.
    assert NS.fingerprint.hex() == GOLDEN_FINGERPRINT


def test_unknown_codec_name_is_rejected_with_the_valid_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="split-zstd"):
        dataclasses.replace(NS, codec="gzip")


def test_engine_keys_are_namespaced_and_deterministic() -> None:
    vllm = Namespace("m", hash_algo="vllm:sha256")
    h = [bytes(range(32)), bytes(range(1, 33))]
    keys = engine_keys(vllm, h)
    assert keys == engine_keys(Namespace("m", hash_algo="vllm:sha256"), h)
    assert [len(k) for k in keys] == [16, 16] and keys[0] != keys[1]
    assert keys == [d[:16] for d in engine_hashes(vllm, h)]
    # Any field of the namespace (salt, rank, algorithm) separates the keys.
    for other in (
        Namespace("m", hash_algo="vllm:sha256", salt="s"),
        Namespace("m", hash_algo="vllm:sha256", tp_rank=1, tp_size=2),
        Namespace("m", hash_algo="vllm:sha256_cbor"),
    ):
        assert set(engine_keys(other, h)).isdisjoint(keys)
    # Length-prefixed: concatenating two names does not collide with another split.
    assert engine_keys(vllm, [b"ab", b"c"]) != engine_keys(vllm, [b"a", b"bc"])


def test_engine_keys_refuse_token_namespaces_and_bad_hashes() -> None:
    with pytest.raises(InvalidArgumentError):
        engine_keys(Namespace("m"), [bytes(32)])
    for bad in (b"", "abc", 5):
        with pytest.raises(InvalidArgumentError):
            engine_keys(Namespace("m", hash_algo="x"), [bad])  # type: ignore[list-item]
