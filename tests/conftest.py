from __future__ import annotations

import os

# Hypothesis: bounded, deterministic-enough runs on a shared 2-core machine.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
