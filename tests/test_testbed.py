"""jaxcomm.testbed: namespaces + shaped veth links; runs where root and iproute2 exist (CI)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxcomm import testbed

ROOT = Path(__file__).resolve().parents[1]
OK, WHY = testbed.available()
if not OK:
    print(f"\ntests/test_testbed.py skipped: {WHY}", file=sys.stderr)
needs_testbed = pytest.mark.skipif(not OK, reason=f"testbed cannot run here: {WHY}")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMM_")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _names_in(out):
    return re.findall(r"'(jc[0-9a-f]+n[0-9]+)'", out)


def _ours(tag=""):
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in names.splitlines() if line.startswith("jc" + tag)]


def test_parse_units():
    assert testbed.parse_rate("1gbit") == 10**9
    assert testbed.parse_rate("250mbit") == 250 * 10**6
    assert testbed.parse_time("100us") == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="1gbit"):
        testbed.parse_rate("1 GB/s")
    with pytest.raises(ValueError, match="at least 2"):
        testbed.Testbed(nodes=1)


def test_without_root_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testbed.main(["--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err


@needs_testbed
def test_two_nodes_allreduce_across_the_link():
    cmd = [sys.executable, "-m", "jaxcomm.testbed", "--nodes", "2", "--devices-per-node", "2"]
    cmd += ["--link", "1gbit", "--", sys.executable, str(ROOT / "tests" / "_dist_worker.py")]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[node0] CHECK_OK process=0" in p.stdout and "[node1] CHECK_OK process=1" in p.stdout
    names = _names_in(p.stdout)
    assert len(names) == 2 and not set(names) & set(_ours())  # namespaces removed


_SERVER = """
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('{addr}', 24000)); s.listen(1); c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n / (time.perf_counter() - t0) * 8, flush=True)
"""
_CLIENT = """
import socket, time
for _ in range(100):
    try: c = socket.create_connection(('{addr}', 24000)); break
    except OSError: time.sleep(0.05)
c.sendall(b'x' * {nbytes}); c.close()
"""


@needs_testbed
@pytest.mark.parametrize("nodes", [2, 3])
def test_link_is_shaped_and_cleaned_up(nodes):
    # TCP from node 1 to node 0 moves at most the link rate (and most of it: REFERENCE.md
    # measured 0.95 of the line rate); the bridge case shapes both ends of each port.
    rate = 40_000_000
    with testbed.Testbed(nodes=nodes, devices_per_node=1, link="40mbit") as tb:
        names = list(tb.namespaces)
        assert set(names) <= set(_ours(tb.tag[2:]))
        srv = subprocess.Popen(
            ["ip", "netns", "exec", names[0], sys.executable, "-c",
             _SERVER.format(addr=tb.addresses[0])],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        subprocess.run(
            ["ip", "netns", "exec", names[-1], sys.executable, "-c",
             _CLIENT.format(addr=tb.addresses[0], nbytes=3_000_000)],
            check=True, timeout=60,
        )  # fmt: skip
        bps = float(srv.communicate(timeout=60)[0])
    assert 0.6 * rate < bps < 1.1 * rate, bps
    assert not set(names) & set(_ours())
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


@needs_testbed
def test_failure_and_ctrl_c_clean_up():
    base = [sys.executable, "-m", "jaxcomm.testbed", "--nodes", "2", "--devices-per-node", "1"]
    cmd = [*base, "--", "sh", "-c", "exit 7"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    assert p.returncode == 7
    names = _names_in(p.stdout)
    assert len(names) == 2 and not set(names) & set(_ours())
    cmd = [*base, "--", "sleep", "60"]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, text=True)
    names = _names_in(p.stdout.readline())  # printed once the namespaces exist
    assert len(names) == 2 and set(names) <= set(_ours())
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 130
    assert not set(names) & set(_ours())
