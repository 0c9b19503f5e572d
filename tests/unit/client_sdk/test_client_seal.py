"""The keyed seal in the SDK: keys from the argument, a key file or the environment; sealed
puts; every read path of an embedded store (get, get_into, get_many, get_many_into, async)
refusing forged, retired, foreign and, when required, unsealed blocks as counted misses.
Forgeries are written straight into the engine, as a rogue node or target would store them.
The same checks through a real daemon are in tests/integration/test_sealed_blocks.py."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvoffload.client_sdk import AsyncClient, Client, Namespace, SealKeys
from kvoffload.client_sdk.seal import ENV_FILE, ENV_KEYS, ENV_REQUIRED
from kvoffload.client_sdk.transports.base import ThreadedAsyncTransport
from kvoffload.client_sdk.transports.local import LocalTransport
from kvoffload.errors import ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
from kvoffload.wire.block import seal

NS = Namespace("org/model", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8)
K1, K2, STRANGER = (bytes([i]) * 32 for i in (1, 2, 3))


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(EngineConfig(DramConfig(capacity_bytes=8 << 20, prefault=False))) as e:
        yield e


def client(engine: Engine, seal_keys: SealKeys | None) -> Client:
    return Client(LocalTransport(engine, owned=False), namespace=NS, seal=seal_keys)


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, NS.block_bytes, dtype=np.uint8)


def forge(
    engine: Engine, key: bytes, payload: bytes, mac_key: tuple[int, bytes] | None = None
) -> None:
    """A well-formed block nobody with the tenant's keys wrote: CRC-only, or sealed with
    `mac_key`."""
    header = seal(
        key_or_hash=key,
        payload=payload,
        stored_length=len(payload),
        raw_length=len(payload),
        namespace=NS.fingerprint,
        mac_key=mac_key,
    )
    engine.put(key, np.frombuffer(header + payload, np.uint8))


def reads(c: Client, key: bytes) -> list[object]:
    """What every read path of the client returns for `key`."""
    out = np.full(NS.block_bytes, 0xAB, np.uint8)
    many = [np.full(NS.block_bytes, 0xAB, np.uint8)]
    got = [c.get(key), c.get_into(key, out), c.get_many([key])[0], c.get_many_into([key], many)[0]]
    assert (out == 0xAB).all() and (many[0] == 0xAB).all()  # no byte of it reached a buffer
    return got


def test_sealed_puts_round_trip_on_every_read_path(engine: Engine) -> None:
    c = client(engine, SealKeys([(1, K1)]))
    key = os.urandom(16)
    c.put(key, value(0))
    stored = engine.get(key)
    assert stored is not None
    assert int.from_bytes(stored.data[4:6], "little") == 2  # the sealed header version
    assert int.from_bytes(stored.data[76:80], "little") == 1  # its key id
    stored.release()
    out = np.empty(NS.block_bytes, np.uint8)
    assert c.get(key) == value(0).tobytes()
    assert c.get_into(key, out) == NS.block_bytes and np.array_equal(out, value(0))
    assert c.get_many([key]) == [value(0).tobytes()]
    assert c.stats().corrupt_blocks == 0


@pytest.mark.parametrize(
    "mac_key", [None, (1, STRANGER), (9, STRANGER)], ids=["crc-only", "wrong-mac", "foreign-id"]
)
def test_a_forged_block_is_a_counted_miss_on_every_read_path(
    engine: Engine, mac_key: tuple[int, bytes] | None
) -> None:
    c = client(engine, SealKeys([(1, K1)]))
    key = os.urandom(16)
    forge(engine, key, value(5).tobytes(), mac_key)
    assert reads(c, key) == [None, None, None, None]
    assert c.stats().corrupt_blocks == 4


def test_a_client_without_keys_cannot_read_sealed_blocks(engine: Engine) -> None:
    key = os.urandom(16)
    client(engine, SealKeys([(1, K1)])).put(key, value(1))
    plain = client(engine, None)
    assert reads(plain, key) == [None, None, None, None]
    assert plain.stats().corrupt_blocks == 4


def test_rotation_reads_old_keys_until_they_are_retired(engine: Engine) -> None:
    old_key, new_key = os.urandom(16), os.urandom(16)
    client(engine, SealKeys([(1, K1)])).put(old_key, value(1))
    rotated = client(engine, SealKeys([(2, K2), (1, K1)]))  # the new key seals, both open
    rotated.put(new_key, value(2))
    stored = engine.get(new_key)
    assert stored is not None and int.from_bytes(stored.data[76:80], "little") == 2
    stored.release()
    assert rotated.get(old_key) == value(1).tobytes()
    assert rotated.get(new_key) == value(2).tobytes()
    retired = client(engine, SealKeys([(2, K2)]))  # key 1 dropped: its blocks are misses
    assert retired.get(new_key) == value(2).tobytes()
    assert reads(retired, old_key) == [None, None, None, None]
    assert retired.stats().corrupt_blocks == 4


def test_unsealed_blocks_are_read_only_when_the_seal_is_not_required(engine: Engine) -> None:
    key = os.urandom(16)
    client(engine, None).put(key, value(3))  # written before the store was sealed
    migrating = client(engine, SealKeys([(1, K1)], required=False))
    out = np.empty(NS.block_bytes, np.uint8)
    assert migrating.get(key) == value(3).tobytes()
    assert migrating.get_into(key, out) == NS.block_bytes and np.array_equal(out, value(3))
    strict = client(engine, SealKeys([(1, K1)]))
    assert reads(strict, key) == [None, None, None, None]


def test_the_async_client_checks_the_seal_too(engine: Engine) -> None:
    key, forged = os.urandom(16), os.urandom(16)
    forge(engine, forged, value(4).tobytes(), (1, STRANGER))
    keys = SealKeys([(1, K1)])

    async def main() -> list[object]:
        transport = ThreadedAsyncTransport(LocalTransport(engine, owned=False))
        async with AsyncClient(transport, namespace=NS, seal=keys) as c:
            await c.put(key, value(4))
            out = np.empty(NS.block_bytes, np.uint8)
            return [await c.get(key), await c.get(forged), await c.get_into(forged, out)]

    assert asyncio.run(main()) == [value(4).tobytes(), None, None]


# ------------------------------------------------------------------ where keys come from
def test_keys_parse_from_a_key_file_and_the_environment(tmp_path: Path) -> None:
    text = f"# rotated 2026-12\n2 {K2.hex()}\n1 {K1.hex()}  # retire after 2027-01\n"
    path = tmp_path / "seal.keys"
    path.write_text(text)
    from_file = SealKeys.from_file(path)
    assert from_file.current == (2, K2) and dict(from_file.keys) == {2: K2, 1: K1}
    assert from_file.required
    inline = SealKeys.from_env({ENV_KEYS: f"2:{K2.hex()}, 1:{K1.hex()}", ENV_REQUIRED: "0"})
    assert inline is not None and inline.current == (2, K2) and not inline.required
    by_path = SealKeys.from_env({ENV_FILE: str(path)})
    assert by_path is not None and dict(by_path.keys) == {2: K2, 1: K1}
    assert SealKeys.from_env({}) is None


def test_a_key_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "seal.keys"
    path.write_text(f"1 {K1.hex()}\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        SealKeys.from_file(path)
    assert "chmod 600" not in caplog.text
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        SealKeys.from_file(path)
    assert "accessible to group or others (mode 644)" in caplog.text
    assert K1.hex() not in caplog.text


def test_the_environment_reaches_clients_made_without_keys(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = os.urandom(16)
    monkeypatch.setenv(ENV_KEYS, f"1 {K1.hex()}")
    client(engine, None).put(key, value(6))  # what a connector's Client.connect does
    monkeypatch.delenv(ENV_KEYS)
    assert client(engine, SealKeys([(1, K1)])).get(key) == value(6).tobytes()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no key"),
        (f"1 {K1.hex()[:-2]}", "line 1"),
        (f"x {K1.hex()}", "line 1"),
        (f"1 {K1.hex()}\n1 {K2.hex()}", "listed twice"),
        (f"{1 << 32} {K1.hex()}", "not in 0.."),
        (f"1 {K1.hex()[:-1]}g", "line 1"),
    ],
)
def test_malformed_keys_are_config_errors_that_do_not_echo_the_key(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as caught:
        SealKeys.parse(text)
    assert K1.hex()[:16] not in str(caught.value)


def test_bad_environment_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        SealKeys.from_env({ENV_KEYS: f"1 {K1.hex()}", ENV_FILE: "/x"})
    with pytest.raises(ConfigError, match="0 or 1"):
        SealKeys.from_env({ENV_KEYS: f"1 {K1.hex()}", ENV_REQUIRED: "yes"})
    with pytest.raises(ConfigError, match="seal key file"):
        SealKeys.from_env({ENV_FILE: str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="32 bytes"):
        SealKeys([(1, b"short")])


def test_keys_stay_out_of_reprs_and_logs(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    keys = SealKeys([(2, K2), (1, K1)])
    assert repr(keys) == "SealKeys(current=2, ids=[1, 2], required=True)"
    c = client(engine, keys)
    key = os.urandom(16)
    forge(engine, key, value(7).tobytes(), (1, STRANGER))
    with caplog.at_level(logging.DEBUG):
        assert c.get(key) is None
    assert "seal mismatch" in caplog.text
    for secret in (K1, K2):
        for form in (secret.hex(), repr(secret)[2:20]):
            assert form not in caplog.text and form not in repr(c) and form not in repr(keys)
