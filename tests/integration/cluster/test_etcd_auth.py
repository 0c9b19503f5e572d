"""A locked-down cluster against a real etcd with auth and TLS on (client certificates too),
and storage nodes that serve TLS: only nodes' credentials can register a node (the rogue record
of trust issue 27, defect 2, is refused), clients read with read-only credentials, and
`cluster+etcds://...&tls=1` clients put and get through TLS nodes (defect 6)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from etcd_server import EtcdServer, Pki, make_pki

from kvoffload.client_sdk import Client
from kvoffload.client_sdk.cluster.gateway import EtcdGateway
from kvoffload.client_sdk.cluster.membership import EtcdMembership, read_members
from kvoffload.errors import AuthError, ConfigError, TransportError
from kvoffload.nvmeof_target.cluster.etcd import EtcdClient
from kvoffload.wire.membership import (
    EtcdAccess,
    Member,
    claim_request,
    encode_member,
    get_request,
    nodes_prefix,
    parse_etcd_url,
    parse_range,
    range_request,
    revoke_request,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLUSTER = "locked"
# A password with characters a URL must escape, as real ones have.
PASSWORDS = {"root": "r00t-pw", "node": "n0de/pw:@x", "reader": "re@d/pw:1 %"}
Start = Callable[..., Any]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def locked_etcd(tmp_path: Path, pki: Pki) -> Iterator[EtcdServer]:
    """etcd over TLS (client certificates required) with auth on and the documented roles."""
    server = EtcdServer(tmp_path / "etcd", pki=pki)
    server.start()
    try:
        server.lock_down(CLUSTER, PASSWORDS)
        yield server
    finally:
        server.stop()


def _tls_query(pki: Pki, prefix: str = "") -> str:
    return f"{prefix}ca={pki.ca}&{prefix}cert={pki.client_cert}&{prefix}key={pki.client_key}"


def _password_file(tmp_path: Path, user: str) -> Path:
    path = tmp_path / f"{user}.password"
    path.write_text(PASSWORDS[user] + "\n")
    path.chmod(0o600)
    return path


def _node_url(etcd: EtcdServer, pki: Pki, tmp_path: Path, user: str = "node") -> str:
    # The password from a file: nothing secret on the command line.
    secret = _password_file(tmp_path, user)
    return f"etcds://{user}@{etcd.endpoint}/{CLUSTER}?{_tls_query(pki)}&password_file={secret}"


def _access(pki: Pki, user: str, password: str) -> EtcdAccess:
    return EtcdAccess(
        True, user, password, "", str(pki.ca), str(pki.client_cert), str(pki.client_key)
    )


def _client_url(
    etcd: EtcdServer, pki: Pki, password: str = PASSWORDS["reader"], **params: str
) -> str:
    query = _tls_query(pki, "etcd_") + "".join(f"&{k}={v}" for k, v in params.items())
    return f"cluster+etcds://reader:{quote(password, safe='')}@{etcd.endpoint}/{CLUSTER}?{query}"


def _tls_node(start_daemon: Start, etcd: EtcdServer, pki: Pki, tmp_path: Path, *extra: str) -> Any:
    return start_daemon(
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--cluster", _node_url(etcd, pki, tmp_path), *extra,
    )  # fmt: skip


def _root_token(etcd: EtcdServer) -> str:
    answer = etcd.call("/v3/auth/authenticate", {"name": "root", "password": PASSWORDS["root"]})
    return str(answer["token"])


def _serve(
    *flags: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvoffload serve` expected to stop at start: its exit status and output."""
    argv = [
        sys.executable, "-m", "kvoffload.cli", "serve", "--port", "0", "--nvme-port", "0",
        "--metrics-port", "0", "--dram", "64MiB", "--ssd", "0",
        "--data-dir", str(tmp_path / "refused"), *flags,
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    environ.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=environ)


