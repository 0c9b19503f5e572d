"""The daemon's [cluster] section: flags, TOML, environment and bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.cluster.registration import Registration
from kvoffload.nvmeof_target.config import DEFAULT_SUBNQN, ClusterConfig, load_config


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
    assert config.cluster.endpoint == ("10.0.0.1", 2379, "prod")
    flagged = load_config(str(toml), {}, ["--cluster", "etcd://etcd.svc:2379/other"])
    assert flagged.cluster.endpoint == ("etcd.svc", 2379, "other")


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--cluster", "http://a:1/x"], {}, "etcd://HOST:PORT/NAME"),
        (["--cluster", "etcd://a/x"], {}, "etcd://HOST:PORT/NAME"),
        (["--cluster", "etcd://a:1/"], {}, "cluster name"),
        (["--cluster", "etcd://a:1/x?y=1"], {}, "etcd://HOST:PORT/NAME"),
        ([], {"KVOFFLOAD_CLUSTER__NODE_ID": "no spaces"}, "node_id"),
        ([], {"KVOFFLOAD_CLUSTER__LEASE_TTL_S": "1"}, "lease_ttl_s"),
        ([], {"KVOFFLOAD_CLUSTER__WEIGHT": "-1"}, "weight"),
        ([], {"KVOFFLOAD_CLUSTER__COLOUR": "red"}, "unknown"),
    ],
)
def test_bad_values_are_config_errors(args: list[str], env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(None, env, args)


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
