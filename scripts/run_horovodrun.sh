#!/usr/bin/env bash
# Launch any adacomp benchmark with horovodrun (Gloo controller):  scripts/run_horovodrun.sh NP NAME [args]   (NAME: see `adacomp bench`)
set -euo pipefail
np=${1:?usage: run_horovodrun.sh NP NAME [args]}; shift
command -v horovodrun >/dev/null || { echo "horovodrun not found: run 'make horovod' first" >&2; exit 2; }
exec horovodrun --gloo -np "$np" python -m adacomp.tools.cli bench "$@"
