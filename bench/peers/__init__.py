"""The peers measured beside kvoffload, each in its own environment: LMCache (`lm://` server,
MP mode's L2), Redis, and vLLM's and LMCache's caches replaying a trace."""
