"""EtcdMembership against a real etcd: listing, watching, bad records, etcd going away."""

from __future__ import annotations

import logging
import time

import pytest
from etcd_server import EtcdServer

from kvoffload.client_sdk.cluster import EtcdMembership, Member, open_membership, parse_cluster_url
from kvoffload.wire.membership import encode_member, nodes_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PREFIX = nodes_prefix("prod")


def _put(etcd: EtcdServer, node_id: str, port: int = 7480) -> None:
    member = Member(node_id, {"native": f"10.0.0.1:{port}"}, 1.0, "n")
    etcd.put(PREFIX + node_id.encode(), encode_member(member))


def _wait(watcher: EtcdMembership, ids: set[str]) -> bool:
    end = time.monotonic() + 30
    generation = watcher.generation
    while {m.node_id for m in watcher.members()} != ids:
        if time.monotonic() > end:
            return False
        generation = watcher.wait_changed(generation, 1.0)
    return True


def test_lists_then_follows_puts_and_deletes(etcd: EtcdServer) -> None:
    _put(etcd, "kv-a")
    watcher = open_membership(parse_cluster_url(f"cluster+etcd://{etcd.endpoint}/prod"))
    assert isinstance(watcher, EtcdMembership)
    try:
        assert {m.node_id for m in watcher.members()} == {"kv-a"}  # listed before returning
        _put(etcd, "kv-b")
        assert _wait(watcher, {"kv-a", "kv-b"})
        _put(etcd, "kv-b", port=7481)  # a changed record replaces the old one
        end = time.monotonic() + 30
        while watcher.members()[1].fronts["native"] != "10.0.0.1:7481":
            assert time.monotonic() < end
            watcher.wait_changed(watcher.generation, 1.0)
        etcd.put(b"/kvoffload/other/nodes/kv-c", b"{}")  # another cluster: not seen at all
        etcd.delete(PREFIX + b"kv-a")
        assert _wait(watcher, {"kv-b"})
    finally:
        watcher.close()


def test_malformed_and_foreign_records_are_skipped_with_a_log_line(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvoffload.cluster")
    etcd.put(PREFIX + b"kv-junk", b"\xff not json")
    _put(etcd, "kv-a")
    host, port = etcd.endpoint.rsplit(":", 1)
    watcher = EtcdMembership(host, int(port), "prod")
    try:
        assert {m.node_id for m in watcher.members()} == {"kv-a"}
        etcd.put(PREFIX + b"kv-liar", encode_member(Member("kv-other", {}, 1.0)))
        _put(etcd, "kv-b")
        assert _wait(watcher, {"kv-a", "kv-b"})
    finally:
        watcher.close()
    logged = [r.getMessage() for r in caplog.records]
    assert any("kv-junk" in m and "not JSON" in m for m in logged), logged
    assert any("kv-liar" in m and "names node" in m for m in logged), logged


def test_etcd_going_away_keeps_the_last_members(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    _put(etcd, "kv-a")
    _put(etcd, "kv-b")
    host, port = etcd.endpoint.rsplit(":", 1)
    watcher = EtcdMembership(host, int(port), "prod")
    try:
        generation = watcher.generation
        etcd.stop()
        assert watcher.wait_changed(generation, 3.0) == generation  # nothing changed
        assert {m.node_id for m in watcher.members()} == {"kv-a", "kv-b"}
        etcd.start()
        etcd.delete(PREFIX + b"kv-a")
        assert _wait(watcher, {"kv-b"})  # listed again and watching once etcd is back
    finally:
        watcher.close()


def test_an_unreachable_etcd_at_start_is_an_empty_membership(etcd: EtcdServer) -> None:
    host, port = etcd.endpoint.rsplit(":", 1)
    etcd.stop()
    watcher = EtcdMembership(host, int(port), "prod", timeout_s=0.5)
    try:
        assert watcher.members() == ()
        etcd.start()
        _put(etcd, "kv-a")
        assert _wait(watcher, {"kv-a"})
    finally:
        watcher.close()
