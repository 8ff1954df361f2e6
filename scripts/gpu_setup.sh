#!/usr/bin/env bash
# Install adacomp on a GPU machine (issue 33), next to the CUDA build of PyTorch already there.
#
#   bash scripts/gpu_setup.sh            # with a package registry: adacomp[all,test], torch left as it is
#   OFFLINE=1 bash scripts/gpu_setup.sh  # no registry: wheels from .whl/ (fetched elsewhere), then adacomp
#
# Never `make install` there: the Makefile pins torch's CPU build for CPU machines. Offline, .whl/ holds
# what the machine lacks (for the lent H100/H200 image: pymoo 0.6.2 and its pure-Python needs; see
# docs/results/cuda.md for the download line). Then: `python3 -m pytest tests/test_cuda.py` and
# `adacomp bench compressors --device cuda`, `adacomp bench gpu_step`.
set -euo pipefail
PY=${PYTHON:-python3}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
if [ "${OFFLINE:-0}" = 1 ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
    fi
    # no registry, so no build backend for an editable install: adacomp runs from the checkout
    # (the caller exports PYTHONPATH=$PWD and PATH=$PWD/.gpu_bin:$PATH, as scripts/gpu_check.sh does)
    mkdir -p .gpu_bin
    printf '#!/bin/sh\nexec %s -c "import sys; from adacomp.tools.cli import main; sys.exit(main())" "$@"\n' \
        "$PY" > .gpu_bin/adacomp
    chmod +x .gpu_bin/adacomp
else
    "$PY" -m pip install -q -e ".[all,test]"
fi
"$PY" -c "import adacomp, pymoo; print('adacomp', adacomp.__file__)"
adacomp bench >/dev/null && echo "adacomp CLI: $(command -v adacomp)"
