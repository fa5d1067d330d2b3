"""The Pillow floor (CVE-2026-25990): the check refuses a Pillow older than the first fixed
release, naming the CVE and both versions; the CLI runs it before any command that decodes
images."""

from __future__ import annotations

from pathlib import Path

import PIL
import pytest

from flowers_job.cli import main
from flowers_job.errors import ConfigError
from flowers_job.vision.pillow_floor import PILLOW_CVE, PILLOW_FLOOR, check_pillow

pytestmark = pytest.mark.tier("gate")


@pytest.mark.parametrize("version", ["11.1.0", "10.3.0", "12.1.0", "12.1.1rc1", "not-a-version"])
def test_an_older_pillow_is_refused_naming_the_cve_and_both_versions(version: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_pillow(version)
    message = str(caught.value)
    assert PILLOW_CVE in message
    assert f"Pillow {version} is installed" in message
    assert f">= {PILLOW_FLOOR}" in message and f"pip install 'pillow>={PILLOW_FLOOR}'" in message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("version", [PILLOW_FLOOR, "12.3.0", "13.0.0"])
def test_the_floor_and_newer_pass(version: str) -> None:
    assert check_pillow(version) == version


def test_the_floor_is_the_first_fixed_release() -> None:
    """GHSA-cfh3-3jmp-rvhc: affected >= 10.3.0, < 12.1.1; patched 12.1.1."""
    assert PILLOW_FLOOR == "12.1.1"


def test_without_an_argument_the_installed_pillow_is_checked() -> None:
    assert check_pillow() == PIL.__version__


def test_the_cli_refuses_to_start_on_an_old_pillow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``flowers-job ingest`` exits 2 before reading anything, naming the CVE; the installed
    Pillow is made to report the runtimes' 11.1.0."""
    monkeypatch.setattr(PIL, "__version__", "11.1.0")
    status = main(["ingest", "--images", str(tmp_path / "none"), "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert PILLOW_CVE in err and "Pillow 11.1.0 is installed" in err
    assert list(tmp_path.iterdir()) == []  # nothing written
