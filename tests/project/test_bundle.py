"""Deployment files: the Databricks Asset Bundle (databricks.yml), the wheel's requirements
and docker/Dockerfile.

databricks.yml is validated against the bundle JSON schema that the Databricks CLI
publishes (kept in ../shared/schemas, see SOURCE.md there), as written and with each
target's variables substituted, then checked for the facts the schema cannot see: declared
variables, the job's arguments, the targets' distributed mode, the paused daily schedule,
the credentials from a secret scope, the timeouts against the scale benchmark they are
sized from. No Spark, no network: these run in well under a second.

Every third-party module that flowers_job imports (lazy imports too: an AST walk) must come
from a requirement of the wheel or of an extra. The wheel's requirements are checked against
the versions Databricks Runtime 17.3 LTS ML and 18 ML ship (../shared/runtimes/
dbr-17.3-lts-ml.txt with ``RUNTIME_MORE``; ``RUNTIME_18_CHANGES``): offline from pyproject.toml, then
(marked ``network``) by building the wheel and resolving what the bundle installs against
those versions (uv's resolver) and into this environment (pip's), which must not change.

The repo's files are found next to this file, or under ``FLOWERS_REPO_ROOT`` when the tests
run from a copy (``make test-dbr``). ``FLOWERS_WHEEL`` names an already built wheel to check
instead of building one; ``FLOWERS_EXPECT_WHEEL=1`` requires ``flowers_job`` to be imported
from site-packages (the installed wheel), not from a source checkout.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator, ValidationError, validators
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO
from tests.support.packaging import clean_env, uv_bin, uv_failure

pytestmark = pytest.mark.tier("gate")

ROOT = REPO
BUNDLE = ROOT / "databricks.yml"
PYPROJECT = ROOT / "pyproject.toml"
SCHEMA = ROOT.parent / "shared" / "schemas" / "databricks-bundle.schema.json"
RUNTIME = ROOT.parent / "shared" / "runtimes" / "dbr-17.3-lts-ml.txt"
RUNTIME_MORE = {
    "packaging": "24.2",
    "scikit-learn": "1.6.1",
    "scipy": "1.15.1",
    "joblib": "1.4.2",
    "threadpoolctl": "3.5.0",
    "matplotlib": "3.10.0",
    "contourpy": "1.3.1",
    "cycler": "0.11.0",
    "fonttools": "4.55.3",
    "kiwisolver": "1.4.8",
    "pyparsing": "3.2.0",
    "filelock": "3.13.1",
}
"""17.3 LTS ML's versions of packages that flowers_job imports, and of scikit-learn's and
matplotlib's own requirements, that ``RUNTIME`` does not list. Source: the runtime's
constraints.txt in Databricks' public ``databricks/environments`` repository
(``python/dbr/17.3.x-cpu-ml-scala2.13/constraints.txt``: ``scikit-learn~=1.6.1``,
``matplotlib~=3.10.0``, ``filelock~=3.13.1``, ...)."""
RUNTIME_18_CHANGES = {
    "pyspark": "4.1.0",
    "delta-spark": None,
    "pyarrow": "21.0.0",
    "torch": "2.9.0",
    "torchvision": "0.24.0",
    "mlflow-skinny": "3.8.1",
    "mosaicml-streaming": "0.13.0",
    "setuptools": "78.1.1",
    "sqlalchemy": "2.0.39",
    "scipy": "1.15.3",
    "filelock": "3.17.0",
}
"""Where Databricks Runtime 18 ML's versions of the packages that ``RUNTIME`` and
``RUNTIME_MORE`` name for 17.3 differ from 17.3's (None: not a package there); the others,
numpy 2.1.3 and pandas 2.2.3 among them, are the same. Source: ``python/dbr/18.0.x-cpu-ml-scala2.13/constraints.txt`` in Databricks'
public ``databricks/environments`` repository (commit 04534b5; 18.1.x's and 18.x's files
there carry the same versions of these), and ../shared/runtimes/README.md for Spark 4.1.0,
which constraints.txt does not list. The runtime's Delta Lake is its own: no delta-spark."""
RUNTIME_RAISED = {"pillow": "12.3.0"}
"""The packages that the bundle raises above what both runtimes ship (Pillow 11.1.0 on 17.3 and
18), each to an exact version that databricks.yml installs beside the wheel and that
requirements/dbr-*-ml.txt carry: Pillow past CVE-2026-25990 (an out-of-bounds write while
loading a crafted PSD, Pillow 10.3.0 to 12.1.0; the wheel's floor is the first fixed release,
:data:`flowers_job.vision.pillow_floor.PILLOW_FLOOR`). Nothing else may differ."""
DBR_REQUIREMENTS = {
    "17.3": ROOT / "requirements" / "dbr-17.3-ml.txt",
    "18": ROOT / "requirements" / "dbr-18-ml.txt",
}
"""The test environment built from each runtime's versions (``make setup-dbr``,
``make setup-dbr18``)."""
RUNTIMES = tuple(DBR_REQUIREMENTS)
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

JOB = "flowers_train"
TARGETS = ("dev", "prod", "standard")
"""Every target of databricks.yml: dev and prod on classic compute (dedicated access mode,
Databricks Runtime ML), standard on Spark Connect compute (standard access mode)."""
CLASSIC_TARGETS = ("dev", "prod")
VAR_REF = re.compile(r"\$\{var\.([^.}\[]+)")


def _translate_pattern(pattern: str) -> str:
    r"""The schema's regexes use ``\p{L}`` / ``\p{N}`` (Go RE2), which Python's ``re`` lacks.

    Letters are ``[^\W\d_]`` and letters-or-digits ``[^\W_]`` in Python's Unicode mode.
    Anything else unsupported is left in place, so ``re`` raises instead of passing silently.
    """
    return pattern.replace(r"[\p{L}\p{N}]", r"[^\W_]").replace(r"\p{L}", r"[^\W\d_]")


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not re.search(
        _translate_pattern(pattern), instance
    ):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


BundleValidator = validators.extend(Draft202012Validator, {"pattern": _pattern})


