"""Signed membership records against a real, open etcd (trust issue 27, defect 2): nodes sign
their records with the cluster's membership key, and a client that holds the key ignores a
rogue unsigned record and a node's record replayed with a changed address, counts and logs
them, and keeps working while nodes restart."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from etcd_server import EtcdServer

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.cluster import EtcdMembership
from kvoffload.client_sdk.cluster.status import members_of
from kvoffload.wire.membership import (
    KeyValue,
    Member,
    MembersKey,
    encode_member,
    nodes_prefix,
    parse_range,
    range_request,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLUSTER = "signed"
PREFIX = nodes_prefix(CLUSTER)
Start = Callable[..., Any]


def _key_file(tmp_path: Path) -> tuple[Path, str]:
    secret = secrets.token_hex(32)
    path = tmp_path / "members.key"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path, secret


def _node(start_daemon: Start, etcd: EtcdServer, key: Path, node_id: str, *flags: str) -> Any:
    env = {
        "KVOFFLOAD_CLUSTER__NODE_ID": node_id,
        "KVOFFLOAD_CLUSTER__MEMBERS_KEY_FILE": str(key),
        "KVOFFLOAD_CLUSTER__LEASE_TTL_S": "3",
    }
    return start_daemon("--cluster", f"etcd://{etcd.endpoint}/{CLUSTER}", *flags, env=env)


def _records(etcd: EtcdServer) -> dict[bytes, KeyValue]:
    _, kvs = parse_range(etcd.call(*range_request(PREFIX)))
    return {kv.key: kv for kv in kvs}


def _until(what: Callable[[], bool], timeout_s: float = 60) -> bool:
    """Poll `what` until it holds (False after `timeout_s`: a hang, not a timing claim)."""
    end = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _watcher(etcd: EtcdServer, key: Path | None) -> EtcdMembership:
    host, port = etcd.endpoint.rsplit(":", 1)
    members_key = MembersKey.from_file(str(key)) if key else None
    return EtcdMembership(host, int(port), CLUSTER, members_key=members_key)


def _ids(watcher: EtcdMembership) -> set[str]:
    return {m.node_id for m in watcher.members()}


def _stats(client: Client) -> dict[str, Any]:
    store = client.stats().store
    return {"nodes": store["nodes"], **store["cluster"]}  # type: ignore[dict-item]


def test_a_verifying_client_ignores_rogue_and_replayed_records(
    etcd: EtcdServer,
    tmp_path: Path,
    start_daemon: Start,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "kvoffload.cluster")
    key, secret = _key_file(tmp_path)
    nodes = {n: _node(start_daemon, etcd, key, n) for n in ("a", "b")}
    rogue = start_daemon()  # a real daemon, not in the cluster: what an attacker points at
    rogue_at = f"127.0.0.1:{rogue.port}"
    assert _until(lambda: len(_records(etcd)) == 2)
    verifying, trusting = _watcher(etcd, key), _watcher(etcd, None)
    try:
        assert _ids(verifying) == {"a", "b"} and verifying.ignored == 0
        # Defect 2's attack on an open etcd: one unsigned record with a huge weight.
        etcd.put(PREFIX + b"rogue", encode_member(Member("rogue", {"native": rogue_at}, 1e6)))
        # And node b's signed record copied with the rogue's address, under b's own live lease
        # (bytes otherwise as b wrote them: its signature, lease and nonce).
        b_record = _records(etcd)[PREFIX + b"b"]
        replayed = json.loads(b_record.value)
        replayed["fronts"] = {"native": rogue_at}
        etcd.put(b_record.key, json.dumps(replayed).encode(), lease=b_record.lease)
        # A client without the key takes both (the attack works on it) ...
        assert _until(lambda: "rogue" in _ids(trusting))
        # ... the verifying one ignores both, counts them and says why, once each.
        assert _until(lambda: verifying.ignored >= 2)
        assert _ids(verifying) <= {"a", "b"} and "rogue" not in _ids(verifying)
        assert all(m.fronts["native"] != rogue_at for m in verifying.members())
        text = caplog.text
        assert "rogue" in text and "is not signed" in text
        assert "not signed with the membership key" in text
        # Node b notices its record changed under its lease and puts its own back.
        assert _until(lambda: _ids(verifying) == {"a", "b"})
        assert _records(etcd)[PREFIX + b"b"].value != json.dumps(replayed).encode()
        # b's signed bytes copied to another node's key (renamed to fit it): ignored.
        ignored = verifying.ignored
        b_value = _records(etcd)[PREFIX + b"b"].value
        etcd.put(PREFIX + b"b2", b_value.replace(b'"node_id":"b"', b'"node_id":"b2"'))
        assert _until(lambda: verifying.ignored > ignored)
        # Each watcher sees etcd's events on its own connection: wait for the trusting one too.
        assert _until(lambda: "b2" in _ids(trusting)) and _ids(verifying) == {"a", "b"}
        # A record replayed after its node left: a's exact signed bytes put back once a has
        # stopped (its lease revoked), under no lease: signed for a lease it is not under.
        a_value = _records(etcd)[PREFIX + b"a"].value
        nodes["a"].stop()
        assert _until(lambda: _ids(verifying) == {"b"})
        ignored = verifying.ignored
        etcd.put(PREFIX + b"a", a_value)
        assert _until(lambda: verifying.ignored > ignored)
        assert _until(lambda: "a" in _ids(trusting)) and _ids(verifying) == {"b"}
        assert "was signed for lease" in caplog.text
        etcd.delete(PREFIX + b"a")  # a new a (another data dir) would take it for a live twin
        nodes["a"] = _node(start_daemon, etcd, key, "a")
        assert _until(lambda: _ids(verifying) == {"a", "b"})
    finally:
        verifying.close()
        trusting.close()
    # A client through the URL (rogue and b2 still in etcd): every put lands on a or b.
    url = f"cluster+etcd://{etcd.endpoint}/{CLUSTER}?members_key={key}"
    blocks = [(i.to_bytes(16, "big"), bytes([i % 251]) * 1024) for i in range(200)]
    with Client.connect(url) as client:
        stats = _stats(client)
        assert set(stats["nodes"]) == {"a", "b"} and stats["records_ignored"] >= 2
        client.put_many(blocks)
        assert client.get_many([k for k, _ in blocks]) == [v for _, v in blocks]
    # `kvoffload cluster status` with the same URL lists what that client uses.
    assert [m.node_id for m in members_of(url)[1]] == ["a", "b"]
    assert "rogue" in [m.node_id for m in members_of(url.partition("?")[0])[1]]
    with Client.connect(rogue.url()) as direct:
        assert direct.get_many([k for k, _ in blocks]) == [None] * len(blocks)
    # The key is in no log line of the client or of the nodes.
    assert secret not in caplog.text
    for node in nodes.values():
        assert secret not in node.stderr() and secret not in "\n".join(node.lines)


def test_a_verifying_client_keeps_working_through_node_restarts(
    etcd: EtcdServer, tmp_path: Path, start_daemon: Start
) -> None:
    key, _ = _key_file(tmp_path)
    data = {n: tmp_path / f"data-{n}" for n in ("a", "b")}
    nodes = {n: _node(start_daemon, etcd, key, n, "--data-dir", str(data[n])) for n in data}
    url = f"cluster+etcd://{etcd.endpoint}/{CLUSTER}?members_key={key}&replicas=2&timeout=1"
    blocks = [(i.to_bytes(16, "big"), bytes([i % 251]) * 1024) for i in range(1, 61)]
    with Client.connect(url) as client:
        assert _until(lambda: set(_stats(client)["nodes"]) == {"a", "b"})
        client.put_many(blocks)
        # SIGKILL: the old record stays until its lease lapses; the restarted node (same id,
        # same data dir) replaces it at once, signed for its new lease.
        old_lease = _records(etcd)[PREFIX + b"b"].lease
        nodes["b"].proc.kill()
        nodes["b"].proc.wait(30)
        nodes["b"] = _node(start_daemon, etcd, key, "b", "--data-dir", str(data["b"]))
        assert _records(etcd)[PREFIX + b"b"].lease != old_lease
        # A clean stop and start of a: its record goes, then comes back re-signed.
        nodes["a"].stop()
        nodes["a"] = _node(start_daemon, etcd, key, "a", "--data-dir", str(data["a"]))

        def both_up() -> bool:
            fronts = {n: s["fronts"]["native"] for n, s in _stats(client)["nodes"].items()}
            return fronts == {n: f"127.0.0.1:{node.port}" for n, node in nodes.items()}

        assert _until(both_up)
        assert _stats(client)["records_ignored"] == 0
        more = [(i.to_bytes(16, "big"), bytes([i % 251]) * 1024) for i in range(100, 160)]
        client.put_many(more)
        assert client.get_many([k for k, _ in more]) == [v for _, v in more]


def test_a_node_with_a_bad_key_file_stops_at_start(etcd: EtcdServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not-a-key-0123456789\n")
    argv = [
        sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0",
        "--metrics-port", "0", "--dram", "64MiB", "--ssd", "0",
        "--data-dir", str(tmp_path / "d"), "--cluster", f"etcd://{etcd.endpoint}/{CLUSTER}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env["KVOFFLOAD_CLUSTER__MEMBERS_KEY_FILE"] = str(bad)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "64 hex digits" in done.stderr and "not-a-key" not in done.stdout + done.stderr
    assert _records(etcd) == {}
