"""CI's choice of tier (tools/ci_tier.py) in a real git repository: the full tier when the
record of the last green full tier is missing, stale (not an ancestor of HEAD, or older
than a day) or the stack changed since it; the gate otherwise."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

sys.path.insert(0, str(REPO / "tools"))
from ci_tier import RECORD, choose, record

from tests.support import REPO

pytestmark = [pytest.mark.timeout(120), pytest.mark.tier("gate")]

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q", "-b", "main")
    _commit(
        tmp_path,
        {"Makefile": "test:\n", "flowers_job/a.py": "", "requirements/lock.txt": "x==1\n"},
        "base",
    )
    return tmp_path


def _record(repo: Path, when: dt.datetime = NOW, commit: bool = True) -> str:
    """A green full tier recorded at ``repo``'s HEAD at ``when``, committed (as a session
    does) unless ``commit`` is False."""
    entry = record(repo, 2500.0, now=when)
    if commit:
        _commit(repo, {}, "full tier record")
    return str(entry["commit"])


def test_a_missing_record_runs_the_full_tier(repo: Path) -> None:
    assert choose(repo, NOW) == ("full", f"{RECORD} is missing")


def test_a_fresh_record_of_an_ancestor_runs_the_gate(repo: Path) -> None:
    recorded = _record(repo, NOW - dt.timedelta(hours=2))
    _commit(repo, {"flowers_job/a.py": "x = 1\n", "docs/x.md": "y\n"}, "code and docs")
    tier, reason = choose(repo, NOW)
    assert tier == "gate", reason
    assert recorded[:12] in reason
    entry = json.loads((repo / RECORD).read_text())
    assert entry["seconds"] == 2500 and entry["cpu"] and entry["dirty"] is False


def test_a_record_older_than_a_day_runs_the_full_tier(repo: Path) -> None:
    _record(repo, NOW - dt.timedelta(hours=25))
    tier, reason = choose(repo, NOW)
    assert tier == "full" and "25.0 h old" in reason


def test_a_record_of_a_commit_that_is_not_an_ancestor_runs_the_full_tier(repo: Path) -> None:
    _git(repo, "checkout", "-q", "-b", "other")
    elsewhere = _commit(repo, {"flowers_job/b.py": ""}, "on another branch")
    _git(repo, "checkout", "-q", "main")
    _commit(repo, {"flowers_job/c.py": ""}, "on main")
    (repo / ".ci").mkdir(exist_ok=True)
    (repo / RECORD).write_text(
        json.dumps({"commit": elsewhere, "date": NOW.isoformat(), "seconds": 1, "cpu": "x"})
    )
    tier, reason = choose(repo, NOW)
    assert tier == "full" and "not an ancestor of HEAD" in reason, reason
    (repo / RECORD).write_text(json.dumps({"commit": "0" * 40, "date": NOW.isoformat()}))
    assert choose(repo, NOW)[0] == "full"  # a commit this clone does not have


@pytest.mark.parametrize(
    "changed",
    ["Makefile", "requirements/lock.txt", "pyproject.toml", ".ci/run", "tests/conftest.py",
     "tools/cluster.py", "docker/Dockerfile", "tools/container.py"],
)  # fmt: skip
def test_a_change_to_the_stack_runs_the_full_tier(repo: Path, changed: str) -> None:
    _record(repo, NOW - dt.timedelta(hours=1))
    _commit(repo, {changed: "changed\n", "flowers_job/a.py": "y = 2\n"}, "stack")
    tier, reason = choose(repo, NOW)
    assert tier == "full" and changed in reason, reason


def test_a_record_of_uncommitted_changes_runs_the_full_tier(repo: Path) -> None:
    (repo / "flowers_job/a.py").write_text("dirty = True\n")
    _record(repo, NOW, commit=False)
    assert json.loads((repo / RECORD).read_text())["dirty"] is True
    _commit(repo, {}, "record and the change")
    tier, reason = choose(repo, NOW)
    assert tier == "full" and "uncommitted" in reason


def test_ci_run_asks_the_chooser_and_runs_the_tier_it_names() -> None:
    """``.ci/run`` runs ``make test`` or ``make test-full`` as ``tools/ci_tier.py`` says."""
    root = REPO
    script = (root / ".ci" / "run").read_text()
    assert "tools/ci_tier.py choose" in script
    assert 'make "$target"' in script