@pytest.fixture(scope="module")
def bundle() -> dict[str, Any]:
    doc = yaml.safe_load(BUNDLE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def schema_validator() -> Any:
    if not SCHEMA.is_file():
        pytest.skip(f"bundle JSON schema not found at {SCHEMA} (shared/schemas is absent)")
    return BundleValidator(json.loads(SCHEMA.read_text(encoding="utf-8")))


def _leaves(error: ValidationError) -> Iterator[ValidationError]:
    """The innermost errors under a ``oneOf``/``anyOf`` error.

    Most schema nodes are ``oneOf: [<the real schema>, <a ${var.*} string>]``; the branch
    that failed only on its ``type`` is dropped, so an error names the offending field.
    """
    branches = [sub for sub in error.context or [] if sub.validator != "type"]
    if not branches:
        yield error
    for sub in branches:
        yield from _leaves(sub)


def _errors(validator: Any, doc: dict[str, Any]) -> list[str]:
    """``"path/to/field: message"`` for every schema violation in ``doc``."""
    found = {
        f"{'/'.join(map(str, leaf.absolute_path)) or '<root>'}: {leaf.message[:200]}"
        for error in validator.iter_errors(doc)
        for leaf in _leaves(error)
    }
    return sorted(found)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


def _target_value(value: Any) -> Any:
    """A target's variable override is either a plain value or ``{default: value}``."""
    return value["default"] if isinstance(value, dict) and "default" in value else value


def _variables(bundle: dict[str, Any], target: str) -> dict[str, str]:
    values = {name: spec.get("default") for name, spec in bundle["variables"].items()}
    for name, value in (bundle["targets"][target].get("variables") or {}).items():
        values[name] = _target_value(value)
    return {name: str(value) for name, value in values.items() if value is not None}


def _task(bundle: dict[str, Any], key: str = "train") -> dict[str, Any]:
    (task,) = [t for t in bundle["resources"]["jobs"][JOB]["tasks"] if t["task_key"] == key]
    return task


def _task_args(bundle: dict[str, Any], target: str) -> list[str]:
    """The train task's command line in ``target``, bundle variables substituted."""
    task = _task(bundle)
    spec = task.get("spark_python_task") or task.get("python_wheel_task")
    assert spec is not None, "the train task is neither a spark_python_task nor a wheel task"
    values = _variables(bundle, target)
    return [_substitute(arg, values) for arg in spec["parameters"]]


def _substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{var\.([^}]+)\}", lambda m: values[m[1]], text)


