"""Challenge–response at Hello (native protocol 5): per-node keys and the proofs both ends make.

The tenant's secret (the `token` a client holds) never crosses the wire. Each node holds, per
tenant, its own key ``K_node = KDF(secret, node id)`` (keyed BLAKE3 in derive-key mode), which
the operator derives with ``kvoffload node-key`` and the client derives from its secret and
the node id the node announces. A Hello then goes:

    client -> Hello(tenant, client nonce)      node -> Challenge(node id, node nonce)
    client -> Auth(proof)                      node -> Welcome(tenant, node's proof)

where both proofs are keyed BLAKE3 under ``K_node`` over both nonces, the node id, the
tenant and, over TLS, the node's certificate (`tls_binding`, as RFC 5929's
tls-server-end-point: a proof made through one TLS endpoint fails at another), each side with
its own label. What a node learns is bound to its own key and to one
connection's nonces: it cannot be replayed on another connection or to another node, and a
node holding only its ``K_node`` cannot compute another node's key.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets

from blake3 import blake3

from kvoffload.errors import InvalidArgumentError

__all__ = [
    "KEY_BYTES",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "client_proof",
    "new_nonce",
    "node_key",
    "parse_node_key",
    "server_proof",
    "tls_binding",
    "tls_binding_of_pem",
]

NONCE_BYTES = 32
KEY_BYTES = 32
PROOF_BYTES = 32
# BLAKE3's derive-key context: globally unique and fixed, so keys never collide with another use.
_KDF_CONTEXT = "kvoffload 2026-12-05 native hello node key v1"


def _field(data: bytes) -> bytes:
    # Length-prefixed, so that no two different (tenant, node, ...) tuples hash alike.
    return len(data).to_bytes(4, "little") + data


def node_key(secret: str, node: str) -> bytes:
    """The key node `node` holds for the tenant whose secret is `secret`.

    Raises:
        InvalidArgumentError: an empty secret.
    """
    if not secret:
        raise InvalidArgumentError("a node key needs a non-empty tenant secret")
    material = _field(node.encode()) + secret.encode()
    return blake3(material, derive_key_context=_KDF_CONTEXT).digest(KEY_BYTES)


def parse_node_key(text: str) -> bytes:
    """A node key from its hex form (what `kvoffload node-key` prints).

    Raises:
        InvalidArgumentError: not 64 hex digits.
    """
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise InvalidArgumentError(f"a node key is {2 * KEY_BYTES} hex digits")
    return key


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def tls_binding(certificate_der: bytes) -> bytes:
    """What binds a proof to a TLS connection: a digest of the node's (leaf) certificate."""
    return blake3(b"kvoffload tls-server-end-point\0" + certificate_der).digest(32)


_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)


def tls_binding_of_pem(pem: str) -> bytes:
    """`tls_binding` of the first (leaf) certificate of a PEM file's text.

    Raises:
        InvalidArgumentError: no certificate in it.
    """
    found = _PEM_CERT.search(pem)
    if found is None:
        raise InvalidArgumentError("no PEM certificate found")
    try:  # PEM is the DER in base64 between its markers (RFC 7468); no sockets in `wire`
        return tls_binding(base64.b64decode("".join(found.group(1).split()), validate=True))
    except binascii.Error as exc:
        raise InvalidArgumentError(f"bad PEM certificate: {exc}") from None


def _proof(
    key: bytes,
    side: bytes,
    tenant: str,
    node: str,
    client_nonce: bytes,
    node_nonce: bytes,
    binding: bytes,
) -> bytes:
    message = b"".join(
        (
            b"kvoffload hello v1\0",
            side,
            _field(tenant.encode()),
            _field(node.encode()),
            _field(client_nonce),
            _field(node_nonce),
            _field(binding),
        )
    )
    return blake3(message, key=key).digest(PROOF_BYTES)


def client_proof(
    key: bytes,
    tenant: str,
    node: str,
    client_nonce: bytes,
    node_nonce: bytes,
    binding: bytes = b"",
) -> bytes:
    """The client's answer to a Challenge; `tenant` as its Hello named it ("" = any);
    `binding`: `tls_binding` of the node's certificate over TLS, else b""."""
    return _proof(key, b"client\0", tenant, node, client_nonce, node_nonce, binding)


def server_proof(
    key: bytes,
    tenant: str,
    node: str,
    client_nonce: bytes,
    node_nonce: bytes,
    binding: bytes = b"",
) -> bytes:
    """The node's proof in its Welcome that it holds `key`; `tenant` as the Welcome names it."""
    return _proof(key, b"server\0", tenant, node, client_nonce, node_nonce, binding)
