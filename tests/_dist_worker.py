"""Worker for tests/test_launch.py, run under ``python -m jaxcomm.tools.launch`` (not a test).

Each process builds its devices' rows from a seed, all-reduces them with 'flat' and
'hierarchical', and checks both against the numpy sum of every process's rows.
It also checks that ``DataParallel.init`` refuses initial params that differ between
processes. ``JC_TEST_PEER_SIGNAL=<sig>`` makes process 1 send itself that signal after
the first check.
"""

import os
import sys

import jaxcomm

jaxcomm.init_distributed(collective_timeout_s=10, heartbeat_timeout_s=10)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N = 1003  # not a multiple of the intra size: exercises the padding path
mesh = jaxcomm.make_mesh()
nproc, ldev = jax.process_count(), jax.local_device_count()
rows = [
    np.random.default_rng(100 + r).standard_normal(N).astype(np.float32)
    for r in range(nproc * ldev)
]
me = jax.process_index()
spec = NamedSharding(mesh, P(("inter", "intra")))
x = jax.make_array_from_process_local_data(spec, np.stack(rows[me * ldev : (me + 1) * ldev]))
want = np.sum(rows, axis=0)


def reduce_fn(alg):
    return jax.jit(
        jax.shard_map(
            lambda v: jaxcomm.allreduce(v[0], algorithm=alg, op="sum")[None],
            mesh=mesh,
            in_specs=P(("inter", "intra")),
            out_specs=P(("inter", "intra")),
        )
    )


got = {}
for alg in ("flat", "hierarchical", "ring", "tree", "halving_doubling"):
    out = reduce_fn(alg)(x)
    got[alg] = np.stack([np.asarray(s.data)[0] for s in out.addressable_shards])
    np.testing.assert_allclose(
        got[alg], np.broadcast_to(want, got[alg].shape), rtol=1e-5, atol=1e-5
    )
np.testing.assert_allclose(got["flat"], got["hierarchical"], rtol=1e-5, atol=1e-5)

# Regression for jax-ml/jax#40830 (gloo reduce-scatter returns a wrong tail for chunks above
# 256 KiB): hierarchical on 16 MiB per device must be right on every device, every time.
big_rows = [np.random.default_rng(200 + r).standard_normal(1 << 22, dtype=np.float32)
            for r in range(nproc * ldev)]  # fmt: skip
big = jax.make_array_from_process_local_data(spec, np.stack(big_rows[me * ldev : (me + 1) * ldev]))
big_want = np.sum(big_rows, axis=0)
hier = reduce_fn("hierarchical")
for _ in range(5):
    for shard in hier(big).addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data)[0], big_want, rtol=1e-4, atol=1e-4)
# check_replicas across processes: digests of every device's copy are exchanged, so every
# process sees a divergence that lives only on process 1's devices.
ok = jax.device_put(np.arange(5, dtype=np.float32), NamedSharding(mesh, P()))
jaxcomm.check_replicas({"ok": ok}, mesh=mesh)
copies = [jax.device_put(np.arange(5, dtype=np.float32) + (me == 1), s.device)
          for s in ok.addressable_shards]  # fmt: skip
bad = jax.make_array_from_single_device_arrays((5,), ok.sharding, copies)
try:
    jaxcomm.check_replicas({"bad": bad}, mesh=mesh)
    raise SystemExit("check_replicas missed a divergence on process 1")
except jaxcomm.ReplicaDivergenceError as e:
    assert e.paths == ["['bad']"], e.paths
    assert f"inter={nproc - 1}" in str(e) or nproc == 1, str(e)
# Outcomes are exchanged without a collective; a step that one process cannot compile
# fails on every process (none runs it alone and waits in its collectives).
assert jaxcomm.distributed.agree("worker", None if me == 0 else "bad") == [None, "bad"]


def loss(p, b):
    if jax.process_index() == 1:
        raise ValueError("no model on process 1")
    return jax.numpy.mean((b["x"] @ p) ** 2)


dp = jaxcomm.data_parallel(loss, optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), mesh)
try:
    dp(dp.init(np.ones(3, np.float32)), {"x": np.ones((2 * ldev, 3), np.float32)})
    raise SystemExit("a step that process 1 cannot compile ran")
