"""The NVMe/TCP front's configuration: defaults, TOML tables, environment, flags, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import DEFAULT_SUBNQN, NamespaceConfig, load_config

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002"


def test_defaults_serve_one_open_subsystem_on_4420() -> None:
    nvme = load_config(None, {}, []).nvme
    assert nvme.enabled is None and nvme.port == 4420 and nvme.host == "127.0.0.1" and nvme.loopback
    (sub,) = nvme.served
    assert sub.nqn == DEFAULT_SUBNQN == "nqn.2026-11.io.kvoffload:store"
    assert sub.allow_hosts == () and sub.active == (NamespaceConfig(1),)


def test_flags_and_environment() -> None:
    env = {"KVOFFLOAD_NVME__IN_CAPSULE_BYTES": "64KiB", "KVOFFLOAD_NVME__HOST": "0.0.0.0"}
    nvme = load_config(None, env, ["--nvme-port", "0", "--subnqn", "nqn.2026-01.org.x:y"]).nvme
    assert nvme.port == 0 and nvme.in_capsule_bytes == 64 << 10 and not nvme.loopback
    assert [s.nqn for s in nvme.served] == ["nqn.2026-01.org.x:y"]


def test_subsystems_namespaces_and_tenants_from_toml(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        f"""
[tenants.alice]
token = "a"
[tenants.bob]
token = "b"
[nvme.subsystems."nqn.2026-11.io.kvoffload:store"]
allow_hosts = ["{HOST_A}", "{HOST_B}"]
[nvme.subsystems."nqn.2026-11.io.kvoffload:store".namespaces.1]
tenant = "alice"
hosts = ["{HOST_A}"]
[nvme.subsystems."nqn.2026-11.io.kvoffload:store".namespaces.2]
tenant = "bob"
"""
    )
    # The NVMe front has no tenant authentication: asked for with tenants, it is refused.
    with pytest.raises(ConfigError, match=r"cannot run with \[tenants\]"):
        load_config(str(toml), {}, [])
    # Without tenants (an open store) the same subsystem serves, hosts and namespaces as set.
    lines = toml.read_text().split("[nvme.", 1)[1].splitlines()
    toml.write_text("[nvme." + "\n".join(x for x in lines if not x.startswith("tenant")))
    (sub,) = load_config(str(toml), {}, []).nvme.served
    assert sub.allow_hosts == (HOST_A, HOST_B)
    assert sub.active == (NamespaceConfig(1, "", (HOST_A,)), NamespaceConfig(2, "", ()))


def test_tenants_decide_whether_the_default_nvme_front_runs() -> None:
    open_store = load_config(None, {}, [])
    assert open_store.nvme.enabled is None and open_store.nvme_serves
    tenants = {"KVOFFLOAD_TENANTS__ALICE__TOKEN": "a"}
    with_tenants = load_config(None, tenants, [])
    assert not with_tenants.nvme_serves and not with_tenants.nvme.explicit
    assert not load_config(None, {"KVOFFLOAD_NVME__ENABLED": "false"}, []).nvme_serves
    with pytest.raises(ConfigError, match="nvme.enabled = false"):
        load_config(None, {**tenants, "KVOFFLOAD_NVME__ENABLED": "1"}, [])
    assert not load_config(None, {**tenants, "KVOFFLOAD_NVME__ENABLED": "0"}, []).nvme_serves


@pytest.mark.parametrize(
    ("toml", "flags", "message"),
    [
        ("", ["--subnqn", "not-an-nqn"], "not an NQN"),
        ("", ["--nvme-port", "70000"], "nvme.port"),
        ('[nvme]\nmaxh2cdata_bytes = "1000"\n', [], "maxh2cdata"),
        ('[nvme]\nin_capsule_bytes = "1000"\n', [], "in_capsule_bytes"),
        ('[nvme.subsystems."nqn.a:b"]\nallow = []\n', [], "unknown config key"),
        ('[nvme.subsystems."nqn.a:b"]\nallow_hosts = ["bad host"]\n', [], "not an NQN"),
        ('[nvme.subsystems."nqn.a:b".namespaces.0]\n', [], "namespace id"),
        ('[nvme.subsystems."nqn.a:b".namespaces.x]\n', [], "integer"),
        ('[nvme.subsystems."nqn.a:b".namespaces.1]\ntenant = "nobody"\n', [], "not configured"),
        ('[nvme.subsystems."nqn.a:b"]\nallow_hosts = "nqn.x:y"\n', [], None),
    ],
)
def test_bad_values_are_config_errors(
    tmp_path: Path, toml: str, flags: list[str], message: str | None
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    if message is None:  # a single string is a one-host list (the environment's form)
        (sub,) = load_config(str(path), {}, flags).nvme.served
        assert sub.allow_hosts == ("nqn.x:y",)
        return
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), {}, flags)
