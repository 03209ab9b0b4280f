"""Strict typed config: every YAML the repo ships parses, and mistakes say how to fix them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.config import convert, load_yaml
from kvlab.engine.sim.profile import load_profiles
from kvlab.errors import ConfigError
from kvlab.gateway.config import PRESETS, load_policy
from kvlab.topology import Topology, load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = sorted((ROOT / "labs" / "topologies").glob("*.yaml"))
POLICIES = sorted((ROOT / "instrumentation" / "kvlab" / "assets" / "policies").glob("*.yaml"))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_every_shipped_topology_parses(path):
    topo = load_topology(path)
    assert topo.total_replicas > 0


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_every_shipped_policy_parses(path):
    assert path.stem in PRESETS
    cfg = load_policy(path.stem)
    assert cfg is not None


def test_every_shipped_profile_parses():
    profiles = load_profiles()
    assert "cpu-tiny" in profiles and len(profiles) >= 2


def test_unknown_keys_name_the_place_and_the_allowed_fields(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("pools:\n  - name: a\n    replica: 3\n")
    with pytest.raises(ConfigError) as err:
        load_topology(bad)
    msg = str(err.value)
    assert str(bad) in msg and "replica" in msg and "$.pools[0]" in msg and "replicas" in msg
    with pytest.raises(ConfigError, match="unknown field `pool`"):
        convert({"pool": []}, Topology)
    with pytest.raises(ConfigError, match="not valid YAML"):
        (tmp_path / "x.yaml").write_text("a: [1,\n")
        load_yaml(tmp_path / "x.yaml", Topology)
    with pytest.raises(ConfigError, match="no such file"):
        load_topology(tmp_path / "missing.yaml")


def test_yaml_on_off_stay_strings(tmp_path):
    # YAML 1.1 would read `off` as False and fail validation; kvlab reads YAML 1.2 booleans
    path = tmp_path / "t.yaml"
    path.write_text("observability:\n  traces: off\n  prometheus: off\n")
    topo = load_topology(path)
    assert topo.observability.traces == "off" and topo.observability.prometheus == "off"


def test_semantic_checks():
    with pytest.raises(ConfigError, match="at least one pool"):
        convert({"pools": []}, Topology)
    with pytest.raises(ConfigError, match="unique"):
        convert({"pools": [{"name": "a"}, {"name": "a"}]}, Topology)
