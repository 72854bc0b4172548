"""Resume a run on another device count: what a restart on the nodes left keeps.

A checkpoint written on ``N`` devices (:class:`experiments.checkpoint.Checkpointer`) is
restored onto the ``M`` devices of a new step (:func:`restore`), or a live state is moved
to them (:func:`resize`, the same rule without a checkpoint). What is kept, and how:

* **params, batch statistics, step count, replicated optimizer state** (Adam's moments of
  a replicated optimizer, the adaptive compressor's level, window and hold, PowerSGD's
  warm start): as they are, bit for bit. The learning-rate schedule is a function of the
  step count, so it goes on where it was.
* **sharded optimizer state** (``shard_optimizer=True``): resharded exactly
  (``DataParallel.reshard``: each per-device chunk leaf read row after row is its param
  leaf, cut anew into ``M`` pieces).
* **other per-device state** (error-feedback residuals, the adaptive compressor's residual,
  ``local_sgd``'s per-device params, ``MultiSteps``' accumulators) by ``rule``:

  - ``'mean'`` (default): every new device gets the mean of the ``N`` old entries. For an
    error-feedback residual this keeps, exactly up to f32 rounding, the correction the
    averaged gradient still owes: the next mean of ``g + e`` over ``M`` devices carries
    ``mean_j e'_j = mean_i e_i``, as it would have over the ``N``. Refused for a leaf
    whose per-device shape changes with the device count, for integer leaves whose
    entries differ, and for a ``compress_stage='inter'`` sync (its residuals are chunks
    that belong to a device's place in its node).
  - ``'zero'``: reset to zeros (what an error-feedback buffer starts from); loses at most
    one step's compression error per device.

* **data position**: as saved. The global batch is kept (each device takes
  ``global_batch / M`` examples; :func:`per_device_batch` refuses a count that does not
  divide it), so position ``p`` names the same examples on any device count and no
  example is skipped or seen twice.

Checked against the checkpoint's manifest (paths, shapes, dtypes of every leaf) before
anything is read: a checkpoint of another model or optimizer is refused naming the first
leaf that differs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.checkpoint import Checkpointer, manifest
from jaxcomm.validate import check_choice, check_int

__all__ = [
    "RULES",
    "agent_env",
    "check_minimum",
    "checkpoint_cost",
    "digits_restart",
    "parse_nodes",
    "per_device_batch",
    "resize",
    "restore",
]

RULES = ("mean", "zero")


def per_device_batch(global_batch: int, devices: int) -> int:
    """Examples per device when ``global_batch`` is split over ``devices``.

    Raises:
      ValueError: ``devices`` does not divide ``global_batch``; the message lists the
        device counts that do.
    """
    global_batch = check_int("global_batch", global_batch, minimum=1)
    devices = check_int("devices", devices, minimum=1)
    if global_batch % devices:
        fits = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise ValueError(
            f"global batch {global_batch} does not divide over {devices} devices; a restart "
            f"keeps the global batch (the schedule and the data position depend on it). "
            f"Device counts that divide it: {fits}. Choose a global batch every device count "
            "the job may shrink to divides (e.g. 24 for 8, 6, 4, 3 or 2 devices), or a "
            "minimum node count that leaves such a device count."
        )
    return global_batch // devices


def check_minimum(available: int, minimum: int, *, what: str = "nodes") -> int:
    """Refuses to go on with fewer than ``minimum`` ``what``; returns ``available``.

    Raises:
      ValueError: ``available < minimum`` (or either is not a positive integer).
    """
    available = check_int(f"{what} available", available, minimum=1)
    minimum = check_int(f"minimum {what}", minimum, minimum=1)
    if available < minimum:
        raise ValueError(
            f"{available} {what} left, the job's minimum is {minimum} (allowed: {minimum} or "
            f"more): it does not resume below its minimum. Lower the minimum (e.g. "
            f"--elastic {available}:...) or bring back {minimum - available} {what}."
        )
    return available


def _per_device_flags(dp: Any, like_opt: Any) -> list[bool]:
    paths = set(dp.per_device_paths)
    return [
        jax.tree_util.keystr(p) in paths for p, _ in jax.tree_util.tree_leaves_with_path(like_opt)
    ]


def _old_devices(opt_state: Any, flags: list[bool]) -> int | None:
    rows = {
        int(jnp.shape(x)[0]) for x, f in zip(jax.tree.leaves(opt_state), flags, strict=True) if f
    }
    if len(rows) > 1:
        raise ValueError(f"per-device leaves disagree on the device count: {sorted(rows)}")
    return rows.pop() if rows else None


def _placing(mesh: Any, axes: tuple[str, ...], rows: int, devices: int) -> NamedSharding:
    """Where ``rows`` per-device entries go on a mesh of ``devices`` before their re-lay:
    split over the devices when they divide evenly, else whole on every device."""
    return NamedSharding(mesh, P(axes) if rows % devices == 0 else P())


def _relay(x: jax.Array, target: jax.ShapeDtypeStruct, rule: str, path: str) -> jax.Array:
    """One per-device leaf of ``N`` rows as ``target``'s ``M`` rows, by ``rule``."""
    if rule == "zero":
        return jax.jit(
            lambda: jnp.zeros(target.shape, target.dtype), out_shardings=target.sharding
        )()
    if tuple(x.shape[1:]) != tuple(target.shape[1:]):
        raise ValueError(
            f"per-device leaf {path} holds {tuple(x.shape[1:])} per device on {x.shape[0]} "
            f"devices and {tuple(target.shape[1:])} on {target.shape[0]}: its layout depends "
            "on the device count, so a mean of its entries means nothing. Restore with "
            "rule='zero' (the entries start again from zero)."
        )
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        same = bool(jax.jit(lambda v: jnp.all(v == v[:1]))(x))
        if not same:
            raise ValueError(
                f"per-device leaf {path} ({x.dtype}) differs between devices: integer "
                "entries have no mean. Restore with rule='zero'."
            )
        mean = lambda v: jnp.broadcast_to(v[0], target.shape)  # noqa: E731
    else:
        mean = lambda v: jnp.broadcast_to(  # noqa: E731
            jnp.mean(v.astype(jnp.float32), axis=0).astype(v.dtype), target.shape
        )
    return jax.jit(mean, out_shardings=target.sharding)(x)


