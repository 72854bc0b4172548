"""A training script written for ``jax.pmap`` in the optax form (not a test module).

No ``TrainState``: the update function takes ``(params, opt_state, batch, rng)`` with the
optimizer ``tx`` closed over, as big_vision's and many research scripts write it: dropout
keys folded with ``lax.axis_index('batch')``, ``lax.pmean`` of the gradients (a
``jax.tree.map``) and of the loss, ``jax_utils.replicate((params, opt_state))``, batches
shaped ``(devices, per_device, ...)``, ``donate_argnums=(0,)``, and checkpoints of
``(unreplicate(params), unreplicate(opt_state), step)`` with ``flax.training.checkpoints``.
A small MLP with dropout on sklearn's 8x8 digits.

``tests/pmap_optax_script_ported.py`` is this file ported to jaxcomm;
``tests/test_pmap_optax.py`` counts the changed lines and runs both.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import checkpoints
from jax import lax

import jaxcomm
from experiments.bench.digits import load_split

DEFAULT_CONFIG = {
    "learning_rate": 0.1,
    "warmup_steps": 3,
    "decay_steps": 100,
    "momentum": 0.9,
    "grad_clip_norm": 1.0,
    "batch_size": 64,
    "num_steps": 6,
    "hidden": 32,
    "dropout": 0.1,
    "seed": 0,
    "workdir": None,
    "checkpoint_every": 0,
}


class MLP(nn.Module):
    hidden: int
    dropout: float

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


def create_optimizer(config):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config["learning_rate"], config["warmup_steps"], config["decay_steps"]
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config["grad_clip_norm"]),
        optax.sgd(schedule, momentum=config["momentum"]),
    )
    return tx, schedule


def make_update_fn(model, tx):
    def update_fn(params, opt_state, batch, rng):
        rng, new_rng = jax.random.split(rng)
        rng_local = jax.random.fold_in(rng, lax.axis_index("batch"))

        def loss_fn(p):
            logits = model.apply({"params": p}, batch["image"], rngs={"dropout": rng_local})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, lax.pmean(loss, "batch"), new_rng

    return update_fn


def batches(xs, ys, batch_size, rng):
    """Batches of ``batch_size`` examples as (local devices, per device, ...)."""
    order = rng.permutation(len(xs))
    n = jax.local_device_count()
    while True:
        for i in range(0, len(xs) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield {"image": xs[idx].reshape(n, -1, 64), "label": ys[idx].reshape(n, -1)}


def evaluate(model, params, xs, ys):
    logits = model.apply({"params": params}, xs, train=False)
    return float(jnp.mean(jnp.argmax(logits, -1) == ys))


def train(config, data=None, on_step=None):
    """Trains for ``num_steps`` (from the checkpoint in ``workdir``, if any); returns the
    unreplicated ``(params, opt_state)``, the losses and the test accuracy."""
    config = {**DEFAULT_CONFIG, **config}
    x_train, y_train, x_test, y_test = data if data is not None else load_split()
    model = MLP(config["hidden"], config["dropout"])
    rng = jax.random.key(config["seed"])
    params = model.init(rng, jnp.ones((1, 64)))["params"]
    tx, _ = create_optimizer(config)
    tx = optax.chain(jaxcomm.sync_gradients(**config.get("sync", {})), tx)
    opt_state = tx.init(params)
    step, workdir = 0, config["workdir"]
    if workdir and checkpoints.latest_checkpoint(workdir):
        old = checkpoints.restore_checkpoint(workdir, None)  # also the unported run's
        params, opt_state, step = old["0"], jaxcomm.lift_opt_state(old["1"], tx, old["0"]), old["2"]
    params_repl, opt_state_repl = jax_utils.replicate((params, opt_state))
    rng_repl = jax_utils.replicate(jax.random.fold_in(rng, step))

    p_update = jaxcomm.pmap_data_parallel(jaxcomm.make_mesh(intra=4))(
        make_update_fn(model, tx),
        axis_name="batch",
        donate_argnums=(0,),
    )

    data_rng = np.random.default_rng(config["seed"])
    losses = []
    it = batches(x_train, y_train, config["batch_size"], data_rng)
    for _ in range(int(step)):  # the data position of a resumed run
        next(it)
    while step < config["num_steps"]:
        params_repl, opt_state_repl, loss, rng_repl = p_update(
            params_repl, opt_state_repl, next(it), rng_repl
        )
        losses.append(float(loss[0]))
        step += 1
        if on_step is not None:
            on_step(step, params_repl, opt_state_repl)
        if workdir and config["checkpoint_every"] and step % config["checkpoint_every"] == 0:
            saved = jax_utils.unreplicate((params_repl, opt_state_repl))
            checkpoints.save_checkpoint(workdir, (*saved, step), step, keep=3)

    params, opt_state = jax_utils.unreplicate((params_repl, opt_state_repl))
    return params, opt_state, losses, evaluate(model, params, x_test, y_test)
