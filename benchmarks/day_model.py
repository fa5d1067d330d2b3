"""A day at 10 million photos, from the day cycles of ``benchmarks/scale.py`` at 1x-100x.

Reads the disk runs ``scale_x<N>.json`` of one results folder (one session, one machine:
``scale.py --factor 100 30 10 1 --train-steps 60``) and fits, by least squares on the
relative error (every point weighs the same whatever its size, so that 1x counts as much as
100x), each step's wall seconds as a cost per file and per changed file:

- **ingest** (``flowers-job ingest``, its process from start to exit): three runs per factor,
  the full ingest (every file decoded), the unchanged one (none) and the day's (1 % added,
  0.1 % deleted)::

      seconds = a + k_incremental * incremental + k_files_listed * files_listed
                + k_incremental_files * incremental_files + k_files_changed * files_changed

  ``files_changed``: files decoded plus rows deleted; ``incremental``: 1 for a change
  written to existing tables (the day's), 0 otherwise: the fixed cost of a change, whatever
  its size (the day's deletes, appends and checks run as Spark jobs of their own);
  ``incremental_files``: ``files_listed`` for that run, 0 otherwise: what a change costs
  per file of the table (the listing compared with the table, the checks over its rows).
- **preparation** of a train (from its start to the first training step: the Spark session,
  the tables' checks, the loader cache and the ranks' start): the first train of a version
  from scratch (every row written to the cache), the second on the same version (none
  written: reused) and the day's train on the new version (the day's rows appended)::

      seconds = a + k_appended * appended + k_rows * rows + k_appended_rows * appended_rows
                + k_rows_written * rows_written

  ``rows``: the images table's rows (every split); ``rows_written``: the rows the loader
  cache wrote (every split; from its bytes over the bytes per row of the full write);
  ``appended``: 1 for the day's train (the cache grows by appending to the previous
  version's entry), 0 otherwise: the fixed cost of an append; ``appended_rows``: ``rows``
  for that train, 0 otherwise: what an append costs per row of the table (the two versions'
  row ids compared, the live rows checked).
- **training**: images/s of epoch 1 (from the progress lines of the first and the day's
  train, ``--train-steps``); an epoch costs ``train_rows / images_per_second``. The model
  is the mean rate; each factor's rate is its point, with its residual.

Then the day at 10 million photos (1 % = 100,000 added, 0.1 % = 10,000 deleted, the train
split's share of the rows as measured): each step's seconds on this machine, the sum, the
same in core-hours (x the machine's cores), the step that dominates, and the day against
a whole run at that size (a full ingest, a cache written whole). It is an
extrapolation 27x past the largest point: the linear model is what the points support, no
more; the residuals say how well it holds over 1x-100x.

Also the ratios asked of the day's cost: ingest files/s at 100x against 10x,
training images/s at 100x against 1x, the incremental and unchanged ingest against the full
one at 30x, and the day's cache bytes against the full cache.

Writes ``day_model.json`` and ``day_model.md`` in the folder, and prints the Markdown::

    python benchmarks/day_model.py benchmarks/results/<date>/<commit>
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Fit", "fit_relative", "load_runs", "model", "points"]

DAY_FILES = 10_000_000
DAY_ADDED = DAY_FILES // 100
DAY_DELETED = DAY_FILES // 1000
UNITS = {
    "incremental": " once per incremental ingest",
    "files_listed": " per file listed",
    "files_changed": " per file changed",
    "appended": " once per append",
    "incremental_files": " per file listed, in an incremental ingest",
    "appended_rows": " per row, in an append",
    "rows": " per row",
    "rows_written": " per row written",
}
"""How each term's coefficient reads (seconds ...)."""
MODELS = {
    "ingest": ["incremental", "files_listed", "incremental_files", "files_changed"],
    "preparation": ["appended", "rows", "appended_rows", "rows_written"],
}
"""Each step's model: its terms after the constant ``a``, each with a coefficient ``k_``."""


