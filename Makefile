# flowers_job: one virtual environment, pinned by requirements/lock.txt.
#   make run    set up (first time) and run the whole job on the real photos
#   make test   set up (first time), lint, type-check and run the tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PHOTOS ?= ../shared/data/flower_photos
OUT    ?= output/flowers
ARGS   ?=

.PHONY: setup run test lint typecheck unit clean

$(VENV)/.installed: requirements/lock.txt pyproject.toml
	@command -v java >/dev/null || { echo "Spark needs Java 17: installing openjdk-17-jre-headless"; \
		apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/lock.txt
	# petastorm 0.13.1 pins setuptools<70, which conflicts with torch; its real needs are in the lock.
	$(BIN)/pip install -q --no-deps petastorm==0.13.1
	$(BIN)/pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/flowers-job run --images $(PHOTOS) --output-dir $(OUT) $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest

clean:
	rm -rf output .pytest_cache .mypy_cache .ruff_cache
