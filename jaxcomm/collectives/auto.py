"""``algorithm='auto'``: pick the all-reduce algorithm per buffer with the cost model.

``jaxcomm.allreduce`` packs leaves into 1-D buffers whose sizes are static at trace time
(a large leaf alone, the small leaves per dtype), so each buffer gets its own choice:
``jaxcomm.cost.choose(nbytes, topology)`` among 'ring', 'tree', 'halving_doubling' and
'hierarchical' (small buffers go to a latency-optimal algorithm, large ones to a
bandwidth-optimal one). Then the buffers that chose the same ppermute algorithm are merged
per dtype and reduced by one call (``jaxcomm.collectives.base.allreduce_plan``).

The topology is, in order: the ``topology=`` argument of ``allreduce`` /
``sync_gradients``; otherwise ``jaxcomm.topology.detect()`` (the ``JAXCOMM_TOPO_FILE``
file when set, else one node per process with per-platform default link figures). It is
fitted to the mesh: the innermost axis ('intra') is the node, the outer axes the nodes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax

from jaxcomm import cost
from jaxcomm.collectives.base import ALGORITHMS, register_algorithm
from jaxcomm.mesh import INTRA
from jaxcomm.topology import Topology, detect

__all__ = ["auto_allreduce", "check_topology", "resolve"]


def check_topology(topology) -> Topology | None:
    """Raises TypeError unless ``topology`` is None or a ``jaxcomm.topology.Topology``."""
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"topology={topology!r} must be a jaxcomm.topology.Topology (e.g. "
            "jaxcomm.topology.fat_tree(...), .dgx_h100(...), .load(path), .detect()) or None."
        )
    return topology


def fit_to_mesh(topology: Topology, nodes: int, devices_per_node: int) -> Topology:
    """``topology``'s link figures on ``nodes`` x ``devices_per_node`` devices."""
    if topology.num_nodes == nodes and topology.devices_per_node == devices_per_node:
        return topology
    try:
        return topology.with_nodes(nodes, devices_per_node)
    except ValueError:  # does not fill whole leaves: put all nodes under one switch
        node = dataclasses.replace(topology.levels[0], size=devices_per_node)
        if len(topology.levels) > 1:
            net = topology.levels[1]
            over = max(1.0, net.oversubscription * devices_per_node / topology.devices_per_node)
        else:  # a one-level description says nothing about the network: reuse the node's
            net, over = topology.levels[0], 1.0
        levels = (node, dataclasses.replace(net, name="leaf", size=nodes, oversubscription=over))
        return dataclasses.replace(topology, levels=levels, placement=None)


def resolve(nbytes: int, axes: tuple[str, ...], topology: Topology | None = None) -> str:
    """The algorithm 'auto' runs for a buffer of ``nbytes`` over ``axes`` (inside shard_map).

    Args:
      nbytes: bytes of the buffer on each device.
      axes: the mesh axes of the all-reduce.
      topology: the cluster; None: ``jaxcomm.topology.detect()``.

    Returns:
      An algorithm name from ``jaxcomm.cost.CANDIDATES``.
    """
    topo = topology or detect()
    sizes = [int(lax.axis_size(a)) for a in axes]
    if axes[-1] == INTRA:
        g, m = sizes[-1], int(np.prod(sizes[:-1]))
    else:
        g, m = 1, int(np.prod(sizes))
    return cost.choose(nbytes, fit_to_mesh(topo, m, g))


@register_algorithm("auto")
def auto_allreduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sums ``x`` over ``axes`` with the algorithm :func:`resolve` picks for its size on
    the detected topology (``jaxcomm.allreduce`` resolves 'auto' per buffer itself, with
    its ``topology=``)."""
    name = resolve(int(x.size) * x.dtype.itemsize, axes)
    return ALGORITHMS[name](x, axes)
