"""The deletion list of an appended cache entry: which copies of a row are dead (a copy in a
segment before the row's ``before``), stored as one int64 ``.npy`` array and loaded without
pickle, refusing anything else; and when an entry is written whole instead of grown."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flowers_job.errors import DataError
from flowers_job.loaders.base import Deletions, live_mask, read_deletions, write_deletions

pytestmark = [pytest.mark.timeout(60), pytest.mark.tier("gate")]


def test_a_copy_is_dead_only_in_a_segment_before_its_rows_mark() -> None:
    """Row 5 removed at version 3; row 9 rewritten at version 4 (its copy of segment 4 is
    the live one); row 7 untouched."""
    deletions = Deletions(np.array([5, 9], np.int64), np.array([3, 4], np.int64))
    row_id = torch.tensor([5, 5, 9, 9, 7, 12, -3], dtype=torch.int64)
    segment = torch.tensor([0, 3, 2, 4, 0, 4, 0], dtype=torch.int64)
    assert live_mask(row_id, segment, deletions).tolist() == [
        False,  # row 5 in segment 0 < 3: removed
        True,  # a copy of row 5 written at 3 (re-added): alive
        False,  # row 9's old copy
        True,  # row 9's new copy
        True,
        True,  # an id above every listed one
        True,  # an id below every listed one
    ]
    assert live_mask(row_id, segment, None).all()
    assert live_mask(row_id, segment, Deletions(np.empty(0, np.int64), np.empty(0, np.int64))).all()


def test_the_list_round_trips_and_anything_else_is_refused(tmp_path: Path) -> None:
    # xxhash64 row ids span int64: their differences overflow it
    deletions = Deletions(
        np.array([-(2**63), -2, 5, 2**63 - 1], np.int64), np.array([1, 1, 3, 4], np.int64)
    )
    url = (tmp_path / "deletions.npy").as_uri()
    assert write_deletions(url, deletions) == 128 + 16 * 4
    back = read_deletions(url)
    assert back is not None and back.row_ids.tolist() == [-(2**63), -2, 5, 2**63 - 1]
    assert back.before.tolist() == [1, 1, 3, 4]
    assert read_deletions(None) is None

    bad = {
        "unsorted.npy": np.array([[5, 2], [1, 1]], np.int64),
        "floats.npy": np.array([[1.0, 2.0], [1.0, 1.0]]),
        "one_row.npy": np.array([1, 2, 3], np.int64),
    }
    for name, array in bad.items():
        np.save(tmp_path / name, array)
        with pytest.raises(DataError, match="not an int64"):
            read_deletions((tmp_path / name).as_uri())
    np.save(tmp_path / "objects.npy", np.array([[{"x": 1}], [{"y": 2}]], dtype=object))
    with pytest.raises(DataError, match="cannot be read"):  # no pickle is loaded
        read_deletions((tmp_path / "objects.npy").as_uri())


@pytest.mark.parametrize(
    ("dead", "stored", "segments", "why"),
    [
        (20, 100, 16, None),  # at both limits: it grows
        (21, 100, 2, "21 of its 100 rows would be dead"),
        (0, 100, 17, "it would have 17 segments"),
    ],
)
def test_an_entry_is_compacted_past_its_dead_rows_or_segments(
    dead: int, stored: int, segments: int, why: str | None
) -> None:
    """``cache.compact_dead_fraction`` (0.2) and ``cache.max_segments`` (16), their
    defaults: past either, the split is written whole, and the log says which."""
    from flowers_job.config.model import CacheConfig
    from flowers_job.loaders.cache_growth import compaction_reason

    reason = compaction_reason(dead, stored, segments, CacheConfig())
    assert reason == why if why is None else (reason or "").startswith(why)