def resize(state: Any, dp: Any, *, rule: str = "mean") -> Any:
    """``state``, a :class:`jaxcomm.TrainState` of the same model and optimizer on another
    device count (a live state, or one restored as it was saved), laid out for ``dp``.

    Args:
      state: the train state; its arrays on ``dp``'s devices (replicated, or per-device
        leaves split over them) or on another mesh of this process.
      dp: the step on the new devices (``jaxcomm.data_parallel``), initialised
        (``dp.init`` run once, so its per-device leaves are known).
      rule: per-device state other than sharded chunks, ``'mean'`` or ``'zero'`` (module
        docstring).

    Returns:
      The state on ``dp``'s mesh; the same values where nothing changes.

    Raises:
      ValueError: unknown ``rule``; a per-device leaf the rule cannot re-lay; a sharded
        state of other params (``DataParallel.reshard``).
    """
    check_choice("rule", rule, RULES, fix="'mean' keeps the entries' mean, 'zero' resets them")
    target = dp.abstract_state(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    )
    flags = _per_device_flags(dp, target.opt_state)
    rows = _old_devices(state.opt_state, flags)
    devices, put = dp.num_devices, lambda t: jax.device_put(t, dp.replicated)  # noqa: E731
    leaves, treedef = jax.tree.flatten(state.opt_state)
    if len(leaves) != len(flags):
        raise ValueError(
            f"the optimizer state has {len(leaves)} leaves, this step's {len(flags)}: another "
            "optimizer. Resume with the optimizer the state was written by."
        )
    stacked = NamedSharding(dp.mesh, P(dp.axes))
    same = rows is None or rows == devices  # entries back to their own devices
    moved = [
        (jax.device_put(x, stacked if same else _placing(dp.mesh, dp.axes, rows, devices)))
        if f
        else put(x)
        for x, f in zip(leaves, flags, strict=True)
    ]
    model_state = None if state.model_state is None else put(state.model_state)
    base = type(state)(
        put(state.step), put(state.params), jax.tree.unflatten(treedef, moved), model_state
    )
    if same:
        return base
    if dp.sharded is not None:
        return dp.reshard(base)
    if rule == "mean" and any(s.compress_stage == "inter" for s in dp.syncs):
        raise ValueError(
            "rule='mean' re-lays per-device state whose entries mean the same thing on every "
            "device; a sync_gradients(compress_stage='inter') keeps residuals of the chunk a "
            "device owns in its node. Restore with rule='zero'."
        )
    targets = jax.tree.leaves(target.opt_state)
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(target.opt_state)
    ]
    out = [
        _relay(x, t, rule, p) if f else x
        for x, t, f, p in zip(moved, targets, flags, paths, strict=True)
    ]
    return base._replace(opt_state=jax.tree.unflatten(treedef, out))


def _check_manifest(saved: list, here: list, per_device: set[str], where: str) -> None:
    """Refuses a checkpoint whose leaves are not this state's: another optimizer (paths)
    or another model (shapes or dtypes of leaves that do not depend on the device count)."""
    saved_paths, here_paths = [s[0] for s in saved], [h[0] for h in here]
    if saved_paths != here_paths:
        gone = [p for p in saved_paths if p not in here_paths][:3]
        new = [p for p in here_paths if p not in saved_paths][:3]
        raise ValueError(
            f"checkpoint {where} holds {len(saved_paths)} state leaves, this run "
            f"{len(here_paths)}; only in the checkpoint: {gone}, only in this run: {new}. It "
            "was written by another optimizer or model: resume with the settings it was "
            "saved with, or use another --checkpoint-dir."
        )
    for (path, shape, dtype), (_, shape2, dtype2) in zip(saved, here, strict=True):
        if dtype != dtype2 or (path not in per_device and shape != shape2):
            raise ValueError(
                f"checkpoint {where}: {path} is {dtype}{shape}, this run's {dtype2}{shape2}. "
                "It was written by another model (or optimizer): resume with the settings it "
                "was saved with, or use another --checkpoint-dir."
            )


