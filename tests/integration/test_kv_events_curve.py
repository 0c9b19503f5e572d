"""ZMQ CURVE on the KV events publisher and replay endpoint: a client whose public key is
allowed receives events and replay answers; a client with an unknown key gets nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.auth

from kvoffload.client_sdk import BlockMeta, Client
from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import EventsConfig
from kvoffload.nvmeof_target.events.curve import Curve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _keys(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """server.key_secret, a directory holding the allowed client's public key, and the
    allowed and the unknown client's secret key files."""
    for name in ("server", "allowed", "stranger"):
        (tmp_path / name).mkdir()
        zmq.auth.create_certificates(tmp_path / name, name)
    return (tmp_path / "server" / "server.key_secret", tmp_path / "allowed",
            tmp_path / "allowed" / "allowed.key_secret",
            tmp_path / "stranger" / "stranger.key_secret")  # fmt: skip


def _client(kind: int, endpoint: str, mine: Path, server: Path) -> zmq.Socket[bytes]:
    public, secret = zmq.auth.load_certificate(mine)
    server_public, _ = zmq.auth.load_certificate(server)
    sock = zmq.Context.instance().socket(kind)
    sock.curve_publickey, sock.curve_secretkey = public, secret  # type: ignore[assignment]
    sock.curve_serverkey = server_public
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _replay_answer(sock: zmq.Socket[bytes], wait_ms: int) -> list[dict[str, Any]] | None:
    sock.send_multipart([b"", bytes(8)])
    events: list[dict[str, Any]] = []
    while sock.poll(wait_ms):
        _, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            return events
        events += msgpack.unpackb(payload)[1]
    return None


@pytest.mark.parametrize("workers", ["1", "2"])
def test_only_allowed_curve_clients_hear_the_events(
    start_daemon: Any, tmp_path: Path, workers: str
) -> None:
    server, allowed_dir, allowed, stranger = _keys(tmp_path)
    env = {
        "KVOFFLOAD_EVENTS__REPLAY_ENDPOINT": "tcp://127.0.0.1:*",
        "KVOFFLOAD_EVENTS__CURVE_SECRET_KEY_FILE": str(server),
        "KVOFFLOAD_EVENTS__CURVE_CLIENTS": str(allowed_dir),
    }
    daemon = start_daemon("--events", "tcp://127.0.0.1:*", "--workers", workers, env=env)
    (replay,) = [line.rsplit(" ", 1)[1] for line in daemon.lines if "events replay on" in line]
    good = _client(zmq.SUB, daemon.events, allowed, server)
    bad = _client(zmq.SUB, daemon.events, stranger, server)
    meta = BlockMeta((1, 2, 3), block_hash=42)
    heard: list[dict[str, Any]] = []
    with Client.connect(daemon.url()) as client:
        for i in range(200):  # until the subscription has propagated
            client.put(bytes([i % 256]) * 16, b"v", meta=meta)
            if good.poll(100):
                heard += msgpack.unpackb(good.recv_multipart()[2])[1]
                break
        assert heard and heard[0]["token_ids"] == [1, 2, 3]
        # The stranger's handshake was refused: in all that time it got nothing.
        assert not bad.poll(500)
        answer = _replay_answer(_client(zmq.DEALER, replay, allowed, server), 60_000)
        assert answer is not None and any(e["token_ids"] == [1, 2, 3] for e in answer)
        assert _replay_answer(_client(zmq.DEALER, replay, stranger, server), 1000) is None
    good.close()
    bad.close()


def test_curve_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, allowed_dir, allowed, _ = _keys(tmp_path)
    with pytest.raises(ConfigError, match="go together"):
        EventsConfig(curve_secret_key_file=str(server))
    public_only = tmp_path / "server" / "server.key"
    with pytest.raises(ConfigError, match="no secret key"):
        Curve(EventsConfig(curve_secret_key_file=str(public_only), curve_clients=str(allowed)))
    with pytest.raises(ConfigError, match="does not exist"):
        Curve(EventsConfig(curve_secret_key_file=str(server), curve_clients=str(tmp_path / "x")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no public key"):
        Curve(
            EventsConfig(curve_secret_key_file=str(server), curve_clients=str(tmp_path / "empty"))
        )
    # A libzmq built without CURVE (fault injection: this one has it).
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="without it"):
        Curve(EventsConfig(curve_secret_key_file=str(server), curve_clients=str(allowed_dir)))
