"""The ``data`` section: where the photos are, how they are stored, split and read.

Kept apart from :mod:`flowers_job.config.model` (the line limit of a module) and imported
there: :class:`~flowers_job.config.model.JobConfig`'s ``data`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flowers_job.config.section import Section as _Section
from flowers_job.location import is_remote, to_location

__all__ = ["DataConfig"]


class DataConfig(_Section):
    """Where the photos are and how they become tensors."""

    images: Path | str | None = None
    """Images root laid out as ``<images>/<label>/<file>``; the folder name is the label. A
    local (or mounted) directory, kept as a ``Path``, or an object-store URI
    (``s3a://bucket/photos``, ``gs://...``: a scheme and ``://``), kept as a string without
    its trailing ``/`` and never resolved as a local path (a ``Path`` would fold ``//``);
    listed and read through pyarrow's file systems
    (:mod:`flowers_job.photos.object_listing`), with credentials from the environment only: a
    URI with credentials in it (``s3a://key:secret@bucket``) is refused."""

    @field_validator("images", mode="before")
    @classmethod
    def _images_path_or_uri(cls, value: Any) -> Any:
        if isinstance(value, str) and is_remote(value):
            return to_location(value).url  # refuses credentials in the URI
        return Path(value) if isinstance(value, str) else value

    image_size: int = Field(224, ge=32, le=1024)
    """Side in pixels of the square crop fed to the model. Unset, the native resolution of
    ``model.architecture`` (:func:`flowers_job.vision.backbones.native_image_size`: EfficientNet-Lite0
    224, Lite1 240, Lite2 260, torchvision models 224); set, that value, whatever the
    architecture (a smaller crop trains faster at some cost in accuracy)."""
    resize_ratio: float = Field(256 / 224, ge=1.0, le=2.0)
    """Stored images have their shorter side = ``round(image_size * resize_ratio)`` px; training
    crops from that (the 256 -> 224 resize/crop of torchvision's ImageNet reference)."""
    jpeg_quality: int = Field(90, ge=50, le=100)
    """JPEG quality of the re-encoded images stored in the Delta table."""
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Fraction of photos in the validation split (decided by a content hash: docs/architecture.md).
    Validation picks the best epoch and decides early stopping."""
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Fraction of photos in the test split: held out of training, early stopping and the
    choice of the best epoch, and scored once, with the restored best weights, at the end.
    Drawn from the same hash as ``val_fraction`` (``val_fraction <= u < val_fraction +
    test_fraction``), so changing it leaves the validation split as it is."""
    split_seed: int = 42
    """Seed mixed into the split hash; change it to draw another split."""
    partitions_per_process: int = Field(2, ge=1, le=64)
    """num_partitions = num_processes * partitions_per_process (the Databricks guides use 2)."""
    extensions: tuple[str, ...] = ("jpg", "jpeg", "png")
    """File extensions (case-insensitive) treated as images; other files are quarantined."""
    max_image_pixels: int = Field(89_478_485, ge=1)
    """Decompression-bomb guard (Pillow's default): larger images are quarantined."""
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Ingest fails, writing nothing, when more than this fraction of files is quarantined
    (counted over the whole table after the change, for an incremental ingest too)."""
    full_ingest: bool = False
    """Decode every file and rewrite both tables, instead of decoding only the files that are
    new or changed (path, size or modification time) and MERGEing them (``--full``)."""
    retention_hours: int = Field(168, ge=0, le=87_600)
    """VACUUM after each ingest that writes removes the files of Delta versions older than
    this (whole hours, as Delta's VACUUM counts them; Delta's default is 168, 7 days),
    except those of versions that a kept loader cache or a registered model's lineage
    names."""
    loader: str = "auto"
    """How the ranks read their shards: a registered loader (:data:`flowers_job.loaders.LOADERS`):
    'petastorm' (Parquet cache, the local pinned stack; needs pyarrow < 15 and NumPy < 2),
    'streaming' (Mosaic Streaming MDS shards, shipped with Databricks Runtime ML 15.2+ and the
    only one that runs on 16.4+), or 'auto' = the first that can run here. Checked before
    Spark starts (:func:`flowers_job.loaders.resolve_loader`). Each loader's own settings
    are under ``loaders.<name>``."""
    loader_workers: int = Field(0, ge=0, le=64)
    """Processes per rank that decode and augment ahead of the training step, overlapping it
    with compute, for every loader: Streaming's DataLoader workers, Petastorm's reader
    processes (with ``loaders.petastorm.reader_pool_type='process'``). 0 decodes in the rank
    itself, the right choice when the ranks already use every core (this machine: 2 ranks on
    2 cores); on a GPU host with spare cores, 2-4 per GPU."""
    decode_device: Literal["auto", "loader", "device"] = "auto"
    """Where the stored JPEGs are decoded and augmented. 'loader': one by one in the loader
    (Pillow, on the host's cores); 'device': a whole batch at once on the rank's device
    (``torchvision.io.decode_jpeg``, nvJPEG on a GPU; :mod:`flowers_job.vision.batch_decode`);
    'auto': 'device' on a GPU, 'loader' on CPU ranks (where Pillow one by one is faster: 64
    photos at 224 px took 0.6 s against 2.0 s batched, 2 cores under load, 2026-11-26)."""
    prefetch_to_device: int | None = Field(None, ge=0, le=64)
    """Batches a background thread of each GPU rank reads, pins, copies to the device and
    (``decode_device``) decodes ahead of the step, so the step never waits for the host.
    None: 2 on a GPU; CPU ranks always read in the step's thread (0)."""

    @field_validator("loader")
    @classmethod
    def _known_loader(cls, value: str) -> str:
        from flowers_job.loaders import LOADERS

        if value != "auto" and value not in LOADERS:
            raise ValueError(f"Input should be 'auto' or one of {sorted(LOADERS)}, not {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if not self.extensions:
            raise ValueError("extensions: give at least one image file extension")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"test_fraction: val_fraction + test_fraction = "
                f"{self.val_fraction + self.test_fraction:g} leaves no photo for training; "
                "their sum must be below 1"
            )
        return self

    @property
    def stored_short_side(self) -> int:
        """Shorter side, in pixels, of the images stored in the Delta tables."""
        return round(self.image_size * self.resize_ratio)