def test_a_reader_cannot_register_a_node_and_a_node_can(
    locked_etcd: EtcdServer, pki: Pki, tmp_path: Path, start_daemon: Start
) -> None:
    prefix = nodes_prefix(CLUSTER)
    rogue = Member("rogue", {"native": "10.9.9.9:7480"}, 1_000_000.0, "x")
    # Defect 2's attack with a client's credentials: one record under nodes/.
    reader = EtcdGateway(
        locked_etcd.host, locked_etcd.port, 5.0, _access(pki, "reader", PASSWORDS["reader"])
    )
    with pytest.raises(AuthError, match="permission denied"):
        reader.call(claim_request(prefix + b"rogue", encode_member(rogue), 0))
    # Nor without any credentials, with the CA's client certificate alone.
    anonymous = EtcdGateway(locked_etcd.host, locked_etcd.port, 5.0, _access(pki, "", ""))
    with pytest.raises(AuthError):
        anonymous.call(claim_request(prefix + b"rogue", encode_member(rogue), 0))
    # A daemon given the reader's credentials stops at start, saying why.
    refused = _serve(
        "--cluster", _node_url(locked_etcd, pki, tmp_path, "reader"), tmp_path=tmp_path
    )
    assert refused.returncode == 2, refused.stderr
    assert "permission denied" in refused.stderr and PASSWORDS["reader"] not in refused.stderr
    # The node's credentials register it; the reader sees it and nothing else.
    node = _tls_node(start_daemon, locked_etcd, pki, tmp_path)
    members = read_members(
        locked_etcd.host,
        locked_etcd.port,
        CLUSTER,
        access=_access(pki, "reader", PASSWORDS["reader"]),
    )
    assert [m.fronts["native+tls"] for m in members] == [f"127.0.0.1:{node.port}"]
    # etcd holds exactly the node's record: the refused attempts left nothing behind.
    listing = locked_etcd.call(*range_request(prefix), _root_token(locked_etcd))
    assert len(listing["kvs"]) == 1  # type: ignore[arg-type]
    assert PASSWORDS["node"] not in "\n".join(node.lines) + node.stderr()
    # `cluster status` with a node's kind of URL, the reader's password in it: the TLS node is up
    # (checked against --ca), and the password is nowhere in what it prints.
    password = quote(PASSWORDS["reader"], safe="")
    url = f"etcds://reader:{password}@{locked_etcd.endpoint}/{CLUSTER}?{_tls_query(pki)}"
    argv = [sys.executable, "-m", "kvoffload.cli", "cluster", "status", url, "--ca", str(pki.ca)]
    status = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "1/1 node(s) up" in " ".join(status.stdout.split())
    assert PASSWORDS["reader"] not in status.stdout + status.stderr


def test_wrong_or_missing_credentials_are_clear_errors(
    locked_etcd: EtcdServer, pki: Pki, tmp_path: Path
) -> None:
    with pytest.raises(AuthError, match="authentication failed") as caught:
        Client.connect(_client_url(locked_etcd, pki, password="wrong-pw"))
    assert "wrong-pw" not in str(caught.value)
    with pytest.raises(AuthError, match="etcd refused a client without credentials"):
        EtcdMembership(locked_etcd.host, locked_etcd.port, CLUSTER, access=_access(pki, "", ""))
    # A node with a wrong password stops at start; the password is in no line it writes.
    secret = tmp_path / "bad.password"
    secret.write_text("not-the-node-pw\n")
    url = f"etcds://node@{locked_etcd.endpoint}/{CLUSTER}?{_tls_query(pki)}&password_file={secret}"
    refused = _serve("--cluster", url, tmp_path=tmp_path)
    assert refused.returncode == 2 and "authentication failed" in refused.stderr, refused.stderr
    assert "not-the-node-pw" not in refused.stdout + refused.stderr
    # etcd's certificate is checked: a client that trusts another CA cannot even list.
    other = make_pki(tmp_path / "other", "another CA")
    stranger = EtcdAccess(True, "reader", PASSWORDS["reader"], "", str(other.ca))
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        read_members(locked_etcd.host, locked_etcd.port, CLUSTER, access=stranger)


