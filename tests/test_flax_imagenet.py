"""Flax's current ImageNet example ported to jaxcomm in 5 lines.

``tests/flax_imagenet/train.py`` is google/flax ``examples/imagenet/train.py`` (commit
18f8f311c275d57f46d95e41b15aa97b454754c0, the form with ``jax.pmap(..., in_axes=(None, 0),
out_axes=(None, 0), axis_name='batch')``) with the swaps its header lists to run offline on
scikit-learn's digits; ``models.py`` is upstream's, verbatim. ``train_ported.py`` is
train.py with ``import jaxcomm``, ``tx = optax.chain(jaxcomm.sync_gradients(), tx)``,
``jax.pmap(`` -> ``jaxcomm.pmap_data_parallel(jaxcomm.make_mesh(intra=4))(`` for the train
step, and the step's ``lax.pmean(grads, ...)`` (and its comment) deleted. Eval stays
``jax.pmap``; Flax's own ``DynamicScale`` and checkpointing stay.
"""

import difflib
import functools
import hashlib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax.training import dynamic_scale as dynamic_scale_lib
from helpers import assert_replicas_equal

import jaxcomm

HERE = Path(__file__).parent
EXAMPLE = HERE / "flax_imagenet"
sys.path.insert(0, str(EXAMPLE))  # train.py does `import input_pipeline` / `import models`

import input_pipeline  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
import train_ported  # noqa: E402

# git blob ids of the upstream files at commit 18f8f311c275d57f46d95e41b15aa97b454754c0
# (`git ls-tree <commit> examples/imagenet/`): the copies here are checked against them
# without a copy of the upstream repository.
UPSTREAM_BLOB = {
    "train.py": "66075aea8ff053f549a773f659ee911d60e694b9",
    "models.py": "f41ed6ad74be2566169022585a7d78bc14a84add",
}

BATCH = 64  # 8 per device; 1440 training images -> 22 steps an epoch, 5 eval batches (320)
STEPS_PER_EPOCH = 1440 // BATCH


def changed_lines(a: str, b: str) -> int:
    """Lines changed from ``a`` to ``b``: per difflib opcode, the longer side of a
    replacement, the lines deleted or inserted (as in test_pmap.py; reimplemented rather
    than imported so that this file does not import test_pmap's scripts)."""
    ops = difflib.SequenceMatcher(None, a.splitlines(), b.splitlines()).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def git_blob_id(text: str) -> str:
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def config(**overrides) -> dict:
    """configs/default.py's fields, sized for the digits: the 1-block ResNet that models.py
    keeps for testing, 3 epochs of 64 images a step, no warm-up."""
    c = train.ml_collections.ConfigDict(
        model="_ResNet1",
        dataset="digits",
        learning_rate=0.4,  # base learning rate 0.4 * 64 / 256 = 0.1
        warmup_epochs=0.0,
        momentum=0.9,
        batch_size=BATCH,
        shuffle_buffer_size=None,
        prefetch=10,
        num_epochs=3.0,
        log_every_steps=11,
        cache=False,
        half_precision=False,
        num_train_steps=-1,
        steps_per_eval=-1,
        profile=False,
    )
    c.update(overrides)
    return c


def run(module, workdir: Path, **overrides):
    """``module.train_and_evaluate``: the final state on the host, and its writer's scalars."""
    state = module.train_and_evaluate(config(**overrides), str(workdir))
    if module is train_ported:
        assert assert_replicas_equal(state) > 0  # every device's copy: the same bits
    return jax.device_get(state), module.metric_writers.writers[-1].scalars


def assert_close(a, b, what: str) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0, what
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-6, err_msg=what)


def final_eval_accuracy(scalars) -> float:
    return [s["eval_accuracy"] for _, s in scalars if "eval_accuracy" in s][-1]


# -- the files --------------------------------------------------------------------------


