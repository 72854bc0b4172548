"""The elastic experiments: the digits guard across a restart, the kill test, the cost of
a checkpoint (``python -m experiments.elastic checkpoint-cost | kill-test``).

What a user's script needs (save, restore onto another device count, asynchronous
checkpoints, the agent's environment) is the library's: :mod:`jaxcomm.elastic` and
:mod:`jaxcomm.checkpoint`; this module only measures it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomm.checkpoint import Checkpointer
from jaxcomm.elastic import AGENT_VARS, per_device_batch, restore

__all__ = [
    "RECOVERY_PHASES",
    "STOP_BOUND_S",
    "checkpoint_cost",
    "digits_restart",
    "format_recovery",
    "kill_test",
    "read_params",
    "recovery_table",
]

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


# The phases of a restart, in order: (name, the phase logged at its end, its meaning).
RECOVERY_PHASES = (
    ("detection", None, "kill -> the last survivor's JAX process ended (heartbeat)"),
    ("agent restart", None, "-> the agent started the processes again"),
    ("start, imports", "main", "-> Python started, jax, flax, jaxcomm imported, main()"),
    ("rendezvous", "distributed", "-> jax.distributed initialised (coordinator, peers)"),
    ("build", "built", "-> model, step and fresh state built (dp.init)"),
    ("restore", "restored", "-> the checkpoint read and re-laid (jaxcomm.elastic.restore)"),
    ("first step", None, "-> the first step ended (its compile included)"),
)


def recovery_table(killed: float, result: dict, phases: list[dict], first_step: float) -> list:
    """Where the time from the kill to the next step went: ``[name, seconds, meaning]`` per
    phase of :data:`RECOVERY_PHASES`, from the kill test's times (the kill, the survivors'
    end, the restart) and the restarted rank-0 process's ``phases.jsonl``. A phase whose
    end was not logged is None (its time goes to the next one)."""
    ends = {p["phase"]: p["time"] for p in phases if p.get("restart", 0) >= 1}
    stopped = result.get("survivors_stopped_s")
    restarted = result.get("restarted_s")
    times = {
        "detection": None if stopped is None else killed + stopped,
        "agent restart": None if restarted is None else killed + restarted,
        "first step": first_step,
    }
    rows, last = [], killed
    for name, logged, meaning in RECOVERY_PHASES:
        end = ends.get(logged) if logged is not None else times.get(name)
        rows.append([name, None if end is None else end - last, meaning])
        last = end if end is not None else last
    return rows


def format_recovery(rows: list) -> str:
    """The recovery table as text."""
    lines = [f"{'phase':<14} {'seconds':>8}  what ended it"]
    total = 0.0
    for name, seconds, meaning in rows:
        total += seconds or 0.0
        shown = "-" if seconds is None else f"{seconds:.2f}"
        lines.append(f"{name:<14} {shown:>8}  {meaning}")
    lines.append(f"{'total':<14} {total:>8.2f}  kill -> next step")
    return "\n".join(lines)


def _write_json(path: str, result: dict) -> None:
    import json

    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


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
    model: str = "resnet-tiny",
    image_size: int = 16,
    per_device_batch: int = 2,
    config: str | None = None,
    overlap_reference: bool = False,
    heartbeat_timeout_s: int | None = None,
) -> dict:
    """Kills the last node (its agent, or its JAX process) once step ``kill_at`` ended; the
    job finishes on ``nodes - 1`` nodes. Then the reference: the same job without a kill
    stopped at the checkpoint the survivors restored, resumed on ``nodes - 1`` nodes.

    Every process is ``python -m experiments.resnet152 --preset cpu-smoke --train
    --elastic MIN:MAX`` (``model``, ``image_size`` px, asynchronous checkpoints every
    ``every`` steps). With ``torchrun``, PyTorch's elastic agents notice the failure and
    restart the job on the nodes left; without, this function plays the agent
    (:func:`_workers`): it waits for the survivors to end on their own (at most
    :data:`STOP_BOUND_S`, then they are killed and counted as hung) and starts the job
    again on ``nodes - 1`` processes, as the agent would after its new rendezvous.

    ``config`` picks the experiment's row (default its last, every technique);
    ``overlap_reference`` starts the reference while the survivors wait for the heartbeat,
    stopped at the last checkpoint step before the kill (what the survivors must restore:
    the suite's test asserts that they did), instead of after the restart.
    ``heartbeat_timeout_s``: the processes' ``--heartbeat-timeout`` (default theirs, 20 s).
    With the restart played here, ``recovery`` is the table of where the time from the
    kill to the next step went (:func:`recovery_table`).

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
              "--model", model, "--image-size", str(image_size),
              "--per-device-batch", str(per_device_batch)]  # fmt: skip
    common += [] if config is None else ["--config", config]
    if heartbeat_timeout_s is not None:
        common += ["--heartbeat-timeout", str(heartbeat_timeout_s)]
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
            result["restarted_s"] = time.time() - killed["time"]
            codes = _wait(job(minimum, minimum, worker, "kill", 1, port), timeout_s)
    log = _read_steps(steps_file)
    # The restarted job's steps (a step of the killed round may end just after the kill).
    after = [x for x in log if killed and x.get("restart", 0) > 0]
    if after:
        result["recovery"] = recovery_table(
            killed["time"], result, _read_steps(os.path.join(run["out"], "phases.jsonl")),
            after[0]["time"],
        )  # fmt: skip
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
    _write_json(os.path.join(out, "kill_test.json"), result)  # the kill's part, already
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
    _write_json(os.path.join(out, "kill_test.json"), result)
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
            heartbeat_timeout_s=args.heartbeat_timeout,
            model=args.model,
        )
    result["load_average"] = [load, os.getloadavg()]
    for k, v in result.items():
        if k != "recovery":
            print(f"{k:<24} {v}")
    if result.get("recovery"):
        print(format_recovery(result["recovery"]))
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
    p.add_argument("--heartbeat-timeout", type=int, default=None,
                   help="kill-test: the processes' --heartbeat-timeout (default theirs, "
                   "20 s)")  # fmt: skip
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
