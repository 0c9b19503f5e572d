"""KV events isolated between tenants (trust issue 27, defect 8): tenants ``alice`` and
``alice2``, whose topics share a prefix, on real daemons and real ZMQ.

- On the shared endpoint a replay request for ``kv/alice`` once got ``kv/alice2``'s blocks,
  token ids included (a prefix match): now only its own topic.
- With endpoints of their own and CURVE, a router holding alice's key receives alice's events
  only, live and through replay, whatever topic it subscribes to or names, and its handshake
  with alice2's endpoints and with the shared ones is refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvoffload.client_sdk import BlockMeta, Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOKENS = {"alice": 1_000, "alice2": 2_000}  # each tenant's token ids start here
TENANTS = '[tenants.alice]\ntoken = "alice-secret"\n[tenants.alice2]\ntoken = "alice2-secret"\n'


def _put(daemon: Any, tenant: str, count: int, first: int = 0) -> None:
    with Client.connect(daemon.url(token=f"{tenant}-secret")) as client:
        for i in range(first, first + count):
            client.put(i.to_bytes(16, "big"), b"v", meta=BlockMeta((TOKENS[tenant] + i,)))


def _socket(kind: int, endpoint: str, keys: tuple[Path, Path] | None) -> zmq.Socket[bytes]:
    """A client socket, with CURVE when `keys` is (its own secret key file, the server's)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public, secret = zmq.auth.load_certificate(keys[0])
        sock.curve_publickey, sock.curve_secretkey = public, secret  # type: ignore[assignment]
        sock.curve_serverkey = zmq.auth.load_certificate(keys[1])[0]
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic it is given
    return sock


def _replay(sock: zmq.Socket[bytes], topic: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """One replay answer, as (the topic a batch was asked for, event)."""
    sock.send_multipart([b"", bytes(8), topic] if topic else [b"", bytes(8)])
    events: list[tuple[bytes, dict[str, Any]]] = []
    while True:
        assert sock.poll(60_000), "no replay answer"
        _, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            return events
        events += [(topic, e) for e in msgpack.unpackb(payload)[1]]


def _first_tokens(events: list[tuple[bytes, dict[str, Any]]]) -> set[int]:
    return {e["token_ids"][0] for _, e in events if e["type"] == "BlockStored"}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_replay_for_alice_gets_nothing_of_alice2(start_daemon: Any, workers: str) -> None:
    env = {
        "KVOFFLOAD_EVENTS__TOPIC": "kv",
        "KVOFFLOAD_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:*",
    }
    daemon = start_daemon("--events", "tcp://127.0.0.1:*", "--workers", workers,
                          config=TENANTS, env=env)  # fmt: skip
    (replay,) = [line.rsplit(" ", 1)[1] for line in daemon.lines if "events replay on" in line]
    _put(daemon, "alice", 5)
    _put(daemon, "alice2", 7)
    sock = _socket(zmq.DEALER, replay, None)
    sock.connect(replay)
    alice, alice2 = range(1_000, 1_005), range(2_000, 2_007)
    assert _first_tokens(_replay(sock, b"kv/alice")) == set(alice)
    assert _first_tokens(_replay(sock, b"kv/alice2")) == set(alice2)
    assert _first_tokens(_replay(sock, b"kv/ali")) == set()
    # The shared endpoint carries both tenants (neither has its own): asked for all, it says so.
    assert _first_tokens(_replay(sock, b"")) == {*alice, *alice2}
    sock.close()


def _keys(tmp_path: Path) -> dict[str, Path]:
    """Key pairs of the daemon and three routers; each router's public key in a directory of
    its own (the allow lists)."""
    out = {}
    for name in ("server", "operator", "alice", "alice2"):
        (tmp_path / name).mkdir()
        zmq.auth.create_certificates(tmp_path / name, name)
        out[name] = tmp_path / name / f"{name}.key_secret"
        if name != "server":
            (tmp_path / name / f"{name}.key_secret").rename(tmp_path / f"{name}.key_secret")
            out[name] = tmp_path / f"{name}.key_secret"
    return out


def _handshake(sock: zmq.Socket[bytes], endpoint: str) -> int:
    """Connect `sock` and return how its first CURVE handshake ended (a monitor event)."""
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    sock.connect(endpoint)
    assert monitor.poll(60_000), "no handshake"
    event = int(recv_monitor_message(monitor)["event"])
    sock.disable_monitor()
    monitor.close(linger=0)
    return event


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_router_with_alices_key_gets_only_alices_events(
    start_daemon: Any, tmp_path: Path, workers: str
) -> None:
    keys = _keys(tmp_path)
    config = f"""
[events]
enabled = true
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
topic = "kv"
curve_secret_key_file = "{keys["server"]}"
curve_clients = "{tmp_path / "operator"}"
{TENANTS}"""
    for tenant in ("alice", "alice2"):
        config += f"""
[tenants.{tenant}.events]
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
curve_clients = "{tmp_path / tenant}"
"""
    daemon = start_daemon("--workers", workers, config=config)
    own = {
        (words[4], words[5]): words[-1]  # (tenant, "publishing"/"replay") -> endpoint
        for words in (line.split() for line in daemon.lines)
        if words[1:4] == ["events", "of", "tenant"]
    }
    (shared_replay,) = [line.split()[-1] for line in daemon.lines if "events replay on" in line]
    assert set(own) == {(t, w) for t in ("alice", "alice2") for w in ("publishing", "replay")}

    def router(name: str) -> tuple[Path, Path]:
        return keys[name], keys["server"]

    # alice's router: admitted on alice's endpoint, refused on alice2's and on the shared one.
    hears = _socket(zmq.SUB, own["alice", "publishing"], router("alice"))
    assert _handshake(hears, own["alice", "publishing"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    for endpoint in (own["alice2", "publishing"], daemon.events,
                     own["alice2", "replay"], shared_replay):  # fmt: skip
        kind = zmq.SUB if endpoint in (own["alice2", "publishing"], daemon.events) else zmq.DEALER
        refused = _socket(kind, endpoint, router("alice"))
        assert _handshake(refused, endpoint) == zmq.EVENT_HANDSHAKE_FAILED_AUTH, endpoint
        refused.close()
    # alice2's router hears alice2 (so alice2's events do go out while alice's router listens).
    alice2_hears = _socket(zmq.SUB, own["alice2", "publishing"], router("alice2"))
    assert _handshake(alice2_hears, own["alice2", "publishing"]) == zmq.EVENT_HANDSHAKE_SUCCEEDED

    # Until both subscriptions have propagated (PUB drops what no subscriber wants yet).
    heard: list[tuple[bytes, dict[str, Any]]] = []
    for round_ in range(200):
        _put(daemon, "alice", 1, first=round_)
        _put(daemon, "alice2", 1, first=round_)
        if hears.poll(100) and alice2_hears.poll(100):
            break
    _put(daemon, "alice2", 50, first=500)
    _put(daemon, "alice", 1, first=999)  # the last: on alice's socket, everything came before it
    while 1_999 not in _first_tokens(heard):
        assert hears.poll(60_000), "alice's last event never came"
        topic, _, payload = hears.recv_multipart()
        heard += [(topic, e) for e in msgpack.unpackb(payload)[1]]
    assert {t for t, _ in heard} == {b"kv/alice"}
    assert all(1_000 <= t < 2_000 for t in _first_tokens(heard))
    got2: list[tuple[bytes, dict[str, Any]]] = []
    while 2_549 not in _first_tokens(got2):
        assert alice2_hears.poll(60_000), "alice2's last event never came"
        topic, _, payload = alice2_hears.recv_multipart()
        got2 += [(topic, e) for e in msgpack.unpackb(payload)[1]]
    assert {t for t, _ in got2} == {b"kv/alice2"}

    # Replay: alice's endpoint answers alice's blocks whatever topic the request names.
    asks = _socket(zmq.DEALER, own["alice", "replay"], router("alice"))
    asks.connect(own["alice", "replay"])
    mine = _first_tokens(_replay(asks, b""))
    assert mine and all(1_000 <= t < 2_000 for t in mine) and 1_999 in mine
    assert _first_tokens(_replay(asks, b"kv/alice")) == mine
    for other in (b"kv/alice2", b"kv", b"kv/", b"kv/ali", b"kv/alice/"):
        assert _replay(asks, other) == [], other
    # The operator's router, on the shared endpoints, gets neither tenant (both have their own).
    operator = _socket(zmq.DEALER, shared_replay, router("operator"))
    operator.connect(shared_replay)
    assert _replay(operator, b"") == [] and _replay(operator, b"kv/alice") == []
    for sock in (hears, alice2_hears, asks, operator):
        sock.close()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_tenant_endpoint_in_use_stops_the_start_with_a_config_error(
    tmp_path: Path, workers: str
) -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    config = tmp_path / "kvoffload.toml"
    config.write_text(
        f'{TENANTS}[tenants.alice.events]\nendpoint = "tcp://127.0.0.1:{port}"\n'
        '[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:*"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--metrics-port", "0"]
        + ["--dram", "16MiB", "--ssd", "0", "--workers", workers, "--config", str(config)]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    taken.close(linger=0)
    assert proc.returncode != 0
    assert f"cannot bind tenant alice's endpoint tcp://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
