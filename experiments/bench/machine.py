"""What a benchmark's JSON records about the machine it ran on, and its load."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax

__all__ = ["describe"]


def describe() -> dict[str, Any]:
    """The machine, its CPU count and 1-minute load average, and JAX's backend and devices.

    Example:
      >>> res |= describe()
    """
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }
