"""Orbax checkpoints of sharded optimizer state: bit for bit on the same devices, and
resharded from 8 devices to 4 with training continuing to the uninterrupted result."""

import jax
import numpy as np
import optax
from helpers import assert_replicas_equal, assert_trees_bitwise_equal
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from experiments.checkpoint import Checkpointer

AX = ("inter", "intra")


def _dp(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2, weight_decay=0.1))
    return jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_optimizer=True)


def _like(state, mesh, per_device_paths):
    """``state``'s shapes with shardings on ``mesh`` (per-device leaves split over AX)."""
    split = {".opt_state" + p for p in per_device_paths}

    def spec(path, x):
        s = P(AX) if jax.tree_util.keystr(path) in split else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))

    return jax.tree_util.tree_map_with_path(spec, state)


def test_checkpoint_same_devices_bitwise_and_resharded_8_to_4(mesh, tmp_path):
    p0 = mlp_init(jax.random.key(0))
    batches = mlp_batches(10, size=32)
    dp8 = _dp(mesh)
    straight = dp8.init(p0)
    for b in batches:
        straight, _ = dp8(straight, b)

    state = dp8.init(p0)
    for b in batches[:5]:
        state, _ = dp8(state, b)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, position=5)
    paths = [".opt_state" + p for p in dp8.per_device_paths]
    assert paths  # Adam's moments are stored sharded

    # the same 8 devices: bit for bit, and the run goes on as if never interrupted
    restored, data = ckpt.restore(state)
    assert data["position"] == 5
    assert_trees_bitwise_equal(restored, state)
    for b in batches[5:]:
        restored, _ = dp8(restored, b)
    assert_trees_bitwise_equal(restored, straight)

    # 4 devices: restored onto them as saved (8 chunks), resharded into 4, 5 more steps
    mesh4 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), AX)
    dp4 = _dp(mesh4)
    saved, _ = ckpt.restore(_like(state, mesh4, dp8.per_device_paths))
    ckpt.close()
    state4 = dp4.reshard(saved)
    mu8 = jax.tree.leaves(state.opt_state.inner)[1]
    mu4 = jax.tree.leaves(state4.opt_state.inner)[1]
    assert mu8.shape[0] == 8 and mu4.shape[0] == 4
    assert mu4.addressable_shards[0].data.shape == (1, mu4.shape[1])
    n = min(mu8.size, mu4.size)
    np.testing.assert_array_equal(np.asarray(mu4).reshape(-1)[:n], np.asarray(mu8).reshape(-1)[:n])
    for b in batches[5:]:
        state4, _ = dp4(state4, b)
        assert assert_replicas_equal(state4) > 0
    for x, y in zip(jax.tree.leaves(state4.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
