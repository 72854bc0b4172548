"""``jaxcomm.same_value.same_on_every_device``: values typed varying proven the same on
every device from a shard_map's dataflow, and the cases it must not prove."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxcomm.same_value import same_on_every_device

AX = ("inter", "intra")


def body_of(fn, mesh, *args, specs):
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * 2)
    mapped = jax.shard_map(fn, mesh=auto, in_specs=specs, out_specs=P(AX), check_vma=True)
    closed = jax.make_jaxpr(mapped)(*args)
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map")
    return eqn.params["jaxpr"]


def grads_and_flag(w, x):
    """Each device's copy of ``w``, its own gradient, the mean, and a finiteness flag
    reduced over the devices (as a skipped step of a mixed-precision script uses them)."""
    copy = lax.pcast(w, AX, to="varying")
    g = jax.grad(lambda v: jnp.sum(jnp.tanh(x @ v)))(copy)
    new = w - 0.1 * lax.pmean(g, AX)
    ok = lax.pmin(jnp.all(jnp.isfinite(g)).astype(jnp.int32), AX) > 0
    return copy, g, new, ok


CASES = {
    # name: (output from (copy, g, new, ok, w, x), proven the same)
    "skipped step from the old copy": (lambda c, g, n, ok, w, x: jnp.where(ok, n, c), True),
    "old copy plus the mean": (lambda c, g, n, ok, w, x: c + (n - w), True),
    "the copy in a nested jit": (lambda c, g, n, ok, w, x: jax.jit(jnp.sin)(c), True),
    "the device's own gradient": (lambda c, g, n, ok, w, x: c - g, False),
    "a flag not reduced": (lambda c, g, n, ok, w, x: jnp.where(jnp.all(g > 0), n, c), False),
    "the device index": (lambda c, g, n, ok, w, x: c * lax.axis_index(AX), False),
    "the batch": (lambda c, g, n, ok, w, x: c * jnp.mean(x), False),
    "a scatter of the copy": (
        lambda c, g, n, ok, w, x: lax.psum_scatter(jnp.tile(c, (8, 1)), AX, tiled=True),
        False,
    ),
    "the index in a nested jit": (
        lambda c, g, n, ok, w, x: jax.jit(lambda v: v * lax.axis_index(AX))(c),
        False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_proofs(mesh, name):
    out, proven = CASES[name]

    def fn(w, x):
        c, g, n, ok = grads_and_flag(w, x)
        return out(c, g, n, ok, w, x)[None]

    w, x = jnp.ones((3, 3)) * 0.1, jnp.arange(24.0).reshape(8, 3) / 24
    body = body_of(fn, mesh, w, x, specs=(P(), P(AX)))
    assert same_on_every_device(body, [True, False], AX) == [proven]


def test_inputs_given_as_per_device_are_not_the_same(mesh):
    body = body_of(lambda w: lax.pcast(w, AX, to="varying")[None], mesh, jnp.ones(3), specs=P())
    assert same_on_every_device(body, [True], AX) == [True]
    body = body_of(lambda w: w[None], mesh, jnp.ones(8), specs=P(AX))
    assert same_on_every_device(body, [False], AX) == [False]
    with pytest.raises(ValueError, match=r"2 flags for 1 inputs"):
        same_on_every_device(body, [False, True], AX)
