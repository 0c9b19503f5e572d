"""kvoffload: KV-cache offload storage engine and client SDK for LLM serving.

The subpackages live in top-level folders of the repository and install under this namespace:
`kvoffload.kvstore` (engine), `kvoffload.client_sdk` (SDK), `kvoffload.nvmeof_target` (daemon),
`kvoffload.connectors`, `kvoffload.compression` and `kvoffload.bench`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
