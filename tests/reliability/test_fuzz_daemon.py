"""The live fuzzer (bench/fuzz/) against a real daemon started with small limits: the daemon
survives, answers a good client bit-exact during and after, logs no traceback, and its RSS
stays within what its limits allow.

CI runs 50,000 frames; KVOFFLOAD_RELIABILITY=long runs 200,000. Each run also stops by itself
after MAX_SECONDS (a slow machine sends fewer frames; the frames sent are printed).
"""

from __future__ import annotations

import os
import random

import pytest

from kvoffload.bench.fuzz import fuzz_bench as fuzz
from kvoffload.client_sdk import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
FRAMES = 200_000 if LONG else 50_000
MAX_SECONDS = 600.0 if LONG else 120.0

MAX_CONNECTIONS = 16
MAX_PENDING = 8
MAX_INFLIGHT = 1 << 20
MAX_HEADER = 256 << 10
MAX_PAYLOAD = 1 << 20
NATIVE_LIMITS = f"""
[native]
max_connections = {MAX_CONNECTIONS}
max_pending = {MAX_PENDING}
max_inflight_bytes = {MAX_INFLIGHT}
max_header_bytes = {MAX_HEADER}
max_payload_bytes = {MAX_PAYLOAD}
frame_timeout_s = 2.0
hello_timeout_s = 2.0
idle_timeout_s = 5.0
"""

# What the native front may hold beyond its baseline, from its limits (the DRAM arena is
# allocated and touched at start, so it is in the baseline):
# - per connection, the parse buffer: a header of max_header_bytes over the 64 KiB floor,
#   twice while it grows (old and new buffer), and the answers queued (max_inflight_bytes);
# - one header being decoded at a time (the loop is single-threaded): msgpack builds at most
#   ~20 bytes of Python objects per header byte once lists and maps are bounded (two-character
#   strings are the worst case);
# - a fixed margin for the allocator's fragmentation, per-connection asyncio objects, metric
#   label sets and log records: 64 MiB.
PER_CONNECTION = 2 * (MAX_HEADER + (64 << 10)) + MAX_INFLIGHT
DECODE = 24 * MAX_HEADER
MARGIN = 64 << 20
ALLOWANCE = MAX_CONNECTIONS * PER_CONNECTION + DECODE + MARGIN


def first_traceback(stderr: str) -> str:
    """The first traceback in a daemon's stderr, with the line that logged it."""
    at = stderr.index("Traceback")
    return stderr[stderr.rfind("\n", 0, max(0, at - 1)) + 1 :][:3000]


def check_good_client(port: int) -> None:
    """A fresh client stores and reads back values bit-exact."""
    rng = random.Random(7)
    with Client.connect(f"kv://127.0.0.1:{port}") as client:
        values = {
            rng.randbytes(16): rng.randbytes(rng.choice((1, 4096, 300_000))) for _ in range(20)
        }
        for key, value in values.items():
            client.put(key, value)
        for key, value in values.items():
            assert client.get(key) == value


def test_native_front_survives_fuzzing_within_its_limits() -> None:
    with fuzz.daemon(dram="64MiB", config=NATIVE_LIMITS) as daemon:
        port = daemon.ports["native"]
        report = fuzz.fuzz(
            port,
            None,
            frames=FRAMES,
            seconds=MAX_SECONDS,
            pid=daemon.proc.pid,
            limits=(MAX_HEADER, MAX_PAYLOAD),
            kinds=("native", "slow", "crowd"),
        )
        print(f"frames {report.frames} in {report.seconds:.0f} s, {report.by_worker}")
        print(f"rss baseline {report.rss_baseline}, peak {report.rss_peak}, allowance {ALLOWANCE}")
        assert daemon.proc.poll() is None, daemon.stderr[-4000:]
        check_good_client(port)
        stderr = daemon.stderr
    assert report.frames > 0 and report.during, "the fuzzer sent nothing"
    assert report.wrong_values == 0
    assert not report.good_errors, report.good_errors[:5]
    assert "Traceback" not in stderr, first_traceback(stderr)
    assert report.rss_baseline is not None and report.rss_peak is not None
    assert report.rss_peak <= report.rss_baseline + ALLOWANCE, (
        f"RSS grew by {(report.rss_peak - report.rss_baseline) >> 20} MiB, "
        f"the limits allow {ALLOWANCE >> 20} MiB"
    )
