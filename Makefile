# flowers_job: virtual environments, each pinned by a lock file and built with uv.
#   make run        set up (first time) and run the whole job on the real photos
#   make run LOADER=petastorm
#                   the same with Petastorm, in its legacy environment (.venv-petastorm)
#   make test       the gate (TIER=gate: the tests marked tier("gate"), docs/testing.md): set
#                   up (first time), lint, type-check, build the wheel once, then the suites
#                   below, each with pytest --tier gate
#   make test-full  everything (TIER=full), the same way; when green it writes .ci/full-pass
#                   (tools/ci_tier.py), which .ci/run reads to choose the tier
# Each suite runs under `timeout` (SUITE_SECONDS_*: SIGINT, so pytest prints where it was and
# its summary) and pytest's --maxfail (MAXFAIL), so that a systematic hang or breakage ends
# well inside CI's 90 minutes with its cause printed. The suites (the files of DBR_ONLY in
# the DBR suite only):
#               test-local  the whole suite in .venv (requirements/lock.txt: Spark 4.2, the
#                           Streaming loader; the project installed editable)
#               test-dbr    the Databricks Runtime 17.3 LTS ML suite in .venv-dbr
#                           (requirements/dbr-17.3-ml.txt) against the BUILT wheel with its
#                           [streaming] extra, with data.loader=streaming
#               test-dbr18  the Databricks Runtime 18 ML tests (DBR18_TESTS: the light
#                           ones and the promotion path; the full tier adds the smoke job)
#                           in .venv-dbr18 (requirements/dbr-18-ml.txt), the same way: in
#                           the gate after it, on the same side; in the full tier after
#                           test-local
#               test-cluster  the netns cluster's tests (tests/cluster) in .venv, on the
#                           DBR side after the 17.3 suite
#               test-petastorm  the Petastorm tests in the
#                           legacy environment .venv-petastorm (requirements/petastorm.txt:
#                           Spark 4.0, pyarrow 14, NumPy 1.26; the project editable): one
#                           end-to-end job in the gate (after the DBR suites), every test
#                           that names petastorm in the full tier (after the DBR side)
#               Where this is root with util-linux's unshare (CI is), the two sides run
#               side by side, the DBR side's suites each in its own mount namespace (its
#               own /dev/shm, for the Streaming state checks of faults/test_faults.py);
#               each suite's output is printed whole when it ends (make -O). Elsewhere one
#               after the other.
# An environment is rebuilt only when its lock file's content changes (a hash in its
# .installed-<hash> marker, not the file's time): uv installs from its cache by hard links,
# seconds when the cache is warm. Each part prints how long it took ("==> part: N s"); with
# TIMES_LOG=FILE the lines are also appended to FILE (.ci/run prints them at the end).
# Each suite writes a JUnit XML into $(REPORTS) and prints every test's duration
# (--durations=0); tools/junit_summary.py reads them back.
# Python writes the bytecode of what it imports (__pycache__), whatever the caller's
# PYTHONDONTWRITEBYTECODE says: uv installs no .pyc, and with that variable set (as on this
# 2-core machine, and CI runs on one like it) every process compiled torch, torchvision,
# MLflow and pandas from source on every import. test_cli_run_local_mode_then_resume[streaming] in .venv-dbr: 99.5 s without
# bytecode, 71.5 s while writing it, 65.8 s with it (alone, 2-core machine, 2026-11-24).
unexport PYTHONDONTWRITEBYTECODE
PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
DBR_VENV ?= .venv-dbr
DBR_BIN  := $(abspath $(DBR_VENV))/bin
# The runtime-like environment the DBR targets build and test in: its lock file, and the name
# of its parts in the times log and of its JUnit XML (test-dbr18 sets all three).
DBR_LOCK ?= requirements/dbr-17.3-ml.txt
DBR_NAME ?= dbr
PHOTOS   ?= ../shared/data/flower_photos
OUT      ?= output/flowers
ARGS     ?=
TIMES_LOG ?=
# JUnit XML of each suite (junit-local.xml, junit-dbr.xml).
REPORTS  ?= $(abspath reports)
UV_VERSION := $(shell sed -n 's/^uv==//p' requirements/lock.txt)
UV       := $(BIN)/uv
# What each environment is built from: its lock file (and, for .venv, pyproject.toml, for
# the editable project), hashed.
LOCAL_ID := $(shell cat requirements/lock.txt pyproject.toml | sha256sum | cut -c1-12)
DBR_ID   := $(shell cat $(DBR_LOCK) | sha256sum | cut -c1-12)
# The legacy Petastorm environment (setup-petastorm, make run LOADER=petastorm, test-petastorm):
# Petastorm 0.13.1 imports only beside pyarrow < 15 and NumPy < 2, so beside Spark 4.0 at most.
PETASTORM_VENV ?= .venv-petastorm
PETASTORM_BIN  := $(abspath $(PETASTORM_VENV))/bin
PETASTORM_LOCK := requirements/petastorm.txt
PETASTORM_ID   := $(shell cat $(PETASTORM_LOCK) pyproject.toml | sha256sum | cut -c1-12)
# `make run LOADER=NAME` sets data.loader (petastorm: in .venv-petastorm); empty: the config's.
LOADER ?=
# The Spark Connect client with no JVM (setup-connect): pyspark-client and what the driver
# side imports (requirements/connect-client.txt, hashed like the others), then the wheel.
CONNECT_VENV ?= .venv-connect
CONNECT_BIN  := $(abspath $(CONNECT_VENV))/bin
CONNECT_LOCK := requirements/connect-client.txt
CONNECT_ID   := $(shell cat $(CONNECT_LOCK) | sha256sum | cut -c1-12)
# The wheel setup-connect installs: empty, the one in WHEEL_DIR (built there if there is none).
CONNECT_WHEEL ?=
# What .venv-connect's setup waits for: .venv, whose uv builds it (the test of .venv-connect,
# running in .venv already, passes its own UV and nothing here).
CONNECT_NEEDS ?= $(VENV)/.installed-$(LOCAL_ID)
# Where test-dbr builds the wheel (the bundle's artifact builds into dist/ the same way). The
# one wheel of a run: the DBR environments, the clean install and the test cluster's
# environment (tools/cluster.py make_env) all take it (FLOWERS_WHEEL).
WHEEL_DIR ?= $(abspath dist)
# The tier the suites run (pytest --tier): gate or full. `make test` and `make test-full` set it.
TIER ?= gate
# Bounds of each suite, seconds (`timeout -s INT`, then SIGKILL 60 s later), and pytest's
# --maxfail, per tier. The gate's sit above what its suites take on the slower machine of this
# kind and inside CI's 5,400 s. The full tier's catch a hang, not a slow suite: on the slower
# machine its local suite alone runs past 7,200 s beside the DBR side and its netns cluster's
# suite past 3,400 s, so the whole tier does not fit CI's 5,400 s there (docs/testing.md,
# where its time goes).
SUITE_SECONDS_gate := 2000
SUITE_SECONDS_full := 10800
CLUSTER_SECONDS_gate := 900
CLUSTER_SECONDS_full := 5400
DBR18_SECONDS_gate := 900
DBR18_SECONDS_full := 1200
MAXFAIL_gate := 5
MAXFAIL_full := 10
SUITE_SECONDS ?= $(SUITE_SECONDS_$(TIER))
MAXFAIL ?= $(MAXFAIL_$(TIER))
# Every process a suite starts carries the word suite-<the recipe shell's pid> in
# FLOWERS_JOB_TEST_SESSION (tests/support/leftovers.py adds the pytest session's after it), so
# that what a suite stopped by its bound left running can be found (suite_timeout).
SUITE_TIMEOUT = FLOWERS_JOB_TEST_SESSION=suite-$$$$ timeout -s INT -k 60 $(SUITE_SECONDS)
# 0: wheel-dbr installs the wheel already in WHEEL_DIR instead of building it again (`make
# test` builds it once, for both runtimes).
BUILD_WHEEL ?= 1
# The Databricks Runtime 18 ML tests (test-dbr18): in both tiers the light ones (the config,
# the loader check, the packages, the fast failures) and the promotion path through a
# tracking server; the full tier adds batch scoring, serving (which 18's MLflow cannot start
# with the FastAPI here: skipped, naming the versions that can) and the smoke job, the CLI's
# whole job on 60 real photos with Mosaic Streaming, then a resume, MLflow, the registry and
# the champion alias (docs/testing.md has what CI can afford and why these).
DBR18_LIGHT := unit/config/test_config.py project/test_stack.py unit/tracking/test_packages.py integration/test_fail_fast.py unit/driver/test_promotion.py
DBR18_TESTS_gate := $(DBR18_LIGHT)
DBR18_TESTS_full := $(DBR18_LIGHT) unit/serving/test_batch_predict.py unit/serving/test_serving.py \
	integration/test_job_e2e.py::test_cli_run_local_mode_then_resume
