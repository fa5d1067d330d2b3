"""The GPU path's Spark side, without a GPU: a fake discovery script stands in for the devices.

What cannot run here: CUDA itself (no GPU in CI). What runs for real: a new local Spark
session (its own JVM, in a subprocess: the tests' session already exists) started with
:func:`flowers_job.cluster.session.local_gpu_conf`, Spark running the discovery script, and
TorchDistributor's own checks and GPU assignment for local mode with ``use_gpu=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pyspark.sql import SparkSession

from flowers_job.cluster.session import local_gpu_conf
from flowers_job.cluster.slots import driver_gpus
from flowers_job.config import ConfigError, load_config
from flowers_job.driver.pipeline import check_cluster
from flowers_job.loaders import resolve_loader

pytestmark = [pytest.mark.timeout(300), pytest.mark.tier("gate")]

_PROBE = """
import json, sys
from pathlib import Path
from flowers_job.cluster.session import get_spark, local_gpu_conf
from flowers_job.cluster.slots import driver_gpus
from pyspark.ml.torch.distributor import TorchDistributor, _get_gpus_owned

spark = get_spark("gpu-probe", master="local[2]", conf=local_gpu_conf(2, Path(sys.argv[1])))
distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)
print("RESULT " + json.dumps({
    "driver_gpus": driver_gpus(spark),
    "num_tasks": distributor.num_tasks,
    "owned": _get_gpus_owned(spark),
}))
spark.stop()
"""


def test_local_gpu_conf_lets_torchdistributor_use_the_discovered_gpus(tmp_path: Path) -> None:
    """Spark runs the written discovery script at start-up, the driver gets a ``gpu``
    resource of 2 addresses, and TorchDistributor's local mode accepts ``use_gpu=True`` with
    2 processes and assigns them those devices (it raises "GPUs were unable to be found on
    the driver" without the settings: the session ``get_spark`` used to build)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "FLOWERS_SPARK_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result == {"driver_gpus": ["0", "1"], "num_tasks": 2, "owned": ["0", "1"]}
    script = next(tmp_path.glob("*.sh"))
    printed = subprocess.run([script], check=True, capture_output=True, timeout=10).stdout
    assert json.loads(printed) == {
        "name": "gpu",
        "addresses": ["0", "1"],
    }


def test_no_gpu_settings_without_cuda_devices() -> None:
    assert local_gpu_conf(0) == {}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_use_gpu_without_a_device_fails_before_any_work(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Asking for GPUs where there are none is a ConfigError naming the setting, raised by
    the checks that run before the ingest (the tests' session has no ``gpu`` resource)."""
    assert driver_gpus(spark) == []
    cfg = load_config(None, ["distributed.use_gpu=true"], **{"paths.output_dir": tmp_path})
    with pytest.raises(ConfigError, match=r"distributed\.use_gpu: GPUs requested"):
        check_cluster(spark, *resolve_loader(cfg))
    assert not any(tmp_path.iterdir())  # nothing written
