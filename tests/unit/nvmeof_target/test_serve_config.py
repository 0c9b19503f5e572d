"""The daemon's config loader: defaults < TOML < environment < flags; unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import Config, load_config


def test_defaults_need_nothing() -> None:
    config = load_config(None, {"HOME": "/home/u"}, [])
    assert (config.native.host, config.native.port) == ("127.0.0.1", 7480)
    assert (config.metrics.host, config.metrics.port) == ("127.0.0.1", 9480)
    assert config.data_dir == "/home/u/.local/share/kvoffload"
    assert config.dram.capacity_bytes == 1 << 30 and config.ssd.capacity_bytes == 4 << 30
    assert config.engine.data_dir == config.data_dir and config.engine.ssd == config.ssd
    assert config.tenants == () and not config.events.enabled
    assert load_config(None, {"XDG_DATA_HOME": "/x"}, []).data_dir == "/x/kvoffload"
    assert Config().native.port == 7480


def test_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text(
        '[native]\nport = 1\nhost = "0.0.0.0"\n[dram]\ncapacity_bytes = "256MiB"\n'
        '[tenants.alice]\ntoken = "t"\nquota_bytes = "1GiB"\n'
    )
    env = {
        "KVOFFLOAD_NATIVE__PORT": "2",
        "KVOFFLOAD_EVENTS__ENABLED": "true",
        "KVOFFLOAD_TENANTS__BOB__TOKEN": "u",
        "KVOFFLOAD_REQUIRE_MODEL": "1",  # another tool's variable: not a section, ignored
    }
    config = load_config(str(toml), env, ["--port", "3", "--ssd", "0", "--data-dir", "/d"])
    assert config.native.port == 3 and config.native.host == "0.0.0.0"
    assert config.dram.capacity_bytes == 256 << 20 and config.ssd.capacity_bytes == 0
    assert config.events.enabled and config.data_dir == "/d"
    assert {(t.name, t.token, t.quota_bytes) for t in config.tenants} == {
        ("alice", "t", 1 << 30),
        ("bob", "u", 0),
    }
    via_flag = load_config(None, env, ["--config", str(toml)])
    assert via_flag.native.port == 2  # env beats the file
    assert load_config(None, {}, ["--events", "tcp://127.0.0.1:*"]).events.enabled


@pytest.mark.parametrize(
    ("toml", "env", "argv", "match"),
    [
        ("[native]\nprot = 1\n", {}, [], "unknown config key.*native.prot"),
        ("[nope]\n", {}, [], "unknown config key"),
        ("", {"KVOFFLOAD_NATIVE__PORTT": "1"}, [], "native.portt"),
        ("", {"KVOFFLOAD_NATIVE__PORT": "x"}, [], "integer"),
        ("", {}, ["--port", "70000"], "native.port"),
        ("", {}, ["--dram", "lots"], "cannot parse size"),
        ("[native]\nenabled = 3\n", {}, [], "true or false"),
        ("[server]\nloop = 'fast'\n", {}, [], "server.loop"),
        ("[tenants.a]\ntoken = ''\n", {}, [], "exactly one of token"),
        ("[tenants.a]\ntoken = 'x'\n[tenants.b]\ntoken = 'x'\n", {}, [], "share a token"),
        ("[tenants.a]\ntoken = 'x'\nnode_key = '" + "ab" * 32 + "'\n", {}, [], "exactly one"),
        ("[tenants.a]\nnode_key = 'abc'\n", {}, [], "node_key: a node key is 64 hex"),
        ("[tenants.a]\nnode_key = '" + "ab" * 32 + "'\n", {}, [], "need \\[cluster\\] node_id"),
        ("native = 1\n", {}, [], "must be a table"),
        ("[native]\nmax_pending = 1\n", {}, [], "native.max_pending must be >= 2"),
        ("", {"KVOFFLOAD_NATIVE__MAX_PENDING": "0"}, [], "native.max_pending must be"),
        ("[native\n", {}, [], "not valid TOML"),
    ],
)
def test_bad_config_is_a_config_error(
    tmp_path: Path, toml: str, env: dict[str, str], argv: list[str], match: str
) -> None:
    path = tmp_path / "k.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_config(str(path), env, argv)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "absent.toml"), {}, [])


def test_tenants_own_event_endpoints(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text(
        '[events]\nenabled = true\ncurve_secret_key_file = "/k/server.key_secret"\n'
        'curve_clients = "/k/operator"\n'
        '[tenants.alice]\ntoken = "t"\n[tenants.alice.events]\nendpoint = "tcp://*:5601"\n'
        'replay_endpoint = "tcp://*:5602"\ncurve_clients = "/k/alice"\n'
    )
    env = {"KVOFFLOAD_TENANTS__BOB__TOKEN": "u"}
    (alice, bob) = sorted(load_config(str(toml), env, []).tenants, key=lambda t: t.name)
    assert (alice.events.endpoint, alice.events.replay_endpoint) == ("tcp://*:5601", "tcp://*:5602")
    assert alice.events.curve_clients == "/k/alice" and bob.events.endpoint == ""


@pytest.mark.parametrize(
    ("events", "alice", "message"),
    [
        ("", 'replay_endpoint = "tcp://*:1"', "need the tenant's own endpoint"),
        ("", 'curve_clients = "/k/a"', "need the tenant's own endpoint"),
        ("", 'endpoint = "tcp://*:1"\ncurve_clients = "/k/a"', "needs events.curve_secret_key"),
        ('curve_secret_key_file = "/s"\ncurve_clients = "/c"', 'endpoint = "tcp://*:1"',
         "must name the routers allowed alice's events"),
        ('endpoint = "tcp://*:1"', 'endpoint = "tcp://*:1"', "bound twice"),
        ("", 'endpoint = "tcp://*:2"\nreplay_endpoint = "tcp://*:2"', "bound twice"),
    ],
)  # fmt: skip
def test_tenant_event_endpoints_that_cannot_work_are_refused(
    tmp_path: Path, events: str, alice: str, message: str
) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text(
        f'[events]\n{events}\n[tenants.alice]\ntoken = "t"\n[tenants.alice.events]\n{alice}\n'
    )
    with pytest.raises(ConfigError, match=message):
        load_config(str(toml), {}, [])