DBR18_TESTS ?= $(DBR18_TESTS_$(TIER))
# 0: `make test` leaves the 18 tests out (`make test-dbr18` still runs them).
SMOKE_DBR18 ?= 1
# Test files that `make test` runs in the DBR suite only, which evens out the two sides'
# times when they run side by side (docs/testing.md): the checks of flowers_job's own that
# read and write Delta tables through the stack both suites exercise in
# unit/ingest/test_ingest.py (the quarantine of each bad input, training's refusal of
# damaged tables, the incremental ingest and retention, the loader cache's reuse, locking and
# eviction, which are the loader's own in-between: the Streaming loader there), and batch
# scoring (the bundle's score task runs on the runtime), and `flowers-job runs` (MLflow's
# client as the runtime ships it), and catalog tables (the runtime's pydantic 2.10 rebuilds
# their settings on the ranks: it caught a dump that only pydantic 2.11+ gave right).
DBR_ONLY ?= unit/tables/test_table_checks.py integration/test_bad_input.py integration/test_incremental.py \
	unit/loaders/test_loader_cache.py unit/serving/test_batch_predict.py unit/driver/test_runs.py integration/test_catalog_tables.py
# Tests that `make test` runs in the DBR suite only (test-local deselects them), for the same
# reason: Delta's commit protocol under an interrupted ingest, which the ingest tests of
# both stacks build on.
DBR_ONLY_TESTS ?= unit/ingest/test_ingest.py::test_an_interrupted_ingest_is_refused_by_training_and_repaired_by_a_rerun
# Tests test-local deselects (`make test` sets it to DBR_ONLY_TESTS).
LOCAL_DESELECT ?=
# The test files that run in the DBR 17.3 environment. Not among them: the fault and restart
# scenarios (faults/test_faults.py, faults/test_restart.py) and the loader cache's appends
# (integration/test_cache_append.py), jobs of several runs each whose guarantees are the
# job's own (process groups, restarts, the cache's layout): they run once, in the local suite
# with the same Streaming loader, and in the Petastorm suite with Petastorm.
DBR_TESTS ?= unit/config/test_config.py unit/ingest/test_ingest.py unit/loaders/test_shards.py unit/loaders/test_loaders.py integration/test_job_e2e.py \
	faults/test_recovery.py project/test_bundle.py integration/test_fail_fast.py project/test_stack.py \
	unit/tracking/test_packages.py unit/driver/test_promotion.py unit/serving/test_serving.py $(DBR_ONLY)
