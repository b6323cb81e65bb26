# shardlab: `make run` and `make test` work on a fresh machine; both create .venv when missing or stale.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardlab-installed
# The CPU wheel of this version is on the machine; installing it first means the range in
# pyproject.toml is already satisfied and pip never downloads a CUDA build.
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: run test test-long venv clean bench-comm bench-train demo

venv: $(STAMP)

# Stale when pyproject.toml or this file changed, or when the venv's interpreter no longer runs.
$(STAMP): pyproject.toml Makefile
	@if ! $(BIN)/python -c "" 2>/dev/null; then rm -rf $(VENV); $(PYTHON) -m venv $(VENV); fi
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# The main job: a GPT trained on the Python standard library's sources through a BPE trained on them
# (the first run trains it, ~40 s, cached in runs/data/) on a two-axis mesh, dp 2 x tp 2 (4 local ranks);
# prints the mesh, per-rank memory and communication share, and ends with validation perplexity, bits per
# byte, the loss curve (runs/gpt-mesh/loss.png) and sampled text.
# --overwrite: `make run` is the demo, so a second one starts runs/gpt-mesh/ afresh (and says what it
# removes) rather than asking for --resume, as any other re-run into a directory holding a run does.
run: $(STAMP)
	$(BIN)/shardlab train --config configs/gpt-mesh.toml --overwrite

# What each collective does, rank by rank, with the backend's and with our ring algorithms.
demo: $(STAMP)
	$(BIN)/shardlab collectives --world-size 4
	$(BIN)/shardlab collectives --world-size 4 --impl ring --ops all_reduce,reduce_scatter,all_gather

# The suite CI runs (16-22 minutes measured on 2 cores of an Intel Xeon); `make test-long` runs the few costliest variants it
# leaves out (torchrun restarts and signals under torchrun, the 8-rank layouts beyond the issue's three).
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -m "not long" $(PYTEST_ARGS)

test-long: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -m long $(PYTEST_ARGS)

# The measurements recorded in docs/ (about 40 minutes on 2 cores; run on a quiet machine).
bench-comm: $(STAMP)
	$(BIN)/shardlab bench comm --world-size 2,4 --impl all --sizes 1K-256M --target-time 0.25 \
	    --json docs/results/bench_comm.json --csv docs/results/bench_comm.csv --plot docs/results/bench_comm.png
	$(BIN)/python benchmarks/comm_bar.py --runs 3 --json docs/results/comm_bar.json --markdown docs/results/comm_bar.md

# Data parallelism against torch DDP at the performance bar's size (deep MLP d=2048, 8 layers,
# batch 128, 2 ranks): 3 separate runs, each interleaving the variants (about 10 minutes; quiet machine).
bench-train: $(STAMP)
	$(BIN)/shardlab bench train --world-size 2 --runs 3 \
	    --json docs/results/bench_train.json --plot docs/results/bench_train.png --markdown docs/results/bench_train.md

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
