"""The live rows of `kvoffload bench cluster`: failover and 2 MiB read throughput through
`cluster://` to real daemons on loopback.

Failover: a reader loops `get_many` over keys spread on 3 nodes while one node is SIGKILLed
(its connections reset: the client learns at once) or SIGSTOPped (it stays connected and never
answers, as a cut link looks to the client: packets vanish, no reset). The row is the time from
the signal until the first call that no longer waits on the node, plus how many calls paid the
deadline in the window after (the breaker's probes). The bench runs without root, so a real
link cut (a namespace's veth down) is left to `tests/integration/cluster`.

Throughput: 8 threads share one client and read 2 MiB blocks with `get_many_into` into their
own buffers; the daemons and the clients share this machine's cores, so with 2 CPUs adding
targets cannot add CPU, only spread the same work (the rows say so).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvoffload.bench.common import Row, daemon_ports, stop_process
from kvoffload.client_sdk import Client
from kvoffload.client_sdk.cluster import Member, Placement

__all__ = ["GOAL_FAILOVER_S", "LoopbackNode", "failover_rows", "loopback_nodes", "throughput_rows"]

GOAL_FAILOVER_S = 1.0
BLOCK = 2 << 20
THREADS = 8


@dataclass
class LoopbackNode:
    proc: subprocess.Popen[str]
    ports: dict[str, int]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['native']}"

    @property
    def node_id(self) -> str:
        """The id a static cluster URL gives this node ("host-port")."""
        return f"127.0.0.1-{self.ports['native']}"


@contextlib.contextmanager
def loopback_nodes(n: int, dram: str) -> Iterator[list[LoopbackNode]]:
    """`n` daemons on loopback ports, stopped (continued first if stopped) at the end."""
    with contextlib.ExitStack() as stack:
        nodes: list[LoopbackNode] = []
        for _ in range(n):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            err = tmp / "stderr"
            argv = [
                sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0",
                "--metrics-port", "0", "--dram", dram, "--ssd", "0", "--data-dir", str(tmp / "d"),
            ]  # fmt: skip
            with open(err, "w") as err_file:
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, text=True)
            stack.callback(_end, proc)
            nodes.append(LoopbackNode(proc, daemon_ports(proc, err)))
        yield nodes


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a stopped daemon cannot act on SIGTERM
        stop_process(proc)


def _cluster_url(nodes: list[LoopbackNode], **params: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return "cluster://" + ",".join(n.address for n in nodes) + (f"?{query}" if query else "")


def _keys(n: int, seed: int) -> list[bytes]:
    raw = np.random.default_rng(seed).bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


# ---------------------------------------------------------------------------------- failover


@dataclass(frozen=True)
class Failover:
    took_s: float  # signal -> end of the first call that did not wait on the node
    slow_calls: int  # calls in the window that waited out (90% of) the deadline
    calls: int  # calls in the window
    hit_ratio: float  # hits / asked over the calls after the first fast one
    expected: float  # the hit ratio the dead node's share leaves (1.0 with 2 replicas)


def measure_failover(
    sig: signal.Signals, replicas: int, deadline_s: float, window_s: float, seed: int = 0
) -> Failover:
    """One node of 3 gets `sig` while a reader loops `get_many` over 300 keys (4 KiB each)."""
    keys = _keys(300, seed)
    values = {k: np.random.default_rng(k[0]).bytes(4096) for k in keys}
    with loopback_nodes(3, "64MiB") as nodes:
        url = _cluster_url(nodes, replicas=replicas, timeout=f"{deadline_s:g}")
        with Client.connect(url) as client:
            client.put_many([(k, values[k]) for k in keys])
            if client.get_many(keys) != [values[k] for k in keys]:
                raise RuntimeError("a stored block did not read back")
            victim = nodes[0]
            members = [Member(n.node_id, {"native": n.address}) for n in nodes]
            placement = Placement(members)
            owners = placement.rank_many(keys, replicas)
            dead = [m.node_id for m in placement.members].index(victim.node_id)
            lost = float(np.mean(np.all(owners == dead, axis=1)))
            calls: list[tuple[float, float, int]] = []
            started = time.monotonic()
            victim.proc.send_signal(sig)
            _wait_signalled(victim.proc, sig)  # no call may start before the signal has acted
            # Bounded by time and by count (a fast loop must not run away).
            while time.monotonic() - started < window_s and len(calls) < 20_000:
                t0 = time.monotonic()
                got = client.get_many(keys)
                if any(g is not None and g != values[k] for k, g in zip(keys, got, strict=True)):
                    raise RuntimeError("a read returned wrong bytes")
                calls.append((t0, time.monotonic(), sum(g is not None for g in got)))
    # A call that took 90% of the deadline waited on the node (noise rarely costs that much).
    slow = [c for c in calls if c[1] - c[0] >= 0.9 * deadline_s]
    first = next((i for i, c in enumerate(calls) if c[1] - c[0] < 0.9 * deadline_s), len(calls))
    if first == len(calls):
        return Failover(float("inf"), len(slow), len(calls), 0.0, 1 - lost)
    after = calls[first:]
    ratio = sum(c[2] for c in after) / (len(after) * len(keys))
    return Failover(calls[first][1] - started, len(slow), len(calls), ratio, 1 - lost)


def _wait_signalled(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Until a SIGKILLed process is gone or a SIGSTOPped one is stopped (10 s at most)."""
    if sig == signal.SIGKILL:
        proc.wait(10)
        return
    for _ in range(1000):
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise RuntimeError(f"daemon {proc.pid} did not stop on {sig.name}")


