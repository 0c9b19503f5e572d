"""Storage nodes in their own network namespaces register in a real etcd; a client-side
EtcdMembership follows them through kills, restarts, an etcd outage and an id collision."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import CLUSTER, LEASE_TTL_S, StartNode
from etcd_server import EtcdServer

from kvoffload.bench.cluster.netns import Network
from kvoffload.cli import main
from kvoffload.client_sdk import Client
from kvoffload.client_sdk.cluster import EtcdMembership, Member
from kvoffload.wire.membership import decode_member, nodes_prefix

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

PREFIX = nodes_prefix(CLUSTER)


@pytest.fixture
def membership(cluster_etcd: EtcdServer) -> Iterator[EtcdMembership]:
    host, port = cluster_etcd.endpoint.rsplit(":", 1)
    watcher = EtcdMembership(host, int(port), CLUSTER)
    yield watcher
    watcher.close()


def _until(membership: EtcdMembership, check: Callable[[tuple[Member, ...]], bool]) -> bool:
    """Wait (60 s at most) until the members satisfy `check`."""
    end = time.monotonic() + 60
    generation = membership.generation
    while not check(membership.members()):
        if time.monotonic() > end:
            return False
        generation = membership.wait_changed(generation, 1.0)
    return True


def _ids(members: tuple[Member, ...]) -> set[str]:
    return {m.node_id for m in members}


def _round_trip(url: str, seed: int) -> bool:
    value = np.random.default_rng(seed).bytes(4096)
    key = seed.to_bytes(16, "little")
    with Client.connect(url) as client:
        client.put(key, value)
        return bool(client.get(key) == value)


def test_three_nodes_register_and_a_client_sees_them(
    start_node: StartNode, membership: EtcdMembership, network: Network
) -> None:
    nodes = [start_node() for _ in range(3)]
    ids = {n.node_id for n in nodes}
    assert len(ids) == 3 and all(i.startswith("kv-") for i in ids)
    assert _until(membership, lambda m: _ids(m) == ids)
    for member in membership.members():
        node = next(n for n in nodes if n.node_id == member.node_id)
        assert member.fronts["native"] == f"{node.host.address}:{node.ports['native']}"
        assert member.fronts["nvme"].startswith(f"{node.host.address}:{node.ports['nvme']}/nqn.")
        # Every node is reachable at the address it advertises, from the client's namespace.
        assert _round_trip(f"kv://{member.fronts['native']}", seed=len(member.node_id))
        assert member.weight == round(64 / 1024, 3)  # its capacity in GiB (DRAM only)
    if network.isolated:
        assert len({m.fronts["native"].split(":")[0] for m in membership.members()}) == 3


def test_a_node_started_while_etcd_is_down_serves_and_registers_later(
    start_node: StartNode, membership: EtcdMembership, cluster_etcd: EtcdServer
) -> None:
    cluster_etcd.stop()
    node = start_node()
    assert node.node_id and _round_trip(node.url, seed=21)
    end = time.monotonic() + 30  # stderr is read by a thread: wait for the warning to arrive
    while "unreachable" not in "".join(node.errors) and time.monotonic() < end:
        time.sleep(0.1)
    assert "registering when it answers" in "".join(node.errors)
    cluster_etcd.start()
    assert _until(membership, lambda m: _ids(m) == {node.node_id})


def test_a_killed_node_leaves_after_its_lease_and_rejoins_under_its_id(
    start_node: StartNode, membership: EtcdMembership, cluster_etcd: EtcdServer
) -> None:
    nodes = [start_node() for _ in range(3)]
    assert _until(membership, lambda m: len(m) == 3)
    victim = nodes[1]
    victim.kill()
    # The record outlives the process by at most the lease TTL (plus etcd's expiry sweep).
    killed_at = time.monotonic()
    assert _until(membership, lambda m: victim.node_id not in _ids(m))
    assert time.monotonic() - killed_at > LEASE_TTL_S / 2  # it left by expiry, not by a revoke

    again = start_node(host=victim.host, data=victim.data_dir)
    assert again.node_id == victim.node_id
    assert _until(membership, lambda m: victim.node_id in _ids(m))
    assert _round_trip(again.url, seed=7)


def test_a_restart_replaces_its_own_stale_record_at_once(
    start_node: StartNode, membership: EtcdMembership, cluster_etcd: EtcdServer
) -> None:
    node = start_node(env={"KVOFFLOAD_CLUSTER__LEASE_TTL_S": "60"})
    assert _until(membership, lambda m: _ids(m) == {node.node_id})
    old_nonce = membership.members()[0].nonce
    node.kill()  # its record stays for a minute
    again = start_node(host=node.host, data=node.data_dir)
    assert again.node_id == node.node_id
    assert _until(membership, lambda m: len(m) == 1 and m[0].nonce != old_nonce)
    (record,) = cluster_etcd.keys(PREFIX).items()
    assert decode_member(*record, PREFIX).fronts == membership.members()[0].fronts


def test_a_record_deleted_by_hand_is_put_back(
    start_node: StartNode, membership: EtcdMembership, cluster_etcd: EtcdServer
) -> None:
    node = start_node()
    assert _until(membership, lambda m: _ids(m) == {node.node_id})
    key = PREFIX + node.node_id.encode()
    cluster_etcd.delete(key)
    end = time.monotonic() + 30  # back within a keepalive interval (a second here)
    while key not in cluster_etcd.keys(PREFIX) and time.monotonic() < end:
        time.sleep(0.1)
    assert key in cluster_etcd.keys(PREFIX)
    assert _until(membership, lambda m: _ids(m) == {node.node_id})


def test_a_second_live_daemon_with_the_same_id_is_refused(
    start_node: StartNode, membership: EtcdMembership
) -> None:
    first = start_node()
    assert _until(membership, lambda m: _ids(m) == {first.node_id})
    twin = start_node(env={"KVOFFLOAD_CLUSTER__NODE_ID": first.node_id}, ready=False)
    assert not twin.ready()
    assert twin.proc.wait(30) == 2
    err = twin.stderr()
    assert f"node id {first.node_id!r} is held in cluster {CLUSTER!r}" in err, err
    # The first node's record is untouched.
    assert _until(membership, lambda m: _ids(m) == {first.node_id})
    assert _round_trip(first.url, seed=11)


def test_cluster_status_reports_members_health_and_capacity(
    start_node: StartNode,
    membership: EtcdMembership,
    cluster_etcd: EtcdServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nodes = [start_node(env={"KVOFFLOAD_CLUSTER__LEASE_TTL_S": "60"}) for _ in range(2)]
    assert _until(membership, lambda m: len(m) == 2)
    assert _round_trip(nodes[0].url, seed=3)
    url = f"etcd://{cluster_etcd.endpoint}/{CLUSTER}"
    assert main(["cluster", "status", url, "--json"]) == 0
    report = {n["node_id"]: n for n in json.loads(capsys.readouterr().out)}
    assert set(report) == {n.node_id for n in nodes}
    first = report[nodes[0].node_id]
    assert first["up"] and first["blocks"] == 1 and first["capacity_bytes"] == 64 << 20
    assert first["hit_ratio"] == 1.0 and report[nodes[1].node_id]["hit_ratio"] is None
    nodes[1].kill()  # its record stays (60 s lease): status shows it down
    assert main(["cluster", "status", url, "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "1/2 node(s) up" in out and "down" in out


def test_two_daemons_on_one_data_dir_are_refused(
    start_node: StartNode, membership: EtcdMembership
) -> None:
    first = start_node()
    second = start_node(data=first.data_dir, ready=False)
    assert not second.ready() and second.proc.wait(30) == 2
    assert "another kvoffload serve is running on data dir" in second.stderr()
    assert _until(membership, lambda m: _ids(m) == {first.node_id})


def test_etcd_down_for_ten_seconds_changes_nothing_for_nodes_or_clients(
    start_node: StartNode, membership: EtcdMembership, cluster_etcd: EtcdServer
) -> None:
    nodes = [start_node() for _ in range(3)]
    ids = {n.node_id for n in nodes}
    assert _until(membership, lambda m: _ids(m) == ids)
    cluster_etcd.stop()
    # Longer than the lease TTL: with etcd gone nothing can expire, and nobody must care.
    down_until = time.monotonic() + 10
    seed = 100
    while time.monotonic() < down_until:
        for node in nodes:
            seed += 1
            assert _round_trip(node.url, seed)
        assert _ids(membership.members()) == ids  # the client keeps the last membership
        time.sleep(0.5)
    # Back with its state lost (a rebuilt etcd): every node registers again.
    cluster_etcd.data_dir = cluster_etcd.data_dir.with_name("etcd-rebuilt")
    cluster_etcd.start()
    assert _until(membership, lambda m: _ids(m) == ids)
    end = time.monotonic() + 60
    while len(cluster_etcd.keys(PREFIX)) < 3 and time.monotonic() < end:
        time.sleep(0.2)
    assert {k.removeprefix(PREFIX).decode() for k in cluster_etcd.keys(PREFIX)} == ids
    for node in nodes:
        seed += 1
        assert _round_trip(node.url, seed)


def test_a_node_with_several_workers_registers_once(
    start_node: StartNode, membership: EtcdMembership
) -> None:
    node = start_node(env={"KVOFFLOAD_SERVER__WORKERS": "2"})
    assert node.node_id.startswith("kv-")
    assert _until(membership, lambda m: _ids(m) == {node.node_id})
    (member,) = membership.members()
    # The node's port only: its shards are found from there (one subsystem per worker is not
    # a node-wide NVMe front, so none is advertised).
    assert set(member.fronts) == {"native"}
    assert member.fronts["native"] == f"{node.host.address}:{node.ports['native']}"
    assert _round_trip(f"kv://{member.fronts['native']}", seed=11)
    with Client.connect(f"kv://{member.fronts['native']}") as client:
        assert client.stats().store["shards"] == 2
    assert node.stop() == 0
    assert _until(membership, lambda m: not m)  # it leaves at once on a clean stop