# Test files test-local leaves out (`make test` sets it to DBR_ONLY).
LOCAL_IGNORE ?=
# Tests of the DBR files whose guarantee does not depend on the Python stack run once, in
# test-local: Delta's commit protocol under a changed ingest and the
# split's independence of the partitioning (the DBR environment's delta-spark is OSS Delta,
# not the runtime's own, so it could not speak for Databricks there anyway), and the slot
# count of a cluster that is too small (Spark's). The rest of unit/ingest/test_ingest.py and
# integration/test_fail_fast.py runs in both: the decode over Arrow (pyarrow 19, NumPy 2, pandas 2.2) and
# MLflow 3.0.1's client depend on the stack.
DBR_DESELECT ?= unit/ingest/test_ingest.py::test_changed_clean_input_is_reingested_consistently \
	unit/ingest/test_ingest.py::test_split_is_deterministic_whatever_the_partitioning \
	integration/test_fail_fast.py::test_cli_exits_2_when_the_processes_do_not_fit_the_cluster \
	$(addprefix integration/test_job_e2e.py::,$(E2E_LOCAL_ONLY))
# The end-to-end jobs (full tier) that the DBR suite leaves to the local suite, for the reason
# DBR_TESTS gives: the resume's refusal of re-ingested data, barrier mode, the validation
# features computed once. The one job per loader (test_cli_run_local_mode_then_resume)
# runs in every environment.
E2E_LOCAL_ONLY := test_resume_refuses_reingested_data_unless_told test_run_barrier_mode \
	test_frozen_backbone_validation_features_once_give_the_same_metrics
