"""MLflow: experiment preflight on the driver; run, metrics and model from rank 0 only.

The driver checks the store and creates the experiment before any worker starts
(:func:`preflight`), failing within seconds when the store cannot be used. Rank 0 then
owns one MLflow run (:class:`RunTracker`): params once, metrics per epoch with
``step=epoch``, the test report and the lineage; the model itself is logged into that run
and registered by :func:`flowers_job.serving.registration.log_pyfunc_model` (this package
imports nothing of ``serving/``). A resumed run continues the same MLflow run and logs no
param and no epoch twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import environment_variables as mlflow_env

from flowers_job.config import JobConfig, TrackingConfig
from flowers_job.errors import TrackingError
from flowers_job.tracking.class_report import TestReport
from flowers_job.tracking.credentials import fail_fast, redact, store_client
from flowers_job.tracking.tags import (
    TAG_FINGERPRINT,
    TAG_IMAGES_TABLE,
    TAG_IMAGES_VERSION,
    TAG_OUTPUT_DIR,
    TAG_TEST_SPLIT,
    TAG_VERSION,
)

__all__ = [
    "EPOCH_KEY",
    "FAILURE_TAG",
    "PREFLIGHT_TIMEOUT_SECONDS",
    "RunTracker",
    "TrackingError",
    "end_failed_run",
    "flatten",
    "mark_run_failed",
    "preflight",
    "use_credentials",
]

EPOCH_KEY = "val_loss"
"""The metric whose steps say which epochs a run has logged (every epoch logs it)."""
PREFLIGHT_TIMEOUT_SECONDS = 10
"""Per-request timeout of the preflight's HTTP calls, seconds (MLflow's default is 120)."""

log = logging.getLogger(__name__)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _strict_table(columns: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    """``{"columns": columns, "data": rows}`` that strict JSON can hold (RFC 8259 has no
    NaN or infinity, which Python's ``json`` would write as the bare words ``NaN``,
    ``Infinity``): a float that is not finite becomes None (``null``), NumPy scalars
    become Python numbers. Checked with ``json.dumps(allow_nan=False)``.

    Raises:
        ValueError: a value JSON cannot hold at all (not a number, string, bool or None).
    """

    def plain(value: Any) -> Any:
        if hasattr(value, "item") and not isinstance(value, str):  # a NumPy scalar
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    table = {"columns": list(columns), "data": [[plain(v) for v in row] for row in rows]}
    try:
        json.dumps(table, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"test table {columns}: {exc}") from exc
    return table


def use_credentials(tracking: TrackingConfig) -> None:
    """Export the tracking section's credentials to this process's environment.

    ``tracking.username``/``password``/``token`` become MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN,
    which MLflow reads, and which the training processes inherit (the password may come from
    ``tracking.password_env`` or ``tracking.password_file``, or from the user info of
    ``tracking.tracking_uri``, which the configuration takes out of the URI): TorchDistributor's local
    mode starts them with this environment, and so does a local Spark master started after
    this call (barrier mode on ``local[n]``). Executors of a real cluster do not inherit the
    driver's environment: give them the variables there (``spark.executorEnv.*``, cluster
    secrets). Values not configured are left as they are. The secrets never enter the job
    sent to the workers (they are excluded from ``JobConfig.model_dump``).

    Raises:
        ConfigError: ``tracking.password_env`` names an unset variable, or
            ``tracking.password_file`` cannot be read (:meth:`TrackingConfig.resolved_password`).
    """
    password = tracking.resolved_password()
    token = tracking.token
    values = {
        mlflow_env.MLFLOW_TRACKING_USERNAME: tracking.username,
        mlflow_env.MLFLOW_TRACKING_PASSWORD: password.get_secret_value() if password else None,
        mlflow_env.MLFLOW_TRACKING_TOKEN: token.get_secret_value() if token else None,
    }
    for var, value in values.items():
        if value:
            var.set(value)


def _probe_database(uri: str) -> None:
    """Connect once to a database store (sqlite, postgresql, mysql, mssql).

    MLflow's own store retries a failed connection 10 times with exponential back-off,
    about 100 s (``mlflow.store.db.utils.create_sqlalchemy_engine_with_retry``); one attempt
    with the same engine factory fails at once.
    """
    import sqlalchemy
    from mlflow.store.db.utils import create_sqlalchemy_engine

    path = uri.removeprefix("sqlite:///")
    if path != uri and path not in ("", ":memory:"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as MLflow's store does
    engine = create_sqlalchemy_engine(uri)
    try:
        sqlalchemy.inspect(engine)
    finally:
        engine.dispose()


def preflight(cfg: JobConfig, timeout_seconds: int = PREFLIGHT_TIMEOUT_SECONDS) -> str:
    """Check the tracking store and get or create the experiment; runs on the driver.

    Fails fast: a database store is connected to once, and HTTP requests (a tracking server,
    Databricks) are retried once, without back-off, with ``timeout_seconds`` per request, so
    an unreachable store surfaces within about ``2 x timeout_seconds`` (a refused connection
    or an unusable sqlite file: well under a second) instead of after minutes of MLflow's
    retries. The configured credentials are exported first (:func:`use_credentials`).

    Returns:
        The experiment id.

    Raises:
        TrackingError: the store cannot be reached or used, or the experiment cannot be
            created; the message names ``tracking.tracking_uri`` and MLflow's error.
    """
    from mlflow.store.db.db_types import DATABASE_ENGINES

    use_credentials(cfg.tracking)
    if not cfg.tracking.tracking_uri:
        cfg.paths.output_dir.mkdir(parents=True, exist_ok=True)
    uri = cfg.tracking_uri
    try:
        with fail_fast(timeout_seconds):
            if urlparse(uri).scheme.partition("+")[0] in DATABASE_ENGINES:
                _probe_database(uri)
            with store_client(uri) as client:
                exp = client.get_experiment_by_name(cfg.tracking.experiment_name)
                if exp is not None:
                    return str(exp.experiment_id)
                return str(
                    client.create_experiment(
                        cfg.tracking.experiment_name, artifact_location=cfg.artifact_location
                    )
                )
    except Exception as exc:
        raise TrackingError(  # redacted: MLflow's error may quote a request with a secret
            redact(
                f"tracking.tracking_uri: the MLflow store {uri} cannot be used: "
                f"{type(exc).__name__}: {exc}"
            )
        ) from exc


class RunTracker:
    """The MLflow run of one training job. Construct on rank 0 only.

    Resuming (``run_id`` given) continues that run and keeps it free of duplicates: params
    already logged are not logged again, and an epoch already logged (``step=epoch`` of
    ``val_loss``) is skipped. The worker logs an epoch only after its checkpoint is on
    disk and, on resume, logs the checkpoint's history first, so a run killed anywhere
    ends up with every completed epoch logged exactly once.
    """

    def __init__(self, cfg: JobConfig, run_id: str | None = None) -> None:
        self.cfg = cfg
        mlflow.set_tracking_uri(cfg.tracking_uri)
        exp = mlflow.set_experiment(cfg.tracking.experiment_name)
        self.resumed = run_id is not None
        self.run = mlflow.start_run(
            run_id=run_id,
            experiment_id=exp.experiment_id,
            run_name=None if run_id else cfg.tracking.run_name,
        )
        self.run_id: str = self.run.info.run_id
        if TAG_OUTPUT_DIR not in self.run.data.tags:  # kept by a resumed run
            mlflow.set_tag(TAG_OUTPUT_DIR, str(cfg.paths.output_dir))  # absolute already
        client = mlflow.MlflowClient()
        self._params: dict[str, str] = dict(self.run.data.params)
        self._logged_epochs: set[int] = (
            {m.step for m in client.get_metric_history(self.run_id, EPOCH_KEY)}
            if self.resumed
            else set()
        )

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the params this run does not have yet (a resumed run keeps its first values)."""
        new = {k: ("" if v is None else v) for k, v in params.items() if k not in self._params}
        changed = sorted(
            k for k, v in params.items() if k in self._params and self._params[k] != str(v)
        )
        if changed:
            log.warning("resumed run keeps its first values of %s", ", ".join(changed))
        if new:
            mlflow.log_params(new)
            self._params.update({k: str(v) for k, v in new.items()})

    def record_recovery(self, attempt: int) -> None:
        """At the start of an attempt: the ``restarts`` metric (``attempt``, at
        ``step=attempt``), and, when the run was reopened after a failure (an automatic
        restart, a ``--resume``), its :data:`FAILURE_TAG` kept as
        ``flowers_job.failure.<n>`` (the n-th interruption) and removed, so that only a run
        that ends FAILED carries it."""
        mlflow.log_metric("restarts", attempt, step=attempt)
        tags = self.run.data.tags
        cause = tags.get(FAILURE_TAG)
        if cause is None:
            return
        n = 1 + sum(k.startswith(f"{FAILURE_TAG}.") for k in tags)
        mlflow.set_tag(f"{FAILURE_TAG}.{n}", cause)
        mlflow.MlflowClient().delete_tag(self.run_id, FAILURE_TAG)

    def log_epoch(self, metrics: dict[str, float], epoch: int) -> bool:
        """Log one epoch's metrics at ``step=epoch`` unless that epoch is logged already.

        Returns:
            True if logged, False if the run already had this epoch.
        """
        if epoch in self._logged_epochs:
            return False
        mlflow.log_metrics(metrics, step=epoch)
        if EPOCH_KEY in metrics:
            self._logged_epochs.add(epoch)
        return True

    def log_final(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log end-of-run metrics (``best_val_loss``, ...) whatever epochs are logged already:
        unlike :meth:`log_epoch`, never skipped. A resumed run that finishes again logs them
        again; MLflow shows the latest value."""
        mlflow.log_metrics(metrics, step=step)

    def log_test(self, report: TestReport, figures: dict[str, Any]) -> None:
        """The test report and the figures, under the run's artifacts:

        - metrics ``test_accuracy``, ``test_loss``, ``test_macro_f1``,
          ``test_images_per_second``;
        - ``test/per_class.json`` (a table: label, precision, recall, f1, support; a label
          absent from the test split has support 0 and ``null`` scores) and
          ``test/confusion_matrix.json`` (a table: one row per true label, one column per
          predicted label), both ``{"columns": [...], "data": [[...], ...]}`` in strict JSON
          (RFC 8259: never ``NaN``; :func:`_strict_table`);
        - ``figures/<name>.png`` for each of ``figures``
          (:func:`flowers_job.tracking.class_report.report_figures`: ``curves``, ``confusion_matrix``,
          ``worst_mistakes``), closed once logged.
        """
        import matplotlib.pyplot as plt

        self.log_final(report.metrics())
        # Tables in mlflow.log_table's JSON layout ({"columns", "data"}), written with
        # log_dict: log_table appends to an existing file, and a resumed run that finishes
        # again must replace its test scores, not add a second set. Built from the plain
        # values, not through pandas, which turns an absent score (None) into NaN.
        columns = ["label", "precision", "recall", "f1", "support"]
        tables = {
            "per_class": _strict_table(
                columns, [[row.get(c) for c in columns] for row in report.per_class]
            ),
            "confusion_matrix": _strict_table(
                ["true_label", *report.label_names],
                [
                    [name, *row]
                    for name, row in zip(report.label_names, report.confusion, strict=True)
                ],
            ),
        }
        for name, table in tables.items():
            mlflow.log_dict(table, f"test/{name}.json")
        for name, fig in figures.items():
            mlflow.log_figure(fig, f"figures/{name}.png")
            plt.close(fig)

    def log_lineage(self, lineage: dict[str, Any]) -> None:
        """Each split read as an MLflow dataset input (the ``images`` table's path or catalog
        name and Delta version in its source and its ``delta_version`` tag, the split in its
        ``split`` tag; context = the split), and the run tags ``flowers_job.ingest_fingerprint``,
        ``flowers_job.test_split_digest``, ``flowers_job.images_table``,
        ``flowers_job.images_version`` (which retention keeps readable:
        :mod:`flowers_job.ingest.retention`) and ``flowers_job.version``.

        Args:
            lineage: :func:`flowers_job.driver.prepare.lineage`'s dict.
        """
        from mlflow.data.delta_dataset_source import DeltaDatasetSource
        from mlflow.data.meta_dataset import MetaDataset

        from flowers_job import __version__

        for name, table in sorted(lineage.get("splits", {}).items()):
            # a path table by its path, a catalog table by its name (MLflow's two forms)
            source = DeltaDatasetSource(
                path=table.get("path"),
                delta_table_name=table.get("name"),
                delta_table_version=table["version"],
            )
            named = table.get("name") or table["path"]
            where = f"{named}@{table['version']}:{table.get('split', name)}"
            digest = hashlib.sha256(where.encode()).hexdigest()[:16]
            # MetaDataset: a dataset known by its source and digest, without loading it here
            # (rank 0 has no Spark session); mypy sees Dataset.profile as abstract.
            dataset = MetaDataset(source, name=f"flowers_{name}", digest=digest)  # type: ignore[abstract]
            # The source drops a version of 0 from its JSON: the tag always carries it.
            mlflow.log_input(
                dataset,
                context=name,
                tags={"delta_version": str(table["version"]), "split": str(table.get("split"))},
            )
        images = lineage.get("tables", {}).get("images", {})
        mlflow.set_tags(
            {
                TAG_FINGERPRINT: lineage.get("ingest_fingerprint", ""),
                TAG_TEST_SPLIT: lineage.get("test_split_digest", ""),
                TAG_IMAGES_TABLE: str(images.get("name") or images.get("path", "")),
                TAG_IMAGES_VERSION: str(images.get("version", "")),
                TAG_VERSION: __version__,
            }
        )

    def finish(self, status: str = "FINISHED") -> None:
        mlflow.end_run(status=status)


FAILURE_TAG = "flowers_job.failure"
"""The tag that holds a failed run's cause (its first :data:`FAILURE_TAG_CHARS` characters)."""
FAILURE_TAG_CHARS = 500
FAILURE_REPORT_SECONDS = 5
"""Per MLflow request while a failure is reported (one retry): the two requests of
:func:`end_failed_run` end within about 20 s, inside torchrun's 30 s between the SIGTERM
that stops the other ranks and its SIGKILL (``torch.distributed.elastic.multiprocessing``'s
``close(timeout=30)``)."""


def end_failed_run(cause: str) -> None:
    """Mark this process's active MLflow run FAILED, its ``cause`` in the
    :data:`FAILURE_TAG` tag, within :data:`FAILURE_REPORT_SECONDS` per request (no-op
    without an active run; never raises: the failure being reported matters more)."""
    try:
        if mlflow.active_run() is None:
            return
        with fail_fast(FAILURE_REPORT_SECONDS):
            try:
                mlflow.set_tag(FAILURE_TAG, redact(cause)[:FAILURE_TAG_CHARS])
            finally:
                mlflow.end_run(status="FAILED")
    except Exception:
        log.exception("could not mark the MLflow run FAILED")


def mark_run_failed(
    tracking_uri: str, run_id: str, cause: str, *, correct_cause: bool = False
) -> bool:
    """The driver's backstop after a failed training: end the MLflow run ``run_id`` FAILED,
    with ``cause`` in the :data:`FAILURE_TAG` tag, if it is still RUNNING. Rank 0 normally
    does this itself (:func:`end_failed_run`); it cannot when it was SIGKILLed (by torchrun
    after its grace period, the kernel's OOM killer, a lost executor). With
    ``correct_cause``, a run that rank 0 ended already gets ``cause`` in the tag too: the
    driver names the rank that failed first, where rank 0 only saw its consequence (a lost
    peer).

    Returns:
        True if the run was RUNNING and is now FAILED; False if it had ended already or
        cannot be read (logged; never raises, within :data:`FAILURE_REPORT_SECONDS` per
        request).
    """
    try:
        with fail_fast(FAILURE_REPORT_SECONDS), store_client(tracking_uri) as client:
            if client.get_run(run_id).info.status != "RUNNING":
                if correct_cause:
                    client.set_tag(run_id, FAILURE_TAG, redact(cause)[:FAILURE_TAG_CHARS])
                return False
            client.set_tag(run_id, FAILURE_TAG, redact(cause)[:FAILURE_TAG_CHARS])
            client.set_terminated(run_id, status="FAILED")
        log.warning("MLflow run %s was still RUNNING: marked FAILED", run_id)
        return True
    except Exception:
        log.exception("could not check or end MLflow run %s", run_id)
        return False
