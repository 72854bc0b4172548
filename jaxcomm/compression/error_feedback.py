"""Error feedback (EF): what a lossy compressor did not send is added to the next step.

With per-device residual ``e`` (zero at first), each step sends ``C(g + e)`` and keeps
``e <- g + e - C(g + e)``. Summed over steps, *transmitted + residual = true gradient sum*,
so nothing is dropped, only delayed; this is what lets biased compressors (top-k,
PowerSGD) converge like SGD.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
  Distributed Training of Speech DNNs" (Interspeech 2014);
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
  Schemes" (ICML 2019); Lin et al., "Deep Gradient Compression" (ICLR 2018).

The residual differs per device, so it is wrapped in ``jaxcomm.PerDevice``: sharded along
the data axes, never replicated, and part of the optimizer state and so of every
checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm.state import PerDevice

__all__ = ["corrected", "init_residuals", "new_residuals"]


def init_residuals(specs: Sequence[Any]) -> PerDevice:
    """Zero f32 residuals shaped like ``specs``, marked per device."""
    return PerDevice(tuple(jnp.zeros(jnp.shape(s), jnp.float32) for s in specs))


def corrected(xs: Sequence[jax.Array], residuals: PerDevice | None) -> list[jax.Array]:
    """``g + e`` in f32 (``g`` alone when there is no residual)."""
    if residuals is None:
        return [jnp.asarray(x).astype(jnp.float32) for x in xs]
    return [
        jnp.asarray(x).astype(jnp.float32) + e for x, e in zip(xs, residuals.value, strict=True)
    ]


def new_residuals(corrected_xs: Sequence[jax.Array], transmitted: Sequence[jax.Array]) -> PerDevice:
    """``e <- (g + e) - C(g + e)``: what this device meant to send but did not."""
    return PerDevice(tuple(c - t for c, t in zip(corrected_xs, transmitted, strict=True)))