# The loaders whose parametrized tests (end-to-end, faults, shards) test-local runs: .venv
# has Streaming only (test-petastorm runs Petastorm's in its own environment).
LOCAL_LOADERS ?= streaming
# The Petastorm suite (test-petastorm): in the gate one real job and the loader checks; in the
# full tier every test whose id names petastorm (pytest -k), but for the netns cluster's and
# the container's, whose hosts run the default environment.
PETASTORM_TESTS_gate := integration/test_job_e2e.py::test_cli_run_local_mode_then_resume project/test_stack.py
PETASTORM_TESTS_full := unit integration faults project
PETASTORM_SELECT_gate :=
PETASTORM_SELECT_full := -k petastorm
PETASTORM_SECONDS_gate := 900
PETASTORM_SECONDS_full := 3600

.PHONY: setup setup-dbr setup-dbr18 setup-petastorm run test test-full tier test-local test-dbr \
	test-dbr18 test-petastorm test-cluster dbr-suite local-side dbr-side petastorm-side dbr18-side wheel-dbr lint typecheck clean cluster-env \
	cluster-up cluster-down s3-jars setup-connect container-deps test-container

# The container image (docker/Dockerfile) built from a base made of Debian's packages and run
# with podman (tools/container.py): the tests of tests/container, in the full tier only, on
# the DBR side after its suites (the local suite is the longer one; docs/testing.md).
# container-deps installs, as root, what they need from Debian's packages.
CONTAINER_PACKAGES := podman mmdebstrap runc
container-deps:
	@missing=""; for tool in $(CONTAINER_PACKAGES); do command -v $$tool >/dev/null || \
		missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
		t0=$$(date +%s); echo "the container tests need:$$missing: installing $(CONTAINER_PACKAGES)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			$(CONTAINER_PACKAGES) >/dev/null; $(call took,install container tools); fi

test-container: setup container-deps
	@t0=$$(date +%s); rc=0; mkdir -p $(REPORTS); set -x; \
	$(SUITE_TIMEOUT) $(BIN)/python -m pytest --tier $(TIER) --maxfail $(MAXFAIL) --durations=0 \
		--junitxml=$(REPORTS)/junit-container.xml tests/container || rc=$$?; \
	set +x; $(call took,tests container); $(call pytest_status); $(call suite_timeout,$(BIN)/python); exit $$rc

# A Spark standalone cluster on this machine, one network namespace per host (needs root):
# master, 2 workers, a driver host with an MLflow server; tools/cluster.py says more.
#   make cluster-up
#   .venv/bin/python tools/cluster.py submit -- --images DIR --output-dir DIR --set ...
#   make cluster-down
cluster-env: setup
	$(BIN)/python tools/cluster.py env

cluster-up: cluster-env
	$(BIN)/python tools/cluster.py up

cluster-down:
	$(PYTHON) tools/cluster.py down

# The jars of Spark on s3a:// (hadoop-aws 3.4.1 and the 550 MB AWS SDK bundle, with Delta) in
# an Ivy cache outside the repo (FLOWERS_IVY_DIR, default ~/.cache/flowers-job/ivy), from
# Maven Central once; nothing when they are there. The object-storage tests do the same
# themselves (tests/support/s3.py, s3_jars; Cluster.up with s3), so CI needs no step of its own.
s3-jars: setup
	$(BIN)/python tools/cluster.py jars

# `t0=$$(date +%s)` at the start of a recipe's shell, then $(call took,PART) at its end.
define took
echo "==> $(1): $$(( $$(date +%s) - t0 )) s" | tee -a $(or $(TIMES_LOG),/dev/null)
endef

# pytest's exit status, with "no tests collected" (5) named as the failure it is.
define pytest_status
if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): failing" >&2; fi
endef

