"""vLLM 0.33.0 integration: `KVOffloadConnector` (a v1 KV connector), `KVOffloadTier` (a
secondary tier for vLLM's own CPU offloading) and `KVOffloadECConnector` (an encoder-cache
connector for encode/prefill/decode disaggregation).

Load them with ``"kv_connector_module_path":"kvoffload.connectors.vllm"`` (the EC connector with
``"ec_connector_module_path"``); this package imports vLLM, so it is only imported where vLLM
is installed. Every vLLM-version specific name of the KV connector lives in `_compat`; the EC
connector's few vLLM imports are at the top of `ec`.
"""

from kvoffload.connectors.vllm.connector import KVOffloadConnector, KVOffloadConnectorMetadata
from kvoffload.connectors.vllm.ec import KVOffloadECConnector, KVOffloadECMetadata
from kvoffload.connectors.vllm.tier import KVOffloadTier

__all__ = [
    "KVOffloadConnector",
    "KVOffloadConnectorMetadata",
    "KVOffloadECConnector",
    "KVOffloadECMetadata",
    "KVOffloadTier",
]
