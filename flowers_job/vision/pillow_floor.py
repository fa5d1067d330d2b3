"""The oldest Pillow the job and the served model run with, and the check that refuses an older one.

CVE-2026-25990 (GHSA-cfh3-3jmp-rvhc): loading a crafted PSD image writes out of bounds in
Pillow 10.3.0 up to the release before 12.1.1; 12.1.1 is the first release with the fix (the
advisory's "Patched versions", and Pillow's 12.1.1 release notes). Databricks Runtime 17.3 LTS
ML and 18 ML ship Pillow 11.1.0: the bundle raises it (databricks.yml, pyproject.toml's floor,
requirements/dbr-*-ml.txt), and this check refuses to start where that did not happen (a
cluster library that skipped the wheel's requirements, a notebook that pinned Pillow back, a
served model whose environment was rebuilt from an old requirement).

No torch and no Pillow import here unless the version is not given: the CLI calls it before
anything heavy.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from flowers_job.errors import ConfigError

__all__ = ["PILLOW_CVE", "PILLOW_FLOOR", "check_pillow"]

PILLOW_FLOOR = "12.1.1"
"""The oldest Pillow allowed: the first release that fixes :data:`PILLOW_CVE`. pyproject.toml's
``pillow>=`` requirement and the served model's requirements carry the same version."""
PILLOW_CVE = "CVE-2026-25990"
"""The vulnerability the floor shuts out: an out-of-bounds write while loading a crafted PSD."""


def check_pillow(version: str | None = None) -> str:
    """Refuse a Pillow older than :data:`PILLOW_FLOOR`.

    Args:
        version: the Pillow version to check (e.g. ``"11.1.0"``); None reads the installed
            one, ``PIL.__version__``.

    Returns:
        The version checked.

    Raises:
        ConfigError: ``version`` is older than the floor, or not a version; the message names
            :data:`PILLOW_CVE`, the installed and the required versions and the pip command
            that installs the required one.
    """
    if version is None:
        import PIL

        version = PIL.__version__
    try:
        too_old = Version(version) < Version(PILLOW_FLOOR)
    except InvalidVersion:
        too_old = True
    if too_old:
        raise ConfigError(
            f"Pillow {version} is installed; the job needs Pillow >= {PILLOW_FLOOR}, which fixes "
            f"{PILLOW_CVE} (an out-of-bounds write while loading a crafted PSD image): "
            f"pip install 'pillow>={PILLOW_FLOOR}'"
        )
    return version
