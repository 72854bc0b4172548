"""Worker for tests/test_mpi.py, run under mpirun (one CPU device per process)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from jaxcomm.collectives import mpi

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
rows = [np.random.default_rng(r).standard_normal(257).astype(np.float32) for r in range(size)]
tree = {"a": jnp.asarray(rows[rank]), "b": jnp.asarray(rows[rank][:3].astype(np.float16))}
out = jax.jit(lambda t: mpi.mpi_allreduce(t, op="sum"))(tree)
np.testing.assert_allclose(np.asarray(out["a"]), np.sum(rows, 0), rtol=1e-5, atol=1e-5)
assert out["b"].dtype == jnp.float16
np.testing.assert_allclose(np.asarray(out["b"], np.float32), np.sum(rows, 0)[:3], atol=1e-2)

# A per-process data-parallel step: params stay identical across ranks.
tx = optax.chain(mpi.mpi_sync_gradients(), optax.sgd(0.5))
params = {"w": jnp.zeros(257)}
state = tx.init(params)


@jax.jit
def step(params, state, x):
    grads = jax.grad(lambda p: jnp.vdot(p["w"], x))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


params, state = step(params, state, jnp.asarray(rows[rank]))
np.testing.assert_allclose(np.asarray(params["w"]), -0.5 * np.mean(rows, 0), rtol=1e-5, atol=1e-6)
print(f"MPI_OK rank={rank} size={size}", flush=True)
