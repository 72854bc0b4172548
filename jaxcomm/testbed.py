"""An emulated cluster on one machine: network namespaces joined by rate-limited links.

``python -m jaxcomm.testbed --nodes 2 --devices-per-node 2 --link 1gbit --latency 100us -- cmd``

Each node is a network namespace running one ``jax.distributed`` process with
``--devices-per-node`` CPU devices. Traffic between devices of one node stays inside its
namespace (loopback); traffic between nodes crosses a veth link shaped with ``tc tbf``. That is
a real two-level hierarchy, with the slow level a link you choose.

Set-up (all names start with ``jc`` plus a per-run tag, so parallel runs do not collide):

1. ``ip netns add`` one namespace per node, ``lo`` up.
2. Two nodes: one veth pair between them. More: a hub namespace with a bridge, one veth pair
   per node (a switch with one port per node).
3. ``tc qdisc add dev X root tbf rate R burst B latency 10ms`` on every link end, so each
   direction of each link carries at most R. netem is not available in this kernel, so
   ``--latency`` is applied with netem when the kernel has it and otherwise reported as not
   applied (veth adds tens of microseconds by itself).
4. ``/etc/netns/NAME/hosts`` maps this machine's host name to the node's veth address:
   ``ip netns exec`` mounts it over ``/etc/hosts``, and gloo binds to the address the host
   name resolves to (../shared/REFERENCE.md).
5. Each node's process runs under ``ip netns exec`` with ``JAXCOMM_COORDINATOR`` (node 0's
   address), ``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID``, ``JAXCOMM_LOCAL_DEVICES`` and
   ``JAXCOMM_TESTBED_*`` (link rate in bit/s, addresses) set; it calls
   ``jaxcomm.init_distributed()``.
6. Cleanup always runs (normal exit, failure, Ctrl-C, SIGTERM): processes ended, namespaces
   (and with them the veths and the bridge) and hosts files removed.

Needs root and iproute2 (``ip``, ``tc``); without them it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from jaxcomm.launch import rank_env, run_group
from jaxcomm.validate import check_int

__all__ = ["Testbed", "available", "main", "parse_rate", "parse_time"]

SUBNET = "10.231.0"
COORDINATOR_PORT = 23456
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> int:
    """``'1gbit'``, ``'250mbit'``, ``'100kbit'`` -> bits per second (tc's units, powers of 10)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", text.lower())
    if not m:
        raise ValueError(f"link rate {text!r}: use tc's form, e.g. '1gbit', '250mbit'.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


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
      burst: tbf bucket size.

    Example:
      >>> with Testbed(nodes=2, devices_per_node=2, link="1gbit") as tb:
      ...     rc = tb.run(["python", "-m", "jaxcomm.bench", "testbed", "--worker"])
    """

    def __init__(
        self,
        *,
        nodes: int = 2,
        devices_per_node: int = 2,
        link: str = "1gbit",
        latency: str = "0",
        burst: str = "128kb",
    ):
        fix = f"a testbed needs at least 2 nodes, and at most 200 fit the {SUBNET}.0/24 subnet"
        nodes = check_int("nodes", nodes, minimum=2, maximum=200, fix=fix)
        devices_per_node = check_int("devices_per_node", devices_per_node, minimum=1)
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self.link = link
        self.rate_bps = parse_rate(link)
        self.latency_s = parse_time(latency)
        self.latency = latency
        self.burst = burst
        self.tag = f"jc{secrets.token_hex(3)}"
        self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
        self.hub = f"{self.tag}hub" if nodes > 2 else None
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.latency_applied = self.latency_s == 0
        self._created: list[str] = []
        self._hosts_dirs: list[str] = []

    # -- set-up -------------------------------------------------------------------------
    def _shape(self, ns: str, dev: str) -> None:
        tbf = ["tbf", "rate", self.link, "burst", self.burst, "latency", "10ms"]
        if self.latency_s > 0:
            delay = f"{self.latency_s * 1e6:.0f}us"
            r = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                    "handle", "1:", "netem", "delay", delay, check=False)  # fmt: skip
            if r.returncode == 0:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                    "parent", "1:1", "handle", "10:", *tbf)  # fmt: skip
                self.latency_applied = True
                return
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def _up(self, ns: str, dev: str, addr: str | None = None) -> None:
        if addr:
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")

    def setup(self) -> None:
        """Creates the namespaces, links, shaping and hosts files."""
        for ns in self.namespaces + ([self.hub] if self.hub else []):
            _sh("ip", "netns", "add", ns)
            self._created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.hub is None:
            a, b = f"{self.tag}a", f"{self.tag}b"
            n0, n1 = self.namespaces
            _sh("ip", "link", "add", a, "netns", n0, "type", "veth", "peer", "name", b,
                "netns", n1)  # fmt: skip
            self._up(n0, a, self.addresses[0])
            self._up(n1, b, self.addresses[1])
            self._shape(n0, a)
            self._shape(n1, b)
        else:
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.namespaces):
                node_end, hub_end = f"{self.tag}e{i}", f"{self.tag}h{i}"
                _sh("ip", "link", "add", node_end, "netns", ns, "type", "veth", "peer", "name",
                    hub_end, "netns", self.hub)  # fmt: skip
                _sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
                self._up(ns, node_end, self.addresses[i])
                self._up(self.hub, hub_end)
                self._shape(ns, node_end)  # node -> switch
                self._shape(self.hub, hub_end)  # switch -> node
        host = socket.gethostname()
        for ns, addr in zip(self.namespaces, self.addresses, strict=True):
            d = f"/etc/netns/{ns}"
            os.makedirs(d, exist_ok=True)
            self._hosts_dirs.append(d)
            with open(f"{d}/hosts", "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n{addr}\t{host}\n")

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
        )
        return env

    def run(self, cmd: Sequence[str], *, timeout_s: float | None = None) -> int:
        """Runs ``cmd`` once per node inside its namespace; returns the first failing code."""
        commands = [["ip", "netns", "exec", ns, *cmd] for ns in self.namespaces]
        envs = [self.env(i) for i in range(self.nodes)]
        prefixes = [f"[node{i}] " for i in range(self.nodes)]
        return run_group(commands, envs, prefixes=prefixes, timeout_s=timeout_s)


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.testbed",
        description="Run a command as one jax.distributed process per emulated node "
        "(network namespaces joined by tc-tbf-shaped veth links). Needs root and iproute2.",
        usage="%(prog)s [options] -- command [args...]",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="per-direction rate, e.g. 250mbit")
    parser.add_argument("--latency", default="0", help="added one-way delay (needs netem)")
    parser.add_argument("--burst", default="128kb", help="tbf burst (default 128kb)")
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
        parse_rate(args.link), parse_time(args.latency)
    except ValueError as e:
        parser.error(str(e))
    ok, why = available()
    if not ok:
        print(f"jaxcomm.testbed: cannot run here: {why}", file=sys.stderr)
        return 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    # A shell starts background jobs with SIGINT ignored, and Python then keeps ignoring it;
    # the testbed must still clean its namespaces up on Ctrl-C / SIGINT, so take it back.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Testbed(
            nodes=args.nodes,
            devices_per_node=args.devices_per_node,
            link=args.link,
            latency=args.latency,
            burst=args.burst,
        ) as tb:
            print(
                f"[testbed] {args.nodes} nodes x {args.devices_per_node} devices, link "
                f"{args.link} per direction, namespaces {tb.namespaces}, latency "
                + (args.latency if tb.latency_applied else "not applied (no netem in kernel)"),
                flush=True,
            )
            return tb.run(cmd, timeout_s=args.timeout)
    except KeyboardInterrupt:
        print("[testbed] interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)


if __name__ == "__main__":
    sys.exit(main())
