#!/usr/bin/env bash
# Launch any adacomp script with torchrun:  scripts/run_torchrun.sh NP scripts/bench_throughput.py [args]
set -euo pipefail
np=${1:?usage: run_torchrun.sh NP script.py [args]}; shift
exec torchrun --standalone --nproc_per_node "$np" "$@"
