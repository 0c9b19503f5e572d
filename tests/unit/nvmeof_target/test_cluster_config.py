"""The daemon's [cluster] section: flags, TOML, environment and bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import ClusterConfig, load_config


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
