# adacomp: the two commands a fresh machine needs are `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .cache/install.stamp

.PHONY: install demo test test-fast horovod results clean

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

results: install
	bash scripts/make_results.sh

clean:
	rm -rf .cache build *.egg-info runs
