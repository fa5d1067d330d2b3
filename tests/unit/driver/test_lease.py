"""One writer per output (flowers_job/driver/lease.py): the lease on a disk (an OS lock held
by another process, a holder killed with SIGKILL), in a bucket of a real S3 API server
(moto: conditional puts, a stale heartbeat, a dead holder), and the retention that only the
lease allows. No Spark: seconds."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from flowers_job.config import ConfigError, load_config
from flowers_job.driver.lease import (
    LOCK_NAME,
    RECORD_NAME,
    Holder,
    OutputInUseError,
    OutputLease,
    output_lease,
    read_holder,
)
from flowers_job.ingest.retention import is_sole_writer, retention_hours
from flowers_job.location import Location
from tests.support.s3 import S3Store, fresh_bucket, s3_server  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]

HOLD = """
import sys, time
from flowers_job.driver.lease import OutputLease
with OutputLease(sys.argv[1], "run"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills this process)
"""


@pytest.fixture
def holder_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another process holding the lease on ``tmp_path/out`` (a disk), until stdin closes."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"  # bounded by the test's timeout
        yield proc, out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_disk_lease_held_by_another_process_refuses_naming_it(
    holder_process: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, out = holder_process
    before = sorted(p.name for p in out.iterdir())
    assert before == [LOCK_NAME, RECORD_NAME]
    with (
        pytest.raises(OutputInUseError) as err,
        OutputLease(out, "train"),
    ):
        pytest.fail("the lease was granted twice")
    message = str(err.value)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message
    assert "flowers-job run" in message and str(out) in message
    assert err.value.exit_code == 2
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written nor removed
    holder = read_holder(out)
    assert holder is not None and holder.pid == proc.pid
    # the holder ends normally: the output is left as it was found, and the lease is free
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert not out.exists()  # the holder made the folder for its lease and wrote nothing else
    with OutputLease(out, "train") as lease:
        assert read_holder(out) == lease.holder


def test_a_holder_killed_with_sigkill_leaves_a_stale_lease_that_is_taken_over(
    holder_process: tuple[subprocess.Popen[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    proc, out = holder_process
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert read_holder(out) is not None  # its record stays behind; its OS lock does not
    with (
        caplog.at_level(logging.WARNING, logger="flowers_job.driver.lease"),
        OutputLease(out, "ingest") as lease,
    ):
        assert read_holder(out) == lease.holder and lease.holder.pid == os.getpid()
    assert f"took over the stale lease of flowers-job run, pid {proc.pid}" in caplog.text
    assert list(out.iterdir()) == []  # the folder was there before this lease: it stays


def test_the_lease_is_reentrant_in_one_process_and_lets_short_retention_run(
    tmp_path: Path,
) -> None:
    """The CLI holds it, then run_job and run_ingest ask again: the same lease. Only while
    it is held does VACUUM use a retention below Delta's safe minimum."""
    out = tmp_path / "out"
    cfg = load_config(
        None,
        ["data.retention_hours=0", "data.allow_short_retention=true"],
        **{"paths.output_dir": out},
    )
    assert retention_hours(cfg.data, cfg.paths.output_dir) == 168  # no lease: the safe minimum
    with output_lease(out, "run") as outer:
        with output_lease(out, "ingest") as inner:  # the inner one ends first
            assert inner is outer
            assert retention_hours(cfg.data, cfg.paths.output_dir) == 0
        assert is_sole_writer(out) and read_holder(out) == outer.holder
        assert retention_hours(cfg.data, cfg.paths.output_dir) == 0
    assert not is_sole_writer(out) and read_holder(out) is None


def test_retention_below_the_safe_minimum_needs_the_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.retention_hours=24"], **{"paths.output_dir": tmp_path})
    assert "data.retention_hours" in str(err.value)
    assert "data.allow_short_retention=true" in str(err.value)
    cfg = load_config(
        None,
        ["data.retention_hours=24", "data.allow_short_retention=true"],
        **{"paths.output_dir": tmp_path},
    )
    assert cfg.data.retention_hours == 24
    assert load_config(None, [], **{"paths.output_dir": tmp_path}).data.retention_hours == 168


