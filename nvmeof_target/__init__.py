"""The storage daemon (`kvoffload serve`): network fronts over the engine.

`server.Daemon` holds the engine, tenants, metrics and KV events and starts every front in
`server.FRONTS`: `native.py` (the native protocol) and `nvme.py` (NVMe/TCP), which share
`services.Services`. Configuration: `config.load_config`.
"""

from kvoffload.nvmeof_target.config import Config, EventsConfig, load_config
from kvoffload.nvmeof_target.events.publisher import KVEvents
from kvoffload.nvmeof_target.server import FRONTS, Daemon
from kvoffload.nvmeof_target.services import Services

__all__ = ["FRONTS", "Config", "Daemon", "EventsConfig", "KVEvents", "Services", "load_config"]
