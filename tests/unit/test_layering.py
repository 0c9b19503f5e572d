"""DESIGN §2: who may import whom, checked on the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]

# package (or sub-package) -> kvoffload packages it may import; the namespace root's "errors" and
# "buffers" (the bottom layer) are allowed everywhere.
ALLOWED = {
    "compression": {"compression"},
    "kvstore": {"kvstore"},
    "client_sdk.wire": {"client_sdk.wire"},
    "client_sdk": {"client_sdk", "compression"},
    "nvmeof_target": {"nvmeof_target", "kvstore", "client_sdk.wire"},
    "connectors": {"connectors", "client_sdk"},
    # The wire codecs are public too: the live fuzzer (bench/fuzz.py) builds frames with them.
    "bench": {*PACKAGES, "client_sdk.wire"},
}
# The SDK reaches the engine through local:// only (DESIGN §2).
SDK_ENGINE_DOORS = {"client_sdk.transports.local"}
# Third-party or stdlib modules a layer must not touch.
FORBIDDEN = {
    "kvstore": {"socket", "asyncio", "ssl", "selectors", "torch"},
    "client_sdk.wire": {"socket", "asyncio", "ssl", "selectors", "numpy", "torch"},
    "compression": {"socket", "asyncio"},
}


def _layer(module: str) -> str:
    """'client_sdk.wire.block' -> 'client_sdk.wire'; 'kvstore.engine' -> 'kvstore'."""
    return "client_sdk.wire" if module.startswith("client_sdk.wire") else module.split(".")[0]


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _sources() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out.append((module, path))
    return out


@pytest.mark.parametrize(("module", "path"), _sources(), ids=lambda v: str(v))
def test_import_edges(module: str, path: Path) -> None:
    layer = _layer(module)
    for name in _imports(path):
        top = name.split(".")[0]
        assert top not in PACKAGES, f"{module}: import {name!r} bare; use kvoffload.{name}"
        for banned in FORBIDDEN.get(layer, ()):
            assert top != banned, f"{module} ({layer}) must not import {name}"
        if not name.startswith("kvoffload."):
            continue
        target = name.removeprefix("kvoffload.")
        if target in ("errors", "buffers", "__version__") or target.startswith(
            ("errors.", "buffers.")
        ):
            continue
        if "." not in target and target not in PACKAGES:
            continue  # `from kvoffload import __version__`-style names
        target_layer = _layer(target)
        assert (
            target_layer in ALLOWED[layer]
            or (layer == "client_sdk" and target_layer == "client_sdk.wire")
            or (module in SDK_ENGINE_DOORS and target_layer == "kvstore")
        ), f"{module} ({layer}) may not import {name} ({target_layer})"


def test_namespace_root_holds_only_the_bottom_layer() -> None:
    files = {p.name for p in (ROOT / "kvoffload").iterdir() if not p.name.startswith("__pycache")}
    assert files == {"__init__.py", "errors.py", "buffers.py", "cli.py", "py.typed"}


def test_the_checker_catches_a_bad_edge(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import socket\nfrom kvoffload.client_sdk import Client\n")
    names = _imports(bad)
    assert "socket" in names and "kvoffload.client_sdk.Client" in names
    assert _layer("client_sdk.Client") not in ALLOWED["kvstore"]