# A suite stopped by its bound (timeout's 124, or 137 after SIGKILL), named as such, and what it
# left running killed and named (tests/support/sweep.py, with the suite's python, $(1)): a
# SIGKILLed pytest never reaches its own leftover check, and its servers run in process groups
# of their own.
define suite_timeout
if [ $$rc -eq 124 ] || [ $$rc -eq 137 ]; then \
	echo "the suite ran past its bound of $(SUITE_SECONDS) s and was stopped (exit $$rc)" >&2; \
	$(1) -m tests.support.sweep suite-$$$$ || true; fi
endef

# .venv: the lock file, synced exactly (uv pip sync), then the project, editable.
$(VENV)/.installed-$(LOCAL_ID):
	@command -v java >/dev/null || { echo "Spark needs Java 17: installing openjdk-17-jre-headless"; \
		apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }
	@set -e; t0=$$(date +%s); set -x; \
	rm -f $(VENV)/.installed*; \
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	test -x $(UV) || $(BIN)/pip install -q "uv==$(UV_VERSION)"; \
	$(UV) pip sync -q --python $(BIN)/python requirements/lock.txt; \
	$(UV) pip install -q --python $(BIN)/python --no-deps -e .; \
	set +x; $(call took,install local)
	touch $@

setup: $(VENV)/.installed-$(LOCAL_ID)

# .venv-petastorm: its lock file (petastorm with everything it asks for: its setuptools<70
# holds torch at 2.12), then the project, editable.
$(PETASTORM_VENV)/.installed-$(PETASTORM_ID): | $(VENV)/.installed-$(LOCAL_ID)
	@set -e; t0=$$(date +%s); set -x; \
	rm -f $(PETASTORM_VENV)/.installed*; \
	test -x $(PETASTORM_BIN)/python || $(PYTHON) -m venv $(PETASTORM_VENV); \
	$(UV) pip sync -q --python $(PETASTORM_BIN)/python $(PETASTORM_LOCK); \
	$(UV) pip install -q --python $(PETASTORM_BIN)/python --no-deps -e .; \
	set +x; $(call took,install petastorm)
	touch $@

setup-petastorm: $(PETASTORM_VENV)/.installed-$(PETASTORM_ID)

# The DBR 17.3 LTS ML-like environment (or 18's, DBR_LOCK): the lock file only, no project
# (test-dbr installs the built wheel into it). pip stays in it: project/test_bundle.py asks pip what
# it would install.
$(DBR_VENV)/.installed-$(DBR_ID): | $(VENV)/.installed-$(LOCAL_ID)
	@set -e; t0=$$(date +%s); set -x; \
	rm -f $(DBR_VENV)/.installed*; \
	test -x $(DBR_BIN)/python || $(PYTHON) -m venv $(DBR_VENV); \
	$(UV) pip sync -q --python $(DBR_BIN)/python $(DBR_LOCK); \
	set +x; $(call took,install $(DBR_NAME))
	touch $@

setup-dbr: $(DBR_VENV)/.installed-$(DBR_ID)

# What test-dbr18 passes to test-dbr: 18's lock file, environment, name and tests.
DBR18 := DBR_LOCK=requirements/dbr-18-ml.txt DBR_VENV=.venv-dbr18 DBR_NAME=dbr18 \
	DBR_TESTS="$(DBR18_TESTS)" DBR_DESELECT= SUITE_SECONDS=$(DBR18_SECONDS_$(TIER))

setup-dbr18:
	@$(MAKE) --no-print-directory setup-dbr $(DBR18)

# .venv-connect: a Spark Connect client with no JVM (`flowers-job run --remote sc://...`):
# requirements/connect-client.txt synced exactly, then the project's wheel with --no-deps
# (its `local` extra would bring pyspark back over pyspark-client: both install the `pyspark`
# package), then a check that the `pyspark` there is the client only. uv venv, not python -m
# venv: it writes a .gitignore into the environment, which keeps it out of git's untracked
# files. The wheel is reinstalled every time (its version does not change with the source):
# CONNECT_WHEEL names it (tests/integration/test_connect_client.py passes the one under test).
$(CONNECT_VENV)/.installed-$(CONNECT_ID): | $(CONNECT_NEEDS)
	@set -e; t0=$$(date +%s); set -x; \
	rm -f $(CONNECT_VENV)/.installed*; \
	test -x $(CONNECT_BIN)/python || $(UV) venv -q --python $(BIN)/python $(CONNECT_VENV); \
	$(UV) pip sync -q --python $(CONNECT_BIN)/python $(CONNECT_LOCK); \
	set +x; $(call took,install connect)
	touch $@

