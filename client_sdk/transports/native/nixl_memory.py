"""The client's NIXL agent and its registration cache (the NIXL data path, docs/guides/nixl.md).

Registering memory costs a system call or more (on RDMA hardware it pins pages), and the daemon
must learn each region, so buffers are registered once and remembered: a later get or put into
the same buffer, or into a slice of a registered one, costs nothing extra. The cache holds a
reference to each buffer it registered, so the memory cannot be freed (and its address reused)
while the daemon may still write there; it is bounded, and what falls out of it is revoked on
the daemon before it is deregistered here.

The agent runs no progress thread (an idle client costs no CPU); `progress` is called by the
request that waits for the daemon's answer.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from collections import OrderedDict
from collections.abc import Set
from typing import Any

import numpy as np

from kvoffload.errors import ConfigError, InvalidArgumentError
from kvoffload.wire.native.connection import NIXL_PROOF_PREFIX

__all__ = ["MAX_BYTES", "MAX_REGIONS", "NixlMemory", "Region", "address_of"]

# Regions kept registered; the least recently used one is revoked past this.
MAX_REGIONS = 64
# Bytes kept registered per agent (a lane), unless a URL says otherwise (`nixl_cache_bytes`):
# the cache keeps its buffers alive, and on RDMA hardware registered pages are pinned.
MAX_BYTES = 1 << 30

Region = tuple[int, int]  # (address, length)


def address_of(buffer: memoryview) -> int:
    """The address of a contiguous buffer's first byte.

    Raises:
        InvalidArgumentError: the buffer is not contiguous.
    """
    if not buffer.c_contiguous:
        raise InvalidArgumentError("the NIXL data path needs contiguous buffers")
    return int(np.frombuffer(buffer.cast("B"), dtype=np.uint8).ctypes.data)


class NixlMemory:
    """One NIXL agent (one per control connection) and the memory registered with it.

    Raises (constructor):
        ConfigError: NIXL is not installed, or its backend cannot be created.
    """

    def __init__(self, backend: str = "UCX", max_bytes: int = MAX_BYTES) -> None:
        try:
            api = importlib.import_module("nixl._api")
            bindings = importlib.import_module("nixl._bindings")
        except ImportError as exc:
            raise ConfigError(
                f"data=nixl needs NIXL: pip install --no-deps nixl-cu12 nixl ({exc})"
            ) from None
        self.errors: tuple[type[Exception], ...] = (
            RuntimeError,
            ValueError,
            *(
                getattr(bindings, n)
                for n in dir(bindings)
                if n.startswith("nixl") and n.endswith("Error")
            ),
        )
        name = f"kvoffload-client-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            self._agent: Any = api.nixl_agent(
                name, api.nixl_agent_config(enable_prog_thread=False, backends=[])
            )
            self._agent.create_backend(backend)
        except self.errors as exc:
            raise ConfigError(f"NIXL backend {backend!r} cannot be created: {exc}") from None
        self.name = name
        self.max_bytes = max_bytes
        self.nbytes = 0  # registered now
        self.proofs: list[bytes] = []  # nonces the daemon sent as notifications, not yet echoed
        # region -> (the buffer kept alive, NIXL's registration), least recently used first
        self._regions: OrderedDict[Region, tuple[memoryview, object]] = OrderedDict()

    def metadata(self) -> bytes:
        """The agent's whole metadata (connection info and every registration)."""
        return bytes(self._agent.get_agent_metadata())

    def find(self, addr: int, length: int) -> Region | None:
        """A registered region holding [addr, addr+length), if any (marked recently used)."""
        for region in reversed(self._regions):
            start, size = region
            if start <= addr and addr + length <= start + size:
                self._regions.move_to_end(region)
                return region
        return None

    def register(self, buffer: memoryview) -> tuple[Region, bytes]:
        """Register `buffer`; returns its region and the partial metadata the daemon loads.

        Raises:
            InvalidArgumentError: NIXL refused to register it.
        """
        region = (address_of(buffer), buffer.nbytes)
        try:
            descs = self._agent.register_memory([(*region, 0, "")], "DRAM")
            partial = bytes(self._agent.get_partial_agent_metadata(descs, False))
        except self.errors as exc:
            raise InvalidArgumentError(f"NIXL could not register the buffer: {exc}") from None
        self._regions[region] = (memoryview(buffer), descs)  # our own view, to release
        self.nbytes += region[1]
        return region, partial

    def surplus(self, keep: int = MAX_REGIONS, protect: Set[Region] = frozenset()) -> list[Region]:
        """The least recently used regions to revoke (and then `deregister`) so that at most
        `keep` regions and `max_bytes` bytes stay registered; never one in `protect` (what the
        request about to be sent names: those stay, even past the bounds, until it is
        answered, and fall out at a later request)."""
        count, nbytes = len(self._regions), self.nbytes
        out: list[Region] = []
        for region in self._regions:  # least recently used first
            if count <= keep and nbytes <= self.max_bytes:
                break
            if region not in protect:
                out.append(region)
                count, nbytes = count - 1, nbytes - region[1]
        return out

    def deregister(self, region: Region) -> None:
        """Drop a region (after the daemon has revoked it)."""
        entry = self._regions.pop(region, None)
        if entry is None:
            return
        self.nbytes -= region[1]
        # A failure means the agent is going away: nothing left to undo.
        with contextlib.suppress(*self.errors):
            self._agent.deregister_memory(entry[1])
        entry[0].release()

    @property
    def regions(self) -> list[Region]:
        return list(self._regions)

    def progress(self) -> None:
        """Drive NIXL's progress once (a waiting request calls it: no progress thread), and
        keep the daemon's proof nonces among the notifications (the latest few)."""
        notifs = self._agent.get_new_notifs()
        for messages in notifs.values() if isinstance(notifs, dict) else ():
            for message in messages:
                data = bytes(message)
                if data.startswith(NIXL_PROOF_PREFIX):
                    self.proofs = [*self.proofs[-7:], data[len(NIXL_PROOF_PREFIX) :]]

    def take_proof(self) -> bytes | None:
        """The latest nonce the daemon sent (dropping older ones), if one has arrived."""
        if not self.proofs:
            return None
        latest, self.proofs = self.proofs[-1], []
        return latest

    def close(self) -> None:
        """Deregister everything and drop the agent (its endpoints and worker with it): past
        this, nothing of ours moves bytes into the buffers, which are no longer kept alive."""
        for region in list(self._regions):
            self.deregister(region)
        self._agent = None
