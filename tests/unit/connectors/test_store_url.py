"""The store URL the connectors connect with: `immutable=1` on cluster URLs (issue 32)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from kvoffload.client_sdk.url import parse_url
from kvoffload.connectors.store_url import block_store_url
from kvoffload.errors import ConfigError

CONNECTORS = Path(__file__).resolve().parents[3] / "connectors"
# The encoder-output connector rewrites a manifest under one key (a new nonce each save).
OVERWRITING = {"vllm/ec.py"}
# Each call that opens a client or transport from a URL.
OPENERS = {"connect", "open_transport"}


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("cluster+etcd://10.0.0.2:2379/prod", "cluster+etcd://10.0.0.2:2379/prod?immutable=1"),
        (
            "cluster+etcds://u:pw@10.0.0.2:2379/prod?replicas=2&timeout=1",
            "cluster+etcds://u:pw@10.0.0.2:2379/prod?replicas=2&timeout=1&immutable=1",
        ),
        (
            "cluster://h1:7480,h2:7480?replicas=2",
            "cluster://h1:7480,h2:7480?replicas=2&immutable=1",
        ),
        ("CLUSTER://h1:7480", "CLUSTER://h1:7480?immutable=1"),
    ],
)
def test_a_cluster_url_gets_immutable_1(url: str, expected: str) -> None:
    out = block_store_url(url)
    assert out == expected
    assert parse_url(out).params["immutable"] == "1"


@pytest.mark.parametrize(
    "url",
    [
        "kv://127.0.0.1:7480",
        "local:///var/kvoffload",
        "nvme+tcp://127.0.0.1:4420/nqn.x",
        "cluster+etcd://10.0.0.2:2379/prod?immutable=1",
        "cluster+etcd://10.0.0.2:2379/prod?immutable=yes",  # the cluster parser refuses it
    ],
)
def test_other_urls_and_a_chosen_value_are_left_as_they_are(url: str) -> None:
    assert block_store_url(url) == url


def test_an_explicit_immutable_0_is_kept_and_its_cost_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "cluster+etcd://u:secret@10.9.8.7:2379/once?immutable=0&token=t0k"
    with caplog.at_level(logging.WARNING, logger="kvoffload.connectors"):
        assert block_store_url(url) == url
        assert block_store_url(url) == url
    told = [r.getMessage() for r in caplog.records if "immutable=0" in r.getMessage()]
    assert len(told) == 1
    assert "10.9.8.7:2379/once" in told[0]
    assert "secret" not in told[0] and "t0k" not in told[0]


def test_bad_urls_are_refused_as_client_connect_refuses_them() -> None:
    for bad in ("no-scheme", "cluster://h1?replicas=1&replicas=2"):
        with pytest.raises(ConfigError):
            block_store_url(bad)


def _opened_urls(path: Path) -> list[ast.expr]:
    """The first argument of every `X.connect(...)` / `open_transport(...)` call in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in OPENERS:
            found.append(node.args[0])
    return found


def _goes_through_block_store_url(arg: ast.expr, source: str) -> bool:
    text = ast.get_source_segment(source, arg) or ""
    return "block_store_url(" in text


def test_every_kv_connector_opens_its_store_through_block_store_url() -> None:
    # A connector added later, or a connect call changed, must not drop immutable=1: each URL a
    # KV connector opens is either wrapped or a name bound to a wrapped URL in that function.
    checked = 0
    for path in sorted(CONNECTORS.rglob("*.py")):
        rel = path.relative_to(CONNECTORS).as_posix()
        if rel in OVERWRITING or rel == "store_url.py":
            continue
        source = path.read_text(encoding="utf-8")
        for arg in _opened_urls(path):
            checked += 1
            if _goes_through_block_store_url(arg, source):
                continue
            text = ast.get_source_segment(source, arg) or ""
            # `open_transport(url)` after `url = parse_url(...)` in lmcache_mp's local:// branch:
            # a local store is no cluster; anything else must be wrapped.
            assert rel == "lmcache_mp.py" and text == "url", f"{rel}: {text} opened as given"
    assert checked >= 6  # vLLM (2), tier, LMCache, LMCache MP (2), SGLang
