"""Which test tier CI runs, and the record of the last green full tier (``.ci/full-pass``).

    python3 tools/ci_tier.py choose            # prints "gate" or "full"; the reason on stderr
    python3 tools/ci_tier.py record SECONDS    # after a green `make test-full`

``make test`` (the gate) runs on every landing; ``make test-full`` (everything) runs instead
when the record of the last green full tier cannot vouch for this commit:

- ``.ci/full-pass`` is missing or unreadable, or was written on a tree with uncommitted
  changes;
- the commit it names is not an ancestor of ``HEAD`` (or not in this clone);
- it is older than :data:`MAX_AGE_HOURS`;
- a file of the stack changed since that commit (:data:`STACK`): what builds the
  environments, the clusters and the CI run, where a change can break a test that only
  the full tier runs.

The record is JSON: ``commit``, ``date`` (UTC, ISO 8601), ``seconds`` (the full tier's wall
time), ``cpu`` (the machine's model name, from ``/proc/cpuinfo``) and ``dirty``. Standard
library and ``git`` only: ``.ci/run`` calls it with the system Python before any install.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

RECORD = Path(".ci/full-pass")
"""The record, relative to the repository root (committed)."""
MAX_AGE_HOURS = 24.0
"""A record older than this no longer vouches for the full tier."""
STACK = (
    "pyproject.toml",
    "requirements/",
    "Makefile",
    ".ci/",
    "tools/cluster.py",
    "tools/container.py",
    "tools/own_shm.sh",
    "docker/",
    ".dockerignore",
    "tools/ci_tier.py",
    "tests/conftest.py",
    "tests/support/s3.py",
)
"""Paths (a trailing ``/``: a folder) whose change sends CI to the full tier: the lock files
and project metadata the environments are built from, the Makefile and ``.ci/`` that run the
tiers, the cluster tooling, and the test fixtures that build Spark sessions, S3 servers and
clusters. The record itself (:data:`RECORD`) is not part of it."""


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60, check=False
    )


def _in_stack(path: str) -> bool:
    if path == str(RECORD):
        return False
    return any(path.startswith(p) if p.endswith("/") else path == p for p in STACK)


def choose(root: Path, now: dt.datetime | None = None) -> tuple[str, str]:  # noqa: PLR0911 (one return per reason)
    """The tier CI runs at ``root``'s ``HEAD``, and why.

    Returns:
        ``("gate" | "full", reason)``.
    """
    now = now or dt.datetime.now(dt.UTC)
    path = root / RECORD
    if not path.is_file():
        return "full", f"{RECORD} is missing"
    try:
        record = json.loads(path.read_text())
        commit = str(record["commit"])
        date = dt.datetime.fromisoformat(str(record["date"]))
    except (ValueError, KeyError, TypeError) as exc:
        return "full", f"{RECORD} is unreadable: {type(exc).__name__}: {exc}"
    if record.get("dirty"):
        return "full", f"{RECORD} was written on a tree with uncommitted changes"
    if _git(root, "merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return "full", f"{RECORD} names {commit[:12]}, not an ancestor of HEAD"
    if date.tzinfo is None:
        date = date.replace(tzinfo=dt.UTC)
    age = (now - date).total_seconds() / 3600
    if age > MAX_AGE_HOURS:
        return "full", f"{RECORD} is {age:.1f} h old (more than {MAX_AGE_HOURS:.0f} h)"
    diff = _git(root, "diff", "--name-only", commit, "HEAD")
    if diff.returncode != 0:
        return "full", f"git diff {commit[:12]} HEAD failed: {diff.stderr.strip()}"
    changed = sorted(p for p in diff.stdout.splitlines() if _in_stack(p))
    if changed:
        return "full", f"the stack changed since {commit[:12]}: {', '.join(changed)}"
    return "gate", f"{RECORD}: {commit[:12]}, {age:.1f} h ago, no stack file changed since"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def record(root: Path, seconds: float, now: dt.datetime | None = None) -> dict[str, object]:
    """Write :data:`RECORD` for ``root``'s ``HEAD``: a green full tier of ``seconds``."""
    now = now or dt.datetime.now(dt.UTC)
    head = _git(root, "rev-parse", "HEAD")
    if head.returncode != 0:
        raise RuntimeError(f"git rev-parse HEAD failed: {head.stderr.strip()}")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    dirty = sorted(line[3:] for line in status.stdout.splitlines() if line[3:] != str(RECORD))
    entry: dict[str, object] = {
        "commit": head.stdout.strip(),
        "date": now.replace(microsecond=0).isoformat(),
        "seconds": round(seconds),
        "cpu": _cpu(),
        "dirty": bool(dirty),
    }
    (root / RECORD).parent.mkdir(parents=True, exist_ok=True)
    (root / RECORD).write_text(json.dumps(entry, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("choose", help="print the tier CI runs: gate or full (why: on stderr)")
    rec = sub.add_parser("record", help="write .ci/full-pass after a green full tier")
    rec.add_argument("seconds", type=float, help="the full tier's wall time, seconds")
    args = parser.parse_args(argv)
    if args.command == "choose":
        tier, reason = choose(args.root)
        print(f"CI tier: {tier} ({reason})", file=sys.stderr)
        print(tier)
    else:
        entry = record(args.root, args.seconds)
        print(f"wrote {RECORD}: {json.dumps(entry)}")
        if entry["dirty"]:
            print(f"{RECORD} names a tree with uncommitted changes: CI will not trust it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
