"""The hash dither behind stochastic rounding: uniform, key-dependent, unbiased rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compression.keys import uniform_dither
from jaxcomm.compression.quantize import quantize

N = 1 << 18


def test_uniform_dither_is_uniform_on_unit_interval():
    u = np.asarray(uniform_dither(jax.random.key(0), (N,)))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    # Chi-square over 64 equal bins: 63 degrees of freedom, p = 1e-6 at about 125.
    counts = np.histogram(u, bins=64, range=(0.0, 1.0))[0]
    chi2 = float(np.sum((counts - N / 64) ** 2 / (N / 64)))
    assert chi2 < 125, chi2
    # Neighbouring elements are uncorrelated (6 sigma of sqrt(1/N)).
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 6 / np.sqrt(N)


def test_uniform_dither_depends_on_key_and_shape():
    a = np.asarray(uniform_dither(jax.random.key(1), (N,)))
    b = np.asarray(uniform_dither(jax.random.key(2), (N,)))
    assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(N)
    assert (a == b).mean() < 1e-3
    again = np.asarray(uniform_dither(jax.random.key(1), (N,)))
    np.testing.assert_array_equal(a, again)  # reproducible from the key
    np.testing.assert_array_equal(
        np.asarray(uniform_dither(jax.random.key(1), (N // 256, 256))).reshape(-1), a
    )


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9])
def test_stochastic_rounding_with_the_dither_is_unbiased(frac):
    """E[floor(v + u)] = v: the mean of N roundings of v within 5 sigma of v."""
    v = jnp.full((N,), 3.0 + frac, jnp.float32)
    r = np.asarray(jnp.floor(v + uniform_dither(jax.random.key(7), v.shape)))
    sigma = np.sqrt(frac * (1 - frac) / N)
    assert abs(r.mean() - (3.0 + frac)) < 5 * sigma
    assert set(np.unique(r)) == {3.0, 4.0}


def test_int8_stochastic_quantization_is_unbiased_per_element():
    """Averaged over keys, dequantized stochastic int8 equals the input (not rounded)."""
    x = jax.random.normal(jax.random.key(3), (1, 1024), jnp.float32)

    def deq(k):
        q, s = quantize(x, 8, 256, k)
        return q.astype(jnp.float32).reshape(1, 4, 256) * s[..., None]

    keys = jax.random.split(jax.random.key(4), 2000)
    mean = np.asarray(jnp.mean(jax.vmap(deq)(keys), axis=0)).reshape(1, 1024)
    nearest = quantize(x, 8, 256, None)
    step = float(jnp.max(nearest[1]))  # the largest quantization step
    # Nearest rounding is off by up to step/2; the stochastic mean within 5 sigma of x
    # (per-element variance at most step^2/4 over 2000 draws).
    assert np.max(np.abs(mean - np.asarray(x))) < 5 * step / 2 / np.sqrt(2000)
