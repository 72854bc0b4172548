"""Every all-reduce algorithm equals numpy (and psum) on random pytrees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, assert_replicas_equal, per_device, run_sharded

import jaxcomm
from jaxcomm.collectives import ALGORITHMS

AXES = AX
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _random_tree(rng, dtype):
    shapes = {"w": (37, 5), "b": (7,), "s": (), "deep": {"k": (3, 3, 2, 9), "big": (20001,)}}
    return jax.tree.map(
        lambda s: rng.normal(size=s).astype(np.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    ), dtype


def _per_device(tree, mesh):
    # Stack 8 different per-device trees along a leading axis, sharded over both axes.
    return per_device(mesh, jax.tree.map(lambda *xs: np.stack(xs), *tree))


def _run(mesh, stacked, **kw):
    """allreduce under check_vma=True with out_specs=P(): typed replicated, and bit-equal."""

    def f(t):
        local = jax.tree.map(lambda x: x[0], t)
        return jaxcomm.allreduce(local, **kw)

    out = run_sharded(f, mesh, stacked)
    assert_replicas_equal(out)
    return out


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_allreduce_matches_numpy(mesh, algorithm, dtype, op):
    rng = np.random.default_rng(0)
    trees = [_random_tree(rng, dtype)[0] for _ in range(8)]
    trees = [jax.tree.map(lambda x: jnp.asarray(x, dtype), t) for t in trees]
    out = _run(mesh, _per_device(trees, mesh), algorithm=algorithm, op=op)
    ref = jax.tree.map(lambda *xs: np.sum([np.asarray(x, np.float64) for x in xs], 0), *trees)
    if op == "mean":
        ref = jax.tree.map(lambda r: r / 8, ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.dtype == dtype and o.shape == r.shape
        scale = np.abs(r).max() + 1
        np.testing.assert_allclose(np.asarray(o, np.float64), r, atol=TOL[dtype] * scale * 8)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_allreduce_equals_psum(mesh, algorithm):
    rng = np.random.default_rng(1)
    trees = [{"a": rng.normal(size=(13, 3)).astype(np.float32)} for _ in range(8)]
    stacked = _per_device(trees, mesh)
    out = _run(mesh, stacked, algorithm=algorithm, op="sum")

    def ref(t):
        return jax.lax.psum(jax.tree.map(lambda x: x[0], t), AXES)

    want = run_sharded(ref, mesh, stacked)
    np.testing.assert_allclose(out["a"], want["a"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_passes_the_replication_check(mesh, algorithm):
    # Each ends in a collective typed invariant (all_gather(to='invarying'), psum), so user
    # code keeps shard_map's check_vma=True with out_specs=P().
    x = per_device(mesh, np.ones((8, 10), np.float32))
    out = run_sharded(lambda v: jaxcomm.allreduce(v[0], algorithm=algorithm, op="sum"), mesh, x)
    np.testing.assert_array_equal(out, np.full((10,), 8.0))


def test_empty_tree_and_scalars(mesh):
    assert _run(mesh, {}, algorithm="hierarchical") == {}
    out = _run(mesh, _per_device([{"s": np.float32(i)} for i in range(8)], mesh), op="sum")
    assert float(out["s"]) == sum(range(8))


@pytest.mark.parametrize("bad", [np.int32, np.complex64, np.bool_])
def test_non_float_leaf_names_path(mesh, bad):
    trees = [{"ok": np.zeros(3, np.float32), "bad": {"count": np.zeros(2, bad)}} for _ in range(8)]
    with pytest.raises(TypeError, match=r"\['bad'\]\['count'\]"):
        _run(mesh, _per_device(trees, mesh))


def test_unknown_algorithm_and_op():
    with pytest.raises(ValueError, match="choose one of.*hierarchical"):
        jaxcomm.allreduce({}, algorithm="butterfly")
    with pytest.raises(ValueError, match=r"choose one of \['sum', 'mean'\]"):
        jaxcomm.allreduce({}, op="max")


def test_unbound_axes_give_the_sync_gradients_error(mesh):
    """Outside shard_map, or over an axis the mesh lacks: one clear ValueError (the check
    sync_gradients uses), not JAX's NameError."""
    grads = {"g": np.ones(4, np.float32)}
    unbound = r"\(axes=\('inter', 'intra'\)\) was called where mesh axis 'inter' is not bound"
    with pytest.raises(ValueError, match=r"^jaxcomm\.allreduce" + unbound + ".*shard_map"):
        jaxcomm.allreduce(grads)
    with pytest.raises(ValueError, match=r"mesh axis 'data' is not bound"):
        _run(mesh, _per_device([grads] * 8, mesh), axes=("data",))
    tx = jaxcomm.sync_gradients()
    with pytest.raises(ValueError, match=r"^sync_gradients" + unbound + ".*shard_map"):
        tx.update(grads, tx.init(grads))
