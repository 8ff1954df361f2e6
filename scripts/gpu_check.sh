#!/usr/bin/env bash
# Everything issue 33 measures on one GPU, in one go (a lent machine's time is short):
#   1. install (scripts/gpu_setup.sh);
#   2. meanwhile: the CUDA tests (cores 0-1) and the whole suite on the other cores, one torch thread per
#      xdist worker (torch's default of one thread per core in every worker oversubscribes the host 14x);
#   3. then, on a quiet host: one training step per method (`adacomp bench gpu_step`, with host-wait sites
#      and the heaviest kernels), the same through the DDP hook on NCCL (`--front hook`), and optionally
#      the compressors against the memory floor (COMP=1).
# Results go to ${OUT:-gpu_out}/: run.log (tests, benches), suite.log, failures.log (each failure's
# traceback as it happens: a suite cut off by SUITE_S prints no summary), the benches' JSON / markdown.
# SUITE_S bounds the suite, BENCH_S each bench (seconds); SKIP_SUITE=1 leaves the suite out, SKIP_BENCH=1
# the benches (STEP=0 / HOOK=0 one of them); TESTS_FILE=f runs the test ids listed in f (one per line)
# instead of the whole suite; CUDA_K selects CUDA tests (pytest -k, default "cuda or device").
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=$PWD/.gpu_bin:$PATH
RES=$(mktemp -d)
CORES=$(nproc)
T0=$(date +%s)
cp docs/results/compressors_cuda.csv docs/results/compressors_cuda.json "$RES"/ 2>/dev/null  # for --merge
pin() { if command -v taskset >/dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{
    OFFLINE=${OFFLINE:-1} bash scripts/gpu_setup.sh || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
} > "$OUT/run.log" 2>&1 || { cat "$OUT/run.log"; exit 1; }
if [ "${SKIP_SUITE:-0}" != 1 ] && [ "$CORES" -ge 8 ]; then
    LIST=${TESTS_FILE:-$(mktemp)}
    [ -n "${TESTS_FILE:-}" ] || ls tests/test_*.py | grep -v test_cuda.py > "$LIST"
    ( ADACOMP_FAIL_LOG=$OUT/failures.log OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 pin 2-$((CORES - 1)) timeout "${SUITE_S:-300}" xargs -d '\n' -a "$LIST" \
        python3 -m pytest -v -p no:cacheprovider -n $((CORES - 2)) --dist worksteal --timeout "${TEST_S:-240}" \
        -rfE --deselect tests/test_architecture.py::test_package_type_checks > "$OUT/suite.log" 2>&1
      echo "suite rc $?" >> "$OUT/suite.log" ) &
fi
{
    stamp "cuda tests"
    pin 0-1 timeout "${CUDA_S:-240}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda.py \
        tests/test_topk_family.py tests/test_threshold_sparsifiers.py -k "${CUDA_K:-cuda or device}"
    echo "cuda tests rc $?"
} >> "$OUT/run.log" 2>&1
wait
# a suite cut off by `timeout` leaves its xdist workers and their gloo ranks running: end them all,
# so the benches below get the quiet host they are meant to (the load average goes in the log)
pkill -9 -f "pytest" 2>/dev/null; pkill -9 -f "tests/_dist|torch.distributed.run|adacomp.tools.cli run" 2>/dev/null
sleep 2
stamp "suite done; load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/run.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    {
        if [ "${STEP:-1}" = 1 ]; then
            stamp "gpu_step (optimizer)"
            timeout "${BENCH_S:-150}" adacomp bench gpu_step --sites --out-dir "$OUT" ${GPU_STEP_ARGS:-}
            echo "gpu_step rc $?"
        fi
        if [ "${HOOK:-1}" = 1 ]; then
            stamp "gpu_step (hook)"
            timeout "${BENCH_S:-150}" adacomp bench gpu_step --front hook --sites --out-dir "$OUT" \
                ${HOOK_ARGS:---models gpt2_small}
            echo "gpu_step hook rc $?"
        fi
        if [ "${COMP:-0}" = 1 ]; then
            timeout "${BENCH_S:-150}" adacomp bench compressors --device cuda \
                ${COMP_ARGS:---exps 20 22 24 26 28 --repeats 7 --budget 0.5} --out-dir "$RES"
            echo "compressors rc $?"
        fi
        stamp "benches done"
    } >> "$OUT/run.log" 2>&1
fi
cp "$RES"/compressors_cuda.* "$OUT"/ 2>/dev/null
grep -E "passed|failed|rc |FAILED|ERROR|^\[" "$OUT/run.log" | tail -40
grep -E "FAILED|ERROR" "$OUT/suite.log" | sort | uniq | tail -40
tail -3 "$OUT/suite.log" 2>/dev/null
