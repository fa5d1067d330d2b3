"""Ranks placed on hosts in Spark's order (flowers_job.runtime.layout.HostLayout): which shard each
rank reads, and which loader can serve which layout. The same on a real cluster:
tests/cluster/test_cluster.py::TestLoopbackNames (4 ranks on 2 hosts, 3 ranks on 2 hosts)."""

from __future__ import annotations

import itertools
import os

import pytest

from flowers_job.loaders import registered_loaders
from flowers_job.loaders.base import Loader
from flowers_job.runtime.layout import HostLayout
from flowers_job.runtime.process_group import shard_environment

pytestmark = pytest.mark.tier("gate")


def _loader(name: str) -> type[Loader]:
    """The registered loader called ``name``."""
    return {cls.name: cls for cls in registered_loaders()}[name]


def layouts(hosts: list[str]) -> list[HostLayout]:
    return [HostLayout.of(hosts, rank) for rank in range(len(hosts))]


def test_ranks_spark_alternates_over_two_hosts_read_consecutive_shards_per_host() -> None:
    """Spark gives each executor one barrier task per pass: ranks 0, 2 on one host and 1, 3
    on the other. Grouped by host, the shards are consecutive on each host (Streaming's
    node = shard // local_world_size), rank 0 reads shard 0, and DDP keeps the ranks."""
    seen = layouts(["w1", "w2", "w1", "w2"])
    assert [(x.shard, x.local_rank, x.local_world_size) for x in seen] == [
        (0, 0, 2),
        (2, 0, 2),
        (1, 1, 2),
        (3, 1, 2),
    ]
    assert all(x.equal and x.num_nodes == 2 for x in seen)
    assert seen[0].describe() == "w1: ranks 0, 2; w2: ranks 1, 3"
    for x in seen:  # what Streaming derives from the shard is this rank's own host
        assert x.shard // x.local_world_size == ["w1", "w2"].index(x.hosts[x.rank])


@pytest.mark.parametrize("hosts", [["a", "b", "a"], ["a", "a", "b", "c", "b", "c"], ["x"]])
def test_every_rank_reads_one_shard_and_every_shard_is_read(hosts: list[str]) -> None:
    shards = [x.shard for x in layouts(hosts)]
    assert sorted(shards) == list(range(len(hosts)))
    assert shards[0] == 0


def test_consecutive_ranks_keep_their_rank_as_shard() -> None:
    """The layout of local mode and of one task slot per host: nothing moves."""
    for hosts in (["h"] * 4, ["a", "a", "b", "b"], ["a", "b", "c"]):
        assert [x.shard for x in layouts(hosts)] == list(range(len(hosts)))


def test_streaming_refuses_unequal_hosts_and_petastorm_reads_them() -> None:
    layout = HostLayout.of(["w1", "w2", "w1"], 1)
    assert not layout.equal
    with pytest.raises(RuntimeError) as refused:
        _loader("streaming").check_layout(layout)
    assert "data.loader=streaming" in str(refused.value)
    assert "(w1: ranks 0, 2; w2: rank 1)" in str(refused.value)
    assert "data.loader=petastorm" in str(refused.value)
    _loader("petastorm").check_layout(layout)  # no refusal
    for hosts in itertools.permutations(["w1", "w1", "w2", "w2"]):
        _loader("streaming").check_layout(HostLayout.of(list(hosts), 0))


def test_shard_environment_gives_the_loader_its_shard_and_restores_the_rank() -> None:
    saved = os.environ.get("RANK")
    os.environ["RANK"] = "1"
    try:
        with shard_environment(2):
            assert os.environ["RANK"] == "2"
        assert os.environ["RANK"] == "1"
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved


def test_a_rank_outside_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 3 is not one of the 3 ranks"):
        HostLayout.of(["a", "b", "a"], 3)
