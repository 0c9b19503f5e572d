from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import AuthError, ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.nvmeof_target.config import TenantConfig
from kvoffload.nvmeof_target.tenants import ANONYMOUS, Tenants


def test_open_store_takes_no_token() -> None:
    tenants = Tenants([])
    assert tenants.authenticate("") is ANONYMOUS
    assert ANONYMOUS.key(b"k" * 16) == b"k" * 16
    with pytest.raises(AuthError, match="no tenants"):
        tenants.authenticate("something")


def test_tokens_select_tenants_and_separate_their_keys() -> None:
    tenants = Tenants([TenantConfig("a", "ta"), TenantConfig("b", "tb", quota_bytes=1 << 20)])
    a, b = tenants.authenticate("ta"), tenants.authenticate("tb")
    assert (a.name, b.name) == ("a", "b")
    key = bytes(range(16))
    assert len(a.key(key)) == 16 and a.key(key) != b.key(key) != key
    assert a.key(key) == tenants.authenticate("ta").key(key)  # deterministic
    assert a.keys([key, key]) == [a.key(key)] * 2 and a.opt_key(None) is None
    for token in ("", "tc", "ta "):
        with pytest.raises(AuthError):
            tenants.authenticate(token)
    with Engine(EngineConfig(DramConfig(capacity_bytes=8 << 20, prefault=False))) as engine:
        tenants.apply_quotas(engine)
        engine.put(b.key(key), bytes(10), tenant="b")
        assert (
            engine.stats().tenant_bytes == {"a": 0, "b": 4096} or "b" in engine.stats().tenant_bytes
        )


def test_ssd_quotas_are_applied_and_need_an_ssd_tier(tmp_path: Path) -> None:
    tenants = Tenants([TenantConfig("a", "ta", ssd_quota_bytes=1 << 20), TenantConfig("b", "tb")])
    dram_only = Engine(EngineConfig(DramConfig(capacity_bytes=4 << 20, prefault=False)))
    with dram_only, pytest.raises(ConfigError, match=r"tenants\.a: an SSD quota needs an SSD tier"):
        tenants.apply_quotas(dram_only)
    config = EngineConfig(
        DramConfig(capacity_bytes=4 << 20, prefault=False),
        SsdConfig(capacity_bytes=32 << 20),
        data_dir=str(tmp_path),
    )
    with Engine(config) as engine:
        tenants.apply_quotas(engine)
        a = tenants.authenticate("ta")
        for i in range(12):  # 12 x 200 KB durable puts against a 1 MiB SSD quota
            engine.put(a.key(i.to_bytes(16, "little")), bytes(200_000), tenant="a", durable=True)
        assert 0 < engine.stats().ssd_tenant_bytes["a"] <= 1 << 20
