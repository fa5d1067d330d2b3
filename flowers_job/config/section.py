"""The base of every configuration section: frozen, and every key checked."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)
