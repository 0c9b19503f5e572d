"""Maps the top-level folders onto the `kvoffload` namespace; metadata lives in pyproject."""

from setuptools import setup

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


setup(
    package_dir=_package_dir(),
    packages=_packages(),
    package_data={"kvoffload": ["py.typed"], "kvoffload.bench": ["data/*"]},
)
