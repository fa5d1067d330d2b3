"""Configuration: defaults, YAML + overrides, and errors that name the field."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from flowers_job.config import (
    ConfigDeprecationWarning,
    ConfigError,
    JobConfig,
    load_config,
    parse_overrides,
    resolve_embeddings,
)
from flowers_job.location import Location
from tests.support import ROOT_DIR
from tests.support.processes import run_cli

pytestmark = pytest.mark.tier("gate")


def test_defaults_are_valid_and_derived_values_follow(tmp_path: Path) -> None:
    cfg = load_config(None, None, **{"paths.output_dir": tmp_path})
    assert cfg.world_size == cfg.distributed.num_processes == 2
    assert cfg.global_batch_size == cfg.train.per_device_batch_size * 2
    assert cfg.num_partitions % cfg.world_size == 0
    assert cfg.num_partitions == 2 * cfg.world_size  # the guides' devices x 2
    assert cfg.tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert cfg.model.resolved_weights == "package"


def test_yaml_file_then_overrides_take_precedence(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("train:\n  epochs: 7\n  per_device_batch_size: 16\ndata:\n  image_size: 160\n")
    cfg = load_config(
        f,
        ["train.epochs=3", "distributed.local_mode=false", "distributed.num_processes=4"],
        **{"paths.output_dir": tmp_path},
    )
    assert cfg.train.epochs == 3
    assert cfg.train.per_device_batch_size == 16
    assert cfg.data.image_size == 160
    assert cfg.distributed.local_mode is False
    assert cfg.global_batch_size == 64


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.epochs=0", "train.epochs"),
        ("train.per_device_batch_size=-1", "train.per_device_batch_size"),
        ("data.image_size=abc", "data.image_size"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("data.test_fraction=0", "data.test_fraction"),
        ("distributed.num_processes=0", "distributed.num_processes"),
        ("train.lr_scaling=cubic", "train.lr_scaling"),
        ("train.early_stopping.patience=-2", "train.early_stopping.patience"),
        ("loaders.petastorm.reader_pool_type=thread", "loaders.petastorm.reader_pool_type"),
        ("loaders.streaming.prefetch_batches=0", "loaders.streaming.prefetch_batches"),
        ("data.loader=parquet", "data.loader"),
        ("trian.epochs=3", "trian"),
        ("train.epoch=3", "train.epoch"),
    ],
)
def test_invalid_values_name_the_field(tmp_path: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], **{"paths.output_dir": tmp_path})
    assert f"  {field}:" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["distributed.backend=nccl", "distributed.use_gpu=false"], "distributed.backend"),
        (["model.weights=file"], "model.weights_path"),
        (["model.weights=package", "model.architecture=resnet18"], "model.weights"),
        (["model.weights=none"], "model.freeze_backbone"),
        (["model.architecture=not_a_net"], "model.architecture"),
        (["data.extensions=[]"], "data.extensions"),
        (["data.val_fraction=0.5", "data.test_fraction=0.5"], "data.test_fraction"),
        (["train.epochs=3", "train.warmup_epochs=3"], "train.warmup_epochs"),
        (
            ["train.early_stopping.monitor=val_accuracy", "train.early_stopping.min_delta=1"],
            "train.early_stopping.min_delta",
        ),
        (
            [
                "train.early_stopping.monitor=val_accuracy",
                "train.early_stopping.stopping_threshold=90",
            ],
            "train.early_stopping.stopping_threshold",
        ),
        (["train.early_stopping.stopping_threshold=0"], "train.early_stopping.stopping_threshold"),
        (["tracking.password=pw"], "tracking.username"),
    ],
)
def test_cross_field_checks_name_the_dotted_field(
    tmp_path: Path, overrides: list[str], field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, **{"paths.output_dir": tmp_path})
    assert f"\n  {field}: " in str(err.value)


def test_valid_neighbours_of_the_cross_field_checks(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "train.epochs=3",
            "train.warmup_epochs=2.5",
            "train.early_stopping.monitor=val_accuracy",
            "train.early_stopping.stopping_threshold=0.95",
            "tracking.username=ann",
            "tracking.password=pw",
        ],
        **{"paths.output_dir": tmp_path},
    )
    assert cfg.train.early_stopping.mode == "max"


def test_secrets_are_masked_and_left_out_of_every_dump(tmp_path: Path) -> None:
    """tracking.password/token: SecretStr, excluded from model_dump (the workers' job, MLflow
    params, checkpoints) and masked in repr/str."""
    f = tmp_path / "job.yaml"
    f.write_text("tracking:\n  username: ann\n  password: pw-SENTINEL\n  token: tk-SENTINEL\n")
    cfg = load_config(f, None, **{"paths.output_dir": tmp_path})
    assert cfg.tracking.password is not None and cfg.tracking.token is not None
    assert cfg.tracking.password.get_secret_value() == "pw-SENTINEL"
    assert cfg.tracking.token.get_secret_value() == "tk-SENTINEL"
    dumps = [
        repr(cfg),
        str(cfg),
        str(cfg.model_dump()),
        str(cfg.model_dump(mode="json")),
        cfg.model_dump_json(),
    ]
    for text in dumps:
        assert "SENTINEL" not in text
    dumped = cfg.model_dump(mode="json")
    assert dumped["tracking"]["username"] == "ann"
    assert "password" not in dumped["tracking"] and "token" not in dumped["tracking"]
    rebuilt = type(cfg).model_validate(dumped)  # what a worker rebuilds: no secrets at all
    assert rebuilt.tracking.password is None and rebuilt.tracking.token is None


def test_output_dir_is_required() -> None:
    with pytest.raises(ConfigError, match=r"paths\.output_dir"):
        load_config()


def test_parse_overrides_types_and_errors() -> None:
    assert parse_overrides(["a.b=3", "a.c=false", "d=null", "e=0.001"]) == {
        "a": {"b": 3, "c": False},
        "d": None,
        "e": 0.001,
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["train.epochs"])
    with pytest.raises(ConfigError, match="both a value and a section"):
        parse_overrides(["a=1", "a.b=2"])


@pytest.mark.parametrize(("scaling", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_learning_rate_scaling(tmp_path: Path, scaling: str, factor: float) -> None:
    cfg = load_config(
        None,
        [f"train.lr_scaling={scaling}", "train.base_learning_rate=0.01"],
        **{"paths.output_dir": tmp_path},
    )
    assert math.isclose(cfg.train.learning_rate(4), 0.01 * factor)
    assert math.isclose(cfg.train.learning_rate(1), 0.01)


def test_cli_rejects_bad_config_before_spark_starts(tmp_path: Path) -> None:
    proc = run_cli(
        "run",
        "--images",
        str(tmp_path),
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        "train.per_device_batch_size=0",
        timeout=120,
    )
    assert proc.returncode == 2
    assert "train.per_device_batch_size" in proc.stderr
    assert "Ivy" not in proc.stderr and "SparkContext" not in proc.stderr  # no JVM was started
    assert not (tmp_path / "out").exists()


def test_example_config_matches_the_defaults(tmp_path: Path) -> None:
    example = ROOT_DIR / "configs" / "example.yaml"
    cfg = load_config(example, None, **{"paths.output_dir": tmp_path})
    default = load_config(None, None, **{"paths.output_dir": tmp_path})
    assert cfg.model_dump(exclude={"data": {"resize_ratio"}}) == default.model_dump(
        exclude={"data": {"resize_ratio"}}
    )
    assert cfg.data.stored_short_side == default.data.stored_short_side


@pytest.mark.parametrize(
    ("overrides", "reads_table", "on"),
    [
        ([], True, True),
        ([], False, False),
        (["model.freeze_backbone=false"], True, False),
        (["model.weights=torchvision"], True, False),
        (["model.architecture=resnet18"], True, False),
    ],
)
def test_auto_embeddings_are_on_where_the_frozen_backbone_and_the_table_reader_are(
    tmp_path: Path, overrides: list[str], reads_table: bool, on: bool
) -> None:
    """``embeddings.enabled: auto`` (the default) is decided once the loader is known: on
    with a frozen backbone, weights every executor can load, and a loader that reads the
    tables; then the recipe's settings are the defaults, otherwise the image recipe's."""
    cfg = load_config(None, overrides, **{"paths.output_dir": tmp_path})
    assert cfg.embeddings.enabled == "auto"
    got = resolve_embeddings(cfg, reads_table)
    assert got.embeddings.enabled is on
    recipe = (320, 40, 0.0, 3) if on else (cfg.data.image_size, 5, 0.1, 2)
    assert (
        got.data.image_size,
        got.train.epochs,
        got.train.label_smoothing,
        got.train.early_stopping.patience,
    ) == recipe
    assert resolve_embeddings(got, reads_table) is got  # decided once


def test_the_embeddings_recipe_fills_only_what_is_not_given(tmp_path: Path) -> None:
    """Settings given beside the embeddings win over the recipe's, with 'auto' as with
    true; the rebuilt configuration keeps every other setting and the resolved loader."""
    given = ["data.image_size=32", "train.epochs=3", "train.early_stopping.patience=1"]
    cfg = load_config(None, [*given, "train.seed=7"], **{"paths.output_dir": tmp_path})
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"loader": "delta"})})
    auto = resolve_embeddings(cfg, reads_table=True)
    explicit = load_config(
        None,
        [*given, "train.seed=7", "embeddings.enabled=true", "data.loader=delta"],
        **{"paths.output_dir": tmp_path},
    )
    assert auto.model_dump() == explicit.model_dump()
    assert auto == explicit and hash(auto) == hash(explicit)  # what was given is not compared
    assert (auto.data.image_size, auto.train.epochs, auto.train.early_stopping.patience) == (
        32,
        3,
        1,
    )
    assert (auto.train.label_smoothing, auto.train.seed, auto.data.loader) == (0.0, 7, "delta")
    off = load_config(None, ["embeddings.enabled=false"], **{"paths.output_dir": tmp_path})
    assert (off.data.image_size, off.train.epochs, off.train.label_smoothing) == (224, 5, 0.1)


def test_the_augmented_preset_is_the_image_recipe(tmp_path: Path) -> None:
    """``configs/augmented.yaml``, the recipe the default is compared with, turns the
    embeddings off and keeps the image recipe's settings."""
    preset = ROOT_DIR / "configs" / "augmented.yaml"
    cfg = resolve_embeddings(load_config(preset, None, **{"paths.output_dir": tmp_path}), True)
    assert cfg.embeddings.enabled is False
    assert (cfg.data.image_size, cfg.train.epochs, cfg.train.label_smoothing) == (224, 5, 0.1)


