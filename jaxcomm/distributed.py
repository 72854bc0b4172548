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
"""

from __future__ import annotations

import collections
import os
import re
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


def init_distributed(
    *,
    collective_timeout_s: int = 45,
    heartbeat_timeout_s: int = 20,
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


def _client() -> Any:
    """The ``jax.distributed`` coordination client, or ``None`` in a one-process job.

    JAX keeps it in ``jax._src.distributed.global_state`` (its own checkpointing reaches
    it the same way); jaxcomm reads it here only.
    """
    import jax

    if jax.process_count() == 1:
        return None
    from jax._src import distributed

    return distributed.global_state.client


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
        client.wait_at_barrier(_unique(f"barrier/{name}"), timeout_in_ms=int(timeout_s * 1000))


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
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    client.wait_at_barrier(f"{key}/posted", timeout_in_ms=int(timeout_s * 1000))
    return [
        client.blocking_key_value_get(f"{key}/{i}", int(timeout_s * 1000))
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

    if jax.process_count() == 1 or _client() is None:
        return
    mine = fingerprint(tree)
    digests = exchange(f"same/{name}", mine)
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"jaxcomm: {name} differ between processes: processes {differ} hold other values "
            f"than process 0, so their replicas would train apart. {fix}"
        )
