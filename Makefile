# Two entry points for newcomers: `make demo` and `make test`. Both set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_USAGE_STATS_ENABLED := 0
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT := false

.PHONY: setup bytecode demo test lint bench fuzz clean

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV) $(PY)
	touch $(STAMP)

setup: $(STAMP) bytecode

# Our sources compiled to bytecode once, here: the install is editable, so where the environment
# sets PYTHONDONTWRITEBYTECODE (many container images do) no process would cache it, and every
# Ray worker, decode actor and rank would compile the modules it imports afresh (a rank's loader
# modules: 0.18 CPU-s from source, 0.11 from bytecode; 64 simulated ranks' first step 2.1 ->
# 1.4-1.7 s, docs/benchmarks.md). Python still reads bytecode under that setting; a file edited
# since is compiled in memory until the next run.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q ray_ingest jobs bench tests > /dev/null

demo: $(STAMP) bytecode
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m ray_ingest.cli.main demo

# Two pytest workers (pytest-xdist), whole files to each: each worker is one pytest session with
# its own local Ray. On 2 cores one sequential session leaves ~40 % of the CPU idle while Ray and
# TorchTrainers start (docs/benchmarks.md, "The test suite's time"). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: $(STAMP) bytecode
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Differential fuzzing, long budget: >= 10,000 examples per parser (the suite runs a bounded
# share of the same tests); counts printed at the end and written to fuzz_figures.json.
fuzz: $(STAMP) bytecode
	RAY_INGEST_FUZZ=long RAY_INGEST_FUZZ_FIGURES=$(CURDIR)/fuzz_figures.json \
		$(BIN)/python -m pytest -q -m fuzz -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check ray_ingest jobs bench tests

bench: $(STAMP) bytecode
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python bench/tar_read.py
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python bench/plan_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
