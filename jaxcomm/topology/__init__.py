"""Cluster topology: levels, presets, JSON files, detection and rank placement.

Example:
  >>> from jaxcomm import topology
  >>> topo = topology.fat_tree(nodes=64, nodes_per_leaf=4, leaves_per_pod=4)
  >>> topology.ring_hops(topo, topology.random_order(topo)) > 2 * topology.ring_hops(
  ...     topo, topology.aware_order(topo))
  True
  >>> mesh = jaxcomm.make_mesh(topology=topology.detect())
"""

from jaxcomm.topology.io import (
    ENV_VAR,
    TopologyFileError,
    detect,
    from_dict,
    load,
    save,
    to_dict,
)
from jaxcomm.topology.model import PRESETS, Level, Topology, cpu_local, dgx_h100, fat_tree
from jaxcomm.topology.placement import aware_order, order_devices, random_order, ring_hops

__all__ = [
    "ENV_VAR",
    "PRESETS",
    "Level",
    "Topology",
    "TopologyFileError",
    "aware_order",
    "cpu_local",
    "detect",
    "dgx_h100",
    "fat_tree",
    "from_dict",
    "load",
    "order_devices",
    "random_order",
    "ring_hops",
    "save",
    "to_dict",
]
