"""`nvme+tcp://` URLs and the host's option checks (no sockets)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest

from kvoffload.client_sdk.transports import open_transport
from kvoffload.client_sdk.transports.base import ThreadedAsyncTransport
from kvoffload.client_sdk.transports.nvme import DEFAULT_SUBNQN, NvmeOptions
from kvoffload.client_sdk.url import parse_url
from kvoffload.errors import ConfigError
from tests.conftest import Daemon


def test_url_parameters() -> None:
    url = parse_url(
        "nvme+tcp://10.0.0.5:4421/nqn.2026-01.org.example:kv?hostnqn=nqn.2026-01.org.example:h1"
        "&nsid=2&queues=8&depth=64&hdgst=1&ddgst=0&kato=5000&timeout=3&retries=1"
    )
    o = NvmeOptions.from_url(url)
    assert (o.host, o.port, o.subnqn, o.hostnqn) == (
        "10.0.0.5",
        4421,
        "nqn.2026-01.org.example:kv",
        "nqn.2026-01.org.example:h1",
    )
    assert (o.nsid, o.queues, o.depth, o.hdgst, o.ddgst, o.kato_ms) == (2, 8, 64, True, False, 5000)
    assert (o.timeout, o.retries) == (3.0, 1) and len(o.hostid) == 16
    assert o.url == "nvme+tcp://10.0.0.5:4421/nqn.2026-01.org.example:kv"


def test_defaults() -> None:
    o = NvmeOptions.from_url(parse_url("nvme+tcp://127.0.0.1"))
    assert (o.port, o.subnqn, o.queues, o.depth, o.kato_ms) == (4420, DEFAULT_SUBNQN, 4, 32, 15000)
    assert o.hostnqn.startswith("nqn.") and o.hostnqn == NvmeOptions().hostnqn  # stable


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nvme+tcp://h/nqn.a:b?bogus=1", "unknown"),
        ("nvme+tcp://h/nqn.a:b?queues=0", "queues"),
        ("nvme+tcp://h/nqn.a:b?depth=x", "bad nvme"),
        ("nvme+tcp://h/nqn.a:b?hdgst=yes", "hdgst"),
        ("nvme+tcp://h/nqn.a:b?timeout=0", "timeouts"),
        ("nvme+tcp://h/" + "x" * 300, "NQN"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NvmeOptions.from_url(parse_url(url))


class _Where:
    """A real transport, recording which thread each of its index calls ran in."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> object:
        method = getattr(self._inner, name)
        if name not in ("exists", "exists_many", "lookup", "lookup_tiers", "delete"):
            return method

        def recorded(*args: object) -> object:
            self.threads.append(threading.get_ident())
            return method(*args)

        return recorded


def test_the_async_api_runs_nvme_index_calls_off_the_event_loop(
    start_daemon: Callable[..., Daemon],
) -> None:
    # An NVMe/TCP index call waits on the network (up to its deadline): inline, it stalled
    # the event loop. local:// answers from memory and stays inline (`index_inline`).
    daemon = start_daemon()
    nvme = _Where(open_transport(parse_url(daemon.nvme_url())))
    local = _Where(open_transport(parse_url("local://")))
    keys = [os.urandom(16) for _ in range(3)]

    async def main() -> int:
        for where in (nvme, local):
            threaded = ThreadedAsyncTransport(where)  # type: ignore[arg-type]
            assert await threaded.exists_many(keys) == [False] * 3
            assert not await threaded.exists(keys[0])
            assert await threaded.lookup(keys) == 0
            await threaded.lookup_tiers(keys)
            assert not await threaded.delete(keys[0])
            await threaded.close()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(nvme.threads) == len(local.threads) == 5
    assert loop_thread not in nvme.threads
    assert set(local.threads) == {loop_thread}
