from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd on 127.0.0.1 (random ports, data in tmp_path), stopped after the test."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()
