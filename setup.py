"""Maps the top-level folders onto the `kvoffload` namespace; metadata lives in pyproject."""

from setuptools import Extension, setup

SUBPACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]


def _package_dir() -> dict[str, str]:
    mapping = {"kvoffload": "kvoffload"}
    mapping.update({f"kvoffload.{name}": name for name in SUBPACKAGES})
    return mapping


def _packages() -> list[str]:
    import os

    found = []
    for name in ["kvoffload", *SUBPACKAGES]:
        for root, dirs, files in os.walk(name):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                dotted = root.replace(os.sep, ".")
                found.append(dotted if name == "kvoffload" else "kvoffload." + dotted)
    return found


# The data plane's C fast path (kvoffload/wire/fast.py falls back to Python without it):
# optional, so that a machine without a compiler still installs; CI sets KVOFFLOAD_REQUIRE_EXT
# to prove it built.
SPEEDUPS = Extension(
    "kvoffload.wire._speedups",
    sources=["kvoffload/wire/_speedups.c", "kvoffload/wire/_speedups_frames.c"],
    depends=["kvoffload/wire/_speedups.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)

# The daemon's C core (kvoffload/core/__init__.py falls back to Python without it): optional
# the same way.
CORE = Extension(
    "kvoffload.core._core",
    sources=["kvoffload/core/_core.c", "kvoffload/core/index.c", "kvoffload/core/hot.c"],
    depends=["kvoffload/core/core.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)


setup(
    ext_modules=[SPEEDUPS, CORE],
    package_dir=_package_dir(),
    packages=_packages(),
    package_data={"kvoffload": ["py.typed"], "kvoffload.bench": ["data/*"]},
)