setup-connect: $(CONNECT_VENV)/.installed-$(CONNECT_ID)
	@set -e; t0=$$(date +%s); set -x; \
	wheel="$(CONNECT_WHEEL)"; \
	if [ -z "$$wheel" ]; then \
		ls $(WHEEL_DIR)/flowers_job-*.whl >/dev/null 2>&1 || \
			$(UV) build -q --wheel --out-dir $(WHEEL_DIR) .; \
		wheel=$$(ls $(WHEEL_DIR)/flowers_job-*.whl | head -1); \
	fi; \
	$(UV) pip install -q --python $(CONNECT_BIN)/python --no-deps --reinstall "$$wheel"; \
	$(CONNECT_BIN)/python -c "from pyspark.util import is_remote_only; \
		assert is_remote_only(), 'the pyspark in $(CONNECT_VENV) is not pyspark-client'"; \
	set +x; $(call took,install wheel connect)

ifeq ($(LOADER),petastorm)
run: setup-petastorm
	$(PETASTORM_BIN)/flowers-job run --images $(PHOTOS) --output-dir $(OUT) \
		--set data.loader=petastorm $(ARGS)
else
run: setup
	$(BIN)/flowers-job run --images $(PHOTOS) --output-dir $(OUT) \
		$(if $(LOADER),--set data.loader=$(LOADER)) $(ARGS)
endif

# ruff, its formatter, and the import rules (import-linter's contracts in pyproject.toml).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: setup
	$(BIN)/mypy

# A private mount namespace can be made here (root, unshare): the suites run side by side.
ISOLATE := $(shell [ "$$(id -u)" = 0 ] && unshare --mount --propagation private true 2>/dev/null && echo 1)

# The gate: what every landing runs (.ci/run), the README's test command.
test:
	@$(MAKE) --no-print-directory tier TIER=gate

# Everything; when it is green, .ci/full-pass records the commit, the date, the seconds and
# the CPU (tools/ci_tier.py record), and .ci/run trusts it for a day (docs/testing.md).
test-full:
	@t0=$$(date +%s); $(MAKE) --no-print-directory tier TIER=full && \
	$(PYTHON) tools/ci_tier.py record $$(( $$(date +%s) - t0 ))

# One tier (TIER): lint and types first (seconds), then the DBR environment and the wheel in
# it, then both suites: side by side where the DBR suite can have its own /dev/shm
# (ISOLATE), else one after the other. The measurement behind running them together:
# docs/testing.md.
tier: lint typecheck
	@$(MAKE) --no-print-directory wheel-dbr
ifeq ($(ISOLATE),1)
	@$(MAKE) --no-print-directory -j2 -k -O local-side dbr-side $(QUEUED_GOALS_$(TIER)) \
		LOCAL_IGNORE="$(DBR_ONLY) container cluster" LOCAL_DESELECT="$(DBR_ONLY_TESTS)"
else
	@$(MAKE) --no-print-directory local-side LOCAL_IGNORE="$(DBR_ONLY) container cluster" \
		LOCAL_DESELECT="$(DBR_ONLY_TESTS)"
	@$(MAKE) --no-print-directory dbr-side $(QUEUED_GOALS_$(TIER))
endif

# The Petastorm suite and the Databricks Runtime 18 tests: in the gate (one job each) on the
# DBR side, after the 17.3 suite and the cluster's; in the full tier (every Petastorm test,
# 13 min, and 18's smoke job, 5 min) the third and fourth goals of the two-slot make, each
# started in whichever slot frees first: Petastorm after the DBR side, 18 after the local
# suite, so that both slots end within a minute or two of each other (docs/testing.md). The
# make keeps going (-k), so that they start even when a side before them failed.
PETASTORM_SIDE_gate := dbr
DBR18_SIDE_gate := dbr
QUEUED_GOALS_full := petastorm-side dbr18-side

# The local side: the local suite.
local-side:
	@$(MAKE) --no-print-directory test-local

petastorm-side:
	@$(MAKE) --no-print-directory test-petastorm

dbr18-side:
	@if [ "$(SMOKE_DBR18)" = 1 ]; then $(MAKE) --no-print-directory test-dbr18 BUILD_WHEEL=0; fi

