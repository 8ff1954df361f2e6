#!/usr/bin/env bash
# Horovod's own torch tests (its test/parallel/test_torch.py, which adacomp does not ship: point
# HOROVOD_TEST_TORCH at it in a checkout of github.com/horovod/horovod; prepare.py makes the
# runnable copy in $HOROVOD_OWN_TESTS_OUT/src with its two edits) on 2 ranks: adacomp under `adacomp run`
# (torch backend), then the same file against real Horovod under `horovodrun --gloo` (to tell
# adacomp's failures from the test's), then one table (summarize.py).
#
# A test that fails on one rank only leaves the other rank one collective ahead. adacomp then fails
# every later test with a mismatch, so the whole file runs once and every test that failed there
# runs again alone in a fresh launch (the table gives that isolated result). Horovod instead stalls
# (ops are matched by name, and unnamed ops are numbered per rank), so under horovodrun every test
# runs alone, each launch killed after HOROVOD_TEST_LAUNCH_TIMEOUT seconds (default 150).
#
# Usage, from the repository root:
#   HOROVOD_TEST_TORCH=/path/to/horovod/test/parallel/test_torch.py scripts/horovod_own_tests/run.sh [adacomp|horovod|both]
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${HOROVOD_OWN_TESTS_OUT:-/tmp/horovod_own_tests}"
which="${1:-both}"
if [ ! -f "${HOROVOD_TEST_TORCH:-}" ]; then
  echo "run.sh: set HOROVOD_TEST_TORCH to Horovod's test/parallel/test_torch.py (a checkout of" \
       "github.com/horovod/horovod; adacomp does not ship Horovod's code)" >&2
  exit 2
fi
export HOROVOD_OWN_TESTS_SRC="$out/src"
python "$here/prepare.py" "$HOROVOD_TEST_TORCH" "$HOROVOD_OWN_TESTS_SRC" || exit 2
launch() {  # impl dir [pytest args]: one launch of both ranks
  local impl="$1" dir="$2"; shift 2
  rm -rf "$dir" && mkdir -p "$dir"
  if [ "$impl" = adacomp ]; then
    HOROVOD_OWN_TESTS_OUT="$dir" timeout 900 adacomp run -np 2 -- python "$here/run_rank.py" "$@" >> "$out/$impl.log" 2>&1
  else
    HVD_IMPL=horovod HOROVOD_OWN_TESTS_OUT="$dir" timeout "${HOROVOD_TEST_LAUNCH_TIMEOUT:-150}" \
      horovodrun --gloo -np 2 -H localhost:2 python "$here/run_rank.py" "$@" >> "$out/$impl.log" 2>&1
  fi
}
alone() {  # impl test
  launch "$1" "$out/$1/alone/$2" -k "$2 and not ${2}_"
}
if [ "$which" != horovod ]; then
  rm -rf "$out/adacomp" "$out/adacomp.log"; mkdir -p "$out"
  launch adacomp "$out/adacomp/all"
  for t in $(python "$here/summarize.py" --failed "$out/adacomp/all"); do alone adacomp "$t"; done
fi
if [ "$which" != adacomp ] && command -v horovodrun > /dev/null; then
  rm -rf "$out/horovod" "$out/horovod.log"; mkdir -p "$out"
  for t in $(python -m pytest -q --collect-only -p no:cacheprovider -o addopts= "$HOROVOD_OWN_TESTS_SRC/test_torch.py" 2>/dev/null \
             | sed -n 's/.*::TorchTests::\(test_[a-z0-9_]*\)$/\1/p'); do
    alone horovod "$t"
  done
fi
python "$here/summarize.py" "$out/adacomp" "$out/horovod"
