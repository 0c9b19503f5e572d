"""deploy/: the Kubernetes manifests pass the Kubernetes API schemas (kubernetes-validate ships
them, so this runs offline), and the configs and command lines there load as the daemon reads
them."""

from __future__ import annotations

import configparser
import copy
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate  # the test extra installs it (schemas included: no network)
import pytest
import yaml

from kvoffload.nvmeof_target.config import build_flag_parser, load_config

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.37.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [(f"{path.name}:{d['kind']}", d) for d in yaml.safe_load_all(path.read_text())]
    return docs


DOCS = _documents()


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_manifests_pass_the_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_rejects_a_broken_manifest() -> None:
    (target,) = [d for n, d in DOCS if n == "targets.yaml:StatefulSet"]
    broken = copy.deepcopy(target)
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(target)
    unknown["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)


def _load(toml: str, argv: list[str], tmp_path: Path) -> Any:
    """load_config as `kvoffload <argv>` runs it, the config file's text being `toml`."""
    path = tmp_path / "kvoffload.toml"
    path.write_text(toml)
    assert Path(argv[0]).name == "kvoffload" and argv[1] == "serve", argv
    flags = [str(path) if a == "/etc/kvoffload/kvoffload.toml" else a for a in argv[2:]]
    build_flag_parser().parse_args(flags)  # every flag exists
    return load_config(None, {}, flags)


def test_the_targets_are_a_statefulset_with_stable_ids_and_volumes(tmp_path: Path) -> None:
    (target,) = [d for n, d in DOCS if n == "targets.yaml:StatefulSet"]
    (config_map,) = [d for n, d in DOCS if n == "targets.yaml:ConfigMap"]
    spec = target["spec"]
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["KVOFFLOAD_CLUSTER__NODE_ID"] == "metadata.name"  # the pod name is the node id
    argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in container["command"]]
    config = _load(config_map["data"]["kvoffload.toml"], argv, tmp_path)
    assert config.cluster.endpoint == ("kvoffload-etcd", 2379, "prod")
    assert config.cluster.advertise == "10.1.2.3" and config.data_dir == "/var/lib/kvoffload"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == config.data_dir


def test_the_systemd_unit_runs_serve_with_the_example_config(tmp_path: Path) -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read(DEPLOY / "systemd" / "kvoffload-node.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    config = _load((DEPLOY / "systemd" / "kvoffload.toml").read_text(), argv, tmp_path)
    assert config.cluster.endpoint == ("etcd-1", 2379, "prod")
    assert config.data_dir == "/var/lib/kvoffload" and config.cluster.advertise == "10.0.0.5"
