"""A loader that needs classic Spark says so (``Loader.classic_only``), and a Spark Connect
session refuses it before any work, naming the API it lacks and a loader that can run there;
``auto`` passes it by, and passes by the loader that reads the table itself where its files
may not be the job's to open (``Loader.auto_problem``). Every registered loader runs on
Connect (tried for real: tests/integration/test_connect.py), so the refusal is shown with a
loader made here that declares a classic-only API. No Spark: the refusal comes before any session is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowers_job import loaders
from flowers_job.config import ConfigError, load_config
from flowers_job.errors import ClusterError
from flowers_job.loaders import check_session, registered_loaders, resolve_loader

pytestmark = pytest.mark.tier("gate")

CONNECT = "--remote sc://127.0.0.1:15002"
"""What made the session Spark Connect, as :func:`flowers_job.cluster.connect.wanted_connect`
names it."""


def test_both_loaders_run_on_spark_connect() -> None:
    """Petastorm's loader here writes its cache with DataFrame writes and reads it with
    Petastorm's reader on the ranks: no ``make_spark_converter``, no ``DataFrame._jdf``."""
    for loader in registered_loaders():
        assert loader.classic_only is None, loader.name
        check_session(loader, CONNECT)


def test_a_classic_only_loader_is_refused_on_connect_naming_the_api_and_streaming(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (petastorm,) = [x for x in registered_loaders() if x.name == "petastorm"]
    monkeypatch.setattr(petastorm, "classic_only", "pyspark.sql.DataFrame._jdf")
    check_session(petastorm, None)  # classic Spark: fine
    auto = load_config(None, ["data.loader=auto"], **{"paths.output_dir": tmp_path})
    with pytest.raises(ClusterError) as err:
        check_session(petastorm, CONNECT, auto)
    message = str(err.value)
    assert "data.loader: 'petastorm'" in message
    assert "pyspark.sql.DataFrame._jdf" in message and CONNECT in message
    streaming_runs = loaders.loader_problem("streaming") is None
    assert ("use data.loader=streaming" in message) == streaming_runs
    cfg = load_config(None, ["data.loader=petastorm"], **{"paths.output_dir": tmp_path})
    # where Petastorm cannot import at all (the default environment), that is the refusal
    expected = (
        r"petastorm needs pyspark\.sql\.DataFrame\._jdf"
        if loaders.loader_problem("petastorm") is None
        else r"'petastorm' cannot run on this stack"
    )
    with pytest.raises(ConfigError, match=expected):
        resolve_loader(cfg, CONNECT)
    if streaming_runs:
        resolved, loader = resolve_loader(auto, CONNECT)
        assert loader.name == resolved.data.loader == "streaming"
    assert resolve_loader(auto)[1].name == resolve_loader(auto, None)[1].name


def test_auto_reads_the_table_itself_only_for_path_tables_on_classic_spark(
    tmp_path: Path,
) -> None:
    """Where deltalake imports, 'auto' is the Delta loader for path tables on classic
    Spark, and passes it over, saying why, for catalog tables (their files are the
    catalog's: Unity Catalog serves them to its own readers) and on Spark Connect; a
    ``data.loader=delta`` set by hand is still taken there."""
    (delta,) = [x for x in registered_loaders() if x.name == "delta"]
    if loaders.loader_problem("delta") is not None:
        pytest.skip(f"needs deltalake: {loaders.loader_problem('delta')}")
    out = {"paths.output_dir": tmp_path}
    paths = load_config(None, ["data.loader=auto"], **out)
    catalog = load_config(None, ["data.loader=auto", "tables.schema=flowers"], **out)
    assert resolve_loader(paths)[1] is delta
    assert delta.auto_problem(paths, None) is None
    assert "catalog tables (tables.schema)" in str(delta.auto_problem(catalog, None))
    assert CONNECT in str(delta.auto_problem(paths, CONNECT))
    assert resolve_loader(catalog)[1].name != "delta"
    assert resolve_loader(paths, CONNECT)[1].name != "delta"
    named = load_config(None, ["data.loader=delta", "tables.schema=flowers"], **out)
    assert resolve_loader(named, CONNECT)[1] is delta
