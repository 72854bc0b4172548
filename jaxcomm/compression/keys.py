"""Every key and seed of the gradient sync, in one place: integer hashes, no threefry.

A sync needs randomness that differs per step, device, buffer and phase and looks
independent (stochastic rounding, top-k's sample, random-k's shared indices, the error
sketch's signs), the same on every device where it must be shared. ``jax.random``'s
``fold_in``/``split`` run threefry (20 rounds) per derived key; here every derivation is
``lowbias32`` (Wellons, "Prospecting for hash functions", 2018), a bijection on uint32:

1. :func:`step_key`: the step's key, from the sync's seed and its step count (the same on
   every device: ``ReduceContext.key``);
2. :func:`dither_seed`: a uint32 seed from a key and salts (device, buffer, phase);
   :func:`two_phase_seeds` those of a two-phase mean;
3. :func:`seeded_uniform` / :func:`uniform_dither`: uniform ``[0, 1)`` values, one hash
   per element;
4. per buffer, what a codec draws from (``BufferCodec.seeds``): :func:`no_seeds`,
   :func:`device_seeds` (top-k's sample), :func:`two_phase_buffer_seeds` (int8/int4's
   dither), :func:`shared_keys` (random-k's positions, the same on every device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "device_seeds",
    "dither_seed",
    "lowbias32",
    "no_seeds",
    "seeded_uniform",
    "shared_keys",
    "step_key",
    "two_phase_buffer_seeds",
    "two_phase_seeds",
    "uniform_dither",
]


def lowbias32(h: jax.Array) -> jax.Array:
    """An integer hash with a low avalanche bias on uint32 (Wellons, "Prospecting for hash
    functions", 2018: the ``lowbias32`` constants); a bijection on uint32."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def step_key(seed: int, step: jax.Array) -> jax.Array:
    """The PRNG key of ``sync_gradients``' step ``step`` (:attr:`ReduceContext.key`).

    The words of ``jax.random.key(seed)`` (no generator runs) each hashed with the step
    and their lane: ``w_l = lowbias32(lowbias32(w_l ^ lowbias32(step ^ 0x9E3779B9)) ^ l)``,
    wrapped as a key of the default implementation. ``jax.random.fold_in`` would run
    threefry (20 rounds), which XLA:CPU compiles into a few scalar kernels of its own in
    every compressed sync; a key only needs words that differ per step and look
    independent, and whatever draws from it (``jax.random`` or
    :func:`~jaxcomm.compression.keys.dither_seed`) mixes them further.

    Args:
      seed: ``sync_gradients``' seed.
      step: int32 scalar, the number of synchronised steps before this one.

    Returns:
      A PRNG key (``jax.random.key``'s implementation), the same on every device.
    """
    base = jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)
    mix = lowbias32(jnp.asarray(step).astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    lanes = lax.iota(jnp.uint32, base.size).reshape(base.shape)
    return jax.random.wrap_key_data(lowbias32(lowbias32(base ^ mix) ^ lanes))


def dither_seed(key: jax.Array, *salts: int | jax.Array) -> jax.Array:
    """A uint32 dither seed from a PRNG key and integer salts (device, buffer, phase).

    Also top-k's sample offset (``sparse.select_topk``) and the error sketch's signs
    (``adaptive.error_of_mean``): any per-device, per-step scalar that only has to look
    random.

    1. ``h = lowbias32(w0 ^ lowbias32(w1 ^ 0x9E3779B9))`` over the key's raw words
       (``jax.random.key_data``: no generator runs);
    2. ``h = lowbias32(h ^ s)`` for each salt ``s`` in order.

    ``jax.random.fold_in``/``split``/``bits`` run threefry (20 rounds) for each derived
    key: on XLA:CPU a few scalar kernels each. A dither only needs seeds that differ per
    device, buffer and phase and look independent; ``lowbias32`` is a bijection on
    uint32, so distinct salts give distinct seeds, and the per-element hash of
    :func:`uniform_dither` decorrelates the streams.

    Args:
      key: a PRNG key (``jax.random.key`` or a raw ``uint32`` key).
      *salts: ints or integer scalars (e.g. ``lax.axis_index``), at most ``2**32 - 1``.

    Returns:
      uint32 scalar.
    """
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    h = jnp.uint32(0x9E3779B9)  # the golden ratio's bits: a nonzero start for a zero key
    for w in words[::-1]:
        h = lowbias32(w ^ h)
    for s in salts:
        h = lowbias32(h ^ jnp.asarray(s).astype(jnp.uint32))
    return h


def two_phase_seeds(key: jax.Array, *salts: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """The dither seeds of :func:`two_phase_mean`'s two phases: ``dither_seed(key, *salts,
    phase)`` for phase 1 and 2 (salts: the device's index and the buffer's)."""
    return dither_seed(key, *salts, 1), dither_seed(key, *salts, 2)


def seeded_uniform(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """:func:`uniform_dither`'s steps 2-3 from a :func:`dither_seed` (uint32 scalar)."""
    n = int(np.prod(shape))
    if n > 2**32:
        raise ValueError(f"uniform_dither: {n} elements; at most 2**32 have distinct indices.")
    index = lax.iota(jnp.uint32, n).reshape(shape)
    h = lowbias32(lowbias32(index) ^ seed)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def uniform_dither(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform ``[0, 1)`` f32 values for stochastic rounding: one integer hash per element.

    ``jax.random.uniform`` (threefry, 20 rounds per pair of words) costs more than the
    blockwise quantization it serves, on GPU and CPU alike. Stochastic rounding needs
    values that are uniform and independent of the data, not a cryptographic stream, so
    each element hashes its index with a seed drawn once from ``key``; the hash fuses into
    the quantization kernel.

    1. ``seed = dither_seed(key)``: the key's raw words hashed, one uint32 per call.
    2. ``h = lowbias32(lowbias32(index) ^ seed)`` for each element's flat index.
    3. The top 24 bits of ``h`` times ``2**-24``: exact f32 multiples of ``2**-24`` in
       ``[0, 1)``, so ``floor(v + u)`` is unbiased to within ``2**-24``.

    Args:
      key: a PRNG key (per device and step in the compressors).
      shape: the output shape; at most ``2**32`` elements.

    Returns:
      f32 array of ``shape``.

    Example:
      >>> u = uniform_dither(jax.random.key(0), (4, 256))
    """
    return seeded_uniform(dither_seed(key), shape)


# -- per buffer: BufferCodec.seeds ---------------------------------------------------------
# Each takes the sync's ReduceContext (its ``key``, the same on every device, and its
# ``axes``) and the number of buffers, and returns one operand per buffer. Module-level
# functions, so that codecs drawing alike share one function and a switch over codecs
# (``adaptive``) hashes each kind once, before its branches.


def no_seeds(ctx, n: int) -> list[None]:
    """No randomness: ``None`` per buffer."""
    del ctx
    return [None] * n


def device_seeds(ctx, n: int) -> list[jax.Array]:
    """A uint32 seed per buffer, different on every device: ``dither_seed(key, device, i)``."""
    device = lax.axis_index(ctx.axes)
    return [dither_seed(ctx.key, device, i) for i in range(n)]


def two_phase_buffer_seeds(ctx, n: int) -> list[tuple[jax.Array, jax.Array]]:
    """The two phases' dither seeds per buffer, different on every device."""
    device = lax.axis_index(ctx.axes)
    return [two_phase_seeds(ctx.key, device, i) for i in range(n)]


def shared_keys(ctx, n: int) -> list[jax.Array]:
    """A key per buffer, the same on every device (shared positions). ``jax.random``
    keys: ``random_k_mean`` draws its positions with ``jax.random.randint``."""
    return [jax.random.fold_in(ctx.key, i) for i in range(n)]
