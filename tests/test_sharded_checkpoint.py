"""Orbax checkpoints of sharded optimizer state: bit for bit on the same devices, and
resharded from 8 devices to 4 with training continuing to the uninterrupted result."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_replicas_equal, assert_trees_bitwise_equal, train
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from jaxcomm.checkpoint import Checkpointer

AX = ("inter", "intra")


def _dp(mesh, **kw):
    tx = optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-2, weight_decay=0.1))
    return jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_optimizer=True, **kw)


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
    straight, _ = train(dp8, dp8.init(p0), batches)
    state, _ = train(dp8, dp8.init(p0), batches[:5])
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


def _assert_close(a, b):
    # f32 rounding only: XLA:CPU may compile a leaf's update in another bucket with other
    # vector code (last bits); moments on another leaf would be ~1e-2 off
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _groups(dp):
    return [[i for i, _, _ in b.pieces] for b in dp.sharded.shard_plan.plan.buffers]


def test_a_state_written_with_other_buckets_restores_as_it_is(mesh, tmp_path):
    """``shard_bucket_bytes`` only groups the pieces for the collectives: the stored state
    is one piece per param leaf. A checkpoint written with buckets [b0] [w0 b1] [w1]
    (1600 bytes) goes on under [b0] [w0] [b1 w1] (1540 bytes: as many buckets, other
    leaves in them) as the uninterrupted run, on the same 8 devices and resharded onto 4,
    within f32 rounding."""
    p0 = mlp_init(jax.random.key(0))  # leaves: b0 (32), w0 (384), b1 (3), w1 (96)
    batches = mlp_batches(8, size=32)
    dp_a, dp_b = _dp(mesh, shard_bucket_bytes=1600), _dp(mesh, shard_bucket_bytes=1540)
    straight, _ = train(dp_a, dp_a.init(p0), batches)
    state, _ = train(dp_a, dp_a.init(p0), batches[:4])
    assert dp_b.init(p0) is not None  # lays dp_b out
    assert _groups(dp_a) == [[0], [1, 2], [3]] and _groups(dp_b) == [[0], [1], [2, 3]]
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, position=4)

    restored, _ = ckpt.restore(state)
    for resumed in (dp_b.reshard(restored), restored):  # resharded, or taken as it is
        for b in batches[4:]:
            resumed, _ = dp_b(resumed, b)
        _assert_close(resumed.params, straight.params)

    mesh4 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), AX)
    dp4 = _dp(mesh4, shard_bucket_bytes=1540)
    saved, _ = ckpt.restore(_like(state, mesh4, dp_a.per_device_paths))
    ckpt.close()
    state4 = dp4.reshard(saved)
    for b in batches[4:]:
        state4, _ = dp4(state4, b)
    assert assert_replicas_equal(state4) > 0
    _assert_close(state4.params, straight.params)


def test_a_state_of_other_params_is_refused_by_reshard(mesh):
    """A piece leaf whose size fits no leaf of this step's size (b0: 32 elements in 8
    pieces of 4, here 64 in pieces of 8): refused, named."""
    state = _dp(mesh).init(mlp_init(jax.random.key(0)))
    wider = _dp(mesh).init(mlp_init(jax.random.key(0), sizes=(12, 64, 3)))
    with pytest.raises(ValueError, match=r"reshard: the optimizer state's .*mu.* 8 pieces of 4 "):
        _dp(mesh).reshard(state._replace(params=wider.params))
