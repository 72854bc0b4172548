"""Inter-process all-reduce through MPI (mpi4jax), for one-device-per-process layouts.

Install the ``mpi`` extra (``pip install 'jaxcomm[mpi]'``; on machines where nvcc exists
without CUDA headers, build the CPU bridge: ``CUDA_ROOT=<empty dir> CUDA_PATH=<empty dir>
pip install mpi4jax``, after Debian's ``openmpi-bin libopenmpi-dev``) and launch
with ``mpirun -np N python ...``.

mpi4jax lowers to a custom call with an ordered effect, which XLA refuses in a program over
more than one device ("ordered effects are not supported for more than 1 device", checked
with jax 0.10.2 and mpi4jax 0.9). So this backend is *not* a ``jaxcomm.allreduce`` algorithm
(those run inside ``jax.shard_map`` over the whole mesh); it reduces each process's local
arrays inside a single-device ``jax.jit``. XLA never combines or overlaps these calls
(mpi4jax#309: its author advises sharding for performance); use it where MPI is the only
fabric, or to compare with gloo (``python -m experiments.bench collectives --mpi``).

mpi4py is imported on first use, not with jaxcomm: importing it initialises MPI.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives.base import check_float_tree, check_op

__all__ = ["available", "mpi_allreduce", "mpi_sync_gradients"]


def available() -> tuple[bool, str]:
    """Whether mpi4jax (and mpi4py) can be imported, and if not, why."""
    for mod in ("mpi4py", "mpi4jax"):
        if importlib.util.find_spec(mod) is None:
            return False, f"{mod} is not installed: pip install 'jaxcomm[mpi]'"
    return True, ""


def _mpi():
    ok, why = available()
    if not ok:
        raise ImportError(f"jaxcomm.collectives.mpi: {why}")
    import mpi4jax
    from mpi4py import MPI

    return MPI, mpi4jax


def mpi_allreduce(tree: Any, *, op: str = "mean", comm: Any = None) -> Any:
    """All-reduces every leaf of ``tree`` over the MPI communicator (one device per process).

    Call it on process-local arrays, eagerly or inside a single-device ``jax.jit``.

    Args:
      tree: a pytree of floating-point arrays.
      op: 'sum' or 'mean'.
      comm: an mpi4py communicator, default ``MPI.COMM_WORLD``.

    Returns:
      The reduced tree (same structure, shapes and dtypes). MPI has no 16-bit float type, so
      float16/bfloat16 leaves are sent and summed as float32.

    Example:
      >>> g = jax.jit(lambda t: mpi_allreduce(t, op='mean'))(grads)   # under mpirun
    """
    mpi, mpi4jax = _mpi()
    check_op(op)
    check_float_tree(tree)
    comm = mpi.COMM_WORLD if comm is None else comm
    size = comm.Get_size()

    def reduce(x):
        x = jnp.asarray(x)
        # MPI has no 16-bit float type (mpi4jax: "Unknown MPI type for dtype float16"):
        # half-precision leaves travel and are summed as f32, twice their bytes.
        wire = jnp.float32 if x.dtype.itemsize < 4 else x.dtype
        y = mpi4jax.allreduce(x.astype(wire), op=mpi.SUM, comm=comm)
        return (y / size if op == "mean" else y).astype(x.dtype)

    return jax.tree.map(reduce, tree)


def mpi_sync_gradients(*, comm: Any = None) -> optax.GradientTransformation:
    """optax transform averaging gradients over MPI ranks (one device per process).

    Use it in a per-process ``jax.jit`` step, not in ``jaxcomm.data_parallel`` (which runs
    inside ``shard_map`` over several devices, where mpi4jax cannot run).

    Args:
      comm: an mpi4py communicator, default ``MPI.COMM_WORLD``.

    Returns:
      An ``optax.GradientTransformation`` with empty state.

    Example:
      >>> tx = optax.chain(mpi_sync_gradients(), optax.sgd(0.1))
    """
    _mpi()  # fail at construction, with the install hint, when mpi4jax is missing

    def update(grads, state, params=None):
        del params
        return mpi_allreduce(grads, op="mean", comm=comm), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
