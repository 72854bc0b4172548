"""jaxcomm.host_memory: XLA:CPU's large buffers reuse freed memory instead of new pages.

Measured by page faults (the kernel's count, not a timing): a process that runs a jitted
elementwise kernel over a 64 MiB array takes a fresh mmap per output under glibc's
defaults (about 16k minor faults a call); with the policy, by ``mallopt`` in the process or
by the environment a launcher gives it, the memory of one call is reused by the next.
"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcomm import host_memory
from jaxcomm.tools import launch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the policy is glibc's malloc tunables",
)

# One process: optionally the policy by mallopt, then rounds of 5 calls of a kernel that
# writes a new 64 MiB buffer; prints the fewest minor faults per call of a round. With the
# policy the heap grows for the first calls (JAX frees a result a little after the next
# call has started), then stays: a later round faults nothing.
CHILD = """
import json, os, resource, sys
applied = None
if sys.argv[1] == "mallopt":
    import jaxcomm.host_memory as hm
    applied = hm.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: x * 2.0)
x = jnp.ones((16 << 20,), jnp.float32)
rounds = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        jax.block_until_ready(f(x))
    rounds.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
print(json.dumps({"faults_per_call": min(rounds), "rounds": rounds, "applied": applied}))
"""


def _child(mode: str, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", **env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_by_mallopt_and_by_the_environment():
    pages = (64 << 20) // 4096
    default = _child("plain", {})
    # glibc's default: every 64 MiB output is a fresh mmap, faulted in page by page
    assert default["faults_per_call"] > pages / 2, default
    by_call = _child("mallopt", {})
    assert by_call["applied"] is True
    by_env = _child("plain", host_memory.REUSE_ENV)
    for got in (by_call, by_env):
        assert got["faults_per_call"] < pages / 50, (default, got)
    # the switch turns the in-process call off
    off = _child("mallopt", {host_memory.ENV_SWITCH: "0"})
    assert off["applied"] is False and off["faults_per_call"] > pages / 2, off


def test_reuse_env_and_its_switch(monkeypatch):
    monkeypatch.delenv(host_memory.ENV_SWITCH, raising=False)
    assert host_memory.reuse_env() == host_memory.REUSE_ENV
    assert set(host_memory.REUSE_ENV) == {
        "MALLOC_ARENA_MAX",
        "MALLOC_MMAP_MAX_",
        "MALLOC_TRIM_THRESHOLD_",
    }
    monkeypatch.setenv(host_memory.ENV_SWITCH, "0")
    assert host_memory.reuse_env() == {}
    monkeypatch.setenv(host_memory.ENV_SWITCH, "false")
    for call in (host_memory.reuse_env, host_memory.keep_freed_memory):
        with pytest.raises(ValueError, match=r"JAXCOMM_KEEP_FREED_MEMORY='false' .*\['0', '1'\]"):
            call()


def test_launched_processes_get_the_policy_and_the_callers_variables_win(tmp_path, monkeypatch):
    monkeypatch.delenv(host_memory.ENV_SWITCH, raising=False)
    for k in host_memory.REUSE_ENV:
        monkeypatch.delenv(k, raising=False)
    names = sorted(host_memory.REUSE_ENV)
    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    out = tmp_path / "out.txt"

    def run():
        with open(out, "w") as f:
            assert launch.run_group([[sys.executable, "-c", show]], [{}], out=f) == 0
        return json.loads(out.read_text().split("] ", 1)[1])

    assert run() == host_memory.REUSE_ENV
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # a user's own setting is kept
    assert run()["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv(host_memory.ENV_SWITCH, "0")
    assert run() == {k: None for k in host_memory.REUSE_ENV}