def failover_rows(window_s: float = 8.0) -> list[Row]:
    """SIGKILL with 1 and 2 replicas (deadline 1 s), SIGSTOP with 2 replicas at deadlines
    0.5 s and 2 s (the default)."""
    rows = []
    verdict = {True: "met", False: "NOT met"}
    for replicas in (1, 2):
        f = measure_failover(signal.SIGKILL, replicas, 1.0, window_s / 2, seed=replicas)
        rows += [
            Row(f"failover/sigkill/R{replicas}", f.took_s, "s", "goal", GOAL_FAILOVER_S,
                note=f"1 of 3 loopback nodes SIGKILLed under a get_many loop (300 keys, "
                f"replicas={replicas}, timeout=1): signal -> end of the first call that did not "
                f"wait on it ({verdict[f.took_s <= GOAL_FAILOVER_S]}); {f.slow_calls} of "
                f"{f.calls} calls took >= 0.9 s"),
            Row(f"failover/sigkill/R{replicas}/hit_ratio", f.hit_ratio, "ratio",
                "1 - dead node's share", f.expected,
                note="hits / asked over the calls after failover, against the share the dead "
                "node held alone (nothing is lost with 2 replicas); every hit bit-exact"),
        ]  # fmt: skip
    for deadline in (0.5, 2.0):
        # Long enough to see the first fast call after the one that waits out the deadline.
        f = measure_failover(signal.SIGSTOP, 2, deadline, max(window_s, 3 * deadline), seed=3)
        rows.append(
            Row(f"failover/stall/deadline{deadline:g}s", f.took_s, "s", "goal", GOAL_FAILOVER_S,
                note=f"1 of 3 loopback nodes SIGSTOPped (connected, never answers: a cut link "
                f"as the client sees it), replicas=2, timeout={deadline:g}: signal -> end of "
                f"the first call that did not wait on it "
                f"({verdict[f.took_s <= GOAL_FAILOVER_S]}; bounded below by the deadline). "
                f"In {max(window_s, 3 * deadline):g} s, {f.slow_calls} of {f.calls} calls took "
                f">= 0.9 x the deadline (the breaker probes in the background); hit ratio after "
                f"{f.hit_ratio:.3f}")
        )  # fmt: skip
    return rows


# -------------------------------------------------------------------------------- throughput


