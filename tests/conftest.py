"""Shared fixtures: a real local Spark session with Delta, and samples of the real photos.

The photos are read from ../shared/data/flower_photos (never copied into the repo);
samples are copied into pytest's temp dirs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

PHOTOS = Path(
    os.environ.get(
        "FLOWERS_PHOTOS", Path(__file__).resolve().parents[2] / "shared" / "data" / "flower_photos"
    )
)
LABELS = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
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
LOADERS = ("petastorm", "streaming")
SELECTED_LOADERS = tuple(
    name.strip()
    for name in os.environ.get("FLOWERS_TEST_LOADERS", ",".join(LOADERS)).split(",")
    if name.strip()
)
"""Loaders the loader-parametrized tests run with: ``FLOWERS_TEST_LOADERS`` (comma-separated),
all of them by default. CI runs petastorm in the local stack and streaming in the DBR 17.3
environment, so that each loader's end-to-end and fault tests run once."""


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
    root = Path(os.environ.get("FLOWERS_REPO_ROOT") or Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "resources.py"), "report", log],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    for line in (proc.stdout + proc.stderr).splitlines():
        terminalreporter.write_line(line)


def run_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m flowers_job ARGS`` as a user runs it; output captured, never raises on exit."""
    return subprocess.run(
        [sys.executable, "-m", "flowers_job", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def index_url() -> str:
    """The package index pip (and uv, in tests/test_clean_install.py) resolve against."""
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def uv_bin() -> str:
    """``FLOWERS_UV`` (the DBR suite's: its environment, like the runtime, has no uv), else
    the uv of this environment (requirements/lock.txt has it)."""
    given = os.environ.get("FLOWERS_UV")
    if given:
        return given
    uv = pytest.importorskip("uv", reason="uv is not installed (requirements/lock.txt has it)")
    return str(uv.find_uv_bin())


def uv_failure(stderr: str) -> str:
    """uv's own error lines (``error:``, ``cause:``, ``hint:``) and any exception line of a
    build backend first, then the tail of ``stderr``: a failed sdist build prints its
    backend's whole output between uv's error and its hint, so the tail alone can miss the
    cause (a full disk, a failed download, the backend's exit status)."""
    cause = re.compile(r"^(error:|cause:|hint:|[\w.]*(Error|Exception)\b)")
    own = [line.strip() for line in stderr.splitlines() if cause.match(line.strip())]
    return " | ".join(own) + f"\n{stderr[-4000:]}"


def clean_env() -> dict[str, str]:
    """This process's environment less what would point a child at another environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if "PIP_INDEX_URL" in os.environ:  # a mirror: uv resolves against the same index
        env["UV_DEFAULT_INDEX"] = index_url()
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return env


@pytest.fixture(scope="session")
def pypi() -> None:
    """Skip, naming why, when the package index cannot be reached (offline machine)."""
    url = f"{index_url()}/pip/"
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            response.read(1)
    except OSError as exc:
        pytest.skip(f"the package index {url} cannot be reached: {exc}")


def sample_photos(dest: Path, per_label: int, offset: int = 0) -> Path:
    """Copy ``per_label`` photos of each label (sorted by name, from ``offset``) into ``dest``."""
    if not PHOTOS.is_dir():
        pytest.fail(f"the real photos are missing: {PHOTOS} (set FLOWERS_PHOTOS)")
    for label in LABELS:
        (dest / label).mkdir(parents=True, exist_ok=True)
        for src in sorted((PHOTOS / label).glob("*.jpg"))[offset : offset + per_label]:
            shutil.copy2(src, dest / label / src.name)
    return dest


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


MARK_ENV = "FLOWERS_JOB_TEST_MARK"
"""Set to a fresh value in a CLI driver's environment, so that every process it starts (its
JVM, Spark's Python workers, the ranks), whatever their parent, can be found."""


def marked_processes(mark: str) -> list[psutil.Process]:
    """Every process (any parent) whose environment carries ``MARK_ENV=mark``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK_ENV) == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def copy_tables(tables: Path, out: Path) -> Path:
    """``out`` (an output dir) holding a copy of the Delta tables of ``tables``, for a test
    that trains on them without ingesting again: a Delta table's paths are relative to its
    folder, so a copied folder is the same table (same versions and commit metadata)."""
    shutil.copytree(tables / "tables", out / "tables")
    return out


def loader_skip_reason(name: str) -> str | None:
    """Why the tests of loader ``name`` do not run here (None: they do)."""
    from flowers_job.loaders import loader_problem

    problem = loader_problem(name)
    if problem is not None:
        return f"data.loader={name} cannot run on this stack: {problem}"
    if name not in SELECTED_LOADERS:
        return f"FLOWERS_TEST_LOADERS={','.join(SELECTED_LOADERS)} leaves out {name}"
    return None


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


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server a test started: SIGTERM, then SIGKILL after 30 s (bounded waits)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
