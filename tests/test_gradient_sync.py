"""The explicit reducer: ``GradientSync`` and how the step builder reaches it.

``sync_gradients`` is the optax adapter of a ``GradientSync``; the step builder, the
microbatch loop and the profiler's twin reach the sync through optax's extra argument
``sync_request=`` (no trace-time side channel).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import AX, per_device, sharded, train
from jax.sharding import PartitionSpec as P
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from jaxcomm.compression import int8

COMPRESSORS = {"none": None, "int8": int8(block=64)}


def _grads(mesh, seed=0):
    rng = np.random.default_rng(seed)
    n = mesh.devices.size
    return per_device(mesh, {"w": rng.normal(size=(n, 40, 64)).astype(np.float32),
                             "b": rng.normal(size=(n, 1, 8)).astype(np.float32)})  # fmt: skip


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_reduce_equals_the_optax_adapter_bit_for_bit(mesh, name):
    kw = {"compression": COMPRESSORS[name], "min_size": 64}
    sync, tx = jaxcomm.gradient_sync(**kw), jaxcomm.sync_gradients(**kw)

    def both(g):
        g = jax.tree.map(lambda x: x[0], g)
        a, _ = sync.reduce(g, sync.init(g))
        b, _ = tx.update(g, tx.init(g))
        return a, b

    a, b = sharded(both, mesh, out_specs=P(AX))(_grads(mesh))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want = np.asarray(_grads(mesh)["w"]).mean(0)
    got = np.asarray(a["w"])[: want.shape[0]]  # device 0's mean
    np.testing.assert_allclose(got, want, atol=0.05 if name == "int8" else 1e-6)


def test_request_not_to_communicate_passes_through_and_reports_the_sync(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(compression=int8()), optax.sgd(1.0))

    def step(g):
        g = jax.tree.map(lambda x: x[0], g)
        found = []
        request = jaxcomm.SyncRequest(communicate=False, on_sync=found.append)
        state = tx.init(g)
        u, state = tx.update(g, state, sync_request=request)
        assert len(found) == 1 and isinstance(found[0], jaxcomm.GradientSync)
        return u, state[0].count

    u, count = sharded(step, mesh, out_specs=(P(AX), P()), check_vma=False)(_grads(mesh))
    g = np.asarray(_grads(mesh)["w"])
    np.testing.assert_array_equal(np.asarray(u["w"]), -g.reshape(-1, g.shape[-1]))
    assert int(count) == 1


def test_data_parallel_exposes_its_syncs(mesh):
    tx = optax.chain(jaxcomm.sync_gradients(algorithm="ring"), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh)
    dp.init(mlp_init(jax.random.key(0)))
    assert [s.algorithm for s in dp.syncs] == ["ring"]


def _dropping_extra_args(inner):
    """A wrapper that forwards the gradients but not optax's extra arguments."""

    def update(g, s, params=None, **_):
        return inner.update(g, s, params)

    return optax.GradientTransformation(inner.init, update)


def test_a_wrapper_that_drops_extra_args_is_refused_by_name(mesh):
    tx = _dropping_extra_args(optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)))
    with pytest.raises(ValueError, match="does not forward extra"):
        jaxcomm.data_parallel(mlp_loss, tx, mesh).init(mlp_init(jax.random.key(0)))


def test_no_context_variables_in_the_package():
    import pathlib

    # Three ambient values only, each with no explicit argument that could carry it: the
    # backend row a trace runs under (backend.use: tests' route comparisons, a branch whose
    # outputs are buffers already), the params a Flax step started from (what
    # jaxcomm.replicated_params, called in the user's own step, looks up) and the blocks a
    # hybrid step hands its loss (what jaxcomm.gather_params and gathered_layers, called
    # inside the user's model, gather: an argument would change every layer's signature).
    root = pathlib.Path(jaxcomm.__file__).parent
    users = sorted(p.name for p in root.rglob("*.py") if "contextvars" in p.read_text())
    assert users == ["backend.py", "flax_step.py", "gathering.py"]


def test_overlap_microbatches_reduce_through_the_sync(mesh):
    """accumulate='overlap' calls the sync's reduce per microbatch: N reductions."""
    tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, microbatches=2, accumulate="overlap")
    state = dp.init(mlp_init(jax.random.key(0)))
    state, _ = train(dp, state, mlp_batches(1, size=32))  # replicas compared by their bits
    assert int(state.opt_state[0].count) == 2
    assert jnp.isfinite(state.params[0]["w"]).all()


def _equations(jaxpr) -> int:
    """Equations of a jaxpr and of the jaxprs nested in it (shard_map, cond, scan, pjit)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _equations(inner)
    return n


@pytest.mark.parametrize("name", ["int8", "adaptive", "powersgd", "fp16"])
def test_traced_program_stays_near_the_plain_sync(mesh, name):
    """The compressed sync of a ResNet's gradient tree traces to a program of the plain
    sync's order of size: a trace-time channel that grows with leaves x leaves (an ordering
    tie of every plain leaf to every compressed leaf made int8 165x the flat program's
    equations on ResNet-152) fails here, in a fraction of a second, without timing anything."""
    from jaxcomm.models import gradient_shapes

    tree = gradient_shapes("resnet18", 10)
    C = jaxcomm.compression
    comp = {"int8": C.int8(), "adaptive": C.adaptive(), "powersgd": C.powersgd(4), "fp16": C.fp16()}

    def size(compression):
        sync = jaxcomm.gradient_sync(compression=compression)

        def run(g):
            return sync.reduce(g, sync.init(g))[0]

        mapped = jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        return _equations(jax.make_jaxpr(mapped)(tree).jaxpr)

    flat = size(None)
    # adaptive (a switch of four rungs and its controller) is ~5x, PowerSGD ~3.5x.
    assert size(comp[name]) < 8 * flat, (name, flat)
