"""jaxcomm's PowerSGD against PyTorch's ``powerSGD_hook``, transcribed to numpy here.

The transcription (:class:`Hook`) follows ``torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py`` (torch 2.x) line by line for one DDP bucket holding every gradient, on
all ranks at once (a leading axis of ``W`` ranks); torch is not a test dependency.
:func:`torch_layout` turns a Flax leaf into the tensor torch would hold (outputs first:
``(out, in, kh, kw)`` for a conv kernel, ``(out, in)`` for a dense one), and the hook gets
jaxcomm's initial ``Q`` (rows permuted to torch's) instead of its seeded ``torch.randn``.

Both run the same per-device gradients for several steps, the hook's
``start_powerSGD_iter`` as ``sync_gradients(warmup_steps=...)``; the means agree within
f32 rounding (the hook's own, measured by running it in f64 too), with PowerSGD over every
device and hierarchical (``compress_stage='inter'``), whose node means give the same sums.
One leaf's gradient is exactly zero at the first compressed step (a zero-initialised
residual branch), then low rank: jaxcomm's warm start kept that matrix at zero for ever
before its ``Q`` restart.
"""

import jax
import numpy as np
import pytest
from helpers import AX, assert_rows_equal, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.compression.powersgd import matrix_shape

W = 8  # the 2 x 4 mesh's devices: the hook's world size
START = 2  # the hook's start_powerSGD_iter, jaxcomm's warmup_steps
STEPS = 5
ZERO_LEAF = "d_zero_then_low_rank"
# Flax shapes, keys in tree order. At rank 4 and min_compression_rate 2 the hook compresses
# the conv kernel, the dense kernels and ZERO_LEAF, and all-reduces the bias, the small
# matrix and (16, 16), whose r (n + m) 2 = n m is not *below* n m.
SHAPES = {
    "a_conv": (3, 3, 8, 16),
    "b_dense": (48, 24),
    "c_bias": (24,),
    ZERO_LEAF: (40, 20),
    "e_small": (6, 5),
    "f_even": (16, 16),
}


def torch_perm(ndim: int) -> list[int]:
    """Axes of a Flax leaf in torch's order: outputs, inputs, then the spatial axes."""
    return list(range(ndim)) if ndim < 2 else [ndim - 1, ndim - 2, *range(ndim - 2)]


def torch_layout(x: np.ndarray, batch: int = 0) -> np.ndarray:
    """The Flax leaf ``x`` (after ``batch`` leading axes) as torch holds it."""
    perm = torch_perm(x.ndim - batch)
    return np.transpose(x, [*range(batch), *[batch + a for a in perm]])


def flax_layout(x: np.ndarray, batch: int = 0) -> np.ndarray:
    """Inverse of :func:`torch_layout`."""
    inv = np.argsort(torch_perm(x.ndim - batch))
    return np.transpose(x, [*range(batch), *[batch + int(a) for a in inv]])


