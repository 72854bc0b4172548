"""The LM train step of the experiment: GPT split, next-byte loss, AdamW, held-out loss.

The model (``jaxcomm.models.gpt``) is split into its parameters and an empty model state
(``nnx.split(model, nnx.Param, nnx.BatchStat)``: a GPT has no batch statistics), so the
step is ``experiments.step.build_step``'s, the same ``jaxcomm.data_parallel`` call as the
ResNet's. The loss is the mean next-byte cross-entropy in nats; bits per byte is that over
``ln 2`` (one token is one byte). The optimizer is GPT-2's recipe at small scale: AdamW
(beta2 0.95, weight decay 0.01 on every parameter, so the transforms need no mask that a
sharded layout would have to carry), linear warm-up then cosine decay, with
``jaxcomm.sync_gradients`` first in the chain.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners", 2019.
  Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from experiments.step import DTYPES, ModelParts, Workload
from experiments.text import TextWindows, load_corpus
from jaxcomm.models import gpt, initialize

__all__ = [
    "bits_per_byte",
    "evaluate",
    "make_loss_fn",
    "make_model",
    "make_optimizer",
    "schedule",
    "workload",
]

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01


@functools.lru_cache(maxsize=4)
def make_model(name: str, *, context: int, dtype: str = "float32", seed: int = 0) -> ModelParts:
    """Builds ``jaxcomm.models.gpt(name, context=context)`` split into :class:`ModelParts`
    (``batch_stats`` empty). Cached and compiled, as ``experiments.step.make_model``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}.")

    def create():
        model = gpt(name, dtype=DTYPES[dtype], seed=seed, context=context)
        return nnx.split(model, nnx.Param, nnx.BatchStat)

    graphdef = nnx.eval_shape(create)[0]
    _, params, model_state = initialize(create)
    return ModelParts(graphdef, params, model_state)


def next_byte_loss(graphdef: Any, params: Any, model_state: Any, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of bytes ``1 ..`` of each row given the bytes before them."""
    model = nnx.merge(graphdef, params, model_state, copy=True)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_loss_fn(graphdef: Any) -> Callable:
    """``loss_fn(params, model_state, batch) -> (loss, (model_state, metrics))`` for
    ``experiments.step.build_step``: the next-byte loss of ``batch['tokens']``, the model
    state passed through; ``metrics`` holds the bits per byte."""

    def loss_fn(params, model_state, batch):
        loss = next_byte_loss(graphdef, params, model_state, batch["tokens"])
        return loss, (model_state, {"bits_per_byte": loss / math.log(2)})

    return loss_fn


def bits_per_byte(loss_nats: float) -> float:
    """A byte-level loss in nats as bits per byte."""
    return loss_nats / math.log(2)


def schedule(*, lr: float, warmup: int, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``lr``, then cosine decay to ``lr / 10``."""
    warmup = max(0, min(warmup, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(total_steps, warmup + 1), end_value=lr / 10
    )


def make_optimizer(
    sync_kwargs: Mapping[str, Any] | None,
    lr: optax.ScalarOrSchedule,
    *,
    local: Mapping[str, Any] | None = None,
) -> optax.GradientTransformation:
    """``chain(sync_gradients(**sync_kwargs), adamw)``; ``sync_kwargs=None``: no sync (the
    compute-only twin); ``local``: ``jaxcomm.local_sgd(adamw, **local)`` with the rows'
    ``algorithm`` and ``topology`` carried to its outer sync (as
    ``experiments.step.make_optimizer``)."""
    inner = optax.adamw(lr, b1=BETAS[0], b2=BETAS[1], weight_decay=WEIGHT_DECAY)
    if sync_kwargs is not None and local is not None:
        carried = {k: sync_kwargs[k] for k in ("algorithm", "topology") if k in sync_kwargs}
        return jaxcomm.local_sgd(inner, **{**carried, **local})
    if sync_kwargs is None:
        return inner
    return optax.chain(jaxcomm.sync_gradients(**dict(sync_kwargs)), inner)


@functools.lru_cache(maxsize=8)
def _eval_fn(graphdef: Any, mesh: Any) -> Callable:
    axes = tuple(mesh.axis_names)

    def local(params, model_state, tokens):  # each device its rows, then the mean
        return lax.pmean(next_byte_loss(graphdef, params, model_state, tokens), axes)

    specs = dict(in_specs=(P(), P(), P(axes)), out_specs=P())
    mapped = jax.shard_map(local, mesh=mesh, **specs)
    whole = NamedSharding(mesh, P())

    def fn(params, model_state, tokens):
        # params stored split over a node (shard_params=True) are gathered for the eval
        params = jax.tree.map(lambda x: jax.reshard(x, whole), params)
        return mapped(params, model_state, tokens)

    return jax.jit(fn)


def evaluate(
    parts: ModelParts, params: Any, data: TextWindows, *, batches: int, start: int = 0
) -> float:
    """Mean next-byte loss (nats) of ``params`` over batches ``start .. start+batches-1``
    of ``data`` (the held-out windows; placed with the step's batch sharding), each device
    on its rows of every batch, averaged over the mesh."""
    fn = _eval_fn(parts.graphdef, data.sharding.mesh)
    losses = [
        float(fn(params, parts.batch_stats, data.batch(p)["tokens"]))
        for p in range(start, start + batches)
    ]
    return float(np.mean(losses))


def _parts(preset: Any, seed: int) -> ModelParts:
    return make_model(preset.model, context=preset.context, dtype=preset.dtype, seed=seed)


def _batch(preset: Any, sharding: Any, global_batch: int, seed: int) -> Any:
    data = TextWindows(load_corpus().train, sharding, global_batch=global_batch,
                       context=preset.context, seed=seed)  # fmt: skip
    return data.batch(0)


def workload(context: int) -> Workload:
    """The LM as the ablation's :class:`experiments.step.Workload`; its rate column counts
    tokens (``context`` per sequence)."""
    return Workload(
        make_parts=_parts,
        loss_fn=make_loss_fn,
        schedule=lambda preset, global_batch: schedule(
            lr=preset.lr, warmup=preset.lr_warmup, total_steps=preset.steps
        ),
        optimizer=make_optimizer,
        batch=_batch,
        unit="tokens",
        rate_scale=context,
    )
