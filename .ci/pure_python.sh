#!/usr/bin/env bash
# The pure-Python reference path (KVOFFLOAD_PURE_PYTHON=1: no C extension is used, in the tests
# nor in the daemons they start). Short form, in .ci/run: the codec and CRC tests, the daemon and
# integration tests of the native data path and the fronts, KV events and NIXL beside it, and
# every differential test (test_differential*.py, wherever it lives): 5 m 47 s on the shared
# 2-vCPU VM (load 2-2.6), ~4.5 min more than the codec and daemon tests it replaces (~70 s).
# test_hotpath.py is not listed: it starts a daemon on each path itself, in the main step.
# Long form (--long, or KVOFFLOAD_RELIABILITY=long): the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVOFFLOAD_PURE_PYTHON=1
if [ "${1:-}" = "--long" ] || [ "${KVOFFLOAD_RELIABILITY:-}" = "long" ]; then
    exec .venv/bin/python -m pytest -p no:cacheprovider -q
fi
shopt -s globstar nullglob
differential=(tests/**/test_differential*.py)
# test_nixl.py whole takes ~3.5 min here; its data-path cases over TCP take ~15 s.
nixl=(
    "test_put_and_get_move_bit_exact[tcp]"
    "test_the_registration_cache_keeps_to_its_byte_bound[tcp]"
    "test_batches_naming_more_buffers_than_the_registration_cache[tcp]"
    "test_a_buffer_too_small_writes_nothing[tcp]"
    "test_a_plain_kv_client_sees_what_nixl_stored[tcp]"
)
exec .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/unit/wire/test_speedups.py tests/unit/wire/test_native.py tests/unit/wire/test_block.py \
    tests/reliability/test_native_bounds.py tests/reliability/test_native_payload_parts.py \
    tests/reliability/test_native_put_reservations.py \
    tests/integration/test_daemon.py tests/integration/test_daemon_batches.py \
    tests/integration/test_daemon_offload.py tests/integration/test_bad_input.py \
    tests/integration/test_client_bad_answers.py tests/integration/test_client_reconnect.py \
    tests/integration/test_answer_pins.py tests/integration/test_hello_auth.py \
    tests/integration/test_native_data_path.py tests/integration/test_sealed_blocks.py \
    tests/integration/test_workers.py tests/integration/test_lookup_tiers.py \
    tests/integration/test_fair_turns.py tests/integration/test_connection_budget.py \
    tests/integration/test_kv_events_tenants.py tests/integration/test_crash.py \
    tests/integration/test_kv_events_curve.py tests/integration/test_kv_events_router.py \
    tests/integration/test_kv_events_workers.py tests/integration/test_tiering_scale.py \
    tests/integration/test_nvme.py tests/integration/test_nvme_bad_input.py \
    tests/integration/test_nvme_interop.py tests/integration/test_nixl_trust.py \
    tests/unit/kvstore/test_engine.py tests/unit/kvstore/test_engine_batch.py \
    tests/integration/test_hotpath_differential.py \
    tests/integration/test_native_one_call.py \
    "${nixl[@]/#/tests/integration/test_nixl.py::}" \
    "${differential[@]}"
