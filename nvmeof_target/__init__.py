"""The storage daemon (`kvoffload serve`): network fronts over the engine.

`server.Daemon` holds the engine, tenants, metrics and KV events and starts every registered
front (`server.FRONTS`); `native.py` is the native-protocol front. Configuration:
`config.load_config`.
"""

from kvoffload.nvmeof_target.config import Config, load_config
from kvoffload.nvmeof_target.server import FRONTS, Daemon, Services, register_front

__all__ = ["FRONTS", "Config", "Daemon", "Services", "load_config", "register_front"]
