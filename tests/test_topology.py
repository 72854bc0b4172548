"""Topology model, presets, JSON files, detection and rank placement."""

import json

import jax
import numpy as np
import pytest

import jaxcomm
from jaxcomm import topology as T


def _expected_random_hops(topo):
    """Mean hops of a random ring edge: hops averaged over all ordered pairs of nodes."""
    n = topo.num_nodes
    return np.mean([topo.hops(topo.node_level(a, b)) for a in range(n) for b in range(n) if a != b])


def test_reference_anchor_two_level():
    # REFERENCE.md: 64 nodes, 16 per leaf, 2 levels: 2.125 (node-contiguous) vs 3.52 random.
    topo = T.fat_tree(64, nodes_per_leaf=16, leaves_per_pod=None)
    assert T.ring_hops(topo, T.aware_order(topo)) == pytest.approx(2.125)
    assert _expected_random_hops(topo) == pytest.approx(3.5238, abs=1e-3)
    rand = np.mean([T.ring_hops(topo, T.random_order(topo, s)) for s in range(300)])
    assert rand == pytest.approx(3.52, abs=0.05)


def test_aware_order_halves_hops_on_three_level_fat_tree():
    # The figure: 64 nodes, 3 levels (4 per leaf, 4 leaves per pod, 4 pods).
    topo = T.fat_tree(nodes=64, nodes_per_leaf=4, leaves_per_pod=4)
    aware = T.ring_hops(topo, T.aware_order(topo))
    rand = np.mean([T.ring_hops(topo, T.random_order(topo, s)) for s in range(100)])
    # 48 edges inside a leaf (2), 12 between leaves of a pod (4), 4 between pods (6).
    assert aware == pytest.approx((48 * 2 + 12 * 4 + 4 * 6) / 64)  # 2.625
    assert rand == pytest.approx(_expected_random_hops(topo), abs=0.05)  # 5.43
    assert aware <= rand / 2


def test_hops_by_level():
    topo = T.fat_tree(64, 4, 4)
    assert [topo.hops(topo.node_level(0, b)) for b in (0, 1, 4, 16)] == [0, 2, 4, 6]


def test_aware_order_undoes_scrambled_placement():
    topo = T.fat_tree(64, 4, 4)
    scrambled = topo.with_random_placement(3)
    assert T.ring_hops(scrambled, range(64)) > 4
    order = T.aware_order(scrambled)
    assert T.ring_hops(scrambled, order) == pytest.approx(T.ring_hops(topo, range(64)))


def test_order_devices_and_make_mesh():
    devs = jax.devices()
    topo = T.fat_tree(4, nodes_per_leaf=2, leaves_per_pod=None, devices_per_node=2)
    topo = topo.with_placement([2, 0, 3, 1])  # node k sits in physical slot placement[k]
    ordered = T.order_devices(topo, devs)
    # Nodes by slot: node 1 (slot 0), node 3, node 0, node 2.
    assert [d.id for d in ordered] == [devs[i].id for i in (2, 3, 6, 7, 0, 1, 4, 5)]
    mesh = jaxcomm.make_mesh(intra=2, topology=topo)
    assert [d.id for d in mesh.devices.ravel()] == [d.id for d in ordered]
    with pytest.raises(ValueError, match="3 nodes"):
        T.order_devices(T.fat_tree(3, 3, None, devices_per_node=2), devs)


def test_presets():
    topo = T.fat_tree(64, 4, 4)
    assert (topo.num_nodes, topo.num_devices, len(topo.levels)) == (64, 512, 4)
    dgx = T.dgx_h100(128)
    assert dgx.devices_per_node == 8 and dgx.num_nodes == 128
    assert dgx.levels[0].bandwidth == pytest.approx(370e9)
    assert dgx.levels[1].bandwidth == pytest.approx(48e9)
    assert T.fat_tree(16, 32, None).levels[1].size == 16  # leaf shrunk to the node count
    with pytest.raises(ValueError, match="multiple of nodes_per_leaf"):
        T.fat_tree(10, 4)
    with pytest.raises(ValueError, match="nics_per_node"):
        T.fat_tree(8, 4, nics_per_node=9)
    with pytest.raises(ValueError, match="size"):
        T.Level("node", 0, 1e9, 1e-6)
    with pytest.raises(ValueError, match="permutation"):
        topo.with_placement([0] * 64)


def test_with_nodes_keeps_figures():
    topo = T.fat_tree(64, 4, 4, oversubscription=2)
    small = topo.with_nodes(8, devices_per_node=4)
    assert (small.num_nodes, small.devices_per_node) == (8, 4)
    assert small.levels[-1].oversubscription == 2
    assert small.levels[1].bandwidth == topo.levels[1].bandwidth
    # One NIC per node: 8 devices shared it 8:1, 4 devices share it 4:1.
    assert (topo.levels[1].oversubscription, small.levels[1].oversubscription) == (8, 4)


def test_json_round_trip(tmp_path):
    topo = T.fat_tree(16, 4, 2, oversubscription=3).with_placement(list(range(16))[::-1])
    path = tmp_path / "topo.json"
    T.save(topo, path)
    back = T.load(path)
    assert back.levels == pytest.approx(topo.levels) or back.levels == topo.levels
    assert back.placement == topo.placement and back.num_devices == topo.num_devices
    assert T.from_dict({"preset": "dgx_h100", "nodes": 32}).num_nodes == 32


LEVEL = {"name": "node", "size": 8, "bandwidth_GBps": 300, "latency_us": 2}


@pytest.mark.parametrize(
    "doc, field",
    [
        ({}, "levels"),
        ({"levels": []}, "levels"),
        ({"levels": [{**LEVEL, "size": "8"}]}, r"levels\[0\]\.size"),
        ({"levels": [LEVEL, {**LEVEL, "bandwidth_GBps": -1}]}, r"levels\[1\]\.bandwidth_GBps"),
        ({"levels": [{k: v for k, v in LEVEL.items() if k != "latency_us"}]}, "latency_us"),
        ({"levels": [{**LEVEL, "oversubscription": 0.5}]}, "oversubscription"),
        ({"levels": [{**LEVEL, "bw": 1}]}, r"unknown key.*'bw'"),
        ({"levels": [LEVEL], "gamma_s_per_byte": "x"}, "gamma_s_per_byte"),
        ({"levels": [LEVEL, {**LEVEL, "size": 2}], "placement": [0, 0]}, "placement"),
        ({"preset": "torus"}, "preset"),
    ],
)
def test_bad_file_names_field(tmp_path, doc, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(T.TopologyFileError, match=field) as e:
        T.load(path)
    msg = str(e.value)
    assert "bad.json" in msg and ("expected" in msg or "must be an integer" in msg)


def test_not_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{levels: ")
    with pytest.raises(T.TopologyFileError, match="not valid JSON"):
        T.load(path)


def test_detect_and_file_override(tmp_path, monkeypatch):
    monkeypatch.delenv(T.ENV_VAR, raising=False)
    topo = T.detect()
    assert topo.num_devices == len(jax.devices()) == 8 and topo.num_nodes == 1
    path = tmp_path / "cluster.json"
    T.save(T.fat_tree(2, 2, None, devices_per_node=4), path)
    monkeypatch.setenv(T.ENV_VAR, str(path))
    assert T.detect().num_nodes == 2 and T.detect().devices_per_node == 4
    assert T.detect(env={}).num_nodes == 1  # explicit env without the variable
    monkeypatch.setenv(T.ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(T.TopologyFileError, match="JAXCOMM_TOPO_FILE.*missing.json.*cannot read"):
        T.detect()