def test_tls_nodes_serve_a_tls_cluster_client(
    locked_etcd: EtcdServer, pki: Pki, tmp_path: Path, start_daemon: Start
) -> None:
    # One single-process node and one with two workers (each registers its native+tls front).
    nodes = [
        _tls_node(start_daemon, locked_etcd, pki, tmp_path),
        _tls_node(start_daemon, locked_etcd, pki, tmp_path, "--workers", "2"),
    ]
    blocks = {bytes([i]) * 16: bytes([i]) * 4096 for i in range(1, 41)}
    url = _client_url(locked_etcd, pki, replicas="2", tls="1", ca=str(pki.ca))
    with Client.connect(url) as client:
        assert len(_nodes(client)) == 2
        client.put_many(list(blocks.items()))
        assert client.get_many(list(blocks)) == list(blocks.values())
        # replicas=2 over two nodes: every block on each node, each reached over TLS.
        assert {n["up"] for n in _nodes(client).values()} == {True}
    for node in nodes:
        with Client.connect(node.url(tls="1", ca=str(pki.ca))) as direct:
            assert direct.get_many(list(blocks)) == list(blocks.values())
    # The same nodes as a static cluster://, TLS too.
    static = ",".join(f"127.0.0.1:{node.port}" for node in nodes)
    with Client.connect(f"cluster://{static}?replicas=2&tls=1&ca={pki.ca}") as client:
        assert client.get_many(list(blocks)) == list(blocks.values())
        client.put_many([(b"s" * 16, b"static" * 700)])
        assert client.get(b"s" * 16) == b"static" * 700
    with pytest.raises(ConfigError, match="tls must be 0 or 1"):
        Client.connect(f"cluster://{static}?tls=yes")
    # The same cluster without tls=1: a clear error, not "no storage node can be reached".
    with Client.connect(_client_url(locked_etcd, pki)) as plain:
        with pytest.raises(ConfigError, match="tls=1"):
            plain.get(next(iter(blocks)))
        with pytest.raises(ConfigError, match="tls=1"):
            plain.put_many([(bytes(16), b"x" * 4096)])
    # A plaintext node joins: a tls=1 client skips it like a down node and keeps serving; a put
    # of a key it ranks among its replicas + 1 is stored on the TLS nodes but not acknowledged
    # (the plaintext member, which this client cannot reach, could hold an older copy).
    plain = start_daemon("--cluster", _node_url(locked_etcd, pki, tmp_path))
    more = {bytes([i]) * 16: bytes([i]) * 4096 for i in range(100, 140)}
    with Client.connect(url) as client:
        assert len(_nodes(client)) == 3
        with pytest.raises(TransportError, match="not acknowledged"):
            client.put_many(list(more.items()))
        assert client.get_many(list(more)) == list(more.values())
        (skipped,) = [n for n in _nodes(client).values() if "native+tls" not in n["fronts"]]  # type: ignore[operator]
        assert skipped["fronts"]["native"] == f"127.0.0.1:{plain.port}"  # type: ignore[index]
        assert skipped["up"] is False
    # tls=1 with a CA that did not sign the nodes' certificates: no node is trusted.
    other = make_pki(tmp_path / "other", "another CA")
    with Client.connect(_client_url(locked_etcd, pki, tls="1", ca=str(other.ca))) as stranger:
        assert stranger.get(next(iter(blocks))) is None
        with pytest.raises(TransportError):
            stranger.put_many([(bytes(16), b"x" * 4096)])


def _nodes(client: Client) -> dict[str, dict[str, object]]:
    nodes = client.stats().store["nodes"]
    assert isinstance(nodes, dict)
    return nodes