@dataclass(frozen=True)
class Fit:
    """A linear model fitted on its points.

    ``terms``: the names of the coefficients (``"1"`` for the constant); ``coefficients``:
    seconds per unit of each term; ``points``: per point its inputs, the observed and the
    predicted seconds, the residual (observed - predicted, seconds) and that over the
    observed."""

    step: str
    formula: str
    terms: list[str]
    coefficients: list[float]
    points: list[dict[str, Any]]

    def predict(self, inputs: dict[str, float]) -> float:
        """Seconds for ``inputs`` (a value per term; the constant's is 1)."""
        return float(
            sum(
                c * (1.0 if t == "1" else inputs[t])
                for t, c in zip(self.terms, self.coefficients, strict=True)
            )
        )

    @property
    def max_relative_residual(self) -> float:
        return max(abs(p["relative_residual"]) for p in self.points)


def fit_relative(
    step: str, formula: str, terms: list[str], rows: list[dict[str, Any]], target: str
) -> Fit:
    """Least squares of ``target`` on ``terms`` (``"1"``: the constant), each row weighed by
    1 / its observed value: the relative residuals' sum of squares is minimised.

    Args:
        rows: the points; each holds a value per term (but ``"1"``), ``target`` and a
            ``label``.

    Raises:
        ValueError: fewer points than terms, or an observed value <= 0.
    """
    if len(rows) < len(terms):
        raise ValueError(f"{step}: {len(rows)} points for {len(terms)} terms")
    y = np.array([float(r[target]) for r in rows])
    if (y <= 0).any():
        raise ValueError(f"{step}: an observed {target} <= 0 in {rows}")
    x = np.array([[1.0 if t == "1" else float(r[t]) for t in terms] for r in rows])
    weights = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * weights[:, None], y * weights, rcond=None)
    predicted = x @ coef
    points = [
        {
            **{k: v for k, v in r.items()},
            "observed": round(float(obs), 2),
            "predicted": round(float(pred), 2),
            "residual": round(float(obs - pred), 2),
            "relative_residual": round(float((obs - pred) / obs), 3),
        }
        for r, obs, pred in zip(rows, y, predicted, strict=True)
    ]
    return Fit(step, formula, terms, [float(c) for c in coef], points)


def load_runs(folder: Path) -> dict[int, dict[str, Any]]:
    """The disk runs of the whole photo set in ``folder``: ``{factor: scale_x<N>.json}``.

    Raises:
        ValueError: none, or one from another day than the others (another session).
    """
    runs: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("scale_x*.json")):
        run = json.loads(path.read_text())
        if run.get("fraction", 1.0) == 1.0 and run.get("store", {}).get("kind") == "disk":
            runs[int(run["factor"])] = run
    if not runs:
        raise ValueError(f"{folder}: no scale_x<N>.json of a disk run")
    days = {run["machine"]["date"][:10] for run in runs.values()}
    if len(days) > 1:
        raise ValueError(f"{folder}: runs from several days {sorted(days)}: one session only")
    return runs


def first_rows(run: dict[str, Any]) -> int:
    """Rows of the images table the first train saw (the full ingest's)."""
    return int(run["full_ingest"]["printed"]["images_rows"])


