"""`cluster+etcd://` clients and challenge–response at Hello, against a real etcd: each node
must prove it is the node of its record, so a record that leads to another node (what a rogue
member relaying that node's challenge presents) is refused; a registered node proves the id
it registered under, configured or generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from etcd_server import EtcdServer

from kvoffload.client_sdk import Client
from kvoffload.errors import KVOffloadError
from kvoffload.wire.membership import Member, encode_member, nodes_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
Start = Callable[..., Any]

SECRET = "alice-secret-0123456789"
TENANT = f'[tenants.alice]\ntoken = "{SECRET}"\n'


def _record(etcd: EtcdServer, cluster: str, node_id: str, port: int) -> None:
    member = Member(node_id, {"native": f"127.0.0.1:{port}"}, 1.0, "n")
    etcd.put(nodes_prefix(cluster) + node_id.encode(), encode_member(member))


def _url(etcd: EtcdServer, cluster: str) -> str:
    return f"cluster+etcd://{etcd.endpoint}/{cluster}?token={SECRET}&timeout=5"


def test_a_record_that_leads_to_another_node_is_refused(
    etcd: EtcdServer, start_daemon: Start
) -> None:
    n1 = start_daemon(config=f'[cluster]\nnode_id = "n1"\n{TENANT}')
    _record(etcd, "honest", "n1", n1.port)
    _record(etcd, "relay", "n2", n1.port)  # "n2"'s record, but n1 answers there
    with Client.connect(_url(etcd, "honest")) as honest:
        honest.put(bytes(16), b"through n1")
        assert honest.get(bytes(16)) is not None
    with Client.connect(_url(etcd, "relay")) as relayed, pytest.raises(KVOffloadError):
        relayed.put(bytes(range(16)), b"never stored")
    with Client.connect(n1.url(token=SECRET)) as direct:
        assert direct.get(bytes(range(16))) is None


def test_a_registered_node_proves_the_id_it_registered_under(
    etcd: EtcdServer, start_daemon: Start
) -> None:
    # No [cluster] node_id: the node generates one, registers under it and proves it.
    start_daemon("--cluster", f"etcd://{etcd.endpoint}/gen", config=TENANT)
    with Client.connect(_url(etcd, "gen")) as client:
        client.put(bytes(16), b"x")
        assert client.get(bytes(16)) is not None
