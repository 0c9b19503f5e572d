"""Cluster membership records and etcd v3 HTTP/JSON gateway messages, sans-I/O.

A storage node registers one record under ``/kvoffload/<cluster>/nodes/<node id>``; clients list
and watch that prefix. The daemon writes records and the SDK reads them, so both sides use this
one codec. etcd 3.4 serves its gRPC API as JSON under ``/v3/...`` (bytes fields are base64, 64-bit
integers are strings); the builders here return ``(path, body)`` pairs and the parsers take the
decoded JSON answer, so the callers own the sockets (docs/design/architecture.md says why the
gateway).
"""

from __future__ import annotations

import base64
import hmac
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import blake3

from kvoffload.errors import AuthError, ConfigError, InvalidArgumentError, RemoteProtocolError

__all__ = [
    "ETCD_PARAMS",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "NO_ACCESS",
    "RECORD_VERSION",
    "EtcdAccess",
    "EtcdEndpoint",
    "KeyValue",
    "Member",
    "MembersKey",
    "Request",
    "WatchEvent",
    "auth_request",
    "check_name",
    "claim_request",
    "etcd_refusal",
    "decode_member",
    "encode_member",
    "get_request",
    "grant_request",
    "keepalive_request",
    "lease_ttl",
    "nodes_prefix",
    "parse_claim",
    "parse_auth",
    "parse_etcd_url",
    "parse_grant",
    "parse_range",
    "parse_watch",
    "range_request",
    "redact_url",
    "revoke_request",
    "watch_request",
]

RECORD_VERSION = 1
# A node's weight is its capacity in GiB by default: 1 MiB to about 1 PiB. Bounded so that no
# record (a typo, a hostile writer) can take every placement or drop out of all of them.
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1_000_000.0
# Cluster names and node ids become etcd key segments and log words: keep them plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# Largest record accepted from etcd: a record is a few hundred bytes; bounds a hostile one.
_MAX_RECORD = 4096
# A front address: "host:port", optionally "/<subsystem nqn>" for NVMe/TCP.
_FRONT = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}:[0-9]{1,5}(/[\x21-\x7e]{1,223})?")


def check_name(name: str, what: str) -> str:
    """Return `name` if it is a valid cluster name or node id.

    Raises:
        InvalidArgumentError: it is not.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"{what} {name!r} must be 1-63 letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit)"
        )
    return name


# Options of an etcd:// URL (name -> meaning); the node's [cluster] etcd_* keys set the same.
ETCD_PARAMS = {
    "ca": "CA file that signed etcd's certificate (etcds://; default: the system's CAs)",
    "cert": "client certificate file, for an etcd that checks client certificates",
    "key": "private key of cert (if not in the same file)",
    "password_file": "file holding the password of the URL's user (instead of user:pass@)",
}


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach an etcd beyond its address: TLS (etcds://, a CA, a client certificate) and
    the credentials of a user of etcd's v3 auth. The password never appears in repr or str."""

    tls: bool = False
    user: str = ""
    password: str = field(default="", repr=False)
    password_file: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if (self.password or self.password_file) and not self.user:
            raise InvalidArgumentError("an etcd password needs a user (etcd://USER:PASS@...)")
        if self.password and self.password_file:
            raise InvalidArgumentError("give the etcd password in the URL or a file, not both")
        if (self.ca or self.cert or self.key) and not self.tls:
            raise InvalidArgumentError("etcd ca/cert/key need TLS: use etcds://")
        if self.key and not self.cert:
            raise InvalidArgumentError("an etcd client key needs its certificate (cert)")

    def credentials(self) -> tuple[str, str] | None:
        """(user, password), or None without a user.

        Raises:
            ConfigError: the password file cannot be read or is empty.
        """
        if not self.user:
            return None
        if not self.password_file:
            return self.user, self.password
        try:
            password = Path(self.password_file).read_text().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd password file {self.password_file!r}: {exc}") from None
        if not password:
            raise ConfigError(f"etcd password file {self.password_file!r} is empty")
        return self.user, password


