"""The store URL a connector connects with: a cluster URL says that its keys name their content.

Every key the KV connectors put (vLLM's connector and `KVOffloadTier`, SGLang's HiCache
storage, both LMCache connectors) is a chained block key: one key, one block, forever (DESIGN
§3). Over `cluster+etcd://` such a client need not wait for every one of a key's best members
to answer a put (`immutable=1`, docs/guides/cluster.md), so the connectors add it to a cluster
URL unless the user wrote `immutable=0`. Deletes (a damaged block dropped, LMCache's `remove`)
follow the cluster's rule either way. The encoder-output connector (`vllm/ec.py`) does not use
this: it rewrites a manifest under the same key with a new nonce.
"""

from __future__ import annotations

import logging
import threading

from kvoffload.client_sdk.url import parse_url

__all__ = ["block_store_url"]

log = logging.getLogger("kvoffload.connectors")

_CLUSTER_SCHEMES = frozenset({"cluster", "cluster+etcd", "cluster+etcds"})
# Clusters (scheme, hosts, name) already told: the cost is said once per process.
_told: set[str] = set()
_told_lock = threading.Lock()


def block_store_url(url: str) -> str:
    """`url` as a connector of content-named blocks connects with: `immutable=1` added to a
    cluster URL that does not set it; any other URL as it is.

    Raises:
        ConfigError: not a store URL, or a repeated parameter (as `Client.connect` would).
    """
    parsed = parse_url(url)
    if parsed.scheme not in _CLUSTER_SCHEMES:
        return url
    if "immutable" in parsed.params:
        if parsed.params["immutable"] == "0":
            port = f":{parsed.port}" if parsed.port else ""
            _tell_once(f"{parsed.scheme}://{parsed.host}{port}{parsed.path}")  # no secrets
        return url  # "1" as asked; a bad value is the cluster parser's error to raise
    head, hash_mark, fragment = url.partition("#")
    joined = f"{head}{'&' if '?' in head else '?'}immutable=1"
    return joined + hash_mark + fragment


def _tell_once(shown: str) -> None:
    with _told_lock:
        if shown in _told:
            return
        _told.add(shown)
    log.warning(
        "kvoffload: %s sets immutable=0: this connector's keys name their content, yet with it "
        "a put of a key whose best member is down (for up to the node's lease) or slow raises "
        "and the block is not offloaded; drop immutable=0 unless something else rewrites keys",
        shown,
    )