def _settings(args: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` pairs of a command line."""
    pairs = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--set"]
    return dict(pair.split("=", 1) for pair in pairs)


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"the train task does not pass {flag}: {args}"
    return args[args.index(flag) + 1]


def _job_cluster(bundle: dict[str, Any], target: str) -> dict[str, Any]:
    """The train task's job cluster in ``target``: the top-level job cluster of the same
    ``job_cluster_key`` joined with the target's, the target's settings taking precedence
    (what the Databricks CLI does: "Override cluster settings in Databricks Asset Bundles")."""
    key = _task(bundle)["job_cluster_key"]
    found: list[dict[str, Any]] = []
    for source in (bundle.get("resources"), bundle["targets"][target].get("resources")):
        job = ((source or {}).get("jobs") or {}).get(JOB) or {}
        found += [
            c["new_cluster"] for c in job.get("job_clusters") or [] if c["job_cluster_key"] == key
        ]
    assert found, f"target {target}: no job cluster {key!r} for the train task"
    merged: dict[str, Any] = {}
    for cluster in found:
        for name, value in cluster.items():
            old = merged.get(name)
            merged[name] = {**old, **value} if isinstance(old, dict) else value
    return merged


# --- the schema ---------------------------------------------------------------------------


def test_bundle_validates_against_the_databricks_schema(
    bundle: dict[str, Any], schema_validator: Any
) -> None:
    errors = _errors(schema_validator, bundle)
    assert not errors, "databricks.yml does not match the bundle schema:\n" + "\n".join(errors)


def test_schema_validation_catches_mistakes(bundle: dict[str, Any], schema_validator: Any) -> None:
    """The validator is not vacuous: a misspelt key, a wrong type and a bad enum all fail."""
    bad = copy.deepcopy(bundle)
    task = bad["resources"]["jobs"][JOB]["tasks"][0]
    task["job_cluster"] = task.pop("job_cluster_key")
    bad["variables"]["num_workers"]["descripton"] = "typo"
    prod = bad["targets"]["prod"]["resources"]["jobs"][JOB]["job_clusters"][0]["new_cluster"]
    prod["num_workers"] = "two"
    prod["data_security_mode"] = "SINGLE"
    paths = {e.split(":")[0] for e in _errors(schema_validator, bad)}
    cluster = f"targets/prod/resources/jobs/{JOB}/job_clusters/0/new_cluster"
    assert paths == {
        f"resources/jobs/{JOB}/tasks/0",
        "variables/num_workers",
        f"{cluster}/num_workers",
        f"{cluster}/data_security_mode",
    }


# --- what the schema cannot see -----------------------------------------------------------


def test_every_referenced_variable_is_declared_and_described(bundle: dict[str, Any]) -> None:
    declared = set(bundle["variables"])
    referenced = {m[1] for text in _strings(bundle) for m in VAR_REF.finditer(text)}
    assert referenced, "databricks.yml references no ${var.*}"
    assert referenced <= declared, f"undeclared variables: {sorted(referenced - declared)}"
    for target, spec in bundle["targets"].items():
        overridden = set(spec.get("variables") or {})
        assert overridden <= declared, f"{target} sets undeclared {sorted(overridden - declared)}"
    undescribed = [n for n, spec in bundle["variables"].items() if not spec.get("description")]
    assert not undescribed, f"variables without a description: {undescribed}"


def test_task_passes_images_and_output_dir_from_variables(bundle: dict[str, Any]) -> None:
    for target in bundle["targets"]:
        args = _task_args(bundle, target)
        images, output = _flag(args, "--images"), _flag(args, "--output-dir")
        assert images.startswith("/Volumes/"), f"{target}: --images {images} is no UC volume"
        assert output.startswith("/Volumes/"), f"{target}: --output-dir {output} is no UC volume"
        assert int(_settings(args)["distributed.num_processes"]) >= 1
    raw = _task(bundle)["spark_python_task"]["parameters"]
    assert _flag(raw, "--images") == "${var.images_path}"
    assert _flag(raw, "--output-dir") == "${var.output_dir}"


def test_train_task_retries_continue_their_own_run(bundle: dict[str, Any]) -> None:
    """A retry of the train task (the job's own, after the job's restarts are used up or
    its driver was lost) resumes from the checkpoint in the same output dir, and only one
    written under the same job run: the next scheduled run starts afresh."""
    train = _task(bundle)
    assert train["max_retries"] >= 1 and train["retry_on_timeout"] is False
    raw = train["spark_python_task"]["parameters"]
    assert "--resume" in raw and _flag(raw, "--resume-key") == "{{job.run_id}}"
    from flowers_job.cli import build_parser

    parsed = build_parser().parse_args(["run", *_task_args(bundle, "dev")])
    assert parsed.resume and parsed.resume_key == "{{job.run_id}}"


def test_score_task_scores_the_test_table_with_the_model_train_registered(
    bundle: dict[str, Any],
) -> None:
    """The job's second task runs `flowers-job predict` after training, on the same cluster,
    with the wheel: the model is the one summary.json in the output dir names."""
    score, train = _task(bundle, "score"), _task(bundle)
    assert score["depends_on"] == [{"task_key": "train"}]
    assert score["job_cluster_key"] == train["job_cluster_key"]
    spec = score["spark_python_task"]
    entry = ROOT / spec["python_file"]
    assert 'main(["predict", *sys.argv[1:]])' in entry.read_text()
    args = spec["parameters"]
    assert _flag(args, "--output-dir") == _flag(
        train["spark_python_task"]["parameters"], "--output-dir"
    )
    # the catalog tables the train task writes (its tables.catalog, tables.schema)
    settings = _settings(train["spark_python_task"]["parameters"])
    assert settings["tables.catalog"] == "${var.tables_catalog}"
    assert settings["tables.schema"] == "${var.tables_schema}"
    assert _flag(args, "--table") == "${var.tables_catalog}.${var.tables_schema}.images"
    assert _flag(args, "--split") == "test"  # the held-out split, a partition of images
    from flowers_job.cli import build_parser
    from flowers_job.tables.table_ref import TableRef

    values = _variables(bundle, "dev")
    parsed = build_parser().parse_args(  # what the entry point parses
        ["predict", *(_substitute(a, values) for a in args)]
    )
    schema = (values["tables_catalog"], values["tables_schema"])
    assert (parsed.split, parsed.table) == ("test", TableRef(parts=(*schema, "images")))
    assert parsed.output_table == TableRef(parts=(*schema, "test_predictions"))
    assert "--model" not in args  # the version summary.json names
    assert _settings(args)["tracking.tracking_uri"] == "databricks"
    assert {"whl": "dist/flowers_job-*.whl"} in score["libraries"]


def test_prod_trains_on_gpu_workers_with_barrier_mode(bundle: dict[str, Any]) -> None:
    settings = _settings(_task_args(bundle, "prod"))
    assert settings["distributed.local_mode"] == "false"
    assert settings["distributed.use_gpu"] == "true"
    cluster = _job_cluster(bundle, "prod")
    assert "-gpu-ml-" in _substitute(cluster["spark_version"], _variables(bundle, "prod"))
    assert cluster["spark_conf"]["spark.task.resource.gpu.amount"] == "1"
    assert cluster["num_workers"] == "${var.num_workers}"


def test_dev_trains_on_one_cpu_node_in_local_mode(bundle: dict[str, Any]) -> None:
    settings = _settings(_task_args(bundle, "dev"))
    assert settings["distributed.local_mode"] == "true"
    assert settings["distributed.use_gpu"] == "false"
    cluster = _job_cluster(bundle, "dev")
    assert cluster["num_workers"] == 0
    assert cluster["spark_conf"]["spark.databricks.cluster.profile"] == "singleNode"
    assert "-cpu-ml-" in _substitute(cluster["spark_version"], _variables(bundle, "dev"))


def _access_mode_problems(cluster: dict[str, Any], values: dict[str, str]) -> list[str]:
    """What Databricks refuses in a job cluster's access mode ("Standard compute requirements
    and limitations", docs.databricks.com/aws/en/compute/
    standard-limitations: "Databricks Runtime for ML is not supported", "GPU-enabled compute
    is not supported"; "Dedicated compute overview": dedicated for "RDD APIs" and "GPU
    instances"): an ML runtime or a GPU setting in standard access mode (USER_ISOLATION), or
    an access mode that is neither standard nor dedicated (no Unity Catalog)."""
    mode = cluster.get("data_security_mode")
    if mode == "SINGLE_USER":
        return []
    if mode != "USER_ISOLATION":
        return [f"data_security_mode {mode!r} is neither SINGLE_USER nor USER_ISOLATION"]
    problems = []
    runtime = _substitute(str(cluster.get("spark_version", "")), values)
    if "-ml-" in runtime or "-gpu-" in runtime:
        problems.append(f"{runtime}: Databricks Runtime ML in standard access mode")
    gpu = {k for k in cluster.get("spark_conf") or {} if ".resource.gpu." in k}
    if gpu:
        problems.append(f"GPU settings {sorted(gpu)} in standard access mode")
    return problems


def test_classic_targets_keep_dedicated_access_mode(bundle: dict[str, Any]) -> None:
    """dev and prod stay classic: a Databricks Runtime ML in dedicated (single user) access
    mode, the job's classic Spark path (the executor probe and restarts use the SparkContext)."""
    assert set(bundle["targets"]) == set(TARGETS), sorted(bundle["targets"])
    for target in CLASSIC_TARGETS:
        cluster = _job_cluster(bundle, target)
        assert cluster["data_security_mode"] == "SINGLE_USER", target
        assert "-ml-" in _substitute(cluster["spark_version"], _variables(bundle, target))


def test_standard_trains_on_spark_connect_compute(bundle: dict[str, Any]) -> None:
    """standard: a job cluster in standard access mode (a Spark Connect session) on the plain
    runtime with CPU workers, ranks as barrier tasks on the workers (TorchDistributor's
    mapInArrow path) with gloo, one per worker node, reading with Mosaic Streaming."""
    values = _variables(bundle, "standard")
    cluster = _job_cluster(bundle, "standard")
    assert cluster["data_security_mode"] == "USER_ISOLATION"
    assert _substitute(cluster["spark_version"], values) == f"{values['dbr_version']}-scala2.13"
    assert cluster["node_type_id"] == "${var.cpu_node_type}"
    assert _access_mode_problems(cluster, values) == []
    settings = _settings(_task_args(bundle, "standard"))
    assert settings["data.loader"] == "streaming"
    assert settings["distributed.local_mode"] == "false"
    assert settings["distributed.use_gpu"] == "false"
    assert settings["distributed.num_processes"] == values["num_workers"]
    assert cluster["spark_conf"]["spark.task.cpus"] == "4"  # a node's vCPUs: a rank per node
    # the credentials and the allocator tuning come from the shared job cluster, as classic's
    assert cluster["spark_env_vars"] == _job_cluster(bundle, "dev")["spark_env_vars"]


def test_access_mode_rules_catch_what_databricks_refuses(bundle: dict[str, Any]) -> None:
    """The rules hold for every target, and are not vacuous: prod's GPU runtime and GPU task
    setting, or dev's ML runtime, in standard access mode are refused, as is no access mode."""
    for target in TARGETS:
        values = _variables(bundle, target)
        assert _access_mode_problems(_job_cluster(bundle, target), values) == [], target
    prod = {**_job_cluster(bundle, "prod"), "data_security_mode": "USER_ISOLATION"}
    assert len(_access_mode_problems(prod, _variables(bundle, "prod"))) == 2
    dev = {**_job_cluster(bundle, "dev"), "data_security_mode": "USER_ISOLATION"}
    assert len(_access_mode_problems(dev, _variables(bundle, "dev"))) == 1
    none = {**_job_cluster(bundle, "standard"), "data_security_mode": "NONE"}
    assert len(_access_mode_problems(none, _variables(bundle, "standard"))) == 1


def test_tracking_goes_to_databricks_and_unity_catalog(bundle: dict[str, Any]) -> None:
    for target in bundle["targets"]:
        settings = _settings(_task_args(bundle, target))
        assert settings["tracking.tracking_uri"] == "databricks"
        assert settings["tracking.experiment_name"].startswith("/Users/")
        name = settings["tracking.registered_model_name"]
        assert len(name.split(".")) == 3, f"{target}: {name} is not catalog.schema.model"


def test_task_reads_with_mosaic_streaming(bundle: dict[str, Any]) -> None:
    for target in bundle["targets"]:
        assert _settings(_task_args(bundle, target))["data.loader"] == "streaming", target


def test_libraries_are_the_built_wheel_and_pins_that_match_pyproject(
    bundle: dict[str, Any],
) -> None:
    project = _project()
    wheel_prefix = canonicalize_name(project["name"]).replace("-", "_") + "-"
    (artifact,) = bundle["artifacts"].values()
    assert artifact["type"] == "whl"
    built = {f["source"] for f in artifact["files"]}
    libraries = _task(bundle)["libraries"]
    wheels = [lib["whl"] for lib in libraries if "whl" in lib]
    assert wheels and set(wheels) <= built, f"task wheels {wheels} are not the artifact {built}"
    assert all(Path(w).name.startswith(wheel_prefix) for w in wheels), wheels
    # A `whl` library takes no extras: the [streaming] extra's packages are pypi libraries.
    wanted = {
        canonicalize_name(r.name): r
        for r in _requirements(project["dependencies"] + _extra(project, "streaming"))
    }
    pins = _bundle_pins(bundle)
    names = {canonicalize_name(p.name) for p in pins}
    assert "petastorm" not in names, "the bundle installs petastorm, which 17.3 cannot run"
    streaming = {canonicalize_name(r.name) for r in _requirements(_extra(project, "streaming"))}
    assert streaming <= names, f"the [streaming] extra {sorted(streaming)} is not installed"
    runtimes = {runtime: _runtime_versions(runtime) for runtime in RUNTIMES}
    for pin in pins:
        name = canonicalize_name(pin.name)
        dep = wanted.get(name)
        assert dep is not None, f"{pin.name} is not a requirement of the wheel or [streaming]"
        shipped = {rt: versions[name] for rt, versions in runtimes.items() if name in versions}
        if name in RUNTIME_RAISED:  # raised past a CVE: the exact version the DBR tests run
            assert str(pin.specifier) == f"=={RUNTIME_RAISED[name]}", pin
            assert dep.specifier.contains(RUNTIME_RAISED[name]), (
                f"{pin} is not in pyproject's {dep}"
            )
            kept = {rt: v for rt, v in shipped.items() if dep.specifier.contains(v)}
            assert not kept, f"{dep} allows the runtime's vulnerable {name}: {kept}"
        elif shipped:  # the runtimes ship it: pyproject's own floor, which each one meets
            assert pin.specifier == dep.specifier, f"{pin} is not pyproject's {dep}"
            refused = {rt: v for rt, v in shipped.items() if not pin.specifier.contains(v)}
            assert not refused, f"{pin} would change the runtime's own version: {refused}"
        else:  # not on the runtimes: an exact pin that pyproject allows
            (spec,) = pin.specifier
            assert spec.operator == "==", f"{pin} is not an exact pin"
            assert dep.specifier.contains(spec.version), f"{pin} does not satisfy pyproject's {dep}"


# --- the wheel's requirements against Databricks Runtime 17.3 LTS ML and 18 ML --------------


def _project() -> dict[str, Any]:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert isinstance(project, dict)
    return project


def _extra(project: dict[str, Any], name: str) -> list[str]:
    extras = project.get("optional-dependencies") or {}
    assert name in extras, f"pyproject.toml has no [{name}] extra"
    return list(extras[name])


def _requirements(lines: list[str]) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def _bundle_pins(bundle: dict[str, Any]) -> list[Requirement]:
    return [
        Requirement(lib["pypi"]["package"]) for lib in _task(bundle)["libraries"] if "pypi" in lib
    ]


def _runtime_versions(runtime: str = "17.3") -> dict[str, str]:
    """``{name: version}`` that Databricks Runtime ``runtime`` ML ships: 17.3 LTS
    (../shared/runtimes and ``RUNTIME_MORE``) or 18 (17.3's with ``RUNTIME_18_CHANGES``)."""
    if runtime == "18":
        changed = {**_runtime_versions("17.3"), **RUNTIME_18_CHANGES}
        return {name: version for name, version in changed.items() if version is not None}
    if not RUNTIME.is_file():
        pytest.skip(f"the 17.3 LTS ML versions are not at {RUNTIME} (shared/runtimes is absent)")
    pins: dict[str, str] = {}
    for raw in RUNTIME.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    assert {"numpy", "pyarrow", "torch", "mlflow-skinny"} <= set(pins), pins
    return {**RUNTIME_MORE, **pins}


def _bundle_versions(runtime: str = "17.3") -> dict[str, str]:
    """``{name: version}`` on a job cluster of Databricks Runtime ``runtime`` ML once the
    bundle's libraries are installed: the runtime's versions with :data:`RUNTIME_RAISED`'s."""
    versions = _runtime_versions(runtime)
    return {**versions, **{n: v for n, v in RUNTIME_RAISED.items() if n in versions}}


def _pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of a requirements file of ``name==version`` lines."""
    pins: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_dbr_requirements_carry_the_runtime_versions(runtime: str) -> None:
    """requirements/dbr-<runtime>-ml.txt (``make test-dbr``, ``make test-dbr18``) has the
    runtime's version of every package it ships that the job touches: the tests run against
    what the runtime has, but :data:`RUNTIME_RAISED`'s versions, which the bundle installs."""
    versions = _bundle_versions(runtime)
    path = DBR_REQUIREMENTS[runtime]
    pins = _pins(path)
    wrong = {name: (pins.get(name), version) for name, version in versions.items()}
    wrong = {name: got for name, got in wrong.items() if got[0] != got[1]}
    assert not wrong, f"{path.name}: (pinned, {runtime}'s) {wrong}"


def _imports(package: Path) -> dict[str, set[str]]:
    """``{top-level module: {"file:line", ...}}`` of every absolute import in ``package``'s
    sources that is neither the standard library's nor the package's own, lazy imports
    inside functions included (an AST walk)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    where = f"{path.relative_to(package.parent)}:{node.lineno}"
                    found.setdefault(top, set()).add(where)
    return found


def test_every_third_party_import_is_declared() -> None:
    """The wheel declares what it imports: each third-party module that flowers_job imports
    (anywhere, lazily too) comes from a requirement of the wheel or of one of its extras,
    so that no import works only because another package happens to pull it in (the full
    mlflow pulls scikit-learn and matplotlib; mlflow-skinny, what runtimes ship, does not).
    And what the end of a run imports is a requirement of the wheel itself, not an extra's."""
    import flowers_job
    from flowers_job.tracking.packages import RUN_PACKAGES

    project = _project()
    base = {canonicalize_name(r.name) for r in _requirements(project["dependencies"])}
    declared = set(base)
    for extra in project.get("optional-dependencies", {}).values():
        declared |= {canonicalize_name(r.name) for r in _requirements(extra)}
    providers = metadata.packages_distributions()
    imports = _imports(Path(flowers_job.__file__).resolve().parent)
    assert {"torch", "sklearn", "matplotlib", "mlflow"} <= set(imports), sorted(imports)
    undeclared = {
        module: sorted(where)
        for module, where in imports.items()
        # a module that is not installed here (petastorm in the 17.3 environment): its name
        if not {canonicalize_name(d) for d in providers.get(module, [module])} & declared
    }
    assert not undeclared, f"imported, but no requirement of the wheel provides it: {undeclared}"
    run = {canonicalize_name(dist) for dist, _, _ in RUN_PACKAGES}
    assert run <= base, f"the end of every run needs {sorted(run - base)}: not in dependencies"


@pytest.mark.parametrize("version", RUNTIMES)
def test_wheel_requirements_admit_the_runtime_versions(version: str) -> None:
    """Offline: every requirement of the wheel and of [streaming] allows the runtime's
    version of the package, so installing the wheel there changes none of them."""
    project = _project()
    runtime = _runtime_versions(version)
    reqs = _requirements(project["dependencies"] + _extra(project, "streaming"))
    names = {canonicalize_name(r.name) for r in reqs}
    assert "petastorm" not in names, "petastorm is a requirement of the wheel, not an extra"
    assert "mlflow" not in names, "the wheel needs mlflow-skinny (what runtimes ship), not mlflow"
    assert "mlflow-skinny" in names
    refused = [
        f"{r} refuses {name}=={runtime[name]}"
        for r in reqs
        if (name := canonicalize_name(r.name)) in runtime
        and name not in RUNTIME_RAISED
        and not r.specifier.contains(runtime[name], prereleases=True)
    ]
    assert not refused, f"the wheel would change Databricks Runtime {version} ML:\n" + "\n".join(
        refused
    )
    # The Petastorm bounds belong to its extra, and pyarrow 19 / NumPy 2 are outside them.
    petastorm: dict[str, Requirement] = {
        canonicalize_name(r.name): r for r in _requirements(_extra(project, "petastorm"))
    }
    assert "petastorm" in petastorm
    assert not petastorm["pyarrow"].specifier.contains(runtime["pyarrow"])
    assert not petastorm["numpy"].specifier.contains(runtime["numpy"])


def test_pillow_is_raised_past_the_cve_everywhere_the_job_installs_it(
    bundle: dict[str, Any],
) -> None:
    """CVE-2026-25990: the wheel's floor is the first fixed Pillow (the runtime check's
    floor), which refuses what both runtimes ship and the last affected release; both of the
    job's tasks install :data:`RUNTIME_RAISED`'s exact Pillow, and each DBR lock file carries
    it with a comment naming the runtime's own version and the CVE. Pillow is the only
    package raised."""
    from flowers_job.vision.pillow_floor import PILLOW_CVE, PILLOW_FLOOR

    assert set(RUNTIME_RAISED) == {"pillow"}
    (pillow,) = [
        r
        for r in _requirements(_project()["dependencies"])
        if canonicalize_name(r.name) == "pillow"
    ]
    assert str(pillow.specifier) == f">={PILLOW_FLOOR}"
    assert pillow.specifier.contains(RUNTIME_RAISED["pillow"])
    shipped = {_runtime_versions(rt)["pillow"] for rt in RUNTIMES}
    assert shipped == {"11.1.0"}, shipped
    assert not pillow.specifier.contains("11.1.0") and not pillow.specifier.contains("12.1.0")
    for key in ("train", "score"):
        pins = [
            Requirement(lib["pypi"]["package"].split("#")[0])
            for lib in _task(bundle, key)["libraries"]
            if "pypi" in lib
        ]
        assert f"pillow=={RUNTIME_RAISED['pillow']}" in [str(p) for p in pins], (key, pins)
    for path in DBR_REQUIREMENTS.values():
        text = path.read_text(encoding="utf-8")
        assert _pins(path)["pillow"] == RUNTIME_RAISED["pillow"], path.name
        assert PILLOW_CVE in text and "not the runtime's 11.1.0" in text, path.name


def test_flowers_job_is_the_installed_wheel_when_required() -> None:
    if os.environ.get("FLOWERS_EXPECT_WHEEL") != "1":
        pytest.skip("FLOWERS_EXPECT_WHEEL is not set (only `make test-dbr` tests the wheel)")
    import flowers_job

    module = Path(flowers_job.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert site in module.parents, f"flowers_job comes from {module}, not the wheel in {site}"
    dist = metadata.distribution("flowers-job")
    assert dist.read_text("direct_url.json") is None or '"editable": true' not in (
        dist.read_text("direct_url.json") or ""
    ), "flowers-job is installed editable, not as a built wheel"


@pytest.fixture(scope="module")
def wheel(pypi: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel: FLOWERS_WHEEL, or built from a copy of the sources."""
    given = os.environ.get("FLOWERS_WHEEL")
    if given:
        return Path(given).resolve()
    src = tmp_path_factory.mktemp("wheel-src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "flowers_job", src / "flowers_job", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(src))
    (built,) = out.glob("flowers_job-*.whl")
    return built


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _dry_run(tmp_path: Path, *args: str) -> list[tuple[str, str]]:
    """``(name, version)`` of every package ``pip install --dry-run ARGS`` would install."""
    report = tmp_path / "report.json"
    _pip("install", "--dry-run", "--quiet", "--report", str(report), *args)
    items = json.loads(report.read_text(encoding="utf-8"))["install"]
    return [
        (canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]) for item in items
    ]


def _compile(tmp_path: Path, constraints: Path, *requirements: str) -> dict[str, str]:
    """``{name: version}`` of everything an install of ``requirements`` from scratch would
    bring for this interpreter, constrained by ``constraints`` (``"url"`` for a requirement
    given as a file), with uv's resolver (``uv pip compile``), which reads the wheels'
    metadata from the index without downloading them: pip's ``install --dry-run
    --ignore-installed`` took 121-149 s for one runtime in CI."""
    wanted = tmp_path / "requirements.in"
    wanted.write_text("".join(f"{line}\n" for line in requirements), encoding="utf-8")
    args = ["pip", "compile", "--no-config", "--python", sys.executable, "--no-header"]
    args += ["--no-annotate", "--constraint", str(constraints), str(wanted)]
    proc = subprocess.run(
        [uv_bin(), *args],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
        env=clean_env(),
        check=False,
    )
    assert proc.returncode == 0, f"uv pip compile failed: {uv_failure(proc.stderr)}"
    got: dict[str, str] = {}
    for raw in proc.stdout.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            got[canonicalize_name(req.name)] = (
                next(iter(req.specifier)).version if req.specifier else "url"
            )
    return got


@pytest.mark.network
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", RUNTIMES)
def test_bundle_libraries_resolve_at_the_runtime_versions(
    bundle: dict[str, Any], wheel: Path, tmp_path: Path, version: str
) -> None:
    """From scratch, constrained to the runtime's versions (17.3 LTS, 18): the resolver finds
    a solution (or the wheel asks for a version the runtime does not have) and installs the
    runtime's versions: nothing is upgraded or downgraded.

    The resolution ignores what is installed, so it runs once, in ``make test-dbr``, against
    the built wheel."""
    if os.environ.get("FLOWERS_EXPECT_WHEEL") != "1":
        pytest.skip(
            "runs once, in `make test-dbr` against the built wheel: the resolution does not "
            "depend on the environment (it starts from scratch)"
        )
    runtime = _bundle_versions(version)
    constraints = tmp_path / f"dbr-{version}-ml.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in runtime.items()), encoding="utf-8")
    got = _compile(
        tmp_path,
        constraints,
        f"flowers-job[streaming] @ {wheel.as_uri()}",
        *(str(pin) for pin in _bundle_pins(bundle)),
    )
    assert "flowers-job" in got, got
    assert "petastorm" not in got
    assert "pyspark" not in got, "the wheel pulls pyspark (mosaicml-streaming's spark extra?)"
    other = {n: (v, runtime[n]) for n, v in got.items() if n in runtime and v != runtime[n]}
    assert not other, f"versions other than {version}'s: {other}"
    for name in ("numpy", "pyarrow", "torch", "mlflow-skinny", "mosaicml-streaming"):
        assert got.get(name) == runtime[name], f"{name}: {got.get(name)}"


@pytest.mark.network
@pytest.mark.timeout(600)
def test_installing_the_bundle_libraries_changes_nothing_installed(
    bundle: dict[str, Any], wheel: Path, tmp_path: Path
) -> None:
    """Installing into this environment would add or change no package but the project.

    In an environment with a runtime's versions (``make test-dbr``:
    requirements/dbr-17.3-ml.txt, required there; requirements/dbr-18-ml.txt) that is
    everything the bundle installs: the wheel with [streaming] and its pypi libraries.
    Elsewhere (the local stack) it is the wheel with [streaming] only: the bundle's pins are
    the runtimes' versions, not this environment's.
    """
    runtimes = {version: _bundle_versions(version) for version in RUNTIMES}
    this = [v for v, pins in runtimes.items() if all(_installed(n) == pins[n] for n in pins)]
    is_runtime = bool(this)
    if os.environ.get("FLOWERS_EXPECT_WHEEL") == "1":
        have = {name: _installed(name) for name in runtimes["17.3"]}
        assert is_runtime, f"this is no runtime's environment: {have} != {runtimes['17.3']}"
    pins = [str(pin) for pin in _bundle_pins(bundle)] if is_runtime else []
    installs = _dry_run(tmp_path, f"{wheel}[streaming]", *pins)
    changes = []
    for name, version in installs:
        if name == "flowers-job":
            continue
        installed = _installed(name)
        if installed is None:
            changes.append(f"{name}: not installed, would install {version}")
        else:
            changes.append(f"{name}: {installed} would become {version}")
    assert not changes, f"installing into {sys.prefix} would change:\n" + "\n".join(changes)


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --- the daily job: schedule, policy, credentials, timeouts --------------------------------


def _resolve(node: Any, values: dict[str, Any]) -> Any:
    """``node`` with every ``${var.NAME}`` replaced by the variable's value: a string that
    is one reference takes the value with its type (an int stays an int), a longer string
    gets it as text."""
    if isinstance(node, dict):
        return {key: _resolve(value, values) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve(item, values) for item in node]
    if isinstance(node, str):
        whole = re.fullmatch(r"\$\{var\.([^}]+)\}", node)
        if whole:
            return values[whole[1]]
        return re.sub(r"\$\{var\.([^}]+)\}", lambda m: str(values[m[1]]), node)
    return node


def _typed_variables(bundle: dict[str, Any], target: str) -> dict[str, Any]:
    values = {name: spec.get("default") for name, spec in bundle["variables"].items()}
    for name, value in (bundle["targets"][target].get("variables") or {}).items():
        values[name] = _target_value(value)
    return values


@pytest.mark.parametrize("target", TARGETS)
def test_bundle_with_the_targets_values_validates(
    bundle: dict[str, Any], schema_validator: Any, target: str
) -> None:
    """With each target's variable values in place (the empty policy_id, the paused
    schedule, the timeouts as ints), the bundle still matches the schema; a misspelt pause
    status does not."""
    resolved = _resolve(bundle, _typed_variables(bundle, target))
    errors = _errors(schema_validator, resolved)
    assert not errors, f"{target}'s values do not match the bundle schema:\n" + "\n".join(errors)
    assert resolved["resources"]["jobs"][JOB]["job_clusters"][0]["new_cluster"]["policy_id"] == ""
    values = {**_typed_variables(bundle, target), "schedule_pause_status": "PAUSE"}
    paths = {e.split(":")[0] for e in _errors(schema_validator, _resolve(bundle, values))}
    assert paths == {f"resources/jobs/{JOB}/schedule/pause_status"}, paths


def test_daily_schedule_is_deployed_paused(bundle: dict[str, Any]) -> None:
    """A daily retrain in Quartz syntax, in UTC, paused unless a deployment says otherwise."""
    job = bundle["resources"]["jobs"][JOB]
    assert not {"trigger", "continuous"} & job.keys(), "one way to start runs: the schedule"
    schedule = job["schedule"]
    assert schedule["pause_status"] == "${var.schedule_pause_status}"
    assert schedule["timezone_id"] == "UTC"
    for target in bundle["targets"]:
        values = _typed_variables(bundle, target)
        assert values["schedule_pause_status"] == "PAUSED", target
        cron = str(_resolve(schedule["quartz_cron_expression"], values)).split()
        # seconds minutes hours day-of-month month day-of-week [year]: fixed time, every day
        assert len(cron) in (6, 7) and all(field.isdigit() for field in cron[:3]), cron
        assert cron[3:6] in (["*", "*", "?"], ["?", "*", "*"]), f"not daily: {cron}"
    assert job["max_concurrent_runs"] == 1


def test_job_cluster_takes_a_cluster_policy_from_a_variable(bundle: dict[str, Any]) -> None:
    assert bundle["variables"]["policy_id"]["default"] == ""
    for target in bundle["targets"]:
        assert _job_cluster(bundle, target)["policy_id"] == "${var.policy_id}", target


CREDENTIAL = re.compile(r"TOKEN|SECRET|PASSWORD|CLIENT_ID", re.IGNORECASE)


def _pairs(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key), value
            yield from _pairs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _pairs(item)


@pytest.mark.parametrize("target", TARGETS)
def test_executors_get_databricks_credentials_from_a_secret_scope(
    bundle: dict[str, Any], target: str
) -> None:
    """Every process of the job cluster, the executors' ranks among them (barrier mode: rank
    0 logs and registers from an executor), gets DATABRICKS_HOST and DATABRICKS_TOKEN; the
    token as a reference to a secret the cluster resolves at start, scope and key from
    variables; no credential's value is written in the file."""
    env = _job_cluster(bundle, target)["spark_env_vars"]
    assert env["DATABRICKS_HOST"] == "${workspace.host}"
    assert env["DATABRICKS_TOKEN"] == "{{secrets/${var.secret_scope}/${var.token_secret_key}}}"
    token = _substitute(env["DATABRICKS_TOKEN"], _variables(bundle, target))
    assert re.fullmatch(r"\{\{secrets/[\w.-]+/[\w.-]+\}\}", token), token
    for key, value in _pairs(bundle):
        if CREDENTIAL.search(key) and isinstance(value, str):
            assert value.startswith("{{secrets/"), f"{key}: {value!r} is no secret reference"
    text = BUNDLE.read_text(encoding="utf-8")
    assert not re.search(r"\bdapi[0-9a-f]{16,}", text), "a personal access token in databricks.yml"


SCALE_RUN = ROOT / "benchmarks" / "results" / "2026-11-25" / "76dc9f4" / "scale_x30.json"
"""The scale benchmark's largest run (benchmarks/README.md, "Measured (scale)"):
110,100 photos, 2026-11-25, an Intel Xeon 2-core, 24 GiB machine without a GPU."""
SAFETY = 2
"""Over the measured times: the job trained about 1.9x faster on another 2-core machine the
same day (157 against 83 images/s, code 0e150d3), and a Databricks node is neither."""
RESTART_SECONDS = 60
"""From a failure to the first step again: 43 s measured after a kill (docs/failures.md)."""


def _ten_minutes_up(seconds: float) -> int:
    return -(-int(seconds) // 600) * 600


def test_timeouts_are_sized_from_the_scale_benchmark(bundle: dict[str, Any]) -> None:
    """docs/cluster.md#timeouts: the job measured at 110,100 photos with the default epochs,
    x SAFETY, plus one restart (train.max_restarts); the job's timeout adds the task's
    retries, each a resume that loses at most a checkpoint interval, and the score task."""
    from flowers_job.config.model import TrainConfig

    run = json.loads(SCALE_RUN.read_text(encoding="utf-8"))
    train = TrainConfig()
    first = run["train_first"]  # one epoch; each further epoch costs its epoch_seconds
    once = run["full_ingest"]["wall_seconds"] + first["wall_seconds"]
    once += (train.epochs - 1) * first["epoch_seconds"]
    assert run["full_ingest"]["files"] == 110_100 and round(once) == 6334
    restart = (train.checkpoint_every_seconds or 0) + RESTART_SECONDS
    attempt = _ten_minutes_up(SAFETY * once + train.max_restarts * restart)
    score = _ten_minutes_up(SAFETY * run["predict"]["wall_seconds"])
    task = _task(bundle)
    retries = task["max_retries"] * (task["min_retry_interval_millis"] / 1000 + restart)
    whole = _ten_minutes_up(attempt + retries + score)
    defaults = {name: spec.get("default") for name, spec in bundle["variables"].items()}
    assert (attempt, score, whole) == (13_200, 600, 15_000)
    assert task["timeout_seconds"] == "${var.train_timeout_seconds}"
    assert defaults["train_timeout_seconds"] == attempt
    assert _task(bundle, "score")["timeout_seconds"] == score
    assert bundle["resources"]["jobs"][JOB]["timeout_seconds"] == "${var.job_timeout_seconds}"
    assert defaults["job_timeout_seconds"] == whole
    assert task["retry_on_timeout"] is False  # a timed-out attempt would time out again


# --- docker/Dockerfile --------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    lines = [
        line
        for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()
        if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def _run_steps() -> list[str]:
    """Every shell command of every RUN, in order (split on ``&&``; a RUN's own flags,
    ``--mount=...``, dropped)."""
    return [
        step.strip()
        for name, args in _instructions()
        if name == "RUN"
        for step in re.sub(r"^(--\S+ )+", "", args).split("&&")
    ]


def _index(steps: list[str], pattern: str) -> int:
    hits = [i for i, step in enumerate(steps) if re.search(pattern, step)]
    assert len(hits) == 1, f"expected one RUN step matching {pattern!r}, found {len(hits)}"
    return hits[0]


def test_dockerfile_installs_the_lock_then_the_project_no_deps() -> None:
    """The base is a build argument whose default is the public Python image (the tests
    build it on a Debian-made one: tests/container); the default lock file is synced exactly
    into a venv, then the project without its dependencies; no Petastorm, which cannot
    import beside that lock's pyarrow."""
    instructions = _instructions()
    assert instructions[0] == ("ARG", "BASE=python:3.11-slim-bookworm")
    assert instructions[1] == ("FROM", "${BASE}")
    copies = [args.split() for name, args in instructions if name == "COPY"]
    assert any("requirements/lock.txt" in args[:-1] for args in copies), copies
    steps = _run_steps()
    lock = _index(steps, r"^uv pip sync (\S+ )*requirements/lock\.txt$")
    project = _index(steps, r"uv pip install (\S+ )*\.$")
    assert "--no-deps" in steps[project].split(), steps[project]
    assert lock < project
    assert not any("petastorm" in step for step in steps), steps


def test_dockerfile_runs_offline_ready_as_the_cli() -> None:
    """Java and the jars inside (a fixed Ivy cache, on every JVM's class path), a non-root
    user, the CLI as the entry point, and no SPARK_LOCAL_IP: a cluster container binds its
    own address."""
    instructions = _instructions()
    env = " ".join(args for name, args in instructions if name == "ENV")
    assert "SPARK_LOCAL_IP" not in env
    steps = _run_steps()
    assert any("openjdk-17-jre-headless" in step for step in steps)
    assert any("spark.jars.ivy" in step for step in steps), "no fixed Ivy cache for Delta jars"
    assert any("spark.executor.extraClassPath" in step for step in steps)
    assert any("get_spark" in step for step in steps), "Delta jars are not fetched at build"
    users = [args for name, args in instructions if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert instructions[[n for n, _ in instructions].index("ENTRYPOINT")] == (
        "ENTRYPOINT",
        '["flowers-job"]',
    )


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a folder above it wins; a
    ``!`` pattern includes again."""
    import fnmatch

    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch(c, glob) for c in candidates):
            ignored = not keep
    return ignored


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    """An allowlist: what the Dockerfile copies is in the context; the virtual
    environments, the git folder and the job's output are not."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for left_out in (".venv", ".venv-dbr", ".venv-cluster", ".git", "output", "dist"):
        assert _docker_ignored(left_out, patterns), f"{left_out} is in the build context"
    copied = {
        src.rstrip("/")
        for name, args in _instructions()
        if name == "COPY"
        for src in args.split()[:-1]
        if not src.startswith("--")
    }
    assert copied, "the Dockerfile copies nothing"
    for src in copied:
        assert not _docker_ignored(src, patterns), f"{src} is copied but .dockerignore drops it"
        assert not _docker_ignored(f"{src}/x.py", patterns) or Path(src).suffix, src


@pytest.mark.parametrize("target", TARGETS)
def test_clusters_run_with_the_allocator_tuning(bundle: dict[str, Any], target: str) -> None:
    """Every process of the job cluster gets flowers_job.runtime.allocator's glibc settings."""
    from flowers_job.runtime.allocator import ALLOCATOR_ENV

    env = _job_cluster(bundle, target)["spark_env_vars"]
    assert {name: env.get(name) for name in ALLOCATOR_ENV} == dict(ALLOCATOR_ENV)
