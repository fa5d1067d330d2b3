"""``--resume`` checks the data and the optimizer: a checkpoint records
the ``images`` table's version, the ingest fingerprint, each split's rows and row checksum
and the test split's digest, and its optimizer's class; a resume on other data or with
another optimizer is a ConfigError (exit 2) naming what changed, old -> new."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flowers_job.config import JobConfig, load_config
from flowers_job.errors import ConfigError
from flowers_job.train.checkpoint import (
    data_changes,
    data_identity,
    load_checkpoint,
    save_checkpoint,
)
from flowers_job.train.resume import check_resumable, check_same_data
from flowers_job.train.step import make_optimizer

pytestmark = pytest.mark.tier("gate")

LABELS = ["daisy", "roses"]
FINGERPRINT = "a1" * 32
TEST_DIGEST = "b2" * 32


def _cfg(tmp_path: Path, *overrides: str) -> JobConfig:
    return load_config(None, list(overrides), **{"paths.output_dir": tmp_path})


def _lineage(version: int = 3, fingerprint: str = FINGERPRINT, test: str = TEST_DIGEST) -> dict:
    """The shape :func:`flowers_job.driver.prepare.lineage` returns."""
    table = {"path": "/out/tables/images", "version": version}
    return {
        "tables": {"images": table, "quarantine": {"path": "/out/tables/quarantine", "version": 1}},
        "splits": {s: {**table, "split": s} for s in ("train", "val", "test")},
        "ingest_fingerprint": fingerprint,
        "test_split_digest": test,
    }


SPLITS = {"train": (2936, 123456789), "val": (367, -42), "test": (367, 987)}


def _saved(tmp_path: Path, cfg: JobConfig, data: dict[str, Any], optimizer: str) -> dict:
    """A real checkpoint, written and read back: a model and its optimizer after one step."""
    model = nn.Linear(4, 2)
    opt = make_optimizer(cfg.train, list(model.parameters()), 1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 1,
        "label_names": LABELS,
        "config": cfg.model_dump(mode="json"),
        "data": data,
        "optimizer_class": type(opt).__name__,
    }
    assert type(opt).__name__ == optimizer
    save_checkpoint(state, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded is not None
    return loaded


def test_the_same_data_resumes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "train.resume=true")
    now = data_identity(_lineage(), SPLITS)
    saved = _saved(tmp_path, cfg, now, "AdamW")
    assert data_changes(saved["data"], copy.deepcopy(now)) == {}
    check_resumable(saved, cfg, LABELS, "AdamW")
    check_same_data(saved, data_identity(_lineage(), dict(SPLITS)), cfg)


def test_a_changed_train_split_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "train.resume=true")
    saved = _saved(tmp_path, cfg, data_identity(_lineage(), SPLITS), "AdamW")
    now = data_identity(_lineage(version=5), {**SPLITS, "train": (2990, 555)})
    with pytest.raises(ConfigError) as err:
        check_same_data(saved, now, cfg)
    message = str(err.value)
    assert err.value.exit_code == 2
    assert "images table /out/tables/images version 3 -> 5" in message
    assert (
        "train split 2936 rows (row checksum 123456789) -> 2990 rows (row checksum 555)" in message
    )
    assert "val split 367" not in message and "test split 367" not in message
    assert "fingerprint" not in message  # the same ingest settings and listing
    assert "train.resume_on_new_data" in message


def test_a_changed_ingest_fingerprint_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "train.resume=true")
    saved = _saved(tmp_path, cfg, data_identity(_lineage(), SPLITS), "AdamW")
    now = data_identity(_lineage(fingerprint="c3" * 32), SPLITS)
    with pytest.raises(ConfigError, match=f"ingest fingerprint {'a1' * 6} -> {'c3' * 6}"):
        check_same_data(saved, now, cfg)


def test_resume_on_new_data_lets_train_change_but_never_the_test_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, "train.resume=true", "train.resume_on_new_data=true")
    saved = _saved(tmp_path, cfg, data_identity(_lineage(), SPLITS), "AdamW")
    new_train = data_identity(
        _lineage(version=5, fingerprint="c3" * 32), {**SPLITS, "train": (3000, 1)}
    )
    with caplog.at_level("WARNING", logger="flowers_job.train"):
        check_same_data(saved, new_train, cfg)  # resumes
    assert "resume_on_new_data" in caplog.text and "train split 2936 rows" in caplog.text
    assert "the test split is unchanged" in caplog.text
    # the same test photos under another content (a photo replaced in place): the digest
    moved = data_identity(_lineage(version=5, test="d4" * 32), SPLITS)
    with pytest.raises(ConfigError, match=f"test split digest {'b2' * 6} -> {'d4' * 6}"):
        check_same_data(saved, moved, cfg)
    # other test photos: rows and checksum
    grown = data_identity(_lineage(version=6), {**SPLITS, "test": (380, 5)})
    with pytest.raises(ConfigError, match=r"test split changed .*367 rows .* -> 380 rows"):
        check_same_data(saved, grown, cfg)


def test_a_checkpoint_without_a_data_record_is_not_checked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path, "train.resume=true")
    saved = _saved(tmp_path, cfg, data_identity(_lineage(), SPLITS), "AdamW")
    del saved["data"]
    with caplog.at_level("WARNING", logger="flowers_job.train"):
        check_same_data(saved, data_identity(_lineage(version=9), SPLITS), cfg)
    assert "records no data" in caplog.text


@pytest.mark.parametrize(
    ("was", "was_class", "now", "now_class"),
    [("adamw", "AdamW", "sgd", "SGD"), ("sgd", "SGD", "adamw", "AdamW")],
)
def test_another_optimizer_is_refused_both_ways(
    tmp_path: Path, was: str, was_class: str, now: str, now_class: str
) -> None:
    """AdamW's state loads silently into SGD, SGD's into AdamW raises ``KeyError: 'step'``
    inside torch: the check names both optimizers first."""
    saved = _saved(tmp_path, _cfg(tmp_path, f"train.optimizer={was}"), {}, was_class)
    cfg = _cfg(tmp_path, "train.resume=true", f"train.optimizer={now}")
    expected = f"optimizer {was_class} \\(train.optimizer='{was}'\\), this run builds {now_class}"
    with pytest.raises(ConfigError, match=expected):
        check_resumable(saved, cfg, LABELS, now_class)
    # the driver's check (no optimizer built there) compares train.optimizer alone
    with pytest.raises(ConfigError, match=f"train.optimizer='{now}'"):
        check_resumable(saved, cfg, LABELS)
    # an older checkpoint without the class: the setting still tells
    del saved["optimizer_class"]
    with pytest.raises(ConfigError, match=f"this run builds {now_class}"):
        check_resumable(saved, cfg, LABELS, now_class)
    # the same optimizer resumes, and its state loads into it
    same = _cfg(tmp_path, "train.resume=true", f"train.optimizer={was}")
    check_resumable(saved, same, LABELS, was_class)
    model = nn.Linear(4, 2)
    make_optimizer(same.train, list(model.parameters()), 1e-3).load_state_dict(saved["optimizer"])