def restore(
    checkpointer: Checkpointer,
    dp: Any,
    like: Any,
    *,
    step: int | None = None,
    rule: str = "mean",
    global_batch: int | None = None,
) -> tuple[Any, dict]:
    """Restores the newest complete checkpoint (or ``step``) onto ``dp``'s devices, written
    on the same or another device count.

    Args:
      checkpointer: the run's checkpoints.
      dp: the step on the devices of this run (initialised).
      like: a fresh state of this run (``dp.init(...)``), for shapes and shardings.
      step: which checkpoint; default the newest complete one.
      rule: per-device state other than sharded chunks: ``'mean'`` or ``'zero'``.
      global_batch: this run's global batch; refused if the checkpoint's differs or does
        not divide over ``dp``'s devices. None: not checked.

    Returns:
      ``(state, data)``: the state on ``dp``'s mesh and the checkpoint's JSON item
      (``position``: the next global batch to read).

    Raises:
      FileNotFoundError: no complete checkpoint.
      ValueError: a checkpoint of another model or optimizer, of another global batch, a
        global batch that does not divide, a checkpoint without a manifest on another
        device count, or a per-device leaf the rule cannot re-lay.
    """
    check_choice("rule", rule, RULES, fix="'mean' keeps the entries' mean, 'zero' resets them")
    data = checkpointer.saved_data(step)
    where = f"{checkpointer.directory}/{data['step']}"
    if global_batch is not None:
        per_device_batch(global_batch, dp.num_devices)
        if data.get("global_batch", global_batch) != global_batch:
            raise ValueError(
                f"checkpoint {where} was written with global batch {data['global_batch']}, "
                f"this run's is {global_batch}: a restart keeps the global batch (the data "
                f"position and the schedule count its batches). Run with global batch "
                f"{data['global_batch']}."
            )
    saved_devices = data.get("devices")
    if saved_devices == dp.num_devices:
        return checkpointer.restore(like, step=data["step"])
    if "leaves" not in data:
        raise ValueError(
            f"checkpoint {where} has no manifest of its leaves (written before elastic "
            "restores), so it restores only onto the device count it was written on."
        )
    per_device = {".opt_state" + p for p in dp.per_device_paths}
    _check_manifest(data["leaves"], manifest(like), per_device, where)
    rows = int(saved_devices)

    def target(path, x, saved):
        if jax.tree_util.keystr(path) not in per_device:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        sharding = _placing(dp.mesh, dp.axes, rows, dp.num_devices)
        return jax.ShapeDtypeStruct(tuple(saved[1]), x.dtype, sharding=sharding)

    leaves = jax.tree_util.tree_leaves_with_path(like)
    abstract = jax.tree.unflatten(
        jax.tree.structure(like),
        [target(p, x, s) for (p, x), s in zip(leaves, data["leaves"], strict=True)],
    )
    saved, data = checkpointer.restore(abstract, step=data["step"])
    return resize(saved, dp, rule=rule), data


# -- the digits quality guard across a restart -------------------------------------------


