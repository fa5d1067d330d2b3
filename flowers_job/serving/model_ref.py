"""The model ``predict`` scores with: a registered version, resolved on the driver once, and
its files shipped to the executors.

The driver resolves the URI against the registry once (``models:/name/version`` or
``models:/name@alias`` -> a version), downloads that version's artifacts and ships the
folder as one zip archive with ``SparkSession.addArtifacts(zip, archive=True)``, which classic
Spark and Spark Connect both have (pyspark 4.0); each executor unpacks it, and a task finds the
folder at ``SparkFiles.get(<archive's name>)``. On classic Spark ``addArtifacts`` is
``SparkContext.addArchive`` (pyspark's ``sql/session.py``); on Connect the client uploads the zip
to the server as a session artifact (``archives/<name>``) and the server's Python workers run
in that session's own folder, where ``SparkFiles.get`` finds it unpacked (tried on a
``local[2]`` Connect server: every task found the folder; a second session on the same server
did not see it, so what was shipped is remembered per Connect session). Executors on other
hosts therefore need neither the registry nor its credentials (the default registry is a sqlite
file on the driver's disk), a moved alias cannot change the model mid-job, and the registry is
read once, not once per worker.
A lookup that fails creates nothing: a ``sqlite:`` store that does not exist is refused
before MLflow is asked (it would create an empty database).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from flowers_job.errors import PredictError, UsageError
from flowers_job.location import Location

__all__ = [
    "FAIL_FAST_SECONDS",
    "ModelRef",
    "PredictError",
    "Shipped",
    "UsageError",
    "artifact_scope",
    "default_model",
    "resolve_model",
    "ship_model",
]

FAIL_FAST_SECONDS = 10
"""Per-request timeout of the registry lookup and the model download, seconds (one retry)."""

_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))")


@dataclass(frozen=True)
class ModelRef:
    """A registered model version, resolved on the driver.

    Attributes:
        uri: the URI as the user gave it (``models:/name/3`` or ``models:/name@champion``).
        name: registered model name.
        version: the version the URI resolved to (an alias resolved once, before scoring).
        tracking_uri: the MLflow store (tracking and registry) it was resolved in.
    """

    uri: str
    name: str
    version: int
    tracking_uri: str

    @property
    def version_uri(self) -> str:
        """``models:/name/version``: the exact version, whatever an alias says later."""
        return f"models:/{self.name}/{self.version}"


@contextmanager
def _no_download_bar() -> Iterator[None]:
    """MLflow's per-file download bar off within the block (predict has its own bar)."""
    from mlflow import environment_variables as mlflow_env

    bar = mlflow_env.MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
    raw = bar.get_raw()
    bar.set(False)
    try:
        yield
    finally:
        if raw is None:
            bar.unset()
        else:
            bar.set(raw)


def default_model(output_dir: Location | Path | str) -> tuple[str, str | None]:
    """The model the last ``run``/``train`` in ``output_dir`` registered.

    Returns:
        ``(models:/<name>/<version>, tracking_uri)`` from ``output_dir/summary.json``
        (``registered_model_name``, ``registered_model_version``, ``mlflow_tracking_uri``;
        the URI is None when the summary has none).

    Raises:
        PredictError: no readable summary.json, or it names no registered model version.
    """
    path = Location.of(output_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise PredictError(
            f"no --model given and no {path}: run flowers-job run/train with this "
            "--output-dir first, or give --model models:/<name>/<version>"
        ) from None
    except (OSError, ValueError) as exc:
        raise PredictError(f"cannot read {path}: {exc}") from None
    name, version = summary.get("registered_model_name"), summary.get("registered_model_version")
    if not name or version is None:
        raise PredictError(
            f"{path} names no registered model version (registered_model_name={name!r}, "
            f"registered_model_version={version!r}); give --model models:/<name>/<version>"
        )
    uri = summary.get("mlflow_tracking_uri")
    return f"models:/{name}/{int(version)}", str(uri) if uri else None


def _missing_local_store(tracking_uri: str) -> Path | None:
    """The path of a ``sqlite:`` or ``file:`` store that does not exist; None otherwise (a
    server, or a store that exists)."""
    from urllib.parse import urlparse

    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri.removeprefix("sqlite:///"))
    elif tracking_uri.startswith("file:"):
        path = Path(urlparse(tracking_uri).path)
    else:
        return None
    return None if path.exists() else path


