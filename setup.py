"""Maps the top-level folders onto the `kvoffload` namespace; metadata lives in pyproject."""

import os

from setuptools import Extension, setup

SUBPACKAGES = ["kvstore", "client_sdk", "nvmeof_target", "connectors", "compression", "bench"]


def _package_dir() -> dict[str, str]:
    mapping = {"kvoffload": "kvoffload"}
    mapping.update({f"kvoffload.{name}": name for name in SUBPACKAGES})
    return mapping


def _packages() -> list[str]:
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
    sources=[
        "kvoffload/wire/_speedups.c",
        "kvoffload/wire/_speedups_frames.c",
        "kvoffload/wire/_speedups_crc.c",
        "kvoffload/wire/_speedups_net.c",
    ],
    depends=["kvoffload/wire/_speedups.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)

# The daemon's C core (kvoffload/core/__init__.py falls back to Python without it): optional
# the same way.
CORE = Extension(
    "kvoffload.core._core",
    sources=[
        "kvoffload/core/_core.c",
        "kvoffload/core/index.c",
        "kvoffload/core/hot.c",
        "kvoffload/core/uring.c",
        # The CRC32C kernels again, for `copy_crc32c` (kvstore may not import kvoffload.wire).
        "kvoffload/wire/_speedups_crc.c",
    ],
    depends=["kvoffload/core/core.h", "kvoffload/wire/_speedups.h"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)


EXTENSIONS = [SPEEDUPS, CORE]

# KVOFFLOAD_SANITIZE=1: every extension with AddressSanitizer + UBSan, for the sanitized fuzz run
# (tests/reliability/sanitized.sh); one loop, so an extension added above gets it too. Not
# optional there: a sanitized build that silently fell back to Python would test nothing.
if os.environ.get("KVOFFLOAD_SANITIZE") == "1":
    _SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    for _ext in EXTENSIONS:
        # -fno-wrapv undoes Python's -fwrapv, under which UBSan ignores signed overflow.
        _ext.extra_compile_args += [*_SAN, "-fno-wrapv", "-fno-omit-frame-pointer", "-g", "-O1"]
        _ext.extra_link_args += _SAN
        _ext.optional = False

setup(
    ext_modules=EXTENSIONS,
    package_dir=_package_dir(),
    packages=_packages(),
    package_data={"kvoffload": ["py.typed"], "kvoffload.bench": ["data/*", "data/*/*"]},
)
