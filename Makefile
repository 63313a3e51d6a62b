# The README's commands. `make install` creates .venv; everything else uses it.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# made by a finished install; older than pyproject.toml means the dependencies changed
STAMP := $(VENV)/.installed

.PHONY: install test test-ray test-fast lint demo bench soak clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite, slow multi-node tests included (what CI runs), on 3 pytest-xdist workers:
# it mostly waits on daemons, restores and bucket deadlines, so 3 workers fit 2 cores (19 min
# instead of ~37). The longest tests start first (tests/conftest.py); every worker keeps its
# tests' ram-dirs on a tmpfs of its own. `make test WORKERS=0` runs it in one process.
# Then the Ray Train test (marker ray: a local Ray cluster of 4 raylets) runs on its own, so
# its Ray processes do not compete with 3 workers of daemons for the 2 cores.
WORKERS ?= 3
test: install
	$(BIN)/pytest -q -n $(WORKERS) --dist load --maxschedchunk 2 -m "not ray"
	$(BIN)/pytest -q -m ray

# The Ray Train v2 elastic test alone (issue #16; about 2-3 minutes on a 2-core VM, also
# beside two busy loops).
test-ray: install
	$(BIN)/pytest -q -m ray

# The quick layer: unit and model tests (no mount, no daemon, no bucket), < 2 minutes.
test-fast: install
	$(BIN)/pytest -q tests/unit tests/model -m "not slow"

lint: install
	$(BIN)/ruff check tierfs tests bench
	$(BIN)/ruff format --check tierfs tests bench setup.py
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: install
	$(BIN)/tierfs demo

bench: install
	$(BIN)/python bench/fs_bench.py
	$(BIN)/python bench/peer_bench.py
	$(BIN)/python bench/gcs_bench.py

# The randomized fault campaign of tests/support/fault_campaign.py, longer than the suite's
# 18 injections; prints per kind: count, failures, recovery median/max. Needs root.
SEED ?= 1
INJECTIONS ?= 200
SOAK_MODE ?= both
soak: install
	$(BIN)/python tests/support/fault_campaign.py --seed $(SEED) --injections $(INJECTIONS) \
		--mode $(SOAK_MODE) $(if $(SOAK_OUT),--out $(SOAK_OUT))

# the install also generates tierfs/rpc's modules (setup.py build_rpc): again when a
# .proto or the build step changes
$(STAMP): setup.py $(wildcard tierfs/rpc/*.proto)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
	rm -f tierfs/rpc/*_pb2.py tierfs/rpc/*_pb2.pyi tierfs/rpc/*_pb2_grpc.py tierfs/rpc/*_pb2_grpc.pyi