def test_a_lapsed_token_is_renewed(
    locked_etcd: EtcdServer, pki: Pki, tmp_path: Path, start_daemon: Start
) -> None:
    """etcd forgets a token unused for --auth-token-ttl seconds (HTTP 401 then): clients and
    nodes authenticate again instead of failing for good."""
    locked_etcd.stop()
    locked_etcd.extra_args = ["--auth-token-ttl", "1"]
    locked_etcd.start()
    node = _tls_node(start_daemon, locked_etcd, pki, tmp_path)
    reader = EtcdGateway(
        locked_etcd.host, locked_etcd.port, 5.0, _access(pki, "reader", PASSWORDS["reader"])
    )
    endpoint = parse_etcd_url(_node_url(locked_etcd, pki, tmp_path))
    as_node = EtcdClient(endpoint, 5.0)  # the node's own client, as its registration uses it
    for gateway in (reader, as_node):
        assert len(gateway.call(range_request(nodes_prefix(CLUSTER)))["kvs"]) == 1
    time.sleep(3)  # past the TTL (etcd checks it every second): both tokens are gone
    for gateway in (reader, as_node):
        assert len(gateway.call(range_request(nodes_prefix(CLUSTER)))["kvs"]) == 1
    # The node's password rotated, in its file and in etcd: the next token uses the new one, for
    # the daemon as for this client of the same file (a renewal that falls between the two
    # changes fails once, is logged, and the next keepalive succeeds).
    (tmp_path / "node.password").write_text("rotated-pw\n")
    changed: dict[str, object] = {"name": "node", "password": "rotated-pw"}
    locked_etcd.call("/v3/auth/user/changepw", changed, _root_token(locked_etcd))
    time.sleep(3)
    assert len(as_node.call(range_request(nodes_prefix(CLUSTER)))["kvs"]) == 1
    with Client.connect(_client_url(locked_etcd, pki, tls="1", ca=str(pki.ca))) as client:
        client.put_many([(bytes(16), b"x" * 4096)])
        assert client.get(bytes(16)) == b"x" * 4096
    # The daemon kept its lease alive through all this: 8 s after the rotation (two keepalive
    # rounds of 3.3 s; 10 s TTL) a lease it had stopped renewing there would have < 2 s left.
    time.sleep(5)
    _, kvs = parse_range(reader.call(range_request(nodes_prefix(CLUSTER))))
    (record,) = kvs
    lease = locked_etcd.call(
        "/v3/lease/timetolive", {"ID": str(record.lease)}, _root_token(locked_etcd)
    )
    assert int(str(lease["TTL"])) > 4, lease
    assert node.proc.poll() is None and "rotated-pw" not in node.stderr()


# Per-node etcd users (trust issue 27, defect 2): each node's role may write only its own record.
NODE_PASSWORDS = {"a": "a-pw/1:@", "b": "b-pw/2:@"}


@pytest.fixture
def per_node_etcd(tmp_path: Path, pki: Pki) -> Iterator[EtcdServer]:
    """As locked_etcd, with the per-node layout for nodes a and b (a user and role each)."""
    server = EtcdServer(tmp_path / "etcd", pki=pki)
    server.start()
    try:
        server.lock_down(CLUSTER, PASSWORDS, per_node=NODE_PASSWORDS)
        yield server
    finally:
        server.stop()


def _per_node_env(pki: Pki, tmp_path: Path, node_id: str, user: str = "") -> dict[str, str]:
    """A node's identity and etcd user as deploy/kubernetes sets them: environment keys."""
    secret = tmp_path / f"{node_id}.password"
    secret.write_text(NODE_PASSWORDS[node_id] + "\n")
    secret.chmod(0o600)
    return {
        "KVOFFLOAD_CLUSTER__NODE_ID": node_id,
        "KVOFFLOAD_CLUSTER__ETCD_USER": user or f"kvoffload-{CLUSTER}-node-{node_id}",
        "KVOFFLOAD_CLUSTER__ETCD_PASSWORD_FILE": str(secret),
        "KVOFFLOAD_CLUSTER__ETCD_CA": str(pki.ca),
        "KVOFFLOAD_CLUSTER__ETCD_CERT": str(pki.client_cert),
        "KVOFFLOAD_CLUSTER__ETCD_KEY": str(pki.client_key),
    }


