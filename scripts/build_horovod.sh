#!/usr/bin/env bash
# Build and install Horovod 0.28.1 for current PyTorch (called by `make horovod`).
#
# Why: 0.28.1 (the latest release) compiles its PyTorch extension as C++14, but PyTorch >= 2.1
# headers need C++17 (DESIGN.md "Horovod on current PyTorch"). We download the sdist, change the
# two `set(CMAKE_CXX_STANDARD 14)` lines to 17, build a wheel with the Gloo controller only
# (no MPI / TensorFlow / MXNet) against the installed torch, cache it, and pip-install it.
#
# Idempotent: an importable horovod.torch is left alone; a cached wheel built for the same torch
# and Python is reused, so CI reruns take seconds.
#
# Environment:
#   PYTHON               interpreter to build for (default: python3)
#   ADACOMP_WHEEL_CACHE  wheel cache folder (default: ~/.cache/adacomp/wheels)
#   MAKEFLAGS            build parallelism (default: -j2; the shared machines have 2 cores)
#   HOROVOD_FORCE=1      rebuild and reinstall even when horovod is already importable
set -euo pipefail

HVD_VERSION=0.28.1
PYTHON=${PYTHON:-python3}
CACHE=${ADACOMP_WHEEL_CACHE:-$HOME/.cache/adacomp/wheels}
export MAKEFLAGS=${MAKEFLAGS:--j2}

die() { echo "build_horovod: ERROR: $*" >&2; exit 1; }
say() { echo "build_horovod: $*"; }

# --- prerequisites, each with the fix -------------------------------------------------------
command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found; set PYTHON=/path/to/python"
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
  || die "torch is not importable with $PYTHON; install it first: $PYTHON -m pip install torch"

if [[ "${HOROVOD_FORCE:-0}" != 1 ]] && "$PYTHON" - <<'EOF' 2>/dev/null
import horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.gloo_built()
EOF
then
  say "horovod $HVD_VERSION (torch, gloo) already installed; nothing to do (HOROVOD_FORCE=1 rebuilds)"
  exit 0
fi

PY_TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The wheel links against one torch ABI: key the cache by torch version as well as Python.
TORCH_TAG=$(echo "$TORCH_VERSION" | tr -c 'A-Za-z0-9.\n' '_')
WHEEL_DIR="$CACHE/horovod-$HVD_VERSION-torch$TORCH_TAG-$PY_TAG"
mkdir -p "$WHEEL_DIR" || die "cannot create wheel cache $WHEEL_DIR; set ADACOMP_WHEEL_CACHE to a writable folder"

shopt -s nullglob
wheels=("$WHEEL_DIR"/horovod-"$HVD_VERSION"-*.whl)
if (( ${#wheels[@]} == 0 )) || [[ "${HOROVOD_FORCE:-0}" == 1 ]]; then
  command -v cmake >/dev/null || die "cmake not found; install it: apt-get install cmake  (or $PYTHON -m pip install cmake)"
  command -v "${CXX:-g++}" >/dev/null || die "C++ compiler '${CXX:-g++}' not found; install it: apt-get install g++"
  command -v make >/dev/null || die "make not found; install it: apt-get install make"
  echo 'int main(){ if constexpr (true) return 0; }' | "${CXX:-g++}" -std=c++17 -x c++ -o /dev/null - 2>/dev/null \
    || die "${CXX:-g++} cannot compile C++17, which PyTorch's headers need; install g++ >= 9"
  "$PYTHON" -c 'import wheel' 2>/dev/null || "$PYTHON" -m pip install -q wheel \
    || die "the 'wheel' package is missing and could not be installed"
  "$PYTHON" -c 'import cloudpickle, psutil, yaml' 2>/dev/null || "$PYTHON" -m pip install -q cloudpickle psutil pyyaml packaging \
    || die "Horovod's runtime dependencies (cloudpickle psutil pyyaml packaging) could not be installed"

  WORK=$(mktemp -d "${TMPDIR:-/tmp}/adacomp-horovod.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  trap 'exit 130' INT TERM  # run the EXIT trap (clean-up) on Ctrl-C / kill too
  say "downloading horovod==$HVD_VERSION source into $WORK"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HVD_VERSION" \
    || die "could not download the horovod==$HVD_VERSION sdist from PyPI (network or index problem)"
  tar -xzf "$WORK"/horovod-"$HVD_VERSION".tar.gz -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"

  for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    [[ -f "$f" ]] || die "expected $f in the sdist; the source layout changed"
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" \
      || die "no 'set(CMAKE_CXX_STANDARD 14)' in $f; the C++17 patch no longer applies"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  say "patched C++ standard 14 -> 17; building (MAKEFLAGS=$MAKEFLAGS, several minutes)"

  LOG="$WORK/build.log"
  if ! HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WORK/dist" "$SRC" >"$LOG" 2>&1; then
    tail -n 60 "$LOG" >&2
    cp "$LOG" "$CACHE/horovod-build-failed.log" 2>/dev/null || true
    die "building the horovod wheel failed (last 60 lines above; full log: $CACHE/horovod-build-failed.log)"
  fi
  built=("$WORK"/dist/horovod-"$HVD_VERSION"-*.whl)
  (( ${#built[@]} == 1 )) || die "the build produced no horovod wheel in $WORK/dist"
  rm -f "$WHEEL_DIR"/horovod-*.whl
  cp "${built[0]}" "$WHEEL_DIR/"
  wheels=("$WHEEL_DIR/$(basename "${built[0]}")")
  say "cached ${wheels[0]}"
else
  say "reusing cached wheel ${wheels[0]}"
fi

"$PYTHON" -m pip install -q --force-reinstall --no-deps "${wheels[0]}" \
  || die "pip could not install ${wheels[0]}"
"$PYTHON" -m pip install -q cloudpickle psutil pyyaml packaging \
  || die "Horovod's runtime dependencies (cloudpickle psutil pyyaml packaging) could not be installed"
"$PYTHON" -c 'import horovod.torch as hvd; assert hvd.gloo_built(), "gloo controller missing"' \
  || die "horovod installed but 'import horovod.torch' fails; rebuild with HOROVOD_FORCE=1 (torch changed?)"
say "horovod $HVD_VERSION installed ($(command -v horovodrun || echo 'horovodrun not on PATH'))"