def test_the_finetune_preset_is_valid_and_trains_the_backbone(tmp_path: Path) -> None:
    preset = ROOT_DIR / "configs" / "finetune.yaml"
    cfg = load_config(preset, None, **{"paths.output_dir": tmp_path})
    assert cfg.model.freeze_backbone is False
    assert (cfg.data.image_size, cfg.train.epochs, cfg.train.lr_schedule) == (224, 7, "cosine")


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [
        ("data.reader_pool_type", "loaders.petastorm.reader_pool_type", "process"),
        ("data.shuffle_buffer_rows", "loaders.petastorm.shuffle_buffer_rows", 16),
        ("data.prefetch_batches", "loaders.streaming.prefetch_batches", 4),
        ("paths.petastorm_cache_url", "paths.cache_url", Location.of("/tmp/flowers-cache")),
    ],
)
def test_a_renamed_key_still_works_for_one_release_and_its_warning_names_the_new_key(
    tmp_path: Path, old: str, new: str, value: object
) -> None:
    with pytest.warns(ConfigDeprecationWarning, match=rf"{old} is deprecated: use {new}"):
        given = value.as_uri() if isinstance(value, Location) else value
        cfg = load_config(None, [f"{old}={given}"], **{"paths.output_dir": tmp_path})
    section, *path = new.split(".")
    node: object = getattr(cfg, section)
    for part in path:
        node = getattr(node, part)
    assert node == value
    # the ranks, checkpoints and MLflow params see only the new key
    old_section, old_key = old.split(".")
    assert old_key not in cfg.model_dump(mode="json")[old_section]
    assert JobConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_an_old_and_a_new_key_that_disagree_are_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            ["data.reader_pool_type=process", "loaders.petastorm.reader_pool_type=dummy"],
            **{"paths.output_dir": tmp_path},
        )
    message = str(err.value)
    assert "  loaders.petastorm.reader_pool_type: set to 'dummy'" in message
    assert "deprecated data.reader_pool_type" in message


