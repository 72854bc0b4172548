"""The golden cases: every option of the gradient sync on fixed inputs (not a test module).

Each case trains the small MLP of ``tests/mlp.py`` (its params and batches, with ReLU and a
squared error: :func:`_loss`; the Flax front ends a Flax twin of it) with the public API
only, for ``STEPS`` steps on fixed batches from fixed params, and records every leaf of the
final state (params, optimizer state, step) and of the last metrics.
``tests/test_golden.py`` compares them with the recorded ones in one process (a 2 x 4 mesh
of fake devices) and in two processes on loopback (2 x 2), so a refactoring of the core is
checked bit for bit.

Bitwise or within a tolerance. The records hold a digest of every leaf, its values, and
:func:`elementary_digest` of the recording platform (XLA:CPU's bits for a long sum, a dot,
tanh, exp and log). Where this platform's elementary digest equals the recording's, every
case is compared bit for bit, except a case whose step calls LAPACK (:attr:`Case.ulps`):
``jnp.linalg.qr`` on the CPU runs the QR of the LAPACK SciPy ships (OpenBLAS, which picks its
kernels by the CPU it loads on: ``OPENBLAS_CORETYPE=Haswell`` changes PowerSGD's bits here,
as an AMD EPYC did), so PowerSGD is compared within :data:`POWERSGD_ULPS`. Where the
elementary digest differs (XLA:CPU sums in the order of the instruction set's vector width
and uses FMA where the CPU has it: ``--xla_cpu_max_isa=SSE4_2``, a CPU without AVX or FMA),
no case keeps the recorded bits but by chance: each is compared within
:data:`ELEMENTARY_ULPS` (plus its own tolerance), except the cases that round
(:attr:`Case.rounds`), which are run but not compared there. The model (:func:`_loss`) and
the optimizer (momentum SGD) keep that tolerance small: no transcendental functions, nothing
that divides by a small gradient. Seen so far: the records of an AVX-512 Intel Xeon pass
bit for bit with ``--xla_cpu_max_isa=AVX2``, and on an AMD EPYC all but PowerSGD did.

The records are bound to XLA:CPU and to the JAX version in use: regenerate them with
``JAXCOMM_GOLDEN_WRITE=1 python -m pytest tests/test_golden.py`` and name every intended
change of bits in the commit that changes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import FAST_COMPILE, f16_converts
from mlp import mlp_batches, mlp_init

import jaxcomm

C = jaxcomm.compression
STEPS = 3
GOLDEN_DIR = Path(__file__).with_name("golden")
# One optimisation level for every case: the records depend on it, not the refactoring.
FAST = FAST_COMPILE
F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23: one ulp of f32 at 1.0

# PowerSGD's tolerance, in ulps of f32 relative to each leaf's largest recorded magnitude:
#     |got - want| <= POWERSGD_ULPS * F32_EPS * max(|want|)   (elementwise, per leaf)
# The CPU-dependent steps are LAPACK's Householder QRs of the warm-start Q and of P = M^T Q
# (n x r each, n <= 32 rows of the MLP's matrices, rank r = 2) in f32. A QR's backward error
# is ~ n * r * u * ||P|| (Higham, Thm 19.4; u = F32_EPS / 2), so two CPUs' kernels, each
# within that of the exact QR, differ by up to 2 * n * r * u = n * r ulps of P's scale per
# QR; each step adds its own, and the sync's mean, the low-rank product and the optimizer
# carry it to every leaf at about that scale: POWERSGD_ULPS = n * r * 2 (the two QRs) *
# STEPS = 384.
# Measured with OPENBLAS_CORETYPE (Haswell, Core2, Prescott, Cooperlake against the
# SkylakeX recording): at most 13.4 ulps of a leaf's scale. A real change is larger: a
# learning rate 1e-4 relative higher moves a leaf 722 ulps (caught), 1e-5 higher 72 ulps
# (within what the CPU's LAPACK may do: not caught).
POWERSGD_ROWS, POWERSGD_RANK = 32, 2
POWERSGD_ULPS = POWERSGD_ROWS * POWERSGD_RANK * 2 * STEPS

ONE, BOTH = ("one_process",), ("one_process", "two_processes")  # the settings


class Case(NamedTuple):
    """One golden case.

    Attributes:
      run: ``run(mesh) -> pytree`` trains on ``mesh`` and returns what is recorded.
      ulps: None: compared bit for bit on a platform with the recording's elementary
        digest. Else the tolerance in ulps of f32 relative to each leaf's largest recorded
        magnitude (see :data:`POWERSGD_ULPS`): the case's bits depend on the CPU.
      f16: the case converts to float16 (skipped where XLA:CPU cannot, see
        :func:`f16_converts`).
      rounds: the step rounds f32 values (a codec, a top-k choice, adaptive's rungs): not
        compared where the platform's elementary digest differs (see ELEMENTARY_ULPS).
      processes: the settings it runs in (``'one_process'``, ``'two_processes'``).
    """

    run: Callable[[Any], Any]
    ulps: int | None = None
    f16: bool = False
    rounds: bool = False
    processes: tuple[str, ...] = BOTH


def _batches(steps: int = STEPS) -> list[dict]:
    """The global batches; with several processes each gets its own contiguous part (the rows
    of its devices, in mesh order), as ``data_parallel`` takes them."""
    n = jax.process_count()
    batches = mlp_batches(steps, seed=1, size=16)
    if n == 1:
        return batches
    k = jax.process_index()
    return [jax.tree.map(lambda x: np.split(x, n)[k], b) for b in batches]


def _loss(params: list[dict], batch: dict) -> jax.Array:
    """The MLP of ``tests/mlp.py`` with ReLU and a squared error to the one-hot labels: no
    tanh, exp or log, whose XLA:CPU bits depend on the CPU having FMA (see the module
    docstring). Every op is IEEE-rounded (add, multiply, divide, sqrt, max) or a dot."""
    h = batch["x"]
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.maximum(h, 0.0)
    return jnp.mean((h - jax.nn.one_hot(batch["y"], h.shape[-1])) ** 2)


def _opt() -> optax.GradientTransformation:
    # Momentum SGD, not Adam: Adam's bias correction b**t is a pow (exp and log).
    return optax.sgd(0.05, momentum=0.9)


def _dp_run(make_tx: Callable[[], optax.GradientTransformation], kwargs: dict, mesh: Any) -> Any:
    dp = jaxcomm.data_parallel(_loss, make_tx(), mesh, compiler_options=FAST, **kwargs)
    state = dp.init(mlp_init(jax.random.key(0)))
    metrics = None
    for batch in _batches():
        state, metrics = dp(state, batch)
    return {"state": state, "metrics": metrics}


def _dp(make_tx: Callable[[], optax.GradientTransformation], **kw: Any) -> Callable:
    return functools.partial(_dp_run, make_tx, kw)


def _sync(**kw: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: optax.chain(jaxcomm.sync_gradients(min_size=64, **kw), _opt())


def _sharded_sync(**kw: Any) -> Callable[[], optax.GradientTransformation]:
    # The sharded step reduce-scatters each packed buffer whole: no min_size.
    return lambda: optax.chain(jaxcomm.sync_gradients(**kw), _opt())


def _local(**kw: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: jaxcomm.local_sgd(optax.sgd(0.05), min_size=64, **kw)


# -- the Flax front ends and the pmap port, on a Flax twin of the MLP ----------------------


def _flax_tx() -> optax.GradientTransformation:
    return optax.chain(jaxcomm.sync_gradients(min_size=64), _opt())


def _xent(out: jax.Array, y: jax.Array) -> jax.Array:
    """:func:`_loss`'s squared error (named for the role: the models' loss)."""
    return jnp.mean((out - jax.nn.one_hot(y, out.shape[-1])) ** 2)


def _nnx_run(mesh: Any) -> Any:
    """``nnx_data_parallel``: a Linear-ReLU-Dropout-Linear model (dropout: the per-device
    keys), an ``nnx.Optimizer`` with the sync first, the loss returned."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(12, 32, rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)
            self.out = nnx.Linear(32, 3, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(self.dropout(nnx.relu(self.hidden(x))))

    def body(model: Net, optimizer: nnx.Optimizer, batch: dict) -> dict:
        loss, grads = nnx.value_and_grad(lambda m: _xent(m(batch["x"]), batch["y"]))(model)
        optimizer.update(model, grads)
        return {"loss": loss}

    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, _flax_tx(), wrt=nnx.Param)
    step = jaxcomm.nnx_data_parallel(mesh)(body)
    for batch in _batches():
        metrics = step(model, optimizer, batch)
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "metrics": metrics}


