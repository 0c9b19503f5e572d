"""`kv://host:7480`: the native protocol to a `kvoffload serve` daemon, sync and asyncio.

Every operation is written once, as a plan (`plans`, run by `core`'s runners); the blocking
driver (`NativeTransport`, a pool of sockets, in `sync`) and the asyncio driver
(`AsyncNativeTransport`, one multiplexed connection, in `aio`) only move bytes; matching
answers to requests is the `session`'s job, which sits on the sans-I/O codec in
`kvoffload/wire/native/connection.py`.

URL parameters: `token` (the tenant's token), `timeout` (seconds per operation, default 30),
`connect_timeout` (default 5), `retries` (default 3, with exponential backoff from `backoff`
seconds, default 0.05), `pool` (sync connections, default 4), `tls` (1 to use TLS), `ca` (CA
file to verify the daemon's certificate; default the system store), `server_name` (name to
verify instead of the URL's host).

A daemon that cannot be reached raises `TransportError` once the retries are spent (never
hangs: every socket operation has the operation's deadline); `DeadlineExceededError` when the
deadline passes first. The request layer turns both into misses for `lookup`/`exists`. A
connection the daemon has closed meanwhile (a goodbye after `idle_timeout_s`, a restart) is
replaced by a fresh one without spending a retry.
"""

from __future__ import annotations

from kvoffload.client_sdk.transports.native.aio import AsyncNativeTransport, open_native_async
from kvoffload.client_sdk.transports.native.options import NativeOptions
from kvoffload.client_sdk.transports.native.sync import NativeTransport, open_native

__all__ = [
    "AsyncNativeTransport",
    "NativeOptions",
    "NativeTransport",
    "open_native",
    "open_native_async",
]