def test_an_object_store_without_conditional_writes_gets_no_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="flowers_job.driver.lease"),
        OutputLease("gs://bucket/out", "run"),
    ):
        pass
    assert "no lease taken on gs://bucket/out" in caplog.text


# -- S3 ------------------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3Store:  # noqa: F811
    """A fresh bucket on the session's moto server, its ``AWS_*`` in the environment (what
    boto3's standard chain reads)."""
    store = fresh_bucket(s3_server)
    for key, value in store.env().items():
        monkeypatch.setenv(key, value)
    return store


def _put(store: S3Store, holder: Holder) -> None:
    store.client().put_object(Bucket=store.bucket, Key=f"out/{RECORD_NAME}", Body=holder.to_json())


def _dead_process() -> tuple[int, float]:
    """The pid and start time (seconds since the epoch) of a process of this host that has
    ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    create_time = psutil.Process(proc.pid).create_time()
    proc.kill()
    proc.wait(timeout=30)
    return proc.pid, create_time


def test_s3_lease_is_a_conditional_put_and_a_second_is_refused_naming_the_holder(
    bucket: S3Store,
) -> None:
    url = bucket.url("out")
    with OutputLease(url, "run") as lease:
        assert bucket.keys() == [f"out/{RECORD_NAME}"]
        stored = Holder.parse(bucket.read(f"out/{RECORD_NAME}"))
        assert stored == lease.holder
        with (
            pytest.raises(OutputInUseError) as err,
            OutputLease(url, "ingest"),
        ):
            pytest.fail("the lease was granted twice")
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(err.value)
        assert Holder.parse(bucket.read(f"out/{RECORD_NAME}")) == stored  # untouched
    assert bucket.keys() == []  # released: deleted


def test_s3_lease_is_renewed_by_its_holder(bucket: S3Store) -> None:
    with OutputLease(bucket.url("out"), "run", heartbeat_seconds=0.2) as lease:
        deadline = time.monotonic() + 30
        while True:
            stored = Holder.parse(bucket.read(f"out/{RECORD_NAME}"))
            assert stored is not None and stored.pid == lease.holder.pid
            if stored.heartbeat > lease.holder.heartbeat:
                break
            assert time.monotonic() < deadline, "the lease was not renewed in 30 s"
            time.sleep(0.1)
    assert bucket.keys() == []


def test_s3_lease_with_an_old_heartbeat_is_taken_over(
    bucket: S3Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder on another host (which this host cannot check) that stopped renewing: stale
    once the object is older than the TTL, by the store's clock."""
    elsewhere = Holder("fl-other-host", 4242, 1.0e9, "2026-01-01T00:00:00+00:00", "run", "x")
    _put(bucket, elsewhere)
    with (
        pytest.raises(OutputInUseError, match="pid 4242 on host fl-other-host"),
        OutputLease(bucket.url("out"), "run", stale_after_seconds=60),
    ):
        pass
    time.sleep(2.5)  # the object ages past a TTL of 1 s (the store counts whole seconds)
    with (
        caplog.at_level(logging.WARNING, logger="flowers_job.driver.lease"),
        OutputLease(bucket.url("out"), "run", stale_after_seconds=1) as lease,
    ):
        assert Holder.parse(bucket.read(f"out/{RECORD_NAME}")) == lease.holder
    assert "took over the stale lease of flowers-job run, pid 4242 on host fl-other-host" in (
        caplog.text
    )
    assert "not renewed for" in caplog.text


def test_s3_lease_of_a_holder_gone_from_this_host_is_taken_over(
    bucket: S3Store, caplog: pytest.LogCaptureFixture
) -> None:
    pid, create_time = _dead_process()
    gone = Holder(socket.gethostname(), pid, create_time, "2026-01-01T00:00:00+00:00", "run", "x")
    _put(bucket, gone)
    with (
        caplog.at_level(logging.WARNING, logger="flowers_job.driver.lease"),
        OutputLease(bucket.url("out"), "train"),
    ):
        record = json.loads(bucket.read(f"out/{RECORD_NAME}"))
        assert record["pid"] == os.getpid() and record["command"] == "train"
    assert f"took over the stale lease of flowers-job run, pid {pid}" in caplog.text
    assert "its process ended" in caplog.text
    assert Location.of(bucket.url("out")).iterdir() == []
