"""vLLM 0.33.0 integration: `KVOffloadConnector` (a v1 KV connector) and `KVOffloadTier` (a
secondary tier for vLLM's own CPU offloading).

Load the connector with ``"kv_connector_module_path":"kvoffload.connectors.vllm"``; this
package imports vLLM, so it is only imported where vLLM is installed. Every vLLM-version
specific name lives in `_compat`.
"""

from kvoffload.connectors.vllm.connector import KVOffloadConnector, KVOffloadConnectorMetadata
from kvoffload.connectors.vllm.tier import KVOffloadTier

__all__ = ["KVOffloadConnector", "KVOffloadConnectorMetadata", "KVOffloadTier"]
