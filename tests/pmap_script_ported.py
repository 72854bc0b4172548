"""A Flax Linen training script written for ``jax.pmap`` (not a test module).

In the style of Flax's ImageNet example (``examples/imagenet/train.py`` and
``models.py``): a ResNet whose BatchNorm synchronises over the pmap axis ``'batch'``, a
``TrainState`` holding ``batch_stats`` and an optional ``dynamic_scale``, a warm-up + cosine
learning-rate schedule, ``lax.pmean`` of the gradients and of the metrics,
``jax_utils.replicate``, batches shaped ``(devices, per_device, ...)``,
``common_utils.get_metrics`` and a pmap-ed eval step, trained on sklearn's 8x8 digits.

``tests/pmap_script_ported.py`` is this file ported to jaxcomm; ``tests/test_pmap.py``
counts the changed lines and runs both.
"""

import functools
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import common_utils, train_state
from flax.training import dynamic_scale as dynamic_scale_lib
from jax import lax

import jaxcomm
from experiments.bench.digits import load_split

ModuleDef = Any
NUM_CLASSES = 10

DEFAULT_CONFIG = {
    "learning_rate": 0.1,
    "warmup_epochs": 1,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "batch_size": 64,
    "num_epochs": 3,
    "num_train_steps": -1,
    "half_precision": False,
    "num_filters": 8,
    "seed": 0,
    "log_every_steps": 10,
}


class ResNetBlock(nn.Module):
    """ResNet block."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNet v1 for small images."""

    stage_sizes: tuple[int, ...]
    num_classes: int
    num_filters: int = 8
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (3, 3), name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(
                    self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNetTiny = functools.partial(ResNet, stage_sizes=(1, 1))


def create_model(*, half_precision, **kwargs):
    platform = jax.local_devices()[0].platform
    if half_precision:
        model_dtype = jnp.float16 if platform == "gpu" else jnp.float32
    else:
        model_dtype = jnp.float32
    return ResNetTiny(num_classes=NUM_CLASSES, dtype=model_dtype, **kwargs)


def initialized(key, image_size, model):
    input_shape = (1, image_size, image_size, 1)

    @jax.jit
    def init(*args):
        return model.init(*args)

    variables = init({"params": key}, jnp.ones(input_shape, model.dtype))
    return variables["params"], variables["batch_stats"]


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
    return jnp.mean(xentropy)


def compute_metrics(logits, labels):
    loss = cross_entropy_loss(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    metrics = {"loss": loss, "accuracy": accuracy}
    metrics = lax.pmean(metrics, axis_name="batch")
    return metrics


def create_learning_rate_fn(config, base_learning_rate, steps_per_epoch):
    """Creates learning rate schedule."""
    warmup_fn = optax.linear_schedule(
        init_value=0.0,
        end_value=base_learning_rate,
        transition_steps=config["warmup_epochs"] * steps_per_epoch,
    )
    cosine_epochs = max(config["num_epochs"] - config["warmup_epochs"], 1)
    cosine_fn = optax.cosine_decay_schedule(
        init_value=base_learning_rate, decay_steps=cosine_epochs * steps_per_epoch
    )
    return optax.join_schedules(
        schedules=[warmup_fn, cosine_fn],
        boundaries=[config["warmup_epochs"] * steps_per_epoch],
    )


def train_step(state, batch, learning_rate_fn, weight_decay):
    """Perform a single training step."""

    def loss_fn(params):
        """loss function used for training."""
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    step = state.step
    dynamic_scale = state.dynamic_scale
    lr = learning_rate_fn(step)

    if dynamic_scale:
        grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
        dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
        # dynamic loss takes care of averaging gradients across replicas
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        aux, grads = grad_fn(state.params)
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr

    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    if dynamic_scale:
        # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
        # params should be restored (= skip this step).
        new_state = new_state.replace(
            opt_state=jax.tree_util.tree_map(
                functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
            ),
            params=jax.tree_util.tree_map(
                functools.partial(jnp.where, is_fin), new_state.params, state.params
            ),
            dynamic_scale=dynamic_scale,
        )
        metrics["scale"] = dynamic_scale.scale

    return new_state, metrics


def eval_step(state, batch):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, batch["image"], train=False, mutable=False)
    return compute_metrics(logits, batch["label"])


def prepare_data(xs, ys, batch_size, rng=None):
    """Batches of ``batch_size`` examples, reshaped to (local devices, per device, ...)."""
    order = np.arange(len(xs)) if rng is None else rng.permutation(len(xs))
    local_device_count = jax.local_device_count()
    for i in range(0, len(xs) - batch_size + 1, batch_size):
        idx = order[i : i + batch_size]
        batch = {"image": xs[idx].reshape(-1, 8, 8, 1), "label": ys[idx]}
        yield jax.tree_util.tree_map(
            lambda x: x.reshape((local_device_count, -1) + x.shape[1:]), batch
        )


class TrainState(train_state.TrainState):
    batch_stats: Any
    dynamic_scale: dynamic_scale_lib.DynamicScale


# pmean only works inside pmap because it needs an axis name.
# This function will average the inputs across all devices.
cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, "x"), "x")


