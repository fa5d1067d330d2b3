"""The MLflow runs of an output dir, and what became of the ones still marked RUNNING.

Driver side, no Spark. A run's MLflow status is what its processes last told the store. A
driver killed with SIGKILL (or a machine lost) tells it nothing: its ranks exit
(:func:`flowers_job.runtime.parent_watch.watch_driver`), no process is left to end the run, and MLflow
shows it RUNNING forever. So the driver of each training records itself in
``<checkpoint_dir>/driver.json`` (:func:`record_driver`); before a ``--resume`` continues
the run, :func:`end_abandoned_run` ends a run whose driver is gone FAILED, with the cause
in the ``flowers_job.failure`` tag; and ``flowers-job runs`` (:func:`list_runs`) shows
such a run as ``ABANDONED`` until then.

MLflow, and the modules that import torch (:mod:`flowers_job.tracking.mlflow_run`,
:mod:`flowers_job.train.checkpoint`), are imported by the functions that need them.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from flowers_job.location import Location
from flowers_job.runtime.parent_watch import driver_identity, process_alive

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion

__all__ = [
    "ABANDONED",
    "DRIVER_FILE_NAME",
    "RESTARTS_METRIC",
    "UNKNOWN",
    "end_abandoned_run",
    "format_runs",
    "list_runs",
    "read_driver",
    "record_driver",
]

DRIVER_FILE_NAME = "driver.json"
"""Next to the checkpoint: the driver of the latest training, :func:`record_driver`'s."""
RESTARTS_METRIC = "restarts"
"""The metric that counts a run's automatic restarts (its last value is listed)."""
ABANDONED = "ABANDONED"
"""State of a run MLflow shows RUNNING that no driver runs any more."""
UNKNOWN = "UNKNOWN"
"""State of the current run, RUNNING in MLflow, whose driver cannot be checked from here
(it ran on another host, or was not recorded)."""

log = logging.getLogger(__name__)


