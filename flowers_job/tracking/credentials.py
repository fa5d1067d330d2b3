"""MLflow credentials where rank 0 runs: on an executor, in barrier mode.

With ``distributed.local_mode=false`` rank 0 logs the run and registers the model from an
executor. The job never copies the driver's secrets there (the job the ranks receive leaves
them out: :func:`flowers_job.tracking.mlflow_run.use_credentials`): the executors need the tracking
server's credentials in their own environment (``spark.executorEnv.<VAR>`` with
spark-submit, ``spark_env_vars`` from a secret scope on Databricks). Without them the job
would fail after the ingest and the training, when rank 0 first calls MLflow.

The executor probe (:func:`flowers_job.cluster.executor_probe.check_executors`) runs
:func:`executor_report` on every executor before any work: the credential variables the
driver uses must be set there, and one authenticated MLflow call must succeed;
:func:`credential_problems` turns what the executors report into the error. Only the
variables' names ever leave a process; an error text is redacted of every secret value
(:func:`redact`) before it does.

This module imports MLflow only inside its functions: the executors import it to run the
probe, and the storage probe alone needs no MLflow there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = [
    "DATABRICKS_VARIABLES",
    "ExecutorTracking",
    "credential_problems",
    "credential_variables",
    "executor_report",
    "executor_tracking",
    "fail_fast",
    "redact",
    "remote_store",
    "store_client",
]

ERROR_CHARS = 300
"""An executor's MLflow error is cut to this many characters in the job's error."""


@contextmanager
def fail_fast(timeout_seconds: int) -> Iterator[None]:
    """MLflow's HTTP client within the block: one retry without back-off, ``timeout_seconds``
    per request. Its defaults (7 retries with exponential back-off, 120 s per request,
    ``mlflow.environment_variables``) take minutes to give up on an unreachable server. The
    environment is restored on exit: the training run keeps MLflow's patient defaults."""
    from mlflow import environment_variables as mlflow_env

    settings: dict[Any, object] = {
        mlflow_env.MLFLOW_HTTP_REQUEST_MAX_RETRIES: 1,
        mlflow_env.MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR: 0,
        mlflow_env.MLFLOW_HTTP_REQUEST_BACKOFF_JITTER: 0.0,
        mlflow_env.MLFLOW_HTTP_REQUEST_TIMEOUT: timeout_seconds,
        mlflow_env.MLFLOW_DATABRICKS_ENDPOINT_HTTP_RETRY_TIMEOUT: timeout_seconds,
    }
    saved = {var: var.get_raw() for var in settings}
    try:
        for var, value in settings.items():
            var.set(value)
        yield
    finally:
        for var, raw in saved.items():
            if raw is None:
                var.unset()
            else:
                var.set(raw)


_STORE_LOCK = threading.RLock()
"""Held while the process-wide tracking URI points at one store (:func:`store_client`)."""


@contextmanager
def store_client(tracking_uri: str) -> Iterator[MlflowClient]:
    """An ``MlflowClient`` of the store ``tracking_uri``, with MLflow's process-wide tracking
    URI pointing at the same store within the block, then restored (the variable
    ``MLFLOW_TRACKING_URI`` as well).

    Why both: MLflow 3.0.1 (Databricks Runtime 17.3 LTS ML's mlflow-skinny) resolves an
    ``mlflow-artifacts:`` URI through the process-wide tracking URI, not the client's
    (``MlflowArtifactsRepository.__init__`` calls ``get_tracking_uri()``; later releases
    take the client's). A client of a tracking server started with
    ``--artifacts-destination`` then fails to log or download any artifact wherever the
    process-wide URI names another store: "When an mlflow-artifacts URI was supplied, the
    tracking URI must be a valid http or https URI". Every MLflow call of the driver and
    the executors goes through this, so that each reaches the configured store whatever
    the process-wide URI says. Blocks of different threads take turns (one lock).

    Raises:
        MlflowException: as the client's calls do.
    """
    import mlflow

    with _STORE_LOCK:
        saved_env = os.environ.get("MLFLOW_TRACKING_URI")
        saved = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(tracking_uri)
        try:
            yield mlflow.MlflowClient(tracking_uri=tracking_uri)
        finally:
            mlflow.set_tracking_uri(saved)
            if saved_env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved_env


