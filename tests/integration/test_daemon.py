"""`kvoffload serve` as a real process, driven through the SDK (sync and async)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgpack
import numpy as np
import pytest
import zmq
from probes import pinned, settled

from kvoffload.client_sdk import AsyncClient, Client, Namespace, block_keys
from kvoffload.core import io_uring_unavailable
from kvoffload.errors import (
    AuthError,
    DeadlineExceededError,
    InvalidArgumentError,
    TransportError,
)
from kvoffload.wire.native.connection import Get, Hello, NativeConnection, Role, Welcome

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = Namespace("org/model", block_tokens=4, num_layers=2, num_kv_heads=2, head_size=8)
Start = Callable[..., Any]  # the `start_daemon` fixture (conftest.py) -> Daemon
UNAVAILABLE = io_uring_unavailable()


def _blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def test_serve_starts_with_no_arguments(start_daemon: Start, tmp_path: Path) -> None:
    # Only the ports move (tests never take fixed ports); everything else is the default.
    env = {
        "HOME": str(tmp_path),
        "KVOFFLOAD_NATIVE__PORT": "0",
        "KVOFFLOAD_NVME__PORT": "0",
        "KVOFFLOAD_METRICS__PORT": "0",
    }
    daemon = start_daemon(defaults=False, env=env)
    with Client.connect(daemon.url()) as client:
        client.put(bytes(16), b"hello")
        assert client.get(bytes(16)) == b"hello"
        dram, ssd = client.stats().store["tiers"]  # type: ignore[misc]
        assert dram["capacity_bytes"] == 1 << 30 and ssd["capacity_bytes"] > (4 << 30) - (
            65 << 20
        )  # whole slabs
    assert daemon.stop() == 0
    assert "kvoffload: stopped" in daemon.lines
    store = tmp_path / ".local" / "share" / "kvoffload"
    assert (store / "kvoffload.meta").exists()  # the default data directory holds the store
    shutil.rmtree(store)  # 4 GiB of preallocated slots


def test_sync_client_round_trips_everything(start_daemon: Start) -> None:
    daemon = start_daemon()
    keys = block_keys(NS, list(range(64)))
    blocks = _blocks(len(keys), NS.block_bytes)
    with Client.connect(daemon.url(), namespace=NS) as client:
        client.put(keys[0], blocks[0])
        client.put_many(zip(keys[1:], blocks[1:], strict=True), parents=list(keys[:-1]))
        assert client.lookup(keys) == len(keys)
        assert client.exists(keys[5]) and not client.exists(bytes(16))
        out = np.empty(NS.block_bytes, dtype=np.uint8)
        for key, block in zip(keys, blocks, strict=True):
            assert client.get_into(key, out) == NS.block_bytes
            assert np.array_equal(out, block)
        got = client.get_many([*keys[:10], bytes(16)])
        assert got[:10] == [b.tobytes() for b in blocks[:10]] and got[10] is None
        assert client.delete(keys[7]) and not client.delete(keys[7])
        assert client.lookup(keys) == 7
        assert client.get(keys[7]) is None
        assert client.prefetch(keys) == len(keys) - 1
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into(keys[0], bytearray(10))
        assert client.get(keys[0]) == blocks[0].tobytes()  # the connection is still fine
        stats = client.stats()
        assert stats.corrupt_blocks == 0 and stats.puts == len(keys)
        assert stats.store["puts"] == len(keys)


def test_large_values_and_batches_split_over_frames(start_daemon: Start) -> None:
    daemon = start_daemon("--dram", "256MiB")
    big = _blocks(12, 8 << 20, seed=1)
    keys = [i.to_bytes(16, "big") for i in range(len(big))]
    with Client.connect(daemon.url()) as client:
        client.put_many(zip(keys, big, strict=True))
        out = np.empty(8 << 20, dtype=np.uint8)
        assert client.get_into(keys[3], out) == 8 << 20 and np.array_equal(out, big[3])
        # 96 MiB of answers: more than one frame's budget, so the client asks again.
        values = client.get_many(keys)
        assert all(v == b.tobytes() for v, b in zip(values, big, strict=True))


def test_async_client_multiplexes_one_connection(start_daemon: Start) -> None:
    daemon = start_daemon()

    async def main() -> None:
        async with AsyncClient.connect(daemon.url(), namespace=NS) as client:
            keys = block_keys(NS, list(range(80)))
            blocks = _blocks(len(keys), NS.block_bytes, seed=2)
            await client.put_many(zip(keys, blocks, strict=True), parents=[None, *keys[:-1]])
            assert await client.lookup(keys) == len(keys)
            results = await asyncio.gather(*(client.get(k) for k in keys))
            assert results == [b.tobytes() for b in blocks]
            buffers = [bytearray(NS.block_bytes) for _ in keys]
            sizes = await asyncio.gather(
                *(client.get_into(k, b) for k, b in zip(keys, buffers, strict=True))
            )
            assert sizes == [NS.block_bytes] * len(keys)
            assert [bytes(b) for b in buffers] == [b.tobytes() for b in blocks]
            assert await client.exists(keys[0]) and await client.delete(keys[0])
            assert await client.get(keys[0]) is None
            assert await client.prefetch(keys) == len(keys) - 1
            assert (await client.get_many(keys[1:3]))[1] == blocks[2].tobytes()
            stats = await client.stats()
            assert stats.puts == len(keys) and stats.store["deletes"] == 1

    asyncio.run(main())


def test_concurrent_clients_each_see_their_own_writes(start_daemon: Start) -> None:
    daemon = start_daemon()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with Client.connect(daemon.url(pool="2")) as client:
                keys = [bytes([n]) * 8 + i.to_bytes(8, "big") for i in range(40)]
                values = [os.urandom(1000 + 97 * i) for i in range(40)]
                for key, value in zip(keys, values, strict=True):
                    client.put(key, value)
                for key, value in zip(keys, values, strict=True):
                    assert client.get(key) == value
                assert client.lookup(keys) == len(keys)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with Client.connect(daemon.url()) as client:
        assert client.stats().store["puts"] == 6 * 40


TENANTS = """
[tenants.alice]
token = "alice-secret"
quota_bytes = "1MiB"

