"""A message on one line for a report: its first non-empty lines, bounded, never empty."""

from __future__ import annotations

import pytest

from flowers_job.runtime.reports import (
    NO_MESSAGE,
    SUMMARY_CHARS,
    SUMMARY_LINES,
    summarize_message,
)

pytestmark = pytest.mark.tier("gate")


def test_leading_and_blank_lines_are_skipped_and_the_rest_joined() -> None:
    assert summarize_message("\n\n  first  \n\n second\n") == "first | second"


def test_the_summary_is_bounded_in_lines_and_characters() -> None:
    many = "\n".join(f"line {i}" for i in range(SUMMARY_LINES + 3))
    assert (
        summarize_message(many) == " | ".join(f"line {i}" for i in range(SUMMARY_LINES)) + " | ..."
    )
    long = summarize_message("x" * (SUMMARY_CHARS * 3))
    assert len(long) == SUMMARY_CHARS and long.endswith("...")


@pytest.mark.parametrize("message", ["", "\n", " \n\t\n"])
def test_an_empty_message_is_never_shown_as_nothing(message: str) -> None:
    assert summarize_message(message) == NO_MESSAGE
