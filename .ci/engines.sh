#!/usr/bin/env bash
# The serving-engine suites, each in a virtual environment of its own (.venv-<engine>):
#   bash .ci/engines.sh                # vllm, sglang and lmcache
#   bash .ci/engines.sh vllm           # one engine
# The engines' full requirements pin CUDA builds of torch and several GB of GPU libraries; each
# environment gets the CPU torch build first (constrained so nothing replaces it) and only what
# the code under test imports. An existing environment is reused. Inside the suites,
# KVOFFLOAD_REQUIRE_<ENGINE>=1 turns a missing engine package into a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang lmcache)

pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo 'torch==2.13.0' >"$pin"

for engine in "${engines[@]}"; do
    venv=".venv-$engine"
    pip=("$venv/bin/python" -m pip install -q -c "$pin")
    start=$SECONDS
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "${pip[@]}" torch==2.13.0
    case "$engine" in
        vllm)
            "${pip[@]}" -r .ci/engines/vllm.txt
            "${pip[@]}" --no-deps vllm==0.33.0
            ;;
        sglang)
            "${pip[@]}" -r .ci/engines/sglang.txt
            "${pip[@]}" --no-deps sglang==0.5.23
            ;;
        lmcache)
            # LMCache's own requirements install on a CPU machine (cupy and cuda-python are
            # plain wheels); only its CUDA kernels would need a GPU, and the tests use none.
            "${pip[@]}" lmcache==0.5.6
            ;;
        *)
            echo ".ci/engines.sh: unknown engine '$engine' (vllm, sglang, lmcache)" >&2
            exit 2
            ;;
    esac
    "${pip[@]}" -e . pytest pytest-timeout hypothesis
    echo "+ $engine environment ready in $((SECONDS - start)) s"
    require="KVOFFLOAD_REQUIRE_$(echo "$engine" | tr '[:lower:]' '[:upper:]')"
    env "$require=1" "$venv/bin/python" -m pytest -p no:cacheprovider \
        tests/integration/engines/test_"$engine"_*.py
done
