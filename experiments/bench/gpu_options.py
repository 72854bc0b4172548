"""The ``options`` part of ``python -m experiments.bench gpu``: every sync option, compiled and run.

One small model (an MLP on flattened 32 x 32 x 3 images, so that compiles stay short)
trained with the public API for each option of :data:`OPTION_NAMES`:
``jaxcomm.data_parallel`` with ``optax.chain(jaxcomm.sync_gradients(...), optax.sgd)``, or
``jaxcomm.local_sgd``. ``flat`` uses ``algorithm='flat'``; every other option the library's
default ``'hierarchical'``; ``bf16``, ``int8``, ``int4`` and ``adaptive`` compress the inter
stage only (``compress_stage='inter'``).

* **Compile** (:func:`compile_options`): the step of every option compiled for a
  2 x 4 mesh of 8 mocked GPUs (``jax_mock_gpu_topology``, default ``1x8x1``: 8 mocked hosts of
  one GPU, as the schedule part mocks them, since XLA requires the mock's GPUs per host to
  equal the real machine's; the mesh is built directly from the 8 devices, so an ``intra``
  group spans mocked hosts, which changes which links XLA would use, not the schedule it
  writes). Recorded per option: compile time, kernels (compute instructions outside fused
  and async-wrapped computations: each one a launch on GPU) and fusions, collectives, how
  many are async start/done pairs and the compute ops between each pair
  (:func:`jaxcomm.tools.schedule.parse_schedule`, as the schedule part reads them), collectives
  inside conditional branches, and the host round trips per step (:func:`host_round_trips`).
  Runs in its own process (the mocked GPU client must be configured before any backend
  exists); with ``--allow-cpu`` it compiles for 8 fake CPU devices instead (synchronous
  collectives: no async pairs there).
* **Run** (:func:`run_options`): on one real device (a 1 x 1 mesh still runs every
  codec), each option's step: compile time, best and median step time of rounds of
  back-to-back steps, images/s, speed against ``flat``; and :func:`repeat_bits`: the same
  steps run twice from the same state with the same batches, the resulting params and
  optimizer state compared bit for bit.

Host round trip rule (:func:`host_round_trips`): on XLA:GPU a ``conditional`` copies its
predicate or branch index to the host before it can launch a branch, so every executed
``conditional`` is one round trip; a ``while`` whose trip count XLA knows
(``known_trip_count`` in its backend config, set for a fixed-trip ``scan``/``fori_loop``)
runs that many iterations without reading its predicate back, so it is none; a ``while``
without a known trip count reads its predicate back every iteration (counted once, a lower
bound). Round trips inside a loop body count once per known iteration. The CPU row's
materialising conditional (``jaxcomm.hlo.is_materializing``) is not one: it exists only
where the host runs the program. Goals: no round trip in the program of every step on an
option that does not need one (only ``adaptive``, whose codec follows a measured error,
and ``local_sgd``, which syncs every ``sync_every`` steps, branch on a value of the step);
none in any option's steady-state programs (:func:`steady_phases`: the programs the step
picks on the host once warm, one per ``jaxcomm.HostPhase``); and every collective async.

Example:
  PYTHONPATH=. python -m experiments.bench gpu --out $OUT/gpu --parts options
  python -m experiments.bench.gpu_options compile --variant cpu --json /tmp/c.json --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DEFAULT",
    "NEEDS_ROUND_TRIP",
    "OPTION_NAMES",
    "TINY",
    "Config",
    "build",
    "compile_options",
    "count_kernels",
    "format_table",
    "host_round_trips",
    "repeat_bits",
    "run_options",
    "summarize",
]

MiB = 1 << 20

#: Every sync option, in table order.
OPTION_NAMES = (
    "flat", "hierarchical", "bf16", "int8", "int4", "adaptive", "powersgd", "topk",
    "buckets", "microbatches", "local_sgd", "warmup",
)  # fmt: skip
#: Options whose step branches on a value (measured error, step count): a round trip is
#: their design, not a defect.
NEEDS_ROUND_TRIP = frozenset({"adaptive", "local_sgd"})


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the model and the runs.

    Attributes:
      in_dim: input features (3072: a flattened 32 x 32 x 3 image).
      hidden: hidden layer widths.
      classes: output classes.
      per_device_batch: images per device per step.
      bucket_bytes: ``(min, max)`` bucket bytes of the ``buckets`` option.
      min_size: ``sync_gradients(min_size=...)`` (leaves below it are not compressed).
      warmup: steps after compiling, before timing.
      rounds: timed rounds.
      steps: back-to-back steps per timed round.
      repeat_steps: steps of each of the two runs compared bit for bit.
      local_every: ``local_sgd(sync_every=...)``.
    """

    in_dim: int = 3072
    hidden: tuple[int, ...] = (2048, 2048, 2048)
    classes: int = 10
    per_device_batch: int = 256
    bucket_bytes: tuple[int, int] = (MiB, 10 * MiB)
    min_size: int = 1024
    warmup: int = 3
    rounds: int = 3
    steps: int = 10
    repeat_steps: int = 3
    local_every: int = 4