def remote_store(uri: str) -> bool:
    """An MLflow tracking server (``http(s)://``) or Databricks (``databricks``,
    ``databricks://<profile>``): a store reached over the network, with credentials."""
    from mlflow.utils.uri import is_databricks_uri, is_http_uri

    return bool(is_http_uri(uri) or is_databricks_uri(uri))


DATABRICKS_VARIABLES: dict[str, bool] = {
    "DATABRICKS_HOST": False,
    "DATABRICKS_TOKEN": True,
    "DATABRICKS_OIDC_TOKEN_ENV": False,
    "DATABRICKS_OIDC_TOKEN_FILEPATH": False,
    "DATABRICKS_USERNAME": False,
    "DATABRICKS_PASSWORD": True,
    "DATABRICKS_CLIENT_ID": False,
    "DATABRICKS_CLIENT_SECRET": True,
    "DATABRICKS_CONFIG_PROFILE": False,
    "DATABRICKS_CONFIG_FILE": False,
    "DATABRICKS_GOOGLE_SERVICE_ACCOUNT": False,
    "GOOGLE_CREDENTIALS": True,
    "DATABRICKS_AZURE_RESOURCE_ID": False,
    "ARM_USE_MSI": False,
    "ARM_CLIENT_SECRET": True,
    "ARM_CLIENT_ID": False,
    "ARM_TENANT_ID": False,
    "DATABRICKS_AUTH_TYPE": False,
    "DATABRICKS_METADATA_SERVICE_URL": True,
}
"""The variables Databricks' unified authentication reads, which MLflow uses for a
``databricks`` store (through the Databricks SDK), and whether each is a secret: the SDK's
configuration attributes of an auth method, plus the host, profile, config file and auth
type (``databricks.sdk.config.Config.attributes()``; tests/unit/cluster/test_executor_probe.py checks
this against the SDK installed, which the wheel does not itself require)."""


def credential_variables(uri: str) -> tuple[str, ...]:
    """The environment variables MLflow authenticates with to the store ``uri``.

    A tracking server: those MLflow's client reads for its host credentials
    (``mlflow.utils.credentials.get_default_host_creds``: MLFLOW_TRACKING_USERNAME,
    MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_AUTH, the AWS SigV4
    switch and the TLS settings). Databricks: the Databricks SDK's (DATABRICKS_HOST,
    DATABRICKS_TOKEN, DATABRICKS_CLIENT_ID, DATABRICKS_CLIENT_SECRET, ...). Anything else
    (sqlite, a path): none.
    """
    from mlflow import environment_variables as mlflow_env
    from mlflow.utils.uri import is_databricks_uri, is_http_uri

    if is_http_uri(uri):
        return tuple(
            var.name
            for var in (
                mlflow_env.MLFLOW_TRACKING_USERNAME,
                mlflow_env.MLFLOW_TRACKING_PASSWORD,
                mlflow_env.MLFLOW_TRACKING_TOKEN,
                mlflow_env.MLFLOW_TRACKING_AUTH,
                mlflow_env.MLFLOW_TRACKING_AWS_SIGV4,
                mlflow_env.MLFLOW_TRACKING_CLIENT_CERT_PATH,
                mlflow_env.MLFLOW_TRACKING_SERVER_CERT_PATH,
                mlflow_env.MLFLOW_TRACKING_INSECURE_TLS,
            )
        )
    if is_databricks_uri(uri):
        return tuple(DATABRICKS_VARIABLES)
    return ()


def _secret_variables() -> list[str]:
    from mlflow import environment_variables as mlflow_env

    names = [mlflow_env.MLFLOW_TRACKING_PASSWORD.name, mlflow_env.MLFLOW_TRACKING_TOKEN.name]
    names += ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]  # an object store's (storage.py)
    return names + [name for name, secret in DATABRICKS_VARIABLES.items() if secret]


