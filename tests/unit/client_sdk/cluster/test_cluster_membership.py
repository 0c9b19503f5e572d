"""Membership records, the etcd gateway messages and cluster URLs (no etcd: codecs only)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kvoffload.client_sdk.cluster import StaticMembership, parse_cluster_url
from kvoffload.errors import ConfigError, InvalidArgumentError, RemoteProtocolError
from kvoffload.nvmeof_target.cluster.config import ClusterConfig
from kvoffload.wire import membership as etcd

PREFIX = etcd.nodes_prefix("prod")


def _member(node_id: str = "kv-1", **kw: object) -> etcd.Member:
    fronts = {"native": "10.0.0.5:7480", "nvme": "10.0.0.5:4420/nqn.2026-11.io.kvoffload:store"}
    return etcd.Member(node_id, kw.pop("fronts", fronts), **kw)  # type: ignore[arg-type]


def test_a_record_round_trips() -> None:
    member = _member(weight=3.5, nonce="abc")
    assert etcd.decode_member(PREFIX + b"kv-1", etcd.encode_member(member), PREFIX) == member
    assert PREFIX == b"/kvoffload/prod/nodes/"


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (b"/kvoffload/other/nodes/kv-1", None, "not under"),
        (PREFIX + b"kv-1", b"not json", "not JSON"),
        (PREFIX + b"kv-1", b"[1]", "version"),
        (PREFIX + b"kv-1", json.dumps({"v": 2, "node_id": "kv-1"}).encode(), "version"),
        (PREFIX + b"kv-2", None, "names node"),
        (PREFIX + b"kv-1", json.dumps({"v": 1, "node_id": "kv-1", "fronts": 3}).encode(), "table"),
        (PREFIX + b"kv-1", None, "weight"),
        (PREFIX + b"kv-1", b" " * 5000, "bytes"),
    ],
)
def test_malformed_or_foreign_records_are_protocol_errors(
    key: bytes, value: bytes | None, says: str
) -> None:
    if value is None:
        good = json.loads(etcd.encode_member(_member()))
        if says == "weight":
            good["weight"] = -1
        value = json.dumps(good).encode()
    with pytest.raises(RemoteProtocolError, match=says):
        etcd.decode_member(key, value, PREFIX)


@pytest.mark.parametrize("bad", ["", "a b", "-x", "x" * 64, "é", "a/b"])
def test_names_are_plain(bad: str) -> None:
    with pytest.raises(InvalidArgumentError):
        etcd.check_name(bad, "node id")


def test_members_check_their_fields() -> None:
    with pytest.raises(InvalidArgumentError, match="front address"):
        _member(fronts={"native": "no port"})
    with pytest.raises(InvalidArgumentError, match="weight"):
        _member(weight=float("nan"))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_range_covers_exactly_the_prefix() -> None:
    path, body = etcd.range_request(PREFIX)
    assert path == "/v3/kv/range"
    assert base64.b64decode(body["range_end"]) == b"/kvoffload/prod/nodes0"
    answer = {
        "header": {"revision": "7"},
        "kvs": [{"key": _b64(PREFIX + b"a"), "value": _b64(b"v"), "mod_revision": "5"}],
    }
    revision, kvs = etcd.parse_range(answer)
    assert revision == 7 and kvs == [etcd.KeyValue(PREFIX + b"a", b"v", 5, 0)]
    assert etcd.parse_range({"header": {"revision": "3"}}) == (3, [])


def test_claim_compares_creation_or_the_stale_records_revision() -> None:
    _, fresh = etcd.claim_request(b"k", b"v", 9)
    assert fresh["compare"][0]["target"] == "CREATE"
    assert fresh["success"][0]["request_put"]["lease"] == "9"
    _, replace = etcd.claim_request(b"k", b"v", 9, replace_revision=41)
    assert replace["compare"][0] == {
        "key": _b64(b"k"), "result": "EQUAL", "target": "MOD", "mod_revision": "41"
    }  # fmt: skip
    assert etcd.parse_claim({"succeeded": True}) == (True, None)
    held = {"responses": [{"response_range": {"kvs": [{"key": _b64(b"k"), "value": _b64(b"x")}]}}]}
    assert etcd.parse_claim(held) == (False, etcd.KeyValue(b"k", b"x", 0, 0))
    assert etcd.parse_claim({"responses": [{"response_range": {}}]}) == (False, None)


def test_leases_and_their_expiry() -> None:
    assert etcd.parse_grant({"ID": "123", "TTL": "5"}) == 123
    with pytest.raises(RemoteProtocolError):
        etcd.parse_grant({"error": "too many leases"})
    assert etcd.lease_ttl({"result": {"ID": "123", "TTL": "5"}}) == 5
    assert etcd.lease_ttl({"result": {"ID": "123"}}) == 0  # expired: the gateway omits TTL 0


def test_watch_messages() -> None:
    put = {"kv": {"key": _b64(b"a"), "value": _b64(b"v"), "mod_revision": "4"}}
    gone = {"type": "DELETE", "kv": {"key": _b64(b"b"), "mod_revision": "5"}}
    line = json.dumps({"result": {"events": [put, gone]}}).encode()
    events, ended = etcd.parse_watch(line)
    assert events == [etcd.WatchEvent(b"a", b"v", 4), etcd.WatchEvent(b"b", None, 5)]
    assert not ended
    assert etcd.parse_watch(b'{"result": {"created": true}}') == ([], False)
    assert etcd.parse_watch(b'{"result": {"canceled": true}}')[1]
    assert etcd.parse_watch(b'{"result": {"compact_revision": "9"}}')[1]
    for bad in (b"{", b'{"error": {"message": "transport is closing"}}', b'{"result": {"events":'
                b' [{"kv": {"key": 5}}]}}'):  # fmt: skip
        with pytest.raises(RemoteProtocolError):
            etcd.parse_watch(bad)


def test_static_urls() -> None:
    static = StaticMembership.from_url("cluster://10.0.0.6:7480,10.0.0.5:7480?replicas=2")
    assert [m.node_id for m in static.members()] == ["10.0.0.5-7480", "10.0.0.6-7480"]
    assert static.members()[0].fronts == {"native": "10.0.0.5:7480"}
    nvme = parse_cluster_url("cluster://a:4420,b:4420/nqn.2026-11.io.kvoffload:store?front=nvme")
    assert (nvme.front, nvme.path, nvme.replicas) == ("nvme", "nqn.2026-11.io.kvoffload:store", 1)
    node = StaticMembership.from_spec(nvme).members()[0]
    assert node.fronts == {"nvme": "a:4420/nqn.2026-11.io.kvoffload:store"}
    spec = parse_cluster_url("cluster+etcd://127.0.0.1:2379/prod?replicas=3")
    assert (spec.source, spec.addresses, spec.path, spec.replicas) == (
        "etcd", (("127.0.0.1", 2379),), "prod", 3
    )  # fmt: skip


def test_etcd_credentials_and_tls_in_cluster_urls() -> None:
    spec = parse_cluster_url(
        "cluster+etcds://reader:p%40ss@etcd.svc:2379/prod?replicas=2&etcd_ca=/ca.pem"
        "&etcd_cert=/c.pem&etcd_key=/k.pem&tls=1&ca=/nodes.pem",
        {"tls": "", "ca": ""},
    )
    assert (spec.source, spec.addresses, spec.path, spec.replicas) == (
        "etcd", (("etcd.svc", 2379),), "prod", 2
    )  # fmt: skip
    assert spec.etcd == etcd.EtcdAccess(True, "reader", "p@ss", "", "/ca.pem", "/c.pem", "/k.pem")
    assert spec.extra == {"tls": "1", "ca": "/nodes.pem"}  # the nodes' TLS: the transport's
    assert "p@ss" not in repr(spec)
    plain = parse_cluster_url("cluster+etcd://reader@etcd.svc:2379/prod?etcd_password_file=/pw")
    assert plain.etcd == etcd.EtcdAccess(False, "reader", "", "/pw")


def test_a_bad_cluster_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_cluster_url("cluster+etcd://reader:hunter2@etcd.svc:2379/prod?color=red")
    assert "hunter2" not in str(caught.value) and "reader:***@etcd.svc" in str(caught.value)
    assert etcd.redact_url("etcds://u:pw@h:1/x?ca=a") == "etcds://u:***@h:1/x?ca=a"
    assert etcd.redact_url("etcd://u@h:1/x") == "etcd://u@h:1/x"


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (400, b'{"error":"etcdserver: authentication failed, invalid user ID or password",'
         b'"code":3}', "authentication failed"),
        (403, b'{"error":"etcdserver: permission denied","code":7}', "permission denied"),
        (400, b'{"error":"etcdserver: user name is empty","code":3}', "requires a user"),
    ],
)  # fmt: skip
def test_etcd_refusals_are_auth_errors(status: int, body: bytes, says: str) -> None:
    refusal = etcd.etcd_refusal(status, body, "user 'reader'")
    assert refusal is not None and says in str(refusal)
    assert etcd.etcd_refusal(503, b"busy", "user 'reader'") is None  # an outage, not a refusal


def test_authenticate_messages() -> None:
    path, body = etcd.auth_request("node", "pw")
    assert path == "/v3/auth/authenticate" and body == {"name": "node", "password": "pw"}
    assert etcd.parse_auth({"token": "abc.1"}) == "abc.1"
    with pytest.raises(RemoteProtocolError):
        etcd.parse_auth({"header": {}})


@pytest.mark.parametrize(
    "url",
    [
        "kv://a:1",
        "cluster://a:1,a:1",
        "cluster://a",
        "cluster://a:0",
        "cluster://a:1?replicas=0",
        "cluster://a:1?replicas=x",
        "cluster://a:1?color=red",
        "cluster://a:1?replicas=1&replicas=2",
        "cluster://a:1?front=rdma",
        "cluster://a:1?front=nvme",
        "cluster+etcd://a:1,b:2/prod",
        "cluster+etcd://a:1/bad name",
        "cluster+etcd://a:1/",
        "cluster://u:p@a:1",  # credentials are etcd's
        "cluster://a:1?etcd_ca=c.pem",
        "cluster+etcd://a:1/prod?etcd_ca=c.pem",  # a CA needs etcd over TLS
        "cluster+etcd://:p@a:1/prod",  # a password needs a user
        "cluster+etcds://a:1/prod?etcd_key=k.pem",  # a key needs its certificate
        "cluster+etcds://a:1/prod?etcd_color=red",
    ],
)
def test_bad_cluster_urls_say_what_is_wrong(url: str) -> None:
    with pytest.raises(ConfigError, match="cluster URL"):
        parse_cluster_url(url)


@pytest.mark.parametrize(
    "weight", [1e300, float("inf"), float("-inf"), float("nan"), -1.0, 0.0, 1e-9, 1_000_001.0]
)
def test_a_record_whose_weight_is_out_of_range_is_refused(weight: float) -> None:
    # A record with weight 1e300 would take every placement: refused, with the reason.
    good = json.loads(etcd.encode_member(_member()))
    good["weight"] = weight
    with pytest.raises(RemoteProtocolError, match=r"weight must be a number in \[0.001, 1e\+06\]"):
        etcd.decode_member(PREFIX + b"kv-1", json.dumps(good).encode(), PREFIX)
    with pytest.raises(InvalidArgumentError, match="weight"):
        _member(weight=weight)
    with pytest.raises(ConfigError, match="weight"):
        ClusterConfig(weight=weight) if weight != 0 else ClusterConfig(weight=-0.5)


@pytest.mark.parametrize("weight", [etcd.MIN_WEIGHT, 1, 3072.0, etcd.MAX_WEIGHT])
def test_weights_in_range_are_kept(weight: float) -> None:
    member = _member(weight=weight)
    assert etcd.decode_member(PREFIX + b"kv-1", etcd.encode_member(member), PREFIX) == member
    assert ClusterConfig(weight=weight).weight == weight


# ---------------------------------------------------------------------- signed records


def _key(tmp_path: Path, text: str, name: str = "members.key") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_signed_record_verifies_only_as_written(tmp_path: Path) -> None:
    members_key = etcd.MembersKey.from_file(_key(tmp_path, "ab" * 32 + "\n"))
    member, key = _member(weight=2.0, nonce="n1"), PREFIX + b"kv-1"
    signed = etcd.encode_member(member, members_key, key=key, lease=77)
    assert etcd.decode_member(key, signed, PREFIX, members_key, 77) == member
    # A client without the key reads it as any record.
    assert etcd.decode_member(key, signed, PREFIX) == member
    record = json.loads(signed)
    for field, value in [
        ("fronts", {"native": "10.6.6.6:7480"}),
        ("weight", 1_000_000.0),
        ("nonce", "other"),
        ("lease", "78"),
    ]:
        changed = json.dumps({**record, field: value}).encode()
        with pytest.raises(RemoteProtocolError, match="not signed with the membership key"):
            etcd.decode_member(key, changed, PREFIX, members_key, 77)
    # The same bytes under another lease (put back after the node left) or at another node's key.
    with pytest.raises(RemoteProtocolError, match="signed for lease '77', not 78"):
        etcd.decode_member(key, signed, PREFIX, members_key, 78)
    with pytest.raises(RemoteProtocolError, match="not signed with the membership key"):
        etcd.decode_member(
            PREFIX + b"kv-2", signed.replace(b"kv-1", b"kv-2"), PREFIX, members_key, 77
        )
    # Unsigned, or signed with another key.
    with pytest.raises(RemoteProtocolError, match="is not signed"):
        etcd.decode_member(key, etcd.encode_member(member), PREFIX, members_key, 0)
    other = etcd.MembersKey(bytes(32))
    with pytest.raises(RemoteProtocolError, match="not signed with the membership key"):
        etcd.decode_member(
            key, etcd.encode_member(member, other, key=key, lease=77), PREFIX, members_key, 77
        )


@pytest.mark.parametrize("text", ["", "ab" * 31, "zz" * 32, "ab" * 33])
def test_a_bad_membership_key_file_is_a_config_error_without_its_content(
    tmp_path: Path, text: str
) -> None:
    path = _key(tmp_path, text)
    with pytest.raises(ConfigError, match="64 hex digits") as caught:
        etcd.MembersKey.from_file(path)
    assert (text not in str(caught.value)) or not text
    with pytest.raises(ConfigError, match="membership key file"):
        etcd.MembersKey.from_file(path + ".missing")


def test_the_membership_key_stays_out_of_repr_and_urls(tmp_path: Path) -> None:
    secret = "5e" * 32
    path = _key(tmp_path, secret)
    members_key = etcd.MembersKey.from_file(path)
    assert secret not in repr(members_key) and members_key.secret.hex() == secret
    spec = parse_cluster_url(f"cluster+etcd://etcd-1:2379/prod?members_key={path}")
    assert spec.members_key == path
    with pytest.raises(ConfigError, match="members_key needs cluster\\+etcd"):
        parse_cluster_url(f"cluster://h1:7480?members_key={path}")
    with pytest.raises(ConfigError, match="members_key needs cluster\\+etcd and a file"):
        parse_cluster_url("cluster+etcd://etcd-1:2379/prod?members_key=")
    config = ClusterConfig(etcd="etcd://etcd-1:2379/prod", members_key_file=path)
    assert config.members_key() == members_key and secret not in repr(config)
