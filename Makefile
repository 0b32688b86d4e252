# portarl: `make demo` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU torch pinned: a bare torch range would pull a multi-GB CUDA build. On a GPU or NPU
# machine install the matching torch yourself and `pip install -e .[cuda]` / `.[npu]`.
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton>=3.2

.PHONY: demo test test-hardware parity-report clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet "$(TRITON_SPEC)" -e ".[dev]"
	touch $@

# Main job: GRPO on the built-in default (tiny Qwen2, character tokenizer, arithmetic),
# a short supervised warm-up first. Metrics, TensorBoard logs, curves.png, checkpoints: runs/demo.
demo: $(VENV)/.installed
	rm -rf runs/demo
	$(VENV)/bin/portarl train --output-dir runs/demo

# The parity sweep on the best available device (fused ops vs float64, every backend and dtype).
parity-report: $(VENV)/.installed
	$(VENV)/bin/portarl parity --device auto --out parity-report.json

# CPU suite; every Triton kernel runs under the interpreter (set before portarl imports).
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# On a GPU or NPU machine: the hardware-marked tests and a parity report.
test-hardware: $(VENV)/.installed
	$(PY) -m pytest -q -m "gpu or npu" -rs

clean:
	rm -rf $(VENV) .pytest_cache parity-report.json runs
