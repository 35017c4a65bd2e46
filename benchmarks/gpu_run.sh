#!/usr/bin/env bash
# Everything CI cannot check, in one run on a machine with an NVIDIA GPU (a few minutes on an H200):
#   1. the `cuda` tests (transfer paths, the Triton kernel path `cuda-kernel` included, the
#      engine's streams and events, the demo on GPU KV);
#   2. benchmarks/gpu_check.py: D2H/H2D GB/s of the staged path, the direct path, the Triton
#      kernel (always, and `auto`: calibrated against DMA, its table logged) and the worker's
#      engine on the staged path and on the kernel, against a pinned copy_ in the same run,
#      for 1, 4 and 16 MiB chunks and the DeepSeek-V4 (fp8) and Gemma-4 layouts of
#      `kvoffload plan`; bit-exact round trips;
#   3. `kvoffload demo --device cuda`: the connector's scheduler and worker on GPU KV tensors;
#   4. the unit suite on a machine with CUDA (pinned slabs, CUDA-present branches);
#   5. benchmarks/gpu_e2e.py, which needs vLLM 0.33 on the machine (it says so if missing);
#   6. with vLLM there too, benchmarks/vllm_ttft.py (TTFT from the CPU tier against vLLM's own
#      cache, a row per way a load in the step copies; its default on CUDA: a copy thread).
# Run from a checkout: `OUT=results benchmarks/gpu_run.sh` (PYTHON=python3 by default). Uses the
# machine's torch, numpy, xxhash, tqdm, pytest and hypothesis; installs nothing. Writes run.log,
# gpu_check.json, gpu_check_jobs.json, demo.json (and gpu_e2e.json, ttft.json) under $OUT; exits 1 if any
# step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-run}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=$OUT/run.log
failed=()

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, remember a failure
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

step machine 30 sh -c "nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv; \
    $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
    $PY -c 'import vllm; print(\"vllm\", vllm.__version__)' 2>&1 | tail -1"
step cuda-tests 180 "$PY" -m pytest -p no:cacheprovider -q -rfE -m cuda tests
step gpu-check 300 "$PY" benchmarks/gpu_check.py --total-mib 512 --json-out "$OUT/gpu_check.json"
step demo 45 sh -c "$PY -m kvoffload demo --device cuda --no-progress --json > '$OUT/demo.json' \
    && $PY -c 'import json, sys; from kvoffload.cli.demo import render; print(render(json.load(open(sys.argv[1]))))' '$OUT/demo.json'"
step gpu-check-jobs 90 "$PY" benchmarks/gpu_check.py --chunk-mib 1,4 --layouts kv_first \
    --total-mib 512 --chunks-per-job 64 --paths staged,kernel,engine,engine-kernel --models "" \
    --json-out "$OUT/gpu_check_jobs.json"
step unit-tests 120 "$PY" -m pytest -p no:cacheprovider -q -rfE tests
if "$PY" -c 'import vllm' 2>/dev/null; then
    step gpu-e2e 600 "$PY" benchmarks/gpu_e2e.py --json-out "$OUT/gpu_e2e.json"
    step ttft 600 sh -c "$PY benchmarks/vllm_ttft.py --copy-modes thread,layer,before --json \
        > '$OUT/ttft.json'"
else
    echo "=== gpu-e2e: skipped, vLLM is not installed for $PY on this machine" | tee -a "$LOG"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" | tee -a "$LOG"
    exit 1
fi
echo "all steps passed" | tee -a "$LOG"
