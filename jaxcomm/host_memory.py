"""Host memory of XLA:CPU buffers: freed memory kept for reuse, not returned to the kernel.

XLA:CPU allocates every buffer of a program with the C library's ``malloc``. glibc serves a
request above its mmap threshold (dynamic, at most 32 MiB on 64-bit Linux) with a fresh
``mmap`` and gives it back with ``munmap`` when the buffer is freed; the other threads'
arenas (XLA runs a process's devices on a thread pool) give back empty heaps the same way.
So every step's large buffers (a packed 47 MB gradient, its quantized and decoded copies)
are new pages, which the kernel zero-fills and faults in on first touch: an elementwise
kernel over such buffers then spends most of its time in page faults (system time), and
with freed memory kept it faults no page (docs/benchmarks.md has the figures). A GPU never
pays this (XLA takes device buffers from its BFC pool), so on a CPU emulation of a GPU
cluster (``jaxcomm.tools.testbed``, fake devices) it is overhead that the modelled cluster does
not have, and on real CPU training it is overhead nobody wants.

The policy is three glibc tunables (``mallopt(3)``, or the ``MALLOC_*_`` environment
variables a new process reads):

1. ``M_ARENA_MAX = 1``: every thread allocates from the main arena, whose heap only grows
   (the other arenas' heaps are at most 64 MiB and are unmapped when empty).
2. ``M_MMAP_MAX = 0``: no allocation is served by its own ``mmap``.
3. ``M_TRIM_THRESHOLD`` = 2 GiB - 1 (``mallopt``'s largest value): the top of the heap
   is given back only when more than that is free.

The process keeps its peak footprint until it exits (what a GPU's pool does too).
Where the C library is not glibc the functions change nothing and say so.

Example:
  >>> import jaxcomm.host_memory as hm
  >>> hm.keep_freed_memory()      # before the first JAX computation of this process
  True
  >>> env = {**os.environ, **hm.reuse_env()}   # a process started by a launcher
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["ENV_SWITCH", "REUSE_ENV", "keep_freed_memory", "reuse_env"]

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_BYTES = 2**31 - 1

# The same policy for a process about to start (glibc reads these at its first malloc).
REUSE_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(_TRIM_BYTES),
}
# 0: glibc's defaults in the processes jaxcomm starts (an A/B of the policy); 1 or unset: the
# policy; anything else is refused.
ENV_SWITCH = "JAXCOMM_KEEP_FREED_MEMORY"


def _wanted() -> bool:
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{ENV_SWITCH}={value!r} is not one of ['0', '1']; set 0 to keep glibc's "
            "defaults, 1 (or leave it unset) to keep freed memory for reuse."
        )
    return value == "1"


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def reuse_env() -> dict[str, str]:
    """The environment variables that give a new process this module's policy.

    Returns:
      :data:`REUSE_ENV`, or ``{}`` when ``JAXCOMM_KEEP_FREED_MEMORY=0`` is set (the
      launchers then start their processes with glibc's defaults).

    Raises:
      ValueError: ``JAXCOMM_KEEP_FREED_MEMORY`` is set to neither ``0`` nor ``1``.
    """
    return dict(REUSE_ENV) if _wanted() else {}


def keep_freed_memory() -> bool:
    """Applies the policy to this process through ``mallopt(3)``.

    Call it before this process's first JAX computation: the threads that run XLA:CPU's
    programs start with the CPU client and pick their arena at their first allocation;
    threads that allocated before the call keep theirs. Nothing is changed when
    ``JAXCOMM_KEEP_FREED_MEMORY=0`` is set.

    Returns:
      ``True`` when all three settings took effect; ``False`` when the C library is not
      glibc, the switch is off, or ``mallopt`` refused a setting.

    Raises:
      ValueError: ``JAXCOMM_KEEP_FREED_MEMORY`` is set to neither ``0`` nor ``1``.
    """
    libc = _glibc() if _wanted() else None
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_BYTES))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
