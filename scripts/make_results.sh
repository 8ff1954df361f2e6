#!/usr/bin/env bash
# `make results`: regenerate every docs/results/*.md (+ CSV / PNG) with one command, each benchmark
# at its default size and with its launcher. Stops at the first failure and names it.
# Budget: about 275 min on 2 idle cores (convergence ~20, throughput ~10, netem < 10,
# time-to-accuracy ~135 (Fashion-MNIST and text, both medium, ~85; the lm task ~50), sweeps ~55 (reduced zoo models, ResNet-50, VGG-16), zoo step times ~35, rest ~10).
# Scripts owned by other work items (adaptive.py, adaptive_network.py, soak.py) run when present.
# netem_experiment.py and time_to_accuracy.py need root; without it they print why and measure nothing (exit 0).
# time_to_accuracy.py reads Debian's dataset-fashion-mnist and fortunes (`make data`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=("$PY" -m adacomp.tools.cli run)
START=$SECONDS
DONE=()

step() {  # step NAME CMD...: run one benchmark with a progress line; fail loudly
    local name=$1; shift
    printf '\n=== [%s +%dm%02ds] %s: %s\n' "$(date +%H:%M:%S)" $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)) \
        "$name" "$*"
    local t0=$SECONDS
    if ! "$@"; then
        echo "make results: FAILED at '$name' (command: $*). Finished before it: ${DONE[*]:-none}." >&2
        exit 1
    fi
    DONE+=("$name")
    printf '=== %s done in %ds\n' "$name" $((SECONDS - t0))
}

optional() {  # optional NAME SCRIPT ARGS...: like step, but only if the script exists
    local name=$1 script=$2; shift 2
    if [[ -f $script ]]; then
        step "$name" "$PY" "$script" "$@"
    else
        echo "=== $name: $script not present, skipped"
    fi
}

step dense          "${RUN[@]}" -np 2 -- "$PY" scripts/bench_dense.py
step collectives    "${RUN[@]}" -np 2 -- "$PY" scripts/bench_collectives.py
step compressors    "$PY" scripts/bench_compressors.py
step lowrank        "$PY" scripts/bench_lowrank.py
step throughput-x2  "${RUN[@]}" -np 2 -- "$PY" scripts/bench_throughput.py
step throughput-x4  "${RUN[@]}" -np 4 -- "$PY" scripts/bench_throughput.py
step convergence    "${RUN[@]}" -np 2 -- "$PY" scripts/convergence.py
step netem          "$PY" scripts/netem_experiment.py
step time-to-accuracy "$PY" scripts/time_to_accuracy.py --size medium --tasks fmnist  # every method, ~55 min
step time-to-accuracy-text "$PY" scripts/time_to_accuracy.py --size medium --tasks text --merge  # ~32 min
step time-to-accuracy-lm "$PY" scripts/time_to_accuracy.py --size medium --tasks lm --merge  # 12.5M transformer, DDP vs DiLoCo family, ~50 min
step sweep          "$PY" scripts/sweep.py                # 2 ranks, shaped links 50mbit..10gbit, ~15 min
step sweep-resnet50  "$PY" scripts/sweep.py --models resnet50 --bandwidths 100mbit 1gbit \
    --name sweep_resnet50                              # ResNet-50 at its real width, ~15 min
step sweep-vgg16    "$PY" scripts/sweep.py --models vgg16 --bandwidths 100mbit 1gbit \
    --name sweep_vgg16                                 # VGG-16 convolutions + a 512-wide head (27.8M), ~22 min
step zoo            "$PY" scripts/bench_zoo.py --rounds 1 # full-size zoo vs DDP, every method, ~35 min
optional adaptive          scripts/adaptive.py
optional policy-decisions  scripts/policy_decisions.py   # appends its section to adaptive.md: after adaptive.py
optional adaptive-network  scripts/adaptive_network.py
optional soak              scripts/soak.py

printf '\nmake results: all %d steps passed in %dm%02ds: %s\n' "${#DONE[@]}" $(((SECONDS - START) / 60)) \
    $(((SECONDS - START) % 60)) "${DONE[*]}"
ls -1 docs/results/*.md