def _read_loop(client: Client, keys: list[bytes], batch: int, rounds: int) -> tuple[float, int]:
    """THREADS threads each read `rounds` batches of `batch` blocks: (seconds, bytes read)."""
    got = [0] * THREADS
    errors: list[BaseException] = []

    def reader(n: int) -> None:
        buffers = [np.empty(BLOCK, dtype=np.uint8) for _ in range(batch)]
        mine = keys[n::THREADS]
        try:
            for r in range(rounds):
                chosen = [mine[(r * batch + j) % len(mine)] for j in range(batch)]
                got[n] += sum(x or 0 for x in client.get_many_into(chosen, buffers))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(THREADS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"a reader failed: {errors[0]!r}")
    return took, sum(got)


def _node_hits(client: Client) -> dict[str, int]:
    nodes = client.stats().store["nodes"]
    assert isinstance(nodes, dict)
    return {node_id: int(n["hits"]) for node_id, n in nodes.items()}


def throughput_rows(
    blocks: int = 64, batch: int = 4, rounds: int = 8, passes: int = 2
) -> list[Row]:
    """Aggregate GB/s of 8 threads' `get_many_into` of 2 MiB blocks over 1, 2 and 4 targets
    (the best of `passes` alternating passes) and plain `kv://` to one daemon."""
    if blocks < THREADS * batch:
        raise ValueError(f"{blocks} blocks: each of {THREADS} threads needs a batch of its own")
    value = np.random.default_rng(5).bytes(BLOCK)
    best: dict[str, float] = {}
    per_node: dict[str, str] = {}
    with loopback_nodes(4, "512MiB") as nodes:
        urls = {"kv": f"kv://{nodes[0].address}"}
        urls |= {f"{n}targets": _cluster_url(nodes[:n]) for n in (1, 2, 4)}
        clients = {name: Client.connect(url) for name, url in urls.items()}
        try:
            keys = {name: _keys(blocks, 100 + i) for i, name in enumerate(urls)}
            for name, client in clients.items():
                client.put_many([(k, value) for k in keys[name]])
                out = np.empty(BLOCK, dtype=np.uint8)
                if client.get_into(keys[name][0], out) != BLOCK or out.tobytes() != value:
                    raise RuntimeError(f"{name}: a stored block did not read back")
            for _ in range(passes):  # alternating: each configuration sees the same noise
                for name, client in clients.items():
                    before = _node_hits(client) if name != "kv" else {}
                    took, nbytes = _read_loop(client, keys[name], batch, rounds)
                    expected = THREADS * rounds * batch * BLOCK
                    if nbytes != expected:
                        raise RuntimeError(f"{name}: read {nbytes} bytes, expected {expected}")
                    rate = nbytes / took / 1e9
                    if rate > best.get(name, 0.0):
                        best[name] = rate
                        if before:
                            after = _node_hits(client)
                            per_node[name] = ", ".join(
                                f"{(after[i] - before.get(i, 0)) * BLOCK / took / 1e9:.2f}"
                                for i in sorted(after)
                            )
        finally:
            for client in clients.values():
                client.close()
    total = THREADS * rounds * batch * BLOCK / 2**20
    rows = [
        Row("get_many_into/2MiB/1target", best["1targets"], "GB/s", "kv:// (no cluster)",
            best["kv"], note=f"8 threads, one client, batches of {batch}; {total:.0f} MiB per "
            f"pass, best of {passes} alternating passes; loopback daemon"),
    ]  # fmt: skip
    for n in (2, 4):
        rows.append(
            Row(f"get_many_into/2MiB/{n}targets", best[f"{n}targets"], "GB/s", "1 target",
                best["1targets"], note=f"per target GB/s: {per_node.get(f'{n}targets', '?')}; "
                f"{n} loopback daemons and the 8 client threads share this machine's "
                "CPUs, so the CPU bounds the aggregate, not the targets")
        )  # fmt: skip
    return rows
