"""Serving latency of the REST endpoint, and the batch throughput of ``flowers-job predict``.

The REST endpoint is ``mlflow models serve -m models:/<name>/<version> --env-manager local``
(one uvicorn worker, as MLflow starts it), called over loopback with real photos,
base64-encoded in a ``dataframe_split`` payload, as a client would. For each batch size
(1 and 32 images per request) it sends ``--warmup`` untimed requests, then ``--requests``
timed ones one after the other (no concurrency: the latency of one request on an idle
server), and reports the median (p50) and 99th percentile (p99) of the wall time from
sending the request to having parsed the JSON answer, in milliseconds, and the images per
second that follow from the median. The request bodies are built before timing. (The
served model tunes the server's allocator when it loads: ``FlowersClassifierModel.load_context``.)

With ``--predict-images DIR`` it then runs ``flowers-job predict --images DIR`` as a user
would (a subprocess: Spark's start, the model's download, listing, decode, scoring, the Delta
write) and reports the wall time of the command and the scoring job's own images/s (from
the command's JSON report: the Spark job that lists nothing, decodes, scores and writes).

Any registered model of the job's architecture serves at the same speed, so the model is
registered here without training (EfficientNet-Lite0 with its offline weights and a new
head, ``tests/support/model_registry.py``), into a temp output dir. Run from the repository root:

    .venv/bin/python benchmarks/serving_latency.py \\
        --predict-images ../shared/data/flower_photos --output /tmp/serving_latency.json
    # quicker: --requests 20
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from report import machine_facts, write_report  # noqa: E402

from tests.support.model_registry import register_model, serve  # noqa: E402

PHOTOS = REPO.parent / "shared" / "data" / "flower_photos"
BATCH_SIZES = (1, 32)
REQUEST_SECONDS = 120  # limit on one HTTP request, seconds
PREDICT_SECONDS = 1800  # limit on the flowers-job predict command, seconds


def _photos(root: Path, n: int) -> list[bytes]:
    """``n`` photos taken in turn from each label folder (sorted names)."""
    groups = [sorted(d.glob("*.jpg")) for d in sorted(root.iterdir()) if d.is_dir()]
    ordered = [f for group in zip(*groups, strict=False) for f in group]
    return [f.read_bytes() for f in ordered[:n]]


def _body(images: list[bytes]) -> bytes:
    data = [[base64.b64encode(x).decode("ascii")] for x in images]
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": data}}).encode()


def measure_latency(url: str, images: list[bytes], requests_n: int, warmup: int) -> dict[str, Any]:
    """p50/p99 latency (ms) of ``requests_n`` sequential requests of ``len(images)`` images."""
    body = _body(images)
    headers = {"Content-Type": "application/json"}
    session = requests.Session()
    seconds = []
    for i in range(warmup + requests_n):
        t0 = time.perf_counter()
        response = session.post(
            f"{url}/invocations", data=body, headers=headers, timeout=REQUEST_SECONDS
        )
        predictions = response.json()["predictions"]
        elapsed = time.perf_counter() - t0
        if response.status_code != 200 or len(predictions) != len(images):
            raise RuntimeError(f"request {i}: {response.status_code} {response.text[:500]}")
        if i >= warmup:
            seconds.append(elapsed)
    ms = np.array(seconds) * 1000.0
    p50 = float(np.percentile(ms, 50))
    return {
        "batch_size": len(images),
        "requests": requests_n,
        "request_bytes": len(body),
        "p50_ms": round(p50, 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "mean_ms": round(statistics.fmean(ms), 1),
        "min_ms": round(float(ms.min()), 1),
        "images_per_second_at_p50": round(len(images) / (p50 / 1000.0), 1),
    }


def measure_predict(output_dir: Path, images: Path, table: Path) -> dict[str, Any]:
    """``flowers-job predict --output-dir OUTPUT_DIR --images IMAGES`` (default model from
    summary.json), its wall time (s) and its report's scoring throughput (images/s)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "flowers_job", "predict", "--output-dir", str(output_dir)),
            *("--images", str(images), "--output-table", str(table)),
        ],
        capture_output=True,
        text=True,
        timeout=PREDICT_SECONDS,
        check=False,
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"flowers-job predict failed ({done.returncode}): {done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "command_wall_seconds": round(wall, 1),
        "input_rows": report["input_rows"],
        "output_rows": report["output_rows"],
        "scoring_job_seconds": round(report["seconds"], 1),
        "images_per_second": round(report["images_per_second"], 1),
        "images_per_second_whole_command": round(report["input_rows"] / wall, 1),
        "label_counts": report["label_counts"],
        "reason_counts": report["reason_counts"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--photos", type=Path, default=PHOTOS, help="where request photos come from"
    )
    parser.add_argument("--requests", type=int, default=100, help="timed requests per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests per batch size")
    parser.add_argument("--predict-images", type=Path, help="also time flowers-job predict here")
    parser.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args()

    facts = machine_facts("mlflow", "torch", "pyspark")
    with tempfile.TemporaryDirectory(prefix="serving-latency-") as tmp:
        out = Path(tmp)
        info = register_model(out / "job", _photos(args.photos, 1))
        (out / "job" / "summary.json").write_text(json.dumps(info))
        model_uri = f"models:/{info['registered_model_name']}/{info['registered_model_version']}"
        t0 = time.perf_counter()
        with serve(model_uri, info["mlflow_tracking_uri"], out / "serve.log") as url:
            start_seconds = round(time.perf_counter() - t0, 1)
            latency = [
                measure_latency(url, _photos(args.photos, n), args.requests, args.warmup)
                for n in BATCH_SIZES
            ]
        predict = (
            measure_predict(out / "job", args.predict_images, out / "predictions")
            if args.predict_images
            else None
        )
    report = {
        "benchmark": "serving_latency",
        **facts,
        "server": "mlflow models serve --env-manager local (1 uvicorn worker), loopback",
        "server_start_seconds": start_seconds,
        "latency": latency,
        "predict": predict,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_report(report, args.output)


if __name__ == "__main__":
    main()
