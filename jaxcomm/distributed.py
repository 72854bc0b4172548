"""``init_distributed``: start ``jax.distributed`` from the jaxcomm launcher's environment.

``python -m jaxcomm.tools.launch`` and ``python -m jaxcomm.tools.testbed`` give every process four
variables; :func:`init_distributed` reads them. Without them (a SLURM or Open MPI job),
it calls ``jax.distributed.initialize()`` and lets JAX detect the cluster.

A hung CPU collective waits ``xla_cpu_collective_timeout_seconds`` (1800 s by default)
before it fails. jaxcomm sets it low, and the coordinator's heartbeat timeout too, so that
a dead peer becomes an error within a minute, not a hang. Known exception
(jax-ml/jax#40831, jaxlib 0.10-0.12): a CPU reduce-scatter ignores the flag and fails after
30 s, so processes that reach one more than 30 s apart (a long compile on one of them)
fail there.

Barriers and exchanges between processes (:func:`barrier`, :func:`agree`, :func:`exchange`)
go through jaxcomm's own coordination store, not a collective: a process that is still
compiling is waited for (up to ``timeout_s``), while one that died is reported at once
(its connection closes) or within the heartbeat timeout (TCP keepalive, for a lost node).
JAX's own coordination client is not public API (``jax.distributed`` exposes only
``initialize``, ``is_initialized`` and ``shutdown``), so :func:`init_distributed` starts
the store: process 0 serves it on a free port, whose address every process learns from one
broadcast (``jax.experimental.multihost_utils.broadcast_one_to_all``) while all of them
are still together, right after ``jax.distributed.initialize``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import threading
import time
from typing import Any

from jaxcomm.validate import check_int

ENV_COORDINATOR = "JAXCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXCOMM_LOCAL_DEVICES"
ENV_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES)

# XLA:CPU's own flag (present in jaxlib 0.10.2: it is in libjax_common's DebugOptions).
TIMEOUT_FLAG = "xla_cpu_collective_timeout_seconds"

__all__ = [
    "ENV_VARS",
    "agree",
    "barrier",
    "check_same_on_processes",
    "exchange",
    "fingerprint",
    "init_distributed",
    "launcher_env",
    "set_collective_timeout",
]


def set_collective_timeout(seconds: int) -> None:
    """Sets XLA:CPU's collective timeout through ``XLA_FLAGS`` (before JAX starts its backend).

    Args:
      seconds: how long a collective may wait for its peers before it fails.

    XLA reads the flag when the CPU backend starts, so call this before any JAX computation.

    Raises:
      RuntimeError: ``jax.distributed`` is already initialised (the flag would be ignored).
    """
    seconds = check_int("seconds", seconds, minimum=1, fix="the collective timeout in seconds")
    _check_backend_not_started("set_collective_timeout")
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"--{TIMEOUT_FLAG}=\S+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --{TIMEOUT_FLAG}={int(seconds)}".strip()


def _check_backend_not_started(what: str) -> None:
    import jax

    if jax.distributed.is_initialized():
        raise RuntimeError(
            f"{what} must run before jax.distributed.initialize() and any JAX computation: "
            "XLA reads its flags when the backend starts. Call jaxcomm.init_distributed() "
            "first thing in the script."
        )


def launcher_env() -> dict[str, str] | None:
    """The four ``JAXCOMM_*`` variables if all are set, else ``None``.

    Raises:
      ValueError: only some of them are set, or a number does not parse.
    """
    present = {k: os.environ[k] for k in ENV_VARS if os.environ.get(k)}
    if not present:
        return None
    missing = [k for k in ENV_VARS if k not in present]
    if missing:
        raise ValueError(
            f"jaxcomm.init_distributed: {missing} are not set but {sorted(present)} are. "
            "Set all four (python -m jaxcomm.tools.launch does) or none "
            "(SLURM / Open MPI auto-detect)."
        )
    for k in (ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES):
        if not present[k].isdigit():
            raise ValueError(f"{k}={present[k]!r} must be a non-negative integer.")
    return present


_DEFAULT_HEARTBEAT_S = 20


def init_distributed(
    *,
    collective_timeout_s: int = 45,
    heartbeat_timeout_s: int = _DEFAULT_HEARTBEAT_S,
    initialization_timeout_s: int = 120,
    **initialize_kwargs: Any,
) -> dict[str, int]:
    """Starts ``jax.distributed`` for this process; call it before any other JAX call.

    1. Sets XLA:CPU's collective timeout low (``collective_timeout_s``).
    2. With ``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID`` and
       ``JAXCOMM_LOCAL_DEVICES`` set (by ``python -m jaxcomm.tools.launch`` or
       ``python -m jaxcomm.tools.testbed``): gives this process that many CPU devices
       (``jax_num_cpu_devices``) and initialises with those values.
    3. Otherwise calls ``jax.distributed.initialize()`` with no address, so JAX detects SLURM,
       Open MPI (``mpirun``) or a TPU pod by itself.

    Args:
      collective_timeout_s: XLA:CPU collective timeout; a dead peer fails a collective after it.
      heartbeat_timeout_s: the coordinator declares a silent process dead after it.
      initialization_timeout_s: how long to wait for all processes to connect.
      **initialize_kwargs: passed on to ``jax.distributed.initialize``.

    Returns:
      ``{'process_id': .., 'num_processes': .., 'local_devices': ..}``.

    Raises:
      ValueError: the ``JAXCOMM_*`` variables are incomplete or malformed.
      RuntimeError: JAX already started its backend.

    Example:
      >>> import jaxcomm
      >>> info = jaxcomm.init_distributed()      # first thing in the script
      >>> mesh = jaxcomm.make_mesh()             # ('inter','intra') = (processes, devices)
    """
    import jax

    set_collective_timeout(collective_timeout_s)
    env = launcher_env()
    kwargs: dict[str, Any] = dict(
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=initialization_timeout_s,
    )
    kwargs.update(initialize_kwargs)
    if env is not None:
        jax.config.update("jax_num_cpu_devices", int(env[ENV_LOCAL_DEVICES]))
        jax.distributed.initialize(
            coordinator_address=env[ENV_COORDINATOR],
            num_processes=int(env[ENV_NUM_PROCESSES]),
            process_id=int(env[ENV_PROCESS_ID]),
            **kwargs,
        )
    else:
        jax.distributed.initialize(**kwargs)
    _start_store(env[ENV_COORDINATOR] if env else None, heartbeat_timeout_s)
    return {
        "process_id": jax.process_index(),
        "num_processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
    }


_USES: collections.Counter = collections.Counter()


def _unique(name: str) -> str:
    """``name`` with the number of its earlier uses in this process: the coordination
    service's barriers and keys are single-use, and processes that do the same work in the
    same order number them alike."""
    _USES[name] += 1
    return f"jaxcomm/{name}/{_USES[name]}"


# The coordination store of this process's jax.distributed job (None: one process, or
# jax.distributed started by another caller than init_distributed).
_STORE: _StoreClient | None = None


class _StoreServer:
    """Process 0's key-value store and barriers, one thread per connected process.

    Each request is a line of JSON, answered with one line: ``{"ok": value}`` or
    ``{"error": message}``. A process whose connection closes is gone: every wait that is
    not complete fails, naming it (a process that exited after the last barrier it took
    part in is waited for by no one)."""

    def __init__(self, num_processes: int, host: str):
        self.num_processes = num_processes
        self.values: dict[str, str] = {}
        self.arrived: dict[str, set[int]] = collections.defaultdict(set)
        self.dead: set[int] = set()
        self.cond = threading.Condition()
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name="jaxcomm-store", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _wait(self, ready, what: str, timeout_s: float) -> str | None:
        """Waits (holding ``cond``) until ``ready()``; the error if a process died first
        or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.dead:
                return f"{what}: processes {sorted(self.dead)} are gone (exited or lost)"
            left = deadline - time.monotonic()
            if left <= 0:
                return f"{what}: not every process arrived within {timeout_s:.0f} s"
            self.cond.wait(left)
        return None

    def _answer(self, req: dict) -> dict:
        op, key, timeout_s = req["op"], req["key"], req.get("timeout_s", 0.0)
        with self.cond:
            if op == "set":
                self.values[key] = req["value"]
                self.cond.notify_all()
                return {"ok": None}
            if op == "get":
                error = self._wait(lambda: key in self.values, f"reading {key!r}", timeout_s)
                return {"error": error} if error else {"ok": self.values[key]}
            if op == "barrier":
                self.arrived[key].add(req["process"])
                self.cond.notify_all()
                error = self._wait(
                    lambda: len(self.arrived[key]) >= self.num_processes,
                    f"barrier {key!r}",
                    timeout_s,
                )
                return {"error": error} if error else {"ok": None}
        return {"error": f"unknown request {op!r}"}

    def _serve(self, conn: socket.socket) -> None:
        process = None
        try:
            with conn, conn.makefile("rw", encoding="utf-8") as f:
                for line in f:
                    req = json.loads(line)
                    if req["op"] == "hello":
                        process, reply = req["process"], {"ok": None}
                    else:
                        reply = self._answer(req)
                    f.write(json.dumps(reply) + "\n")
                    f.flush()
        except OSError:
            pass
        finally:  # a process that exited (or was lost) fails every wait that needs it
            if process is not None:
                with self.cond:
                    self.dead.add(process)
                    self.cond.notify_all()


