"""deploy/: the Kubernetes manifests pass the Kubernetes API schemas (kubernetes-validate ships
them, so this runs offline), and the configs and command lines there load as the daemon reads
them."""

from __future__ import annotations

import configparser
import copy
import re
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


def _load(toml: str, argv: list[str], tmp_path: Path, environ: dict[str, str] | None = None) -> Any:
    """load_config as `kvoffload <argv>` runs it, the config file's text being `toml`."""
    path = tmp_path / "kvoffload.toml"
    path.write_text(toml)
    assert Path(argv[0]).name == "kvoffload" and argv[1] == "serve", argv
    flags = [str(path) if a.endswith("/kvoffload.toml") else a for a in argv[2:]]
    build_flag_parser().parse_args(flags)  # every flag exists
    return load_config(None, environ or {}, flags)


def _pod_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: `fields` gives the downward API's
    values (metadata.name, status.podIP), and $(NAME) expands an earlier variable."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
        else:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env[item["name"]] = value
    return env


def test_the_targets_are_a_statefulset_with_stable_ids_and_volumes(tmp_path: Path) -> None:
    (target,) = [d for n, d in DOCS if n == "targets.yaml:StatefulSet"]
    (config_map,) = [d for n, d in DOCS if n == "targets.yaml:ConfigMap"]
    spec = target["spec"]
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (container,) = spec["template"]["spec"]["containers"]
    pod = "kvoffload-target-1"
    env = _pod_env(container, {"metadata.name": pod, "status.podIP": "10.1.2.3"})
    argv = [a.replace("$(POD_IP)", env["POD_IP"]) for a in container["command"]]
    config = _load(config_map["data"]["kvoffload.toml"], argv, tmp_path, env)
    assert config.cluster.node_id == pod  # the pod name is the node id
    endpoint = config.cluster.endpoint
    # Its own etcd user (the role layout's per-node user) and its own password file.
    assert endpoint.access.user == f"kvoffload-prod-node-{pod}"
    assert endpoint.access.password_file == f"/etc/kvoffload/etcd-user/{pod}"
    assert (endpoint.host, endpoint.port, endpoint.cluster) == ("kvoffload-etcd", 2379, "prod")
    assert config.cluster.advertise == "10.1.2.3" and config.data_dir == "/var/lib/kvoffload"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == config.data_dir
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    _assert_locked_down(config)
    # Every file the config names comes from a Secret mounted where the config looks.
    files = [
        config.native.tls.cert_file, config.native.tls.key_file, endpoint.access.ca,
        endpoint.access.cert, endpoint.access.key, endpoint.access.password_file,
        config.cluster.members_key_file,
    ]  # fmt: skip
    for file in files:
        (name,) = [n for n, at in mounts.items() if file.startswith(at + "/")]
        assert "secret" in volumes[name], f"{file} is not from a Secret"
    # The nodes' passwords, keyed by pod name; not the root's or the client's.
    assert volumes["etcd-user"]["secret"] == {"secretName": "kvoffload-etcd-nodes"}
    # etcd.yaml's Job makes a user for every pod the StatefulSet runs.
    (job,) = [d for n, d in DOCS if n == "etcd.yaml:Job"]
    (setup,) = job["spec"]["template"]["spec"]["containers"]
    nodes = {e["name"]: e.get("value") for e in setup["env"]}["NODES"]
    assert nodes.split() == [f"kvoffload-target-{i}" for i in range(spec["replicas"])]


def _assert_locked_down(config: Any) -> None:
    """A node's config with etcd over TLS as an etcd user whose password is in a file (with a
    client certificate), and its native front over TLS."""
    access = config.cluster.endpoint.access
    assert access.tls and access.ca and access.cert and access.key
    assert access.user and access.password_file and not access.password
    assert config.native.tls.enabled
    assert config.cluster.members_key_file  # the node signs its record


def test_etcd_serves_tls_only_with_client_certificates_and_turns_auth_on() -> None:
    (etcd,) = [d for n, d in DOCS if n == "etcd.yaml:StatefulSet"]
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in container["command"][1:])
    assert flags["--listen-client-urls"].startswith("https://")
    assert flags["--advertise-client-urls"].startswith("https://")
    assert "--client-cert-auth" in flags and flags["--trusted-ca-file"]
    assert flags["--cert-file"] and flags["--key-file"]
    # The only plain-HTTP port serves /health and metrics, not the key-value API.
    assert flags["--listen-metrics-urls"].startswith("http://")
    assert container["readinessProbe"]["httpGet"]["port"] == 2381
    (job,) = [d for n, d in DOCS if n == "etcd.yaml:Job"]
    (setup,) = job["spec"]["template"]["spec"]["containers"]
    script = setup["command"][-1]
    assert script.rstrip().endswith("etcdctl auth enable")
    # The role layout of docs/guides/cluster.md: each node writes its own record key alone (no
    # --prefix: node a's role does not cover node ab), clients only read the prefix.
    node_role = '"kvoffload-prod-node-$id"'
    grant = f'grant-permission {node_role} readwrite "/kvoffload/prod/nodes/$id"\n'
    assert grant in script
    assert f"user grant-role {node_role} {node_role}" in script
    assert "grant-permission kvoffload-prod-client read --prefix=true /kvoffload/prod/" in script
    assert "user grant-role kvoffload-client kvoffload-prod-client" in script
    assert "kvoffload-prod-node readwrite" not in script  # no shared node role
    env = {e["name"]: e for e in setup["env"]}
    assert env["ETCDCTL_ENDPOINTS"]["value"].startswith("https://")
    assert all("secretKeyRef" in env[n]["valueFrom"] for n in ("ROOT_PASSWORD", "CLIENT_PASSWORD"))


def test_the_systemd_unit_runs_serve_with_the_example_config(tmp_path: Path) -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read(DEPLOY / "systemd" / "kvoffload-node.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    config = _load((DEPLOY / "systemd" / "kvoffload.toml").read_text(), argv, tmp_path)
    endpoint = config.cluster.endpoint
    assert (endpoint.host, endpoint.port, endpoint.cluster) == ("etcd-1", 2379, "prod")
    assert config.data_dir == "/var/lib/kvoffload" and config.cluster.advertise == "10.0.0.5"
    _assert_locked_down(config)
    # The per-node layout: a fixed id and the user whose role covers that id's key alone.
    node_id = config.cluster.node_id
    assert node_id and endpoint.access.user == f"kvoffload-prod-node-{node_id}"
