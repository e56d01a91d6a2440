# Everyday commands. `make test` is the README's test command (what .ci/run runs); `make bench SUITE=name` runs one
# benchmark suite (`make bench-list` shows them; DRY=1 prints the commands only).
PYTHON ?= python
SUITE ?= cpu-smoke
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-fast lint format typecheck bench bench-list constraints deps-latest

install:
	pip install torch==2.13.0 -e ".[test]" -c constraints.txt

test:
	$(PYTHON) -m pytest -n 2 --dist loadfile

# The development tier: every module's in-process tests, no launches or end-to-end trainings (under 3 minutes).
test-fast:
	$(PYTHON) -m pytest -n 2 --dist loadfile -m "not integration"

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

typecheck:
	$(PYTHON) -m mypy pair_dpo_trainer

bench:
	$(PYTHON) -m benchmarks.run --suite $(SUITE) $(if $(DRY),--dry-run,)

bench-list:
	$(PYTHON) -m benchmarks.run --list

# constraints.txt pins what CI installs; `make deps-latest` tries the newest releases in a throw-away venv (the fast
# tier, then the list of pins a raise would change); `make constraints` rewrites the pins from the current resolution.
constraints:
	$(PYTHON) tools/constraints.py write

deps-latest:
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q torch==2.13.0 -e ".[test]"
	.venv-latest/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow" -p no:cacheprovider
	.venv-latest/bin/python tools/constraints.py diff
