"""DESIGN §2 and the house rules (docs/guides/development.md), checked on the source with `ast`.

- who may import whom (the layer table), and what the bottom layers must not touch;
- `bench` uses the packages' public faces only (their `__init__`s; the wire codecs whole);
- no import circles between modules, `TYPE_CHECKING` imports included;
- no imports inside functions, except of optional dependencies;
- no project base class with exactly one subclass;
- at most 14 modules in one package directory.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Top-level folders installed as `kvoffload.<name>` (setup.py), and the namespace root itself.
PACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]
BOTTOM = {"errors", "buffers"}

# layer -> layers it may import (its own always; the bottom layer everywhere).
ALLOWED = {
    "compression": set(),
    "core": set(),  # the daemon's C core: below the engine and the daemon that share it
    "kvstore": {"core"},
    "wire": set(),
    "client_sdk": {"compression", "wire"},
    "nvmeof_target": {"kvstore", "wire", "core"},
    "connectors": {"client_sdk"},
    "bench": {"kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "wire"}
    | {"core"},
    "cli": {"kvstore", "client_sdk", "nvmeof_target", "bench"},
}
# The SDK reaches the engine through local:// only (DESIGN §2).
SDK_ENGINE_DOORS = {"client_sdk.transports.local"}
# Third-party or stdlib modules a layer must not touch.
FORBIDDEN = {
    "kvstore": {"socket", "asyncio", "ssl", "selectors", "torch"},
    "wire": {"socket", "asyncio", "ssl", "selectors", "numpy", "torch"},
    "core": {"socket", "asyncio", "ssl", "selectors", "numpy", "torch"},
    "compression": {"socket", "asyncio"},
}
# Project modules that are optional at run time (a C build that may be absent, modules that
# need torch or a serving engine): the only project imports allowed inside a function.
OPTIONAL = {"wire._speedups", "core._core", "connectors.transformers"}
MAX_MODULES_PER_PACKAGE = 14
# Bases with one subclass still to be recut, each with why it is still there; only shrinks.
ONE_SUBCLASS_LEFT: set[str] = set()


@dataclass
class Module:
    name: str  # dotted, relative to `kvoffload`: "kvstore.engine", "wire", "cli"
    path: Path
    tree: ast.Module
    # (target module, line, inside a function) for every project import
    imports: list[tuple[str, int, bool]] = field(default_factory=list)
    external: list[tuple[str, int]] = field(default_factory=list)


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kvoffload":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _paths() -> Iterator[Path]:
    for top in ["kvoffload", *PACKAGES]:
        yield from sorted((ROOT / top).rglob("*.py"))


def _resolve(name: str, modules: dict[str, Module]) -> str | None:
    """'kvoffload.kvstore.engine.Engine' -> 'kvstore.engine' (the module that defines it)."""
    rest = name.removeprefix("kvoffload").lstrip(".")
    while rest not in modules:
        if not rest:
            return None
        rest = rest.rpartition(".")[0]
    return rest


def _function_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
    return inside


def load() -> dict[str, Module]:
    modules = {}
    for path in _paths():
        modules[_dotted(path)] = Module(_dotted(path), path, ast.parse(path.read_text(), str(path)))
    for mod in modules.values():
        in_function = _function_nodes(mod.tree)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                names = list(submodules)
                # `from pkg import name` runs pkg/__init__ unless every name is a submodule.
                if any(
                    _resolve(n, modules) != n.removeprefix("kvoffload.")
                    and n.removeprefix("kvoffload.") not in OPTIONAL
                    for n in submodules
                ):
                    names.append(node.module)
            else:
                continue
            for name in names:
                if name.removeprefix("kvoffload.") in OPTIONAL - set(modules):
                    continue  # an optional build that may be absent (the C extension)
                if name == "kvoffload" or name.startswith("kvoffload."):
                    target = _resolve(name, modules)
                    if target is not None and target != mod.name and target != "":
                        mod.imports.append((target, node.lineno, id(node) in in_function))
                    elif target is None:
                        # a C extension or a name of the namespace root (__version__)
                        leaf = name.removeprefix("kvoffload.")
                        if leaf in OPTIONAL or "." not in leaf:
                            continue
                        mod.imports.append((leaf, node.lineno, id(node) in in_function))
                else:
                    mod.external.append((name, node.lineno))
    return modules


MODULES = load()


def _layer(module: str) -> str:
    """'kvstore.engine' -> 'kvstore'; 'wire.native.events' -> 'wire'; 'errors' -> 'errors'."""
    return module.split(".")[0] if module else ""


def _public_face(target: str) -> bool:
    """What bench may import: a package's `__init__`, any wire codec or connector module (the
    paths users type), the bottom layer."""
    if _layer(target) in BOTTOM | {"wire", "connectors", ""}:
        return True
    module = MODULES.get(target)
    return module is not None and module.path.name == "__init__.py"


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_import_edges(module: str) -> None:
    mod = MODULES[module]
    layer = _layer(module)
    for name, line in mod.external:
        top = name.split(".")[0]
        assert top not in PACKAGES, f"{module}:{line}: import {name!r} bare; use kvoffload.{name}"
        assert top not in FORBIDDEN.get(layer, ()), f"{module}:{line} ({layer}) imports {name}"
    for target, line, _ in mod.imports:
        target_layer = _layer(target)
        if target_layer in BOTTOM or target_layer == layer or target == "":
            continue
        assert layer not in BOTTOM, f"{module}:{line}: the bottom layer imports {target}"
        allowed = target_layer in ALLOWED[layer] or (
            module in SDK_ENGINE_DOORS and target_layer == "kvstore"
        )
        assert allowed, f"{module}:{line} ({layer}) may not import {target} ({target_layer})"
        if layer == "bench" and target not in OPTIONAL:  # an optional module is its own face
            assert _public_face(target), f"{module}:{line}: bench imports {target}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    edges = {name: {t for t, _, _ in mod.imports if t in MODULES} for name, mod in MODULES.items()}
    assert _cycles(edges) == []


def test_no_imports_inside_functions() -> None:
    bad = [
        f"{name}:{line} imports {target}"
        for name, mod in sorted(MODULES.items())
        for target, line, inside in mod.imports
        if inside and target not in OPTIONAL
    ]
    assert bad == []


def test_no_base_class_with_one_subclass() -> None:
    """A base that is never made on its own and has one subclass only splits a class in two."""
    classes: dict[str, str] = {}  # class name -> module (project classes only)
    bases: dict[str, list[str]] = {}
    made: set[str] = set()  # names called somewhere: classes that are concrete on their own
    for name, mod in MODULES.items():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Call):
                func = node.func
                made.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, name)
                for base in node.bases:
                    base_name = base.id if isinstance(base, ast.Name) else None
                    if isinstance(base, ast.Attribute):
                        base_name = base.attr
                    if base_name:
                        bases.setdefault(base_name, []).append(f"{name}.{node.name}")
    lonely = {
        f"{classes[base]}.{base}": subs
        for base, subs in bases.items()
        if base in classes and len(subs) == 1 and base not in made and not _is_error(base)
    }
    assert set(lonely) <= ONE_SUBCLASS_LEFT, lonely


def _is_error(class_name: str) -> bool:
    """Exceptions form one hierarchy (errors.py): a leaf with one refinement is fine there."""
    return class_name.endswith(("Error", "Exception"))


def test_at_most_14_modules_per_package() -> None:
    crowded = {}
    for top in ["kvoffload", *PACKAGES]:
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or not (folder / "__init__.py").exists():
                continue
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES_PER_PACKAGE:
                crowded[str(folder.relative_to(ROOT))] = count
    assert crowded == {}


def test_namespace_root_holds_only_the_bottom_layer() -> None:
    files = {p.name for p in (ROOT / "kvoffload").iterdir() if not p.name.startswith("__pycache")}
    assert files - {p.name for p in (ROOT / "kvoffload").glob("_speedups*")} >= {
        "__init__.py",
        "errors.py",
        "buffers.py",
        "cli.py",
        "py.typed",
        "wire",
    }
    assert {p.name for p in (ROOT / "kvoffload").glob("*.py")} == {
        "__init__.py",
        "errors.py",
        "buffers.py",
        "cli.py",
    }


def test_the_checkers_catch_what_they_check(tmp_path: Path) -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    import socket\nimport os\n")
    inside = _function_nodes(tree)
    imports = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Import)), key=lambda n: n.lineno
    )
    assert [id(n) in inside for n in imports] == [True, False]
    assert not _public_face("kvstore.described") and _public_face("kvstore")
    assert "kvstore" not in ALLOWED["wire"] and "client_sdk" not in ALLOWED["nvmeof_target"]