def undo_swaps(text: str) -> str:
    """train.py with the swaps its header lists undone: upstream's train.py."""
    text = text[text.index("# Copyright 2024 The Flax Authors.\n") :]  # the swaps' header
    stand_ins = text[text.index("\n\n# Offline stand-ins") : text.index("\n\nNUM_CLASSES")]
    for old, new in [
        (stand_ins, ""),
        ("from input_pipeline import tf\nfrom input_pipeline import tfds\n", ""),
        (
            "import orbax.checkpoint as ocp\n",
            "import orbax.checkpoint as ocp\nimport tensorflow as tf\n"
            "import tensorflow_datasets as tfds\n",
        ),
        (
            "from absl import logging\n",
            "from absl import logging\nfrom clu import metric_writers\n"
            "from clu import periodic_actions\n",
        ),
        ("from jax import random\n", "from jax import random\nimport ml_collections\n"),
        ("  image_size = 8\n", "  image_size = 224\n"),
    ]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def test_train_py_is_upstream_but_for_the_listed_swaps():
    train_py = (EXAMPLE / "train.py").read_text()
    assert git_blob_id(undo_swaps(train_py)) == UPSTREAM_BLOB["train.py"]
    models_py = (EXAMPLE / "models.py").read_text()
    body = models_py[models_py.index("# Copyright 2024 The Flax Authors.\n") :]
    assert git_blob_id(body) == UPSTREAM_BLOB["models.py"]  # verbatim below its note


def test_the_port_changes_at_most_6_lines():
    original = (EXAMPLE / "train.py").read_text()
    ported = (EXAMPLE / "train_ported.py").read_text()
    n = changed_lines(original, ported)
    assert 0 < n <= 6, n
    diff = difflib.unified_diff(original.splitlines(), ported.splitlines(), n=0, lineterm="")
    assert [d for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---")] == [
        "+import jaxcomm",
        "-    # Re-use same axis_name as in the call to `pmap(...train_step...)` below.",
        "-    grads = lax.pmean(grads, axis_name='batch')",
        "+  tx = optax.chain(jaxcomm.sync_gradients(), tx)",
        "-  p_train_step = jax.pmap(",
        "+  p_train_step = jaxcomm.pmap_data_parallel(jaxcomm.make_mesh(intra=4))(",
    ]


# -- training ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def original_3_epochs(tmp_path_factory):
    return run(train, tmp_path_factory.mktemp("original_3_epochs"))


@pytest.fixture(scope="module")
def ported_3_epochs(tmp_path_factory):
    return run(train_ported, tmp_path_factory.mktemp("ported_3_epochs"))


def test_the_original_trains_on_the_digits(original_3_epochs):
    # Seen here: eval accuracy 87.2% / 94.7% / 95.6% after epochs 1 / 2 / 3 (320 images).
    state, scalars = original_3_epochs
    assert int(state.step) == 3 * STEPS_PER_EPOCH
    accuracies = [s["eval_accuracy"] for _, s in scalars if "eval_accuracy" in s]
    assert len(accuracies) == 3, scalars
    assert accuracies[-1] > 0.9, accuracies
    assert [s for s, x in scalars if "train_loss" in x] == list(range(11, 67, 11))


def test_port_after_2_steps_is_the_original(tmp_path):
    a, _ = run(train, tmp_path / "original", num_train_steps=2)
    b, _ = run(train_ported, tmp_path / "ported", num_train_steps=2)
    assert int(a.step) == int(b.step) == 2
    assert_close(a.params, b.params, "params")
    assert_close(a.batch_stats, b.batch_stats, "batch_stats")


def test_port_trains_as_the_original(original_3_epochs, ported_3_epochs):
    (a, sa), (b, sb) = original_3_epochs, ported_3_epochs
    assert int(b.step) == int(a.step) == 3 * STEPS_PER_EPOCH
    acc_a, acc_b = final_eval_accuracy(sa), final_eval_accuracy(sb)  # original: 95.6% seen
    assert acc_a > 0.5 and acc_b > 0.5, (acc_a, acc_b)
    assert acc_b == pytest.approx(acc_a, abs=0.03), (acc_a, acc_b)


def test_the_stand_in_data_replays_each_epoch():
    """A fresh iterator (a restored run's) gives the batches an uninterrupted run sees in
    its next epoch: the checkpoint test below then compares like with like."""
    builder = input_pipeline.tfds.builder("digits")
    uninterrupted = input_pipeline.create_split(builder, BATCH, train=True)
    first = [next(uninterrupted) for _ in range(STEPS_PER_EPOCH)]
    second = [next(uninterrupted) for _ in range(STEPS_PER_EPOCH)]
    fresh = input_pipeline.create_split(builder, BATCH, train=True)
    for a, b, c in zip(first, second, (next(fresh) for _ in first), strict=True):
        for k in ("image", "label"):
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(c[k]))


