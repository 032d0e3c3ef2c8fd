# SpecSplit — the two commands a new user needs are `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.specsplit-installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install run test chaos lint proto bench loadtest clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The CPU build of torch is installed first so that the package's own
# `torch` requirement is already met and never pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The workers' dtype: auto is bfloat16 where SpecSplit's bfloat16 kernel builds (2.5x
# float32's tokens/s at one stream here), else float32; DTYPE=float32 gives transformers'
# own greedy text (README, "Precision").
DTYPE ?= auto
run: $(STAMP)
	$(BIN)/specsplit serve --host $(HOST) --port $(PORT) --dtype $(DTYPE) $(ARGS)

# One pytest process per core (pytest-xdist), each with one torch thread: the
# tests' models are tiny, and two processes of two threads on two cores fight.
# It ends with the 25 slowest tests, to keep the suite's time in view.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal -m "not slow" --durations=25 $(ARGS)

# The slow chaos cases (a soak of a few hundred requests against a real serve; minutes),
# which `make test` leaves out; they print their figures.
chaos: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s -n 0 -m slow tests/chaos $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

proto: $(STAMP)
	$(BIN)/python -m proto.generate

bench: $(STAMP)
	$(BIN)/specsplit bench engine $(ARGS)

# Locust against a running SpecSplit (`make run` in another shell), headless;
# CSV files (specsplit_stats.csv, ...), specsplit.json and report.html land in $(RESULTS).
# Locust rewrites the CSV files once a second and not at exit, so a request that ends
# in the run's last second can be missing there; specsplit.json holds the final totals.
URL ?= http://$(HOST):$(PORT)
USERS ?= 4
DURATION ?= 60s
RESULTS ?= loadtest/results
loadtest: $(STAMP)
	mkdir -p $(RESULTS)
	$(BIN)/locust -f loadtest/locustfile.py --headless --host $(URL) \
		--users $(USERS) --spawn-rate $(USERS) --run-time $(DURATION) --stop-timeout 120 \
		--csv $(RESULTS)/specsplit --json-file $(RESULTS)/specsplit --html $(RESULTS)/report.html $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