def test_a_nodes_credentials_write_only_its_own_record(
    per_node_etcd: EtcdServer, pki: Pki, tmp_path: Path, start_daemon: Start
) -> None:
    etcd, prefix = per_node_etcd, nodes_prefix(CLUSTER)
    url = f"etcds://{etcd.endpoint}/{CLUSTER}"
    tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    nodes = {
        node_id: start_daemon(*tls, "--cluster", url, env=_per_node_env(pki, tmp_path, node_id))
        for node_id in ("a", "b")
    }
    reader = _access(pki, "reader", PASSWORDS["reader"])
    members = {m.node_id: m for m in read_members(etcd.host, etcd.port, CLUSTER, access=reader)}
    assert {k: m.fronts["native+tls"] for k, m in members.items()} == {
        k: f"127.0.0.1:{node.port}" for k, node in nodes.items()
    }
    # Node a's stolen credentials, used as an attacker would: every write that touches b's
    # record, or makes a record of a new node, is refused by etcd itself.
    user_a, password = f"kvoffload-{CLUSTER}-node-a", quote(NODE_PASSWORDS["a"], safe="")
    as_a = EtcdClient(
        parse_etcd_url(f"etcds://{user_a}:{password}@{etcd.endpoint}/{CLUSTER}?{_tls_query(pki)}"),
        5.0,
    )
    rogue_b = encode_member(Member("b", {"native": "10.9.9.9:7480"}, 1_000_000.0, "x"))
    b_key = prefix + b"b"
    (b_record,) = parse_range(etcd.call(*get_request(b_key), _root_token(etcd)))[1]
    attacks = {
        "replace b's record": claim_request(b_key, rogue_b, 0, b_record.mod_revision),
        "put at b's key": ("/v3/kv/put", {"key": _b64(b_key), "value": _b64(rogue_b)}),
        "delete b's record": ("/v3/kv/deleterange", {"key": _b64(b_key)}),
        "delete the prefix": (
            "/v3/kv/deleterange",
            {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + b"0")},
        ),
        "revoke b's lease": revoke_request(b_record.lease),
        "add a node": claim_request(prefix + b"rogue", encode_member(Member("rogue")), 0),
        "write node ab (a prefix match)": claim_request(prefix + b"ab", b"{}", 0),
    }
    for what, request in attacks.items():
        with pytest.raises(AuthError, match="permission denied"):
            as_a.call(request)
            pytest.fail(f"node a's credentials could {what}")
    # Its own key a may write, but a record there naming b is not b's: clients ignore it.
    own = parse_range(as_a.call(get_request(prefix + b"a")))[1][0]
    as_a.call(claim_request(prefix + b"a", rogue_b, own.lease, own.mod_revision))
    members = {m.node_id: m for m in read_members(etcd.host, etcd.port, CLUSTER, access=reader)}
    assert set(members) == {"b"}
    assert members["b"].fronts["native+tls"] == f"127.0.0.1:{nodes['b'].port}"
    # b is untouched and serves a TLS client through membership.
    with Client.connect(_client_url(etcd, pki, tls="1", ca=str(pki.ca))) as client:
        client.put_many([(bytes([i]) * 16, bytes([i]) * 4096) for i in range(1, 9)])
        assert client.get(bytes([1]) * 16) == bytes([1]) * 4096
    # A daemon started as node b with a's user stops at start, naming the key its role lacks.
    env = _per_node_env(pki, tmp_path, "b", user=user_a)
    env["KVOFFLOAD_CLUSTER__ETCD_PASSWORD_FILE"] = str(tmp_path / "a.password")
    refused = _serve("--cluster", url, tmp_path=tmp_path, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "permission denied" in refused.stderr
    assert f"readwrite on key /kvoffload/{CLUSTER}/nodes/b" in refused.stderr
    assert NODE_PASSWORDS["a"] not in refused.stdout + refused.stderr
    for node in nodes.values():
        assert node.proc.poll() is None
        assert not any(p in node.stderr() for p in NODE_PASSWORDS.values())


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
