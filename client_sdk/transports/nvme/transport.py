"""The SDK's `Transport` over NVMe/TCP: an `NvmeHost` with deadlines, retries and reconnects."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from kvoffload.client_sdk.transports.base import (
    HeldBlock,
    IntoBuffer,
    PutItem,
    Received,
    received_into,
    received_many_into,
)
from kvoffload.client_sdk.transports.core import left, retrying
from kvoffload.client_sdk.transports.nvme import plans
from kvoffload.client_sdk.transports.nvme.host import NvmeHost
from kvoffload.client_sdk.transports.nvme.options import NvmeOptions
from kvoffload.client_sdk.transports.nvme.queue import Plan
from kvoffload.client_sdk.transports.sharding import ShardRouter
from kvoffload.client_sdk.url import StoreURL
from kvoffload.errors import DeadlineExceededError, InvalidArgumentError, TransportError
from kvoffload.wire.nvme_tcp import cmd as nc
from kvoffload.wire.nvme_tcp import data as nd
from kvoffload.wire.tiers import Tier, TierRun

__all__ = ["NvmeTransport", "open_nvme"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NvmeTransport:
    """The SDK `Transport` over an `NvmeHost`, reconnecting and retrying like `kv://`."""

    def __init__(self, options: NvmeOptions) -> None:
        self.options = options
        self._host: NvmeHost | None = None
        self._lock = threading.Lock()
        self._closed = False
        try:  # connect now for an early refusal; a target that is down is only a warning
            self._association(time.monotonic() + options.connect_timeout * 2)
        except (TransportError, DeadlineExceededError) as exc:
            log.warning("%s is not reachable yet (%s); will retry on use", options.url, exc)

    def _association(self, deadline: float) -> NvmeHost:
        with self._lock:
            if self._closed:
                raise TransportError("the client is closed")
            host = self._host
            if host is None or host.broken is not None:
                if host is not None:
                    host.close()
                left(deadline)
                self._host = host = NvmeHost(self.options)
            return host

    def _run(self, plan: Callable[[NvmeHost], Plan[T]]) -> T:
        return retrying(self.options, self._attempt, plan)

    def _attempt(self, plan: Callable[[NvmeHost], Plan[T]], deadline: float) -> T:
        host = self._association(deadline)
        return host.run(plan(host), deadline)

    @property
    def max_value_bytes(self) -> int:
        host = self._association(time.monotonic() + self.options.timeout)
        return host.namespace.max_value

    def put(
        self,
        key: bytes,
        parts: Sequence[object],
        parent: bytes | None,
        durable: bool = False,
        meta: bytes | None = None,
    ) -> None:
        # `meta` is dropped: a KV Store command has no room for it (docs/reference/events.md).
        if durable:
            raise InvalidArgumentError("nvme+tcp:// has no durable stores (no FUA in KV Store)")
        self._run(lambda h: plans.put(h.nsid, h.in_capsule, key, parts))

    def put_many(self, items: Sequence[PutItem], durable: bool = False) -> None:
        if durable:
            raise InvalidArgumentError("nvme+tcp:// has no durable stores (no FUA in KV Store)")
        self._run(lambda h: plans.put_many(h.nsid, h.in_capsule, items))

    def get(self, key: bytes) -> HeldBlock | None:
        return self._run(lambda h: plans.get(h.nsid, h.namespace.max_value, key))

    def get_into(self, key: bytes, buffer: memoryview) -> HeldBlock | Received | None:
        into = IntoBuffer(buffer)
        return received_into(into, lambda: self._run(lambda h: plans.get_into(h.nsid, key, into)))

    def get_many(self, keys: Sequence[bytes]) -> list[HeldBlock | None]:
        return self._run(lambda h: plans.get_many(h.nsid, h.namespace.max_value, keys))

    def get_many_into(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> list[HeldBlock | Received | None]:
        into = [IntoBuffer(b) for b in buffers]
        got = received_many_into(
            into, lambda: self._run(lambda h: plans.get_many_into(h.nsid, keys, into))
        )
        return list(got)

    def exists(self, key: bytes) -> bool:
        return self._run(lambda h: plans.exists(h.nsid, key))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(lambda h: plans.exists_many(h.nsid, keys, 4 * h.options.depth))

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda h: plans.lookup(h.nsid, keys, 4 * h.options.depth))

    def lookup_tiers(self, keys: Sequence[bytes]) -> TierRun:
        # The KV command set has no tiers: the run's blocks are all UNKNOWN.
        return TierRun.of(Tier.UNKNOWN, self.lookup(keys))

    def prefetch(self, keys: Sequence[bytes]) -> int:
        # NVMe KV has no prefetch: count what is there (every tier of the store serves reads).
        return self._run(lambda h: plans.count(h.nsid, keys))

    def delete(self, key: bytes) -> bool:
        return self._run(lambda h: plans.delete(h.nsid, key))

    def stats(self) -> dict[str, object]:
        host = self._association(time.monotonic() + self.options.timeout)
        c, raw = host.admin_command(partial(nc.get_log_page, lid=nd.Lid.SMART, length=512))
        smart = nd.SmartLog.unpack(raw) if c.ok else nd.SmartLog()
        c, raw = host.admin_command(
            partial(nc.identify, cns=nd.Cns.CSI_NAMESPACE, nsid=host.nsid, csi=nd.Csi.KV)
        )
        ns = nd.KvNamespace.unpack(raw) if c.ok else host.namespace
        return {
            "transport": "nvme+tcp",
            "subnqn": self.options.subnqn,
            "cntlid": host.cntlid,
            "nsid": host.nsid,
            "capacity_bytes": ns.nsze,
            "used_bytes": ns.nuse,
            "max_value_bytes": ns.max_value,
            "data_units_read": smart.data_units_read,
            "data_units_written": smart.data_units_written,
            "host_reads": smart.host_reads,
            "host_writes": smart.host_writes,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            host, self._host = self._host, None
        if host is not None:
            host.close()


def open_nvme(url: StoreURL) -> NvmeTransport | ShardRouter:
    """Open `nvme+tcp://host:4420/<subsystem NQN>?hostnqn=...` (blocking); with `shards=N` (or
    `ports=`), a multi-worker daemon's N subsystems, each key sent to its own."""
    options = NvmeOptions.from_url(url)
    if options.shard_ports:
        count = len(options.shard_ports)
        return ShardRouter(lambda: [NvmeTransport(options.shard(i)) for i in range(count)])
    return NvmeTransport(options)