# The DBR side of `make test`: the 17.3 suite, the netns cluster's tests, then (the gate) the
# 18 tests (SMOKE_DBR18) with the wheel that wheel-dbr built and the Petastorm suite, then
# (the full tier) the container tests; what it costs CI: docs/testing.md. Each runs
# whatever the others' results; the side fails if any does.
dbr-side:
	@rc=0; $(MAKE) --no-print-directory dbr-suite || rc=$$?; \
	$(MAKE) --no-print-directory test-cluster || rc=$$?; \
	if [ "$(SMOKE_DBR18)" = 1 ] && [ "$(DBR18_SIDE_$(TIER))" = dbr ]; then \
		$(MAKE) --no-print-directory test-dbr18 BUILD_WHEEL=0 || rc=$$?; fi; \
	if [ "$(PETASTORM_SIDE_$(TIER))" = dbr ]; then \
		$(MAKE) --no-print-directory test-petastorm || rc=$$?; fi; \
	if [ "$(TIER)" = full ]; then \
		$(MAKE) --no-print-directory test-container || rc=$$?; fi; exit $$rc

test-local: setup
	@t0=$$(date +%s); rc=0; mkdir -p $(REPORTS); set -x; \
	wheel=$$(ls $(WHEEL_DIR)/flowers_job-*.whl 2>/dev/null | head -1); \
	FLOWERS_TEST_LOADERS=$(LOCAL_LOADERS) FLOWERS_WHEEL=$$wheel \
	$(SUITE_TIMEOUT) $(BIN)/python -m pytest --tier $(TIER) --maxfail $(MAXFAIL) --durations=0 \
		--junitxml=$(REPORTS)/junit-local.xml $(addprefix --ignore=tests/,$(LOCAL_IGNORE)) \
		$(addprefix --deselect tests/,$(LOCAL_DESELECT)) || rc=$$?; \
	set +x; $(call took,tests local); $(call pytest_status); $(call suite_timeout,$(BIN)/python); exit $$rc

# The netns cluster's tests (tests/cluster: spark-submit and a Spark Connect server on hosts
# in network namespaces, tools/cluster.py) in .venv, a suite of their own so that they can run
# on the DBR side (a third of the local suite's time in the full tier, docs/testing.md); with
# ISOLATE in a mount namespace with its own /dev/shm, like the DBR suite, which the hosts'
# processes inherit.
test-cluster: SUITE_SECONDS = $(CLUSTER_SECONDS_$(TIER))
test-cluster: setup
	@t0=$$(date +%s); rc=0; mkdir -p $(REPORTS); \
	wrap=""; if [ "$(ISOLATE)" = 1 ]; then wrap=$(CURDIR)/tools/own_shm.sh; fi; set -x; \
	FLOWERS_TEST_LOADERS=$(LOCAL_LOADERS) $(SUITE_TIMEOUT) $$wrap $(BIN)/python -m pytest \
		--tier $(TIER) --maxfail $(MAXFAIL) --durations=0 \
		--junitxml=$(REPORTS)/junit-cluster.xml tests/cluster || rc=$$?; \
	set +x; $(call took,tests cluster); $(call pytest_status); $(call suite_timeout,$(BIN)/python); exit $$rc

# The Petastorm suite in .venv-petastorm (PETASTORM_TESTS, PETASTORM_SELECT), its loader's
# tests only (FLOWERS_TEST_LOADERS=petastorm).
test-petastorm: SUITE_SECONDS = $(PETASTORM_SECONDS_$(TIER))
test-petastorm: setup-petastorm
	@t0=$$(date +%s); rc=0; mkdir -p $(REPORTS); set -x; \
	FLOWERS_TEST_LOADERS=petastorm $(SUITE_TIMEOUT) $(PETASTORM_BIN)/python -m pytest \
		--tier $(TIER) --maxfail $(MAXFAIL) --durations=0 --junitxml=$(REPORTS)/junit-petastorm.xml $(PETASTORM_SELECT_$(TIER)) \
		$(addprefix tests/,$(PETASTORM_TESTS_$(TIER))) || rc=$$?; \
	set +x; $(call took,tests petastorm); $(call pytest_status); $(call suite_timeout,$(PETASTORM_BIN)/python); exit $$rc

