"""PowerSGD's batches: matrices of different shapes, zero-padded into shared batches, give
what the algorithm gives one matrix at a time (a float64 numpy reference), and the padding
stays exactly zero in the state; the bytes that cross a node's link, flat and hierarchical.
(Against PyTorch's powerSGD_hook: tests/test_powersgd_hook.py.)"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AX, ROOT, abstract_per_device, per_device, sharded, state_specs
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.compression import ReduceContext
from jaxcomm.compression.powersgd import matrix_shape, shape_groups
from jaxcomm.state import stack_local, unstack_local

C = jaxcomm.compression
RANK = 2
# Matrix views (16, 12) x3, (10, 12), (12, 8), (24, 5): with max_padding=1 one batch
# (24, 12) pads rows, columns or both; with 0 a batch per shape.
SHAPES = [(16, 12), (10, 12), (16, 12), (3, 4, 8), (24, 5), (16, 12)]


def _reference(xs, qs, es):
    """One PowerSGD step per matrix in float64: (means, new Q, new per-device residuals)."""
    outs, new_q, new_e = [], [], []
    for x, q, e in zip(xs, qs, es, strict=True):
        c = x + e  # (devices, n, m)
        q = np.linalg.qr(q)[0]  # (n, r), orthonormal before use
        qr, r = np.linalg.qr((np.swapaxes(c, 1, 2) @ q).mean(0))  # P = M^T Q: (m, r)
        p = qr * (np.abs(np.diagonal(r)) > 0)
        q_local = c @ p  # (devices, n, r)
        q_mean = q_local.mean(0)
        outs.append(q_mean @ p.T)
        new_q.append(q_mean)
        new_e.append(c - q_local @ p.T)
    return outs, new_q, new_e


@pytest.mark.parametrize("max_padding, batches", [(1.0, 1), (0.0, 4)])
def test_padded_batches_equal_the_per_matrix_algorithm(mesh, max_padding, batches):
    comp = C.powersgd(rank=RANK, max_padding=max_padding)
    dims = [(*matrix_shape(s), RANK) for s in SHAPES]
    groups = shape_groups(dims, max_padding=max_padding)
    assert len(groups) == batches
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES]
    sspecs = state_specs(lambda: comp.init(specs), mesh)
    init = sharded(lambda: stack_local(comp.init(specs)), mesh, in_specs=(), out_specs=sspecs)

    def local(xs, state, step):
        ctx = ReduceContext(AX, "hierarchical", step, jax.random.key(0))
        out, new = comp.reduce([x[0] for x in xs], unstack_local(state), ctx)
        return [o[None] for o in out], stack_local(new)

    step = sharded(local, mesh, in_specs=(P(AX), sspecs, P()), out_specs=(P(AX), sspecs))
    state = init()
    # the padded rows of the initial Q are zero; its real rows are each leaf's own Q
    qs = []
    for i, (n, _, _) in enumerate(dims):
        k = next(k for k, g in enumerate(groups) if i in g)
        stack = np.asarray(state.q[k])[groups[k].index(i)]
        assert not stack[n:].any()
        qs.append(stack[:n].astype(np.float64))
    es = [np.zeros((8, n, m)) for n, m, _ in dims]
    rng = np.random.default_rng(0)
    for t in range(2):  # the second step starts from the first one's Q and residuals
        xs = [rng.normal(size=(8, *s)).astype(np.float32) for s in SHAPES]
        out, state = step(per_device(mesh, xs), state, jnp.int32(t))
        flat = [
            x.reshape(8, n, m).astype(np.float64) for x, (n, m, _) in zip(xs, dims, strict=True)
        ]
        ref_out, qs, es = _reference(flat, qs, es)
        for o, ref, s in zip(out, ref_out, SHAPES, strict=True):
            o = np.asarray(o)
            assert o.shape == (8, *s)
            for d in range(8):  # every device holds the same mean
                np.testing.assert_allclose(o[d].reshape(ref.shape), ref, rtol=1e-4, atol=1e-4)
        for k, g in enumerate(groups):
            n_pad = max(dims[i][0] for i in g)
            m_pad = max(dims[i][1] for i in g)
            q = np.asarray(state.q[k])
            res = np.asarray(state.residual.value[k]).reshape(8, len(g), n_pad, m_pad)
            for j, i in enumerate(g):
                n, m, _ = dims[i]
                np.testing.assert_allclose(q[j, :n], qs[i], rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(res[:, j, :n, :m], es[i], rtol=1e-4, atol=1e-4)
                # zero padding stays exactly zero: nothing leaks into the real block
                assert not q[j, n:].any()
                assert not res[:, j, n:].any() and not res[:, j, :, m:].any()


def test_shape_groups_merge_within_the_padding_budget():
    dims = [(*matrix_shape(s), RANK) for s in SHAPES]
    assert shape_groups(dims) == [[0, 2, 5], [1], [3], [4]]
    real = sum(n * m for n, m, _ in dims)
    for budget in (0.05, 0.2, 0.5, 1.0):
        groups = shape_groups(dims, max_padding=budget)
        padded = sum(
            len(g) * max(dims[i][0] for i in g) * max(dims[i][1] for i in g) for g in groups
        )
        assert padded - real <= budget * real
        assert sorted(i for g in groups for i in g) == list(range(len(dims)))
    # another rank never shares a batch
    assert shape_groups([(4, 3, 2), (4, 3, 1)], max_padding=10.0) == [[0], [1]]
    with pytest.raises(ValueError, match="max_padding=-1"):
        C.powersgd(max_padding=-1)


_RESNET18_STEP = """
import jax, jax.numpy as jnp, numpy as np, optax
import jaxcomm
from jaxcomm.models.resnet import gradient_shapes
rng = np.random.default_rng(0)
shapes = [x.shape for x in jax.tree.leaves(gradient_shapes("resnet18", 10))]
params = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
def loss(p, b):
    return sum(jnp.sum(v * jnp.mean(b)) + jnp.sum(v * v) for v in p)