def sync_batch_stats(state):
    """Sync the batch statistics across replicas."""
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def create_train_state(rng, config, model, image_size, learning_rate_fn):
    """Create initial training state."""
    dynamic_scale = None
    if config["half_precision"]:
        dynamic_scale = dynamic_scale_lib.DynamicScale()
    params, batch_stats = initialized(rng, image_size, model)
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=config["momentum"], nesterov=True)
    tx = optax.chain(jaxcomm.sync_gradients(**config.get("sync", {})), tx)
    state = TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        batch_stats=batch_stats,
        dynamic_scale=dynamic_scale,
    )
    return state


def train_and_evaluate(config, data=None, inject=None, on_step=None):
    """Trains and evaluates; returns the final (unreplicated) state, a summary and the
    logged history.

    ``inject(step, batch) -> batch`` may alter a training batch and ``on_step(step,
    state)`` sees the replicated state after each step (tests use them)."""
    config = {**DEFAULT_CONFIG, **config}
    x_train, y_train, x_test, y_test = data if data is not None else load_split()
    rng = jax.random.key(config["seed"])
    batch_size = config["batch_size"]
    if batch_size % jax.device_count() > 0:
        raise ValueError("Batch size must be divisible by the number of devices")
    steps_per_epoch = len(x_train) // batch_size
    num_steps = config["num_train_steps"]
    if num_steps == -1:
        num_steps = steps_per_epoch * config["num_epochs"]

    model = create_model(half_precision=config["half_precision"], num_filters=config["num_filters"])
    learning_rate_fn = create_learning_rate_fn(config, config["learning_rate"], steps_per_epoch)
    state = create_train_state(rng, config, model, 8, learning_rate_fn)
    state = jax_utils.replicate(state)

    p_train_step = jaxcomm.pmap_data_parallel(jaxcomm.make_mesh(intra=4))(
        functools.partial(
            train_step,
            learning_rate_fn=learning_rate_fn,
            weight_decay=config["weight_decay"],
        ),
        axis_name="batch",
    )
    p_eval_step = jax.pmap(eval_step, axis_name="batch")

    train_metrics, summary, history = [], {}, []
    data_rng = np.random.default_rng(config["seed"])
    step, train_metrics_last_t = 0, time.time()
    while step < num_steps:
        for batch in prepare_data(x_train, y_train, batch_size, data_rng):
            if inject is not None:
                batch = inject(step, batch)
            state, metrics = p_train_step(state, batch)
            train_metrics.append(metrics)
            step += 1
            if on_step is not None:
                on_step(step, state)
            if step % config["log_every_steps"] == 0 or step == num_steps:
                train_metrics = common_utils.get_metrics(train_metrics)
                summary = {
                    f"train_{k}": float(v)
                    for k, v in jax.tree_util.tree_map(lambda x: x.mean(), train_metrics).items()
                }
                summary["steps_per_second"] = config["log_every_steps"] / (
                    time.time() - train_metrics_last_t
                )
                history.append(summary)
                train_metrics, train_metrics_last_t = [], time.time()
            if step == num_steps:
                break

    state = sync_batch_stats(state)
    eval_metrics = []
    n_eval = len(x_test) // batch_size * batch_size
    for batch in prepare_data(x_test[:n_eval], y_test[:n_eval], batch_size):
        eval_metrics.append(p_eval_step(state, batch))
    eval_metrics = common_utils.get_metrics(eval_metrics)
    summary = {**summary, **{f"eval_{k}": float(v.mean()) for k, v in eval_metrics.items()}}
    return jax_utils.unreplicate(state), summary, history