@pytest.mark.parametrize("module", [train_ported], ids=["ported"])
def test_restored_at_an_epoch_boundary_continues_as_one_run(module, tmp_path):
    """One epoch (saved at its end), then a second call to two epochs in the same workdir
    (restored, continued) ends where one uninterrupted two-epoch run ends."""
    run(module, tmp_path / "a", num_train_steps=STEPS_PER_EPOCH)
    resumed, _ = run(module, tmp_path / "a", num_train_steps=2 * STEPS_PER_EPOCH)
    whole, _ = run(module, tmp_path / "b", num_train_steps=2 * STEPS_PER_EPOCH)
    assert int(resumed.step) == int(whole.step) == 2 * STEPS_PER_EPOCH
    assert_close(resumed.params, whole.params, "params")
    assert_close(resumed.batch_stats, whole.batch_stats, "batch_stats")
    assert_close(resumed.opt_state, whole.opt_state, "opt_state")


# -- Flax's DynamicScale ----------------------------------------------------------------


def dynamic_scale_steps(module, p_map, batches):
    """The module's TrainState with Flax's DynamicScale (its create_train_state makes one on
    GPU only), stepped through ``batches``: the state after each step, on the host."""
    c = config()
    learning_rate_fn = module.create_learning_rate_fn(
        c, c.learning_rate * c.batch_size / 256.0, STEPS_PER_EPOCH
    )
    model = module.create_model(model_cls=models._ResNet1, half_precision=False)
    state = module.create_train_state(
        jax.random.key(0), c, model, input_pipeline.IMAGE_SIZE, learning_rate_fn
    ).replace(dynamic_scale=dynamic_scale_lib.DynamicScale())
    p_train_step = p_map(
        functools.partial(module.train_step, learning_rate_fn=learning_rate_fn),
        in_axes=(None, 0),
        out_axes=(None, 0),
        axis_name="batch",
    )
    states = [jax.device_get(state)]
    for batch in batches:
        state, metrics = p_train_step(state, batch)
        if p_map is not jax.pmap:
            assert assert_replicas_equal(state) > 0
        states.append(jax.device_get(state))
        assert float(np.asarray(metrics["scale"])[0]) == float(states[-1].dynamic_scale.scale)
    return states


def test_flax_dynamic_scale_as_under_jax_pmap():
    """Two finite steps (params within 1e-6 of jax.pmap's, the same scale and count of
    finite steps), then a step with a NaN image on device 3: both skip it."""
    builder = input_pipeline.tfds.builder("digits")
    it = input_pipeline.create_split(builder, BATCH, train=True)
    batches = [train.prepare_tf_data(next(it)) for _ in range(3)]
    batches[2]["image"] = batches[2]["image"].copy()
    batches[2]["image"][3, 0, 0, 0, 0] = np.nan
    a = dynamic_scale_steps(train, jax.pmap, batches)
    b = dynamic_scale_steps(
        train_ported, jaxcomm.pmap_data_parallel(jaxcomm.make_mesh(intra=4)), batches
    )
    for s in (1, 2):
        assert_close(a[s].params, b[s].params, f"params after step {s}")
        assert_close(a[s].batch_stats, b[s].batch_stats, f"batch_stats after step {s}")
        # the port's tx is chain(sync, sgd): its second state is sgd's
        assert_close(a[s].opt_state, b[s].opt_state[1], f"opt_state after step {s}")
    for states in (a, b):
        scales = [float(s.dynamic_scale.scale) for s in states]
        fin_steps = [int(s.dynamic_scale.fin_steps) for s in states]
        assert scales == [65536.0, 65536.0, 65536.0, 32768.0]  # backed off at the NaN
        assert fin_steps == [0, 1, 2, 0]
        assert int(states[3].step) == 3
        for x, y in zip(
            jax.tree.leaves((states[3].params, states[3].opt_state)),
            jax.tree.leaves((states[2].params, states[2].opt_state)),
            strict=True,
        ):
            np.testing.assert_array_equal(x, y)  # step 3 skipped: params, optimizer state
