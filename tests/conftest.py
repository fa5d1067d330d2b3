"""Shared fixtures: a real local Spark session with Delta, and samples of the real photos.

The photos are read from ../shared/data/flower_photos (never copied into the repo);
samples are copied into pytest's temp dirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.data import LOADERS, loader_skip_reason, sample_photos
from tests.support.packaging import index_url

pytest_plugins = ["tests.support.leftovers"]
"""At the session's end, no process it started is still alive (docs/testing.md, "Processes
left behind")."""

SHORT_LIVED_JVM = (
    "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC "
    "-XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
)
"""Java options of every Spark driver the tests start (local sessions and the CLI's, through
``SPARK_SUBMIT_OPTS``, which spark-submit adds to the driver's command line): the C1 compiler
only, the serial collector, and no bytecode verification of the (pinned, downloaded) jars'
classes. A test's JVM lives for seconds to minutes, too short for C2's compilations to pay
back on the 2-core machine. Measured 2026-11-24: a local session that writes and counts a
small Delta table, 19.8 CPU-seconds in all processes with the defaults, 10.8 with C1 and the
serial collector, 9.8 without verification too; test_cli_run_local_mode_then_resume[streaming]
152 -> 107 CPU-seconds (C1 and serial), 84 -> 71 s. tools/cluster.py gives the test
cluster's JVMs the same options."""
os.environ.setdefault("SPARK_SUBMIT_OPTS", SHORT_LIVED_JVM)
SESSION_JVM = "-XX:+UseSerialGC -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
"""Java options of the tests' own Spark session (``spark``, one per pytest run): it lives as
long as the suite and runs every in-process ingest and loader cache, so C2's compilations
pay back there. Measured 2026-11-25 (2-core machine): test_ingest, test_incremental and
test_table_checks, 20 tests, 244 s and 235 CPU-seconds in that JVM with
:data:`SHORT_LIVED_JVM`, 209 s and 210 with these options."""


TIERS = ("gate", "full")
"""The test tiers (docs/testing.md): ``gate``, what ``make test`` runs on every landing, and
``full``, what only ``make test-full`` adds. A test's tier is its closest
``pytest.mark.tier(...)``: a test's own mark, else its class's, else its module's
``pytestmark``."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=TIERS,
        default="full",
        help="gate: only the tests marked tier('gate'); full (default): every test",
    )


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def tier_of(item: pytest.Item) -> str | None:
    """``item``'s tier: the first argument of its closest ``tier`` mark (None: unmarked)."""
    mark = item.get_closest_marker("tier")
    return str(mark.args[0]) if mark is not None and mark.args else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test has a tier (else the run stops before any test, naming the tests); with
    ``--tier gate`` the others are deselected."""
    wrong = [f"{item.nodeid} ({tier_of(item)})" for item in items if tier_of(item) not in TIERS]
    if wrong:
        raise pytest.UsageError(
            f"tests without a tier (pytest.mark.tier('gate') or 'full'): {', '.join(wrong[:20])}"
        )
    if config.getoption("tier") != "gate":
        return
    keep = [item for item in items if tier_of(item) == "gate"]
    dropped = [item for item in items if tier_of(item) != "gate"]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Under ``.ci/run``: the lowest memory and free disk seen so far in the run (its
    ``tools/resources.py`` log, ``FLOWERS_RESOURCES_LOG``), beside the failures they may
    explain."""
    log = os.environ.get("FLOWERS_RESOURCES_LOG")
    if not log:
        return
    root = REPO
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "resources.py"), "report", log],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    for line in (proc.stdout + proc.stderr).splitlines():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def pypi() -> None:
    """Skip, naming why, when the package index cannot be reached (offline machine)."""
    url = f"{index_url()}/pip/"
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            response.read(1)
    except OSError as exc:
        pytest.skip(f"the package index {url} cannot be reached: {exc}")


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Local Spark with 2 task slots (barrier mode needs one per training process). Its
    session catalog (``spark_catalog``, in memory) keeps managed tables under a temp
    ``spark.sql.warehouse.dir``, not ``./spark-warehouse``."""
    from flowers_job.cluster.session import get_spark

    short = os.environ.get("SPARK_SUBMIT_OPTS")
    os.environ["SPARK_SUBMIT_OPTS"] = SESSION_JVM
    warehouse = tmp_path_factory.mktemp("warehouse")
    try:
        session = get_spark(
            "flowers_job_tests",
            master="local[2]",
            conf={"spark.sql.warehouse.dir": str(warehouse)},
        )
    finally:  # the CLI runs' drivers, the test cluster's JVMs: short-lived
        if short is None:
            os.environ.pop("SPARK_SUBMIT_OPTS", None)
        else:
            os.environ["SPARK_SUBMIT_OPTS"] = short
    yield session
    session.stop()


@pytest.fixture(scope="session")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``sc://127.0.0.1:<port>`` of one real Spark Connect server for the whole session
    (``local[2]``, Delta, this interpreter's Python workers: :mod:`tests.support.connect`).
    Skipped where the client cannot import pyspark's Connect module (no grpcio: the DBR
    17.3 environment)."""
    pytest.importorskip("grpc", reason="Spark Connect's client needs grpcio")
    from tests.support.connect import connect_server

    with connect_server(tmp_path_factory.mktemp("connect")) as server:
        yield server.url


@pytest.fixture(scope="session")
def connect_client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """``.venv-connect/bin``: a Spark Connect client with no JVM (``pyspark-client`` and the
    wheel under test, ``make setup-connect``); skipped where it cannot be built
    (:func:`tests.support.connect.client_bin`)."""
    from tests.support.connect import client_bin

    return client_bin(request, tmp_path_factory)


@pytest.fixture(scope="session")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A class-balanced sample of the real photos: 12 per label, 60 in all."""
    return sample_photos(tmp_path_factory.mktemp("photos"), per_label=12)


@pytest.fixture(scope="session")
def tables(spark: object, photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output dir holding the four Delta tables of ``photos`` ingested at 32 px, shared by
    the tests that prepare loader caches from them (each cache lives in its own run folder)."""
    from flowers_job.config import load_config
    from flowers_job.ingest.job import ingest

    out = tmp_path_factory.mktemp("tables32")
    cfg = load_config(
        None, ["data.image_size=32"], **{"data.images": photos, "paths.output_dir": out}
    )
    ingest(spark, cfg)  # type: ignore[arg-type]
    return out


@pytest.fixture(params=LOADERS)
def loader(request: pytest.FixtureRequest) -> str:
    """Each loader in turn (``data.loader=...``), skipped with the reason where it cannot run
    on this stack or is not selected."""
    name = str(request.param)
    reason = loader_skip_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return name


@pytest.fixture(autouse=True)
def _restore_tracking_credentials() -> Iterator[None]:
    """The MLflow preflight exports the configured credentials into this process's
    environment (the training processes inherit them); every test starts from the
    environment the previous one found, so that none sees another's credentials."""
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
