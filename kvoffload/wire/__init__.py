"""Sans-I/O wire formats shared by the SDK and the daemon: bytes in, events out, no sockets."""

from kvoffload.wire.block import HEADER_BYTES, BlockHeader, open_block, seal

__all__ = ["HEADER_BYTES", "BlockHeader", "open_block", "seal"]
