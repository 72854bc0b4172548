"""The ResNet train step of the experiment: model, loss, optimizer, data-parallel step.

The model is split into parameters and batch statistics
(``nnx.split(model, nnx.Param, nnx.BatchStat)``); the statistics travel as model state
through ``jaxcomm.data_parallel(..., with_model_state=True)``, which averages them across
devices every step (synchronised batch norm at step granularity). The optimizer is the
ResNet recipe (Goyal et al., 2017): SGD with Nesterov momentum 0.9, weight decay 1e-4, a
peak learning rate of ``lr x global_batch / 256`` reached by linear warm-up, then cosine
decay, with ``jaxcomm.sync_gradients`` first in the chain.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
  Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import jaxcomm
from jaxcomm.models import initialize, resnet

__all__ = [
    "DTYPES",
    "RESNET",
    "ModelParts",
    "Workload",
    "build_step",
    "learning_rate",
    "make_loss_fn",
    "make_model",
    "make_optimizer",
]

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
WEIGHT_DECAY = 1e-4
MOMENTUM = 0.9


class ModelParts(NamedTuple):
    """A split NNX model: static graph, trainable params, batch statistics."""

    graphdef: Any
    params: Any
    batch_stats: Any


@functools.lru_cache(maxsize=4)
def make_model(name: str, num_classes: int, *, dtype: str = "float32", seed: int = 0):
    """Builds ``jaxcomm.models.resnet(name)`` and splits it into :class:`ModelParts`.

    Cached: the ablation rows, the training run and the tests share one initialisation.
    The arrays are never donated (:func:`build_step` places copies on the mesh).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}.")

    def create():
        return nnx.split(resnet(name, num_classes, dtype=DTYPES[dtype], seed=seed),
                         nnx.Param, nnx.BatchStat)  # fmt: skip

    # One compiled initialiser (jaxcomm.models.initialize) instead of hundreds of eagerly
    # dispatched ops; the values are the same as eager construction.
    graphdef = nnx.eval_shape(create)[0]
    _, params, batch_stats = initialize(create)
    return ModelParts(graphdef, params, batch_stats)


def make_loss_fn(graphdef: Any) -> Callable:
    """``loss_fn(params, batch_stats, batch) -> (loss, (new_batch_stats, metrics))``.

    Mean softmax cross-entropy over the local batch, in training mode (batch norm uses and
    updates the batch statistics); ``metrics`` holds the local top-1 accuracy.
    """

    def loss_fn(params, batch_stats, batch):
        # copy=True: the statistics arrive from the enclosing shard_map trace and are
        # updated inside the grad trace; NNX refuses to mutate variables across traces.
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(batch["image"])
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        _, _, new_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
        return loss, (new_stats, {"accuracy": accuracy})

    return loss_fn


def sync_only_loss_fn(params, batch_stats, batch):
    """A loss whose gradient costs one elementwise pass: the row's sync without the model.

    ``s * sum(|p|^2)``, ``s`` from the device's batch (the mean of its last leaf: an image
    batch's labels, a text batch's tokens), so the gradient ``2 s p`` has each parameter's
    shape and differs between devices, as a model's does; the batch statistics pass
    through unchanged. The ablation times the row's optimizer (its sync) on it.
    """
    s = 1.0 + jnp.mean(jax.tree.leaves(batch)[-1].astype(jnp.float32))
    loss = s * sum(jnp.vdot(p, p) for p in jax.tree.leaves(params))
    return loss, (batch_stats, {})


