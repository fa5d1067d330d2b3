"""The loaders' own settings (``loaders.petastorm``, ``loaders.streaming``).

Kept apart from :mod:`flowers_job.config.model` (the line limit of a module) and imported
there: :class:`~flowers_job.config.model.JobConfig`'s ``loaders`` section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowers_job.config.section import Section as _Section

__all__ = ["LoadersConfig", "PetastormConfig", "StreamingConfig"]


class PetastormConfig(_Section):
    """``data.loader=petastorm`` only (:mod:`flowers_job.loaders.petastorm.petastorm_loader`)."""

    reader_pool_type: Literal["dummy", "process"] = "dummy"
    """Petastorm reader pool. 'thread' is not offered: it can end a shard early (STACK.md
    trap 1). 'process' decodes in ``data.loader_workers`` processes per rank."""
    shuffle_buffer_rows: int = Field(256, ge=0)
    """Rows held in Petastorm's shuffling queue per process (0 = no row-level shuffle)."""


class StreamingConfig(_Section):
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


class LoadersConfig(_Section):
    """Each loader's own settings, one section per registered loader."""

    petastorm: PetastormConfig = PetastormConfig()
    streaming: StreamingConfig = StreamingConfig()