def resolve_model(model_uri: str, tracking_uri: str) -> ModelRef:
    """Resolve ``models:/<name>/<version>`` or ``models:/<name>@<alias>`` in the registry.

    One registry lookup, with MLflow's HTTP client held to one retry and
    :data:`FAIL_FAST_SECONDS` per request.

    Raises:
        UsageError: ``model_uri`` is not of either form.
        PredictError: a local store (``sqlite:``, ``file:``) that does not exist (checked
            first: MLflow would create it), a store that cannot be read, or no such model,
            version or alias (the message lists the versions and aliases it has).
    """
    from mlflow.exceptions import MlflowException

    from flowers_job.tracking.credentials import fail_fast, store_client

    m = _MODEL_URI.fullmatch(model_uri)
    if m is None:
        raise UsageError(
            f"--model {model_uri!r}: expected models:/<name>/<version> or models:/<name>@<alias>"
        )
    name, alias = m["name"], m["alias"]
    missing = _missing_local_store(tracking_uri)
    if missing is not None:
        raise PredictError(
            f"--model {model_uri}: no MLflow store at {missing} (tracking URI {tracking_uri}); "
            "give the --output-dir of a run, or tracking.tracking_uri"
        )
    try:
        with fail_fast(FAIL_FAST_SECONDS), store_client(tracking_uri) as client:
            try:
                mv = (
                    client.get_model_version_by_alias(name, alias)
                    if alias
                    else client.get_model_version(name, m["version"])
                )
            except MlflowException as exc:
                # a missing version: RESOURCE_DOES_NOT_EXIST; a missing alias (sqlite store,
                # MLflow 3): INVALID_PARAMETER_VALUE
                if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    raise
                raise PredictError(
                    f"--model {model_uri}: {_what_exists(client, name)} in the MLflow store "
                    f"{tracking_uri}"
                ) from None
    except PredictError:
        raise
    except Exception as exc:
        raise PredictError(
            f"--model {model_uri}: the MLflow store {tracking_uri} cannot be read: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return ModelRef(model_uri, name, int(mv.version), tracking_uri)


def _what_exists(client: Any, name: str) -> str:
    """``"registered model 'x' has versions [1, 2] and aliases ['champion']"``, or that
    there is no such model (with the names there are)."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models(max_results=20))
        return f"no registered model named {name!r} (registered: {names})"
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    aliases = sorted(model.aliases or {})
    return f"registered model {name!r} has versions {versions} and aliases {aliases}, not this one"


@dataclass(frozen=True)
class Shipped:
    """A model version downloaded on the driver and added to the session's artifacts."""

    name: str  # the archive's name in SparkFiles (the folder it unpacks to)
    label_names: list[str]
    model_config: dict[str, Any]


_SHIPPED: dict[tuple[str, str, str], Shipped] = {}
"""(:func:`artifact_scope`, tracking URI, models:/name/version) -> the archive already shipped."""


def artifact_scope(spark: SparkSession) -> str:
    """What an archive added with ``addArtifacts`` is visible to: the Spark application on
    classic Spark (``SparkContext.addArchive``: every session of the application), the one
    session on Spark Connect (``connect:<session id>``: the server keeps each session's
    artifacts apart; the server's ``spark.app.id`` is shared by all its sessions, so it cannot
    be the key there)."""
    from flowers_job.cluster.connect import is_connect_session

    if is_connect_session(spark):
        return f"connect:{spark.session_id}"  # type: ignore[attr-defined]
    return str(spark.sparkContext.applicationId)


def ship_model(spark: SparkSession, ref: ModelRef) -> Shipped:
    """Download ``ref``'s artifacts once per driver process and Spark application (classic) or
    Connect session, and ship them to the executors as one zip archive
    (``spark.addArtifacts(zip, archive=True)``, classic and Connect alike; ``Shipped.name`` is
    its name in ``SparkFiles``, the folder it unpacks to).

    Raises:
        MlflowException, OSError: the registry or the artifact store cannot be read (as
            MLflow raises them).
    """
    import mlflow
    from mlflow.models import Model

    from flowers_job.tracking.credentials import fail_fast, store_client

    key = (artifact_scope(spark), ref.tracking_uri, ref.version_uri)
    shipped = _SHIPPED.get(key)
    if shipped is not None:
        return shipped
    parent = tempfile.mkdtemp(prefix="flowers-model-")
    atexit.register(shutil.rmtree, parent, True)
    name = f"flowers_model_{ref.version}_{uuid.uuid4().hex[:8]}"
    with (
        fail_fast(FAIL_FAST_SECONDS),
        _no_download_bar(),
        store_client(ref.tracking_uri) as client,
    ):
        source = client.get_model_version_download_uri(ref.name, str(ref.version))
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=source,
            dst_path=os.path.join(parent, "download"),
            tracking_uri=ref.tracking_uri,
        )
    flavor = Model.load(local).flavors["python_function"]
    conf = flavor.get("config") or flavor.get("model_config") or {}
    # an archive, not the folder: Spark 4 refuses addFile of a local directory unless the
    # master is local (UNSUPPORTED_ADD_FILE.LOCAL_DIRECTORY); an archive is one file, which
    # each executor unpacks into the folder SparkFiles.get(<archive's name>) names
    archive = shutil.make_archive(os.path.join(parent, name), "zip", root_dir=local)
    shutil.rmtree(local, ignore_errors=True)
    spark.addArtifacts(archive, archive=True)
    shipped = Shipped(os.path.basename(archive), [str(x) for x in conf["label_names"]], dict(conf))
    _SHIPPED[key] = shipped
    return shipped
