"""SGLang 0.5.23 HiCache storage backend over a kvoffload store.

Load it with ``--hicache-storage-backend dynamic`` and an extra config that names this class::

    --hicache-storage-backend-extra-config '{"backend_name":"kvoffload",
      "module_path":"kvoffload.connectors.sglang","class_name":"KVOffloadHiCacheStorage",
      "interface_v1":1,"url":"kv://127.0.0.1:7480"}'

`storage` holds the backend (v1 zero copy, generic and the v2 per-pool interface of hybrid
models), `pools` one v2 pool's pages and hit rule, `settings` the extra config and the
namespaces. All SGLang-version-specific code is in this package.
"""

from kvoffload.connectors.sglang.settings import Settings, page_namespace
from kvoffload.connectors.sglang.storage import KVOffloadHiCacheStorage

__all__ = ["KVOffloadHiCacheStorage", "Settings", "page_namespace"]