def _linen_module() -> Any:
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
            h = nn.Dropout(0.25, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
            return nn.Dense(3)(h)

    return Net()


def _linen_state() -> Any:
    from flax.training import train_state

    class State(train_state.TrainState):
        key: jax.Array

    model = _linen_module()
    params = model.init(jax.random.key(0), jnp.ones((2, 12)), train=False)["params"]
    return State.create(apply_fn=model.apply, params=params, key=jax.random.key(1), tx=_flax_tx())


def _linen_step(state: Any, batch: dict) -> tuple[Any, dict]:
    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params: Any) -> jax.Array:
        out = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
        return _xent(out, batch["y"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _linen_run(mesh: Any) -> Any:
    """``linen_data_parallel``: a TrainState with a dropout key, folded per device by the
    front end. (No BatchNorm: with 2 examples per device its statistics amplify the last
    bit of the inputs a thousandfold.)"""
    step = jaxcomm.linen_data_parallel(mesh)(_linen_step)
    state = _linen_state()
    for batch in _batches():
        state, metrics = step(state, batch)
    return {"state": state, "metrics": metrics}


def _pmap_step(state: Any, batch: dict) -> tuple[Any, dict]:
    """A ``jax.pmap`` script's step, ported: the gradient mean is the sync's, the metrics'
    ``lax.pmean`` over the script's axis name stays."""

    def loss_fn(params: Any) -> jax.Array:
        logits = state.apply_fn({"params": params}, batch["x"])
        return _xent(logits, batch["y"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": jax.lax.pmean(loss, "batch")}


def _pmap_run(mesh: Any) -> Any:
    """``pmap_data_parallel``: pmap's layouts in and out (a replicated TrainState, batches of
    one row per device, metrics one row per device)."""
    import flax.linen as nn
    from flax import jax_utils
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(3)(nn.relu(nn.Dense(32)(x)))

    model = Net()
    params = model.init(jax.random.key(0), jnp.ones((2, 12)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_flax_tx())
    state = jax_utils.replicate(state)
    step = jaxcomm.pmap_data_parallel(mesh, axis_name="batch")(_pmap_step)
    d = jax.device_count()
    for batch in _batches():
        state, metrics = step(state, jax.tree.map(lambda x: x.reshape(d, -1, *x.shape[1:]), batch))
    return {"state": state, "metrics": metrics}


# The Flax front ends take the global batch on every process today, and that contract is
# being changed (issue 41, item 5): they are recorded in one process only, where what they
# compute is settled (and the two-process run stays short).

#: name -> case. ``kind:variant``; ``test_golden_cases_cover_every_option`` checks the kinds
#: against the library's own lists.
CASES: dict[str, Case] = {
    **{f"alg:{a}": Case(_dp(_sync(algorithm=a))) for a in jaxcomm.collectives.ALGORITHMS},
    "comp:bf16": Case(_dp(_sync(compression=C.bf16())), rounds=True),
    "comp:fp16": Case(_dp(_sync(compression=C.fp16())), f16=True, rounds=True),
    "comp:int8": Case(_dp(_sync(compression=C.int8(block=32))), rounds=True),
    "comp:int4": Case(_dp(_sync(compression=C.int4(block=32))), rounds=True),
    "comp:int8_error_feedback": Case(
        _dp(_sync(compression=C.int8(block=32, error_feedback=True))), rounds=True
    ),
    "comp:topk": Case(_dp(_sync(compression=C.topk(0.1))), rounds=True),
    "comp:random_k": Case(_dp(_sync(compression=C.random_k(0.25)))),
    "comp:powersgd": Case(
        _dp(_sync(compression=C.powersgd(rank=POWERSGD_RANK))), ulps=POWERSGD_ULPS
    ),
    "comp:adaptive": Case(
        _dp(_sync(compression=C.adaptive(0.5, adjustment_step=1, error_low=0.2, error_high=0.3))),
        rounds=True,
    ),
    "stage:int8_inter_hierarchical": Case(
        _dp(_sync(algorithm="hierarchical", compression=C.int8(block=32), compress_stage="inter")),
        rounds=True,
    ),
    "stage:int4_inter_ring": Case(
        _dp(_sync(algorithm="ring", compression=C.int4(block=32), compress_stage="inter")),
        rounds=True,
    ),
    "warmup:int8": Case(_dp(_sync(compression=C.int8(block=32), warmup_steps=1)), rounds=True),
    "buckets:fixed": Case(_dp(_sync(bucket_bytes=(256, 1024)))),
    "buckets:auto_int8": Case(
        _dp(_sync(bucket_bytes="auto", compression=C.int8(block=32))), rounds=True
    ),
    "microbatches:2": Case(_dp(_sync(algorithm="hierarchical"), microbatches=2)),
    "local_sgd:h2": Case(_dp(_local(sync_every=2))),
    "local_sgd:h2_int8_fragments2": Case(
        _dp(_local(sync_every=2, fragments=2, compression=C.int8(block=32))), rounds=True
    ),
    # shard_optimizer=True with every param_gather it takes (None: f32 gathers); small
    # buckets so the 515 params make several buffers; the int8 gathers with int8
    # reduce-scatters of the gradients (ZeRO++'s qgZ + qwZ). The bf16 and int4 gathers
    # differ from int8's only in the codec each device runs: one process is enough for them.
    **{
        f"shard:gather_{name}": Case(
            _dp(
                _sharded_sync(compression=C.int8(block=32) if name == "int8" else None),
                shard_optimizer=True,
                param_gather=None if name == "none" else getattr(C, name)(),
                shard_bucket_bytes=1024,
            ),
            rounds=name != "none",
            processes=ONE if name in ("bf16", "int4") else BOTH,
        )
        for name in ("none", "bf16", "int8", "int4")
    },
    "front:nnx_data_parallel": Case(_nnx_run, processes=ONE),
    "front:linen_data_parallel": Case(_linen_run, processes=ONE),
    "front:pmap_data_parallel": Case(_pmap_run, processes=ONE),
}


@functools.cache
def cases_to_run(setting: str) -> tuple[list[str], dict[str, str]]:
    """The cases of ``setting`` that can run here, and the skipped ones with the reason."""
    names = [n for n, c in CASES.items() if setting in c.processes]
    skipped = {}
    if not f16_converts():
        skipped = {
            n: "XLA:CPU here cannot convert float16 (XLA_FLAGS --xla_cpu_max_isa?)"
            for n in names
            if CASES[n].f16
        }
    return [n for n in names if n not in skipped], skipped


# -- records -------------------------------------------------------------------------------


def _parts(x: Any) -> list[np.ndarray]:
    """A leaf's bits on this process: every addressable copy, in device order."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
        return [np.asarray(s.data) for s in shards]
    return [np.asarray(x)]


def _leaf_digest(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in parts:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()[:24]


def _leaves(tree: Any) -> dict[str, list[np.ndarray]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): _parts(x) for path, x in flat}


def digests(tree: Any) -> dict[str, str]:
    """Leaf path -> digest of its bits on this process."""
    return {k: _leaf_digest(p) for k, p in _leaves(tree).items()}


class Record(NamedTuple):
    """What one setting records: the digests of every case and the values of the cases that
    do not round (``'case|leaf'`` -> the leaf's addressable copies stacked, or one copy where
    they are all equal)."""

    digests: dict[str, dict[str, str]]
    values: dict[str, np.ndarray]


def run_cases(names: list[str], mesh: Any) -> Record:
    """Runs ``names`` on ``mesh``; one :class:`Record` of their final states and metrics."""
    table, values = {}, {}
    for name in names:
        leaves = _leaves(CASES[name].run(mesh))
        table[name] = {k: _leaf_digest(p) for k, p in leaves.items()}
        if CASES[name].rounds:  # compared only bit for bit: the digests suffice
            continue
        for k, p in leaves.items():
            same = all(q.tobytes() == p[0].tobytes() for q in p)
            values[f"{name}|{k}"] = p[0][None] if same else np.stack(p)
    return Record(table, values)


@functools.cache
def elementary_digest() -> str:
    """Digest of XLA:CPU's f32 results for a long sum, a dot, tanh, exp and log on fixed
    inputs, compiled as the cases are: what every case's bits depend on. XLA:CPU vectorises
    a reduction by the instruction set's vector width (the order of the sum) and evaluates
    tanh/exp/log with FMA where the CPU has it, so ``--xla_cpu_max_isa=SSE4_2`` or a CPU
    without AVX or FMA gives other bits (AVX2 and AVX-512 give these). Where this equals the
    recording's, every case must match bit for bit."""
    x = np.linspace(-4.0, 4.0, 4099, dtype=np.float32)
    m = x[:384].reshape(12, 32)
    fns = (jnp.sum, lambda v: m @ (m.T @ v), jnp.tanh, jnp.exp, lambda v: jnp.log(v * v + 1))
    args = (x, x[32:44, None] * np.ones((1, 5), np.float32), x, x, x)
    outs = [jax.jit(f, compiler_options=FAST)(a) for f, a in zip(fns, args, strict=True)]
    return _leaf_digest([np.asarray(o) for o in outs])


# Where the platform's elementary digest differs from the recording's, a case can keep the
# recorded bits only by chance, so each is compared within ELEMENTARY_ULPS of f32 relative
# to each leaf's scale. Why 2 * 32 * STEPS: a sum of n terms in another order moves by up
# to ~n * u of the sum of their magnitudes (u = F32_EPS / 2), n <= 32 here (the hidden width,
# the 16 rows of a batch, the 8 devices); the model is made of such sums and IEEE-rounded
# ops (_loss), and momentum SGD is linear in the gradient, so each of the STEPS steps adds
# ~n ulps of a leaf's scale; 2x for the dot's two passes (forward, backward). Measured,
# SSE4_2 against the AVX-512 recording: <= 8.3 ulps. The cases that round (a codec, a top-k
# choice, a rung of adaptive) are not compared there: an element within that of a rounding
# boundary flips to the next level, a change of a whole quantum, and whether one does is the
# platform's, not the code's (Case.rounds).
ELEMENTARY_ULPS = 2 * 32 * STEPS


def tolerances(names: list[str], platform_matches: bool) -> dict[str, int | None]:
    """Case -> its tolerance in ulps here (None: bit for bit); without the cases that round
    where the platform does not match (they cannot be compared there)."""
    out = {}
    for n in names:
        case = CASES[n.split("/")[-1]]
        if platform_matches:
            out[n] = case.ulps
        elif not case.rounds:
            out[n] = (case.ulps or 0) + ELEMENTARY_ULPS
    return out


def _close(case: str, leaf: str, a: np.ndarray, b: np.ndarray, ulps: int) -> str | None:
    """The difference of ``a`` from the recorded ``b`` beyond ``ulps``, or None."""
    if a.shape != b.shape and b.shape[0] == 1:  # recorded as one copy: all were equal
        b = np.broadcast_to(b, a.shape)
    if a.shape != b.shape and a.shape[0] == 1:
        a = np.broadcast_to(a, b.shape)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{case} {leaf}: shape or dtype differs from the record (re-record)"
    if not np.issubdtype(b.dtype, np.floating):
        return None if np.array_equal(a, b) else f"{case} {leaf}: integers differ (exact)"
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = float(np.max(np.abs(b64))) if b64.size else 0.0
    bound = ulps * F32_EPS * scale
    err = float(np.max(np.abs(a64 - b64))) if b64.size else 0.0
    if err <= bound:  # NaN fails
        return None
    return (
        f"{case} {leaf}: max |got - want| {err:.3g} > {ulps} ulps of its scale {scale:.3g}"
        f" ({bound:.3g}): {err / (F32_EPS * scale or 1):.0f} ulps"
    )


def compare(got: Record, want: Record, tolerance: dict[str, int | None]) -> list[str]:
    """The differences of ``got`` from ``want`` over ``got``'s cases, one line each (empty:
    equal). ``tolerance``: case -> ulps (None: bit for bit); a case not in it is not
    compared."""
    problems = [f"{c}: not recorded (re-record)" for c in got.digests if c not in want.digests]
    for case in sorted(set(got.digests) & set(want.digests) & set(tolerance)):
        mine, theirs = got.digests[case], want.digests[case]
        if sorted(mine) != sorted(theirs):
            problems.append(f"{case}: leaves differ: {sorted(set(mine) ^ set(theirs))}")
            continue
        ulps = tolerance.get(case)
        for leaf in sorted(theirs):
            key = f"{case}|{leaf}"
            a, b = got.values.get(key), want.values.get(key)
            if ulps is None:
                if mine[leaf] != theirs[leaf]:
                    diff = ""
                    if a is not None and b is not None and a.shape[1:] == b.shape[1:]:
                        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                        diff = f", max |got - want| {float(d.max()) if d.size else 0.0:.3g}"
                    problems.append(f"{case} {leaf}: bits differ (compared bit for bit{diff})")
                continue
            if a is None or b is None:
                problems.append(f"{case} {leaf}: no recorded value (re-record)")
                continue
            problem = _close(case, leaf, a, b, ulps)
            if problem:
                problems.append(problem)
    return problems


def golden_path(setting: str, suffix: str = "json") -> Path:
    """The recorded digests (``json``) or values (``npz``) of ``setting`` (``'one_process'``,
    ``'two_processes'``), or the recording platform's (``'platform'``)."""
    return GOLDEN_DIR / f"{setting}.{suffix}"


def platform_matches() -> bool:
    """Whether this platform's elementary functions have the recording's bits."""
    recorded = json.loads(golden_path("platform").read_text())
    return recorded["elementary_digest"] == elementary_digest()


def load(setting: str) -> Record:
    table = json.loads(golden_path(setting).read_text())
    with np.load(golden_path(setting, "npz")) as npz:
        values = {k: npz[k] for k in npz.files}
    return Record(table, values)


def save(setting: str, record: Record) -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    golden_path(setting).write_text(json.dumps(record.digests, indent=1, sort_keys=True) + "\n")
    with golden_path(setting, "npz").open("wb") as f:
        np.savez_compressed(f, **record.values)
    platform = {"elementary_digest": elementary_digest(), "jax": jax.__version__}
    golden_path("platform").write_text(json.dumps(platform, indent=1, sort_keys=True) + "\n")
