#!/usr/bin/env bash
# Launch any adacomp benchmark with torchrun:  scripts/run_torchrun.sh NP NAME [args]   (NAME: see `adacomp bench`)
set -euo pipefail
np=${1:?usage: run_torchrun.sh NP NAME [args]}; shift
exec torchrun --standalone --nproc_per_node "$np" -m adacomp.tools.cli bench "$@"