def points(runs: dict[int, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The points of each step (module docstring), labelled ``<factor>x <run>``."""
    ingest: list[dict[str, Any]] = []
    prep: list[dict[str, Any]] = []
    rate: list[dict[str, Any]] = []
    for factor, run in sorted(runs.items()):
        for key in ("full_ingest", "unchanged_ingest", "incremental_ingest"):
            step = run[key]
            counts = step["incremental"]
            ingest.append(
                {
                    "label": f"{factor}x {key.removesuffix('_ingest')}",
                    "files_listed": counts["files_listed"],
                    "files_changed": counts["files_decoded"] + counts["rows_deleted"],
                    "incremental": int(key == "incremental_ingest"),
                    "incremental_files": counts["files_listed"] * (key == "incremental_ingest"),
                    "seconds": step["wall_seconds"],
                }
            )
        rows = first_rows(run)
        # the first wrote every row; a loader that reads the table writes none (0 bytes)
        bytes_per_row = (run["train_first"]["bytes_written"] or 0) / rows
        day_train = run["day"]["train"]
        for label, n, train, written in (
            ("first", rows, run["train_first"], run["train_first"]["bytes_written"]),
            ("reused", rows, run["train_second"], run["train_second"]["bytes_written"]),
            (
                "day",
                run["incremental_ingest"]["printed"]["images_rows"],
                day_train,
                run["day"]["cache_bytes_written_total"],
            ),
        ):
            prep.append(
                {
                    "label": f"{factor}x {label}",
                    "rows": n,
                    # the rows the loader cache wrote: its bytes over the full write's per row
                    "rows_written": round((written or 0) / bytes_per_row) if bytes_per_row else 0,
                    "appended": int(label == "day"),
                    "appended_rows": n * (label == "day"),
                    "seconds": train["preparation_seconds"],
                }
            )
        for label, train in (("first", run["train_first"]), ("day", day_train)):
            if train.get("train_images_per_second"):
                rate.append(
                    {
                        "label": f"{factor}x {label}",
                        "images_per_second": round(train["train_images_per_second"], 1),
                    }
                )
    return {"ingest": ingest, "preparation": prep, "training": rate}


def ratios(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The day's ratios, where the factors they need were run (None otherwise)."""

    def get(factor: int, *keys: str) -> float | None:
        value: Any = runs.get(factor)
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return float(value) if isinstance(value, int | float) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    rate = ("train_first", "train_images_per_second")
    full30 = get(30, "full_ingest", "ingest_seconds")
    return {
        "ingest_files_per_second_100x_vs_10x": ratio(
            get(100, "full_ingest", "files_per_second"), get(10, "full_ingest", "files_per_second")
        ),
        "train_images_per_second_100x_vs_1x": ratio(get(100, *rate), get(1, *rate)),
        "unchanged_ingest_vs_full_30x": ratio(
            get(30, "unchanged_ingest", "ingest_seconds"), full30
        ),
        "incremental_ingest_vs_full_30x": ratio(
            get(30, "incremental_ingest", "ingest_seconds"), full30
        ),
        "incremental_above_unchanged_vs_full_30x": get(
            30, "incremental_ingest", "above_unchanged_vs_full_ingest"
        ),
        "day_cache_bytes_vs_full": {
            f"{f}x": run["day"].get("cache_bytes_vs_full") for f, run in sorted(runs.items())
        },
    }


def model(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The fits, the day at 10 million photos and the ratios, as a JSON-ready dict."""
    data = points(runs)
    used = dict(MODELS)
    if not any(p["rows_written"] for p in data["preparation"]):
        # a loader that reads the table (the Delta loader) writes no cache: a first, a
        # reused and a day's train prepare alike, and nothing is appended
        used["preparation"] = ["rows"]
    ingest, prep = (
        fit_relative(
            step,
            " + ".join(["a", *(f"k_{t} * {t}" for t in terms)]),
            ["1", *terms],
            data[step],
            "seconds",
        )
        for step, terms in used.items()
    )
    rates = np.array([p["images_per_second"] for p in data["training"]])
    mean_rate = float(rates.mean())
    rate_points = [
        {**p, "relative_residual": round((p["images_per_second"] - mean_rate) / mean_rate, 3)}
        for p in data["training"]
    ]
    any_run = runs[max(runs)]
    train_share = any_run["full_ingest"]["printed"]["train_rows"] / first_rows(any_run)
    nproc = int(any_run["machine"]["nproc"])
    files = DAY_FILES + DAY_ADDED - DAY_DELETED
    day = {
        "ingest": ingest.predict(
            {
                "incremental": 1,
                "files_listed": files,
                "incremental_files": files,
                "files_changed": DAY_ADDED + DAY_DELETED,
            }
        ),
        "preparation": prep.predict(
            {"appended": 1, "rows": files, "appended_rows": files, "rows_written": DAY_ADDED}
        ),
        "training_epoch": files * train_share / mean_rate,
    }
    total = sum(day.values())
    listed = {"files_listed": files, "incremental_files": 0, "incremental": 0}
    full_ingest = ingest.predict({**listed, "files_changed": files})
    unchanged_ingest = ingest.predict({**listed, "files_changed": 0})
    whole_cache = prep.predict(
        {"appended": 0, "rows": files, "appended_rows": 0, "rows_written": files}
    )
    against_full = {
        # part 3's targets, at the size they are meant for (predicted, not measured)
        "full_ingest_seconds": round(full_ingest, 1),
        "unchanged_ingest_seconds": round(unchanged_ingest, 1),
        "unchanged_vs_full": round(unchanged_ingest / full_ingest, 3),
        "day_ingest_vs_full": round(day["ingest"] / full_ingest, 3),
        "day_ingest_above_unchanged_vs_full": round(
            (day["ingest"] - unchanged_ingest) / full_ingest, 3
        ),
        "first_train_preparation_seconds": round(whole_cache, 1),
        "day_preparation_vs_first": round(day["preparation"] / whole_cache, 3),
    }
    return {
        "benchmark": "day_model",
        "runs": {f"{f}x": run["machine"]["date"] for f, run in sorted(runs.items())},
        "machine": {k: any_run["machine"].get(k) for k in ("nproc", "memory_gib", "date")},
        "fits": [asdict(ingest), asdict(prep)],
        "training": {
            "images_per_second_mean": round(mean_rate, 1),
            "points": rate_points,
            "train_share_of_rows": round(train_share, 4),
        },
        "day_10m": {
            "files": files,
            "added": DAY_ADDED,
            "deleted": DAY_DELETED,
            "seconds": {k: round(v, 1) for k, v in day.items()},
            "total_seconds": round(total, 1),
            "total_hours": round(total / 3600, 2),
            "core_hours": round(total * nproc / 3600, 1),
            "dominant_step": max(day, key=lambda k: day[k]),
            "dominant_share": round(max(day.values()) / total, 3),
            "against_a_full_run": against_full,
        },
        "ratios": ratios(runs),
    }


def markdown(result: dict[str, Any]) -> str:
    """The model as Markdown: each fit with its points and residuals, the day at 10 M."""
    machine = result["machine"]
    lines = [
        f"# A day at 10 million photos ({machine['nproc']} cores, {machine['memory_gib']} GiB; "
        f"runs of {', '.join(result['runs'])})",
        "",
    ]
    for fit in result["fits"]:
        coefs = ", ".join(
            f"{'a' if t == '1' else t} = {c:.4g} s{UNITS.get(t, '')}"
            for t, c in zip(fit["terms"], fit["coefficients"], strict=True)
        )
        lines += [f"## {fit['step']}: seconds = {fit['formula']}", "", coefs, ""]
        terms = [t for t in fit["terms"] if t != "1"]
        lines.append("| point | " + " | ".join(terms) + " | observed s | fitted s | residual |")
        lines.append("|---|" + "---:|" * (len(terms) + 3))
        for p in fit["points"]:
            values = " | ".join(str(p[t]) for t in terms)
            lines.append(
                f"| {p['label']} | {values} | {p['observed']} | {p['predicted']} | "
                f"{p['residual']:+} ({p['relative_residual']:+.1%}) |"
            )
        lines.append("")
    training = result["training"]
    lines += [
        f"## training: {training['images_per_second_mean']} images/s (mean of the points)",
        "",
        "| point | images/s | vs mean |",
        "|---|---:|---:|",
        *(
            f"| {p['label']} | {p['images_per_second']} | {p['relative_residual']:+.1%} |"
            for p in training["points"]
        ),
        "",
    ]
    day = result["day_10m"]
    lines += [
        f"## The day at {day['files']:,} files (+{day['added']:,}, -{day['deleted']:,})",
        "",
        "| step | seconds | hours |",
        "|---|---:|---:|",
        *(f"| {k} | {v:,.0f} | {v / 3600:.2f} |" for k, v in day["seconds"].items()),
        f"| **total** | {day['total_seconds']:,.0f} | {day['total_hours']} |",
        "",
        f"{day['core_hours']} core-hours on this machine; {day['dominant_step']} is "
        f"{day['dominant_share']:.0%} of the day.",
        "",
        "Against a whole run at that size (predicted by the same fits):",
        "",
        *(f"- {k}: {v}" for k, v in day["against_a_full_run"].items()),
        "",
        "## The scaling ratios",
        "",
        *(f"- {k}: {v}" for k, v in result["ratios"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the results folder of one scale.py run")
    args = parser.parse_args(argv)
    result = model(load_runs(args.folder))
    (args.folder / "day_model.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.folder / "day_model.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