[tenants.bob]
token = "bob-secret"
"""


def test_tenants_are_isolated_and_authenticated(start_daemon: Start) -> None:
    daemon = start_daemon(config=TENANTS)
    key = bytes(range(16))
    with (
        Client.connect(daemon.url(token="alice-secret")) as alice,
        Client.connect(daemon.url(token="bob-secret")) as bob,
    ):
        alice.put(key, b"alice's block")
        assert alice.get(key) == b"alice's block"
        assert bob.get(key) is None and not bob.exists(key) and bob.lookup([key]) == 0
        assert not bob.delete(key)
        bob.put(key, b"bob's block")
        assert alice.get(key) == b"alice's block" and bob.get(key) == b"bob's block"
        # Alice's quota: 1 MiB of slots. Writing 2 MiB evicts her own oldest blocks only.
        keys = [i.to_bytes(16, "big") for i in range(32)]
        for k in keys:
            alice.put(k, bytes(64 << 10))
        held = alice.stats().store["tenant_bytes"]
        assert held == {"alice": pytest.approx(held["alice"])} and held["alice"] <= 1 << 20  # type: ignore[index]
        assert alice.lookup(keys[-4:]) == 4 and alice.lookup(keys[:1]) == 0
        assert bob.get(key) == b"bob's block"
    for token in ("wrong", ""):
        with pytest.raises(AuthError):
            Client.connect(daemon.url(token=token, retries="0"))


def test_ssd_quotas_bound_a_tenants_ssd_blocks(start_daemon: Start) -> None:
    config = TENANTS.replace('quota_bytes = "1MiB"', 'ssd_quota_bytes = "2MiB"')
    daemon = start_daemon("--ssd", "64MiB", config=config)
    keys = [i.to_bytes(16, "big") for i in range(24)]
    with (
        Client.connect(daemon.url(token="alice-secret")) as alice,
        Client.connect(daemon.url(token="bob-secret")) as bob,
    ):
        bob.put(keys[0], bytes(200_000), durable=True)
        for k in keys:  # 24 durable 200 KB blocks: ~5 MB against a 2 MiB SSD quota
            alice.put(k, bytes(200_000), durable=True)
        held = alice.stats().store["ssd_tenant_bytes"]
        assert list(held) == ["alice"] and 0 < held["alice"] <= 2 << 20  # type: ignore[index]
        assert bob.get(keys[0]) == bytes(200_000)
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert 'kvoffload_tenant_ssd_bytes{tenant="alice"}' in text
    assert 'kvoffload_tenant_ssd_bytes{tenant="bob"}' in text


def test_ssd_quota_without_an_ssd_tier_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "kvoffload.toml"
    config.write_text('[tenants.alice]\ntoken = "t"\nssd_quota_bytes = "1GiB"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0"]
        + ["--metrics-port", "0", "--dram", "16MiB", "--ssd", "0", "--config", str(config)]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "tenants.alice: an SSD quota needs an SSD tier" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tls_with_a_self_signed_certificate(start_daemon: Start, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    daemon = start_daemon("--tls-cert", str(cert), "--tls-key", str(key))
    assert "native+tls" in daemon.ports
    with Client.connect(daemon.url(tls="1", ca=str(cert), server_name="localhost")) as client:
        value = os.urandom(3 << 20)
        client.put(bytes(16), value)
        assert client.get(bytes(16)) == value
        out = bytearray(3 << 20)
        assert client.get_into(bytes(16), out) == len(value) and out == value

    async def main() -> None:
        url = daemon.url(tls="1", ca=str(cert), server_name="localhost")
        async with AsyncClient.connect(url) as client:
            assert await client.get(bytes(16)) == value

    asyncio.run(main())
    # A plain-text client gets a clear error, not a hang.
    with pytest.raises((TransportError, DeadlineExceededError)):
        Client.connect(daemon.url(timeout="3", retries="0")).put(bytes(16), b"x")


def test_a_tls_client_that_stops_reading_is_flow_controlled(
    start_daemon: Start, tmp_path: Path
) -> None:
    # Ciphertext waiting for a peer that does not read counts against max_inflight_bytes: the
    # daemon stops taking that connection's Gets instead of encrypting every answer into memory.
    cert, key = _self_signed(tmp_path)
    daemon = start_daemon(
        "--tls-cert", str(cert), "--tls-key", str(key),
        config='[native]\nmax_inflight_bytes = "4MiB"\n',
    )  # fmt: skip
    gets = 300  # of a 1 MiB block: 300 MiB of answers if nothing held the daemon back
    with Client.connect(daemon.url(tls="1", ca=str(cert), server_name="localhost")) as client:
        client.put(bytes(16), os.urandom(1 << 20))
        before = cast(int, client.stats().store["gets"])
        context = ssl.create_default_context(cafile=str(cert))
        plain = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
        with context.wrap_socket(plain, server_hostname="localhost") as raw:
            conn = NativeConnection(Role.CLIENT)
            raw.sendall(conn.send(Hello(1)))
            conn.receive_data(raw.recv(65536))
            assert isinstance(conn.next_event(), Welcome)
            rss_before = daemon.rss_bytes()
            raw.sendall(b"".join(conn.send(Get(i, bytes(16))) for i in range(2, 2 + gets)))
            # ... and never reads an answer.
            served = settled(lambda: cast(int, client.stats().store["gets"]) - before, gets)
            assert served < gets / 4
            assert daemon.rss_bytes() - rss_before < 64 << 20


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_metrics_can_leave_tenant_names_out(start_daemon: Start, workers: str) -> None:
    env = {"KVOFFLOAD_METRICS__TENANT_LABELS": "false"}
    daemon = start_daemon("--workers", workers, config=TENANTS, env=env)
    with Client.connect(daemon.url(token="alice-secret")) as alice:
        alice.put(bytes(16), bytes(5000))
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert 'kvoffload_requests_total{front="native",op="put",status="ok"} 1.0' in text
    assert "alice" not in text and "bob" not in text and "kvoffload_tenant_" not in text


def test_metrics_are_scraped(start_daemon: Start) -> None:
    daemon = start_daemon()
    with Client.connect(daemon.url()) as client:
        client.put(bytes(16), bytes(5000))
        assert client.get(bytes(16)) is not None
        assert client.get(b"\x01" * 16) is None
        text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert 'kvoffload_requests_total{front="native",op="put",status="ok"} 1.0' in text
    assert 'kvoffload_requests_total{front="native",op="get",status="ok"} 2.0' in text
    assert 'kvoffload_tier_hits_total{tier="dram"} 1.0' in text
    assert 'kvoffload_tier_misses_total{tier="dram"} 1.0' in text
    assert 'kvoffload_tier_evictions_total{tier="dram"} 0.0' in text
    assert 'kvoffload_connections{front="native"} 1.0' in text
    assert 'kvoffload_request_seconds_bucket{front="native",le="10.0",op="get"} 2.0' in text
    # One stored value went in and came back out once (the miss sent nothing).
    sent_in = _sample(text, 'kvoffload_payload_bytes_in_total{front="native"}')
    sent_out = _sample(text, 'kvoffload_payload_bytes_out_total{front="native"}')
    assert sent_in == sent_out >= 5000


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no io_uring: {UNAVAILABLE}")
def test_the_io_uring_rings_registrations_are_scraped(start_daemon: Start) -> None:
    daemon = start_daemon("--ssd", "64MiB")
    with Client.connect(daemon.url()) as client:
        for i in range(4):  # a durable put writes its slot through a ring
            client.put(i.to_bytes(16, "big"), bytes(200_000), durable=True)
        text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert _sample(text, 'kvoffload_tier_io_rings{tier="ssd"}') >= 1
    assert _sample(text, 'kvoffload_tier_io_rings_with_file{tier="ssd"}') >= 1
    assert _sample(text, 'kvoffload_tier_io_fixed_file_entries_total{tier="ssd"}') >= 8
    assert _sample(text, 'kvoffload_tier_io_submissions_total{tier="ssd"}') >= 4
    assert _sample(text, 'kvoffload_tier_io_entries_total{tier="ssd"}') >= 8
    for name in ("io_rings_with_memory", "io_clone_unsupported"):
        assert _sample(text, f'kvoffload_tier_{name}{{tier="ssd"}}') >= 0
    for name in ("io_files_refused", "io_memory_refused", "io_fixed_memory_entries"):
        assert _sample(text, f'kvoffload_tier_{name}_total{{tier="ssd"}}') >= 0
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", "stats", daemon.url()],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "io_uring: " in proc.stdout and "with the slot file" in proc.stdout


def _sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_kv_events_reach_a_zmq_subscriber(start_daemon: Start) -> None:
    daemon = start_daemon("--events", "tcp://127.0.0.1:*", "--dram", "8MiB")
    assert daemon.events.startswith("tcp://127.0.0.1:")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events)
    key, parent = bytes(range(16)), bytes(16)
    with Client.connect(daemon.url()) as client:
        # PUB drops messages until the subscription has propagated: put until one arrives.
        for _ in range(100):
            client.put(key, b"v", parent=parent)
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        ts, batch, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank is None
        stored = batch[0]
        assert stored["type"] == "BlockStored" and stored["medium"] == "CPU"
        assert stored["block_hashes"] == [int.from_bytes(key[8:], "big")]
        assert stored["parent_block_hash"] == 0
        client.delete(key)
        # Evictions: 8 MiB of DRAM cannot keep 16 blocks of 900 KiB.
        for i in range(16):
            client.put(i.to_bytes(16, "big"), bytes(900 << 10))
        removed: set[int] = set()
        while sub.poll(2000) and len(removed) < 2:
            for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                if event["type"] == "BlockRemoved":
                    assert event["medium"] == "CPU"
                    removed.update(event["block_hashes"])
        assert int.from_bytes(key[8:], "big") in removed  # the delete
        assert removed - {int.from_bytes(key[8:], "big")}  # at least one eviction
    sub.close(linger=0)


def test_kv_events_follow_blocks_to_the_ssd(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--events", "tcp://127.0.0.1:*", "--dram", "8MiB", "--ssd", "64MiB",
        env={"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"},
    )  # fmt: skip
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events)
    seen: dict[tuple[str, str], set[int]] = {}
    with Client.connect(daemon.url()) as client:
        for _ in range(100):  # until the subscription has propagated
            client.put(bytes(16), b"v")
            if sub.poll(100):
                break
        for i in range(16):  # 8 MiB of DRAM cannot keep 16 blocks of 900 KiB: demotions
            client.put(i.to_bytes(16, "big"), bytes(900 << 10))
        while sub.poll(2000):
            for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                seen.setdefault((event["type"], event["medium"]), set()).update(
                    event["block_hashes"]
                )
        demoted = seen.get(("BlockStored", "STORAGE"), set())
        assert demoted and demoted <= seen[("BlockRemoved", "CPU")]
        first = 0  # block 0 went to the SSD first; reading it promotes it back to DRAM
        assert client.get((first).to_bytes(16, "big")) == bytes(900 << 10)
        promoted: set[int] = set()
        while sub.poll(2000):
            for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                if event["type"] == "BlockStored" and event["medium"] == "CPU":
                    promoted.update(event["block_hashes"])
        assert first in demoted and first in promoted
    sub.close(linger=0)


def _replay(events: list[dict[str, Any]]) -> dict[str, set[int]]:
    """Apply KV events in order to a per-medium model; a BlockRemoved must follow a
    BlockStored of the same block in the same medium."""
    held: dict[str, set[int]] = {"CPU": set(), "STORAGE": set()}
    for event in events:
        for digest in event["block_hashes"]:
            if event["type"] == "BlockStored":
                held[event["medium"]].add(digest)
            else:
                assert digest in held[event["medium"]], f"removed before stored: {event}"
                held[event["medium"]].discard(digest)
    return held


def test_kv_events_announce_durable_puts_on_the_ssd_in_order(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--events", "tcp://127.0.0.1:*", "--dram", "8MiB", "--ssd", "64MiB",
        env={"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"},
    )  # fmt: skip
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.events)
    events: list[dict[str, Any]] = []
    with Client.connect(daemon.url()) as client:
        probe = b"\xff" * 16
        for _ in range(100):  # until the subscription has propagated
            client.put(probe, b"v")
            if sub.poll(100):
                break
        client.delete(probe)
        keys = [i.to_bytes(16, "big") for i in range(16)]
        for key in keys:  # 16 durable blocks of 900 KiB through 8 MiB of DRAM
            client.put(key, bytes(900 << 10), durable=True)
        while sub.poll(2000):
            events += msgpack.unpackb(sub.recv_multipart()[2])[1]
    sub.close(linger=0)
    events = [e for e in events if int.from_bytes(probe[8:], "big") not in e["block_hashes"]]
    held = _replay(events)
    digests = [int.from_bytes(k[8:], "big") for k in keys]
    assert set(digests) <= held["STORAGE"]  # every durable put is announced on the SSD ...
    for digest in digests:  # ... before it is announced in DRAM
        mine = [(e["type"], e["medium"]) for e in events if digest in e["block_hashes"]]
        assert mine[:2] == [("BlockStored", "STORAGE"), ("BlockStored", "CPU")]
    assert held["CPU"] and held["CPU"] < set(digests)  # the oldest left DRAM


def test_a_get_many_of_ssd_blocks_is_read_in_chunks_in_key_order(start_daemon: Start) -> None:
    # The daemon serves GetMany through the engine's batched get, `ssd.read_depth` keys at a
    # time: distinct values, a depth that does not divide the batch and a missing key in the
    # middle show every block lands at its own position and nothing stays pinned.
    env = {"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1", "KVOFFLOAD_SSD__READ_DEPTH": "3"}
    daemon = start_daemon("--dram", "8MiB", "--ssd", "64MiB", env=env)
    keys = [i.to_bytes(16, "big") for i in range(14)]
    values = [np.random.default_rng(i).bytes(700 << 10) for i in range(14)]
    with Client.connect(daemon.url()) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value)
        asked = [*keys[:7], b"\xee" * 16, *keys[7:]]
        assert client.get_many(asked) == [*values[:7], None, *values[7:]]
        assert pinned(client) == 0
        outs = [bytearray(700 << 10) for _ in asked]
        assert client.get_many_into(asked, outs) == [*[700 << 10] * 7, None, *[700 << 10] * 7]
        assert [bytes(o) for o in outs[:7] + outs[8:]] == values and not any(outs[7])
        assert pinned(client) == 0


def test_a_get_many_larger_than_dram_is_served_whole(start_daemon: Start) -> None:
    # 16 blocks of 900 KiB in 8 MiB of DRAM: most live on the SSD only. A get_many of all of
    # them pins each block it reads, so the later ones find every DRAM block pinned: they are
    # read from the SSD into buffers of their own instead of failing.
    daemon = start_daemon(
        "--dram", "8MiB", "--ssd", "64MiB", env={"KVOFFLOAD_SSD__ADMISSION_MIN_USES": "1"}
    )
    keys = [i.to_bytes(16, "big") for i in range(16)]
    with Client.connect(daemon.url()) as client:
        for key in keys:
            client.put(key, bytes(900 << 10))
        assert client.get_many(keys) == [bytes(900 << 10)] * len(keys)
        assert pinned(client) == 0  # every view the batch took was released
        for key in keys[:4]:  # ... so DRAM has room to promote blocks again
            assert client.get(key) == bytes(900 << 10)


def test_a_dead_daemon_gives_misses_and_clear_errors(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Client.connect(f"kv://127.0.0.1:{port}?timeout=5&retries=2&backoff=0.01") as client:
        assert client.lookup([bytes(16)]) == 0
        assert client.exists(bytes(16)) is False
        assert caplog.text.count("store unreachable") == 2
        with pytest.raises(TransportError, match="cannot reach"):
            client.stats()
        with pytest.raises(TransportError, match="cannot reach"):
            client.get(bytes(16))
        with pytest.raises(TransportError):
            client.put(bytes(16), b"x")

    async def main() -> None:
        async with AsyncClient.connect(f"kv://127.0.0.1:{port}?retries=1") as client:
            assert await client.lookup([bytes(16)]) == 0
            with pytest.raises(TransportError):
                await client.get(bytes(16))

    asyncio.run(main())


def test_a_daemon_that_dies_mid_session_is_an_error_not_a_hang(start_daemon: Start) -> None:
    daemon = start_daemon()
    client = Client.connect(daemon.url(timeout="10", retries="1", backoff="0.01"))
    client.put(bytes(16), b"x")
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    with pytest.raises(TransportError):
        client.get(bytes(16))
    assert client.lookup([bytes(16)]) == 0
    client.close()


def test_sigterm_finishes_in_flight_requests(start_daemon: Start) -> None:
    daemon = start_daemon()
    client = Client.connect(daemon.url())
    keys = [i.to_bytes(16, "big") for i in range(200)]
    done = threading.Event()

    def writer() -> None:
        with contextlib.suppress(TransportError):  # refused once the daemon stops accepting
            client.put_many([(k, bytes(20000)) for k in keys])
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    daemon.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert done.is_set()
    # Wait for the exit without stop()'s SIGTERM: a second one that lands after the event loop
    # closed (which gives SIGTERM back its default action) kills the exiting daemon (-15).
    assert daemon.proc.wait(60) == 0
    daemon.stop()  # the last output line
    assert daemon.lines[-1] == "kvoffload: stopped"
    client.close()


def test_stats_command_prints_a_summary(start_daemon: Start) -> None:
    daemon = start_daemon()
    with Client.connect(daemon.url()) as client:
        client.put(bytes(16), b"x")
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "stats", daemon.url()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "daemon: kvoffload" in proc.stdout and "tier dram: 1 blocks" in proc.stdout


def test_kv_events_go_out_on_each_tenants_topic(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--events", "tcp://127.0.0.1:*", config=TENANTS, env={"KVOFFLOAD_EVENTS__TOPIC": "kv"}
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv/alice")
    sub.connect(daemon.events)
    key = bytes(range(16))
    with (
        Client.connect(daemon.url(token="alice-secret")) as alice,
        Client.connect(daemon.url(token="bob-secret")) as bob,
    ):
        for _ in range(100):  # until the subscription has propagated
            alice.put(key, b"alice")
            if sub.poll(100):
                break
        bob.put(key, b"bob")  # the same client key, another tenant
        bob.delete(key)
        alice.put(bytes(16), b"alice again")
        got: list[tuple[bytes, int, dict[str, Any]]] = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            got += [(topic, int.from_bytes(seq, "big"), e) for e in msgpack.unpackb(payload)[1]]
    sub.close(linger=0)
    assert got and {topic for topic, _, _ in got} == {b"kv/alice"}
    assert not [e for _, _, e in got if e["type"] == "BlockRemoved"]  # bob's delete is not here
    assert got[-1][2]["block_hashes"] == [0]  # alice's second block
    seqs = [seq for _, seq, _ in got]
    assert seqs == sorted(seqs) and seqs[-1] - seqs[0] < len(seqs) + 1  # alice's own numbering


def test_batched_gets_larger_than_one_answer_are_asked_again(start_daemon: Start) -> None:
    # 4 MiB answers at most: a batch of 12 x 1 MiB comes back as prefixes, asked for again.
    daemon = start_daemon(env={"KVOFFLOAD_NATIVE__MAX_PAYLOAD_BYTES": "4MiB"})
    keys = [i.to_bytes(16, "big") for i in range(12)]
    values = [os.urandom(1 << 20) for _ in keys]
    with Client.connect(daemon.url()) as client:
        for key, value in zip(keys, values, strict=True):
            client.put(key, value)
        assert client.get_many([*keys, b"\xff" * 16]) == [*values, None]
        outs = [bytearray(1 << 20) for _ in range(len(keys) + 1)]
        assert client.get_many_into([*keys, b"\xff" * 16], outs) == [1 << 20] * len(keys) + [None]
        assert outs[:-1] == [bytearray(v) for v in values]
