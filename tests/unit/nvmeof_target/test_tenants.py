from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import AuthError, ConfigError
from kvoffload.kvstore import DramConfig, Engine, EngineConfig, SsdConfig
from kvoffload.nvmeof_target.config import TenantConfig
from kvoffload.nvmeof_target.tenants import ANONYMOUS, Tenants
from kvoffload.wire.hello_auth import client_proof, new_nonce, node_key, server_proof


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


def test_challenge_response_without_the_secret_on_the_node() -> None:
    secret = "alice-secret"
    key = node_key(secret, "n1").hex()
    tenants = Tenants(
        [TenantConfig("alice", node_key=key), TenantConfig("bob", "bob-secret")], "n1"
    )
    client_nonce = new_nonce()
    pending = tenants.challenge("", client_nonce, 5)
    proof = client_proof(node_key(secret, "n1"), "", "n1", client_nonce, pending.node_nonce)
    tenant, mine = tenants.answer(pending, proof)
    assert tenant.name == "alice"
    assert mine == server_proof(
        node_key(secret, "n1"), "alice", "n1", client_nonce, pending.node_nonce
    )
    # Another connection's challenge, another node's key, or bob's name: refused.
    with pytest.raises(AuthError):
        tenants.answer(tenants.challenge("", client_nonce, 5), proof)
    other = client_proof(node_key(secret, "n2"), "", "n1", client_nonce, pending.node_nonce)
    with pytest.raises(AuthError):
        tenants.answer(pending, other)
    as_bob = tenants.challenge("bob", client_nonce, 5)
    claim = client_proof(node_key(secret, "n1"), "bob", "n1", client_nonce, as_bob.node_nonce)
    with pytest.raises(AuthError):
        tenants.answer(as_bob, claim)
    # The token Hello cannot reach a tenant configured with its node key alone.
    with pytest.raises(AuthError):
        tenants.authenticate(secret)
    with pytest.raises(AuthError, match="no tenants"):
        Tenants([]).challenge("", client_nonce, 5)
