"""Processes on one host: ``python -m jaxcomm.tools.launch --nprocs N --local-devices D -- cmd``.

Starts ``N`` copies of ``cmd`` with ``JAXCOMM_COORDINATOR`` (loopback, a free port),
``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID`` and ``JAXCOMM_LOCAL_DEVICES`` set; the
command calls :func:`jaxcomm.init_distributed`. Output is forwarded line by line with a
``[rank]`` prefix. When one process exits with an error, the others are ended (their whole
process groups), and the launcher returns the first failing exit code.

Example:
  python -m jaxcomm.tools.launch --nprocs 2 --local-devices 2 -- \
      python -m experiments.bench collectives
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcomm.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jaxcomm.host_memory import reuse_env
from jaxcomm.validate import check_int

__all__ = ["free_port", "main", "quiet", "rank_env", "run_group"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, below the kernel's ephemeral
    range: a port from that range (what binding port 0 gives) can be taken as the local
    port of any outgoing connection before the coordinator binds it (jax.distributed's
    "Failed to start RPC server")."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: any free port
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(coordinator: str, nprocs: int, rank: int, local_devices: int) -> dict[str, str]:
    """The ``JAXCOMM_*`` variables for one process."""
    return {
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(nprocs),
        ENV_PROCESS_ID: str(rank),
        ENV_LOCAL_DEVICES: str(local_devices),
    }


# gloo's connection report ("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of
# connected peer ranks is : 3"), written once per communicator from C++ threads at once: the
# reports of several threads arrive split and interleaved character runs apart.
_GLOO_REPORT = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)
_GLOO_WORDS = re.compile(
    r"\[Gloo\]|(?<![A-Za-z])(?:Rank|is|connected|to|peer|ranks|Expected|number|of)(?![A-Za-z])"
    r"|[\d\s.:]"
)
_GLOO_MARKS = ("[Gloo]", "peer ranks", "is connected to", "Expected number of connected")


def quiet(line: str) -> str | None:
    """``line`` without gloo's connection reports; ``None`` when nothing else was in it.

    A line holding only pieces of reports (interleaved by gloo's threads) is dropped; a
    line with other text keeps that text with the whole reports cut out.
    """
    if not any(m in line for m in _GLOO_MARKS):
        return line
    kept = _GLOO_REPORT.sub("", line)
    if not _GLOO_WORDS.sub("", kept):
        return None
    return kept


def _forward(stream, prefix: str, out, lock: threading.Lock) -> None:
    dropped = False  # the last line was a gloo report; its trailing digits may follow alone
    for raw in iter(stream.readline, b""):
        text = raw.decode(errors="replace").rstrip("\n")
        line = quiet(text)
        if line is None or (dropped and text.strip().isdigit()):
            dropped = True
            continue
        dropped = False
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_group(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    prefixes: Sequence[str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 3.0,
    settle_s: float = 20.0,
    out=None,
) -> int:
    """Runs one command per rank, forwards their output, ends the group on the first failure.

    Args:
      commands: the argv of each process.
      envs: extra environment variables of each process (added to ``os.environ``). Every
        process also keeps its freed memory for reuse (``jaxcomm.host_memory.reuse_env``;
        variables already in ``os.environ`` win, ``JAXCOMM_KEEP_FREED_MEMORY=0`` turns it
        off).
      prefixes: output prefix per process, default ``[rank] ``.
      timeout_s: end all processes after this many seconds (exit code 124).
      grace_s: seconds between SIGTERM and SIGKILL when ending a group.
      settle_s: after the first failure, seconds the others get to end by themselves
        (a survivor's collective fails fast once its peer is gone, and it names the
        operation it was in) before they are ended.
      out: where to write (default ``sys.stdout``).

    Returns:
      0 when every process exited 0; else the first non-zero exit code seen (a process
      killed by signal ``s`` counts as ``128 + s``).
    """
    out = sys.stdout if out is None else out
    prefixes = prefixes or [f"[{i}] " for i in range(len(commands))]
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for cmd, extra, prefix in zip(commands, envs, prefixes, strict=True):
            p = subprocess.Popen(
                list(cmd),
                env={**reuse_env(), **os.environ, **extra},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: we can end it and its children
            )
            procs.append(p)
            t = threading.Thread(target=_forward, args=(p.stdout, prefix, out, lock), daemon=True)
            t.start()
            threads.append(t)
        return _watch(procs, timeout_s, settle_s, out, lock)
    finally:
        for p in procs:
            _end_group(p, grace_s)
        for t in threads:
            t.join(timeout=5)


def _watch(
    procs: list[subprocess.Popen],
    timeout_s: float | None,
    settle_s: float,
    out: Any,
    lock: threading.Lock,
) -> int:
    """Waits for ``procs``: 0 when all exit 0; the first non-zero code (``128 + s`` for a
    signal ``s``) once the others had ``settle_s`` to end; 124 after ``timeout_s``."""
    first_error = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    running = set(range(len(procs)))
    while running:
        for i in sorted(running):
            rc = procs[i].poll()
            if rc is None:
                continue
            running.discard(i)
            if rc != 0 and first_error == 0:
                first_error = 128 - rc if rc < 0 else rc
                with lock:
                    out.write(
                        f"[launch] process {i} exited with {rc}; the others end "
                        f"within {settle_s:g} s\n"
                    )
                    out.flush()
                settled = time.monotonic() + settle_s
                while any(procs[j].poll() is None for j in running):
                    if time.monotonic() > settled:
                        break
                    time.sleep(0.05)
        if first_error:
            return first_error
        if deadline is not None and time.monotonic() > deadline:
            with lock:
                out.write(f"[launch] timeout after {timeout_s} s; ending all processes\n")
            return 124
        time.sleep(0.05)
    return first_error


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.tools.launch",
        usage="%(prog)s --nprocs N [--local-devices D] [options] -- command [args...]",
        description="Start N jax.distributed processes on this machine (coordinator on "
        "loopback); the command calls jaxcomm.init_distributed().",
    )
    parser.add_argument("--nprocs", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--local-devices", type=int, default=1, help="CPU devices per process (default 1)"
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: free)")
    parser.add_argument("--timeout", type=float, default=None, help="end all after N seconds")
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            parser.parse_args(["--help"])
        parser.error("give the command after --")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        parser.error("no command after --")
    for flag, value in (("--nprocs", args.nprocs), ("--local-devices", args.local_devices)):
        try:
            check_int(flag, value, minimum=1)
        except ValueError as e:
            parser.error(str(e))
    return args, cmd


def main(argv: Sequence[str] | None = None) -> int:
    args, cmd = _parse(sys.argv[1:] if argv is None else argv)
    port = args.port or free_port()
    coordinator = f"127.0.0.1:{port}"
    envs = [rank_env(coordinator, args.nprocs, r, args.local_devices) for r in range(args.nprocs)]
    return run_group([cmd] * args.nprocs, envs, timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
