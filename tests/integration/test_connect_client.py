"""A Spark Connect client with no JVM: ``.venv-connect``.

``make setup-connect`` builds ``.venv-connect`` from ``requirements/connect-client.txt``
(``pyspark-client`` 4.0.4, not ``pyspark``: no JVM, no py4j, no Spark jars) and installs the
project's wheel with ``--no-deps`` (the ``connect_client`` fixture:
:func:`tests.support.connect.client_bin`, the Makefile's own recipe with the wheel under
test). Here: what that environment holds, and that the run path's driver-side modules import
there, where the server's full pyspark cannot hide an import of ``delta``, ``py4j`` or the
JVM. The full tier's job over Connect runs from this environment's ``flowers-job``
(tests/integration/test_connect.py, ``connect_run``): exit 0, a test accuracy, the model
registered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.connect import client_env, run

pytestmark = [pytest.mark.timeout(1200), pytest.mark.tier("gate")]


def _locked(name: str, lock: Path) -> str:
    """The version ``lock`` pins for ``name``."""
    for line in lock.read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{lock} pins no {name}")


def test_the_client_environment_has_pyspark_client_and_the_wheel(connect_client: Path) -> None:
    """``pyspark`` there is the client only (``is_remote_only()``, no py4j, no Spark jars,
    no ``delta``), and ``flowers_job`` is the installed wheel, not the checkout; the run
    path's driver-side modules import there."""
    check = (
        "import importlib, importlib.util, pathlib, sysconfig, pyspark, flowers_job\n"
        "from pyspark.util import is_remote_only\n"
        "site = pathlib.Path(sysconfig.get_paths()['purelib']).resolve()\n"
        "print(is_remote_only(), pyspark.__version__,\n"
        "      [m for m in ('py4j', 'delta', 'petastorm') if importlib.util.find_spec(m)],\n"
        "      (pathlib.Path(pyspark.__file__).parent / 'jars').exists(),\n"
        "      site in pathlib.Path(flowers_job.__file__).resolve().parents)\n"
        "for m in ('flowers_job.cli', 'flowers_job.driver.pipeline', 'flowers_job.train.rank',\n"
        "          'flowers_job.loaders.streaming.streaming_loader', 'flowers_job.tables.table_ref',\n"
        "          'flowers_job.serving.batch_predict', 'pyspark.ml.torch.distributor'):\n"
        "    importlib.import_module(m)\n"
    )
    proc = run([str(connect_client / "python"), "-c", check], 300, connect_client, client_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = _locked("pyspark-client", REPO / "requirements" / "connect-client.txt")
    assert proc.stdout.split("\n")[0] == f"True {client} [] False True", proc.stdout
