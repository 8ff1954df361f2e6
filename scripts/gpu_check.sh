#!/usr/bin/env bash
# Everything issue 33 measures on one GPU, in one go (a lent machine's time is short):
#   1. install (scripts/gpu_setup.sh), 2. the CUDA tests, 3. compressors vs the memory floor,
#   4. one training step per method (ResNet-50, GPT-2 small), and meanwhile 5. the whole suite on other cores.
# Results go to ${OUT:-gpu_out}/: run.log (1-4), suite.log (5), the bench CSV / JSON / markdown.
# SUITE_S / BENCH_S bound the suite and each bench (seconds); SKIP_SUITE=1 leaves the suite out.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=$PWD/.gpu_bin:$PATH
RES=$(mktemp -d)
CORES=$(nproc)
cp docs/results/compressors_cuda.csv docs/results/compressors_cuda.json "$RES"/ 2>/dev/null  # for --merge
pin() { if command -v taskset >/dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
{
    OFFLINE=${OFFLINE:-1} bash scripts/gpu_setup.sh || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
} > "$OUT/run.log" 2>&1 || { cat "$OUT/run.log"; exit 1; }
if [ "${SKIP_SUITE:-0}" != 1 ] && [ "$CORES" -ge 8 ]; then
    # the suite on cores 4.. (CPU work, gloo on loopback); the GPU timings keep cores 0-3 to themselves
    # SUITE_ORDER=reverse starts from the other end (a run cut short by SUITE_S then covers the rest)
    FILES=$(ls tests/test_*.py | grep -v test_cuda.py)
    [ "${SUITE_ORDER:-}" = reverse ] && FILES=$(echo "$FILES" | sort -r)
    ( pin 4-$((CORES - 1)) timeout "${SUITE_S:-400}" python3 -m pytest -v -p no:cacheprovider \
        -n $((CORES - 4)) --timeout 300 -rfE $FILES \
        --deselect tests/test_architecture.py::test_package_type_checks > "$OUT/suite.log" 2>&1
      echo "suite rc $?" >> "$OUT/suite.log" ) &
fi
{
    pin 0-3 timeout 200 python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda.py \
        tests/test_topk_family.py tests/test_threshold_sparsifiers.py -k "cuda or device"
    echo "cuda tests rc $?"
    pin 0-3 timeout "${BENCH_S:-150}" adacomp bench compressors --device cuda \
        ${COMP_ARGS:---exps 20 22 24 26 28 --repeats 7 --budget 0.5} --out-dir "$RES"
    echo "compressors rc $?"
    pin 0-3 timeout "${BENCH_S:-150}" adacomp bench gpu_step --out-dir "$RES" ${GPU_STEP_ARGS:-}
    echo "gpu_step rc $?"
} >> "$OUT/run.log" 2>&1
cp "$RES"/compressors_cuda.csv "$RES"/compressors_cuda.json "$RES"/gpu_step.json "$RES"/gpu_step.md "$OUT"/ 2>/dev/null
wait
grep -E "passed|failed|rc |PASSED|FAILED|ERROR" "$OUT/run.log" | tail -60
grep -E "FAILED|ERROR" "$OUT/suite.log" | sort | uniq | tail -40
tail -3 "$OUT/suite.log" 2>/dev/null
