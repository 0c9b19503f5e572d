"""A real etcd (Debian's etcd-server, installed by .ci/deps) for the cluster tests."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import shutil
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvoffload.bench.cluster.etcd import etcd_argv, etcd_healthy
from kvoffload.bench.common import free_port, stop_process


@dataclass(frozen=True)
class Pki:
    """A test CA and what it signed: a server certificate for 127.0.0.1 and localhost (etcd's
    and the daemons'), and a client certificate (etcd checks one from every caller)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def make_pki(directory: Path, name: str = "kvoffload test CA") -> Pki:
    """A fresh CA in `directory` and certificates it signed (valid for a day)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(stem: str, common_name: str, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = x509.oid.ExtendedKeyUsageOID
        subject = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if common_name else []
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                # etcd's HTTP gateway calls etcd's own gRPC with the server certificate: with
                # client certificates required, that one must serve as a client's too.
                x509.ExtendedKeyUsage(
                    [usage.SERVER_AUTH, usage.CLIENT_AUTH] if server else [usage.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path = directory / f"{stem}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, _write_key(directory / f"{stem}.key", key)

    server_cert, server_key = issue("server", "localhost", server=True)
    # No CommonName: etcd (3.4) refuses a gateway call from a client certificate with one, as
    # its CN would not be taken as the etcd user there (the credentials say who calls).
    client_cert, client_key = issue("client", "", server=False)
    return Pki(directory / "ca.pem", server_cert, server_key, client_cert, client_key)


class EtcdServer:
    """One etcd member on `host`, data in `data_dir`; stop() and start() keep the data. With
    `pki`, etcd serves TLS only and wants a client certificate signed by the test CA."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", pki: Pki | None = None) -> None:
        self.pki = pki
        self.extra_args: list[str] = []  # further flags of the next start()
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd is not installed (bash .ci/deps installs Debian's etcd-server)")
        self.binary, self.data_dir, self.host = binary, data_dir, host
        self.port = free_port(host)
        self.peer_port = free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base(self) -> str:
        return f"{'https' if self.pki else 'http'}://{self.endpoint}"

    def _context(self) -> ssl.SSLContext | None:
        if self.pki is None:
            return None
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        return context

    def start(self) -> None:
        peer = f"http://{self.host}:{self.peer_port}"
        args = etcd_argv(self.binary, "kvtest", self.data_dir, self.base, peer)
        if self.pki is not None:
            args += [
                "--cert-file", str(self.pki.server_cert), "--key-file", str(self.pki.server_key),
                "--trusted-ca-file", str(self.pki.ca), "--client-cert-auth",
            ]  # fmt: skip
        args += self.extra_args
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"etcd did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        return etcd_healthy(self.base, self._context())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, 10)
        self.proc = None

    def keys(self, prefix: bytes) -> dict[bytes, bytes]:
        """The keys under `prefix` and their values (a direct read, for assertions)."""
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = json.dumps(
            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
        ).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=body)
        with urllib.request.urlopen(req, timeout=5) as resp:
            answer = json.load(resp)
        return {
            base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", ""))
            for kv in answer.get("kvs", [])
        }

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        """Put `value` at `key` (held by `lease`, if not 0), as an open etcd lets anyone."""
        fields = {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()}
        if lease:
            fields["lease"] = str(lease)
        body = json.dumps(fields).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/put", data=body)
        with urllib.request.urlopen(req, timeout=5):
            pass

    def delete(self, key: bytes) -> None:
        body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/deleterange", data=body)
        with urllib.request.urlopen(req, timeout=5):
            pass

    # ------------------------------------------------------------------ auth (over the gateway)

    def call(self, path: str, body: dict[str, object], token: str = "") -> dict[str, object]:
        """POST to etcd's v3 gateway (as `token`'s user); the answer, or HTTPError."""
        request = urllib.request.Request(f"{self.base}{path}", data=json.dumps(body).encode())
        if token:
            request.add_header("Authorization", token)
        with urllib.request.urlopen(request, timeout=5, context=self._context()) as resp:
            answer: dict[str, object] = json.load(resp)
        return answer

    def lock_down(
        self, cluster: str, passwords: dict[str, str], per_node: dict[str, str] | None = None
    ) -> None:
        """Turn etcd's auth on with the role layout of docs/guides/cluster.md: `root`; role
        `kvoffload-<cluster>-node` may read and write the cluster's prefix and role
        `kvoffload-<cluster>-client` may only read it; users `node` and `reader` hold them.
        `passwords` gives each of root, node and reader its password. `per_node` (node id to
        password) adds the per-node layout: user and role `kvoffload-<cluster>-node-<id>`, which
        may read and write the node's record key only."""
        for node_id, password in (per_node or {}).items():
            key = f"/kvoffload/{cluster}/nodes/{node_id}".encode()
            role = user = f"kvoffload-{cluster}-node-{node_id}"
            self.call("/v3/auth/user/add", {"name": user, "password": password})
            self.call("/v3/auth/role/add", {"name": role})
            # No range_end: the one key, so node "a" cannot write "ab" either.
            own = {"permType": "READWRITE", "key": base64.b64encode(key).decode()}
            self.call("/v3/auth/role/grant", {"name": role, "perm": own})
            self.call("/v3/auth/user/grant", {"user": user, "role": role})
        prefix = f"/kvoffload/{cluster}/".encode()
        span = {
            "key": base64.b64encode(prefix).decode(),
            "range_end": base64.b64encode(prefix[:-1] + b"0").decode(),  # "/" + 1
        }
        roles = {"node": "READWRITE", "client": "READ"}
        for user in ("root", "node", "reader"):
            self.call("/v3/auth/user/add", {"name": user, "password": passwords[user]})
        self.call("/v3/auth/role/add", {"name": "root"})
        self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        for role, perm in roles.items():
            name = f"kvoffload-{cluster}-{role}"
            self.call("/v3/auth/role/add", {"name": name})
            self.call("/v3/auth/role/grant", {"name": name, "perm": {"permType": perm, **span}})
        self.call("/v3/auth/user/grant", {"user": "node", "role": f"kvoffload-{cluster}-node"})
        self.call("/v3/auth/user/grant", {"user": "reader", "role": f"kvoffload-{cluster}-client"})
        self.call("/v3/auth/enable", {})