# Build the wheel (as the bundle's artifact does; BUILD_WHEEL=0 takes the one in WHEEL_DIR)
# and install it into .venv-dbr with its [streaming] extra, from the lock file's packages
# only (--no-index): the wheel's requirements must be met by the runtime's versions without
# fetching or changing anything.
wheel-dbr: setup-dbr
	@set -e; t0=$$(date +%s); set -x; \
	if [ "$(BUILD_WHEEL)" != 0 ] || ! ls $(WHEEL_DIR)/flowers_job-*.whl >/dev/null 2>&1; then \
		rm -rf $(WHEEL_DIR) build; \
		$(DBR_BIN)/python -m build --wheel --outdir $(WHEEL_DIR) . >/dev/null; \
	fi; \
	$(DBR_BIN)/pip uninstall -q -y flowers-job; \
	$(DBR_BIN)/pip install -q --no-index "$$(ls $(WHEEL_DIR)/flowers_job-*.whl)[streaming]"; \
	$(DBR_BIN)/pip check; \
	set +x; $(call took,build and install wheel $(DBR_NAME))

test-dbr: wheel-dbr
	@$(MAKE) --no-print-directory dbr-suite

# The Databricks Runtime 18 ML smoke job: test-dbr in .venv-dbr18 with DBR18_TESTS.
test-dbr18:
	@$(MAKE) --no-print-directory test-dbr $(DBR18)

# The DBR suite against the wheel that wheel-dbr installed. The tests run from a copy of
# tests/ in a temp dir, so that neither pytest nor the processes it starts
# (TorchDistributor's `python -m torch.distributed.run` children, the CLI runs) can import
# the repo's flowers_job/ source instead of the installed wheel; FLOWERS_REPO_ROOT points
# project/test_bundle.py at the repo's deployment files, FLOWERS_WHEEL at the wheel under test,
# FLOWERS_UV at .venv's uv (project/test_clean_install.py's; the DBR environment has none).
# With ISOLATE, pytest runs in a new mount namespace with a tmpfs on /dev/shm and TMPDIR in
# the run's folder: Mosaic Streaming's shared memory and lock files, and every check of
# them, are this suite's alone.
dbr-suite:
	@set -e; t0=$$(date +%s); rc=0; mkdir -p $(REPORTS); \
	run=$$(mktemp -d); trap 'rm -rf "$$run"' EXIT; \
	cp -r tests configs pyproject.toml "$$run"/; \
	find "$$run" -name __pycache__ -prune -exec rm -rf {} +; \
	mkdir "$$run/tmp"; \
	wrap=""; if [ "$(ISOLATE)" = 1 ]; then export TMPDIR="$$run/tmp"; wrap=$(CURDIR)/tools/own_shm.sh; fi; \
	cd "$$run"; set -x; \
	$(DBR_BIN)/python -c "import flowers_job, pathlib, sysconfig; f = pathlib.Path(flowers_job.__file__).resolve(); site = pathlib.Path(sysconfig.get_paths()['purelib']).resolve(); assert site in f.parents, f'flowers_job is imported from {f}, not from the installed wheel in {site}'; print('flowers_job from', f)"; \
	FLOWERS_TEST_LOADERS=streaming FLOWERS_EXPECT_WHEEL=1 \
	FLOWERS_PHOTOS=$(abspath $(PHOTOS)) FLOWERS_REPO_ROOT=$(CURDIR) \
	FLOWERS_WHEEL="$$(ls $(abspath $(WHEEL_DIR))/flowers_job-*.whl)" FLOWERS_UV=$(abspath $(UV)) \
	$(SUITE_TIMEOUT) $$wrap $(DBR_BIN)/python -m pytest -p no:cacheprovider --tier $(TIER) \
		--maxfail $(MAXFAIL) --durations=0 \
		--junitxml=$(REPORTS)/junit-$(DBR_NAME).xml $(addprefix tests/,$(DBR_TESTS)) \
		$(addprefix --deselect tests/,$(DBR_DESELECT)) || rc=$$?; \
	set +x; $(call took,tests $(DBR_NAME)); $(call pytest_status); $(call suite_timeout,$(DBR_BIN)/python); exit $$rc

clean:
	rm -rf output reports .pytest_cache .mypy_cache .ruff_cache dist build
