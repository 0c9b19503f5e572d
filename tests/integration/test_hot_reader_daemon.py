"""The C reader callback (`NativeSession._read_in_c`, `HotGets.arm`) in a real daemon, against
the Python read loop (KVOFFLOAD_PURE_PYTHON=1): a connection idle at a frame boundary waits
for its requests in C, and what C must not answer (a put, a partial frame, EOF, a full
socket, the turn) goes back to Python with the same answers, metrics, timeouts and stops.

Every C-side check also asks the daemon's stats whether the C reader was the one that read
(`hot_reader_requests`, `hot_reader_handbacks`): without it those stay 0 and the test fails.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import pytest
from probes import eventually, pinned, refused, small_window

from kvoffload.client_sdk import Client
from kvoffload.wire.native.connection import (
    NEED_DATA,
    ConnectionClosed,
    ErrorReply,
    Exists,
    Get,
    GetMany,
    GetManyResult,
    GetResult,
    Hello,
    NativeConnection,
    PayloadEnd,
    Put,
    Role,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(find_spec("kvoffload.core._core") is None, reason="the C core is not built"),
]
Start = Callable[..., Any]
PATHS = {"c": {"KVOFFLOAD_REQUIRE_EXT": "1"}, "python": {"KVOFFLOAD_PURE_PYTHON": "1"}}
KEYS = [i.to_bytes(16, "big") for i in range(1, 9)]
MIB = 1 << 20


def _server(daemon: Any) -> dict[str, Any]:
    with Client.connect(daemon.url()) as client:
        server: dict[str, Any] = client.stats().store["server"]  # type: ignore[assignment]
    return server


class Raw:
    """A connection speaking frames by hand: Hello sent and its Welcome read, so the daemon's
    session is idle at a frame boundary (on the C core: waiting in the C reader)."""

    def __init__(self, port: int, sock: socket.socket | None = None) -> None:
        self.sock = sock or socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.settimeout(30)
        self.conn = NativeConnection(Role.CLIENT)
        self.sock.sendall(self.conn.send(Hello(1)))
        self.events: list[object] = []
        self.read(1)

    def read(self, n: int) -> list[object]:
        """Read until `n` more answers (each with its payload) or the close arrived; their
        events (a payload as ("payload", its bytes))."""
        start, done = len(self.events), 0
        while done < n:
            data = self.sock.recv(1 << 20)
            self.conn.receive_data(data)
            while done < n and (event := self.conn.next_event()) is not NEED_DATA:
                if isinstance(event, PayloadEnd):
                    self.events.append(("payload", bytes(event.data)))
                else:
                    self.events.append(event)
                if isinstance(event, ConnectionClosed):
                    return self.events[start:]
                done += not _payload_follows(event)
        return self.events[start:]


def _payload_follows(event: object) -> bool:
    if isinstance(event, GetResult):
        return bool(event.length)
    if isinstance(event, GetManyResult):
        return any(event.lengths)
    return False


def _mixed(raw: Raw) -> None:
    """Hot and non-hot frames pipelined, a frame split across reads, then more of both."""
    c = raw.conn
    value = b"x" * 5000
    stream = [c.send(Put(2, KEYS[0], len(value)), [value]), c.send(Get(3, KEYS[0]))]
    stream += [c.send(Exists(4, KEYS[1])), c.send(GetMany(5, (KEYS[0], KEYS[1])))]
    raw.sock.sendall(b"".join(stream))
    raw.read(4)
    get = c.send(Get(6, KEYS[0]))
    raw.sock.sendall(get[:10])  # half a frame: C hands it back, Python waits for the rest
    time.sleep(0.2)  # (not a timing assertion: only makes the two halves two reads)
    raw.sock.sendall(get[10:])
    raw.read(1)
    burst = [c.send(Get(7 + i, KEYS[i % 2])) for i in range(12)]  # more than one turn
    burst.append(c.send(Put(20, KEYS[1], 3), [b"abc"]))
    burst += [c.send(Get(21, KEYS[1])), c.send(Exists(22, KEYS[5]))]
    raw.sock.sendall(b"".join(burst))
    raw.read(15)


def test_mixed_pipelined_and_split_frames_answer_the_same(start_daemon: Start) -> None:
    answers = {}
    # the C reader under uvloop (the default) and under the stock asyncio loop
    for path, flags, env in (("c", (), PATHS["c"]), ("c-asyncio", ("--loop", "asyncio"),
                             PATHS["c"]), ("python", (), PATHS["python"])):  # fmt: skip
        daemon = start_daemon(*flags, env=env)
        raw = Raw(daemon.port)
        _mixed(raw)
        raw.sock.close()
        answers[path] = raw.events
        server = _server(daemon)
        if path != "python":  # the C reader read most of them, handed back what it must not
            assert server["hot_reader_requests"] >= 5, server
            assert server["hot_reader_handbacks"] >= 3, server
        else:
            assert server["hot_reader_requests"] == server["hot_reader_handbacks"] == 0
    assert answers["c"] == answers["c-asyncio"] == answers["python"] and len(answers["c"]) > 20


def _metrics(daemon: Any) -> list[str]:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    counted = re.compile(
        r"^(kvoffload_requests_total|kvoffload_request_seconds_count|"
        r"kvoffload_payload_bytes_\w+_total)\{[^}]*\} \S+$",
        re.M,
    )
    return sorted(m.group(0) for m in counted.finditer(text) if 'op="stats"' not in m.group(0))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_metrics_count_each_request_once(start_daemon: Start, path: str) -> None:
    daemon = start_daemon(env=PATHS[path])
    with Client.connect(daemon.url()) as client:
        client.put(KEYS[0], b"v" * 1000)
        for _ in range(50):
            assert client.get(KEYS[0]) == b"v" * 1000
            assert client.exists(KEYS[0])
    got = "\n".join(_metrics(daemon))
    assert 'op="get",status="ok"} 50.0' in got and 'op="exists",status="ok"} 50.0' in got
    assert 'kvoffload_request_seconds_count{front="native",op="get"} 50.0' in got
    block = re.search(r'payload_bytes_in_total\{front="native"\} (\S+)', got)  # with its header
    assert block is not None
    assert f'payload_bytes_out_total{{front="native"}} {50 * float(block.group(1))}' in got
    if path == "c":
        assert _server(daemon)["hot_reader_requests"] >= 99  # one get may follow the put


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_client_closing_mid_frame_costs_only_its_connection(
    start_daemon: Start, path: str
) -> None:
    daemon = start_daemon(env=PATHS[path])
    with Client.connect(daemon.url()) as client:
        client.put(KEYS[0], b"v" * 1000)
        raw = Raw(daemon.port)
        raw.sock.sendall(raw.conn.send(Get(2, KEYS[0])))
        assert raw.read(1)[-1][1].endswith(b"v" * 1000)  # type: ignore[index]  # its header first
        raw.sock.sendall(raw.conn.send(Get(3, KEYS[0]))[:30])
        raw.sock.close()
        server = lambda: client.stats().store["server"]  # noqa: E731
        assert eventually(lambda: server()["connections"] == 1)  # type: ignore[index]  # this one
        assert pinned(client) == 0 and client.get(KEYS[0]) == b"v" * 1000
    # closed mid-frame: the codec's protocol error, counted once, on either path
    assert 'kvoffload_protocol_errors_total{front="native"} 1.0' in _metrics_text(daemon)


def _metrics_text(daemon: Any) -> list[str]:
    text: str = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    return [line for line in text.splitlines() if not line.startswith("#")]


IDLE = "[native]\nidle_timeout_s = 1.5\n"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_idle_timeout_counts_what_the_c_reader_received(start_daemon: Start, path: str) -> None:
    """Requests read in C keep a connection alive; one that then goes quiet is closed as idle."""
    daemon = start_daemon(config=IDLE, env=PATHS[path])
    with Client.connect(daemon.url()) as client:
        client.put(KEYS[0], b"v" * 100)
    raw = Raw(daemon.port)
    end = time.monotonic() + 4.5  # three idle timeouts, a get every 0.2 s
    rid = 2
    while time.monotonic() < end:
        raw.sock.sendall(raw.conn.send(Get(rid, KEYS[0])))
        assert raw.read(1)[-1][1].endswith(b"v" * 100)  # type: ignore[index]
        rid += 1
        time.sleep(0.2)
    assert refused(daemon, "idle timeout") == 0
    goodbye = raw.read(2)  # then quiet: the daemon says why, and closes
    assert isinstance(goodbye[0], ErrorReply) and "idle timeout" in goodbye[0].message
    assert isinstance(goodbye[1], ConnectionClosed)
    assert refused(daemon, "idle timeout") == 1
    if path == "c":
        assert _server(daemon)["hot_reader_requests"] >= rid - 3


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_daemon_stops_with_clients_idle_in_the_c_reader(start_daemon: Start, path: str) -> None:
    daemon = start_daemon(env=PATHS[path])
    clients = [Client.connect(daemon.url(retries="0")) for _ in range(3)]
    try:
        clients[0].put(KEYS[0], b"v" * 100)
        for client in clients:  # the first get read in Python, the second in C
            assert client.get(KEYS[0]) == client.get(KEYS[0]) == b"v" * 100
        # then each waits for its next request (in C on the C core)
        hot = _server(daemon)["hot_reader_requests"]
        assert (hot >= 2) == (path == "c")
        assert daemon.stop() == 0  # SIGTERM: every session stops, the daemon exits cleanly
        assert "Traceback" not in daemon.stderr()
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_answers_a_full_socket_leaves_stay_pinned_until_the_reader_goes(
    start_daemon: Start, path: str
) -> None:
    """Gets read in C whose answers the kernel does not take whole: the rest is queued in
    Python, pinned, and given back when the reader disconnects."""
    daemon = start_daemon("--dram", "32MiB", env=PATHS[path])
    with Client.connect(daemon.url()) as client:
        for key in KEYS:
            client.put(key, bytes([key[-1]]) * MIB)
        raw = Raw(daemon.port, small_window(daemon.port, 4096))
        raw.sock.sendall(raw.conn.send(Get(2, KEYS[0])))  # answered in C: the next read is C's
        raw.read(1)
        raw.sock.sendall(b"".join(raw.conn.send(Get(3 + i, KEYS[i % 8])) for i in range(24)))
        assert eventually(lambda: pinned(client) > 0)
        if path == "c":
            assert _server(daemon)["hot_reader_requests"] >= 1
        raw.sock.close()
        assert eventually(lambda: pinned(client) == 0)
        assert client.get(KEYS[0]) == bytes([KEYS[0][-1]]) * MIB


def test_a_run_of_puts_stays_in_the_c_reader(start_daemon: Start) -> None:
    """The C reader takes canonical puts too (`HotGets.take_puts`) and stays armed after the
    puts it answers: a run of puts (1 KiB, and 64 KiB ones read a header at a time) neither
    hands back at every put nor leaves the C reader."""
    daemon = start_daemon(env=PATHS["c"])
    with Client.connect(daemon.url()) as client:
        client.put(KEYS[0], b"v" * 1000)
        assert client.get(KEYS[0]) == client.get(KEYS[0])  # the second read in C
        before = client.stats().store["server"]
        for i in range(20):
            client.put(KEYS[i % 8], bytes([i]) * (1000 if i < 10 else 65536))
        server = client.stats().store["server"]
        for i in range(12, 20):
            assert client.get(KEYS[i % 8]) == bytes([i]) * 65536
    # the first put after the stats request (answered in Python) is Python's; it arms the C
    # reader, which takes the other 19 and hands back only the last stats request
    assert server["hot_reader_handbacks"] == before["hot_reader_handbacks"] + 1, server  # type: ignore[index, operator]
    assert server["hot_reader_puts"] - before["hot_reader_puts"] == 19, server  # type: ignore[index, operator]
