# adacomp: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .cache/install.stamp

.PHONY: install demo test test-fast horovod data results clean

# torch first, pinned: the CPU build of 2.13.0 is on local disk; an unpinned torch would pull a CUDA build.
$(STAMP): setup.py
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[all,test]"
	@mkdir -p .cache && touch $(STAMP)

install: $(STAMP)

# Horovod 0.28.1 patched to C++17 for current PyTorch; the wheel is cached in ~/.cache/adacomp/wheels.
horovod: install
	PYTHON=$(PYTHON) bash scripts/build_horovod.sh

demo: install
	adacomp train --config configs/quickstart.yaml

test: install horovod
	$(PYTHON) -m pytest -q tests

test-fast: install
	$(PYTHON) -m pytest -q tests -m "not slow"

# Real data for `adacomp bench time_to_accuracy` (not for `make test` / `make demo`: the tests write their own
# small IDX files, the demo uses scikit-learn's digits). Debian packages, read from disk at run time:
# dataset-fashion-mnist (IDX files in /usr/share/datasets/fashion-mnist, ~30 MB) and fortunes
# (~2.5 MB of plain text in /usr/share/games/fortunes). Needs root and a reachable apt mirror once.
data:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -d /usr/share/games/fortunes ]; then \
	    echo "data: dataset-fashion-mnist and fortunes are installed"; \
	else apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist fortunes; fi

results: install data
	bash scripts/make_results.sh

clean:
	rm -rf .cache build *.egg-info runs
