"""The driver's failure report keeps each rank's message readable on its first line: a
message that starts with a line break (matplotlib's mathtext error) is not cut to nothing."""

from __future__ import annotations

import io
import time
import traceback
from pathlib import Path

import pytest

from flowers_job.driver.failures import failure
from flowers_job.runtime.reports import FAILURE_SUFFIX, RANKS_FILE, write_json

pytestmark = pytest.mark.tier("gate")


def _report(folder: Path, rank: int, exc: BaseException) -> None:
    """``rank-<r>.json`` as a rank writes it (:func:`flowers_job.train.rank.train_worker`)."""
    write_json(
        folder / f"rank-{rank}{FAILURE_SUFFIX}",
        {
            "rank": rank,
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "time": time.time(),
        },
    )


def _mathtext_error() -> ValueError:
    """The real error of a label folder named ``$\\notacommand$`` drawn in a figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(r"$\notacommand$")
    try:
        fig.savefig(io.BytesIO())
    except ValueError as exc:
        return exc
    finally:
        plt.close(fig)
    raise AssertionError("matplotlib drew $\\notacommand$ without an error")


def test_a_message_that_starts_with_a_line_break_is_shown_on_the_first_line(
    tmp_path: Path,
) -> None:
    exc = _mathtext_error()
    assert str(exc).startswith("\n")  # what cut the report to "ValueError: " before
    write_json(
        tmp_path / RANKS_FILE,
        {"ranks": [{"rank": 0, "host": "vm", "address": "127.0.0.1", "pid": 1}]},
    )
    _report(tmp_path, 0, exc)
    _report(tmp_path, 1, RuntimeError("\n\nsecond\nthird"))
    error = failure(tmp_path, RuntimeError("barrier stage failed"), 2)
    first = str(error).splitlines()[0]
    assert first.startswith("rank 0 failed on host vm (127.0.0.1): ValueError: \\notacommand | ^")
    assert "Unknown symbol: \\notacommand" in first
    assert error.cause is not None and error.cause == first.split(": ", 1)[1]
    assert "\nthen rank 1: RuntimeError: second | third" in str(error)
    assert str(error).endswith(str(exc) + "\n")  # the whole message, in the traceback


def test_an_empty_message_says_so(tmp_path: Path) -> None:
    _report(tmp_path, 0, KeyError())
    error = failure(tmp_path, RuntimeError("barrier stage failed"), 1)
    assert str(error).splitlines()[0] == (
        "rank 0 failed: KeyError: (no message: see the traceback)"
    )
