"""The keys a client seals blocks with and opens them with (the keyed seal, wire/block.py).

A client with keys seals every put with its current key (keyed BLAKE3 over header and
payload) and opens sealed blocks with any key it still holds, so keys can be rotated: add the
new key first, keep the old ones while their blocks live, drop a key to retire its blocks
(they become misses). By default it also refuses CRC-only blocks, which anyone can write;
`required=False` reads them as before, for the migration of a store written without a seal.

Keys never go in a URL. They come from the SDK argument (`SealKeys`), a key file
(`KVOFFLOAD_SEAL_KEY_FILE`) or the environment (`KVOFFLOAD_SEAL_KEYS`); both hold lines of
``<key id> <64 hex digits>``, the current key first (``,`` or ``;`` also separate entries,
``#`` starts a comment). `KVOFFLOAD_SEAL_REQUIRED=0` reads unsealed blocks too.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from kvoffload.errors import ConfigError
from kvoffload.wire.block import MAC_KEY_BYTES

__all__ = ["ENV_FILE", "ENV_KEYS", "ENV_REQUIRED", "SealKeys"]

log = logging.getLogger(__name__)

ENV_FILE = "KVOFFLOAD_SEAL_KEY_FILE"
ENV_KEYS = "KVOFFLOAD_SEAL_KEYS"
ENV_REQUIRED = "KVOFFLOAD_SEAL_REQUIRED"
_MAX_KEY_ID = (1 << 32) - 1
_ENTRY = re.compile(r"^(\d+)\s*[ :=]\s*([0-9a-fA-F]+)$")


class SealKeys:
    """A client's seal keys: the current one (it seals puts) and every key it opens with.

    Args:
        keys: (key id, 32-byte key) pairs, the current key first; ids are 0..2**32-1 and
            distinct.
        required: refuse blocks without a seal (default); False also reads CRC-only blocks.

    Raises:
        ConfigError: no key, a key that is not 32 bytes, a bad or repeated key id.
    """

    __slots__ = ("_current", "_keys", "required")

    def __init__(self, keys: Sequence[tuple[int, bytes]], *, required: bool = True) -> None:
        if not keys:
            raise ConfigError("seal keys: at least one key is needed")
        table: dict[int, bytes] = {}
        for key_id, key in keys:
            if type(key_id) is not int or not 0 <= key_id <= _MAX_KEY_ID:
                raise ConfigError(f"seal keys: key id {key_id!r} is not in 0..{_MAX_KEY_ID}")
            if not isinstance(key, bytes) or len(key) != MAC_KEY_BYTES:
                raise ConfigError(f"seal keys: key id {key_id} is not {MAC_KEY_BYTES} bytes")
            if key_id in table:
                raise ConfigError(f"seal keys: key id {key_id} is listed twice")
            table[key_id] = key
        self._current = keys[0]
        self._keys: Mapping[int, bytes] = MappingProxyType(table)
        self.required = required

    @property
    def current(self) -> tuple[int, bytes]:
        """(key id, key) that seals new blocks."""
        return self._current

    @property
    def current_id(self) -> int:
        return self._current[0]

    @property
    def keys(self) -> Mapping[int, bytes]:
        """Every key this client opens sealed blocks with, by key id."""
        return self._keys

    def __repr__(self) -> str:
        # Ids only: a repr lands in logs and tracebacks.
        return (
            f"SealKeys(current={self.current_id}, ids={sorted(self._keys)}, "
            f"required={self.required})"
        )

    @classmethod
    def parse(cls, text: str, *, required: bool = True, source: str = "seal keys") -> SealKeys:
        """Keys in the key-file form (see the module); `source` names them in errors.

        Raises:
            ConfigError: a malformed entry (its line number, never its text: it is a secret).
        """
        keys: list[tuple[int, bytes]] = []
        for number, line in enumerate(text.splitlines(), 1):
            for entry in re.split(r"[,;]", line.split("#", 1)[0]):
                entry = entry.strip()
                if not entry:
                    continue
                match = _ENTRY.match(entry)
                if match is None or len(match.group(2)) != 2 * MAC_KEY_BYTES:
                    raise ConfigError(
                        f"{source}, line {number}: expected '<key id> <{2 * MAC_KEY_BYTES} "
                        "hex digits>'"
                    )
                keys.append((int(match.group(1)), bytes.fromhex(match.group(2))))
        if not keys:
            raise ConfigError(f"{source}: no key")
        return cls(keys, required=required)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, required: bool = True) -> SealKeys:
        """Keys from a key file.

        Raises:
            ConfigError: the file cannot be read or is malformed.
        """
        try:
            text = Path(path).read_text()
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"seal key file {os.fspath(path)!r}: {exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            # As ssh does for a private key: whoever can read the file can forge blocks.
            log.warning(
                "seal key file %r is accessible to group or others (mode %o); chmod 600 it",
                os.fspath(path),
                stat.S_IMODE(mode),
            )
        return cls.parse(text, required=required, source=f"seal key file {os.fspath(path)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SealKeys | None:
        """Keys from `KVOFFLOAD_SEAL_KEYS` or the file `KVOFFLOAD_SEAL_KEY_FILE` names; None
        when neither is set.

        Raises:
            ConfigError: both are set, or what they hold is malformed.
        """
        env = os.environ if environ is None else environ
        inline, path = env.get(ENV_KEYS), env.get(ENV_FILE)
        flag = env.get(ENV_REQUIRED, "1")
        if flag not in ("0", "1"):
            raise ConfigError(f"{ENV_REQUIRED} must be 0 or 1, not {flag!r}")
        if inline and path:
            raise ConfigError(f"set one of {ENV_KEYS} and {ENV_FILE}, not both")
        if inline:
            return cls.parse(inline, required=flag == "1", source=ENV_KEYS)
        if path:
            return cls.from_file(path, required=flag == "1")
        return None