def _iso(seconds: float | None) -> str | None:
    """Seconds since the epoch -> ISO 8601 in UTC, to the second."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds")


def record_driver(checkpoint_dir: Location | Path) -> None:
    """Record this process as the driver of the training that starts now:
    ``<checkpoint_dir>/driver.json`` holds :func:`~flowers_job.runtime.parent_watch.driver_identity`
    (``host``, ``pid``, ``create_time``) and ``started`` (ISO 8601, UTC), written atomically
    (temporary file + rename). Call it after :func:`end_abandoned_run`, which reads the
    previous driver's record.

    Raises:
        OSError: the directory cannot be created or written.
    """
    record = {**driver_identity(), "started": _iso(time.time())}
    (Location.of(checkpoint_dir) / DRIVER_FILE_NAME).write_text(json.dumps(record))


def read_driver(checkpoint_dir: Location | Path) -> dict[str, Any] | None:
    """The record of :func:`record_driver`, or None if there is none (or it is unreadable)."""
    try:
        record = json.loads((Location.of(checkpoint_dir) / DRIVER_FILE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not {"host", "pid", "create_time"} <= record.keys():
        return None
    return record


def _driver_state(driver: dict[str, Any] | None) -> str:
    """``"alive"``, ``"self"`` (this very process), ``"gone"``, ``"elsewhere"`` (another
    host: cannot be checked) or ``"unrecorded"``."""
    if driver is None:
        return "unrecorded"
    if driver["host"] != socket.gethostname():
        return "elsewhere"
    if not process_alive(driver):
        return "gone"
    me = driver_identity()
    if (
        int(driver["pid"]) == me["pid"]
        and abs(float(driver["create_time"]) - me["create_time"]) < 1
    ):
        return "self"
    return "alive"


def _describe(driver: dict[str, Any]) -> str:
    return f"pid {driver['pid']} on host {driver['host']}, started {driver.get('started', '?')}"


def _cause(driver: dict[str, Any] | None, state: str, continued_by: str | None) -> str:
    """The ``flowers_job.failure`` tag of a run taken over from a driver in ``state``."""
    if driver is None:
        what = (
            f"its driver was not recorded (no {DRIVER_FILE_NAME}) and is taken to have "
            "ended without ending the run"
        )
    elif state == "elsewhere":
        what = (
            f"its driver ({_describe(driver)}) ran on another host, which host "
            f"{socket.gethostname()} cannot check, and is taken to have ended without "
            "ending the run"
        )
    elif state == "self":
        what = (
            f"an earlier training of this driver ({_describe(driver)}) ended without ending the run"
        )
    else:
        what = (
            f"its driver ({_describe(driver)}) ended without ending the run "
            "(SIGKILL, or the machine lost)"
        )
    then = f"continued by {continued_by}" if continued_by else "a new run replaces it"
    return f"interrupted: {what}; {then}"


def end_abandoned_run(
    checkpoint_dir: Location | Path, tracking_uri: str, *, continued_by: str | None = "--resume"
) -> str | None:
    """Before a training continues the MLflow run of ``<checkpoint_dir>/mlflow_run.json``:
    if that run is still RUNNING and the driver recorded in ``driver.json`` is gone, end it
    FAILED, the cause in the ``flowers_job.failure`` tag
    (:func:`flowers_job.tracking.mlflow_run.mark_run_failed`: never raises, 5 s per request), and log
    a WARNING. A driver on another host cannot be checked, nor one that was not recorded:
    such a run is taken over too, and the cause says so. A recorded driver that still runs
    on this host is another training in the same output dir: its run is left as it is
    (logged). Call it before :func:`record_driver`.

    Args:
        checkpoint_dir: ``paths.checkpoint_dir``.
        tracking_uri: the MLflow store (``JobConfig.tracking_uri``).
        continued_by: what continues the run, for the cause (``"--resume"``, ``"an
            automatic restart"``); None: nothing, a new run starts in the output dir
            (call it before the new run removes ``mlflow_run.json``).

    Returns:
        The cause if the run was marked FAILED, else None.
    """
    from flowers_job.tracking.mlflow_run import mark_run_failed
    from flowers_job.train.checkpoint import read_run_id

    run_id = read_run_id(checkpoint_dir)
    if run_id is None or _store_missing(tracking_uri):
        return None
    driver = read_driver(checkpoint_dir)
    state = _driver_state(driver)
    if state == "alive":
        assert driver is not None
        log.warning(
            "the driver of %s (%s) still runs: its MLflow run %s is left as it is, and two "
            "trainings in one output dir race for its checkpoint",
            checkpoint_dir,
            _describe(driver),
            run_id,
        )
        return None
    cause = _cause(driver, state, continued_by)
    if not mark_run_failed(tracking_uri, run_id, cause):
        return None
    log.warning("MLflow run %s ended FAILED: %s", run_id, cause)
    return cause


def _store_missing(tracking_uri: str) -> bool:
    """A local store (``sqlite:``, ``file:``, a bare path) that does not exist: opening it
    would create it."""
    url = urlparse(tracking_uri)
    if url.scheme == "sqlite":
        path = tracking_uri.removeprefix("sqlite:///")
        return path not in ("", ":memory:") and not Path(path).exists()
    if url.scheme in ("", "file"):
        return not Path(url.path if url.scheme else tracking_uri).exists()
    return False


def _runs_of(client: MlflowClient, experiment_id: str, output_dir: str) -> list[Run]:
    """The runs of ``experiment_id`` tagged with ``output_dir``, newest first."""
    from flowers_job.tracking.tags import TAG_OUTPUT_DIR

    # A quote cannot be escaped in MLflow's filter grammar: such a path is matched here.
    where = f"tags.`{TAG_OUTPUT_DIR}` = '{output_dir}'" if "'" not in output_dir else ""
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=where,
            order_by=["attributes.start_time DESC"],
            max_results=1000,
            page_token=token,
        )
        runs += [r for r in page if r.data.tags.get(TAG_OUTPUT_DIR) == output_dir]
        token = page.token
        if not token:
            return runs


def _state(status: str, current: bool, driver_state: str) -> str:
    """The truth about a run: MLflow's status, unless it says RUNNING and no driver runs it."""
    if status != "RUNNING":
        return status
    if not current:  # the output dir has moved on to another run
        return ABANDONED
    return {"alive": "RUNNING", "self": "RUNNING", "gone": ABANDONED}.get(driver_state, UNKNOWN)


def _model_versions(client: MlflowClient, run_id: str) -> list[ModelVersion]:
    """The model versions registered from ``run_id``, oldest first; none where the
    registry cannot be searched by run (logged)."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.search_model_versions(f"run_id = '{run_id}'")
    except MlflowException as exc:
        log.info("model versions of run %s not searched: %s", run_id, exc)
        return []
    return sorted(found, key=lambda v: v.creation_timestamp or 0)


def _run_record(client: MlflowClient, run: Run, current: bool, driver_state: str) -> dict[str, Any]:
    from flowers_job.tracking.mlflow_run import EPOCH_KEY, FAILURE_TAG

    info = run.info
    epochs = sorted({m.step for m in client.get_metric_history(info.run_id, EPOCH_KEY)})
    versions = _model_versions(client, info.run_id)
    restarts = run.data.metrics.get(RESTARTS_METRIC)
    return {
        "run_id": info.run_id,
        "run_name": info.run_name,
        "state": _state(info.status, current, driver_state),
        "status": info.status,
        "start_time": _iso(info.start_time / 1000 if info.start_time else None),
        "end_time": _iso(info.end_time / 1000 if info.end_time else None),
        "epochs": epochs,
        "restarts": int(restarts) if restarts is not None else 0,
        "failure": run.data.tags.get(FAILURE_TAG),
        "registered_model_name": versions[-1].name if versions else None,
        "registered_model_version": int(versions[-1].version) if versions else None,
        "current": current,
    }


def list_runs(
    output_dir: Location | Path, tracking_uri: str, experiment_name: str
) -> list[dict[str, Any]]:
    """The MLflow runs of ``output_dir``: every run of ``experiment_name`` tagged
    ``flowers_job.output_dir`` = the resolved ``output_dir``, newest first. Never creates
    a store or an experiment: a local store that does not exist, or no such experiment,
    gives no runs.

    Each run is a dict: ``run_id``, ``run_name``, ``status`` (MLflow's), ``state`` (the
    truth: ``RUNNING`` only for the output dir's current run whose recorded driver is alive
    on this host; :data:`ABANDONED` for a RUNNING run whose driver is gone or that is not
    the current run; :data:`UNKNOWN` for the current RUNNING run whose driver cannot be
    checked; else ``status``), ``start_time`` and ``end_time`` (ISO 8601, UTC, or None),
    ``epochs`` (the steps of ``val_loss`` logged, ascending), ``restarts`` (the last value
    of :data:`RESTARTS_METRIC`, 0 without one), ``failure`` (the ``flowers_job.failure``
    tag or None), ``registered_model_name`` and ``registered_model_version`` (the newest
    model version registered from the run, or None) and ``current`` (the run of
    ``checkpoints/mlflow_run.json``).

    Raises:
        TrackingError: the store cannot be used; the message names ``tracking.tracking_uri``.
    """
    from flowers_job.tracking.credentials import fail_fast, store_client
    from flowers_job.tracking.mlflow_run import PREFLIGHT_TIMEOUT_SECONDS, TrackingError
    from flowers_job.train.checkpoint import read_run_id

    if _store_missing(tracking_uri):
        return []
    output_dir = Location.of(output_dir)
    checkpoint_dir = output_dir / "checkpoints"
    current_id = read_run_id(checkpoint_dir)
    driver_state = _driver_state(read_driver(checkpoint_dir))
    try:
        with fail_fast(PREFLIGHT_TIMEOUT_SECONDS), store_client(tracking_uri) as client:
            experiment = client.get_experiment_by_name(experiment_name)
            if experiment is None:
                return []
            runs = _runs_of(client, experiment.experiment_id, str(output_dir))
            return [
                _run_record(client, run, run.info.run_id == current_id, driver_state)
                for run in runs
            ]
    except Exception as exc:
        raise TrackingError(
            f"tracking.tracking_uri: the MLflow store {tracking_uri} cannot be used: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``; ``"-"`` for none."""
    groups: list[list[int]] = []
    for step in steps:
        if groups and step == groups[-1][-1] + 1:
            groups[-1].append(step)
        else:
            groups.append([step])
    return ",".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups) or "-"


FAILURE_COLUMN_CHARS = 80
"""The table shows the first line of a run's failure cut to this many characters."""


def format_runs(runs: list[dict[str, Any]]) -> str:
    """:func:`list_runs`'s runs as an aligned table, one line per run; ``*`` marks the
    current run. Times in UTC."""
    header = (
        "",
        "RUN ID",
        "NAME",
        "STATE",
        "STARTED (UTC)",
        "ENDED (UTC)",
        "EPOCHS",
        "RESTARTS",
        "MODEL",
        "FAILURE",
    )
    rows = [header]
    for run in runs:
        model = run["registered_model_version"]
        failure = (run["failure"] or "").split("\n")[0]
        if len(failure) > FAILURE_COLUMN_CHARS:
            failure = failure[: FAILURE_COLUMN_CHARS - 3] + "..."
        rows.append(
            (
                "*" if run["current"] else "",
                run["run_id"],
                run["run_name"] or "",
                run["state"],
                (run["start_time"] or "-").replace("+00:00", ""),
                (run["end_time"] or "-").replace("+00:00", ""),
                _ranges(run["epochs"]),
                str(run["restarts"]),
                f"{run['registered_model_name']}/{model}" if model is not None else "-",
                failure,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)