tx = optax.chain(jaxcomm.sync_gradients(compression=jaxcomm.compression.powersgd(rank=4)),
                 optax.sgd(1e-3))
dp = jaxcomm.data_parallel(loss, tx, jaxcomm.make_mesh(intra=2))
state = dp.init(params)
for _ in range(2):
    state, _ = dp(state, dp.shard_batch(np.arange(16, dtype=np.float32).reshape(4, 4)))
print("finite", all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state.params)))
"""


def test_resnet18_shapes_on_four_cpu_devices_do_not_deadlock():
    """ResNet-18's 62 gradient matrices, stacked into batches of QRs, on 4 fake CPU
    devices: XLA:CPU's batched LAPACK QR deadlocked its thread pool there (jaxlib 0.10.2,
    2 cores); the CPU row orthogonalizes a batch one QR at a time (backend item 9)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", _RESNET18_STEP], env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert p.returncode == 0 and "finite True" in p.stdout, (p.stdout + p.stderr)[-3000:]


# Flax shapes whose factors at rank 4 divide by the 4 devices of a node (no padding).
CROSSING_SHAPES = {"conv": (3, 3, 16, 32), "dense": (64, 48), "bias": (48,)}


@pytest.mark.parametrize("stage", ["inter", "all"])
def test_factors_cross_nodes_with_the_hooks_bytes(mesh, stage):
    """What crosses a node's link (2 nodes of 4 devices) is what PyTorch's powerSGD_hook
    with one rank per node sends: an all-reduce of every P, one of every Q and one of the
    uncompressed leaves. Hierarchical PowerSGD (compress_stage='inter') averages the
    gradients inside the node first and sends each device's quarter of the factors over
    'inter'; 'all' (with the default 'hierarchical' algorithm) reduce-scatters each
    device's own factors inside the node instead. Every stage is in the HLO census."""
    sync = jaxcomm.gradient_sync(
        compression=C.powersgd(rank=4, max_padding=0.0), compress_stage=stage, min_size=0
    )

    def run(g):
        g = jax.tree.map(lambda x: x[0], g)
        return sync.reduce(g, sync.init(g))[0]

    fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(AX), out_specs=P()))
    args = {k: abstract_per_device(mesh, s) for k, s in CROSSING_SHAPES.items()}
    wb = jaxcomm.wire_bytes(fn, args, mesh=mesh)
    nodes, g = mesh.shape["inter"], mesh.shape["intra"]
    # the hook's P and Q per compressed matrix, torch's view (outputs first): out x r, rest x r
    p_floats = sum(4 * s[-1] for s in CROSSING_SHAPES.values() if len(s) > 1)
    q_floats = sum(4 * int(np.prod(s[:-1])) for s in CROSSING_SHAPES.values() if len(s) > 1)
    plain = CROSSING_SHAPES["bias"][0]
    ring = 2 * (nodes - 1) / nodes  # a ring all-reduce among the nodes
    hook = ring * 4 * (p_floats + q_floats + plain)
    assert wb["crossing"]["inter"] == hook, (wb["crossing"], hook)
    census = [(c["kind"], tuple(c["axes"]), c["operand_bytes"]) for c in wb["collectives"]]
    across = sorted(b for k, axes, b in census if "inter" in axes)
    # each device's 1/g of P, of Q and of the bias: nothing else crosses
    assert across == sorted([4 * p_floats / g, 4 * q_floats / g, 4 * plain / g]), census
    gathered = sorted(b for k, axes, b in census if k == "all-gather" and axes == ("intra",))
    assert gathered[-2:] == sorted([4 * p_floats / g, 4 * q_floats / g]), census
    grads = 4 * sum(int(np.prod(s)) for s in CROSSING_SHAPES.values() if len(s) > 1)
    inside = sum(b for k, axes, b in census if k == "all-reduce" and axes == ("intra",))
    # 'inter': the node's mean of the compressed gradients, in full precision inside it
    assert inside == (grads if stage == "inter" else 0), census
