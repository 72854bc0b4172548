"""Flax's mixed-precision loss scaling with the gradient mean left to ``sync_gradients``.

Flax's ``DynamicScale.value_and_grad(loss_fn, axis_name='batch')`` averages the gradients
itself (``lax.pmean``, flat and in f32) and then decides from the mean whether the step is
finite. In a jaxcomm step the mean belongs to ``jaxcomm.sync_gradients`` in the optimizer
(hierarchical, compressed), and gradients averaged before it are refused. This
:class:`DynamicScale` is Flax's with one change inside a jaxcomm step: each device keeps its
own gradients, and the finiteness decision is reduced over ``axis_name`` (a ``pmin`` of one
flag per device), so every device takes the same decision: the step is finite if every
device's gradients are, which is when their mean is (barring an overflow of the sum of
finite values, which an fp16 sync catches and skips by itself). Outside a jaxcomm step (under
``jax.pmap``) it is Flax's class unchanged, so one script runs under both.

Port: ``from flax.training import dynamic_scale as dynamic_scale_lib`` becomes
``from jaxcomm import dynamic_scale as dynamic_scale_lib``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import dynamic_scale as flax_dynamic_scale
from jax import lax

from jaxcomm import axis_names

__all__ = ["DynamicScale", "DynamicScaleResult"]

DynamicScaleResult = flax_dynamic_scale.DynamicScaleResult


class DynamicScale(flax_dynamic_scale.DynamicScale):
    """Flax's ``DynamicScale`` whose gradient mean is ``jaxcomm.sync_gradients``'s inside a
    jaxcomm step (see the module docstring); the fields and defaults are Flax's.

    Example:
      >>> state = TrainState.create(..., dynamic_scale=jaxcomm.dynamic_scale.DynamicScale())
      >>> grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name='batch')
      >>> dynamic_scale, is_fin, aux, grads = grad_fn(state.params)  # grads: this device's
    """

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """Flax's ``value_and_grad``; inside a jaxcomm step with ``axis_name``, the
        gradients stay per device and the finiteness decision is reduced over the axis.

        Args:
          fun, argnums, has_aux: as ``jax.value_and_grad``.
          axis_name: the data axis (bound by the jaxcomm step's ``axis_name=``).

        Returns:
          A function returning ``DynamicScaleResult(dynamic_scale, finite, aux, grad)``;
          ``finite`` and the new scale are the same on every device.
        """
        base = flax_dynamic_scale.DynamicScale.value_and_grad
        if axis_name is None or not axis_names.active():
            return base(self, fun, argnums, has_aux, axis_name)
        local = base(self, fun, argnums, has_aux, None)  # no mean: the sync does it

        def grad_fn(*args):
            out = local(*args)
            flags = jnp.asarray(out.finite, jnp.int32)
            finite = lax.pmin(flags, axis_name) > 0  # one decision on every device
            return DynamicScaleResult(self._advance(finite), finite, out.aux, out.grad)

        return grad_fn

    def _advance(self, finite: jax.Array) -> DynamicScale:
        """The next scale and count of finite steps, as Flax computes them."""
        grow = self.fin_steps == self.growth_interval
        fin_scale = jnp.where(
            grow & finite,
            jnp.minimum(self.scale * self.growth_factor, jnp.finfo(jnp.float32).max),
            self.scale,
        )
        inf_scale = self.scale * self.backoff_factor
        if self.minimum_scale is not None:
            inf_scale = jnp.maximum(inf_scale, self.minimum_scale)
        new_scale = jnp.where(finite, fin_scale, inf_scale)
        new_fin_steps = jnp.where(grow | (~finite), 0, self.fin_steps + 1)
        return self.replace(fin_steps=new_fin_steps, scale=new_scale)
