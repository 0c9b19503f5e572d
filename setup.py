"""Maps the top-level folders onto the `kvoffload` namespace; metadata lives in pyproject."""

from setuptools import Extension, setup

SUBPACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]


def _package_dir() -> dict[str, str]:
    mapping = {"kvoffload": "kvoffload"}
    mapping.update({f"kvoffload.{name}": name for name in SUBPACKAGES})
    return mapping


def _packages() -> list[str]:
    import os

    found = ["kvoffload"]
    for name in SUBPACKAGES:
        for root, dirs, files in os.walk(name):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                found.append("kvoffload." + root.replace(os.sep, "."))
    return found


# The data plane's C fast path (client_sdk/wire/fast.py falls back to Python without it):
# optional, so that a machine without a compiler still installs; CI sets KVOFFLOAD_REQUIRE_EXT
# to prove it built.
SPEEDUPS = Extension(
    "kvoffload.client_sdk.wire._speedups",
    sources=["client_sdk/wire/_speedups.c", "client_sdk/wire/_speedups_frames.c"],
    depends=["client_sdk/wire/_speedups.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)


setup(
    ext_modules=[SPEEDUPS],
    package_dir=_package_dir(),
    packages=_packages(),
    package_data={"kvoffload": ["py.typed"], "kvoffload.bench": ["data/*"]},
)