class _StoreClient:
    """One process's connection to the store: one request at a time."""

    def __init__(self, address: tuple[str, int], process: int, heartbeat_timeout_s: int):
        self.process = process
        self.sock = socket.create_connection(address, timeout=heartbeat_timeout_s * 3)
        self.sock.settimeout(None)
        # A lost node closes nothing: keepalive probes find it within the heartbeat timeout.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        probe = max(1, heartbeat_timeout_s // 4)
        for option, value in (
            ("TCP_KEEPIDLE", probe),
            ("TCP_KEEPINTVL", probe),
            ("TCP_KEEPCNT", 3),
        ):
            if hasattr(socket, option):
                self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        self.file = self.sock.makefile("rw", encoding="utf-8")
        self.lock = threading.Lock()
        self.request({"op": "hello", "process": process})

    def request(self, req: dict) -> Any:
        """Sends ``req`` and returns its value; raises RuntimeError for an error or a
        store that is gone (process 0 exited or was lost)."""
        with self.lock:
            try:
                self.file.write(json.dumps(req) + "\n")
                self.file.flush()
                line = self.file.readline()
            except OSError as e:
                line = ""
                cause: Exception | None = e
            else:
                cause = None
        if not line:
            raise RuntimeError(
                "jaxcomm.distributed: process 0, which serves the coordination store, is gone "
                "(exited or lost)"
            ) from cause
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"jaxcomm.distributed: {reply['error']}")
        return reply["ok"]