def test_a_config_file_with_the_old_keys_loads_with_warnings(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text(
        "data:\n  reader_pool_type: process\n  loader_workers: 2\n"
        "paths:\n  petastorm_cache_url: file:///tmp/c\n"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(old, None, **{"paths.output_dir": tmp_path})
    assert {str(w.message).split(" is ")[0] for w in caught} == {
        "configuration key data.reader_pool_type",
        "configuration key paths.petastorm_cache_url",
    }
    assert cfg.loaders.petastorm.reader_pool_type == "process"
    assert cfg.data.loader_workers == 2 and str(cfg.paths.cache_url) == "/tmp/c"


def test_cli_refuses_a_missing_images_root_before_spark_starts(tmp_path: Path) -> None:
    """The images root is checked with the configuration, before the JVM starts."""
    proc = run_cli(
        "run", "--images", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "out")
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"IngestError: data.images: {tmp_path / 'nowhere'} is not a directory" in proc.stderr
    assert "Ivy" not in proc.stderr and "SparkContext" not in proc.stderr  # no JVM was started
    assert not (tmp_path / "out").exists()


def test_predict_with_an_unknown_model_and_no_store_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --output-dir the store is ./mlflow.db; a lookup there must not create it."""
    from flowers_job.cli import main

    monkeypatch.chdir(tmp_path)
    # predict takes MLFLOW_TRACKING_URI first; mlflow.set_tracking_uri in this process (an
    # earlier test's job) sets it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = ["predict", "--model", "models:/nope/1", "--images", str(tmp_path)]
    assert main([*args, "--output-table", str(tmp_path / "scored")]) == 1
    assert f"no MLflow store at {tmp_path / 'mlflow.db'}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
