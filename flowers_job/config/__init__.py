"""Typed configuration: defaults, a YAML file and ``--set KEY=VALUE`` overrides.

:mod:`~flowers_job.config.model` holds the tree of sections, :mod:`~flowers_job.config.load`
builds it, :mod:`~flowers_job.config.deprecated` carries renamed keys for one release.

The whole job is described by one :class:`JobConfig` tree. It is built and
validated once, on the driver, before Spark starts; workers receive
``config.model_dump(mode="json")`` (plain data) and rebuild it with
:meth:`JobConfig.model_validate`.

Precedence (lowest to highest): field defaults, the YAML file, command-line
flags (``--images``, ``--output-dir``), ``--set`` overrides.

Secrets (``tracking.password``, ``tracking.token``) are :class:`~pydantic.SecretStr` fields
excluded from every dump: they print as ``'**********'``, never reach the workers' job,
MLflow params or checkpoints, and travel to the training processes only through the
environment (``MLFLOW_TRACKING_PASSWORD``/``MLFLOW_TRACKING_TOKEN``, see
:func:`flowers_job.tracking.mlflow_run.use_credentials`).
"""

from flowers_job.config.deprecated import ConfigDeprecationWarning
from flowers_job.config.load import ConfigError, load_config, parse_overrides, resolve_embeddings
from flowers_job.config.model import (
    CacheConfig,
    DataConfig,
    DeltaConfig,
    DistributedConfig,
    EarlyStoppingConfig,
    EmbeddingsConfig,
    JobConfig,
    LoadersConfig,
    ModelConfig,
    PathsConfig,
    PetastormConfig,
    StreamingConfig,
    TablesConfig,
    TrackingConfig,
    TrainConfig,
)

__all__ = [
    "CacheConfig",
    "ConfigDeprecationWarning",
    "ConfigError",
    "DataConfig",
    "DeltaConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "EmbeddingsConfig",
    "JobConfig",
    "LoadersConfig",
    "ModelConfig",
    "PathsConfig",
    "PetastormConfig",
    "StreamingConfig",
    "TablesConfig",
    "TrackingConfig",
    "TrainConfig",
    "load_config",
    "parse_overrides",
    "resolve_embeddings",
]
