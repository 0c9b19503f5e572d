"""Eviction policies beyond `eviction.py`'s three, registered under their names on import (the
engine's package imports this one, so `make_policy` and the config know them everywhere)."""

from kvoffload.kvstore.eviction import register_policy
from kvoffload.kvstore.policies.reuse import ReusePolicy

register_policy(ReusePolicy)

__all__ = ["ReusePolicy"]