def learning_rate(*, lr: float, global_batch: int, warmup: int, total_steps: int) -> optax.Schedule:
    """Linear warm-up to ``lr x global_batch / 256``, then cosine decay to 0."""
    peak = lr * global_batch / 256
    warmup = max(0, min(warmup, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        0.0 if warmup else peak, peak, warmup, max(total_steps, warmup + 1)
    )


def make_optimizer(
    sync_kwargs: Mapping[str, Any] | None,
    schedule: optax.ScalarOrSchedule,
    *,
    extra: Sequence[optax.GradientTransformation] = (),
    local: Mapping[str, Any] | None = None,
) -> optax.GradientTransformation:
    """The experiment's optimizer.

    Args:
      sync_kwargs: keyword arguments of ``jaxcomm.sync_gradients``; ``None`` leaves the
        gradients unsynchronised (the compute-only twin that the ablation times).
      schedule: learning rate or schedule.
      extra: transforms inserted right after the synchronisation (tests use this to add
        per-device state).
      local: ``jaxcomm.local_sgd`` keyword arguments with a numeric ``sync_every``: the
        optimizer below becomes its inner optimizer (``sync_kwargs``' ``algorithm`` and
        ``topology`` carry over; its other settings do not apply to the outer sync).

    Returns:
      ``optax.chain(sync_gradients(**sync_kwargs), *extra, add_decayed_weights, sgd)``,
      or with ``local``: ``local_sgd(chain(*extra, add_decayed_weights, sgd), **local)``.
    """
    inner = [
        optax.add_decayed_weights(WEIGHT_DECAY),
        optax.sgd(schedule, momentum=MOMENTUM, nesterov=True),
    ]
    if sync_kwargs is not None and local is not None:
        # Local steps: the experiment's optimizer runs on each device's own params, and
        # the outer sync reduces with the rows' algorithm on their topology.
        carried = {k: sync_kwargs[k] for k in ("algorithm", "topology") if k in sync_kwargs}
        return jaxcomm.local_sgd(optax.chain(*extra, *inner), **{**carried, **local})
    head = [] if sync_kwargs is None else [jaxcomm.sync_gradients(**dict(sync_kwargs))]
    return optax.chain(*head, *extra, *inner)


def drives_adaptive(sync_kwargs: Mapping[str, Any] | None, adapt_windows: int) -> bool:
    """Whether a step with these ``sync_gradients`` arguments runs under
    ``jaxcomm.CommProfiler.drive``: it has an adaptive compressor and the preset asks for
    driven windows. Such a step is built with ``donate=False`` (drive runs the state it is
    given several times)."""
    compression = (sync_kwargs or {}).get("compression")
    return adapt_windows > 0 and compression is not None and compression.name.startswith("adaptive")


def build_step(
    parts: ModelParts,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    compiler_options: Mapping[str, Any] | None = None,
    compute_only: bool = False,
    sync_only: bool = False,
    donate: bool = True,
    loss_fn: Callable | None = None,
    layout: Mapping[str, Any] | None = None,
) -> tuple[jaxcomm.DataParallel, jaxcomm.TrainState]:
    """Builds the data-parallel step and its initial state on ``mesh``.

    Args:
      parts: from :func:`make_model` (or a :class:`Workload`'s ``make_parts``).
      optimizer: from :func:`make_optimizer`.
      mesh: from ``jaxcomm.make_mesh``.
      compiler_options: XLA options for the step.
      compute_only: the optimizer has no ``sync_gradients`` (a timing twin); each device
        then applies its own gradient.
      sync_only: the model's loss is replaced by :func:`sync_only_loss_fn`: the step is the
        optimizer and its sync on gradients of the params' shapes, no model.
      donate: donate the input state's buffers (the state is never reused).
      loss_fn: the model's loss, ``loss_fn(params, model_state, batch) -> (loss,
        (model_state, metrics))`` (default: the ResNet's, :func:`make_loss_fn`).
      layout: more ``jaxcomm.data_parallel`` keyword arguments: where the state lives
        (an ablation row's ``data_parallel``, e.g. ``shard_params=True``).

    Returns:
      ``(dp, state)``.
    """
    model_loss = make_loss_fn(parts.graphdef) if loss_fn is None else loss_fn
    dp = jaxcomm.data_parallel(
        sync_only_loss_fn if sync_only else model_loss,
        optimizer,
        mesh,
        with_model_state=True,
        compiler_options=compiler_options,
        donate=donate,
        require_sync=not compute_only,
        **dict(layout or {}),
    )
    # Host copies: dp.init may alias the device buffers it is given, and a donating step
    # would then delete the caller's arrays (and those of a second step built from them).
    params, batch_stats = jax.tree.map(np.array, (parts.params, parts.batch_stats))
    state = dp.init(params, batch_stats)
    return dp, state


class Workload(NamedTuple):
    """What the ablation trains: the parts of a row's step that depend on the model.

    ``experiments.ablation.run_speed`` builds every row's step, its compute-only twin and
    its sync alone from these; :data:`RESNET` is the ResNet experiment's,
    ``experiments.lm_step.workload(context)`` the LM's.

    Attributes:
      make_parts: ``(preset, seed) -> ModelParts`` (the model split; cached by the callee).
      loss_fn: ``graphdef -> loss_fn`` for :func:`build_step`.
      schedule: ``(preset, global_batch) -> optax schedule``.
      optimizer: ``(sync_kwargs, schedule, *, local=None) -> GradientTransformation``, as
        :func:`make_optimizer` (``sync_kwargs=None``: the compute-only twin's).
      batch: ``(preset, sharding, global_batch, seed) -> batch``: one global batch placed
        with the step's batch sharding.
      unit: what one element of the global batch is, for the rate column (``'images'``).
      rate_scale: units per batch element (1; an LM's tokens per sequence).
    """

    make_parts: Callable[[Any, int], ModelParts]
    loss_fn: Callable[[Any], Callable]
    schedule: Callable[[Any, int], optax.Schedule]
    optimizer: Callable[..., optax.GradientTransformation]
    batch: Callable[[Any, Any, int, int], Any]
    unit: str = "images"
    rate_scale: int = 1


def _resnet_batch(preset: Any, sharding: Any, global_batch: int, seed: int) -> Any:
    from experiments.data import SyntheticImages

    data = SyntheticImages(
        sharding,
        global_batch=global_batch,
        image_size=preset.image_size,
        num_classes=preset.num_classes,
        dtype=DTYPES[preset.dtype],
        seed=seed,
    )
    return data.batch(0)


RESNET = Workload(
    make_parts=lambda preset, seed: make_model(
        preset.model, preset.num_classes, dtype=preset.dtype, seed=seed
    ),
    loss_fn=make_loss_fn,
    schedule=lambda preset, global_batch: learning_rate(
        lr=preset.lr, global_batch=global_batch, warmup=preset.lr_warmup, total_steps=preset.steps
    ),
    optimizer=make_optimizer,
    batch=_resnet_batch,
)


def one_step_in_flight() -> bool:
    """Whether loops should wait for each step before dispatching the next.

    On XLA:CPU with fake devices, several queued executions of a program with collectives
    can deadlock the in-process rendezvous on a loaded machine (seen by the digits guard,
    ``experiments/bench/digits.py``), so CPU runs keep one step in flight. On GPUs the host
    runs ahead, as usual.
    """
    return jax.default_backend() == "cpu"


def host_mean(x: jax.Array) -> float:
    """The mean of a metric on the host: a replicated scalar, or the per-device values that
    ``jaxcomm.local_sgd`` returns (in a job of several processes, this process's devices:
    the others' are not addressable here)."""
    if x.ndim == 0:
        return float(x)
    return float(np.mean([np.asarray(s.data) for s in x.addressable_shards]))
