"""Store URLs: `local:///dir?dram=1GiB`, later `kv://host:7480` and `nvme+tcp://host:4420/nqn`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from kvoffload.errors import ConfigError
from kvoffload.wire.membership import redact_url

__all__ = ["DEFAULT_URL", "StoreURL", "parse_url"]

DEFAULT_URL = "local://"


@dataclass(frozen=True)
class StoreURL:
    scheme: str
    host: str
    port: int | None
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    # "user[:password]" before the host, as written (percent-encoded); only cluster+etcd://
    # uses it (etcd's credentials). Out of repr: it may hold a password.
    userinfo: str = field(default="", repr=False)

    def take(self, allowed: Mapping[str, str]) -> dict[str, str]:
        """The query parameters, checked against `allowed` (name -> description).

        Raises:
            ConfigError: a parameter is not in `allowed`.
        """
        unknown = sorted(set(self.params) - set(allowed))
        if unknown:
            valid = ", ".join(f"{k} ({v})" for k, v in allowed.items())
            raise ConfigError(
                f"unknown {self.scheme}:// URL parameter(s) {unknown}; valid: {valid}"
            )
        return dict(self.params)


def parse_url(url: str) -> StoreURL:
    """Split a store URL; the scheme decides which transport serves it.

    Raises:
        ConfigError: not a URL, a repeated parameter or a bad port.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"not a store URL: {url!r} (expected e.g. 'local:///var/kvoffload')")
    parts = urlsplit(url)
    url = redact_url(url)  # for the messages below
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    params = dict(pairs)
    if len(params) != len(pairs):
        raise ConfigError(f"repeated parameter in URL {url!r}")
    userinfo, _, netloc = parts.netloc.rpartition("@")
    scheme = parts.scheme.lower()
    if "," in netloc:
        # Several hosts (a cluster's node list): the transport parses them itself.
        return StoreURL(scheme, netloc, None, parts.path, params, userinfo)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad port in URL {url!r}: {exc}") from None
    return StoreURL(scheme, parts.hostname or "", port, parts.path, params, userinfo)