def redact(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """``text`` with the value of every secret credential variable set in ``environ``
    (MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, DATABRICKS_TOKEN,
    DATABRICKS_CLIENT_SECRET, AWS_SECRET_ACCESS_KEY, ...) replaced by ``***``."""
    for name in _secret_variables():
        value = environ.get(name)
        if value:
            text = text.replace(value, "***")
    return text


def executor_report(
    uri: str, experiment: str, wanted: list[str], timeout_seconds: int
) -> dict[str, Any]:
    """Run on an executor: can this process use the MLflow store ``uri``?

    Args:
        uri: the tracking URI (``http(s)://`` or ``databricks``).
        experiment: the job's experiment, read once (``get_experiment_by_name``): an
            authenticated call.
        wanted: the credential variables the driver has set (names).
        timeout_seconds: per request, one retry (:func:`fail_fast`).

    Returns:
        ``{"missing": [names of wanted not set here], "set": [credential variables set
        here], "error": None or "<exception type>: <message>", redacted}``: names only,
        never a value.
    """
    present = [name for name in credential_variables(uri) if os.environ.get(name)]
    error = None
    try:
        with fail_fast(timeout_seconds), store_client(uri) as client:
            client.get_experiment_by_name(experiment)
    except Exception as exc:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        error = redact(text)[:ERROR_CHARS]
    return {"missing": [n for n in wanted if not os.environ.get(n)], "set": present, "error": error}


ExecutorTracking = dict[str, Any]
"""The arguments of :func:`executor_report` (plain data, shipped to the executors)."""


def executor_tracking(
    uri: str, experiment: str, local_mode: bool, timeout_seconds: int
) -> ExecutorTracking | None:
    """What the executors must check, or None when they never call MLflow: local mode (the
    ranks run on the driver) or a store that is not remote (:func:`remote_store`; a shared
    sqlite or file store is the storage probe's). ``wanted``: the credential variables set
    in this (the driver's) environment, the configured ones exported already
    (:func:`flowers_job.tracking.mlflow_run.use_credentials`)."""
    if local_mode or not remote_store(uri):
        return None
    wanted = [name for name in credential_variables(uri) if os.environ.get(name)]
    return {
        "uri": uri,
        "experiment": experiment,
        "wanted": wanted,
        "timeout_seconds": timeout_seconds,
    }


def _fix(uri: str, wanted: list[str]) -> str:
    from mlflow.utils.uri import is_databricks_uri

    if wanted:
        names = wanted
    elif is_databricks_uri(uri):
        names = ["DATABRICKS_HOST", "DATABRICKS_TOKEN"]
    else:
        names = ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    conf = " ".join(f"--conf spark.executorEnv.{name}=..." for name in names)
    return (
        f"give the executors their own credentials: spark-submit {conf} (or the cluster's "
        "spark-defaults.conf, or --properties-file); on Databricks, the job cluster's "
        "spark_env_vars from a secret scope ({{secrets/<scope>/<key>}}); docs/cluster.md"
    )


def credential_problems(plan: ExecutorTracking, reports: list[dict[str, Any]]) -> list[str]:
    """The executors that cannot use the tracking server, one line per kind of failure.

    Args:
        plan: :func:`executor_tracking`'s dict.
        reports: ``{"host", "address", "tracking"}`` per executor, ``tracking`` being
            :func:`executor_report`'s dict.

    Returns:
        Lines naming ``tracking.tracking_uri``, the variables missing on the executors
        (names only), the executor hosts and addresses, MLflow's error, and the fix; empty
        when every executor passed.
    """
    failed: dict[tuple[tuple[str, ...], tuple[str, ...], str | None], list[str]] = {}
    for r in reports:
        t = r["tracking"]
        if t["missing"] or t["error"]:
            key = (tuple(t["missing"]), tuple(t["set"]), t["error"])
            failed.setdefault(key, []).append(f"{r['host']} ({r['address']})")
    problems = []
    for (missing, present, error), hosts in failed.items():
        where = "executor host " + ", ".join(sorted(set(hosts)))
        line = (
            f"tracking.tracking_uri: the MLflow store {plan['uri']} cannot be used from the "
            f"executors, where rank 0 logs and registers the model "
            f"(distributed.local_mode=false): "
        )
        if missing:
            line += (
                f"{', '.join(missing)} set on the driver but missing on {where} (the job "
                "never copies the driver's secrets to the executors)"
            )
            if error:
                line += f"; MLflow's call there failed: {error}"
        else:
            line += (
                f"an authenticated call failed on {where}, where "
                f"{', '.join(present) or 'no credential variable'} is set: {error}"
            )
        problems.append(f"{line}; {_fix(plan['uri'], plan['wanted'])}")
    return problems
