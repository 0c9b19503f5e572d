"""The daemon's [cluster] section: flags, TOML, environment and bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.cluster.registration import Registration
from kvoffload.nvmeof_target.config import DEFAULT_SUBNQN, ClusterConfig, load_config
from kvoffload.wire.membership import EtcdAccess, EtcdEndpoint


def test_standalone_by_default() -> None:
    config = load_config(None, {})
    assert config.cluster == ClusterConfig() and config.cluster.endpoint is None


def test_flags_toml_and_environment(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text(
        '[cluster]\netcd = "etcd://10.0.0.1:2379/prod"\nweight = 2.5\nlease_ttl_s = 6\n'
    )
    config = load_config(str(toml), {"KVOFFLOAD_CLUSTER__NODE_ID": "kv-a"}, ["--advertise", "h1"])
    assert config.cluster == ClusterConfig("etcd://10.0.0.1:2379/prod", "h1", "kv-a", 2.5, 6)
    assert config.cluster.endpoint == EtcdEndpoint("10.0.0.1", 2379, "prod")
    flagged = load_config(str(toml), {}, ["--cluster", "etcd://etcd.svc:2379/other"])
    assert flagged.cluster.endpoint == EtcdEndpoint("etcd.svc", 2379, "other")


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--cluster", "http://a:1/x"], {}, r"etcd\[s\]://"),
        (["--cluster", "etcd://a/x"], {}, r"etcd\[s\]://"),
        (["--cluster", "etcd://a:1/"], {}, "cluster name"),
        (["--cluster", "etcd://a:1/x?y=1"], {}, "unknown or repeated parameter"),
        (["--cluster", "etcd://a:1/x?ca=c.pem"], {}, "need TLS: use etcds://"),
        (["--cluster", "etcds://a:1/x?key=k.pem"], {}, "needs its certificate"),
        (["--cluster", "etcd://:pw@a:1/x"], {}, "needs a user"),
        (["--cluster", "etcd://u:pw@a:1/x?password_file=/p"], {}, "not both"),
        (["--cluster", "etcd://u@a:1/x"], {"KVOFFLOAD_CLUSTER__ETCD_USER": "v"}, "also given"),
        ([], {"KVOFFLOAD_CLUSTER__NODE_ID": "no spaces"}, "node_id"),
        ([], {"KVOFFLOAD_CLUSTER__LEASE_TTL_S": "1"}, "lease_ttl_s"),
        ([], {"KVOFFLOAD_CLUSTER__WEIGHT": "-1"}, "weight"),
        ([], {"KVOFFLOAD_CLUSTER__COLOUR": "red"}, "unknown"),
    ],
)
def test_bad_values_are_config_errors(args: list[str], env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(None, env, args)


def test_etcd_credentials_and_tls_from_the_url_and_the_keys(tmp_path: Path) -> None:
    url = "etcds://node:s%40cret@etcd.svc:2379/prod?ca=/etc/ca.pem&cert=/etc/n.pem&key=/etc/n.key"
    config = load_config(None, {}, ["--cluster", url])
    access = EtcdAccess(True, "node", "s@cret", "", "/etc/ca.pem", "/etc/n.pem", "/etc/n.key")
    assert config.cluster.endpoint == EtcdEndpoint("etcd.svc", 2379, "prod", access)
    secret = tmp_path / "password"
    secret.write_text("from-a-file\n")
    toml = tmp_path / "k.toml"
    toml.write_text(
        '[cluster]\netcd = "etcds://etcd.svc:2379/prod"\netcd_user = "node"\n'
        f'etcd_password_file = "{secret}"\netcd_ca = "/etc/ca.pem"\n'
    )
    keyed = load_config(str(toml), {}).cluster.endpoint
    assert keyed is not None and keyed.access.tls and keyed.access.ca == "/etc/ca.pem"
    assert keyed.access.credentials() == ("node", "from-a-file")
    # The password is in no printed form of the endpoint or the config.
    for shown in (str(config.cluster.endpoint), repr(config.cluster.endpoint)):
        assert "s@cret" not in shown and "s%40cret" not in shown
    assert str(config.cluster.endpoint) == "etcds://node@etcd.svc:2379/prod"


def test_a_bad_etcd_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, {}, ["--cluster", "etcd://node:hunter2@etcd.svc/prod"])
    assert "hunter2" not in str(caught.value) and "node:***@etcd.svc" in str(caught.value)


def test_an_unreadable_password_file_is_a_config_error(tmp_path: Path) -> None:
    config = load_config(None, {}, ["--cluster", f"etcd://u@a:1/x?password_file={tmp_path}/no"])
    endpoint = config.cluster.endpoint
    assert endpoint is not None
    with pytest.raises(ConfigError, match="password file"):
        endpoint.access.credentials()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        EtcdAccess(user="u", password_file=str(tmp_path / "empty")).credentials()


# What a node advertises (built from the config and its listeners; nothing is sent).

ETCD = ["--cluster", "etcd://127.0.0.1:2379/prod"]
NODE = {"KVOFFLOAD_CLUSTER__NODE_ID": "kv-t"}  # a node id is otherwise made by Registration.open
LISTENING = {"metrics": ("0.0.0.0", 9480), "native": ("0.0.0.0", 7480), "nvme": ("127.0.0.1", 4420)}


def test_the_record_advertises_reachable_fronts_and_capacity() -> None:
    config = load_config(
        None, NODE, [*ETCD, "--advertise", "10.0.0.5", "--dram", "2GiB", "--ssd", "0"]
    )
    registration = Registration(config, LISTENING)
    member = registration.member
    # The NVMe front listens on loopback only: advertising it elsewhere would be a lie.
    assert member.fronts == {"native": "10.0.0.5:7480"}
    assert member.weight == 2.0 and member.nonce == registration.nonce  # DRAM only: its size
    with_ssd = load_config(None, NODE, [*ETCD, "--advertise", "h", "--ssd", "3GiB"])
    assert Registration(with_ssd, LISTENING).member.weight == 3.0  # the SSD tier's size
    weighted = load_config(
        None, {**NODE, "KVOFFLOAD_CLUSTER__WEIGHT": "7"}, [*ETCD, "--advertise", "h"]
    )
    assert Registration(weighted, LISTENING).member.weight == 7.0


def test_loopback_nodes_advertise_their_own_addresses() -> None:
    config = load_config(None, NODE, ETCD)
    local = {"native": ("127.0.0.1", 7480), "nvme": ("127.0.0.1", 4420)}
    fronts = Registration(config, local).member.fronts
    assert fronts == {"native": "127.0.0.1:7480", "nvme": f"127.0.0.1:4420/{DEFAULT_SUBNQN}"}


def test_a_wildcard_listener_needs_an_advertised_address() -> None:
    with pytest.raises(ConfigError, match="--advertise"):
        Registration(load_config(None, {}, ETCD), LISTENING)
