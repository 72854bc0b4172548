"""An emulated cluster on one machine: network namespaces joined by rate-limited links.

``python -m jaxcomm.tools.testbed --nodes 2 --devices-per-node 2 --link 1gbit --latency 100us
-- cmd``

Each node is a network namespace running one ``jax.distributed`` process with
``--devices-per-node`` CPU devices. Traffic between devices of one node stays inside its
namespace (loopback); traffic between nodes crosses a veth link shaped with ``tc tbf``. That is
a real two-level hierarchy, with the slow level a link you choose.

With ``--leaves L --spine RATE`` the nodes hang under ``L`` leaf switches joined by a slower
spine (a leaf-spine fabric, one more level): node ``i`` sits under leaf ``i % L``, so
consecutive process ids alternate leaves, as a scheduler that knows nothing of the network
hands them out. A ring in process order then crosses the spine at every hop; one ordered by
leaf crosses it ``L`` times. The fabric is written as a ``jaxcomm.topology`` file (levels node
/ leaf / spine, the placement, the link rates) named by ``JAXCOMM_TOPO_FILE`` in every node's
environment, so ``jaxcomm.topology.detect()`` inside the job sees it, and the bytes the spine
carried are read from its ``tc`` counters (:func:`spine_bytes`, ``JAXCOMM_TESTBED_SPINE``), as
are the bytes each node sends into its own link (:func:`node_link_sent`,
``JAXCOMM_TESTBED_NODE_LINK``).

Set-up (all names start with ``jc`` plus a per-run tag, so parallel runs do not collide):

1. ``ip netns add`` one namespace per node, ``lo`` up.
2. Two nodes: one veth pair between them. More: a hub namespace with a bridge, one veth pair
   per node (a switch with one port per node). Leaf-spine: one hub per leaf, and the leaf
   hubs joined by one veth pair (two leaves) or through a spine hub (more).
3. ``tc qdisc add dev X root tbf rate R burst B limit L`` on every link end, so each
   direction of each link carries at most R. ``B`` is sized from ``R`` (:func:`tbf_burst`:
   1 ms of line rate, at least 8 KiB): a step's traffic after an idle gap passes unshaped
   only up to ``B``; the queue ``L`` holds 10 ms of line rate plus 128 KiB. netem is not
   available in this kernel, so ``--latency`` is applied with netem when the kernel has it
   and otherwise reported as not applied (veth adds tens of microseconds by itself).
4. ``/etc/netns/NAME/hosts`` maps this machine's host name to the node's veth address:
   ``ip netns exec`` mounts it over ``/etc/hosts``, and gloo binds to the address the host
   name resolves to (gloo's default device).
5. Each node's process runs under ``ip netns exec`` with ``JAXCOMM_COORDINATOR`` (node 0's
   address), ``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID``, ``JAXCOMM_LOCAL_DEVICES`` and
   ``JAXCOMM_TESTBED_*`` (link rate in bit/s, addresses; ``..._LINK_LOG``, the JSON lines of
   the link changes; ``..._START``, the unix time that ``--link-schedule`` counts from) set;
   it calls ``jaxcomm.init_distributed()``.
6. Cleanup always runs (normal exit, failure, Ctrl-C, SIGTERM): processes ended, namespaces
   (and with them the veths and the bridge) and hosts files removed.

Needs root and iproute2 (``ip``, ``tc``); without them it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from jaxcomm.tools.launch import rank_env, run_group
from jaxcomm.validate import check_int

__all__ = [
    "Testbed",
    "available",
    "PACKET_HEADER_BYTES",
    "main",
    "node_link_sent",
    "parse_link_schedule",
    "parse_rate",
    "parse_time",
    "payload_bytes",
    "qdisc_sent",
    "spine_bytes",
    "tbf_burst",
]

SUBNET = "10.231.0"
COORDINATOR_PORT = 23456
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> int:
    """``'1gbit'``, ``'250mbit'``, ``'100kbit'`` -> bits per second (tc's units, powers of 10)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", text.lower())
    if not m:
        raise ValueError(f"link rate {text!r}: use tc's form, e.g. '1gbit', '250mbit'.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# The token bucket refills while a step computes, so the traffic that follows an idle gap
# passes its first ``burst`` bytes at veth speed, faster than the link: a bucket of a
# transfer's size would let it through unshaped (a link efficiency above 1). The bucket is
# one millisecond of line rate, so the qdisc's timer wakes at most 1000 times a second per
# link end (a smaller bucket at 1 Gbit/s holds the link below its rate on a 2-core host),
# with a floor of 8 KiB, a few MTU-sized packets.
_BURST_SECONDS = 1e-3
_MIN_BURST_KIB = 8
# The queue behind the bucket: tbf's limit is latency x rate + burst, so ``latency 10ms``
# with a small bucket leaves about one 64 KB GSO burst of queue, and two TCP flows sharing
# the link lose packets and fall well below the line rate. The limit is set instead: 10 ms
# of line rate plus 128 KiB.
_QUEUE_SECONDS = 10e-3
_QUEUE_EXTRA_BYTES = 128 * 1024


def tbf_burst(rate: str) -> str:
    """The tbf bucket for a link of ``rate``: 1 ms of line rate, at least 8 KiB, in tc's
    ``kb`` (KiB), e.g. ``'8kb'`` at 50 Mbit/s, ``'123kb'`` at 1 Gbit/s."""
    bytes_ = parse_rate(rate) / 8 * _BURST_SECONDS
    return f"{max(_MIN_BURST_KIB, -(-int(bytes_) // 1024))}kb"


def _tbf(rate: str, burst: str | None) -> list[str]:
    """tc's tbf arguments for a link of ``rate``: with the default bucket the queue's
    depth in bytes (``limit``), with a bucket ``burst`` given 10 ms beyond it."""
    if burst is not None:
        return ["tbf", "rate", rate, "burst", burst, "latency", "10ms"]
    limit = int(parse_rate(rate) / 8 * _QUEUE_SECONDS) + _QUEUE_EXTRA_BYTES
    return ["tbf", "rate", rate, "burst", tbf_burst(rate), "limit", str(limit)]


def parse_time(text: str) -> float:
    """``'100us'``, ``'2ms'``, ``'0'`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s|)\s*", text.lower())
    if not m:
        raise ValueError(f"latency {text!r}: use e.g. '100us', '2ms', '0'.")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}[m.group(2)]


def available() -> tuple[bool, str]:
    """Whether this machine can build a testbed, and if not, why."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return False, "the testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "the testbed needs root (ip netns, tc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found: install iproute2 (apt-get install iproute2)"
    probe = f"jc{secrets.token_hex(3)}p"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"'ip netns add' failed: {r.stderr.strip()}"
    try:
        checks = [  # entering a namespace, and the tbf qdisc, as the testbed uses them
            ["ip", "netns", "exec", probe, "true"],
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", "1gbit", "burst", "128kb", "latency", "10ms"],
        ]  # fmt: skip
        for cmd in checks:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                return False, f"`{' '.join(cmd[4:]) or 'ip netns exec'}` failed: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


# What each packet carries besides the payload of a TCP segment, as tc counts it: the
# Ethernet header (14 bytes), IPv4 (20) and TCP with the timestamp option Linux sends by
# default (32). gloo and the coordination service speak TCP; a pure ACK is all header.
PACKET_HEADER_BYTES = 14 + 20 + 32


def qdisc_sent(ends: str) -> tuple[int, int]:
    """Bytes and packets the ``tc`` qdiscs of link ends have sent so far.

    Args:
      ends: ``'ns/dev,ns/dev'``, e.g. ``JAXCOMM_TESTBED_SPINE`` or
        ``JAXCOMM_TESTBED_NODE_LINK``.

    Returns:
      ``(bytes, packets)``, each summed over the ends: the ``Sent N bytes M pkt`` counters,
      headers included (tc counts a segmentation-offloaded packet as its segments).

    Raises:
      RuntimeError: ``tc`` failed.
    """
    total_bytes = total_packets = 0
    for end in ends.split(","):
        ns, dev = end.split("/")
        out = _sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
        m = re.search(r"Sent (\d+) bytes (\d+) pkt", out)
        total_bytes += int(m.group(1))
        total_packets += int(m.group(2))
    return total_bytes, total_packets


def payload_bytes(sent: tuple[int, int]) -> int:
    """TCP payload of ``(bytes, packets)`` from :func:`qdisc_sent`: the bytes less
    :data:`PACKET_HEADER_BYTES` per packet, what a collective's byte count describes."""
    return sent[0] - PACKET_HEADER_BYTES * sent[1]


def spine_bytes(ends: str | None = None) -> int:
    """Bytes sent so far through the spine's link ends (both directions summed).

    Args:
      ends: ``'ns/dev,ns/dev'``; default ``JAXCOMM_TESTBED_SPINE`` (set by a leaf-spine
        testbed in every node's environment).

    Returns:
      The sum of the ``Sent N bytes`` counters of the ``tc`` qdiscs on those ends.

    Raises:
      RuntimeError: no spine (not a leaf-spine testbed) or ``tc`` failed.
    """
    ends = os.environ.get("JAXCOMM_TESTBED_SPINE") if ends is None else ends
    if not ends:
        raise RuntimeError("spine_bytes: no spine; run under a testbed with --leaves >= 2.")
    return qdisc_sent(ends)[0]


def node_link_sent() -> tuple[int, int] | None:
    """``(bytes, packets)`` this node has sent into its link so far (:func:`qdisc_sent` of
    ``JAXCOMM_TESTBED_NODE_LINK``, the node's own shaped end); ``None`` outside a
    testbed."""
    end = os.environ.get("JAXCOMM_TESTBED_NODE_LINK")
    return qdisc_sent(end) if end else None


def framing_per_call(
    mesh, keys: list[str], *, elements: int = 2048, reps: int = 60
) -> dict[str, float | None]:
    """TCP payload each collective call sends into this node's link beyond its HLO bytes.

    A transport frames every message (gloo: a header per send, and small control messages
    per step of its algorithm), which no HLO shows and which does not grow with the
    message: a step of many small collectives pays it per call. Each ``'kind/group
    size'`` of :func:`jaxcomm.tools.wire.summarize`'s ``crossing_calls`` is timed alone:

    1. its collective over the mesh axes of that group size (``('inter', 'intra')`` for all
       devices, ``('inter',)`` for the nodes; a collective-permute: each device to its
       peer on the next node) on ``elements`` f32 per device, compiled;
    2. run ``reps`` times between two reads of this node's link counters
       (:func:`node_link_sent`, TCP payload);
    3. framing per call = (payload per run - the compiled program's crossing bytes,
       ``jaxcomm.wire_bytes``) / its crossing calls.

    Collective: every process of the testbed must call it with the same ``keys``.

    Args:
      mesh: the run's ``('inter', 'intra')`` mesh.
      keys: ``'kind/group size'`` keys, e.g. ``['all-reduce/4', 'all-gather/2']``.
      elements: f32 elements per device of each probe (small: the framing, not the bytes).
      reps: calls timed per key.

    Returns:
      ``{key: bytes per crossing call}``; ``None`` for a key with no probe (another kind,
      a group size that is no set of mesh axes) or outside a testbed.

    Raises:
      ValueError: a key that is not ``'kind/group size'``.
    """
    import jax
    import numpy as np
    from jax import lax

    import jaxcomm

    probes = {  # the collective of each HLO kind, over the axes given
        "all-reduce": lambda x, axes: lax.psum(x, axes),
        "all-gather": lambda x, axes: lax.all_gather(x, axes, tiled=True),
        "reduce-scatter": lambda x, axes: lax.psum_scatter(x, axes, tiled=True),
        "all-to-all": lambda x, axes: lax.all_to_all(x, axes, 0, 0, tiled=True),
        # one pair per device, each to the next node: a "group" of 2, as crossing_calls counts
        "collective-permute": lambda x, axes: lax.ppermute(
            x, "inter", [(i, (i + 1) % nodes) for i in range(nodes)]
        ),
    }
    for key in keys:
        kind, _, size = key.rpartition("/")
        if not kind or not size.isdigit():
            raise ValueError(
                f"framing_per_call: key {key!r} is not 'kind/group size'; use e.g. "
                f"'all-reduce/4', a kind of {sorted(probes)} and a group size in devices "
                "(the keys of jaxcomm.wire_bytes(...)['crossing_calls'])."
            )
    out: dict[str, float | None] = {}
    nodes = mesh.shape["inter"]
    sizes = {mesh.devices.size: tuple(mesh.axis_names), nodes: ("inter",)}
    spec = jax.P(tuple(mesh.axis_names))
    for key in sorted(keys):
        kind, size = key.rsplit("/", 1)
        axes = ("inter",) if kind == "collective-permute" else sizes.get(int(size))
        if kind not in probes or axes is None or node_link_sent() is None:
            out[key] = None
            continue
        probe = probes[kind]
        n = elements * mesh.devices.size
        x = jax.make_array_from_callback(
            (n,),
            jax.sharding.NamedSharding(mesh, spec),
            lambda idx: np.ones(elements, np.float32),
        )
        fn = (
            jax.jit(
                jax.shard_map(
                    lambda v, probe=probe, axes=axes: probe(v, axes)[: v.shape[0]],
                    mesh=mesh,
                    in_specs=spec,
                    out_specs=spec,
                    check_vma=False,
                )
            )
            .lower(x)
            .compile()
        )
        summary = jaxcomm.wire_bytes(fn, mesh=mesh)
        calls = summary["crossing_calls"]["inter"].get(key, 0)
        if not calls:
            out[key] = None
            continue
        for _ in range(3):  # connections set up before the counters are read
            jax.block_until_ready(fn(x))
        before = node_link_sent()
        for _ in range(reps):
            jax.block_until_ready(fn(x))
        after = node_link_sent()
        sent = payload_bytes((after[0] - before[0], after[1] - before[1])) / reps
        out[key] = (sent - summary["crossing"]["inter"]) / calls
    return out


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"testbed: `{' '.join(args)}` failed: {r.stderr.strip()}")
    return r


class Testbed:
    """Network namespaces joined by shaped links; use as a context manager.

    Args:
      nodes: number of nodes (namespaces), >= 2.
      devices_per_node: CPU devices of each node's process.
      link: per-direction link rate in tc units, e.g. '1gbit', '250mbit'.
      latency: one-way added delay ('100us'); needs netem, reported as not applied without.
      burst: tbf bucket size in tc's units (``'16kb'``; the queue then holds 10 ms beyond
        it); default: :func:`tbf_burst` of each link's rate (re-sized by :meth:`set_link`).
      leaves: leaf switches (1: all nodes under one switch). With 2 or more, node ``i``
        hangs under leaf ``i % leaves`` and the leaves are joined by the spine.
      spine: per-direction rate of each leaf's spine link (default: ``link``).

    Example:
      >>> with Testbed(nodes=2, devices_per_node=2, link="1gbit") as tb:
      ...     rc = tb.run(["python", "-m", "experiments.bench", "testbed", "--worker"])
    """

    def __init__(
        self,
        *,
        nodes: int = 2,
        devices_per_node: int = 2,
        link: str = "1gbit",
        latency: str = "0",
        burst: str | None = None,
        leaves: int = 1,
        spine: str | None = None,
    ):
        fix = f"a testbed needs at least 2 nodes, and at most 200 fit the {SUBNET}.0/24 subnet"
        nodes = check_int("nodes", nodes, minimum=2, maximum=200, fix=fix)
        devices_per_node = check_int("devices_per_node", devices_per_node, minimum=1)
        leaves = check_int("leaves", leaves, minimum=1, maximum=nodes,
                           fix="leaf switches, at most one per node")  # fmt: skip
        if nodes % leaves or (leaves > 1 and nodes // leaves < 2):
            raise ValueError(
                f"leaves={leaves} must divide nodes={nodes} with at least 2 nodes per leaf; "
                f"e.g. nodes={2 * leaves}."
            )
        if spine is not None and leaves == 1:
            raise ValueError(f"spine={spine!r} needs leaves >= 2 (a spine joins leaf switches).")
        self.leaves = leaves
        self.spine = spine or (link if leaves > 1 else None)
        self.spine_bps = parse_rate(self.spine) if self.spine else None
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self.link = link
        self.rate_bps = parse_rate(link)
        self.latency_s = parse_time(latency)
        self.latency = latency
        self.burst = burst
        self.tag = f"jc{secrets.token_hex(3)}"
        self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
        self.hub = f"{self.tag}hub" if nodes > 2 and leaves == 1 else None
        self.leaf_hubs = [f"{self.tag}l{j}" for j in range(leaves)] if leaves > 1 else []
        self.spine_hub = f"{self.tag}sp" if leaves > 2 else None
        self.spine_ends: list[tuple[str, str]] = []
        # per node, its end of its link ('ns/dev'): the tc counters of what it sends
        self.node_ends: dict[int, str] = {}
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.latency_applied = self.latency_s == 0
        self.topology_file: str | None = None
        self.link_log: str | None = None
        self.started: float | None = None  # run(): when the link schedule's clock started
        self._link_ends: list[tuple[str, str, list[str]]] = []
        self._created: list[str] = []
        self._hosts_dirs: list[str] = []

    # -- set-up -------------------------------------------------------------------------
    def leaf_of(self, node: int) -> int:
        """The leaf switch of node ``node`` (0 without a spine)."""
        return node % self.leaves

    def placement(self) -> list[int]:
        """Physical slot of each node (process), leaves contiguous: the topology's
        ``placement``."""
        per_leaf = self.nodes // self.leaves
        return [self.leaf_of(i) * per_leaf + i // self.leaves for i in range(self.nodes)]

    def topology(self) -> dict:
        """The fabric as a ``jaxcomm.topology`` JSON dict (bandwidths per device).

        The node level's figure is loopback gloo between a process's devices as measured
        by ``python -m experiments.bench testbed`` on the 2-core reference machine (about 0.3
        GB/s bus bandwidth); the link levels are the shaped rates shared by the devices
        behind them.
        """
        g = self.devices_per_node
        levels = [{"name": "node", "size": g, "bandwidth_GBps": 0.3, "latency_us": 50}]
        per_leaf = self.nodes // self.leaves
        leaf_bw = self.rate_bps / 8 / g / 1e9
        levels.append({"name": "leaf" if self.leaves > 1 else "switch", "size": per_leaf,
                       "bandwidth_GBps": leaf_bw, "latency_us": 100})  # fmt: skip
        if self.leaves > 1:
            spine_bw = self.spine_bps / 8 / (g * per_leaf) / 1e9
            levels.append({"name": "spine", "size": self.leaves, "latency_us": 150,
                           "bandwidth_GBps": spine_bw})  # fmt: skip
        return {"name": f"testbed-{self.tag}", "levels": levels, "placement": self.placement()}

    def _shape(self, ns: str, dev: str, rate: str | None = None) -> None:
        tbf = _tbf(rate or self.link, self.burst)
        under_netem = False
        if self.latency_s > 0:
            delay = f"{self.latency_s * 1e6:.0f}us"
            r = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                    "handle", "1:", "netem", "delay", delay, check=False)  # fmt: skip
            under_netem = self.latency_applied = r.returncode == 0
        where = ["parent", "1:1", "handle", "10:"] if under_netem else ["root"]
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *where, *tbf)
        if rate is None:  # a node link (not the spine): what set_link changes
            self._link_ends.append((ns, dev, where))
            if ns in self.namespaces:  # the node's own end: what it sends
                self.node_ends[self.namespaces.index(ns)] = f"{ns}/{dev}"

    def _up(self, ns: str, dev: str, addr: str | None = None) -> None:
        if addr:
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")

    def _bridge(self, ns: str) -> None:
        _sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", ns, "link", "set", "br0", "up")

    def _port(self, ns: str, end: str, hub: str, hub_end: str, rate: str | None = None) -> None:
        """A veth from ``ns`` (end ``end``) to a bridge port of ``hub``, shaped both ways."""
        _sh("ip", "link", "add", end, "netns", ns, "type", "veth", "peer", "name", hub_end,
            "netns", hub)  # fmt: skip
        _sh("ip", "-n", hub, "link", "set", hub_end, "master", "br0")
        self._up(hub, hub_end)
        self._shape(ns, end, rate)  # towards the switch
        self._shape(hub, hub_end, rate)  # from the switch

    def _setup_fabric(self) -> None:
        for hub in self.leaf_hubs:
            self._bridge(hub)
        for i, ns in enumerate(self.namespaces):
            j = self.leaf_of(i)
            self._port(ns, f"{self.tag}e{i}", self.leaf_hubs[j], f"{self.tag}h{i}")
            self._up(ns, f"{self.tag}e{i}", self.addresses[i])
        if self.spine_hub is None:  # two leaves: one spine link between their switches
            a, b = f"{self.tag}s0", f"{self.tag}s1"
            l0, l1 = self.leaf_hubs
            _sh("ip", "link", "add", a, "netns", l0, "type", "veth", "peer", "name", b,
                "netns", l1)  # fmt: skip
            for hub, end in ((l0, a), (l1, b)):
                _sh("ip", "-n", hub, "link", "set", end, "master", "br0")
                self._up(hub, end)
                self._shape(hub, end, self.spine)
                self.spine_ends.append((hub, end))
        else:
            self._bridge(self.spine_hub)
            for j, hub in enumerate(self.leaf_hubs):
                up, down = f"{self.tag}u{j}", f"{self.tag}d{j}"
                self._port(hub, up, self.spine_hub, down, self.spine)
                _sh("ip", "-n", hub, "link", "set", up, "master", "br0")
                self._up(hub, up)
                self.spine_ends.append((hub, up))

    def setup(self) -> None:
        """Creates the namespaces, links, shaping, hosts files and the topology file."""
        hubs = [self.hub] if self.hub else [*self.leaf_hubs]
        hubs += [self.spine_hub] if self.spine_hub else []
        for ns in self.namespaces + hubs:
            _sh("ip", "netns", "add", ns)
            self._created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.leaves > 1:
            self._setup_fabric()
        elif self.hub is None:
            a, b = f"{self.tag}a", f"{self.tag}b"
            n0, n1 = self.namespaces
            _sh("ip", "link", "add", a, "netns", n0, "type", "veth", "peer", "name", b,
                "netns", n1)  # fmt: skip
            self._up(n0, a, self.addresses[0])
            self._up(n1, b, self.addresses[1])
            self._shape(n0, a)
            self._shape(n1, b)
        else:
            self._bridge(self.hub)
            for i, ns in enumerate(self.namespaces):
                self._port(ns, f"{self.tag}e{i}", self.hub, f"{self.tag}h{i}")
                self._up(ns, f"{self.tag}e{i}", self.addresses[i])
        d = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self._hosts_dirs.append(d)
        self.topology_file = os.path.join(d, "topology.json")
        with open(self.topology_file, "w") as f:
            json.dump(self.topology(), f, indent=1)
        self.link_log = os.path.join(d, "links.jsonl")
        with open(self.link_log, "w") as f:
            f.write(json.dumps({"time": time.time(), "link": self.link,
                                "link_bps": self.rate_bps}) + "\n")  # fmt: skip
        host = socket.gethostname()
        for ns, addr in zip(self.namespaces, self.addresses, strict=True):
            d = f"/etc/netns/{ns}"
            os.makedirs(d, exist_ok=True)
            self._hosts_dirs.append(d)
            with open(f"{d}/hosts", "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n{addr}\t{host}\n")

    def set_link(self, rate: str) -> None:
        """Changes the rate of every node link while the job runs (``tc qdisc change``) and
        appends ``{"time": unix seconds, "link": rate, "link_bps": ...}`` to
        :attr:`link_log` (``JAXCOMM_TESTBED_LINK_LOG`` in the nodes' environment)."""
        bps = parse_rate(rate)
        for ns, dev, where in self._link_ends:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, *where,
                *_tbf(rate, self.burst))  # fmt: skip
        self.link, self.rate_bps = rate, bps
        with open(self.link_log, "a") as f:
            f.write(json.dumps({"time": time.time(), "link": rate, "link_bps": bps}) + "\n")

    def cleanup(self) -> None:
        """Removes everything :meth:`setup` created; safe to call twice."""
        for ns in reversed(self._created):
            _sh("ip", "netns", "del", ns, check=False)
        self._created.clear()
        for d in self._hosts_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._hosts_dirs.clear()

    def __enter__(self) -> Testbed:
        try:
            self.setup()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- running ------------------------------------------------------------------------
    def env(self, node: int) -> dict[str, str]:
        """The environment of node ``node``'s process."""
        coordinator = f"{self.addresses[0]}:{COORDINATOR_PORT}"
        env = rank_env(coordinator, self.nodes, node, self.devices_per_node)
        env.update(
            JAXCOMM_TESTBED_LINK_BPS=str(self.rate_bps),
            JAXCOMM_TESTBED_LINK=self.link,
            JAXCOMM_TESTBED_LATENCY_S=str(self.latency_s),
            JAXCOMM_TESTBED_LATENCY_APPLIED=str(int(self.latency_applied)),
            JAXCOMM_TESTBED_ADDRESSES=",".join(self.addresses),
            JAXCOMM_TOPO_FILE=self.topology_file or "",
            JAXCOMM_TESTBED_LINK_LOG=self.link_log or "",
            JAXCOMM_TESTBED_NODE_LINK=self.node_ends.get(node, ""),
        )
        if self.started is not None:  # the link schedule's zero (unix seconds)
            env["JAXCOMM_TESTBED_START"] = repr(self.started)
        if self.spine_ends:
            env["JAXCOMM_TESTBED_SPINE"] = ",".join(f"{ns}/{dev}" for ns, dev in self.spine_ends)
            env["JAXCOMM_TESTBED_SPINE_BPS"] = str(self.spine_bps)
        return env

    def run(
        self,
        cmd: Sequence[str],
        *,
        timeout_s: float | None = None,
        link_schedule: Sequence[tuple[float, str]] = (),
    ) -> int:
        """Runs ``cmd`` once per node inside its namespace; returns the first failing code.

        Args:
          cmd: the command of every node.
          timeout_s: end all after this many seconds.
          link_schedule: ``(seconds after start, rate)`` pairs: :meth:`set_link` at those
            times while the job runs (see :func:`parse_link_schedule`).
        """
        commands = [["ip", "netns", "exec", ns, *cmd] for ns in self.namespaces]
        start, self.started = time.monotonic(), time.time()
        envs = [self.env(i) for i in range(self.nodes)]
        prefixes = [f"[node{i}] " for i in range(self.nodes)]
        done = threading.Event()

        def changes():
            for at, rate in sorted(link_schedule):
                if done.wait(max(0.0, start + at - time.monotonic())):
                    return
                self.set_link(rate)
                print(f"[testbed] t={at:g}s: link -> {rate}", flush=True)

        thread = threading.Thread(target=changes, daemon=True)
        thread.start()
        try:
            return run_group(commands, envs, prefixes=prefixes, timeout_s=timeout_s)
        finally:
            done.set()
            thread.join(timeout=10)