#: On a GPU: 14.7M parameters (59 MB f32).
DEFAULT = Config()
#: The CPU dry run: the plumbing, not the numbers.
TINY = Config(
    in_dim=32, hidden=(64, 64), classes=10, per_device_batch=4, bucket_bytes=(2048, 8192),
    min_size=64, warmup=1, rounds=2, steps=2, repeat_steps=2, local_every=2,
)  # fmt: skip


def _option(name: str, cfg: Config) -> dict[str, Any]:
    """``{'sync': kwargs | None, 'local': kwargs | None, 'dp': kwargs}`` of an option."""
    import jaxcomm

    C = jaxcomm.compression
    inter = {"compress_stage": "inter"}
    sync: dict[str, Any] = {
        "flat": {"algorithm": "flat"},
        "hierarchical": {},
        "bf16": {"compression": C.bf16(), **inter},
        "int8": {"compression": C.int8(), **inter},
        "warmup": {"compression": C.int8(), "warmup_steps": 2, **inter},
        "int4": {"compression": C.int4(), **inter},
        # The ablation's +compression row (experiments/rows.py ADAPTIVE), minus its driver.
        "adaptive": {
            "compression": C.adaptive(
                0.75,
                min_compression=0.0,
                max_compression=1.0,
                ladder=("f32", "bf16", "int8", "int4"),
                adjustment_step=2,
                block=64,
                stochastic=False,
            ),
            **inter,
        },  # fmt: skip
        "powersgd": {"compression": C.powersgd(rank=4)},
        "topk": {"compression": C.topk(0.01)},
        "buckets": {"bucket_bytes": tuple(cfg.bucket_bytes)},
        "microbatches": {},
        "local_sgd": None,
    }[name]
    if sync is not None:
        sync = {"min_size": cfg.min_size, **sync}
    local = {"sync_every": cfg.local_every} if name == "local_sgd" else None
    dp = {"microbatches": 2} if name == "microbatches" else {}
    return {"sync": sync, "local": local, "dp": dp}


def _init_params(cfg: Config, seed: int = 0) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    sizes = [cfg.in_dim, *cfg.hidden, cfg.classes]
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b), jnp.float32) / (a**0.5), "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _loss(params, batch):
    import jax
    import jax.numpy as jnp
    import optax

    h = batch["x"]
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _batches(cfg: Config, devices: int, n: int, seed: int = 0) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    b = cfg.per_device_batch * devices
    return [
        {
            "x": rng.normal(size=(b, cfg.in_dim)).astype(np.float32),
            "y": rng.integers(0, cfg.classes, b).astype(np.int32),
        }
        for _ in range(n)
    ]


def build(name: str, cfg: Config, mesh: Any, compiler_options: dict | None = None) -> Any:
    """The ``jaxcomm.DataParallel`` step of option ``name`` on ``mesh``.

    Args:
      name: one of :data:`OPTION_NAMES`.
      cfg: the sizes.
      mesh: an ``('inter', 'intra')`` mesh.
      compiler_options: XLA options of the step.

    Returns:
      The ``DataParallel`` (``dp.init(params)``, ``dp(state, batch)``).

    Raises:
      KeyError: an unknown option name.
    """
    import optax

    import jaxcomm

    if name not in OPTION_NAMES:
        raise KeyError(f"unknown option {name!r}; choose from {list(OPTION_NAMES)}")
    o = _option(name, cfg)
    lr = 0.05
    if o["local"] is not None:
        tx = jaxcomm.local_sgd(optax.sgd(lr), **o["local"])
    else:
        tx = optax.chain(jaxcomm.sync_gradients(**o["sync"]), optax.sgd(lr))
    return jaxcomm.data_parallel(_loss, tx, mesh, compiler_options=compiler_options, **o["dp"])


