"""The cluster model: a tree of levels (devices in a node, nodes under a leaf switch, ...).

A :class:`Topology` is a list of :class:`Level` s, innermost first. Level 0 groups the
devices of one node (NVLink, PCIe), level 1 the nodes under one leaf switch, level 2 the
leaves of one pod (spine), and so on; the outermost level's ``size`` counts its children
in the whole cluster. Two devices talk over the *lowest common level* (LCA) of their
positions: its bandwidth, latency and switch hops apply.

Units are SI: bytes per second, seconds. Bandwidth is *per device*: what one device can
push across that level when every device of its group does the same (a DGX-H100 has one
400 Gb/s NIC per GPU, so its level-1 bandwidth is ~48 GB/s, the NDR busbw of
nccl-tests). ``oversubscription`` of a level is the down:up capacity ratio of the
links that climb into it: a node's uplink is ``devices * bandwidth_1 /
oversubscription_1`` (8 GPUs sharing one NIC: oversubscription 8), and a level-(i-1)
group's uplink is its children's uplinks summed over ``oversubscription_i``.

Nodes are numbered by process (logical node ``k`` = process ``k``); ``placement[k]`` is
the physical slot the scheduler gave it (slots are numbered leaf-contiguous). The default
placement is the identity, i.e. ranks already follow the network.

References:
  Leiserson, "Fat-trees: universal networks for hardware-efficient supercomputing" (1985);
  NVIDIA DGX SuperPOD reference architecture (DGX H100, NDR 400 Gb/s InfiniBand).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxcomm.validate import check_int

__all__ = ["Level", "Topology", "cpu_local", "dgx_h100", "fat_tree", "PRESETS"]


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of the cluster tree.

    Attributes:
      name: e.g. 'node', 'leaf', 'pod', 'cluster'.
      size: children per group of this level (devices per node at level 0; nodes per leaf
        at level 1; ...; at the outermost level, its children in the whole cluster).
      bandwidth: bytes/s per device for traffic whose endpoints meet at this level.
      latency: seconds per message (alpha) between two devices that meet at this level.
      oversubscription: down:up capacity ratio of the links that climb into this level
        (1.0 = full bisection).
    """

    name: str
    size: int
    bandwidth: float
    latency: float
    oversubscription: float = 1.0

    def __post_init__(self):
        check_int(f"Level {self.name!r}: size", self.size, minimum=1)
        if not self.bandwidth > 0:
            raise ValueError(f"Level {self.name!r}: bandwidth={self.bandwidth!r} must be > 0.")
        if not self.latency >= 0:
            raise ValueError(f"Level {self.name!r}: latency={self.latency!r} must be >= 0.")
        if not self.oversubscription >= 1:
            raise ValueError(
                f"Level {self.name!r}: oversubscription={self.oversubscription!r} must be >= 1."
            )