# Plain HTTP, no user: etcd as the tests and a private network run it.
NO_ACCESS = EtcdAccess()


@dataclass(frozen=True)
class EtcdEndpoint:
    """A parsed ``etcd[s]://[USER[:PASS]@]HOST:PORT/NAME[?ca=..&cert=..&key=..]``."""

    host: str
    port: int
    cluster: str
    access: EtcdAccess = NO_ACCESS

    def __str__(self) -> str:
        """The URL as it may be logged: the password is never part of it."""
        user = f"{self.access.user}@" if self.access.user else ""
        scheme = "etcds" if self.access.tls else "etcd"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{user}{host}:{self.port}/{self.cluster}"


def parse_etcd_url(url: str) -> EtcdEndpoint:
    """``etcd://HOST:PORT/NAME`` (plain HTTP) or ``etcds://`` (TLS), with an optional
    ``USER:PASS@`` and the options of ETCD_PARAMS.

    Raises:
        InvalidArgumentError: it is not such a URL, or its options do not fit together. The
            message never holds the password.
    """
    parts = urlsplit(url)
    shown = redact_url(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if parts.scheme not in ("etcd", "etcds") or not host or not port:
        raise InvalidArgumentError(f"{shown!r} is not etcd[s]://[USER:PASS@]HOST:PORT/NAME")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    params = dict(pairs)
    unknown = sorted(set(params) - set(ETCD_PARAMS))
    if unknown or len(params) != len(pairs):
        valid = ", ".join(f"{k} ({v})" for k, v in ETCD_PARAMS.items())
        raise InvalidArgumentError(f"{shown!r}: unknown or repeated parameter(s); valid: {valid}")
    access = EtcdAccess(
        tls=parts.scheme == "etcds",
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        **params,
    )
    return EtcdEndpoint(host, port, check_name(parts.path.strip("/"), "cluster name"), access)


def redact_url(url: str) -> str:
    """`url` with the password of its user part replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    user, at, address = netloc.rpartition("@")
    if not sep or not at or ":" not in user:
        return url
    return f"{scheme}://{user.partition(':')[0]}:***@{address}{slash}{tail}"


# Domain separation: a membership MAC is never valid as any other keyed BLAKE3 of the project.
_SIG_CONTEXT = b"kvoffload membership record\0"


@dataclass(frozen=True)
class MembersKey:
    """A cluster's membership key: a 32-byte secret that nodes sign their records with and
    clients verify them with (keyed BLAKE3). It is shared, so every holder, node or client, can
    sign a record for any node. The secret is never in repr, str or a message."""

    secret: bytes = field(repr=False)
    source: str = ""  # where it was read from, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != 32:
            raise InvalidArgumentError("a membership key is 32 bytes")

    @classmethod
    def from_file(cls, path: str) -> MembersKey:
        """The key in `path`: its first line, 64 hex digits (``openssl rand -hex 32``).

        Raises:
            ConfigError: the file cannot be read or holds no such key (the message names the
                file, never its content).
        """
        try:
            line = Path(path).read_text().split("\n", 1)[0].strip()
            return cls(bytes.fromhex(line) if len(line) == 64 else b"", path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"membership key file {path!r}: {exc}") from None
        except (ValueError, InvalidArgumentError):
            raise ConfigError(
                f"membership key file {path!r}: its first line must be 64 hex digits "
                "(openssl rand -hex 32)"
            ) from None

    def sign(self, key: bytes, body: bytes) -> str:
        """The MAC of the record `body` stored at etcd key `key` (which names the cluster and
        the node), as hex."""
        mac = blake3.blake3(_SIG_CONTEXT + key + b"\0" + body, key=self.secret)
        return mac.hexdigest()

    def verify(self, key: bytes, body: bytes, sig: str) -> bool:
        return hmac.compare_digest(self.sign(key, body), sig)


def nodes_prefix(cluster: str) -> bytes:
    """The etcd prefix under which the nodes of `cluster` register."""
    return f"/kvoffload/{check_name(cluster, 'cluster name')}/nodes/".encode()


@dataclass(frozen=True)
class Member:
    """One storage node as its record describes it.

    `fronts` maps a front name ("native", "nvme") to its address ("host:port", for NVMe/TCP
    "host:port/<subsystem nqn>"); `weight` is the node's share of placements (its capacity);
    `nonce` is random per daemon process, so a restart is told from a second live process.
    """

    node_id: str
    fronts: Mapping[str, str] = field(default_factory=dict)
    weight: float = 1.0
    nonce: str = ""

    def __post_init__(self) -> None:
        node = check_name(self.node_id, "node id")
        weight = self.weight
        if not (
            isinstance(weight, (int, float))
            and math.isfinite(weight)
            and MIN_WEIGHT <= weight <= MAX_WEIGHT
        ):
            raise InvalidArgumentError(
                f"node {node}: weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], "
                f"got {weight!r}"
            )
        for name, address in self.fronts.items():
            if not (isinstance(name, str) and isinstance(address, str)):
                raise InvalidArgumentError(f"node {node}: fronts must map names to addresses")
            if not _FRONT.fullmatch(address):
                raise InvalidArgumentError(f"node {node}: bad {name} front address {address!r}")
        if not isinstance(self.nonce, str) or len(self.nonce) > 64:
            raise InvalidArgumentError(f"node {node}: nonce must be a string of <= 64 chars")


def _canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def encode_member(
    member: Member, members_key: MembersKey | None = None, *, key: bytes = b"", lease: int = 0
) -> bytes:
    """The record's bytes (JSON: readable with `etcdctl get`). With `members_key` the record
    carries the etcd `lease` it is put under and a MAC (``sig``) over itself and its etcd `key`:
    a copy put at another key, under another lease or with any field changed does not verify."""
    record: dict[str, Any] = {
        "v": RECORD_VERSION,
        "node_id": member.node_id,
        "fronts": dict(member.fronts),
        "weight": member.weight,
        "nonce": member.nonce,
    }
    if members_key is not None:
        record["lease"] = str(lease)
        record["sig"] = members_key.sign(key, _canonical(record))
    return _canonical(record)


def decode_member(
    key: bytes,
    value: bytes,
    prefix: bytes,
    members_key: MembersKey | None = None,
    lease: int = 0,
) -> Member:
    """Parse the record stored at `key` (under etcd lease `lease`); with `members_key`, only a
    record signed with that key for this key and lease.

    Raises:
        RemoteProtocolError: not a record of this cluster (foreign key, bad JSON, unknown version,
            a node id that is not the key's), a bad field, or, with `members_key`, a record
            that is unsigned, badly signed, or signed for another lease (a replay).
    """
    if not key.startswith(prefix):
        raise RemoteProtocolError(f"key {key[:80]!r} is not under {prefix!r}")
    if len(value) > _MAX_RECORD:
        raise RemoteProtocolError(f"record {key[:80]!r} is {len(value)} bytes (> {_MAX_RECORD})")
    try:
        record = json.loads(value)
    except (UnicodeDecodeError, ValueError):
        raise RemoteProtocolError(f"record {key[:80]!r} is not JSON") from None
    if not isinstance(record, dict) or record.get("v") != RECORD_VERSION:
        raise RemoteProtocolError(f"record {key[:80]!r} is not a version {RECORD_VERSION} record")
    if members_key is not None:
        _check_signature(key, record, members_key, lease)
    node_id = key[len(prefix) :].decode("utf-8", "replace")
    if record.get("node_id") != node_id:
        raise RemoteProtocolError(f"record {key[:80]!r} names node {record.get('node_id')!r}")
    fronts, weight, nonce = record.get("fronts"), record.get("weight"), record.get("nonce", "")
    if not isinstance(fronts, dict) or isinstance(weight, bool):
        raise RemoteProtocolError(f"record {key[:80]!r}: fronts must be a table")
    try:
        return Member(node_id, fronts, weight, nonce)  # type: ignore[arg-type]
    except (TypeError, InvalidArgumentError) as exc:
        raise RemoteProtocolError(f"record {key[:80]!r}: {exc}") from None


def _check_signature(
    key: bytes, record: dict[str, Any], members_key: MembersKey, lease: int
) -> None:
    sig = record.pop("sig", None)
    if not isinstance(sig, str):
        raise RemoteProtocolError(f"record {key[:80]!r} is not signed")
    if not members_key.verify(key, _canonical(record), sig):
        raise RemoteProtocolError(f"record {key[:80]!r} is not signed with the membership key")
    # Signed for the lease it sits under: an old record put back under another lease (a
    # replay after its node left) does not verify.
    if record.get("lease") != str(lease):
        raise RemoteProtocolError(
            f"record {key[:80]!r} was signed for lease {record.get('lease')!r}, not {lease}"
        )


# ---------------------------------------------------------------------------- the gateway


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """A put (value set) or a delete (value None) of `key`."""

    key: bytes
    value: bytes | None
    revision: int
    lease: int = 0


Request = tuple[str, dict[str, Any]]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise RemoteProtocolError("etcd answer: a bytes field is not a string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise RemoteProtocolError("etcd answer: a bytes field is not base64") from None


def _int(value: Any, what: str) -> int:
    # The gateway writes int64 as JSON strings and omits zero values.
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RemoteProtocolError(f"etcd answer: {what} {value!r} is not an integer") from None


def _prefix_end(prefix: bytes) -> bytes:
    # The first key after every key that starts with `prefix` (etcd's range_end convention).
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _kv(item: Any) -> KeyValue:
    if not isinstance(item, dict):
        raise RemoteProtocolError("etcd answer: a key-value is not an object")
    return KeyValue(
        _unb64(item.get("key", "")),
        _unb64(item.get("value", "")),
        _int(item.get("mod_revision"), "mod_revision"),
        _int(item.get("lease"), "lease"),
    )


def _header_revision(answer: Mapping[str, Any]) -> int:
    header = answer.get("header")
    return _int(header.get("revision") if isinstance(header, dict) else None, "revision")


def range_request(prefix: bytes) -> Request:
    """List every key under `prefix`."""
    return "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}


def get_request(key: bytes) -> Request:
    """Read exactly `key` (parse the answer with parse_range)."""
    return "/v3/kv/range", {"key": _b64(key)}


def parse_range(answer: Mapping[str, Any]) -> tuple[int, list[KeyValue]]:
    """(revision of the listing, the key-values)."""
    kvs = answer.get("kvs", [])
    if not isinstance(kvs, list):
        raise RemoteProtocolError("etcd answer: kvs is not a list")
    return _header_revision(answer), [_kv(item) for item in kvs]


def auth_request(user: str, password: str) -> Request:
    """Ask etcd for a token of `user` (sent in the ``Authorization`` header of later calls)."""
    return "/v3/auth/authenticate", {"name": user, "password": password}


def parse_auth(answer: Mapping[str, Any]) -> str:
    """The token of an authenticate answer."""
    token = answer.get("token")
    if not isinstance(token, str) or not token:
        raise RemoteProtocolError("etcd answered an authenticate call without a token")
    return token


# gRPC codes the gateway reports in an error answer: the token has lapsed (authenticate again),
# and the user may not do that.
_UNAUTHENTICATED, _PERMISSION_DENIED = 16, 7


def etcd_refusal(status: int, raw: bytes, who: str) -> AuthError | None:
    """The AuthError for an answer that refuses `who` (an etcd user, or nobody), or None if the
    answer is not a refusal; `status` is the HTTP status, `raw` the body."""
    try:
        answer = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        answer = None
    code = answer.get("code") if isinstance(answer, dict) else None
    reason = str(answer.get("error", ""))[:200] if isinstance(answer, dict) else ""
    if code == _PERMISSION_DENIED or status == 403:
        return AuthError(f"etcd refused {who}: {reason or 'permission denied'}")
    if code == _UNAUTHENTICATED or status == 401 or "authentication failed" in reason:
        return AuthError(f"etcd refused {who}: {reason or 'not authenticated'}")
    if "user name is empty" in reason:  # auth is on and no credentials were sent
        return AuthError(f"etcd requires a user and password ({who} sent none)")
    return None


def grant_request(ttl_s: int) -> Request:
    return "/v3/lease/grant", {"TTL": str(ttl_s)}


def parse_grant(answer: Mapping[str, Any]) -> int:
    """The granted lease id."""
    if answer.get("error"):
        raise RemoteProtocolError(f"etcd refused a lease: {answer.get('error')}")
    lease = _int(answer.get("ID"), "lease id")
    if not lease:
        raise RemoteProtocolError("etcd granted no lease id")
    return lease


def keepalive_request(lease: int) -> Request:
    return "/v3/lease/keepalive", {"ID": str(lease)}


def lease_ttl(answer: Mapping[str, Any]) -> int:
    """Seconds a keepalive extended the lease by; 0 when the lease has expired."""
    result = answer.get("result")
    return _int(result.get("TTL") if isinstance(result, dict) else None, "TTL")


def revoke_request(lease: int) -> Request:
    return "/v3/lease/revoke", {"ID": str(lease)}


def claim_request(key: bytes, value: bytes, lease: int, replace_revision: int = 0) -> Request:
    """Put `value` at `key` held by `lease`, if the key is absent (`replace_revision` 0) or
    still at `replace_revision`; otherwise read the key back (see parse_claim)."""
    if replace_revision:
        compare = {"target": "MOD", "mod_revision": str(replace_revision)}
    else:
        compare = {"target": "CREATE", "create_revision": "0"}
    return "/v3/kv/txn", {
        "compare": [{"key": _b64(key), "result": "EQUAL", **compare}],
        "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
        "failure": [{"request_range": {"key": _b64(key)}}],
    }


def parse_claim(answer: Mapping[str, Any]) -> tuple[bool, KeyValue | None]:
    """(whether the put happened, the record that stood in the way — None if it vanished)."""
    if answer.get("succeeded") is True:
        return True, None
    for response in answer.get("responses", []) or []:
        found = response.get("response_range") if isinstance(response, dict) else None
        if isinstance(found, dict):
            kvs = found.get("kvs") or []
            return False, _kv(kvs[0]) if kvs else None
    return False, None


def watch_request(prefix: bytes, start_revision: int) -> Request:
    """Stream every change under `prefix` from `start_revision` on."""
    create = {
        "key": _b64(prefix),
        "range_end": _b64(_prefix_end(prefix)),
        "start_revision": str(start_revision),
    }
    return "/v3/watch", {"create_request": create}


def parse_watch(line: bytes) -> tuple[list[WatchEvent], bool]:
    """One message of a watch stream: (its events, whether the watch ended — cancelled or
    compacted past, so the caller lists again)."""
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        raise RemoteProtocolError("etcd watch: a message is not JSON") from None
    result = message.get("result") if isinstance(message, dict) else None
    if not isinstance(result, dict):
        raise RemoteProtocolError(f"etcd watch: unexpected message {line[:120]!r}")
    ended = bool(result.get("canceled")) or _int(result.get("compact_revision"), "compact") > 0
    events = []
    for event in result.get("events", []) or []:
        kv = _kv(event.get("kv") if isinstance(event, dict) else None)
        deleted = event.get("type") == "DELETE"
        events.append(WatchEvent(kv.key, None if deleted else kv.value, kv.mod_revision, kv.lease))
    return events, ended
