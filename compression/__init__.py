"""Codecs for KV blocks. Codec ids are stored in every block header (DESIGN §3).

Only the identity codec exists so far; every block the SDK writes carries `CODEC_NONE`.
"""

CODEC_NONE = 0

__all__ = ["CODEC_NONE"]