@dataclasses.dataclass(frozen=True)
class Topology:
    """A cluster: levels innermost first, a per-byte reduction cost, a node placement.

    Attributes:
      levels: the levels; ``levels[0]`` is the node (its size = devices per node).
      gamma: seconds per byte to reduce (add) received data into a local buffer.
      placement: physical slot of each logical node (process), or None for the identity.
      name: a label for tables.
    """

    levels: tuple[Level, ...]
    gamma: float = 0.0
    placement: tuple[int, ...] | None = None
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise ValueError("Topology needs at least one level (the node).")
        if self.gamma < 0:
            raise ValueError(f"Topology gamma={self.gamma!r} must be >= 0.")
        if self.placement is not None:
            pl = tuple(
                check_int(f"placement[{i}]", v, minimum=0, fix="one physical slot per node")
                for i, v in enumerate(self.placement)
            )
            if sorted(pl) != list(range(self.num_nodes)):
                raise ValueError(
                    f"placement: expected a permutation of range({self.num_nodes}) "
                    f"(one physical slot per node); got {list(pl)[:8]}..."
                )
            object.__setattr__(self, "placement", pl)

    # --- sizes -------------------------------------------------------------------------
    @property
    def devices_per_node(self) -> int:
        return int(self.levels[0].size)

    @property
    def num_nodes(self) -> int:
        return int(np.prod([lv.size for lv in self.levels[1:]], dtype=np.int64))

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    def spans(self) -> list[int]:
        """Nodes per group at each level (level 0: 1 node)."""
        out, acc = [1], 1
        for lv in self.levels[1:]:
            acc *= lv.size
            out.append(acc)
        return out

    # --- positions -----------------------------------------------------------------------
    def slot(self, node: int) -> int:
        """Physical slot of logical node ``node``."""
        return node if self.placement is None else self.placement[node]

    def node_level(self, a: int, b: int) -> int:
        """Lowest common level of logical nodes ``a`` and ``b`` (0 if equal)."""
        sa, sb = self.slot(a), self.slot(b)
        if sa == sb:
            return 0
        for i, span in enumerate(self.spans()[1:], start=1):
            if sa // span == sb // span:
                return i
        return len(self.levels) - 1

    def device_level(self, a: int, b: int) -> int:
        """Lowest common level of device ranks ``a`` and ``b`` (rank = node * g + local)."""
        g = self.devices_per_node
        return self.node_level(a // g, b // g)

    def hops(self, level: int) -> int:
        """Network links crossed between two nodes meeting at ``level`` (fat tree: 2 per
        switch tier climbed; same node 0)."""
        return 2 * level

    # --- derived topologies ---------------------------------------------------------------
    def with_placement(self, placement: Sequence[int] | None) -> Topology:
        """The same cluster with logical node ``k`` at physical slot ``placement[k]``."""
        return dataclasses.replace(self, placement=None if placement is None else tuple(placement))

    def with_random_placement(self, seed: int = 0) -> Topology:
        """Nodes placed in a random order, as a scheduler unaware of the network does."""
        rng = np.random.default_rng(seed)
        return self.with_placement(rng.permutation(self.num_nodes).tolist())

    def with_nodes(self, nodes: int, devices_per_node: int | None = None) -> Topology:
        """A cluster of the same kind with ``nodes`` nodes (inner levels filled first).

        Used to fit a topology to a mesh: ``with_nodes(inter, intra)``. A level that does
        not fit is shrunk; the outermost level takes what is left. The node keeps its NICs
        (level-1 oversubscription scales with the devices sharing them).

        Raises:
          ValueError: ``nodes`` (or ``devices_per_node``) is not an integer >= 1, or does
            not fill whole groups of the inner levels.
        """
        g = self.devices_per_node
        if devices_per_node is not None:
            g = check_int("devices_per_node", devices_per_node, minimum=1)
        levels = [dataclasses.replace(self.levels[0], size=g)]
        left = nodes = check_int("nodes", nodes, minimum=1)
        for lv in self.levels[1:-1]:
            size = min(lv.size, left)
            levels.append(dataclasses.replace(lv, size=size))
            left = math.ceil(left / size)
        if len(self.levels) > 1:
            levels.append(dataclasses.replace(self.levels[-1], size=left))
            # Keep the node's uplink (its NICs) when the device count changes: devices
            # sharing the NICs change the level-1 oversubscription in proportion.
            over = max(1.0, self.levels[1].oversubscription * g / self.devices_per_node)
            levels[1] = dataclasses.replace(levels[1], oversubscription=over)
        topo = dataclasses.replace(self, levels=tuple(levels), placement=None)
        if topo.num_nodes != nodes:
            raise ValueError(
                f"cannot lay {nodes} nodes on {self.name!r} levels "
                f"{[lv.size for lv in self.levels]}: pick a node count that fills its leaves."
            )
        return topo

    def describe(self) -> str:
        parts = [
            f"{lv.name}={lv.size} ({lv.bandwidth / 1e9:g} GB/s, {lv.latency * 1e6:g} us"
            + (f", {lv.oversubscription:g}:1" if lv.oversubscription != 1 else "")
            + ")"
            for lv in self.levels
        ]
        return f"{self.name}: " + " / ".join(parts)


def fat_tree(
    nodes: int = 64,
    nodes_per_leaf: int = 4,
    leaves_per_pod: int | None = 4,
    *,
    devices_per_node: int = 8,
    nics_per_node: int = 1,
    intra_bandwidth: float = 150e9,
    link_bandwidth: float = 12.5e9,
    intra_latency: float = 3e-6,
    base_latency: float = 4e-6,
    hop_latency: float = 1e-6,
    oversubscription: float = 1.0,
    gamma: float = 1e-12,
) -> Topology:
    """A fat tree: nodes under leaf switches, leaves in pods, pods under a core.

    Args:
      nodes: number of nodes (hosts, processes).
      nodes_per_leaf: nodes under one leaf switch (shrunk to ``nodes`` when larger).
      leaves_per_pod: leaves per pod; None gives a 2-level tree (leaf + spine).
      devices_per_node: accelerators per node.
      nics_per_node: network ports per node; the node's devices share them (level-1
        oversubscription ``devices_per_node / nics_per_node``).
      intra_bandwidth: bytes/s per device inside a node.
      link_bandwidth: bytes/s of one NIC (one flow's ceiling).
      intra_latency: seconds per message inside a node.
      base_latency: seconds per network message (software + NIC).
      hop_latency: seconds added per link crossed (same leaf 2, same pod 4, else 6).
      oversubscription: down:up ratio of every switch tier above the leaf.
      gamma: seconds per byte of reduction.

    Returns:
      A :class:`Topology` with levels node / leaf / pod / cluster (or node / leaf / spine).

    Raises:
      ValueError: a count is not an integer >= 1, or the node count does not fill whole
        leaves or pods.

    Example:
      >>> topo = fat_tree(nodes=64, nodes_per_leaf=4, leaves_per_pod=4)
      >>> topo.num_devices
      512
    """
    nodes = check_int("nodes", nodes, minimum=1)
    nodes_per_leaf = check_int("nodes_per_leaf", nodes_per_leaf, minimum=1)
    if leaves_per_pod is not None:
        fix = "or None for a 2-level tree"
        leaves_per_pod = check_int("leaves_per_pod", leaves_per_pod, minimum=1, fix=fix)
    devices_per_node = check_int("devices_per_node", devices_per_node, minimum=1)
    nics_per_node = check_int(
        "nics_per_node", nics_per_node, minimum=1, maximum=devices_per_node,
        fix=f"at most devices_per_node={devices_per_node}",
    )  # fmt: skip
    npl = min(nodes_per_leaf, nodes)
    if nodes % npl:
        raise ValueError(
            f"fat_tree(nodes={nodes}, nodes_per_leaf={nodes_per_leaf}): nodes must be a "
            "multiple of nodes_per_leaf."
        )
    leaves = nodes // npl
    levels = [
        Level("node", devices_per_node, intra_bandwidth, intra_latency),
        Level(
            "leaf",
            npl,
            link_bandwidth,
            base_latency + 2 * hop_latency,
            devices_per_node / nics_per_node,
        ),
    ]
    levels += _switch_tiers(
        nodes, leaves, leaves_per_pod, link_bandwidth, base_latency, hop_latency, oversubscription
    )
    return Topology(tuple(levels), gamma=gamma, name=f"fat_tree({nodes})")


def _switch_tiers(
    nodes: int,
    leaves: int,
    leaves_per_pod: int | None,
    link_bandwidth: float,
    base_latency: float,
    hop_latency: float,
    oversubscription: float,
) -> list[Level]:
    """The tiers of :func:`fat_tree` above its leaves: a spine, or pods and a cluster."""
    if leaves_per_pod is None:
        return [
            Level("spine", leaves, link_bandwidth, base_latency + 4 * hop_latency, oversubscription)
        ]
    lpp = min(leaves_per_pod, leaves)
    if leaves % lpp:
        raise ValueError(
            f"fat_tree(nodes={nodes}, leaves_per_pod={leaves_per_pod}): {leaves} leaves "
            "must be a multiple of leaves_per_pod."
        )
    return [
        Level("pod", lpp, link_bandwidth, base_latency + 4 * hop_latency, oversubscription),
        Level(
            "cluster", leaves // lpp, link_bandwidth, base_latency + 6 * hop_latency,
            oversubscription,
        ),
    ]  # fmt: skip


def dgx_h100(nodes: int = 64, *, nodes_per_leaf: int = 32, oversubscription: float = 1.0):
    """DGX-H100 nodes (8 GPUs, NVLink 4) on NDR 400 Gb/s InfiniBand, SuperPOD style.

    Per-device figures are typical nccl-tests bus bandwidths (NVIDIA nccl-tests): NVLink
    ~370 GB/s inside a node, ~48 GB/s per GPU over its own NDR NIC. 32 nodes per scalable
    unit (leaf group), units joined by spines (2-level tree).

    Args:
      nodes: number of DGX nodes.
      nodes_per_leaf: nodes per scalable unit.
      oversubscription: spine tier down:up ratio (SuperPOD: 1.0, full fat tree).

    Returns:
      A :class:`Topology`.

    Example:
      >>> dgx_h100(128).num_devices
      1024
    """
    topo = fat_tree(
        nodes,
        nodes_per_leaf,
        None,
        devices_per_node=8,
        nics_per_node=8,
        intra_bandwidth=370e9,
        link_bandwidth=48e9,
        intra_latency=3e-6,
        base_latency=5e-6,
        hop_latency=0.5e-6,
        oversubscription=oversubscription,
        gamma=1.0 / 1.5e12,  # H100 HBM3 ~3 TB/s: read two operands, write one
    )
    return dataclasses.replace(topo, name=f"dgx_h100({nodes})")


def cpu_local(nodes: int = 1, devices_per_node: int = 8) -> Topology:
    """One or more CPU hosts on one Ethernet switch (the test and CI set-up).

    Args:
      nodes: processes (hosts).
      devices_per_node: (fake) devices per process.

    Returns:
      A 2-level :class:`Topology`: shared-memory copies inside a host, 10 Gb/s between.
    """
    nodes = check_int("nodes", nodes, minimum=1)
    devices_per_node = check_int("devices_per_node", devices_per_node, minimum=1)
    return Topology(
        (
            Level("node", devices_per_node, 5e9, 20e-6),
            Level("leaf", nodes, 1.25e9, 50e-6),
        ),
        gamma=1.0 / 5e9,
        name=f"cpu_local({nodes}x{devices_per_node})",
    )


PRESETS = {"fat_tree": fat_tree, "dgx_h100": dgx_h100, "cpu_local": cpu_local}