def steady_phases(name: str, cfg: Config) -> list[Any]:
    """The :class:`jaxcomm.HostPhase` s of the programs option ``name`` runs once warm
    (``jaxcomm.data_parallel`` picks one per step on the host): every rung of adaptive's
    ladder, local SGD's sync step and the steps between, int8 after its warm-up; the one
    program of every step for the other options (``HostPhase()``)."""
    import jaxcomm

    if name == "adaptive":
        rungs = len(_option(name, cfg)["sync"]["compression"].name.split(","))
        return [jaxcomm.HostPhase(codec_choice=r) for r in range(rungs)]
    if name == "local_sgd":
        every = cfg.local_every
        return [jaxcomm.HostPhase(local_sgd=(b, every, 1)) for b in (0, 1)]
    if name == "warmup":
        return [jaxcomm.HostPhase(warming_up=False)]
    return [jaxcomm.HostPhase()]


# --------------------------------------------------------------------------- HLO readers

_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_NOT_KERNELS = frozenset({"while", "conditional", "call"})


def _callees(opcode: str, rest: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind, name in _CALLS.findall(rest):
        out.setdefault(kind, []).append(name)
    bm = _BRANCH_LIST.search(rest)
    if bm:
        out["branches"] = [b.strip().lstrip("%") for b in bm.group(1).split(",") if b.strip()]
    else:
        for key in ("true_computation", "false_computation"):
            m = re.search(rf"{key}=%?([\w.\-]+)", rest)
            if m:
                out.setdefault("branches", []).append(m.group(1))
    return out


def count_kernels(text: str) -> dict[str, int]:
    """Kernels and fusions of optimized HLO text.

    A kernel is a compute instruction (not bookkeeping, not communication, not control
    flow: :data:`jaxcomm.tools.schedule.NON_COMPUTE`) in a computation that is not the body of a
    fusion, an async wrapper or a reducer (``to_apply``); on GPU each one is a launch.

    Args:
      text: ``compiled.as_text()``.

    Returns:
      ``{'kernels': n, 'fusions': n}``, counted statically (a loop body once).
    """
    from jaxcomm.hlo import instructions
    from jaxcomm.tools.schedule import NON_COMPUTE

    comps = instructions(text)
    inner: set[str] = set()
    for instrs in comps.values():
        for _, opcode, rest in instrs:
            called = _callees(opcode, rest)
            if opcode in ("fusion", "async-start") or opcode.endswith("-start"):
                inner.update(called.get("calls", []))
            if opcode != "call":  # a reducer; a call's body (e.g. a command buffer) runs
                inner.update(called.get("to_apply", []))
    kernels = fusions = 0
    for comp, instrs in comps.items():
        if comp in inner:
            continue
        for _, opcode, _ in instrs:
            if opcode in NON_COMPUTE or opcode in _NOT_KERNELS:
                continue
            kernels += 1
            fusions += opcode == "fusion"
    return {"kernels": kernels, "fusions": fusions}


def host_round_trips(text: str) -> dict[str, Any]:
    """Host round trips per step of optimized HLO text (the rule in the module docstring).

    Walks from the entry computation: a ``conditional`` is one round trip plus the most of
    its branches; a ``while`` with ``known_trip_count`` n is n times its body and condition;
    one without is one round trip plus its body and condition once (a lower bound).

    Args:
      text: ``compiled.as_text()``.

    Returns:
      ``per_step`` (the walk's count), ``conditionals`` and ``whiles_unknown_trip`` /
      ``whiles_known_trip`` (static counts over the computations reached), ``lower_bound``
      (a while without a known trip count was reached) and ``sites`` (``'computation:
      instruction opcode'`` of each conditional and unknown-trip while).
    """
    from jaxcomm.hlo import instructions, is_materializing

    comps = instructions(text)
    entry_m = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    entry = entry_m.group(1) if entry_m else next(iter(comps), "")
    static = {"conditionals": 0, "whiles_unknown_trip": 0, "whiles_known_trip": 0}
    sites: list[str] = []
    seen: set[str] = set()
    memo: dict[str, int] = {}

    def walk(comp: str, stack: tuple[str, ...]) -> int:
        if comp in memo:
            return memo[comp]
        if comp in stack:
            return 0
        first = comp not in seen
        seen.add(comp)
        total = 0
        for name, opcode, rest in comps.get(comp, []):
            called = _callees(opcode, rest)
            sub = (*stack, comp)
            if opcode == "conditional":
                branches = [walk(b, sub) for b in called.get("branches", [])]
                if is_materializing(rest):
                    total += max(branches, default=0)  # XLA:CPU's buffer: the host runs it
                    continue
                if first:
                    static["conditionals"] += 1
                    sites.append(f"{comp}: {name} conditional")
                total += 1 + max(branches, default=0)
            elif opcode == "while":
                inner = sum(
                    walk(c, sub) for c in called.get("body", []) + called.get("condition", [])
                )
                trip = _TRIP.search(rest)
                if trip:
                    static["whiles_known_trip"] += first
                    total += int(trip.group(1)) * inner
                else:
                    if first:
                        static["whiles_unknown_trip"] += 1
                        sites.append(f"{comp}: {name} while (trip count unknown)")
                    total += 1 + inner
            elif opcode == "call":
                total += sum(
                    walk(c, sub) for c in called.get("to_apply", []) + called.get("calls", [])
                )
        memo[comp] = total
        return total

    per_step = walk(entry, ())
    return {
        "per_step": per_step,
        **static,
        "lower_bound": static["whiles_unknown_trip"] > 0,
        "sites": sites,
    }


def _branch_computations(text: str) -> set[str]:
    """Every computation that runs under a conditional (its branches and what they call)."""
    from jaxcomm.hlo import instructions

    comps = instructions(text)
    calls: dict[str, list[str]] = {}
    roots: list[str] = []
    for comp, instrs in comps.items():
        for _, opcode, rest in instrs:
            called = _callees(opcode, rest)
            roots += called.get("branches", []) if opcode == "conditional" else []
            calls.setdefault(comp, []).extend(c for v in called.values() for c in v)
    out: set[str] = set()
    todo = list(roots)
    while todo:
        c = todo.pop()
        if c not in out:
            out.add(c)
            todo += calls.get(c, [])
    return out


def analyze(text: str, mesh: Any = None) -> dict[str, Any]:
    """Kernels, collectives, async pairs, compute between them and host round trips of
    one compiled step's HLO text (what the compile half records per option)."""
    from jaxcomm.tools.schedule import parse_schedule

    rep = parse_schedule(text, mesh)
    branched = _branch_computations(text)
    colls = rep.collectives
    return {
        **count_kernels(text),
        "collectives": len(colls),
        "async": sum(s.is_async for s in colls),
        "overlapped": sum(s.overlapped for s in colls),
        "in_branches": sum(s.computation in branched for s in colls),
        "collective_rows": [
            {
                "kind": s.collective.kind,
                "axes": list(s.collective.axes or []),
                "dtype": s.collective.dtype,
                "async": s.is_async,
                "ops_between": s.ops_between,
                "in_branch": s.computation in branched,
            }
            for s in colls
        ],
        "round_trips": host_round_trips(text),
    }


# --------------------------------------------------------------------------- compile half


def compile_options(
    names: Sequence[str],
    cfg: Config,
    mesh: Any,
    *,
    compiler_options: dict | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict[str, dict]:
    """Compiles every option's step for ``mesh`` (abstract arrays: nothing runs).

    Args:
      names: options of :data:`OPTION_NAMES`.
      cfg: the sizes (the global batch is ``per_device_batch`` x the mesh's devices).
      mesh: the mesh (8 mocked GPUs in a 2 x 4 mesh, or 8 fake CPU devices).
      compiler_options: XLA options of every compile.
      on_result: called with the results so far after each option.

    Returns:
      ``{option: analyze(...) + compile_s, lower_s}``, or ``{'error': ...}`` for an option
      that failed to build or compile.
    """
    import jax
    import jax.numpy as jnp

    from experiments.bench.schedule import _abstract, abstract_state

    n = mesh.devices.size
    params = jax.eval_shape(lambda: _init_params(cfg))
    batch = {
        "x": jax.ShapeDtypeStruct((cfg.per_device_batch * n, cfg.in_dim), jnp.float32),
        "y": jax.ShapeDtypeStruct((cfg.per_device_batch * n,), jnp.int32),
    }
    out: dict[str, dict] = {}
    for name in names:
        try:
            dp = build(name, cfg, mesh)
            state = abstract_state(dp, params)
            b = _abstract(batch, jax.tree.map(lambda _, d=dp: d.batch_sharding, batch))
            t0 = time.perf_counter()
            lowered = dp.step_fn(state).lower(state, b)
            t1 = time.perf_counter()
            compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
            t2 = time.perf_counter()
            out[name] = {
                "lower_s": t1 - t0,
                "compile_s": t2 - t1,
                **analyze(compiled.as_text(), mesh),
                "steady": _steady_round_trips(dp, state, b, name, cfg, compiler_options),
            }
        except Exception as e:  # one option failing does not stop the others
            out[name] = _error_record(e)
        if on_result is not None:
            on_result(out)
    return out


def _steady_round_trips(dp, state, batch, name: str, cfg: Config, options) -> dict:
    """Host round trips per step of each program the option runs once warm
    (:func:`steady_phases`), compiled as the step compiles them; ``None`` for the
    program of every step (``HostPhase()``), analyzed already."""
    import jaxcomm

    rows = []
    for phase in steady_phases(name, cfg):
        rt = None
        if phase != jaxcomm.HostPhase():
            lowered = dp.step_fn(state, phase=phase).lower(state, batch)
            compiled = lowered.compile(options) if options else lowered.compile()
            rt = host_round_trips(compiled.as_text())
        rows.append({"phase": repr(phase), "round_trips": rt})
    return {"phases": rows}


def _error_record(e: Exception) -> dict:
    """One option's failure, as the table and the JSON report it."""
    import traceback

    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}


def _compile_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.gpu_options compile")
    p.add_argument("--variant", choices=("gpu", "cpu"), required=True)
    p.add_argument("--mock-topology", default="1x8x1")
    p.add_argument("--json", required=True)
    p.add_argument("--options", default=",".join(OPTION_NAMES))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--extra-options", default=None, help="JSON dict of XLA options")
    a = p.parse_args(argv)
    import jax
    import numpy as np

    if a.variant == "gpu":
        jax.config.update("jax_mock_gpu_topology", a.mock_topology)
        jax.config.update("jax_platforms", "cuda")
    else:
        jax.config.update("jax_platforms", "cpu")
        try:
            jax.config.update("jax_num_cpu_devices", 8)
        except Exception:
            pass
    from jax.sharding import AxisType, Mesh

    from jaxcomm import xla

    devs = jax.devices()
    if len(devs) != 8:
        raise SystemExit(f"the compile half needs 8 devices, found {len(devs)}")
    # Built directly: make_mesh refuses intra groups across (mocked) hosts.
    mesh = Mesh(np.array(devs, dtype=object).reshape(2, 4), ("inter", "intra"),
                axis_types=(AxisType.Explicit, AxisType.Explicit))  # fmt: skip
    opts = json.loads(a.extra_options) if a.extra_options else {}
    dropped = None
    try:
        opts = xla.check_options(opts)
    except xla.XlaOptionError as e:
        dropped, opts = str(e), {}
    cfg = TINY if a.tiny else DEFAULT
    head = {
        "variant": a.variant,
        "platform": devs[0].platform,
        "devices": len(devs),
        "mock_topology": a.mock_topology if a.variant == "gpu" else None,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "compiler_options": opts,
        "dropped_options": dropped,
        "config": dataclasses.asdict(cfg),
        "jax": jax.__version__,
    }

    def write(results):
        tmp = f"{a.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({**head, "options": results}, f, indent=1, default=str)
        os.replace(tmp, a.json)

    write({})
    compile_options(a.options.split(","), cfg, mesh, compiler_options=opts or None, on_result=write)
    return 0


# --------------------------------------------------------------------------- run half


def _leaves_bytes(tree: Any) -> list[tuple[str, bytes]]:
    import jax
    import numpy as np

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, x in flat:
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        a = np.asarray(jax.device_get(x))
        out.append((jax.tree_util.keystr(path), a.tobytes()))
    return out


def repeat_bits(step: Callable, state: Any, batches: Sequence[Any]) -> dict[str, Any]:
    """Runs ``step`` over ``batches`` twice from the same ``state``; compares the bits.

    Args:
      step: ``step(state, batch) -> (state, metrics)``; must not donate ``state``.
      state: the starting state (a pytree).
      batches: the batches of each run.

    Returns:
      ``{'equal': bool, 'leaves': n, 'differing': [paths of leaves whose bytes differ]}``.
    """
    finals = []
    for _ in range(2):
        s = state
        for b in batches:
            s, _ = step(s, b)
        finals.append(_leaves_bytes(s))
    (a, b) = finals
    diff = [pa for (pa, xa), (_, xb) in zip(a, b, strict=True) if xa != xb]
    return {"equal": not diff, "leaves": len(a), "differing": diff[:20]}


def _time_steps(dp: Any, state: Any, batches: Sequence[Any], cfg: Config) -> dict[str, float]:
    import jax

    times = []
    for _ in range(cfg.rounds):
        t = time.perf_counter()
        for i in range(cfg.steps):
            state, m = dp(state, batches[i % len(batches)])
        jax.block_until_ready((state, m))
        times.append((time.perf_counter() - t) / cfg.steps)
    times.sort()
    return {"step_best_s": times[0], "step_median_s": times[len(times) // 2]}


def run_options(
    names: Sequence[str],
    cfg: Config,
    device: Any,
    *,
    on_result: Callable[[dict], None] | None = None,
    deadline: float | None = None,
) -> dict[str, dict]:
    """Runs every option's step on a 1 x 1 mesh of ``device``: times and bit repeats.

    Args:
      names: options of :data:`OPTION_NAMES`.
      cfg: the sizes.
      device: the device (one GPU; the CPU dry run passes a CPU device).
      on_result: called with the results so far after each option.
      deadline: a ``time.perf_counter()`` value; options not started by then are
        reported as not run.

    Returns:
      ``{option: {compile_s, warmup_s, step_best_s, step_median_s, images_per_s,
      repeat: repeat_bits(...)}}`` (``speed_vs_flat`` is added by :func:`summarize`), or
      ``{'error': ...}``.
    """
    import jax

    import jaxcomm

    mesh = jaxcomm.make_mesh(devices=[device])
    params = _init_params(cfg)
    out: dict[str, dict] = {}
    for name in names:
        if deadline is not None and time.perf_counter() > deadline:
            out[name] = {"error": "not run: the part's time limit was near"}
            if on_result is not None:
                on_result(out)
            continue
        try:
            dp = build(name, cfg, mesh)
            state0 = dp.init(params)
            batches = [dp.shard_batch(b) for b in _batches(cfg, 1, max(2, cfg.repeat_steps))]
            t = time.perf_counter()
            state, m = dp(state0, batches[0])
            jax.block_until_ready((state, m))
            compile_s = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(cfg.warmup):
                state, m = dp(state, batches[i % len(batches)])
            jax.block_until_ready((state, m))
            r = {"compile_s": compile_s, "warmup_s": time.perf_counter() - t}
            r.update(_time_steps(dp, state, batches, cfg))
            r["images_per_s"] = cfg.per_device_batch / r["step_best_s"]
            r["repeat"] = repeat_bits(dp, state0, batches[: cfg.repeat_steps])
            out[name] = r
        except Exception as e:
            out[name] = _error_record(e)
        if on_result is not None:
            on_result(out)
    return out


# --------------------------------------------------------------------------- the part


def summarize(compiled: dict[str, dict], runs: dict[str, dict], *, async_expected: bool) -> dict:
    """Per-option rows and the goals, computed from the compile and run results.

    Args:
      compiled: :func:`compile_options`' result (may be partial).
      runs: :func:`run_options`' result (may be partial).
      async_expected: whether collectives can be async at all (False on XLA:CPU, where
        they are synchronous: the goal is then reported as not applicable).

    Returns:
      ``{'rows': {option: {...}}, 'goals': {...}}``.
    """
    flat = runs.get("flat", {}).get("step_best_s")
    rows: dict[str, dict] = {}
    for name in OPTION_NAMES:
        c, r = compiled.get(name), runs.get(name)
        if c is None and r is None:
            continue
        row: dict[str, Any] = {"needs_round_trip": name in NEEDS_ROUND_TRIP}
        if c is not None and "error" not in c:
            rt = c["round_trips"]
            steady = _steady_trips(c, rt)
            row.update(
                compile_s=c["compile_s"], kernels=c["kernels"], fusions=c["fusions"],
                collectives=c["collectives"], async_pairs=c["async"],
                in_branches=c["in_branches"],
                ops_between=[x["ops_between"] for x in c["collective_rows"] if x["async"]],
                round_trips=rt["per_step"], round_trips_lower_bound=rt["lower_bound"],
                round_trip_sites=rt["sites"],
                ok_round_trips=rt["per_step"] == 0 or name in NEEDS_ROUND_TRIP,
                steady_round_trips=steady,
                ok_steady=None if steady is None else steady == 0,
                ok_all_async=(c["async"] == c["collectives"]) if async_expected else None,
            )  # fmt: skip
        elif c is not None:
            row["compile_error"] = c["error"]
        if r is not None and "error" not in r:
            row.update(
                step_best_s=r["step_best_s"], step_median_s=r["step_median_s"],
                images_per_s=r["images_per_s"], run_compile_s=r["compile_s"],
                speed_vs_flat=(flat / r["step_best_s"]) if flat else None,
                bits_equal=r["repeat"]["equal"], bits_differing=r["repeat"]["differing"],
            )  # fmt: skip
        elif r is not None:
            row["run_error"] = r["error"]
        rows[name] = row

    def every(key):
        vals = [row[key] for row in rows.values() if row.get(key) is not None]
        return all(vals) if vals else None

    goals = {
        "no host round trip on an option that does not need one": every("ok_round_trips"),
        "no host round trip in any option's steady-state programs": every("ok_steady"),
        "every collective async": every("ok_all_async"),
        "two runs from the same state: equal bits": every("bits_equal"),
        "options over the round-trip goal": sorted(
            n for n, row in rows.items() if row.get("ok_round_trips") is False
        ),
        "options with a round trip in steady state": sorted(
            n for n, row in rows.items() if row.get("ok_steady") is False
        ),
        "options with a synchronous collective": sorted(
            n for n, row in rows.items() if row.get("ok_all_async") is False
        ),
        "options whose bits differ": sorted(
            n for n, row in rows.items() if row.get("bits_equal") is False
        ),
    }
    return {"rows": rows, "goals": goals}


def _steady_trips(compiled: dict, every_step: dict) -> int | None:
    """The most host round trips per step among an option's steady-state programs (the
    program of every step where it is one of them)."""
    phases = (compiled.get("steady") or {}).get("phases")
    if not phases:
        return None
    return max(
        (every_step if p["round_trips"] is None else p["round_trips"])["per_step"] for p in phases
    )


def run_part(args: argparse.Namespace, emit: Callable[..., None], limit_s: float) -> None:
    """The ``options`` part: the compile half in a subprocess, the run half here.

    Args:
      args: ``python -m experiments.bench gpu``'s arguments (``out``, ``allow_cpu``,
        ``mock_topology``, ``options``, ``sequential``, ``fast_compile``).
      emit: records data (``emit(**items)``).
      limit_s: the part's time limit; the compile half is stopped before it.
    """
    import jax

    t_start = time.perf_counter()
    names = [n for n in (args.options or ",".join(OPTION_NAMES)).split(",") if n]
    unknown = [n for n in names if n not in OPTION_NAMES]
    if unknown:
        raise ValueError(f"--options {unknown}: choose from {list(OPTION_NAMES)}")
    cfg = TINY if args.allow_cpu else DEFAULT
    if getattr(args, "quick", False) and not args.allow_cpu:
        cfg = dataclasses.replace(cfg, rounds=2, steps=5)
    variant = "cpu" if args.allow_cpu else "gpu"
    raw = os.path.join(args.out, "parts", "options_compile.json")
    if os.path.exists(raw):
        os.remove(raw)
    cmd = [sys.executable, "-m", "experiments.bench.gpu_options", "compile", "--variant", variant,
           "--mock-topology", args.mock_topology, "--json", raw,
           "--options", ",".join(names)]  # fmt: skip
    if args.allow_cpu:
        cmd.append("--tiny")
    elif args.fast_compile:
        cmd += ["--extra-options", json.dumps({"xla_gpu_autotune_level": 0})]
    env = dict(os.environ)
    if args.allow_cpu:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # On a GPU the compile half runs alongside the timed half (it uses the host, little of
    # the GPU); on CPU (2 cores in CI) and with --sequential one after the other.
    concurrent = not args.allow_cpu and not args.sequential
    emit(
        config=dataclasses.asdict(cfg),
        variant=variant,
        compile_command=cmd,
        compile_concurrent_with_runs=concurrent,
        device_kind=jax.devices()[0].device_kind,
        rule=(
            "round trips per step: each conditional 1 (+ its costliest branch); a while with "
            "known_trip_count n: n x its body; a while without: 1 + its body once (lower bound)"
        ),
    )
    log = open(os.path.join(args.out, "parts", "options_compile.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    compiled: dict = {}
    runs: dict = {}

    def wait_compile() -> None:
        left = max(1.0, limit_s - 10 - (time.perf_counter() - t_start))
        killed = False
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            killed = True
            proc.kill()
            rc = proc.wait()
            emit(compile_error=f"compile half killed after {left:.0f} s (kept what it finished)")
        log.close()
        head = read_compiled()
        if rc != 0 and not killed:
            with open(log.name) as f:
                emit(compile_error=f"compile half exited {rc}: {f.read()[-2000:]}")
        emit(compile_info=head, compiled=compiled)

    def read_compiled() -> dict:
        """Merges what the compile half has written so far (it rewrites after each option)."""
        head: dict = {}
        try:
            with open(raw) as f:
                head = json.load(f)
        except (OSError, ValueError):  # not written yet
            return head
        compiled.update(head.pop("options", {}))
        return head

    def on_run(res: dict) -> None:
        runs.update(res)
        read_compiled()  # a part killed at its limit keeps the compiled rows too
        emit(runs=runs, **summarize(compiled, runs, async_expected=variant == "gpu"))

    if not concurrent:
        wait_compile()
    # Leave time to collect the compile half: options not started by then are reported.
    deadline = t_start + limit_s - 15
    run_options(names, cfg, jax.devices()[0], on_result=on_run, deadline=deadline)
    if concurrent:
        wait_compile()
    emit(**summarize(compiled, runs, async_expected=variant == "gpu"))


def format_table(d: dict) -> list[str]:
    """The printed table of the ``options`` part's data."""
    info = d.get("compile_info") or {}
    cfg = d.get("config") or {}
    lines = [
        f"  MLP {cfg.get('in_dim')}-{'-'.join(map(str, cfg.get('hidden') or []))}-"
        f"{cfg.get('classes')}, {cfg.get('per_device_batch')} images per device; compiled for "
        f"{info.get('devices')} {info.get('platform')} devices, mesh {info.get('mesh')}"
        f" (mock {info.get('mock_topology')}); run on one {d.get('device_kind')}",
        f"  {'option':<13} {'compile':>8} {'kern.':>5} {'fus.':>5} {'colls':>5} {'async':>5} "
        f"{'in br.':>6} {'trips':>5} {'steady':>6} {'step':>11} {'img/s':>9} {'vs flat':>7} "
        f"{'bits':>5}"
        "  ops between start/done",
    ]
    for name, r in (d.get("rows") or {}).items():
        if "compile_error" in r or "run_error" in r:
            err = r.get("compile_error") or r.get("run_error")
            lines.append(f"  {name:<13} FAILED: {str(err)[:90]}")
            if "run_error" in r and "compile_error" in r:
                continue
        trips = r.get("round_trips")
        trips_s = (
            "-" if trips is None else f"{trips}{'+' if r.get('round_trips_lower_bound') else ''}"
        )
        bits = r.get("bits_equal")
        vs = r.get("speed_vs_flat")
        ips = r.get("images_per_s")
        between = r.get("ops_between") or []
        between_s = ",".join("-" if x is None else str(x) for x in between[:12])
        lines.append(
            f"  {name:<13} {_s(r.get('compile_s')):>8} {_n(r.get('kernels')):>5} "
            f"{_n(r.get('fusions')):>5} {_n(r.get('collectives')):>5} "
            f"{_n(r.get('async_pairs')):>5} "
            f"{_n(r.get('in_branches')):>6} {trips_s:>5} {_n(r.get('steady_round_trips')):>6} "
            f"{_s(r.get('step_best_s')):>11} "
            f"{'-' if ips is None else f'{ips:.0f}':>9} {'-' if vs is None else f'{vs:.2f}x':>7} "
            f"{'-' if bits is None else ('same' if bits else 'DIFF'):>5}  {between_s}"
        )
    for goal, ok in (d.get("goals") or {}).items():
        lines.append(f"  goal: {goal}: {ok}")
    if d.get("compile_error"):
        lines.append(f"  compile half: {str(d['compile_error'])[:200]}")
    return lines


def _n(x: Any) -> str:
    return "-" if x is None else str(x)


def _s(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3f} ms" if x < 1 else f"{x:.2f} s"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compile":
        sys.exit(_compile_main(sys.argv[2:]))
    print(__doc__)
    sys.exit(2)
