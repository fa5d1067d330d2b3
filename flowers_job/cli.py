"""Command line: ``flowers-job {ingest,train,run,predict,runs}`` (also ``python -m flowers_job``).

Configuration is parsed and validated before Spark starts: an invalid value exits
with status 2 and a message naming the field, within a second or two. The checks that need
no Spark follow, still before Spark starts (:func:`flowers_job.driver.pipeline.preflight`): the
images root (``ingest``, ``run``: status 1), the loader on this stack and the packages the
run needs (status 2), the MLflow store (status 1). The cluster is checked once, right after
Spark starts (status 2). Between the checks without Spark and the MLflow store, ``ingest``,
``train`` and ``run`` take the lease on ``paths.output_dir`` (:mod:`flowers_job.driver.lease`):
a second command on the same output exits with status 2 naming the first, having written
nothing.
``predict`` resolves the model in the registry and checks its input before Spark starts
(an unknown model, version or alias, or a missing input, exits with status 1).
``runs`` lists the MLflow runs of an output dir with their true state; it starts no Spark
and creates no store.
Every command that uses Spark runs on classic Spark or on Spark Connect (``--remote
sc://HOST:PORT``, ``SPARK_REMOTE``, spark-submit ``--remote`` or ``--conf
spark.api.mode=connect``, Databricks serverless compute or standard access mode); the log's
first line says which (:mod:`flowers_job.cluster.connect`). A loader that needs classic Spark
is refused on Connect with status 2 before Spark starts.
Every status comes from one place, :func:`main`: the ``exit_code`` of the
:class:`~flowers_job.errors.FlowersJobError` that stopped the command (:mod:`flowers_job.errors`
lists them); any other exception is a bug, and ends with Python's traceback (status 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowers_job.config import JobConfig, load_config
from flowers_job.errors import ConfigError, FlowersJobError, PredictError
from flowers_job.vision.pillow_floor import check_pillow

if TYPE_CHECKING:
    from flowers_job.driver import pipeline
    from flowers_job.tables.table_ref import TableRef

__all__ = ["build_parser", "main"]

log = logging.getLogger("flowers_job")


def _table_arg(text: str) -> TableRef:
    """``--table``/``--output-table``: a path table or a catalog name (TableRef.from_arg)."""
    from flowers_job.tables.table_ref import TableRef

    try:
        return TableRef.from_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flowers-job``."""
    parser = argparse.ArgumentParser(
        prog="flowers-job",
        description="Distributed image-classification training on Spark: "
        "photos -> Delta -> Petastorm or Streaming -> TorchDistributor (DDP) -> MLflow.",
        epilog="Runs on classic Spark or on Spark Connect (--remote sc://HOST:PORT, "
        "SPARK_REMOTE, spark-submit --remote, Databricks serverless or standard access "
        "mode): docs/cluster.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common, images, resume = _shared_options()
    sub.add_parser("ingest", parents=[common, images], help="photos -> Delta tables")
    sub.add_parser(
        "train", parents=[common, resume], help="Delta tables -> trained, registered model"
    )
    sub.add_parser("run", parents=[common, images, resume], help="ingest, then train")
    _add_predict(sub, common)
    runs = sub.add_parser(
        "runs",
        parents=[common],
        help="the MLflow runs of --output-dir and their state (ABANDONED: its driver is gone)",
    )
    runs.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser


def _shared_options() -> tuple[argparse.ArgumentParser, ...]:
    """The options several commands share, as argparse parents: every command's (config,
    overrides, output dir, log level, Spark Connect), the photos' and the resume's."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="YAML file with any of the config sections")
    common.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.epochs=3 (repeatable)",
    )
    common.add_argument(
        "--output-dir",
        help="paths.output_dir: tables, checkpoints, summary (a directory or s3a://bucket/prefix)",
    )
    common.add_argument("--log-level", default="INFO", help="Python log level (default INFO)")
    common.add_argument(
        "--remote",
        metavar="sc://HOST:PORT",
        help="run on this Spark Connect server (default: $SPARK_REMOTE, or classic Spark)",
    )
    images = argparse.ArgumentParser(add_help=False)
    images.add_argument(
        "--images", help="data.images: <images>/<label>/<file> (a directory or s3a://bucket/prefix)"
    )
    images.add_argument(
        "--full",
        action="store_true",
        help="data.full_ingest: decode every file and rewrite the tables (default: only "
        "new and changed files)",
    )
    resume = argparse.ArgumentParser(add_help=False)
    resume.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in output dir"
    )
    resume.add_argument(
        "--resume-key",
        metavar="KEY",
        help="train.resume_key, with --resume: continue only a checkpoint written under KEY "
        "(a Databricks job run id: the task's retries continue, the next run starts afresh)",
    )
    return common, images, resume


def _add_predict(sub: Any, common: argparse.ArgumentParser) -> None:
    """``flowers-job predict``: its source (photos or a table), model and output table."""
    predict = sub.add_parser(
        "predict",
        parents=[common],
        help="score photos or a Delta table with a registered model -> Delta table",
        description="Score photos (--images) or a Delta table with an image column (--table) "
        "on the executors; one output row per input row, bad inputs with a reason. "
        "Default model: the version the last run/train in --output-dir registered. "
        "Runs on classic Spark or Spark Connect (--remote), as training does.",
    )
    predict.add_argument(
        "--model",
        help="models:/<name>/<version> or models:/<name>@<alias> "
        "(default: summary.json in --output-dir)",
    )
    source = predict.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", type=Path, help="photos: <images>/<label>/<file> or flat")
    source.add_argument(
        "--table",
        type=_table_arg,
        help="Delta table with row_id and image columns: a path, or catalog.schema.table",
    )
    predict.add_argument(
        "--split",
        choices=("train", "val", "test"),
        help="with --table: only the rows of this split (a partition of the images table)",
    )
    predict.add_argument(
        "--output-table",
        type=_table_arg,
        required=True,
        help="Delta table the predictions go to: a path, or catalog.schema.table",
    )
    predict.add_argument(
        "--tracking-uri-from-output",
        action="store_true",
        help="take the MLflow store from --output-dir's summary.json when neither "
        "tracking.tracking_uri nor MLFLOW_TRACKING_URI names one (without it: the sqlite "
        "store under --output-dir); only for a folder you trust, as the credentials go there",
    )


def _config(args: argparse.Namespace) -> JobConfig:
    flags = {
        "data.images": getattr(args, "images", None),
        "paths.output_dir": args.output_dir,
        "train.resume": True if getattr(args, "resume", False) else None,
        "train.resume_key": getattr(args, "resume_key", None),
        "data.full_ingest": True if getattr(args, "full", False) else None,
    }
    return load_config(args.config, args.overrides, **flags)


def main(argv: list[str] | None = None) -> int:
    """Run ``flowers-job``; returns the process exit status: 0 done, otherwise the
    ``exit_code`` of the :class:`~flowers_job.errors.FlowersJobError` that stopped it (2 the
    configuration or the cluster, before any work; 1 the work failed)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # predict and runs skip the pipeline's checks: they have their own paths
    commands = {"predict": _predict, "runs": _runs}
    try:
        if args.command != "runs":  # every command that decodes images (CVE-2026-25990)
            check_pillow()
        return commands.get(args.command, _pipeline)(args)
    except FlowersJobError as exc:  # the one place where an error becomes the exit status
        print(_message(args.command, exc), file=sys.stderr)
        return exc.exit_code


def _message(command: str, exc: FlowersJobError) -> str:
    """What stderr says of ``exc``: ``flowers-job <command>: <Error>: <message>``. A
    configuration or predict error's message says what to fix, and goes without its class;
    ``ingest``, ``train`` and ``run`` name no command before a configuration error
    (``flowers-job: invalid configuration: ...``)."""
    if isinstance(exc, ConfigError) and command not in ("predict", "runs"):
        return f"flowers-job: {exc}"
    if isinstance(exc, (ConfigError, PredictError)):
        return f"flowers-job {command}: {exc}"
    return f"flowers-job {command}: {type(exc).__name__}: {exc}"


def _pipeline(args: argparse.Namespace) -> int:
    """``flowers-job {ingest,train,run}``: the configuration and the checks that need no
    Spark (seconds), then Spark, the cluster's checks, and the work."""
    from flowers_job.cluster.connect import wanted_connect

    connect = wanted_connect(args.remote)
    log.info("session: %s", f"Spark Connect ({connect})" if connect else "classic Spark")
    cfg = _config(args)
    if args.command in ("ingest", "run") and cfg.data.images is None:
        raise ConfigError("invalid configuration:\n  data.images: required (--images DIR)")

    from flowers_job.driver import pipeline
    from flowers_job.driver.lease import output_lease

    job = pipeline.preflight(cfg, args.command, connect)  # seconds, and no JVM yet
    # one writer per output: held before anything is written there, restarts included
    with output_lease(job.cfg.paths.output_dir, args.command):
        return _work(args, job)


def _work(args: argparse.Namespace, job: pipeline.CheckedJob) -> int:
    """The part of :func:`_pipeline` that writes: under the output's lease."""
    from flowers_job.driver import pipeline

    cfg = job.cfg
    if args.command != "ingest":
        pipeline.check_tracking(cfg)
    stores = [str(cfg.paths.output_dir), str(cfg.paths.cache_root), str(cfg.data.images)]
    spark = _spark(args.remote, stores)
    if args.command != "ingest":
        pipeline.check_on_cluster(spark, job)
    result = pipeline.execute(spark, job, args.command)
    if isinstance(result, dict):
        keys = (
            "test_accuracy",
            "test_macro_f1",
            "val_accuracy",
            "val_loss",
            "best_epoch",
            "epochs_completed",
            "stop_reason",
            "loader",
            "world_size",
            "global_batch_size",
            "train_rows",
            "val_rows",
            "test_rows",
            "quarantined_rows",
            "seconds_per_epoch",
            "images_per_second",
            "job_seconds",
            "registered_model_name",
            "registered_model_version",
            "images_rows",
            "files",
            "mode",
            "files_listed",
            "files_decoded",
            "rows_inserted",
            "rows_updated",
            "rows_deleted",
            "rows_quarantined",
        )
        shown = {k: result[k] for k in keys if k in result}
        uses = result.get("loader_cache") or {}
        if any(use.get("entry") is not None for use in uses.values()):
            shown["loader_cache_reused"] = {split: use["reused"] for split, use in uses.items()}
        if result.get("embeddings"):
            shown["embeddings"] = {
                k: result["embeddings"][k]
                for k in ("embedded", "copied", "deleted", "seconds")
                if k in result["embeddings"]
            }
        print(json.dumps(shown, indent=2))
        if args.command != "ingest":
            print(f"summary: {cfg.paths.summary_path}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    """``flowers-job predict``: model and input checked before Spark starts, then scored
    on classic Spark or Spark Connect (``--remote``)."""
    if args.model is None and args.output_dir is None:
        raise ConfigError("give --model or --output-dir (its summary.json)")
    from flowers_job.serving import batch_predict as predict
    from flowers_job.tracking.mlflow_run import use_credentials

    # paths.output_dir only locates the defaults (summary.json, the sqlite store); "."
    # makes the default store ./mlflow.db, MLflow's own default
    cfg = load_config(args.config, args.overrides, **{"paths.output_dir": args.output_dir or "."})
    use_credentials(cfg.tracking)
    model_uri, summary_uri = args.model, None
    if args.output_dir is not None and (args.model is None or cfg.paths.summary_path.exists()):
        default_uri, summary_uri = predict.default_model(args.output_dir)
        model_uri = model_uri or default_uri
    tracking_uri = predict.predict_tracking_uri(
        cfg.tracking.tracking_uri,
        cfg.tracking_uri,
        summary_uri,
        from_output=args.tracking_uri_from_output,
    )
    ref = predict.resolve_model(model_uri, tracking_uri)
    predict.check_input(args.images, args.table)
    report = predict.predict(
        _spark(args.remote, []),
        ref,
        args.output_table,
        images=args.images,
        table=args.table,
        split=args.split,
        data=cfg.data,
    )
    print(json.dumps(report.to_dict(), indent=2))
    return 0


def _spark(remote: str | None, stores: list[str]) -> Any:
    """The session: Spark Connect where ``--remote`` or the environment asks for it
    (:func:`~flowers_job.cluster.connect.remote_session`), else classic Spark (the one
    spark-submit made, or a local one: :func:`~flowers_job.cluster.session.get_spark`); its
    kind logged."""
    from flowers_job.cluster.connect import remote_session, session_kind, wanted_connect

    if wanted_connect(remote) is not None:
        spark = remote_session(remote)
    else:
        from flowers_job.cluster.session import get_spark

        spark = get_spark(object_stores=stores)
    log.info("%s", session_kind(spark))
    return spark


def _runs(args: argparse.Namespace) -> int:
    """``flowers-job runs``: the output dir's MLflow runs, newest first, as a table or JSON
    lines; no Spark, and a store or experiment that does not exist is not created."""
    from flowers_job.driver.runs import format_runs, list_runs
    from flowers_job.tracking.mlflow_run import use_credentials

    cfg = _config(args)
    use_credentials(cfg.tracking)
    found = list_runs(cfg.paths.output_dir, cfg.tracking_uri, cfg.tracking.experiment_name)
    if not found:
        print(
            f"no runs of {cfg.paths.output_dir} in experiment {cfg.tracking.experiment_name!r} "
            f"of the MLflow store {cfg.tracking_uri}",
            file=sys.stderr if args.json else sys.stdout,
        )
    elif args.json:
        for run in found:
            print(json.dumps(run))
    else:
        print(format_runs(found))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
