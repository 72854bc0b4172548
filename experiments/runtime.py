"""Process set-up that must happen before, or right after, JAX starts.

* :func:`ensure_cpu_devices` gives a CPU-only run several fake devices (so the
  ``('inter', 'intra')`` mesh has two levels), by adding
  ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` *before* JAX is imported.
  The flag only shapes the host platform: on a GPU node JAX still picks the GPUs.
* :func:`init_distributed` joins a multi-process job (``jaxcomm.tools.launch``, the testbed,
  SLURM, Open MPI) through ``jax.distributed`` when the environment asks for one.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["distributed_requested", "ensure_cpu_devices", "init_distributed", "testbed_link_bps"]

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def ensure_cpu_devices(count: int = 8) -> int | None:
    """Adds ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` if it is not set.

    Under ``jaxcomm.tools.launch`` or the testbed (``JAXCOMM_LOCAL_DEVICES`` set) it does nothing:
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


def init_distributed(**kwargs: Any) -> bool:
    """Starts ``jax.distributed`` (``jaxcomm.init_distributed(**kwargs)``) when the
    environment asks for it (``jaxcomm.tools.launch``, the testbed, SLURM, Open MPI).

    Returns:
      ``True`` when a distributed runtime was started.
    """
    if not distributed_requested():
        return False
    import jaxcomm

    jaxcomm.init_distributed(**kwargs)
    return True


def testbed_link_bps() -> float | None:
    """The emulated link rate in bit/s under ``jaxcomm.tools.testbed``, else ``None``."""
    rate = os.environ.get("JAXCOMM_TESTBED_LINK_BPS")
    return float(rate) if rate else None
