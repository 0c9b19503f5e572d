"""What each worker of `kvoffload serve --workers N` gets (nvmeof_target/workers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.nvmeof_target.config import load_config
from kvoffload.nvmeof_target.layout import shard_config, shard_count

TOML = """
[tenants.alice]
token = "a"
quota_bytes = "64MiB"
ssd_quota_bytes = "1GiB"
[tenants.bob]
token = "b"
"""


def _config(tmp_path: Path, *flags: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "k.toml"
    path.write_text(TOML)
    return load_config(
        str(path),
        {},
        ["--dram", "1GiB", "--ssd", "8GiB", "--data-dir", str(tmp_path / "d"), *flags],
    )


def test_each_worker_gets_its_share(tmp_path: Path) -> None:
    config = _config(tmp_path, "--workers", "4", "--nvme-port", "4420")
    shards = [shard_config(config, i, 4) for i in range(4)]
    for i, shard in enumerate(shards):
        assert shard.server.workers == 1 and not shard.metrics.enabled
        assert shard.dram.capacity_bytes == 256 << 20
        assert shard.ssd.capacity_bytes == 2 << 30
        # Clients see the node's largest value whatever the count.
        assert shard.dram.effective_max_value_bytes == config.dram.effective_max_value_bytes
        assert shard.data_dir == str(tmp_path / "d" / f"shard-{i}")
        assert shard.nvme.port == 4420 + i
        assert shard.nvme.subnqn == f"{config.nvme.subnqn}.shard{i}"
        alice, bob = shard.tenants
        assert (alice.quota_bytes, alice.ssd_quota_bytes) == (16 << 20, 256 << 20)
        assert (bob.quota_bytes, bob.ssd_quota_bytes) == (0, 0)  # no quota stays no quota
    assert sum(s.dram.capacity_bytes for s in shards) <= config.dram.capacity_bytes


def test_shares_too_small_and_one_ssd_file_are_refused(tmp_path: Path) -> None:
    config = load_config(None, {}, ["--dram", "32MiB", "--data-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="with 64 workers each gets 1/64 of the DRAM"):
        shard_config(config, 0, 64)
    path = tmp_path / "k.toml"
    path.write_text(f'[ssd]\ncapacity_bytes = "1GiB"\npath = "{tmp_path / "slots"}"\n')
    with pytest.raises(ConfigError, match="cannot be split"):
        shard_config(load_config(str(path), {}, []), 0, 2)


def test_a_store_keeps_the_count_it_was_made_with(tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert shard_count(_config(tmp_path, "--workers", "3")) == 3  # a new store: as asked
    data.mkdir()
    (data / "shards.json").write_text(json.dumps({"shards": 3}))
    assert shard_count(_config(tmp_path, "--workers", "0")) == 3  # auto: the store's own
    with pytest.raises(ConfigError, match="holds a store of 3 shard"):
        shard_count(_config(tmp_path, "--workers", "2"))
    (data / "shards.json").write_text("{not json")
    with pytest.raises(ConfigError, match="damaged"):
        shard_count(_config(tmp_path, "--workers", "0"))
    (data / "shards.json").unlink()
    (data / "lost+found").mkdir()  # a fresh file system's: not a store
    assert shard_count(_config(tmp_path, "--workers", "2")) == 2
    (data / "kvoffload.meta").write_text("a one-process store")
    with pytest.raises(ConfigError, match="holds a store of 1 shard"):
        shard_count(_config(tmp_path, "--workers", "2"))
    with pytest.raises(ConfigError, match="server.workers"):
        _config(tmp_path, "--workers", "-1")
