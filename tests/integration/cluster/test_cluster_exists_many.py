"""`exists_many` over `cluster+etcd://`: members from a real etcd, storage nodes that are real
daemons on 127.0.0.1 (their records written by the test, as in `test_etcd_membership`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest
from etcd_server import EtcdServer

from kvoffload.client_sdk import AsyncClient, Client
from kvoffload.client_sdk.cluster import Member
from kvoffload.wire.membership import encode_member, nodes_prefix
from tests.conftest import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_exists_many_over_cluster_etcd(
    etcd: EtcdServer, start_daemon: Callable[..., Daemon]
) -> None:
    nodes = [start_daemon(), start_daemon()]
    for i, node in enumerate(nodes):
        member = Member(f"kv-{i}", {"native": f"127.0.0.1:{node.port}"}, 1.0, "n")
        etcd.put(nodes_prefix("prod") + member.node_id.encode(), encode_member(member))
    url = f"cluster+etcd://{etcd.endpoint}/prod?replicas=1"
    keys = [os.urandom(16) for _ in range(40)]
    expected = [i % 4 != 0 for i in range(len(keys))]
    with Client.connect(url) as client:
        client.put_many([(k, b"v") for k, there in zip(keys, expected, strict=True) if there])
        assert client.exists_many(keys) == expected
        # One copy each (replicas=1): both nodes hold some, and each answers for its own.
        held = []
        for node in nodes:
            with Client.connect(node.url()) as one:
                held.append(one.exists_many(keys))
        assert all(any(h) for h in held)
        assert [a or b for a, b in zip(*held, strict=True)] == expected

    async def main() -> list[bool]:
        async with AsyncClient.connect(url) as a:
            return await a.exists_many(keys)

    assert asyncio.run(main()) == expected
