#!/usr/bin/env bash
# `make results`: regenerate every docs/results/*.md (+ CSV / PNG) with one command, each benchmark
# at its default size and with its launcher. Stops at the first failure and names it.
# Budget: about 275 min on 2 idle cores (convergence ~20, throughput ~10, netem < 10,
# time-to-accuracy ~135 (Fashion-MNIST and text, both medium, ~85; the lm task ~50), sweeps ~55 (reduced zoo models, ResNet-50, VGG-16), zoo step times ~35, rest ~10).
# Every benchmark is `adacomp bench NAME` (the package adacomp/bench; `adacomp bench` lists them), run
# from the checkout's root so results land in docs/results/. Optional ones run when the package has them.
# netem_experiment and time_to_accuracy need root; without it they print why and measure nothing (exit 0).
# time_to_accuracy reads Debian's dataset-fashion-mnist and fortunes (`make data`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=("$PY" -m adacomp.tools.cli run)
BENCH=("$PY" -m adacomp.tools.cli bench)
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

optional() {  # optional NAME BENCH ARGS...: like step, but only if the package has benchmark BENCH
    local name=$1 bench=$2; shift 2
    if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('adacomp.bench.$bench') is None)"; then
        step "$name" "${BENCH[@]}" "$bench" "$@"
    else
        echo "=== $name: adacomp.bench.$bench not present, skipped"
    fi
}

step dense          "${RUN[@]}" -np 2 -- "${BENCH[@]}" dense
step collectives    "${RUN[@]}" -np 2 -- "${BENCH[@]}" collectives
step compressors    "${BENCH[@]}" compressors
step lowrank        "${BENCH[@]}" lowrank
step throughput-x2  "${RUN[@]}" -np 2 -- "${BENCH[@]}" throughput
step throughput-x4  "${RUN[@]}" -np 4 -- "${BENCH[@]}" throughput
step convergence    "${RUN[@]}" -np 2 -- "${BENCH[@]}" convergence
step netem          "${BENCH[@]}" netem_experiment
step time-to-accuracy "${BENCH[@]}" time_to_accuracy --size medium --tasks fmnist  # every method, ~55 min
step time-to-accuracy-text "${BENCH[@]}" time_to_accuracy --size medium --tasks text --merge  # ~32 min
step time-to-accuracy-lm "${BENCH[@]}" time_to_accuracy --size medium --tasks lm --merge  # 12.5M transformer, DDP vs DiLoCo family, ~50 min
step sweep          "${BENCH[@]}" sweep                # 2 ranks, shaped links 50mbit..10gbit, ~15 min
step sweep-resnet50  "${BENCH[@]}" sweep --models resnet50 --bandwidths 100mbit 1gbit \
    --name sweep_resnet50                              # ResNet-50 at its real width, ~15 min
step sweep-vgg16    "${BENCH[@]}" sweep --models vgg16 --bandwidths 100mbit 1gbit \
    --name sweep_vgg16                                 # VGG-16 convolutions + a 512-wide head (27.8M), ~22 min
step zoo            "${BENCH[@]}" zoo --rounds 1       # full-size zoo vs DDP, every method, ~35 min
optional adaptive          adaptive
optional policy-decisions  policy_decisions   # appends its section to adaptive.md: after adaptive
optional adaptive-network  adaptive_network
optional soak              soak

printf '\nmake results: all %d steps passed in %dm%02ds: %s\n' "${#DONE[@]}" $(((SECONDS - START) / 60)) \
    $(((SECONDS - START) % 60)) "${DONE[*]}"
ls -1 docs/results/*.md
