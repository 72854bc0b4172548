"""Rank placement: ring orders of nodes that keep neighbours close in the network.

A ring all-reduce moves every byte across every ring edge, so an edge that leaves a leaf
or a pod costs more switch hops (latency) and shares oversubscribed uplinks. Ordering the
ring node-, leaf- and pod-contiguously makes all but a few edges local.

References:
  Sanders & Traff, "The hierarchical factor algorithm for all-to-all communication" (2002);
  NCCL builds its rings from the PCI/NIC topology it detects (``NCCL_TOPO_FILE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcomm.topology.model import Topology

__all__ = ["aware_order", "order_devices", "random_order", "ring_hops"]


def _check_order(topology: Topology, order: Sequence[int]) -> list[int]:
    order = [int(v) for v in order]
    if sorted(order) != list(range(topology.num_nodes)):
        raise ValueError(
            f"order must be a permutation of the {topology.num_nodes} node indices "
            f"range({topology.num_nodes}); got {len(order)} entries {order[:8]}..."
        )
    return order


def ring_hops(topology: Topology, order: Sequence[int]) -> float:
    """Average network hops per ring edge when nodes form a ring in ``order``.

    Args:
      topology: the cluster (its ``placement`` maps node indices to physical slots).
      order: a permutation of ``range(topology.num_nodes)``; the ring closes from the last
        back to the first.

    Returns:
      The mean over the ring's edges of the links crossed (fat tree: same leaf 2, same pod
      4, across pods 6).

    Example:
      >>> topo = fat_tree(64, nodes_per_leaf=16, leaves_per_pod=None)
      >>> ring_hops(topo, aware_order(topo))
      2.125
    """
    order = _check_order(topology, order)
    if len(order) < 2:
        return 0.0
    hops = [
        topology.hops(topology.node_level(a, b))
        for a, b in zip(order, order[1:] + order[:1], strict=True)
    ]
    return float(np.mean(hops))


def aware_order(topology: Topology) -> list[int]:
    """Node order that is node-, leaf- and pod-contiguous.

    Nodes are sorted by their physical slot (slots are numbered leaf-major, so nodes of one
    leaf, and leaves of one pod, come together). Only one edge per group leaves the group.

    Args:
      topology: the cluster.

    Returns:
      A permutation of ``range(topology.num_nodes)``.
    """
    return sorted(range(topology.num_nodes), key=topology.slot)


def random_order(topology: Topology, seed: int = 0) -> list[int]:
    """A random permutation of the nodes (what a network-unaware scheduler gives)."""
    return np.random.default_rng(seed).permutation(topology.num_nodes).tolist()


def _node_groups(topology: Topology, devices: Sequence[Any]) -> list[list[Any]]:
    """Splits ``devices`` into one list per node, in process order."""
    procs = list(dict.fromkeys(getattr(d, "process_index", 0) for d in devices))
    if len(procs) > 1:
        groups = [[d for d in devices if getattr(d, "process_index", 0) == p] for p in procs]
    else:
        # One process holding several "nodes" (fake CPU devices, or a single host): split
        # its devices into nodes of devices_per_node in the runtime's order.
        g = topology.devices_per_node
        groups = [list(devices[i : i + g]) for i in range(0, len(devices), g)]
    return groups


def order_devices(topology: Topology, devices: Sequence[Any]) -> list[Any]:
    """Orders ``devices`` so that mesh neighbours are network neighbours.

    Devices are grouped by node (process; on a single process, consecutive runs of
    ``devices_per_node``), nodes are ordered by :func:`aware_order`, and devices keep the
    runtime order inside a node. ``jaxcomm.make_mesh(topology=...)`` calls this, so the
    ``inter`` axis runs leaf- and pod-contiguously.

    Args:
      topology: the cluster; its node count must equal the number of node groups.
      devices: the devices (e.g. ``jax.devices()``).

    Returns:
      The same devices, reordered.

    Raises:
      ValueError: the devices do not split into ``topology.num_nodes`` equal nodes.

    Example:
      >>> mesh = jaxcomm.make_mesh(topology=jaxcomm.topology.detect())
    """
    devices = list(devices)
    groups = _node_groups(topology, devices)
    sizes = {len(g) for g in groups}
    if len(groups) != topology.num_nodes or len(sizes) != 1:
        raise ValueError(
            f"order_devices: {len(devices)} devices split into {len(groups)} nodes of sizes "
            f"{sorted(sizes)}, but topology {topology.name!r} has {topology.num_nodes} nodes of "
            f"{topology.devices_per_node} devices. Describe the running job (fat_tree(nodes=..., "
            "devices_per_node=...) or a JSON file with JAXCOMM_TOPO_FILE)."
        )
    return [d for k in aware_order(topology) for d in groups[k]]