def digits_restart(
    directory: str,
    sync_kwargs: dict | None = None,
    *,
    steps: int = 300,
    restart_at: int = 150,
    devices: tuple[int, int] = (8, 4),
    rule: str = "mean",
    seed: int = 0,
) -> dict:
    """The digits quality guard (``experiments.bench.digits``: a 64-256-10 MLP, Adam, global
    batch 120) run straight on ``devices[0]`` devices, and stopped at ``restart_at`` with a
    checkpoint restored onto ``devices[1]`` (:func:`restore` with ``rule``) to go on to
    ``steps`` with the same data order.

    Returns:
      ``accuracy`` (straight), ``restarted_accuracy``, their ``difference_points``
      (percentage points), and the test set size.
    """
    import jaxcomm
    from experiments.bench import digits

    x_tr, y_tr, x_te, y_te = digits.load_split()
    order = digits.data_order(seed, steps, digits.BATCH)

    def batch(i):
        idx = order[i * digits.BATCH : (i + 1) * digits.BATCH]
        return {"x": x_tr[idx], "y": y_tr[idx]}

    def build(n):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(2, n // 2), ("inter", "intra"))
        tx = optax.chain(
            jaxcomm.sync_gradients(**(sync_kwargs or {})), optax.adam(digits.LEARNING_RATE)
        )
        dp = jaxcomm.data_parallel(digits._loss, tx, mesh)
        return dp, dp.init(digits._init(seed))

    def run(dp, state, start, stop):
        for i in range(start, stop):
            state, _ = dp(state, dp.shard_batch(batch(i)))
            jax.block_until_ready(state)  # one step in flight (XLA:CPU's rendezvous)
        return state

    def accuracy(state):
        params = jax.device_get(state.params)
        return float(np.mean(np.asarray(jnp.argmax(digits._logits(params, x_te), -1)) == y_te))

    per_device_batch(digits.BATCH, devices[1])
    dp, state = build(devices[0])
    half = run(dp, state, 0, restart_at)
    ckpt = Checkpointer(directory)
    ckpt.save(half, position=restart_at, meta={"global_batch": digits.BATCH})
    straight = accuracy(run(dp, half, restart_at, steps))
    dp2, like = build(devices[1])
    restored, data = restore(ckpt, dp2, like, rule=rule, global_batch=digits.BATCH)
    ckpt.close()
    restarted = accuracy(run(dp2, restored, data["position"], steps))
    return {
        "accuracy": straight,
        "restarted_accuracy": restarted,
        "difference_points": 100 * (restarted - straight),
        "test_images": int(len(y_te)),
        "devices": list(devices),
        "restart_at": restart_at,
        "steps": steps,
        "rule": rule,
    }


# -- an elastic agent's processes -----------------------------------------------------------

# What PyTorch's elastic agent (torchrun) gives each worker it starts.
AGENT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_nodes(text: str) -> tuple[int, int]:
    """``'MIN:MAX'`` (or ``'N'``) node counts of ``--elastic``, as torchrun's ``--nnodes``.

    Raises:
      ValueError: not one or two positive integers with ``MIN <= MAX``.
    """
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise ValueError(
            f"--elastic {text!r} must be MIN:MAX node counts with 1 <= MIN <= MAX (as "
            "torchrun's --nnodes), e.g. --elastic 2:3."
        )
    return low, high


def agent_env(local_devices: int, environ: dict | None = None) -> dict[str, str]:
    """The ``JAXCOMM_*`` variables of a process started by PyTorch's elastic agent.

    ``torch.distributed.run`` (torchrun) starts one process per node
    (``--nproc-per-node=1``) and gives it ``RANK``, ``WORLD_SIZE`` and the rank-0 node's
    address (``MASTER_ADDR``, new after every restart). The agent itself listens on
    ``MASTER_PORT`` (its store), so ``jax.distributed``'s coordinator listens on the rank-0
    node at ``JAXCOMM_ELASTIC_PORT`` (default ``MASTER_PORT + 1``). The process then starts
    with ``jaxcomm.init_distributed()`` as under ``jaxcomm.tools.launch``.

    Args:
      local_devices: CPU devices of this process (ignored by accelerators).
      environ: the environment (default ``os.environ``).

    Raises:
      ValueError: a variable of the agent is missing, or the agent starts several
        processes per node.
    """
    from jaxcomm import distributed

    env = os.environ if environ is None else environ
    missing = [k for k in AGENT_VARS if not env.get(k)]
    if missing:
        raise ValueError(
            f"--elastic runs under an elastic agent, and {missing} are not set: start it "
            "with torchrun --nnodes=MIN:MAX --nproc-per-node=1 --rdzv-backend=c10d ... "
            "--no-python python -m experiments.resnet152 ... --elastic MIN:MAX "
            "(docs/elastic.md)."
        )
    if env["LOCAL_WORLD_SIZE"] != "1":
        raise ValueError(
            f"--nproc-per-node={env['LOCAL_WORLD_SIZE']}: a JAX process drives every device "
            "of its node; start one per node (--nproc-per-node=1)."
        )
    port = env.get("JAXCOMM_ELASTIC_PORT") or str(int(env["MASTER_PORT"]) + 1)
    return {
        distributed.ENV_COORDINATOR: f"{env['MASTER_ADDR']}:{port}",
        distributed.ENV_NUM_PROCESSES: env["WORLD_SIZE"],
        distributed.ENV_PROCESS_ID: env["RANK"],
        distributed.ENV_LOCAL_DEVICES: str(check_int("local_devices", local_devices, minimum=1)),
    }


# -- the kill test: a node lost mid-run, the job finished on the others ---------------------


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _read_steps(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_params(folder: str) -> dict:
    """The params of a checkpoint step folder (``ckpt/<step>``) as NumPy arrays, read on
    the host whatever devices wrote it."""
    import orbax.checkpoint as ocp
    from etils import epath

    path = epath.Path(folder) / "state"
    tree = ocp.PyTreeCheckpointHandler().metadata(path).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    with ocp.PyTreeCheckpointer() as ckpt:
        return ckpt.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))["params"]


# The bound the project states for survivors of a dead peer: the coordinator's heartbeat
# (20 s) or the collective timeout (45 s) ends every survivor within a minute.
STOP_BOUND_S = 60.0