except (ValueError, RuntimeError) as e:
    want = "no model on process 1" if me == 1 else "process 1 could not compile"
    assert want in str(e), str(e)


# Step outputs by their kind across processes: per-example values gathered in global batch
# order, counts summed, the loss averaged (and the step compiles without ordering hazards).
def aux_loss(p, b):
    pred = b["x"] @ p
    count = jax.numpy.sum(pred > 0)
    return jax.numpy.mean(pred**2), {"pred": pred, "positive": jaxcomm.outputs.sum(count)}


dp = jaxcomm.data_parallel(
    aux_loss, optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)), mesh, has_aux=True
)
w = np.array([1.0, -2.0, 0.5], np.float32)
xs = np.random.default_rng(7).standard_normal((2 * nproc * ldev, 3)).astype(np.float32)
mine = xs[me * 2 * ldev : (me + 1) * 2 * ldev]
_, m = dp(dp.init(w), {"x": mine})
local = {k: np.asarray(v.addressable_shards[0].data) for k, v in m.items()}
np.testing.assert_allclose(local["pred"], xs @ w, rtol=1e-5, atol=1e-6)
assert int(local["positive"]) == int(np.sum(xs @ w > 0)), local["positive"]
np.testing.assert_allclose(local["loss"], np.mean((xs @ w) ** 2), rtol=1e-5)

# Initial params drawn from a per-process seed would train divergent replicas: refused
# by DataParallel.init on every process, naming the process that differs.
dp = jaxcomm.data_parallel(
    lambda p, b: jax.numpy.mean((b["x"] @ p) ** 2),
    optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1)),
    mesh,
)
dp.init(np.ones(3, np.float32))  # the same on every process: accepted
try:
    dp.init(np.random.default_rng(me).standard_normal(3).astype(np.float32))
    raise SystemExit("initial params that differ between processes were accepted")
except ValueError as e:
    assert "the initial params and model state differ between processes" in str(e), str(e)
    assert "processes [1]" in str(e) and "one seed" in str(e), str(e)


# Decisions taken on each process's host (jaxcomm.HostPhase): local SGD's branch and an
# adaptive rung, from the replicated state. Every process runs the same programs (a
# mismatch would hang or fail the collectives), and they equal the program that decides
# on the devices. (Not in the dead-peer runs, which time the stop.)
def mse(p, b):
    return jax.numpy.mean((b["x"] @ p) ** 2)


if not os.environ.get("JC_TEST_PEER_SIGNAL"):
    climbing = jaxcomm.compression.adaptive(
        0.0, min_compression=0.0, max_compression=1.0, adjustment_step=1,
        ladder=("f32", "bf16", "int8"), stochastic=False, error_low=0.5, error_high=0.9,
    )  # fmt: skip
    for tx in (
        jaxcomm.local_sgd(optax.sgd(0.1), sync_every=2),
        optax.chain(jaxcomm.sync_gradients(compression=climbing, min_size=0), optax.sgd(0.1)),
    ):
        dp = jaxcomm.data_parallel(mse, tx, mesh)
        a = b = dp.init(w)
        on_device = dp.compile(a, {"x": mine}, phase=jaxcomm.HostPhase())
        for _ in range(4):
            a, _ = dp(a, {"x": mine})
            b, _ = on_device(b, dp.shard_batch({"x": mine}))
        np.testing.assert_allclose(
            np.asarray(a.params.addressable_shards[0].data),
            np.asarray(b.params.addressable_shards[0].data),
            rtol=2e-6,
        )
        assert not np.array_equal(np.asarray(a.params.addressable_shards[0].data), w)
    adaptive_state = jaxcomm.compression.adaptive_states(a.opt_state)[0]
    assert int(np.asarray(adaptive_state.level.addressable_shards[0].data)) == 2, adaptive_state
print(f"CHECK_OK process={me} mesh={dict(mesh.shape)}", flush=True)

sig = os.environ.get("JC_TEST_PEER_SIGNAL")
if sig and me == 1:
    os.kill(os.getpid(), int(sig))
if sig:
    f = reduce_fn("flat")
    for _ in range(5):
        f(x).block_until_ready()
    print("UNEXPECTED_SUCCESS", flush=True)
sys.exit(0)
