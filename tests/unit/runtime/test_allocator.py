"""The allocator settings: what the driver sets, what reaches Spark, what a process reports.

The end-to-end tests check that real ranks start with them (both ``local_mode`` values),
and the cluster test that a cluster's executors pass them on; these check the pieces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowers_job.runtime.allocator import (
    ALLOCATOR_ENV,
    allocator_report,
    apply_to_environ,
    spark_conf,
    tune_this_process,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.tier("gate")]


def test_the_driver_sets_the_variables_and_keeps_the_users() -> None:
    env = {"MALLOC_TRIM_THRESHOLD_": "12345"}
    assert apply_to_environ(env) == {**ALLOCATOR_ENV, "MALLOC_TRIM_THRESHOLD_": "12345"}
    assert env["MALLOC_MMAP_MAX_"] == "0"
    conf = spark_conf(env)
    assert conf["spark.executorEnv.MALLOC_TRIM_THRESHOLD_"] == "12345"
    assert conf["spark.executorEnv.MALLOC_MMAP_MAX_"] == "0"


def test_a_process_reports_the_environment_it_started_with() -> None:
    """``allocator_report`` reads ``/proc/self/environ``: what glibc read at start-up, not a
    later change to ``os.environ``."""
    code = (
        "import os, json; os.environ['MALLOC_TOP_PAD_'] = 'changed'; "
        "from flowers_job.runtime.allocator import allocator_report; print(json.dumps(allocator_report()))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    started = {**env, "MALLOC_MMAP_MAX_": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=started, check=True, capture_output=True, timeout=30
    )
    report = json.loads(out.stdout)
    assert report == {
        "allocator": "glibc",
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": "unset",
        "MALLOC_TOP_PAD_": "unset",
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_running_process_can_be_tuned_with_mallopt() -> None:
    assert allocator_report()["allocator"] == "glibc"
    assert tune_this_process() is True