def q_in_torch_rows(q: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """jaxcomm's ``Q`` of a Flax leaf (rows over ``shape[:-1]``, row-major) with its rows in
    the order of torch's ``view(out, -1)`` columns (``in`` first, then the spatial axes)."""
    r = q.shape[-1]
    lead = q.reshape(*shape[:-1], r)
    perm = [len(shape) - 2, *range(len(shape) - 2), len(shape) - 1]
    return np.transpose(lead, perm).reshape(-1, r)


def orthogonalize(m: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """The hook's ``_orthogonalize``: Gram-Schmidt at rank <= 2 (``epsilon`` 0 by default),
    else ``torch.linalg.qr`` (reduced)."""
    m = m.copy()
    if m.shape[1] > 2:
        return np.linalg.qr(m)[0]
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col /= np.linalg.norm(col) + epsilon
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest -= np.sum(col * rest, axis=0) * col
    return m


class Hook:
    """``PowerSGDState`` + ``powerSGD_hook`` for one bucket, all ``W`` ranks at once.

    ``step(grads)`` takes each leaf's per-rank gradients ``(W, *torch_shape)`` and returns
    each leaf's synchronised gradient (the same on every rank, so one copy).
    """

    def __init__(self, rank, start, initial_q, min_compression_rate=2.0, dtype=np.float32):
        self.rank, self.start, self.min_rate, self.dtype = rank, start, min_compression_rate, dtype
        self.initial_q = initial_q  # leaf index -> (m, r), for the first compressed step
        self.iter, self.error, self.q = 0, None, None

    def step(self, grads):
        grads = [g.astype(self.dtype) for g in grads]
        w = grads[0].shape[0]
        if self.iter < self.start:  # default._allreduce_fut: divide, then all-reduce
            self.iter += 1
            return [(g / w).sum(0) for g in grads]
        sizes = [int(np.prod(g.shape[1:])) for g in grads]
        bucket = np.concatenate([g.reshape(w, -1) for g in grads], axis=1)
        if self.error is None:  # use_error_feedback: zeros at the first compressed step
            self.error = np.zeros_like(bucket)
        else:
            bucket = bucket + self.error
        bucket_cp = bucket.copy()
        offsets = np.cumsum([0, *sizes])
        tensors = [
            bucket[:, a:b].reshape(g.shape)
            for a, b, g in zip(offsets[:-1], offsets[1:], grads, strict=True)
        ]
        compress, plain = [], []
        for i, t in enumerate(tensors):
            n, m = t.shape[1], sizes[i] // t.shape[1]
            r = min(n, m, self.rank)
            (compress if (n + m) * r * self.min_rate < n * m else plain).append(i)
        out = [None] * len(grads)
        for i in plain:  # all-reduced as a batch, divided by the world size
            out[i] = tensors[i].sum(0) / w
        if self.q is None:  # the first compressed step: random Q, orthogonalized
            qs = [orthogonalize(self.initial_q[i].astype(self.dtype)) for i in compress]
        else:  # warm start: last step's Q, orthogonalized
            qs = [orthogonalize(q) for q in self.q]
        mats = [tensors[i].reshape(w, tensors[i].shape[1], -1) for i in compress]
        ps = [np.matmul(mt, q).sum(0) for mt, q in zip(mats, qs, strict=True)]  # all-reduce: a sum
        ps = [orthogonalize(p) for p in ps]
        self.q = [
            np.matmul(np.swapaxes(mt, 1, 2), p).sum(0) / w for mt, p in zip(mats, ps, strict=True)
        ]
        for i, p, q in zip(compress, ps, self.q, strict=True):
            out[i] = (p @ q.T).reshape(tensors[i].shape[1:])
        # every rank's bucket now holds the means; the error is what its copy had more
        after = np.concatenate([o.reshape(1, -1) for o in out], axis=1)
        self.error = bucket_cp - after
        self.iter += 1
        return out


def gradients(rng) -> list[dict]:
    """Per-device Flax gradients of each step ``(W, *shape)``; ZERO_LEAF's are zero at the
    first compressed step and rank 2 in the mean after (a shared basis)."""
    n, m = SHAPES[ZERO_LEAF]
    u, v = rng.normal(size=(n, 2)), rng.normal(size=(2, m))
    steps = []
    for t in range(STEPS):
        g = {k: rng.normal(size=(W, *s)) for k, s in SHAPES.items()}
        coef = rng.normal(size=(W, 2, 1))
        g[ZERO_LEAF] = np.zeros((W, n, m)) if t == START else (u[None] @ (coef * v[None]))
        steps.append({k: x.astype(np.float32) for k, x in g.items()})
    return steps


@pytest.fixture(scope="module", params=["all", "inter"])
def runs(mesh, request):
    """jaxcomm's means of every step on every device, and its initial ``Q`` per leaf:
    flat PowerSGD, and hierarchical (``compress_stage='inter'``: the node's mean first)."""
    sync = jaxcomm.gradient_sync(
        compression=jaxcomm.compression.powersgd(rank=4, max_padding=0.0),
        warmup_steps=START,
        min_size=0,
        compress_stage=request.param,
    )

    def run(grads):
        state = sync.init(jax.tree.map(lambda x: x[0, 0], grads))
        q0 = state.compression.q
        means = []
        for t in range(STEPS):
            mean, state = sync.reduce(jax.tree.map(lambda x, t=t: x[0, t], grads), state)
            means.append(jax.tree.map(lambda x: x[None], mean))
        return means, q0

    steps = gradients(np.random.default_rng(0))
    stacked = {k: np.stack([s[k] for s in steps], 1) for k in SHAPES}  # (W, STEPS, ...)
    fn = jax.jit(shard(run, mesh, in_specs=P(AX), out_specs=(P(AX), P())))
    means, q0 = fn(per_device(mesh, stacked))
    return steps, [jax.device_get(m) for m in means], [np.asarray(q) for q in q0]


def hook_means(steps, q0, dtype):
    """The transcribed hook's means of every step, in Flax layout."""
    keys = list(SHAPES)
    compressed = [k for k in keys if len(SHAPES[k]) > 1 and k not in ("e_small", "f_even")]
    assert len(q0) == len(compressed)  # one batch per shape (max_padding=0), in tree order
    initial = {}
    for k, q in zip(compressed, q0, strict=True):
        n, _ = matrix_shape(SHAPES[k])
        assert q.shape == (1, n, 4)
        initial[keys.index(k)] = q_in_torch_rows(q[0], SHAPES[k])
    hook = Hook(rank=4, start=START, initial_q=initial, dtype=dtype)
    out = []
    for g in steps:
        means = hook.step([torch_layout(g[k].astype(dtype), batch=1) for k in keys])
        out.append({k: flax_layout(x) for k, x in zip(keys, means, strict=True)})
    return out


def test_powersgd_agrees_with_the_hook_transcription(runs):
    steps, means, q0 = runs
    want64 = hook_means(steps, q0, np.float64)  # the exact reference
    hook32 = hook_means(steps, q0, np.float32)  # the hook's own f32 rounding
    for t in range(STEPS):
        assert_rows_equal(means[t])  # every device holds the same bits
        for k in SHAPES:
            got, want = means[t][k][0], want64[t][k]
            scale = np.abs(want).max()
            if scale == 0:  # ZERO_LEAF at the first compressed step
                assert not np.asarray(got).any(), (t, k)
                continue
            err = np.abs(got - want).max() / scale
            own = np.abs(hook32[t][k] - want).max() / scale
            # Within f32 rounding: jaxcomm's error from the exact hook is of the order of
            # the hook's own in f32 (the QR of P, conditioned like M, dominates both).
            assert err <= max(4 * own, 64 * np.finfo(np.float32).eps), (t, k, err, own)
    # the zero-then-low-rank matrix is sent whole once its gradient is rank 2 again
    for t in range(START + 1, STEPS):
        want = steps[t][ZERO_LEAF].astype(np.float64).mean(0)
        np.testing.assert_allclose(means[t][ZERO_LEAF][0], want, rtol=0, atol=1e-5)
