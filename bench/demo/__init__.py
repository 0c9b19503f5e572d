"""`kvoffload demo`: a multi-turn chat with SmolLM2-135M whose prefix KV comes back from the
store, and the real model it shares with `bench codecs`."""
