# Every target installs what it needs first (scripts/install.sh is idempotent: seconds once done).
PYTHON ?= python3
NP ?= 2
COMPRESSION ?= topk:ratio=0.01

.PHONY: install digits test test-full test-fast test-integrations bench bench-schedules docs gpu-check

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# The main job: a real 2-worker training run with compressed gradients, on data that needs no download.
digits: install
	horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PYTHON) examples/pytorch_digits.py --compression $(COMPRESSION)

# Two pytest-xdist workers: the tests that launch Horovod workers form two groups, each run in order
# in one of them (tests/conftest.py), the single-process tests share both.
test: install
	$(PYTHON) -m pytest tests -q -n 2 --dist loadgroup --durations=25

# The default suite plus the extended tier (tests/conftest.py: costly repeats of covered paths).
test-full: install
	HVDC_EXTENDED_TESTS=1 $(PYTHON) -m pytest tests -q -n 2 --dist loadgroup

# PyTorch Lightning and Ray Train for real (docs/supported.md): installs the pinned packages into this
# Python's environment (neither is in requirements/; ray[train] adds about 500 MB), then runs
# tests/test_integrations.py (the default suite skips it).
INTEGRATIONS ?= lightning==2.6.6 ray[train]==2.58.0
test-integrations: install
	$(PYTHON) -m pip install $(foreach p,$(INTEGRATIONS),"$(p)")
	HVDC_INTEGRATION_TESTS=1 $(PYTHON) -m pytest tests/test_integrations.py -q

# Single-process tests only: deselects the tests marked ``multiprocess`` (tests/conftest.py), the
# ones that launch Horovod/Gloo worker processes.
test-fast:
	$(PYTHON) -m pytest tests -q -m "not multiprocess"

# The emulated-network benchmark of docs/benchmarks.md "Step time across link rates" (root; ~15 minutes on
# 2 cores). Without root: make bench BENCH_ARGS="--loopback -n 2 --steps 4".
BENCH_ARGS ?= -n 4 -b 10mbit,100mbit,1gbit,10gbit,unlimited -c none fp16 topk:ratio=0.001 dgc:ratio=0.001 \
	-s layerwise --no-profile --model vgg --batch 32 --steps 6 --warmup 1 --phase-budget-s 30 \
	--out benchmarks/results/step-time/vgg-4workers
bench: install
	$(PYTHON) -m hvdcompress.bench $(BENCH_ARGS)

# The merge-schedule comparison of docs/scheduler.md "Measured with real CPU compute" (root; ~3 minutes): Horovod's own
# tensor fusion off, so every group of a schedule is one collective.
bench-schedules: install
	HOROVOD_FUSION_THRESHOLD=0 $(PYTHON) -m hvdcompress.bench --model deep -n 2 -b 100mbit,1gbit \
	-c topk:ratio=0.01 none -s layerwise,single,size:0.25,auto --steps 20 --warmup 14 --profile-steps 8 \
	--out benchmarks/results/scheduler/schedules-deep

# Rewrite the generated spec/parameter tables of docs/algorithms.md from the registry
# (tests/test_docs.py fails while they are stale).
docs:
	$(PYTHON) -m hvdcompress.docs_tables

# The GPU checks of docs/gpu.md in one run (a machine with a CUDA device and torch; no install needed,
# about 9 minutes): CUDA tests, benchmarks/cuda_check.py, benchmarks/gpu_e2e.py, advise --device cuda.
# Writes under $(OUT) (the device tool sets OUT; default a new temporary folder).
gpu-check:
	bash scripts/gpu_check.sh
