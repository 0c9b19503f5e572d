"""The `kv://` clients against a real daemon that closes connections on its own (idle timeout):
a request on a connection the daemon has said goodbye to is carried by a fresh one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest
from probes import eventually, refused

from kvoffload.client_sdk import AsyncClient, Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Start = Callable[..., Any]

IDLE = "[native]\nidle_timeout_s = 1.0\n"


def test_a_pooled_connection_the_daemon_closed_as_idle_is_replaced(start_daemon: Start) -> None:
    daemon = start_daemon(config=IDLE)
    key, value = os.urandom(16), os.urandom(1000)
    # One pooled connection and no retries: only reconnecting on a goodbye can serve the get.
    with Client.connect(daemon.url(pool="1", retries="0")) as client:
        client.put(key, value)
        closed_before = refused(daemon, "idle timeout")
        assert eventually(lambda: refused(daemon, "idle timeout") > closed_before)
        assert client.get(key) == value
        assert client.exists(key)


def test_the_async_client_reconnects_after_an_idle_goodbye(start_daemon: Start) -> None:
    daemon = start_daemon(config=IDLE)
    key, value = os.urandom(16), os.urandom(1000)

    async def main() -> None:
        async with AsyncClient.connect(daemon.url(retries="0")) as client:
            await client.put(key, value)
            closed_before = refused(daemon, "idle timeout")
            assert eventually(lambda: refused(daemon, "idle timeout") > closed_before)
            assert await client.get(key) == value

    asyncio.run(main())