def parse_link_schedule(text: str) -> list[tuple[float, str]]:
    """``'60s:100mbit,120s:1gbit'`` -> ``[(60.0, '100mbit'), (120.0, '1gbit')]``.

    Raises:
      ValueError: a malformed entry (the message shows the form).
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        at, sep, rate = item.partition(":")
        if not sep:
            raise ValueError(f"link schedule entry {item!r}: use TIME:RATE, e.g. '60s:100mbit'.")
        parse_rate(rate)
        out.append((parse_time(at), rate.strip()))
    return out


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.tools.testbed",
        description="Run a command as one jax.distributed process per emulated node "
        "(network namespaces joined by tc-tbf-shaped veth links). Needs root and iproute2.",
        usage="%(prog)s [options] -- command [args...]",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="per-direction rate, e.g. 250mbit")
    parser.add_argument("--latency", default="0", help="added one-way delay (needs netem)")
    parser.add_argument(
        "--burst", default=None,
        help="tbf bucket, e.g. 16kb (default: 1 ms of line rate, at least 8kb)",
    )  # fmt: skip
    parser.add_argument(
        "--leaves", type=int, default=1,
        help="leaf switches joined by a spine (node i under leaf i %% LEAVES; default 1: one "
        "switch)",
    )  # fmt: skip
    parser.add_argument("--spine", default=None, help="spine link rate (default: --link)")
    parser.add_argument(
        "--link-schedule", default="",
        help="change the node links' rate while the job runs, e.g. '60s:100mbit,120s:1gbit' "
        "(times after the start; each change is logged to JAXCOMM_TESTBED_LINK_LOG)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="end all after N seconds")
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            parser.parse_args(["--help"])
        parser.print_usage(sys.stderr)
        print("error: give the command after --", file=sys.stderr)
        return 2
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        parser.error("no command after --")
    try:
        schedule = parse_link_schedule(args.link_schedule)
        # the constructor checks every value (and touches nothing): bad input is a usage
        # error before any namespace exists
        bed = Testbed(
            nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            link=args.link,
            latency=args.latency,
            burst=args.burst,
            leaves=args.leaves,
            spine=args.spine,
        )
    except ValueError as e:
        parser.error(str(e))
    ok, why = available()
    if not ok:
        print(f"jaxcomm.tools.testbed: cannot run here: {why}", file=sys.stderr)
        return 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    # A shell starts background jobs with SIGINT ignored, and Python then keeps ignoring it;
    # the testbed must still clean its namespaces up on Ctrl-C / SIGINT, so take it back.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with bed as tb:
            fabric = f", {tb.leaves} leaves joined by a {tb.spine} spine" if tb.leaves > 1 else ""
            print(
                f"[testbed] {args.nodes} nodes x {args.devices_per_node} devices, link "
                f"{args.link} per direction{fabric}, namespaces {tb.namespaces}, latency "
                + (args.latency if tb.latency_applied else "not applied (no netem in kernel)"),
                flush=True,
            )
            return tb.run(cmd, timeout_s=args.timeout, link_schedule=schedule)
    except KeyboardInterrupt:
        print("[testbed] interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)


if __name__ == "__main__":
    sys.exit(main())
