"""The live fuzzer's NVMe/TCP half (bench/fuzz/) against a real daemon with small NVMe
limits: the daemon survives, a good client stays bit-exact, no traceback, and RSS stays within
what the NVMe front's limits allow.

Kept apart from test_fuzz_daemon.py: until the NVMe front bounds Get Log Page by the host's
buffer (branch h-nvme: NUMD = 2^32 - 1 with a 512-byte SGL builds a 16 GiB page), this fails.
"""

from __future__ import annotations

import os

import pytest
from test_fuzz_daemon import MARGIN, check_good_client, first_traceback

from kvoffload.bench.fuzz import fuzz_bench as fuzz

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

LONG = os.environ.get("KVOFFLOAD_RELIABILITY") == "long"
FRAMES = 200_000 if LONG else 50_000
MAX_SECONDS = 600.0 if LONG else 120.0

MAX_CONNECTIONS = 16
MAX_INFLIGHT = 1 << 20
IN_CAPSULE = 16 << 10
MAXH2CDATA = 16 << 10
NVME_LIMITS = f"""
[nvme]
max_connections = {MAX_CONNECTIONS}
max_inflight_bytes = {MAX_INFLIGHT}
in_capsule_bytes = {IN_CAPSULE}
maxh2cdata_bytes = {MAXH2CDATA}
max_c2h_bytes = 65536
max_io_queues = 2
queue_depth = 8
connect_timeout_s = 2.0
frame_timeout_s = 2.0
"""
# Per connection: the parse buffer (64 KiB floor) plus one PDU's data that the front does not
# receive into the store (admin data: at most the in-capsule limit or MAXH2CDATA), twice while
# it grows, and the answers queued. Then the same fixed margin as the native test.
PER_CONNECTION = 2 * ((64 << 10) + max(IN_CAPSULE, MAXH2CDATA)) + MAX_INFLIGHT
ALLOWANCE = MAX_CONNECTIONS * PER_CONNECTION + MARGIN


def test_nvme_front_survives_fuzzing_within_its_limits() -> None:
    with fuzz.daemon(dram="64MiB", config=NVME_LIMITS) as daemon:
        report = fuzz.fuzz(
            daemon.ports["native"],
            daemon.ports["nvme"],
            frames=FRAMES,
            seconds=MAX_SECONDS,
            pid=daemon.proc.pid,
            kinds=("nvme", "crowd"),
        )
        print(f"frames {report.frames} in {report.seconds:.0f} s, {report.by_worker}")
        print(f"rss baseline {report.rss_baseline}, peak {report.rss_peak}, allowance {ALLOWANCE}")
        assert daemon.proc.poll() is None, daemon.stderr[-4000:]
        check_good_client(daemon.ports["native"])
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
