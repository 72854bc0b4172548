"""Process set-up that must happen before, or right after, JAX starts.

* :func:`ensure_cpu_devices` gives a CPU-only run several fake devices (so the
  ``('inter', 'intra')`` mesh has two levels), by adding
  ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` *before* JAX is imported.
  The flag only shapes the host platform: on a GPU node JAX still picks the GPUs.
* :func:`init_distributed` joins a multi-process job (``jaxcomm.launch``, the testbed,
  SLURM, Open MPI) through ``jax.distributed`` when the environment asks for one.
"""

from __future__ import annotations

import os

__all__ = ["distributed_requested", "ensure_cpu_devices", "init_distributed"]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def ensure_cpu_devices(count: int = 8) -> int | None:
    """Adds ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` if it is not set.

    Under ``jaxcomm.launch`` or the testbed (``JAXCOMM_LOCAL_DEVICES`` set) it does nothing:
    :func:`init_distributed` gives the process its devices. Must run before JAX is
    imported; afterwards it changes nothing.

    Returns:
      The device count set, or ``None`` when it left ``XLA_FLAGS`` as it was.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG in flags or os.environ.get("JAXCOMM_LOCAL_DEVICES"):
        return None
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={count}".strip()
    return count


def distributed_requested() -> bool:
    """Whether the environment describes a multi-process job."""
    env = os.environ
    if env.get("JAXCOMM_COORDINATOR"):
        return True
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if int(env.get(key, "1") or 1) > 1:
            return True
    return False


def init_distributed() -> bool:
    """Starts ``jax.distributed`` when the environment asks for it.

    Uses ``jaxcomm.init_distributed()`` when this jaxcomm has it (the profiler/launcher
    issue); otherwise ``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES``,
    ``JAXCOMM_PROCESS_ID`` (and ``JAXCOMM_LOCAL_DEVICES`` CPU devices) if set, else
    ``jax.distributed.initialize()``'s own detection (SLURM, Open MPI).

    Returns:
      ``True`` when a distributed runtime was started.
    """
    if not distributed_requested():
        return False
    import jax

    import jaxcomm

    if hasattr(jaxcomm, "init_distributed"):
        jaxcomm.init_distributed()
    elif os.environ.get("JAXCOMM_COORDINATOR"):
        if os.environ.get("JAXCOMM_LOCAL_DEVICES"):
            jax.config.update("jax_num_cpu_devices", int(os.environ["JAXCOMM_LOCAL_DEVICES"]))
        jax.distributed.initialize(
            coordinator_address=os.environ["JAXCOMM_COORDINATOR"],
            num_processes=int(os.environ["JAXCOMM_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXCOMM_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True
