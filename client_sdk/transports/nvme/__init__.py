"""`nvme+tcp://host:4420/<subsystem NQN>`: the NVMe Key Value command set over NVMe/TCP.

A userspace NVMe/TCP host (no kernel modules): one admin queue and several I/O queues, each its
own TCP connection with queue depth > 1 (`queue`), driven through the sans-I/O codec in
`wire.nvme_tcp.connection`. Bring-up follows a Linux host's order (ref §1.10) and checks the
controller's answers the way Linux and SPDK do (`bringup`); Keep Alive runs on the admin queue
from a background thread; `close()` shuts the controller down (CC.SHN) before closing the
sockets.

`NvmeHost` is the association itself (KV commands by name, any admin command); `NvmeTransport`
adapts it to the SDK's `Transport` protocol with deadlines, retries and reconnects (`core`).
Blocks are stored as KV values under their 16-byte block keys; `lookup` pipelines Exist
commands (`plans`).

URL parameters: `hostnqn` (default from /etc/nvme/hostnqn, else one derived from the machine
id), `nsid` (default: the first KV namespace), `queues` (I/O queues, default 4), `depth`
(commands in flight per queue, default 32), `hdgst` / `ddgst` (1: CRC32C header / data
digests), `kato` (keep-alive timeout in ms, default 15000), `timeout` (seconds per operation,
default 30), `connect_timeout` (default 5), `retries` (default 3), `backoff` (default 0.05).
"""

from __future__ import annotations

from kvoffload.client_sdk.transports.nvme.host import NvmeHost
from kvoffload.client_sdk.transports.nvme.options import DEFAULT_SUBNQN, NvmeOptions
from kvoffload.client_sdk.transports.nvme.transport import NvmeTransport, open_nvme

__all__ = ["DEFAULT_SUBNQN", "NvmeHost", "NvmeOptions", "NvmeTransport", "open_nvme"]
