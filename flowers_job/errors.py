"""Errors about the data that more than one layer raises: the driver's tables and shard plans
(:class:`DataError`) and a rank's reading of its shard (:class:`ShardError`)."""

from __future__ import annotations

__all__ = ["DataError", "ShardError"]


class DataError(RuntimeError):
    """The tables cannot be trained on as they are (missing, inconsistent, too small), or
    their loader cache cannot be written. Raised on the driver, before any rank starts."""


class ShardError(RuntimeError):
    """A rank read other rows than the driver's plan: more or fewer batches or rows, or rows
    dropped or read twice across the ranks."""
