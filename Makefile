# The README's commands. `make install` creates .venv; everything else uses it.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# made by a finished install; older than pyproject.toml means the dependencies changed
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite, slow multi-node tests included (what CI runs).
test: install
	$(BIN)/pytest -q

# Everything but the tests marked slow.
test-fast: install
	$(BIN)/pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check tierfs tests bench

demo: install
	$(BIN)/tierfs demo

bench: install
	$(BIN)/python bench/fs_bench.py
	$(BIN)/python bench/peer_bench.py
	$(BIN)/python bench/gcs_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