def _start_store(coordinator: str | None, heartbeat_timeout_s: int) -> None:
    """Starts the coordination store of this job (process 0 serves it) and connects this
    process to it; every process calls it, right after ``jax.distributed.initialize``.

    The address is process 0's: the host of ``coordinator`` (the launcher's), or its own
    host name's address, with a free port; one broadcast hands it to every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    global _STORE
    if jax.process_count() == 1:
        return
    address = np.zeros(256, np.uint8)
    if jax.process_index() == 0:
        host = coordinator.rsplit(":", 1)[0] if coordinator else socket.gethostname()
        host = socket.gethostbyname(host.strip("[]"))
        server = _StoreServer(jax.process_count(), host)
        text = f"{host}:{server.port}".encode()
        address[: len(text)] = np.frombuffer(text, np.uint8)
    address = np.asarray(multihost_utils.broadcast_one_to_all(address))
    host, port = bytes(address[address > 0].tolist()).decode().rsplit(":", 1)
    _STORE = _StoreClient((host, int(port)), jax.process_index(), heartbeat_timeout_s)


def _client() -> _StoreClient | None:
    """This process's connection to the coordination store, or ``None`` in a one-process
    job.

    A job whose ``jax.distributed`` another caller started (``jax.distributed.initialize()``
    in the script) gets its store here, at the first barrier or exchange: every process
    reaches that call in the same order, so the one broadcast of the store's address
    (a collective, under JAX's own collective timeout) pairs up.
    """
    import jax

    if jax.process_count() == 1:
        return None
    if _STORE is None:
        _start_store(None, _DEFAULT_HEARTBEAT_S)
    return _STORE


def barrier(name: str, *, timeout_s: int = 1800) -> None:
    """Waits until every process reached ``barrier(name)``; a no-op in one process.

    The wait goes through the coordination service of ``jax.distributed``, not through a
    collective: a peer that is still compiling is alive (its heartbeats go on) and is
    waited for up to ``timeout_s``, while a dead one is reported by the heartbeat. Call it
    after compiling a program and before its first run, so that the collectives inside
    never wait for a slower compile.

    Args:
      name: the barrier's name; every process passes the same one, once.
      timeout_s: how long to wait for the slowest process.

    Raises:
      RuntimeError: (from JAX) a process did not arrive within ``timeout_s``.

    Example:
      >>> compiled = step.lower(state, batch).compile()
      >>> jaxcomm.distributed.barrier("step compiled")
    """
    client = _client()
    if client is not None:
        _barrier(client, _unique(f"barrier/{name}"), timeout_s)


def _barrier(client: _StoreClient, key: str, timeout_s: float) -> None:
    client.request({"op": "barrier", "key": key, "process": client.process, "timeout_s": timeout_s})


def agree(name: str, error: str | None, *, timeout_s: int = 1800) -> list[str | None]:
    """Every process's outcome of one piece of work, exchanged without a collective.

    Work that can fail on one process only (a compilation out of memory, a bad file) must
    be followed by the same decision everywhere: a process that went on alone would wait
    in the next collective for a peer that gave up. Each process posts its outcome to the
    coordination service of ``jax.distributed``; all wait at a barrier and read them all.

    Args:
      name: names the work; every process passes the same one, once.
      error: this process's error message, or ``None`` when it succeeded.
      timeout_s: how long to wait for the slowest process.

    Returns:
      One entry per process, in process order: its error message, or ``None``.

    Example:
      >>> errors = jaxcomm.distributed.agree("build row 3", None if ok else str(e))
      >>> failed = [i for i, e in enumerate(errors) if e is not None]
    """
    posted = exchange(f"agree/{name}", "" if error is None else "E" + error, timeout_s=timeout_s)
    return [value[1:] if value else None for value in posted]


def exchange(name: str, value: str, *, timeout_s: int = 1800) -> list[str]:
    """Every process's string, read by every process, through the coordination service.

    Args:
      name: names the exchange; every process passes the same one, once.
      value: this process's string.
      timeout_s: how long to wait for the slowest process.

    Returns:
      One string per process, in process order (``[value]`` in one process).
    """
    import jax

    client = _client()
    if client is None:
        return [value]
    key = _unique(name)
    client.request({"op": "set", "key": f"{key}/{jax.process_index()}", "value": value})
    _barrier(client, f"{key}/posted", timeout_s)
    return [
        client.request({"op": "get", "key": f"{key}/{i}", "timeout_s": timeout_s})
        for i in range(jax.process_count())
    ]


def fingerprint(tree: Any) -> str:
    """A hash of the bits, shapes, dtypes and structure of a pytree of arrays.

    Reads every leaf to the host (its addressable data: for a replicated array, this
    process's first copy), so call it on initial values, not in a loop.

    Args:
      tree: a pytree of arrays (or numpy arrays, scalars).

    Returns:
      A hex digest; equal trees give equal digests on every process and platform.
    """
    import hashlib

    import jax
    import numpy as np

    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten_with_path(tree)
    h.update(str(treedef).encode())
    for path, x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = x.addressable_shards[0].data
        a = np.asarray(jax.device_get(x))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype.str}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def check_same_on_processes(name: str, tree: Any, *, fix: str) -> None:
    """Refuses a pytree whose values differ between processes (e.g. initial params drawn
    from a per-process seed: data-parallel replicas would then train apart).

    Compares :func:`fingerprint` of ``tree`` across processes through the coordination
    service (no collective); a no-op in one process.

    Args:
      name: what ``tree`` is, for the message (e.g. ``'the initial params'``).
      tree: the values every process must hold alike.
      fix: how to make them alike, for the message.

    Raises:
      ValueError: on every process, naming the processes that differ from process 0.
    """
    import jax

    if jax.process_count() == 1:
        return
    mine = fingerprint(tree)
    digests = exchange(f"same/{name}", mine)
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"jaxcomm: {name} differ between processes: processes {differ} hold other values "
            f"than process 0, so their replicas would train apart. {fix}"
        )
