"""The C hot path and the C reader on a daemon with two workers (issue 29): a 2-worker daemon
on the C core (KVOFFLOAD_REQUIRE_EXT=1) and one on KVOFFLOAD_PURE_PYTHON=1 get the same
operations and must give the same answers, final engine stats and request metrics.

A worker serves in C only frames whose keys are all its shard's (CRC32C mod 2, as
`shard_of`); a frame naming another shard's key goes to the Python session, which answers
WRONG_SHARD. Raw clients send both kinds to one worker's own port, pipelined and one frame at
a time (so that the C reader callback is the one that meets the other shard's key). Every
worker of the C daemon must have answered requests in C (`hot_reader_requests` in its own
stats), and the metrics a client scrapes once it has its answer must count it (the node's
/metrics reads the workers' files: each worker folds what C counted before that). Bounded: a
few hundred operations per daemon pair.
"""

from __future__ import annotations

import dataclasses
import random
import re
import socket
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import pytest

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.transports.native import NativeOptions, NativeTransport
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    Exists,
    Get,
    GetMany,
    Hello,
    Lookup,
    NativeConnection,
    PayloadEnd,
    Put,
    Role,
    Welcome,
)
from kvoffload.wire.shards import shard_of
from kvoffload.wire.status import Status
from tests.integration.test_hotpath_differential import (
    C_ENV,
    DRAM,
    KEYS,
    PY_ENV,
    TENANTS,
    _counted,
    _run,
    _sequence,
    _store,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(find_spec("kvoffload.core._core") is None, reason="the C core is not built"),
]
Start = Callable[..., Any]

# Each worker gets half (2.5 MiB: values up to 1.2 MB evict).
FLAGS = ("--dram", "5MiB", "--workers", "2")
HOT = ("hot_gets", "hot_exists", "hot_lookups", "hot_get_manys", "hot_put_answers",
       "hot_reader_requests")  # fmt: skip
_SHARD_LINE = re.compile(r"native shard (\d+) listening on [^:]+:(\d+)$")


def _pair(start: Start, config: str = "") -> tuple[Any, Any]:
    config = DRAM + config
    return start(*FLAGS, config=config, env=C_ENV), start(*FLAGS, config=config, env=PY_ENV)


def _shard_ports(daemon: Any) -> list[int]:
    found = dict(m.groups() for line in daemon.lines if (m := _SHARD_LINE.search(line)))
    return [int(found[str(i)]) for i in range(len(found))]


def _worker_servers(daemon: Any, **params: str) -> list[dict[str, Any]]:
    """Each worker's own server section, asked at its own port."""
    servers = []
    for port in _shard_ports(daemon):
        direct = NativeTransport(NativeOptions(port=port, retries=0, **params))  # type: ignore[arg-type]
        try:
            servers.append(direct.stats()["server"])
        finally:
            direct.close()
    return servers


def test_keys_span_both_shards() -> None:
    assert {shard_of(k, 2) for k in KEYS} == {0, 1}
    assert {shard_of(k, 2) for k in KEYS[:8]} == {0, 1}


@pytest.mark.parametrize("tenants", [False, True], ids=["open", "tenants"])
def test_random_sequences_on_two_workers(start_daemon: Start, tenants: bool) -> None:
    c, py = _pair(start_daemon, TENANTS if tenants else "")
    users = [{"token": "alice-secret"}, {"token": "bob-secret"}] if tenants else [{}]
    finals = []
    for daemon, core in ((c, "c"), (py, "python")):
        answers = []
        for seed in (1, 2):
            for i, params in enumerate(users):
                with Client.connect(daemon.url(**params)) as client:
                    answers.append(_run(client, _sequence(seed * 10 + i, 120)))
        with Client.connect(daemon.url(**users[0])) as client:
            # Answered (in C on the C daemon, on both shards), then scraped with the
            # connection still open: the worker folds C's counts in before the node reads them.
            answers.append([client.get(k) is not None for k in KEYS[:8]])
            answers.append(client.lookup(KEYS[:8]))
            counted = _counted(daemon)
            finals.append((answers, _store(client), counted))
            merged = client.stats().store["server"]
        servers = _worker_servers(daemon, **users[0])
        assert len(servers) == 2
        for server in servers:
            assert server["core"] == core
            for name in HOT:  # every worker answered in C (and its reader read), or none did
                assert (server[name] > 0) == (core == "c"), (name, server)
        for name in HOT:  # the SDK's stats add the workers' up
            assert merged[name] == sum(s[name] for s in servers)  # type: ignore[index]
    assert finals[0][0] == finals[1][0]
    assert finals[0][1] == finals[1][1]
    assert finals[0][2] == finals[1][2] and finals[0][2]
    assert finals[0][1]["evictions"], "the arenas were meant to be small enough to evict"


