"""The data sections of the configuration: where the photos are (``data``), where the Delta
tables live (``tables``) and the loaders' own settings (``loaders``), with the base every
section derives from. :mod:`flowers_job.config.model` assembles them into
:class:`~flowers_job.config.model.JobConfig` beside the training sections.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from flowers_job.location import is_remote, to_location

__all__ = [
    "SAFE_RETENTION_HOURS",
    "DataConfig",
    "DeltaConfig",
    "ImageFormat",
    "LoaderName",
    "LoadersConfig",
    "PetastormConfig",
    "Section",
    "StreamingConfig",
    "TablesConfig",
    "check_identifier",
]

SAFE_RETENTION_HOURS = 168
"""Delta's safe minimum for VACUUM's retention (``delta.deletedFileRetentionDuration``'s
default, 7 days), below which Delta's own check refuses a VACUUM: a concurrent writer's
files not yet committed may be older than a shorter retention."""

ImageFormat = Literal["JPEG", "PNG"]
"""``data.image_formats``' values: the image formats the job decodes (Pillow's names)."""

LoaderName = Literal["auto", "petastorm", "streaming", "delta"]
"""``data.loader``'s values: a registered loader (:data:`flowers_job.loaders.LOADERS`, whose
keys a test holds equal to these) or 'auto'."""


class Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(Section):
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
    """Decompression-bomb guard (Pillow's default): larger images are quarantined
    (``too_many_pixels``). Applied by the job's own decode, which raises Pillow's process-wide limit
    to this value for the decode (:func:`flowers_job.vision.limits.pillow_pixel_limit`), so it may
    be set above Pillow's default too."""
    image_formats: tuple[ImageFormat, ...] = ("JPEG", "PNG")
    """Image formats decoded (Pillow's names, case-insensitive): Pillow's ``formats=`` in every
    decode of ingest, predict and the served model, so that no other decoder ever reads a
    file. A file of another format, whatever its name, is quarantined as
    ``unsupported_format`` naming the format its signature shows (PSD, TIFF, WEBP, ...):
    the workaround of CVE-2026-25990's advisory (a crafted PSD writes out of bounds in
    Pillow 10.3.0-12.1.1). Only JPEG and PNG are supported."""
    max_aspect_ratio: float = Field(20.0, ge=1.0)
    """Long side / short side at most; a more elongated image is quarantined
    (``extreme_aspect``), read from its header, never decoded: resizing the short side of a
    4000x1 image to 256 px makes it 1,024,000x256 (about 1 GB). The 3,670 real photos reach
    5.48 (1024x187, tulips/6905876618_12732b74de_b.jpg); 20 keeps
    wide panoramas."""
    max_long_side_pixels: int = Field(16_384, ge=1)
    """Pixels of the longer side at most; a longer image is quarantined
    (``long_side_too_large``), read from its header. The real photos' longest side is 1,024
    px; 16,384 keeps a 200-megapixel camera's 16,320x12,240."""
    max_file_bytes: int = Field(128 * 2**20, ge=1)
    """Bytes of one image file at most (128 MiB); a larger file is quarantined
    (``file_too_large``) from its listed size, without being read. The real photos' largest
    is 281,953 bytes; a 100-megapixel camera JPEG is about 40 MB."""
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Ingest fails, writing nothing, when more than this fraction of files is quarantined
    (counted over the whole table after the change, for an incremental ingest too)."""
    full_ingest: bool = False
    """Decode every file and rewrite both tables, instead of decoding only the files that are
    new or changed (path, size or modification time) and MERGEing them (``--full``)."""
    retention_hours: int = Field(SAFE_RETENTION_HOURS, ge=0, le=87_600)
    """VACUUM after each ingest that writes removes the files of Delta versions older than
    this (whole hours, as Delta's VACUUM counts them; Delta's default is 168, 7 days),
    except those of versions that a kept loader cache or a registered model's lineage
    names. Below :data:`SAFE_RETENTION_HOURS` only with ``allow_short_retention``."""
    allow_short_retention: bool = False
    """Allow a ``retention_hours`` below Delta's safe minimum (:data:`SAFE_RETENTION_HOURS`).
    Such a VACUUM can delete files that a concurrent writer has written but not committed
    yet, so it runs only while this command holds the output's lease
    (:mod:`flowers_job.driver.lease`), which keeps every other flowers_job command out;
    without the lease VACUUM keeps :data:`SAFE_RETENTION_HOURS`. Nothing protects against a
    writer outside flowers_job (docs/failures.md)."""
    loader: LoaderName = "auto"
    """How the ranks read their shards: a registered loader (:data:`flowers_job.loaders.LOADERS`):
    'streaming' (Mosaic Streaming MDS shards, shipped with Databricks Runtime ML 15.2+ and the
    only one that runs beside Spark 4.1+), 'petastorm' (Parquet cache; needs pyarrow < 15
    and NumPy < 2: the legacy environment), 'delta' (the ranks read the ``images`` table's own
    files at the planned version with delta-rs: no cache), or 'auto' = 'delta' where
    deltalake is installed, for path tables on classic Spark, else the first that can run
    here (:data:`flowers_job.loaders.LOADERS`). Checked before Spark starts
    (:func:`flowers_job.loaders.resolve_loader`). Each loader's own settings are under
    ``loaders.<name>``."""
    loader_workers: int = Field(0, ge=0, le=64)
    """Processes per rank that decode and augment ahead of the training step, overlapping it
    with compute, for every loader: Streaming's DataLoader workers, Petastorm's reader
    processes (with ``loaders.petastorm.reader_pool_type='process'``). 0 decodes in the rank
    itself, the right choice when the ranks already use every core (this machine: 2 ranks on
    2 cores); on a GPU host with spare cores, 2-4 per GPU."""
    decode_device: Literal["auto", "loader", "device"] = "auto"
    """Where the stored JPEGs are decoded and augmented. 'loader': one by one in the loader
    (TorchCodec, else Pillow, on the host's cores); 'device': a whole batch at once on the
    rank's device (TorchCodec, nvJPEG on a GPU; :mod:`flowers_job.vision.batch_decode`);
    'auto': 'device' on a GPU, 'loader' on CPU ranks (where one by one is faster
    than batched: docs/performance.md)."""
    prefetch_to_device: int | None = Field(None, ge=0, le=64)
    """Batches a background thread of each GPU rank reads, pins, copies to the device and
    (``decode_device``) decodes ahead of the step, so the step never waits for the host.
    None: 2 on a GPU; CPU ranks always read in the step's thread (0)."""

    @field_validator("image_formats", mode="before")
    @classmethod
    def _formats_upper(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            value = tuple(dict.fromkeys(v.upper() if isinstance(v, str) else v for v in value))
            if not value:
                raise ValueError("give at least one image format (JPEG, PNG)")
        return value

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if not self.extensions:
            raise ValueError("extensions: give at least one image file extension")
        if self.retention_hours < SAFE_RETENTION_HOURS and not self.allow_short_retention:
            raise ValueError(
                f"retention_hours: {self.retention_hours} h is below Delta's safe minimum of "
                f"{SAFE_RETENTION_HOURS} h, which keeps a concurrent writer's uncommitted "
                "files from being vacuumed; set data.allow_short_retention=true as well to "
                "allow it (VACUUM then uses it only while this command holds the output's "
                "lease)"
            )
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


class PetastormConfig(Section):
    """``data.loader=petastorm`` only (:mod:`flowers_job.loaders.petastorm.loader`)."""

    reader_pool_type: Literal["dummy", "process"] = "dummy"
    """Petastorm reader pool. 'thread' is not offered: it can end a shard early
    (docs/known-issues.md, "Petastorm"). 'process' decodes in ``data.loader_workers``
    processes per rank."""
    shuffle_buffer_rows: int = Field(256, ge=0)
    """Rows held in Petastorm's shuffling queue per process (0 = no row-level shuffle)."""


class StreamingConfig(Section):
    """``data.loader=streaming`` only (:mod:`flowers_job.loaders.streaming.streaming_loader`). Streaming
    shuffles the whole split every epoch (no buffer to size)."""

    prefetch_batches: int = Field(2, ge=1, le=64)
    """Batches each DataLoader worker decodes ahead (Streaming's ``prefetch_factor``; with
    ``data.loader_workers`` > 0)."""
    local_cache_dir: str | None = None
    """With the loader cache in an object store: the directory on each host's own disk where
    Streaming copies the shards it reads (its ``local=``; ``remote=`` is the store). None =
    ``<temp dir>/flowers-streaming``. Removed after the run."""
    local_cache_limit_bytes: int | None = Field(None, ge=2**27)
    """Bytes of shards one host keeps in ``local_cache_dir`` (Streaming's ``cache_limit``:
    beyond it, the least recently used shards are dropped and fetched again when needed).
    At least 128 MiB (two 64 MiB shards). None = no limit."""


class DeltaConfig(Section):
    """``data.loader=delta`` only (:mod:`flowers_job.loaders.delta.table_loader`)."""

    shuffle_window_rows: int = Field(1024, ge=1, le=1 << 20)
    """Training: each epoch visits the split's files in a new order, and shuffles each run of
    this many consecutive rows of a rank's share; a larger window mixes more files at the
    cost of its rows' stored images held in memory (about 30 KB each at 224 px)."""
    prefetch_batches: int = Field(2, ge=1, le=64)
    """Batches each decoding process works on ahead of the step (the DataLoader's
    ``prefetch_factor``; with ``data.loader_workers`` > 0)."""


class LoadersConfig(Section):
    """Each loader's own settings, one section per registered loader."""

    petastorm: PetastormConfig = PetastormConfig()
    streaming: StreamingConfig = StreamingConfig()
    delta: DeltaConfig = DeltaConfig()


_MAX_NAME = 255
_FORBIDDEN = re.compile(r"[.\s/`\x00-\x1f\x7f]")
"""Characters a catalog or schema name may not hold: Unity Catalog refuses a period, a
space, a forward slash and the ASCII control characters (Databricks' documentation, "Names":
"Object names cannot exceed 255 characters" and the characters "not allowed"); a backtick is
refused as well, so that every part can be quoted as ```part``` in SQL and a name never needs
an escape. Any other whitespace is refused with the space."""


def check_identifier(value: str) -> str:
    """``value``, checked as one part of a catalog name (a catalog or a schema).

    Returns:
        ``value`` unchanged (Unity Catalog stores names in lower case; Spark's own catalog
        is case-insensitive: the job does not change the case).

    Raises:
        ValueError: empty, longer than 255 characters, or holding a period, whitespace, a
            forward slash, a backtick or a control character, naming the first one found.
    """
    if not value:
        raise ValueError("an empty name; leave the setting out (null) for path tables")
    if len(value) > _MAX_NAME:
        raise ValueError(f"{len(value)} characters, more than Unity Catalog's {_MAX_NAME}")
    if bad := _FORBIDDEN.search(value):
        raise ValueError(
            f"{value!r} holds {bad.group()!r}: a name part may not hold a period, whitespace, "
            "'/', '`' or a control character (give the catalog and the schema as separate "
            "settings, not 'catalog.schema')"
        )
    return value


class TablesConfig(BaseModel):
    """Where the job's Delta tables (``images``, ``quarantine``) live.

    By default they are path tables under ``<output_dir>/tables``. With ``schema`` set they
    are managed tables in a catalog, written and read by name: ``<catalog>.<schema>.images``
    (Unity Catalog's three-level name, the form for Databricks) or ``<schema>.images`` in the
    session's current catalog when ``catalog`` is left out (Spark's own catalog, with
    ``spark.sql.warehouse.dir``, locally).
    """

    # The field cannot be named ``schema`` (it would shadow BaseModel.schema; pydantic warns):
    # it is ``schema_name`` with the alias ``schema``, the only key accepted, and dumps use
    # the alias (:meth:`_dump_schema_as_alias`), so the ranks rebuild the section from
    # model_dump(). Not ``serialize_by_alias``: pydantic 2.11 added it, and Databricks
    # Runtime 17.3 and 18 ship 2.10.6, which ignores it.
    model_config = ConfigDict(extra="forbid", frozen=True)

    catalog: str | None = None
    """The catalog of the tables (Unity Catalog: e.g. ``main``); None: the session's current
    catalog. Needs ``schema``."""
    schema_name: str | None = Field(None, alias="schema")
    """The schema (database) of the tables, written ``tables.schema``; None: path tables
    under ``<output_dir>/tables``. Ingest creates it when it does not exist."""

    @model_serializer(mode="wrap")
    def _dump_schema_as_alias(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and "schema_name" in data:
            data["schema"] = data.pop("schema_name")
        return data

    @field_validator("catalog", "schema_name")
    @classmethod
    def _identifier(cls, value: str | None) -> str | None:
        return None if value is None else check_identifier(value)

    @model_validator(mode="after")
    def _check(self) -> TablesConfig:
        if self.catalog is not None and self.schema_name is None:
            raise ValueError(
                f"schema: required with tables.catalog={self.catalog!r} (tables are named "
                "<catalog>.<schema>.<table>)"
            )
        return self

    @property
    def in_catalog(self) -> bool:
        """Whether the tables are catalog tables (by name) rather than path tables."""
        return self.schema_name is not None

    def namespace(self) -> tuple[str, ...]:
        """``(catalog, schema)`` or ``(schema,)``: the parts before a table's own name;
        empty for path tables."""
        if self.schema_name is None:
            return ()
        return (self.catalog, self.schema_name) if self.catalog else (self.schema_name,)
