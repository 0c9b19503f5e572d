from __future__ import annotations

import pytest

from kvoffload.errors import AuthError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig
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
