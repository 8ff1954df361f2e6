#!/usr/bin/env bash
# Launch any adacomp script with horovodrun (Gloo controller):  scripts/run_horovodrun.sh NP script.py [args]
set -euo pipefail
np=${1:?usage: run_horovodrun.sh NP script.py [args]}; shift
command -v horovodrun >/dev/null || { echo "horovodrun not found: run 'make horovod' first" >&2; exit 2; }
exec horovodrun --gloo -np "$np" python "$@"
