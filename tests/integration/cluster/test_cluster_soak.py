"""The reliability suite's linearizability soak over a cluster: `cluster+etcd://` with
`replicas=2` on 3 nodes in their own network namespaces (SSD tiers, a real etcd), worker
processes of client threads doing durable and fast overwrites, deletes and gets of a small hot
key set (tests/reliability/soak.py), judged by the register checker (history.py): no read may
return a value older than the latest acknowledged put or delete it did not overlap ("stale",
"resurrected"), whatever the rounds do to the nodes meanwhile:

- a node SIGKILLed under load and restarted on its data dir (its SSD still holds its blocks);
- a node cut off (its link down, packets vanish) for longer than its lease, then back.

Node failures are not store crashes: the cluster as a whole stays up, so the checker sees no
CRASH and every acknowledged write must hold. CI form: ~45 s (2 rounds: a kill and restart,
then a cut where the network namespaces allow it); KVOFFLOAD_RELIABILITY=long runs 16 rounds
(4 of them cuts).
"""

from __future__ import annotations

import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CLUSTER, LEASE_TTL_S, StartNode
from etcd_server import EtcdServer

from kvoffload.bench.cluster.netns import Network
from kvoffload.client_sdk import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reliability"))
from history import Op, check  # noqa: E402
from soak import MIX, Workers, read_all  # noqa: E402

LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800 if LONG else 400)]
ROUNDS = 16 if LONG else 2
ROUND_SECONDS = 16.0
PROCESSES, THREADS = 2, 4
KEYS = MIX.keys + PROCESSES * THREADS
SSD = "512MiB"
# What clients may see: a delete that a member did not answer is not acknowledged (it raises,
# by design); a put that no node could take; a full node's refusal.
ALLOWED = {
    f"{op}:{error}"
    for op in ("put", "dput", "del")
    for error in ("TransportError", "CapacityError", "DeadlineExceededError")
}


def _url(etcd: EtcdServer) -> str:
    return f"cluster+etcd://{etcd.endpoint}/{CLUSTER}?replicas=2&timeout=3"


def _members_up(url: str, ids: set[str], timeout_s: float = 60) -> bool:
    """Whether a client sees exactly `ids`, all answering, within `timeout_s`."""
    end = time.monotonic() + timeout_s
    with Client.connect(url) as client:
        while time.monotonic() < end:
            nodes = client.stats().store["nodes"]
            assert isinstance(nodes, dict)
            if set(nodes) == ids and all(n["up"] for n in nodes.values()):
                return True
            time.sleep(0.3)
    return False


def test_cluster_soak_with_kills_restarts_and_a_cut_has_no_stale_or_resurrected_read(
    tmp_path: Path, start_node: StartNode, cluster_etcd: EtcdServer, network: Network
) -> None:
    rng = random.Random()
    nodes = [start_node(ssd=SSD) for _ in range(3)]
    ids = {n.node_id for n in nodes}
    url = _url(cluster_etcd)
    assert _members_up(url, ids)
    history: list[Op] = []
    logs: list[str] = []
    done: list[str] = []
    workers = Workers(tmp_path, PROCESSES, THREADS, seed=rng.randrange(1 << 16))

    def kill_and_restart(i: int) -> Callable[[], None]:
        def during() -> None:
            time.sleep(rng.uniform(2, 5))
            victim = nodes[i]
            killed = time.monotonic()
            victim.kill()
            logs.append(victim.stderr())
            time.sleep(rng.uniform(2, 5))
            nodes[i] = start_node(host=victim.host, data=victim.data_dir, ssd=SSD)
            done.append(f"kill+restart {victim.node_id} {killed:.3f}-{time.monotonic():.3f}")

        return during

    def cut(i: int) -> Callable[[], None]:
        def during() -> None:
            time.sleep(rng.uniform(1, 3))
            started = time.monotonic()
            nodes[i].host.link(False)
            try:  # past the lease: the node leaves, and drops its blocks to rejoin
                time.sleep(3 * LEASE_TTL_S)
            finally:
                nodes[i].host.link(True)
            done.append(f"cut {nodes[i].node_id} {started:.3f}-{time.monotonic():.3f}")

        return during

    try:
        history += workers.run(url, ROUND_SECONDS / 2)  # load alone first
        for round_ in range(ROUNDS):
            i = rng.randrange(3)
            # Every fourth round a cut, from the second on: the CI form's two rounds see both.
            during = cut(i) if round_ % 4 == 1 and network.isolated else kill_and_restart(i)
            history += workers.run(url, ROUND_SECONDS, during)
            assert _members_up(url, ids), f"round {round_}: the cluster did not heal"
        history += read_all(url, KEYS)
    finally:
        workers.close()
        for node in nodes:
            node.stop()
            logs.append(node.stderr())
    report = check(history)
    stderr = "".join(logs)
    tracebacks = stderr.count("Traceback")
    print(f"cluster soak ({', '.join(done)}): {report.summary()}, node tracebacks {tracebacks}")
    wrong = [f"{v.kind}: {v.detail} ({v.read})" for v in report.violations[:10]]
    for v in report.violations[:2]:  # what ran on that key around the read
        wrong += [
            f"  {op}"
            for op in sorted(history, key=lambda op: op.invoke)
            if op.key == v.read.key and abs(op.invoke - v.read.invoke) < 15
        ]
    if tracebacks:
        wrong.append(stderr[stderr.index("Traceback") :][:3000])
    unexpected = {e: n for e, n in report.errors.items() if e not in ALLOWED}
    if unexpected:
        wrong.append(f"undocumented client errors: {unexpected}")
    assert not wrong, "\n".join(wrong)
    assert report.hits > report.reads // 4, report.summary()  # the replicas served
    assert len(done) == ROUNDS
    if network.isolated:
        assert re.search(r"lease expired; registering again", stderr), "the cut node never left"
        assert "to rejoin" in stderr
    assert "dropped" in stderr  # a restarted node dropped what its SSD held
