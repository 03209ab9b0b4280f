"""The experiments of lab 10 (kvlab.scenarios.experiments, docs/experiments.md): their topologies
parse and name shipped policies, the shared-prefix workload's hot group, sweep variants and the
measures the checkpoints assert with."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kvlab.errors import ConfigError
from kvlab.load.measure import Record
from kvlab.load.summary import HitRate, Summary
from kvlab.load.workloads import create
from kvlab.scenarios import experiments as ex
from kvlab.topology import load_topology

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "instrumentation" / "kvlab" / "assets" / "policies"
SMALL = {"system_tokens": 8, "question_tokens": 4}   # fast to generate; the order of groups is what counts


@pytest.mark.parametrize("name", sorted(ex.EXPERIMENTS))
def test_every_experiment_is_a_shipped_topology_with_shipped_policies(name):
    topology = ex.topology(name)
    assert topology.name == name and (ROOT / "labs" / "topologies" / f"{name}.yaml").is_file()
    assert topology.engine == "sim"
    for policy in ex.EXPERIMENTS[name]:
        assert (POLICIES / f"{policy}.yaml").is_file(), f"{name}: no preset {policy}"
    create(topology.workload.name, params=topology.workload.params)   # the sized parameters validate


def test_the_experiments_are_sized_for_their_effect():
    """The sizing each topology's comment explains, so an edit that breaks the premise fails here."""
    sweep, evict = ex.topology("cache-sweep"), ex.topology("eviction")
    group_blocks = sweep.workload.params["system_tokens"] // sweep.sim.block_size
    assert sweep.sim.num_blocks < 3 * group_blocks < 8 * group_blocks < 640   # ~2 groups fit; all 8 at 640
    per_replica = evict.workload.params["groups"] // evict.pools[0].replicas
    assert evict.sim.num_blocks < per_replica * evict.workload.params["system_tokens"] // evict.sim.block_size
    assert ex.topology("control").workload.name == "random"
    assert ex.topology("hot-group").workload.params["hot_share"] > 0.5


def test_hot_share_sends_that_share_to_group_0_and_the_rest_to_the_others():
    requests = create("shared-prefix", params={**SMALL, "groups": 8, "hot_share": 0.6}).requests(2000)
    counts = Counter(r.group for r in requests)
    assert 0.55 < counts["g0"] / 2000 < 0.65
    others = [counts[f"g{g}"] for g in range(1, 8)]
    assert sum(others) == 2000 - counts["g0"] and min(others) > 0.5 * max(others)   # uniform over the rest
    assert {r.group for r in create("shared-prefix", params={**SMALL, "groups": 3, "hot_share": 1.0})
            .requests(50)} == {"g0"}


def test_without_a_hot_group_the_stream_is_the_one_it_always_was():
    """hot_share 0 draws exactly what shared-prefix drew before the parameter: seeded runs compare."""
    rng = random.Random("7:shared-prefix:order")
    expected = []
    for _ in range(200):
        expected.append(f"g{rng.randrange(32)}")
        rng.randrange(16)
    assert [r.group for r in create("shared-prefix", seed=7, params=SMALL).requests(200)] == expected


@pytest.mark.parametrize("params, message", [
    ({"hot_share": 1.5}, "<= 1.0"), ({"hot_share": -0.1}, ">= 0.0"),
    ({"groups": 1, "hot_share": 0.5}, "at least 2 groups"), ({"hot_share": "most"}, "Expected `float`"),
])
def test_a_bad_hot_share_is_a_clear_config_error(params, message):
    with pytest.raises(ConfigError, match=message):
        create("shared-prefix", params=params)


def test_a_sweep_point_is_the_topology_with_its_sim_setting_changed(tmp_path):
    path = ex.variant("cache-sweep", tmp_path, num_blocks=320)
    point, base = load_topology(path), ex.topology("cache-sweep")
    assert path.name == "cache-sweep-320.yaml" and point.name == "cache-sweep-320"
    assert point.sim.num_blocks == 320
    assert point.workload == base.workload and point.pools == base.pools and point.gateway == base.gateway
    with pytest.raises(TypeError):
        ex.variant("cache-sweep", tmp_path, num_blokcs=320)


def test_the_measures_the_checkpoints_use():
    summary = Summary(hit_rate=HitRate(available=0.8, predicted=0.7, delivered=0.55), replicas={"a": 6, "b": 2})
    assert ex.delivered(summary) == 0.55
    assert ex.undelivered(summary) == pytest.approx(0.15)
    assert ex.busiest_share(summary) == 0.75
    assert ex.undelivered(Summary()) == 0.0   # no gateway headers
    records = [Record(ts=0, group="g0", replica="a")] * 3 + [
        Record(ts=0, group="g0", replica="b"), Record(ts=0, group="g0", replica="c", error="timeout"),
        Record(ts=0, group="g1", replica="c")]
    assert ex.group_replicas(records, "g0") == {"a": 0.75, "b": 0.25}


def test_the_warm_hit_rate_leaves_out_each_groups_first_visit_to_a_replica():
    records = [Record(ts=3, group="g0", replica="a", prompt_tokens=100, cached_tokens=90),
               Record(ts=1, group="g0", replica="a", prompt_tokens=100, cached_tokens=0),   # first: left out
               Record(ts=2, group="g0", replica="b", prompt_tokens=100, cached_tokens=0),   # first on b
               Record(ts=4, group="g0", replica="b", prompt_tokens=100, cached_tokens=10),
               Record(ts=5, group="g1", replica="a", prompt_tokens=100, error="timeout")]
    assert ex.warm_delivered(records) == pytest.approx(0.5)
    assert ex.warm_delivered(records[1:3]) == 0.0     # only first visits: nothing to measure
