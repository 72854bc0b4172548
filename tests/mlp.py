"""A small tanh MLP classifier shared by the train-step tests (not a test module)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def mlp_init(key, sizes=(12, 32, 3)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, (a, b) in zip(keys, itertools.pairwise(sizes), strict=True)
    ]


def mlp_logits(params, x):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h


def mlp_loss(params, batch):
    """Mean negative log-likelihood over the local batch."""
    logp = jax.nn.log_softmax(mlp_logits(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], 1))


def mlp_batches(n: int, *, seed: int = 0, size: int = 16) -> list[dict]:
    """``n`` random global batches of ``size`` examples for :func:`mlp_loss` (12 features,
    3 classes)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 12)).astype(np.float32),
            "y": rng.integers(0, 3, size).astype(np.int32),
        }
        for _ in range(n)
    ]
