"""The benchmarks' common ending: print the results as one JSON line, and keep them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], path: Path | None) -> None:
    """Print ``report`` as one JSON line and, with ``path``, write it there indented
    (parent folders created)."""
    print(json.dumps(report))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