def _clean_env() -> dict[str, str]:
    """This environment without a job's variables (jaxcomm's, the agent's, a test's 8 fake
    devices): the processes of a kill test get their own."""
    from jaxcomm import distributed

    agent = {*AGENT_VARS, "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_RESTART_COUNT", "JAXCOMM_ELASTIC_PORT"}  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in {*distributed.ENV_VARS, *agent}}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base.update(PYTHONPATH=root, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return base


def _start(commands: list[list[str]], envs: list[dict], logs: str, name: str, testbed: Any,
           pause: bool = False):  # fmt: skip
    """Starts one process per node (node ``i`` in the testbed's namespace ``i`` when given),
    node 0 first; ``pause``: a moment after each (the agents' rendezvous is hosted by the
    first; JAX processes wait for their coordinator by themselves)."""
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for i, (cmd, env) in enumerate(zip(commands, envs, strict=True)):
        if testbed is not None:
            env = {**env, **{k: v for k, v in testbed.env(i).items()
                             if k.startswith("JAXCOMM_TESTBED")}}  # fmt: skip
            cmd = ["ip", "netns", "exec", testbed.namespaces[i], *cmd]
        log = open(os.path.join(logs, f"{name}-node{i}.log"), "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=root))  # fmt: skip
        if pause:
            time.sleep(2.0 if i == 0 else 0.5)
    return procs


def _agents(torchrun: str, nodes: int, minimum: int, worker: list[str], *, run_id: str,
            port: int, logs: str, testbed: Any = None) -> list[Any]:  # fmt: skip
    """Starts ``nodes`` elastic agents (torchrun), one per node, each starting
    ``python -m experiments.resnet152 WORKER`` and restarting it on the nodes left."""
    host = "127.0.0.1" if testbed is None else testbed.addresses[0]
    commands = []
    for i in range(nodes):
        cmd = [torchrun, f"--nnodes={minimum}:{nodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={run_id}",
               "--max-restarts=3", "--monitor-interval=1",
               "--rdzv-conf=last_call_timeout=5"]  # fmt: skip
        if testbed is not None:
            cmd.append(f"--local-addr={testbed.addresses[i]}")
        commands.append([*cmd, "--no-python", sys.executable, "-m", "experiments.resnet152",
                         *worker])  # fmt: skip
    return _start(commands, [_clean_env()] * nodes, logs, run_id, testbed, pause=True)


def _workers(nodes: int, worker: list[str], *, run_id: str, restart: int, logs: str,
             testbed: Any = None) -> list[Any]:  # fmt: skip
    """Plays the elastic agent's part where torch is not installed (the test suite): starts
    ``nodes`` processes of ``python -m experiments.resnet152 WORKER`` with the variables
    torchrun gives the workers of one rendezvous round (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR``, ``TORCHELASTIC_RUN_ID``,
    ``TORCHELASTIC_RESTART_COUNT``), which ``--elastic`` reads through :func:`agent_env`.
    Nothing listens on ``MASTER_PORT`` (there is no agent's store); the coordinator's port
    is a free one (``JAXCOMM_ELASTIC_PORT``)."""
    from jaxcomm.tools.launch import free_port

    host = "127.0.0.1" if testbed is None else testbed.addresses[0]
    agent = {"WORLD_SIZE": str(nodes), "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
             "MASTER_ADDR": host, "MASTER_PORT": "1", "JAXCOMM_ELASTIC_PORT": str(free_port()),
             "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart)}  # fmt: skip
    envs = [{**_clean_env(), **agent, "RANK": str(i), "GROUP_RANK": str(i)} for i in range(nodes)]
    command = [sys.executable, "-m", "experiments.resnet152", *worker]
    return _start([command] * nodes, envs, logs, f"{run_id}-{restart}", testbed)


def _wait(
    procs: list[Any], timeout_s: float, on_poll: Any = None, ended: dict | None = None
) -> list[int | None]:
    """Waits for ``procs`` for at most ``timeout_s`` (or until ``on_poll()`` returns true),
    then kills those still running; their exit codes. ``ended`` (when given) receives
    ``index: time.time()`` of each process seen ended on its own."""
    import time

    end, ended = time.monotonic() + timeout_s, {} if ended is None else ended
    while time.monotonic() < end:
        now = time.time()
        ended.update(
            {i: now for i, p in enumerate(procs) if i not in ended and p.poll() is not None}
        )
        if len(ended) == len(procs) or (on_poll is not None and on_poll()):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def _complete_steps(folder: str) -> list[int]:
    """The complete checkpoint steps in ``folder`` (orbax renames a step's folder to its
    number once every process has written it)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def kill_test(
    out: str,
    *,
    torchrun: str | None = None,
    nodes: int = 3,
    kill_at: int = 8,
    steps: int = 20,
    every: int = 5,
    devices_per_node: int = 2,
    port: int = 29555,
    testbed: Any = None,
    timeout_s: float = 1200,
    image_size: int = 16,
    per_device_batch: int = 2,
    config: str | None = None,
    overlap_reference: bool = False,
) -> dict:
    """Kills the last node (its agent, or its JAX process) once step ``kill_at`` ended; the
    job finishes on ``nodes - 1`` nodes. Then the reference: the same job without a kill
    stopped at the checkpoint the survivors restored, resumed on ``nodes - 1`` nodes.

    Every process is ``python -m experiments.resnet152 --preset cpu-smoke --train
    --elastic MIN:MAX`` (ResNet-tiny, ``image_size`` px, asynchronous checkpoints every
    ``every`` steps). With ``torchrun``, PyTorch's elastic agents notice the failure and
    restart the job on the nodes left; without, this function plays the agent
    (:func:`_workers`): it waits for the survivors to end on their own (at most
    :data:`STOP_BOUND_S`, then they are killed and counted as hung) and starts the job
    again on ``nodes - 1`` processes, as the agent would after its new rendezvous.

    ``config`` picks the experiment's row (default its last, every technique);
    ``overlap_reference`` starts the reference while the survivors wait for the heartbeat,
    stopped at the last checkpoint step before the kill (what the survivors must restore:
    the suite's test asserts that they did), instead of after the restart.

    Returns:
      The kill's step, the complete checkpoints at the kill, the step restored, the steps
      lost, seconds from the kill to the first step after it, the exit codes, and the final
      params against the reference (``params_bitwise_equal``, ``params_max_abs_diff``);
      without ``torchrun`` also the survivors' exit codes, seconds from the kill to the
      last survivor's end (``survivors_stopped_s``, None if one had to be killed) and the
      complete checkpoints when the job was started again (``complete_at_restart``);
      ``reference_stop`` and the two ``final_checkpoints`` folders.
    """
    import shutil
    import time

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    minimum = nodes - 1
    common = ["--preset", "cpu-smoke", "--train", "--elastic", f"{minimum}:{nodes}",
              "--steps", str(steps), "--checkpoint-every", str(every),
              "--devices-per-node", str(devices_per_node), "--no-progress",
              "--image-size", str(image_size),
              "--per-device-batch", str(per_device_batch)]  # fmt: skip
    common += [] if config is None else ["--config", config]
    run = {"ckpt": os.path.join(out, "kill", "ckpt"), "out": os.path.join(out, "kill", "out")}
    worker = [*common, "--checkpoint-dir", run["ckpt"], "--out", run["out"]]

    def job(count, low, argv, run_id, restart, agent_port):
        """``count`` nodes: agents that accept ``low`` or more, or the processes of the
        agent's round ``restart``."""
        if torchrun is None:
            return _workers(count, argv, run_id=run_id, restart=restart, logs=out,
                            testbed=testbed)  # fmt: skip
        return _agents(torchrun, count, low, argv, run_id=run_id, port=agent_port, logs=out,
                       testbed=testbed)  # fmt: skip

    ref = os.path.join(out, "reference", "ckpt")
    ref_worker = [*common, "--checkpoint-dir", ref, "--out", os.path.join(out, "reference", "out")]

    def reference(stop):  # the same job without a kill, stopped at checkpoint ``stop``
        argv = [*ref_worker, "--stop-at", str(stop)]
        return {"stop": stop, "procs": job(nodes, nodes, argv, "ref", 0, port + 10)}

    t0 = time.time()
    procs = job(nodes, minimum, worker, "kill", 0, port)
    killed: dict = {}
    ended: dict[int, float] = {}
    early: dict = {}
    steps_file = os.path.join(run["out"], "steps.jsonl")

    def poll():
        done = _read_steps(steps_file)
        if not killed and done and done[-1]["step"] >= kill_at:
            victim = procs[-1]
            for pid in [*_descendants(victim.pid), victim.pid]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            killed.update(time=time.time(), step=done[-1]["step"],
                          complete=_complete_steps(run["ckpt"]))  # fmt: skip
            if overlap_reference:  # while the survivors wait for the heartbeat
                early.update(reference(every * (killed["step"] // every)))
        # playing the agent: the survivors must end on their own within the bound
        return torchrun is None and killed and time.time() - killed["time"] > STOP_BOUND_S

    codes = _wait(procs, timeout_s, poll, ended)
    result: dict[str, Any] = {}
    if torchrun is None:
        survivors = range(nodes - 1)
        on_their_own = bool(killed) and all(i in ended for i in survivors)
        result["survivors_exit_codes"] = [codes[i] for i in survivors]
        result["survivors_stopped_s"] = (
            max(ended[i] for i in survivors) - killed["time"] if on_their_own else None
        )
        result["complete_at_restart"] = _complete_steps(run["ckpt"])
        if on_their_own and all(codes[i] for i in survivors):  # the agent's restart
            codes = _wait(job(minimum, minimum, worker, "kill", 1, port), timeout_s)
    log = _read_steps(steps_file)
    after = [x for x in log if killed and x["time"] > killed["time"]]
    restored = after[0]["step"] - 1 if after else None
    result = {
        "nodes": nodes,
        "devices_per_node": devices_per_node,
        "every": every,
        "steps": steps,
        "where": "testbed" if testbed is not None else "localhost",
        "agent": "torchrun" if torchrun is not None else "this process",
        "kill_step": killed.get("step"),
        "complete_at_kill": killed.get("complete"),
        "restored_step": restored,
        "steps_lost": None if restored is None else killed["step"] - restored,
        "kill_to_next_step_s": after[0]["time"] - killed["time"] if after else None,
        "devices_after": after[0]["devices"] if after else None,
        "final_step": log[-1]["step"] if log else None,
        **result,
        "exit_codes": codes,
        "seconds": time.time() - t0,
    }
    if early:
        first_codes = _wait(early["procs"], timeout_s)
    if restored is None or result["final_step"] != steps:
        return result
    # The reference: no kill; the checkpoint the survivors restored, then the nodes left.
    if not early:
        early = reference(restored)
        first_codes = _wait(early["procs"], timeout_s)
    result["reference_stop"] = early["stop"]
    second_codes = None
    if not any(first_codes):
        second_codes = _wait(job(minimum, minimum, ref_worker, "ref", 1, port + 20), timeout_s)
    result["reference_exit_codes"] = [first_codes, second_codes]
    result["seconds"] = time.time() - t0
    if second_codes is None or any(second_codes):
        return result
    result["final_checkpoints"] = [os.path.join(run["ckpt"], str(steps)),
                                   os.path.join(ref, str(steps))]  # fmt: skip
    a, b = (read_params(folder) for folder in result["final_checkpoints"])
    diffs = [
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    result["params_max_abs_diff"] = max(diffs)
    result["params_bitwise_equal"] = all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    return result


# -- the cost of asynchronous checkpoints on the step ---------------------------------------


def checkpoint_cost(
    directory: str,
    *,
    model: str = "resnet-tiny",
    image_size: int = 32,
    per_device_batch: int = 4,
    every: int = 10,
    steps: int = 40,
    rounds: int = 3,
) -> dict:
    """Step time with no checkpoint, asynchronous and synchronous checkpoints every
    ``every`` steps, in ``rounds`` paired rounds of ``steps`` steps (medians and ranges).

    Each checkpoint is what the training loop does: ``jaxcomm.check_replicas`` and
    :meth:`Checkpointer.save` of the whole state (int8 with error feedback: per-device
    residuals included), after one of each outside the timing (the replica check's
    compilation and orbax's start). The rounds' saves land at steps ``every, 2 every, ...`` below
    ``steps``; the write still running at the end of a round is waited for outside the
    timed window (it would overlap the next steps of a longer run).
    """
    import shutil
    import time

    import jaxcomm
    from experiments import step as steplib
    from experiments.data import SyntheticImages

    mesh = jaxcomm.make_mesh(intra=max(1, jax.device_count() // 2))
    global_batch = per_device_batch * mesh.devices.size
    parts = steplib.make_model(model, 10, seed=0)
    schedule = steplib.learning_rate(lr=0.1, global_batch=global_batch, warmup=2, total_steps=1000)
    sync = {
        "algorithm": "hierarchical",
        "compression": jaxcomm.compression.int8(error_feedback=True),
    }
    dp, state = steplib.build_step(parts, steplib.make_optimizer(sync, schedule), mesh)
    data = SyntheticImages(
        dp.batch_sharding, global_batch=global_batch, image_size=image_size, num_classes=10
    )
    state_mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    for _, batch in data.iterate(0, 3):  # compile and settle
        state, _ = dp(state, batch)
    jax.block_until_ready(state)
    for mode in (False, True):  # compile the replica check, start orbax's threads
        warm = Checkpointer(os.path.join(directory, "warm-up"), async_save=mode)
        jaxcomm.check_replicas(state, mesh=mesh, what="warm-up")
        warm.save(state, position=0)
        warm.close()
        shutil.rmtree(os.path.join(directory, "warm-up"), ignore_errors=True)
    times: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    blocking: dict[str, list[float]] = {"async": [], "sync": []}  # save() until it returns
    checking: dict[str, list[float]] = {"async": [], "sync": []}  # check_replicas
    position = 3
    for r in range(rounds):
        for mode in times:
            folder = os.path.join(directory, f"{mode}-{r}")
            shutil.rmtree(folder, ignore_errors=True)
            ckpt = None if mode == "none" else Checkpointer(folder, async_save=mode == "async")
            t0 = time.perf_counter()
            for i in range(1, steps + 1):
                state, _ = dp(state, data.batch(position))
                position += 1
                jax.block_until_ready(state)
                if ckpt is not None and i % every == 0 and i < steps:
                    t = time.perf_counter()
                    jaxcomm.check_replicas(state, mesh=mesh, what=f"step {i}")
                    t1 = time.perf_counter()
                    ckpt.save(state, position=position)
                    checking[mode].append(t1 - t)
                    blocking[mode].append(time.perf_counter() - t1)
            times[mode].append((time.perf_counter() - t0) / steps)
            if ckpt is not None:
                ckpt.close()
            shutil.rmtree(folder, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = []
    for mode, v in times.items():
        rows.append({
            "mode": mode,
            "step_s": med[mode],
            "range_s": [min(v), max(v)],
            "overhead": med[mode] / med["none"] - 1,
            "save_s": float(np.median(blocking[mode])) if mode in blocking else 0.0,
            "replica_check_s": float(np.median(checking[mode])) if mode in checking else 0.0,
        })  # fmt: skip
    return {
        "model": model,
        "image_size": image_size,
        "devices": int(mesh.devices.size),
        "global_batch": global_batch,
        "state_mib": state_mib,
        "every": every,
        "steps": steps,
        "rounds": rounds,
        "rows": rows,
        "load_average": os.getloadavg(),
        "jax": jax.__version__,
    }


def format_cost(result: dict) -> str:
    """The table of :func:`checkpoint_cost`."""
    head = (
        f"{result['model']} {result['image_size']}px, {result['devices']} devices, global "
        f"batch {result['global_batch']}, state {result['state_mib']:.1f} MiB, a checkpoint "
        f"every {result['every']} steps ({result['rounds']} rounds of {result['steps']} steps; "
        f"load {result['load_average'][0]:.2f})"
    )
    lines = [
        head,
        f"{'checkpoints':<12} {'s/step':>9} {'range':>19} {'overhead':>9} "
        f"{'save s':>8} {'check s':>8}",
    ]
    for r in result["rows"]:
        lo, hi = r["range_s"]
        lines.append(
            f"{r['mode']:<12} {r['step_s']:>9.4f} {f'[{lo:.4f}-{hi:.4f}]':>19} "
            f"{100 * r['overhead']:>8.1f}% {r['save_s']:>8.4f} {r['replica_check_s']:>8.4f}"
        )
    return "\n".join(lines)


def _kill_test_main(args) -> int:
    import contextlib
    import json

    from jaxcomm.tools.testbed import Testbed

    with contextlib.ExitStack() as stack:
        testbed = None
        if args.testbed:
            testbed = stack.enter_context(Testbed(nodes=args.nodes, devices_per_node=2,
                                                  link=args.link))  # fmt: skip
        load = os.getloadavg()
        result = kill_test(
            os.path.abspath(os.path.join(args.out, "kill-test")),
            torchrun=args.torchrun,
            nodes=args.nodes,
            kill_at=args.kill_at,
            steps=args.steps,
            every=args.every,
            testbed=testbed,
        )
    result["load_average"] = [load, os.getloadavg()]
    for k, v in result.items():
        print(f"{k:<24} {v}")
    with open(os.path.join(args.out, "kill_test.json"), "w") as f:
        json.dump(result, f, indent=2)
    ok = result.get("params_max_abs_diff") is not None and result["final_step"] == args.steps
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.elastic checkpoint-cost | kill-test``: a table and JSON."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="python -m experiments.elastic",
        description="The cost of asynchronous orbax checkpoints on the train step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("command", choices=["checkpoint-cost", "kill-test"])
    p.add_argument("--torchrun", default=None,
                   help="kill-test: PyTorch's torchrun as the agent (default: this process "
                   "plays the agent's restart)")  # fmt: skip
    p.add_argument("--nodes", type=int, default=3, help="kill-test: nodes at the start")
    p.add_argument("--kill-at", type=int, default=8, help="kill-test: kill after this step")
    p.add_argument("--testbed", action="store_true", help="kill-test: nodes in the testbed")
    p.add_argument("--link", default="1gbit", help="kill-test --testbed: link rate")
    p.add_argument("--model", default="resnet-tiny", help="ResNet name")
    p.add_argument("--image-size", type=int, default=32, help="square image side")
    p.add_argument("--per-device-batch", type=int, default=4, help="images per device")
    p.add_argument("--every", type=int, default=None,
                   help="checkpoint period in steps (default 10; kill-test 5)")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="steps per timed round (default 40; kill-test: the job's, 20)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="paired rounds")
    p.add_argument("--cpu-devices", type=int, default=8, help="fake CPU devices")
    p.add_argument("--out", default="runs/checkpoint-cost", help="folder for the JSON")
    args = p.parse_args(argv)
    from experiments import runtime

    runtime.ensure_cpu_devices(args.cpu_devices)  # read when the backend starts, below
    os.makedirs(args.out, exist_ok=True)
    if args.command == "kill-test":
        args.every, args.steps = args.every or 5, args.steps or 20
        return _kill_test_main(args)
    args.every, args.steps = args.every or 10, args.steps or 40
    result = checkpoint_cost(
        os.path.join(os.path.abspath(args.out), "ckpt"),
        model=args.model,
        image_size=args.image_size,
        per_device_batch=args.per_device_batch,
        every=args.every,
        steps=args.steps,
        rounds=args.rounds,
    )
    print(format_cost(result))
    with open(os.path.join(args.out, f"checkpoint_cost_{args.model}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
