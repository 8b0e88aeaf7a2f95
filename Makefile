# Every target installs what it needs first (scripts/install.sh is idempotent: seconds once done).
PYTHON ?= python3
NP ?= 2
COMPRESSION ?= topk:ratio=0.01

.PHONY: install digits test test-fast

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# The main job: a real 2-worker training run with compressed gradients, on data that needs no download.
digits: install
	horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PYTHON) examples/pytorch_digits.py --compression $(COMPRESSION)

test: install
	$(PYTHON) -m pytest tests -q

# Single-process tests only (no Horovod processes).
test-fast:
	$(PYTHON) -m pytest tests -q --ignore=tests/test_multiprocess.py