def _frames(
    seed: int, mine: list[bytes], theirs: list[bytes]
) -> tuple[NativeConnection, list[bytes]]:
    """A Hello, then random requests naming this worker's keys, the other's, or both (raw
    frames), and the client codec that made them (to read the answers)."""
    rng = random.Random(seed)
    conn = NativeConnection(Role.CLIENT)
    out = [conn.send(Hello(1))]
    for rid in range(2, 90):
        kind = rng.choice(["put", "get", "get", "exists", "get_many", "lookup"])
        key = rng.choice(mine + theirs[:2])  # mostly this worker's
        if kind == "put":
            value = rng.randbytes(rng.choice((0, 1, 4096, 65536)))
            out.append(conn.send(Put(rid, key, len(value)), [value]))
        elif kind == "get":
            out.append(conn.send(Get(rid, key)))
        elif kind == "exists":
            out.append(conn.send(Exists(rid, key)))
        else:
            keys = rng.sample(mine, 3)
            if rng.random() < 0.3:  # one key of the other shard, anywhere in the batch
                keys.insert(rng.randrange(4), rng.choice(theirs))
            req = GetMany if kind == "get_many" else Lookup
            out.append(conn.send(req(rid, tuple(keys))))
    return conn, out


def _raw(
    port: int, seed: int, mine: list[bytes], theirs: list[bytes], lockstep: bool
) -> list[object]:
    """Send `_frames(seed)` all at once, or each once the one before is answered; every
    event back."""
    conn, frames = _frames(seed, mine, theirs)  # all pending in `conn` until answered
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        batches = [[f] for f in frames] if lockstep else [frames]
        unsent = len(frames)
        for batch in batches:
            sock.sendall(b"".join(batch))
            unsent -= len(batch)
            while conn.pending > unsent or not conn.at_frame_boundary:  # payloads too
                data = sock.recv(1 << 20)
                assert data, events
                conn.receive_data(data)
                while (event := conn.next_event()) is not NEED_DATA:
                    assert not isinstance(event, ConnectionClosed)
                    if isinstance(event, PayloadEnd):  # its view is the codec's buffer
                        events.append((event.request_id, bytes(event.data)))
                    elif isinstance(event, Welcome):  # each daemon has its own ports
                        events.append(dataclasses.replace(event, shard_ports=()))
                    else:
                        events.append(bytes(event) if isinstance(event, memoryview) else event)
    return events


def test_keys_of_the_other_shard_answer_the_same(start_daemon: Start) -> None:
    """Raw frames at worker 0's own port: its keys are answered (in C on the C daemon), the
    other shard's refused WRONG_SHARD by Python, a batch with one such key refused whole."""
    c, py = _pair(start_daemon)
    mine = [k for k in KEYS if shard_of(k, 2) == 0][:6]
    theirs = [k for k in KEYS if shard_of(k, 2) == 1][:6]
    got = {}
    for daemon in (c, py):
        port = _shard_ports(daemon)[0]
        got[daemon.port] = (
            [
                _raw(port, seed, mine, theirs, lockstep)
                for seed in (5, 6)
                for lockstep in (False, True)
            ],
            _counted(daemon),
        )
    answers, counted = got[c.port]
    assert answers == got[py.port][0]
    assert counted == got[py.port][1]
    refused = [
        e for run in answers for e in run if getattr(e, "status", None) == Status.WRONG_SHARD
    ]
    assert len(refused) > 10, "the frames were meant to name the other shard's keys"
    server = _worker_servers(c)[0]
    assert server["hot_reader_requests"] > 0 and server["hot_reader_handbacks"] > 0, server
    assert 'status="wrong_shard"' in "".join(counted)


_PARENTS = """
[dram]
max_value_bytes = "1536KiB"
policy = "reuse"

[native]
answer_pin_share = 1.0
"""


def _evicted_with_a_foreign_parent(daemon: Any) -> list[bool]:
    """Five 600 kB puts on shard 0's 2.5 MiB, one of them (taken by the C reader) with a parent
    that shard 1 holds: which one is evicted says whether the engine took it for an orphan."""
    mine = [k for k in KEYS if shard_of(k, 2) == 0]
    parent = next(k for k in KEYS if shard_of(k, 2) == 1)
    y1, x, y2, y3, y4 = mine[:5]
    value = bytes(600_000)
    with Client.connect(daemon.url()) as client:
        client.get(y1)  # a request C answers: the C reader takes the puts after it
        client.put(y1, value)
        client.put(x, value, parent=parent)
        for key in (y2, y3, y4):
            client.put(key, value)
        return [client.get(k) is not None for k in (y1, x, y2, y3, y4)]


def test_a_parent_of_another_shard_is_not_an_orphan_s_on_either_path(
    start_daemon: Start,
) -> None:
    """A worker knows nothing of a parent another worker holds: both paths reserve the put
    without it (as `_reserve`), so `reuse` does not rank the block an orphan, evicted first
    (review of the workers change: the C reader's put kept the parent)."""
    got = [
        _evicted_with_a_foreign_parent(start_daemon(*FLAGS, config=_PARENTS, env=env))
        for env in (C_ENV, PY_ENV)
    ]
    assert got[0] == got[1]
    assert got[0].count(False) == 1, got  # exactly one block had to go
