"""The data-parallel train step builder: ``jit`` + ``shard_map`` with explicit state specs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import backend, deprecated, ordering, outputs
from jaxcomm.axis_names import call_step
from jaxcomm.collectives import allreduce_floats, check_axes
from jaxcomm.diloco import gradient_params
from jaxcomm.distributed import agree, check_same_on_processes
from jaxcomm.gathering import GATHER_MODES
from jaxcomm.hlo import ordering_hazards
from jaxcomm.hybrid import HybridOptimizer
from jaxcomm.layout import OptimizerLayout, ReplicatedOptimizer
from jaxcomm.mesh import DATA_AXES, MODEL, check_mesh_axes
from jaxcomm.microbatch import accumulate_gradients, check_accumulate
from jaxcomm.phase_clock import PhaseClock
from jaxcomm.replicas import check_replicas as _check_replicas
from jaxcomm.sharded import ShardedOptimizer, shard_options
from jaxcomm.state import stack_leaves, unstack_leaves
from jaxcomm.sync import NO_HOST_PHASE, GradientSync, HostPhase, accepting_requests
from jaxcomm.sync_inputs import check_sync_inputs
from jaxcomm.validate import check_choice, check_int

__all__ = [
    "DataParallel",
    "TrainState",
    "check_sync_inputs",
    "compile_on_every_process",
    "data_parallel",
    "refuse_nnx_object",
]


class TrainState(NamedTuple):
    """Everything a step reads and writes (and so everything a checkpoint holds).

    Attributes:
      step: int32 scalar, number of steps taken.
      params: model parameters, replicated (with ``shard_params=True`` each leaf split
        over ``'intra'`` along one dimension, ``jaxcomm.hybrid.param_dims``).
      opt_state: optimizer state; replicated except its per-device leaves (marked
        ``PerDevice``, or typed varying over the data axes by shard_map, such as
        ``optax.MultiSteps``' ``acc_grads``), which carry a leading axis of one entry per
        device, sharded along the data axes (``DataParallel.per_device_paths`` lists them).
      model_state: non-trained model state such as batch-norm statistics (replicated,
        averaged across devices every step), or ``None``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None


def _float_metrics(tree: Any) -> Any:
    """Floating means (unmarked scalars and ``outputs.mean`` leaves) in f32, as the loss."""

    def cast(x):
        if isinstance(x, outputs.Reduced):
            if x.op != "mean":
                return x
            return outputs.Reduced(
                jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), x.value), "mean"
            )
        x = jnp.asarray(x)
        if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.float32)
        return x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, outputs.Reduced))


def compile_on_every_process(step: Any, args: tuple, mesh: Mesh, what: str) -> Any:
    """``step.lower(*args).compile()``, made safe to run on every process of a job.

    The one compile of the step builders (``data_parallel``, the Flax front ends). In a
    job of several processes, each compiles on its own, and a collective of the first run
    would wait for the slowest compile (gloo gives up after its timeout). So after
    compiling, every process waits for the others through the coordination service
    (``jaxcomm.distributed.agree``: a compiling peer is alive, a dead one is caught by the
    heartbeat), and a process that failed to compile (out of memory) makes every process
    raise, so that none runs the step alone. On a CPU mesh the compiled module is also
    checked for collectives whose order XLA:CPU does not fix
    (``jaxcomm.hlo.ordering_hazards``), which gloo would pair differently on different
    processes. In one process: the plain compile.

    Args:
      step: a jitted function (``jax.jit``).
      args: its example arguments (arrays or ``jax.ShapeDtypeStruct`` s).
      mesh: the mesh it runs on (its platform decides the ordering check).
      what: names the step in the errors and the agreement, e.g. ``'data-parallel step'``.

    Returns:
      The ``jax.stages.Compiled`` step.

    Raises:
      RuntimeError: on several CPU processes, the module holds an ordering hazard; or
        another process could not compile the step. This process's own compile error
        is raised as it is (on every other process, as the RuntimeError).
    """
    if jax.process_count() == 1:
        return step.lower(*args).compile()
    compiled, error = None, None
    try:
        compiled = step.lower(*args).compile()
        if backend.for_mesh(mesh).check_collective_order:  # gloo pairs ops by order
            _refuse_ordering_hazards(compiled.as_text())
    except Exception as e:  # every process learns of it: none runs the step alone
        error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = agree(f"compiled a {what}", message)
    if error is not None:
        raise error
    failed = [(i, m) for i, m in enumerate(outcomes) if m is not None]
    if failed:
        i, message = failed[0]
        raise RuntimeError(f"process {i} could not compile the {what}: {message}")
    return compiled


def _refuse_ordering_hazards(text: str) -> None:
    hazards = ordering_hazards(text)
    if hazards:
        h = hazards[0]
        raise RuntimeError(
            f"the compiled step issues collectives in an order XLA:CPU does not fix: "
            f"{h.collective!r} may start while {h.control_flow!r} (a lax.cond / lax.switch "
            f"/ lax.scan holding collectives) is still running them ({len(hazards)} such "
            "pairs). On several processes gloo would pair them differently and hang. Make "
            "the later collective's input depend on the conditional's result "
            "(jaxcomm.ordering.after), e.g. use one sync_gradients for all leaves."
        )


_DATA_PARALLEL_FIX = (
    "Name the mesh axes where it is used, e.g. nn.BatchNorm(axis_name={axes}) or "
    "lax.pmean(x, {axes}); a Flax step written for jax.pmap runs as it is under "
    "jaxcomm.pmap_data_parallel(mesh, axis_name={name!r})."
)


def _axis_names_checked(loss_fn: Callable, axes: tuple[str, ...]) -> Callable:
    """``loss_fn`` whose collectives over an axis name that the mesh does not bind raise
    ``jaxcomm.axis_names.UnboundAxisError`` (the names in scope, the fix) from JAX's own
    error (a bare ``AssertionError`` for ``lax.pmean``); ``jax.lax`` is left as it is."""

    @functools.wraps(loss_fn)
    def checked(*args):
        return call_step(
            loss_fn, args, aliases={}, axes=axes, where="data_parallel", fix=_DATA_PARALLEL_FIX
        )

    return checked


def _flax_kind(x: Any) -> str | None:
    """``'Optimizer'`` or ``'Module'`` for a Flax NNX object, else None (read from the
    class's module, so the train step needs no Flax import)."""
    for cls in type(x).__mro__:
        if cls.__module__.startswith("flax.nnx") and cls.__name__ in ("Optimizer", "Module"):
            return cls.__name__
    return None


def refuse_nnx_object(x: Any, where: str) -> None:
    """Raises TypeError for a Flax NNX module or optimizer passed where ``where`` takes
    plain values, naming the NNX front end to use instead."""
    if _flax_kind(x) is not None:
        raise TypeError(
            f"{where}: got a Flax NNX {type(x).__name__}. "
            "The NNX step is data-parallel with @jaxcomm.nnx_data_parallel(mesh) on "
            "train_step(model, optimizer, metrics, batch); jaxcomm.data_parallel takes "
            "a loss function, an optax transform and params (nnx.state(model, nnx.Param))."
        )


def _check_optimizer(optimizer: Any) -> None:
    """Raises a clear error if ``optimizer`` is not an optax transform (e.g. an
    ``nnx.Optimizer`` passed to :func:`data_parallel`)."""
    if _flax_kind(optimizer) == "Optimizer":
        raise TypeError(
            "data_parallel(optimizer=...): got an nnx.Optimizer; data_parallel takes the optax "
            "transform itself, e.g. optax.chain(jaxcomm.sync_gradients(), optax.adamw(1e-3)). "
            "To keep nnx.Optimizer and the NNX train step, decorate the step with "
            "@jaxcomm.nnx_data_parallel(mesh) instead."
        )
    refuse_nnx_object(optimizer, "data_parallel(optimizer=...)")
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"data_parallel(optimizer=...): got {type(optimizer).__name__}, not an optax "
            "GradientTransformation (init/update); pass e.g. "
            "optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))."
        )


def _check_step_options(
    optimizer: Any,
    mesh: Mesh,
    axes: tuple[str, ...],
    check_replicas: Any,
    microbatches: Any,
    accumulate: Any,
    with_model_state: bool,
) -> tuple[int, int]:
    """Checks :class:`DataParallel`'s arguments at construction; returns
    ``(check_replicas, microbatches)`` as ints."""
    check_replicas = check_int(
        "check_replicas",
        0 if check_replicas is None else check_replicas,
        minimum=0,
        fix="N compares the replicas every N steps; 0 or None turns it off",
    )
    microbatches = check_int("microbatches", microbatches, minimum=1, fix="1 turns it off")
    check_accumulate(accumulate)
    _check_optimizer(optimizer)
    if microbatches > 1 and with_model_state:
        raise ValueError(
            "microbatches > 1 with with_model_state=True is not supported: model state "
            "such as batch-norm statistics would be updated once per microbatch instead "
            "of once per step. Use microbatches=1 for such models."
        )
    check_mesh_axes("data_parallel", axes, mesh)
    return check_replicas, microbatches


def _check_params(params: Any) -> None:
    """Raises a clear error for Flax objects passed as params to ``DataParallel.init``: an
    NNX module, or Linen ``variables`` holding mutable collections (``batch_stats``)."""
    refuse_nnx_object(params, "DataParallel.init(params)")
    if isinstance(params, Mapping) and "params" in params:
        others = sorted(str(k) for k in params if k != "params")
        if others:
            raise ValueError(
                f"DataParallel.init(params): got Linen variables with collections {others} "
                "besides 'params'. Pass them apart and build the step with "
                "with_model_state=True: dp.init(variables['params'], "
                f"{{k: variables[k] for k in {others}}}), with loss_fn(params, model_state, "
                "batch) calling model.apply({'params': params, **model_state}, x, "
                f"mutable={others}). Or keep a flax TrainState step and decorate it with "
                "@jaxcomm.linen_data_parallel(mesh)."
            )


class DataParallel:
    """A compiled data-parallel train step; build it with :func:`data_parallel`.

    Attributes:
      mesh: the device mesh.
      axes: data-parallel axis names.
      check_replicas: compare replicas every this many steps (0: off).
      per_device_paths: optimizer-state leaves stored per device (after ``init``).
      syncs: the :class:`~jaxcomm.GradientSync` of each ``sync_gradients`` the optimizer
        runs, in the order it runs them (after ``init``).

    The step equals the one-device computation of the same script, or is refused:

    * each ``sync_gradients`` must receive the gradients the step computed (the step
      states them in its ``jaxcomm.SyncRequest``; compared by identity, whatever wraps
      the sync), or a function of them that commutes with the mean over devices: a
      transform before the sync (``scale``, ``add_decayed_weights``), a wrapper's
      accumulated mean (``optax.MultiSteps``). One that does not (``clip_by_global_norm``,
      ``clip``, per-leaf or adaptive clipping), in an ``optax.chain``, a
      ``named_chain``, ``MultiSteps``, ``inject_hyperparams`` or a wrapper of your own, is
      found by a probe at build time (the sync's input for two random gradients and for
      their mean, at three scales) and refused: put ``sync_gradients()`` first.
    * optimizers that read the loss (optax's extra argument ``value=``, e.g.
      ``optax.contrib.reduce_on_plateau``) get the mean loss of the global batch.
    * an fp16 overflow (``jaxcomm.compression.fp16``) skips the step whole: params and
      optimizer state stay as they were, only the fp16 counters move.
    * every process must pass the same initial params, model state and optimizer state to
      :meth:`DataParallel.init` (compared by digest; refused naming the processes).
    * a batch in ``jax.pmap``'s layout ``(devices, per_device, ...)`` is refused where the
      loss tells it apart (it traces on ``(per_device, ...)`` and not on the
      ``(1, per_device, ...)`` slice each device would get); pass the global batch,
      ``x.reshape(-1, *x.shape[2:])``.
    """

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        axes: tuple[str, ...],
        has_aux: bool,
        with_model_state: bool,
        compiler_options: Mapping[str, Any] | None,
        donate: bool,
        require_sync: bool,
        microbatches: int = 1,
        accumulate: str = "local",
        check_replicas: int | None = None,
        shard: Mapping[str, Any] | None = None,
        shard_params: bool = False,
        gather: str = "whole",
    ):
        check_replicas, microbatches = _check_step_options(
            optimizer, mesh, axes, check_replicas, microbatches, accumulate, with_model_state
        )
        self.mesh = mesh
        self.axes = axes
        # Mesh axes besides the data axes (make_mesh(model=M)'s 'model'): left to the
        # compiler, the step's shard_map manual over the data axes only.
        self.model_axes = tuple(a for a in mesh.axis_names if a not in axes)
        if MODEL in axes:
            raise ValueError(
                f"data_parallel(axes={axes}): {MODEL!r} is the model axis of "
                "jaxcomm.make_mesh(model=...), over which a model shards its params; it "
                "cannot also be a data axis. Pass axes=('inter', 'intra')."
            )
        self.optimizer = accepting_requests(optimizer)
        self._loss_fn = _axis_names_checked(loss_fn, axes)
        self._has_aux = has_aux
        self._with_model_state = with_model_state
        self._require_sync = require_sync
        self.compiler_options = dict(compiler_options or {})
        self._donate = donate
        self.microbatches = microbatches
        self.accumulate = accumulate
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self.batch_sharding = NamedSharding(mesh, P(axes))
        self.replicated = NamedSharding(mesh, P())
        self._stacked = NamedSharding(mesh, P(axes))
        self.check_replicas = int(check_replicas)
        self._one_step_in_flight = backend.for_mesh(mesh).one_step_in_flight
        self._compiled_step: Any = None  # set_feedback's step
        self._programs: dict = {}  # by jaxcomm.HostPhase (HostPhase(): on the devices)
        self._clock: PhaseClock | None = None  # the host's copy of the counts
        self._opt_layout: list[bool] | None = None  # per optimizer-state leaf: per device?
        check_choice("data_parallel(gather=...)", gather, GATHER_MODES)
        if gather != "whole" and not shard_params:
            raise ValueError(
                f"data_parallel(gather={gather!r}) says where params stored split over a "
                "node are gathered, but shard_params=False keeps them whole; pass "
                "shard_params=True with it, or leave gather='whole'."
            )
        self._gather = gather
        self.layout: OptimizerLayout = self._make_layout(shard, shard_params)
        self._step_loss = self.layout.loss(self._loss_fn)  # of the stored params
        self._calls = 0
        self._feedback: Any = None  # set_feedback: the measured share goes into each step

    def _make_layout(self, shard: Mapping[str, Any] | None, shard_params: bool) -> OptimizerLayout:
        """The optimizer's layout: replicated, sharded with the :class:`ShardedOptimizer`
        keyword arguments ``shard`` (:func:`jaxcomm.sharded.shard_options`), or hybrid
        (``shard_params``: :class:`jaxcomm.hybrid.HybridOptimizer`)."""
        if shard_params:
            return self._hybrid_layout(shard)
        self._refuse_model_axes_options(shard)
        if shard is None:
            return ReplicatedOptimizer(
                self.optimizer,
                self.mesh,
                self.axes,
                require_sync=self._require_sync,
                overlapped=self._overlapped,
            )
        if self._overlapped:
            raise NotImplementedError(
                "data_parallel(shard_optimizer=True, microbatches > 1) accumulates the "
                f"microbatches' gradients on each device (accumulate='local') and "
                f"reduce-scatters once; accumulate={self.accumulate!r} (a reduction per "
                "microbatch) is not implemented. Use accumulate='local'."
            )
        if not self._require_sync:
            raise ValueError(
                "data_parallel(shard_optimizer=True) reduce-scatters the gradients itself: "
                "require_sync=False does not apply; leave it True."
            )
        return ShardedOptimizer(self.optimizer, self.mesh, self.axes, **shard)

    def _refuse_model_axes_options(self, shard: Mapping[str, Any] | None) -> None:
        """Refuses, on a mesh with a model axis, the options not implemented there."""
        options = (
            ("shard_optimizer=True", shard is not None),
            (f"microbatches={self.microbatches}", self.microbatches > 1),
        )
        for name, given in options:
            if given and self.model_axes:
                raise NotImplementedError(
                    f"data_parallel({name}) on a mesh with the model axes {self.model_axes} "
                    "is not implemented; use a mesh of the data axes "
                    "(jaxcomm.make_mesh(intra=...)) for it."
                )

    def _hybrid_layout(self, shard: Mapping[str, Any] | None) -> HybridOptimizer:
        """``shard_params=True``'s layout, after refusing the options it does not run."""
        if shard is not None:
            raise ValueError(
                "data_parallel(shard_params=True, shard_optimizer=True): shard_params "
                "shards the optimizer state (and the params and gradients) over the node "
                "already; pass only shard_params=True."
            )
        if not self._require_sync:
            raise ValueError(
                "data_parallel(shard_params=True) reduce-scatters the gradients itself: "
                "require_sync=False does not apply; leave it True."
            )
        if self.microbatches > 1:
            raise NotImplementedError(
                f"data_parallel(shard_params=True, microbatches={self.microbatches}) is not "
                "implemented; use microbatches=1 (a smaller batch per step)."
            )
        if self.model_axes:
            raise NotImplementedError(
                f"data_parallel(shard_params=True) on a mesh with axes {self.model_axes} "
                "besides the data axes (a model axis) is not implemented; use a mesh of "
                "the data axes (jaxcomm.make_mesh(intra=...)) or shard_params=False."
            )
        return HybridOptimizer(
            self.optimizer, self.mesh, self.axes, where="data_parallel", gather=self._gather
        )

    # -- state ------------------------------------------------------------------------
    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of a (global) TrainState."""
        return TrainState(
            step=P(),
            params=self.layout.param_specs(state.params),
            opt_state=self.layout.opt_specs(state.opt_state, self._layout(state.params)),
            model_state=jax.tree.map(lambda _: P(), state.model_state),
        )

    @property
    def per_device_paths(self) -> list[str]:
        """Paths (``jax.tree_util.keystr``) of the optimizer-state leaves stored per device
        (known after :meth:`init` or the first step)."""
        flags = self._opt_layout or []
        return [p for p, f in zip(self.layout.paths, flags, strict=True) if f]

    def _layout(self, params: Any) -> list[bool]:
        """Per optimizer-state leaf, whether it is stored per device: decided once, by
        the layout (:meth:`jaxcomm.layout.OptimizerLayout.infer_layout`)."""
        if self._opt_layout is None:
            self._opt_layout = self.layout.infer_layout(params)
            self._refuse_with_model_axes()
        return self._opt_layout

    def _refuse_with_model_axes(self) -> None:
        """On a mesh with a model axis, refuses what is not implemented there: in a
        partial-manual shard_map every collective but ``psum`` first gathers its operand
        over the automatic axes, and the compressors' all-to-alls and all-gathers (and
        their per-device state) are not written for that."""
        if not self.model_axes:
            return
        what = None
        if any(s.compression is not None for s in self.syncs):
            what = "a compressed sync_gradients"
        elif self.layout.local_sgd:
            what = "jaxcomm.local_sgd"
        if what is not None:
            raise NotImplementedError(
                f"data_parallel on a mesh with the model axes {self.model_axes}: {what} is "
                "not implemented (only the f32 sync: sync_gradients() with any algorithm; "
                "'flat' keeps each device's model shard, the others gather it over the "
                "model axis first). Use a mesh of the data axes for it."
            )

    @property
    def syncs(self) -> list[GradientSync]:
        """The :class:`~jaxcomm.GradientSync` of each ``sync_gradients`` the step runs, in
        the order it runs them (known after :meth:`init`)."""
        return self.layout.syncs

    def param_shardings(self, params: Any) -> Any:
        """The ``NamedSharding`` of each param leaf as the step stores it (replicated, or
        with ``shard_params=True`` split over ``'intra'``); on a mesh with a model axis
        (``make_mesh(model=M)``), a leaf's own sharding over it is kept.

        Raises:
          ValueError: a param leaf is sharded over a data axis (the data axes split the
            batch; a model shards its params over the model axis).
        """
        specs = self.layout.param_specs(params)
        if not self.model_axes:
            return jax.tree.map(
                lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
            )
        return jax.tree_util.tree_map_with_path(self._model_sharding, params)

    def _model_sharding(self, path: Any, x: Any) -> NamedSharding:
        """A replicated param leaf's sharding over the model axes: its own, if it has one
        on this mesh; refused if that names a data axis."""
        sharding = getattr(x, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        named = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
        clash = sorted(named & set(self.axes))
        if clash:
            raise ValueError(
                f"data_parallel: params{jax.tree_util.keystr(path)} is sharded {spec}, over "
                f"{clash}, data axes of this step (they split the batch, and every data-"
                f"parallel replica holds the whole params). Shard params over the model axis "
                f"{self.model_axes} (jaxcomm.make_mesh(model=M), "
                f"NamedSharding(mesh, P(None, {MODEL!r}))), or use shard_params=True on a "
                "mesh of the data axes to split them over 'intra'."
            )
        return NamedSharding(self.mesh, spec)

    @property
    def sharded(self) -> ShardedOptimizer | None:
        """The :class:`~jaxcomm.sharded.ShardedOptimizer` of ``shard_optimizer=True``
        (``.sync``, ``.param_gather``, ``.bucket_bytes``, ``.shard_plan`` after
        :meth:`init`), else None."""
        return self.layout if isinstance(self.layout, ShardedOptimizer) else None

    def state_shardings(self, state: TrainState) -> TrainState:
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.state_specs(state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def abstract_state(self, params: Any) -> TrainState:
        """The :class:`TrainState` :meth:`init` would build, as ``jax.ShapeDtypeStruct`` s
        with their shardings (nothing is allocated): to read a model's memory per device
        (``jaxcomm.sharded.per_device_bytes``) or compile its step
        (:meth:`compile` takes it) before building it.

        Args:
          params: the params, or their ``jax.ShapeDtypeStruct`` s.

        Example:
          >>> state = dp.abstract_state(jax.eval_shape(model_init, key))
          >>> dp.compile(state, batch).memory_analysis()
        """
        abstract = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p), sharding=s),
            params,
            self.param_shardings(params),
        )
        per = self._layout(abstract)
        opt = jax.eval_shape(self.layout.init_fn(per), abstract)
        specs = self.layout.opt_specs(opt, per)
        opt = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, s)
            ),
            opt,
            specs,
        )
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        return TrainState(step, abstract, opt, None)

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Places params on the mesh and initialises the optimizer state.

        Per-device state is created inside ``shard_map``, so a transform may make it differ
        across devices (``lax.axis_index``).

        Raises:
          ValueError: with several processes, the params, model state or replicated
            optimizer state differ between processes (``check_same_on_processes``: their
            replicas would train apart); or the optimizer is refused (see
            :func:`data_parallel`).
        """
        _check_params(params)
        # Every process must start from the same values, or the replicas train apart (a
        # per-process seed); compared by digest through the coordination service.
        check_same_on_processes(
            "the initial params and model state",
            (params, model_state),
            fix="Draw them from one seed on every process (e.g. jax.random.key(0), not a "
            "key from jax.process_index()), or load them from one checkpoint.",
        )
        params = jax.device_put(params, self.param_shardings(params))
        if model_state is not None:
            model_state = jax.device_put(model_state, self.replicated)
        per = self._layout(params)
        opt_state = self.layout.init_fn(per)(params)
        shared = [x for x, f in zip(jax.tree.leaves(opt_state), per, strict=True) if not f]
        check_same_on_processes(
            "the initial optimizer state",
            shared,
            fix="Build the optimizer alike on every process (its init must not read "
            "jax.process_index() or a per-process seed outside jaxcomm.PerDevice state).",
        )
        return TrainState(
            step=jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
        )

    def reshard(self, state: TrainState) -> TrainState:
        """``state`` of a sharded step (``shard_optimizer=True``) on another device count
        (e.g. restored from a checkpoint written on 8 devices) laid out for this one
        (:meth:`jaxcomm.sharded.ShardedOptimizer.reshard`: each per-device leaf read row
        after row is its param leaf, flattened, so it is cut or zero-padded and split
        anew; the layout does not depend on ``shard_bucket_bytes``).

        Args:
          state: a :class:`TrainState` of a sharded step with the same params and
            optimizer, its arrays on this step's devices (restore them with this mesh's
            shardings) or on the host.

        Returns:
          The state, sharded over this step's mesh.

        Raises:
          ValueError: the step's optimizer state is replicated, or the state does not
            have this step's structure (see the layout's ``reshard``).
        """
        self._layout(state.params)
        opt_state = self.layout.reshard(state.opt_state, self._stacked)
        put = lambda t: jax.device_put(t, self.replicated)  # noqa: E731
        return TrainState(
            put(state.step),
            jax.device_put(state.params, self.param_shardings(state.params)),
            opt_state,
            None if state.model_state is None else put(state.model_state),
        )

    # -- batch ------------------------------------------------------------------------
    def _refuse_pmap_layout(self, state: TrainState, batch: Any) -> None:
        """Refuses a batch in ``jax.pmap``'s layout ``(devices, per_device, ...)``.

        data_parallel splits the leading axis itself, so such a batch gives each device a
        slice ``(1, per_device, ...)``. Where that is unambiguous it is refused: every leaf
        has ``devices`` rows and at least two axes, the loss traces on the slice without
        that axis (``(per_device, ...)``) to a scalar, and not on the slice it would get
        (``(1, per_device, ...)``). A global batch of one example per device whose loss
        traces either way is taken as what it says it is.
        """
        if jax.process_count() > 1 or self._with_model_state or self.microbatches > 1:
            return
        leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
        shapes = [(k, np.shape(x), jnp.result_type(x)) for k, x in leaves]
        d = self.num_devices
        if not shapes or any(len(s) < 2 or s[0] != d for _, s, _ in shapes):
            return
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), p.dtype), state.params)

        def traces(cut):
            local = jax.tree.unflatten(
                jax.tree.structure(batch),
                [jax.ShapeDtypeStruct(cut(s), t) for _, s, t in shapes],
            )
            try:
                out = jax.eval_shape(self._loss_fn, params, local)
            except Exception:  # noqa: BLE001 (the loss does not take this shape)
                return False
            loss = out[0] if self._has_aux else out
            return getattr(loss, "shape", None) == ()

        if traces(lambda s: (1, *s[1:])) or not traces(lambda s: s[1:]):
            return
        k, s, _ = shapes[0]
        flat = (s[0] * s[1], *s[2:])
        raise ValueError(
            f"data_parallel: the batch leaf {jax.tree_util.keystr(k)} has shape {s}, the "
            f"layout of jax.pmap (devices, per_device, ...): its leading axis is the {d} "
            "devices, and the loss takes one device's part only without it. data_parallel "
            "takes the global batch and splits its leading axis over the devices itself: "
            f"pass x.reshape(-1, *x.shape[2:]), here shape {flat}."
        )

    def shard_batch(self, batch: Any) -> Any:
        """Puts a batch on the mesh, split along its leading axis over the data axes.

        On one process ``batch`` is the global batch; with several processes, each passes
        its own part (``jax.make_array_from_process_local_data``). A
        ``jax.ShapeDtypeStruct`` (the global batch's shape, for :meth:`compile` on an
        :meth:`abstract_state`) gets the batch sharding.
        """

        def put(x):
            if isinstance(x, jax.Array) and x.sharding == self.batch_sharding:
                return x
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding)
            x = np.asarray(x) if not isinstance(x, jax.Array) else x
            if jax.process_count() > 1:
                return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x))
            if x.shape[0] % self.num_devices:
                raise ValueError(
                    f"batch leading dimension {x.shape[0]} does not divide by the "
                    f"{self.num_devices} data-parallel devices; use a multiple of "
                    f"{self.num_devices}."
                )
            return jax.device_put(x, self.batch_sharding)

        return jax.tree.map(put, batch)

    # -- step -------------------------------------------------------------------------
    def _varying_params(self, params: Any) -> Any:
        """``params`` typed varying over the data axes (a no-op at run time), by the
        layout (:meth:`jaxcomm.layout.OptimizerLayout.differentiable`).

        Under ``check_vma=True``, the gradient with respect to an *invariant* input is
        reduced by JAX itself (the transpose of the implicit ``pvary`` is a ``psum``);
        differentiating with respect to a varying copy yields each device's own gradient,
        which ``sync_gradients`` then reduces with the configured algorithm.
        """
        return self.layout.differentiable(params)

    def _local_step(
        self,
        state: TrainState,
        batch: Any,
        comm_share: jax.Array | None = None,
        *,
        feedback: Any = None,
        communicate: bool = True,
        phase: HostPhase = NO_HOST_PHASE,
    ):
        """One device's step inside shard_map: the gradients, the optimizer's step by the
        layout (:meth:`jaxcomm.layout.OptimizerLayout.step`: the syncs reduce, or the
        sharded optimizer reduce-scatters and gathers), then the outputs combined."""
        self.layout.check_step(feedback=comm_share is not None, communicate=communicate)
        opt_state = unstack_leaves(state.opt_state, self._opt_layout)
        if comm_share is not None:
            # The measured communication share, an explicit input of the step (one value per
            # device, from its process's clock), averaged over the data axes so that every
            # device decides from one value, written into the state by the feedback.
            opt_state = feedback.write(opt_state, lax.pmean(comm_share[0], self.axes))
        # Where this device's gradient is taken: jaxcomm.local_sgd's local params (per
        # device, varying already) if the optimizer has them, else the replicated params.
        local = gradient_params(opt_state) if self.layout.local_sgd else None
        value, aux, grads, update, model_state = self._gradients(
            state, opt_state, batch, local, communicate
        )
        params, new_opt, done = self.layout.step(
            grads,
            opt_state,
            state.params,
            state.step,
            lambda: lax.pmean(value, self.axes),
            update=update,
            communicate=communicate,
            phase=phase,
        )
        metrics = {"loss": value, **dict(aux or {})}
        # After the update: the sync's conditionals may hold collectives still running
        # when an independent all-reduce starts (jaxcomm.ordering).
        synced, metrics = ordering.after(
            (model_state if self._with_model_state else None, metrics), done
        )
        synced, metrics = self._outputs(synced, metrics, local_sgd=local is not None)
        if self._with_model_state:
            model_state = synced
        new_state = TrainState(
            state.step + 1, params, stack_leaves(new_opt, self._opt_layout), model_state
        )
        return new_state, metrics

    def _gradients(self, state, opt_state, batch, local, communicate: bool):
        """This device's ``(loss, metrics, gradients, optimizer update, model state)``: at
        the replicated params (typed varying) or at local_sgd's ``local`` params, over
        microbatches where asked (their update then threads the reductions' state)."""
        at = self._varying_params(state.params) if local is None else local
        if self._with_model_state:

            def loss(p):
                return self._step_loss(p, state.model_state, batch)

            (value, (model_state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(at)
            return value, aux, grads, self.optimizer.update, model_state
        if self.microbatches > 1:
            acc = accumulate_gradients(
                self._loss_fn,
                self.optimizer,
                state.params if local is None else local,
                opt_state,
                batch,
                microbatches=self.microbatches,
                accumulate=self.accumulate,
                has_aux=self._has_aux,
                axes=self.axes,
                communicate=communicate,
            )
            return acc.value, acc.aux, acc.grads, acc.update, state.model_state
        out, grads = jax.value_and_grad(self._step_loss, has_aux=self._has_aux)(at, batch)
        value, aux = out if self._has_aux else (out, {})
        return value, aux, grads, self.optimizer.update, state.model_state

    def _outputs(self, synced: Any, metrics: Any, *, local_sgd: bool) -> tuple[Any, Any]:
        """The model state averaged and the metrics combined over the devices; with
        local_sgd the metrics stay one row per device."""
        if not local_sgd:
            return self._combine(synced, _float_metrics(metrics))
        synced = allreduce_floats(synced, self.axes, "mean")
        # jaxcomm.local_sgd: each device's own value (at its own params), one row per
        # device. Averaging here would put a collective on every local step, the very
        # cost local steps avoid; the caller averages the rows when it reads them.
        metrics = jax.tree.map(
            lambda m: jnp.asarray(m.value if isinstance(m, outputs.Reduced) else m)[None],
            _float_metrics(metrics),
            is_leaf=lambda x: isinstance(x, outputs.Reduced),
        )
        return synced, metrics

    def _combine(self, synced: Any, metrics: Any) -> tuple[Any, Any]:
        """The model state averaged and the metrics combined over the devices by their kind
        (``jaxcomm.outputs``: means averaged, sums summed, per-example values gathered), the
        float means of both in one all-reduce per dtype."""
        flat, treedef = jax.tree.flatten(synced)
        floats = [i for i, x in enumerate(flat) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
        out = outputs.combine(
            {"state": outputs.mean([flat[i] for i in floats]), "metrics": metrics}, self.axes
        )
        for i, x in zip(floats, out["state"], strict=True):
            flat[i] = x
        return jax.tree.unflatten(treedef, flat), out["metrics"]

    @property
    def _overlapped(self) -> bool:
        """Whether the gradients reach the optimizer reduced already ('overlap' mode)."""
        return self.microbatches > 1 and self.accumulate == "overlap"

    def step_fn(
        self,
        state: TrainState,
        *,
        feedback: Any = None,
        communicate: bool = True,
        phase: HostPhase = NO_HOST_PHASE,
        warming_up: bool | None = None,
    ) -> Callable:
        """The jitted ``(state, batch) -> (state, metrics)`` for states shaped like ``state``.

        Runs under ``jax.shard_map(..., check_vma=True)``: every output typed replicated
        (``P()``: step, params, model state, the optimizer state that is not per device)
        must be invariant over the data axes in shard_map's type system, or tracing fails.
        That is the proof that replicas agree; ``check_replicas=N`` checks the values too.

        Args:
          state: an example state (its shapes and layout).
          feedback: None, or the feedback of :meth:`set_feedback`: the step then takes a
            third input, the measured communication share (f32, one value per device,
            split over the data axes like the batch), and writes its mean over the
            devices into the optimizer state with ``feedback.write(opt_state, share)``
            before the update.
          communicate: False builds the compute-only twin: every ``sync_gradients`` passes
            the gradients through (no gradient collective; params drift, so no
            replication check).
          phase: the program of one :class:`jaxcomm.HostPhase` (the warm-up phase, local
            SGD's branch, the compressor's choice), with no conditional for the
            decisions it fixes; ``HostPhase()`` (default): the step decides on the
            devices, one program for every step.
          warming_up: deprecated since 0.2.0 (it warns):
            ``phase=jaxcomm.HostPhase(warming_up=...)``.
        """
        if not isinstance(phase, HostPhase):
            raise TypeError(
                f"phase={phase!r} is not a jaxcomm.HostPhase; pass jaxcomm.HostPhase() (the "
                "program for every step) or one with warming_up / local_sgd / codec_choice "
                "set, e.g. jaxcomm.HostPhase(warming_up=False)."
            )
        if warming_up is not None:
            deprecated.warn(
                "DataParallel.step_fn(state, warming_up=...)",
                "dp.step_fn(state, phase=jaxcomm.HostPhase(warming_up=...))",
            )
            phase = phase._replace(warming_up=warming_up)
        specs = self.state_specs(state)
        local_step = functools.partial(
            self._local_step, feedback=feedback, communicate=communicate, phase=phase
        )
        # A model axis is left to the compiler (partial-manual shard_map): the params keep
        # their sharding over it, and what is not sharded over it is replicated.
        manual = {"axis_names": frozenset(self.axes)} if self.model_axes else {}
        mapped = jax.shard_map(
            local_step,
            mesh=self.mesh,
            **manual,
            in_specs=(specs, P(self.axes), *((P(self.axes),) if feedback else ())),
            out_specs=(specs, P(self.axes) if self.layout.local_sgd else P()),
            # Off only where params are meant to drift: require_sync=False (the user's own
            # reduction, or an experiment's compute-only twin) and the profiler's twin.
            check_vma=self._require_sync and communicate,
        )
        return jax.jit(
            mapped,
            donate_argnums=(0,) if self._donate else (),
            compiler_options=self.compiler_options or None,
        )

    def set_feedback(self, feedback: Any, state: TrainState, batch: Any) -> Any:
        """Feeds a measurement into every later step, and compiles that step now.

        From now on each call passes ``feedback.before_step()`` (an f32 array of one value
        per device, sharded like the batch: the measured communication share; the step
        averages it over the devices and writes it into the optimizer state with
        ``feedback.write(opt_state, share)``, inside the step) as the step's third input
        and hands the new state to ``feedback.after_step(state)``.
        ``jaxcomm.CommProfiler.drive`` is the feedback that measures the share; users call
        that.

        Args:
          feedback: an object with ``before_step() -> jax.Array``,
            ``write(opt_state, share) -> opt_state`` (traced) and
            ``after_step(state) -> None``.
          state, batch: example inputs (the step is compiled for their shapes).

        Returns:
          The ``jax.stages.Compiled`` step.
        """
        self._compiled_step = self.compile(state, batch, feedback=feedback)
        self._feedback = feedback
        return self._compiled_step

    # -- what jaxcomm.CommProfiler.drive reads --------------------------------------------
    def drive_inputs(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """The inputs of the compiled step (``state``, the batch on the mesh), for
        ``jaxcomm.CommProfiler.drive``, which times the step on them several times.

        Raises:
          ValueError: ``donate=True`` (each run consumes the state), or
            ``accumulate='overlap'`` (the adaptive windows would count reductions).
        """
        if self._donate:
            raise ValueError(
                "CommProfiler.drive times the compute-only twin and each rung on the state "
                "you pass (several runs of it), but data_parallel(donate=True) consumes the "
                "state's buffers on every step; build the step with donate=False to drive it."
            )
        if self._overlapped:
            raise ValueError(
                "CommProfiler.drive: accumulate='overlap' reduces every microbatch, so the "
                "adaptive windows would count reductions, not steps; use accumulate='local'."
            )
        return state, self.shard_batch(batch)

    @staticmethod
    def optimizer_states(state: TrainState) -> list[Any]:
        """The optimizer state of the step's one optimizer (``jaxcomm.FrontEnd``):
        ``[state.opt_state]``."""
        return [state.opt_state]

    @staticmethod
    def with_optimizer_states(state: TrainState, opt_states: list[Any]) -> TrainState:
        """``state`` with its optimizer state replaced by ``opt_states``' one entry
        (``jaxcomm.FrontEnd``)."""
        (opt_state,) = opt_states
        return state._replace(opt_state=opt_state)

    def adaptive_states(self, state: TrainState) -> list[Any]:
        """Deprecated since 0.2.0 (it warns):
        ``jaxcomm.compression.adaptive_states(dp.optimizer_states(state)[0])``."""
        from jaxcomm.compression import adaptive_states

        deprecated.warn(
            "DataParallel.adaptive_states(state)",
            "jaxcomm.compression.adaptive_states(dp.optimizer_states(state)[0])",
        )
        return adaptive_states(self.optimizer_states(state)[0])

    def replace_adaptive(self, state: TrainState, fn: Callable) -> TrainState:
        """Deprecated since 0.2.0 (it warns): ``dp.with_optimizer_states(state,
        [jaxcomm.compression.map_adaptive(dp.optimizer_states(state)[0], fn)])``."""
        from jaxcomm.compression import map_adaptive

        deprecated.warn(
            "DataParallel.replace_adaptive(state, fn)",
            "dp.with_optimizer_states(state, "
            "[jaxcomm.compression.map_adaptive(dp.optimizer_states(state)[0], fn)])",
        )
        return self.with_optimizer_states(
            state, [map_adaptive(self.optimizer_states(state)[0], fn)]
        )

    def compile(
        self,
        state: TrainState,
        batch: Any,
        *,
        feedback: Any = None,
        communicate: bool = True,
        phase: HostPhase | None = None,
    ) -> Any:
        """The step compiled for these inputs, ready to run on every process.

        With several processes, every process agrees on the outcome and a CPU module is
        checked for ordering hazards (:func:`compile_on_every_process`).

        Args:
          state, batch: example inputs (the step is compiled for their shapes).
          feedback, communicate: as :meth:`step_fn` says (the feedback of
            :meth:`set_feedback`; the compute-only twin).
          phase: the program of this :class:`jaxcomm.HostPhase`; ``HostPhase()`` the one
            program for every step, which decides on the devices; None (default): the
            phase the step runs from ``state`` (the feedback step and the twin: every
            step's).

        Returns:
          A ``jax.stages.Compiled`` step: ``compiled(state, batch[, share])``.

        Raises:
          RuntimeError: on several CPU processes, the module holds an ordering hazard; or
            another process could not compile the step.
        """
        self._refuse_pmap_layout(state, batch)
        args: tuple = (state, self.shard_batch(batch))
        if feedback is not None:
            share = jax.ShapeDtypeStruct((self.num_devices,), jnp.float32, sharding=self._stacked)
            args += (share,)
        if phase is None:
            phase = self._phase(state) if feedback is None and communicate else NO_HOST_PHASE
        step = self.step_fn(state, feedback=feedback, communicate=communicate, phase=phase)
        return compile_on_every_process(step, args, self.mesh, "data-parallel step")

    def _phase(self, state: TrainState) -> HostPhase:
        """The host's decisions for a step from ``state`` (:mod:`jaxcomm.phase_clock`);
        ``HostPhase()`` before the optimizer was probed. The syncs whose count does not
        advance by one per step (microbatches reduced one by one, local SGD's outer
        syncs) and a sharded optimizer's (no warm-up, no host choice) decide on the
        devices, as does the profiler's feedback step (one program across windows)."""
        if self._clock is None:
            if not self.syncs:  # not probed yet: the devices decide this once
                return HostPhase()
            one_per_step = not (self._overlapped or self.layout.local_sgd)
            replicated = isinstance(self.layout, ReplicatedOptimizer)
            syncs = self.syncs if one_per_step and replicated else []
            self._clock = PhaseClock(syncs, state.opt_state, dict(self.mesh.shape))
        return self._clock.decide(state.opt_state)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """Runs one step; returns ``(new_state, metrics)``: metrics combined over devices by
        their kind (``jaxcomm.outputs``; the loss averaged), or with ``jaxcomm.local_sgd``
        one value per device (shape ``(devices,)``)."""
        if self._feedback is not None:
            step = self._compiled_step
        else:
            phase = self._phase(state)
            step = self._programs.get(phase)
            if step is None:  # one program per phase, compiled at its first step
                self._refuse_pmap_layout(state, batch)
                # Several processes: compiled ahead and met at a barrier (see compile()).
                many = jax.process_count() > 1
                step = (
                    self.compile(state, batch, phase=phase)
                    if many
                    else self.step_fn(state, phase=phase)
                )
                self._programs[phase] = step
        extra = () if self._feedback is None else (self._feedback.before_step(),)
        out = step(state, self.shard_batch(batch), *extra)
        if self._feedback is None and self._clock is not None:
            self._clock.advanced(out[0].opt_state)
        if self._one_step_in_flight:
            jax.block_until_ready(out)
        self._calls += 1
        if self.check_replicas and self._calls % self.check_replicas == 0:
            _check_replicas(out[0], mesh=self.mesh, what=f"state (step {self._calls})")
        if self._feedback is not None:
            self._feedback.after_step(out[0])
        return out

    def lower(self, state: TrainState, batch: Any):
        """``jax.stages.Lowered`` of the program the step runs from ``state`` (its
        :class:`jaxcomm.HostPhase`), for HLO inspection (``jaxcomm.hlo``)."""
        step = self.step_fn(state, phase=self._phase(state))
        return step.lower(state, self.shard_batch(batch))


def data_parallel(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: tuple[str, ...] = DATA_AXES,
    has_aux: bool = False,
    with_model_state: bool = False,
    compiler_options: Mapping[str, Any] | None = None,
    donate: bool = False,
    require_sync: bool = True,
    microbatches: int = 1,
    accumulate: str = "local",
    check_replicas: int | None = None,
    shard_optimizer: bool = False,
    param_gather: Any = None,
    shard_bucket_bytes: int | None = None,
    shard_params: bool = False,
    gather: str = "whole",
) -> DataParallel:
    """Builds a data-parallel train step over ``mesh``.

    The batch is split along its leading axis over ``axes``; params, model state and
    ordinary optimizer state are replicated; optimizer state wrapped in
    ``jaxcomm.PerDevice``, or whose value depends on each device's own gradients (shard_map
    types it varying, e.g. ``optax.MultiSteps``' accumulators), is stored per device,
    sharded along ``axes``. Each device computes the gradient of ``loss_fn`` on its shard;
    the optimizer (which must contain ``jaxcomm.sync_gradients``) averages them.

    Replicas agree by construction: the step runs under shard_map's replication check
    (``check_vma=True``), which proves at trace time that everything stored replicated is
    invariant across devices; an optimizer whose update is not (no sync before it) is
    refused with an error naming the leaf.

    The step equals the one-device computation of the same script, or is refused
    (:class:`DataParallel` lists what is refused and why).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``-> (loss, metrics)`` with
        ``has_aux``); with ``with_model_state``,
        ``loss_fn(params, model_state, batch) -> (loss, (new_model_state, metrics))``.
        The loss is the mean over the local batch.
      optimizer: an optax transform, e.g. ``optax.chain(jaxcomm.sync_gradients(), ...)``,
        or ``jaxcomm.local_sgd(...)`` (local steps: the gradient is taken at each device's
        own params, kept in its state; ``params`` are the anchor of the last sync).
      mesh: from :func:`jaxcomm.make_mesh`.
      axes: data-parallel axes of ``mesh``.
      has_aux: ``loss_fn`` also returns a dict of metrics, combined over the devices by
        their kind (``jaxcomm.outputs``): a floating scalar is a mean (averaged, in f32,
        like the loss), an array with a leading axis is per example (gathered in global
        batch order, e.g. logits come back ``(global batch, classes)``), and values marked
        ``jaxcomm.outputs.sum`` / ``max`` / ``min`` / ``mean`` / ``gather`` are reduced so;
        an unmarked integer scalar is refused (mark it). With ``microbatches`` the same
        rules hold over the microbatches (sums summed, not divided by their number).
        With ``jaxcomm.local_sgd`` the loss and metrics are not averaged: each has shape
        ``(devices,)``, one value per device at its own params (an average would be a
        collective on every local step): ``float(metrics['loss'].mean())`` when read.
      with_model_state: ``loss_fn`` takes and returns model state (batch statistics),
        whose float leaves are averaged across devices every step.
      compiler_options: XLA options for this step only (``jaxcomm.xla`` builds them).
      donate: donate the input state's buffers.
      require_sync: raise if the optimizer never calls ``sync_gradients``. ``False`` (you
        reduce gradients yourself, or time a compute-only twin) also runs the step without
        shard_map's replication check and takes per-device state from ``PerDevice`` marks
        only: replication is then not proven, use ``check_replicas``.
      microbatches: split each device's batch into this many microbatches, run one after
        the other in a ``lax.scan`` (activation memory of one microbatch), and accumulate
        their gradients as ``accumulate`` says. The loss must be a mean over the batch; the
        result then equals ``microbatches=1`` (to f32 rounding; with a compressor, in
        'local' mode). Not supported with ``with_model_state``.
      accumulate: how microbatch gradients reach the optimizer (``jaxcomm.microbatch``):
        ``'local'`` (default) sums them on each device in f32 and synchronises once per
        step (the bytes of ``microbatches=1``, any compressor); ``'overlap'`` reduces
        microbatch i while i+1 computes (``N`` times the bytes; never a shorter step than
        'local' in the simple model: ``N C + R`` vs ``C + (N-1) max(C, R) + R``).
      check_replicas: every this many steps, compare every replicated leaf of the state
        across devices by its bits (hashes exchanged between processes) and raise
        ``jaxcomm.ReplicaDivergenceError`` naming the leaf and the devices that differ.
        ``0``/``None``: off. Costs a device-to-host copy of the state each time.
      shard_optimizer: shard the optimizer state and update over the data axes (ZeRO
        stages 1-2, ``jaxcomm.sharded``): gradients reduce-scattered hierarchically
        (through the sync's compressor: bf16, int8, int4 give ZeRO++'s qgZ; the packed
        buffer is compressed whole, so the sync's ``min_size`` and ``algorithm`` stay at
        their defaults), each device's optimizer on its ``1/N`` chunk, params
        all-gathered. The optimizer must be
        ``optax.chain(jaxcomm.sync_gradients(...), *elementwise transforms)``; a
        transform that does not shard is refused at build time by a probe. With
        ``microbatches``, ``accumulate='local'`` only (one reduce-scatter per step).
      param_gather: with ``shard_optimizer``: None (f32 all-gathers of the params) or a
        compressor with an ``all_gather`` (``jaxcomm.compression.bf16()``, ``int8()``:
        ZeRO++'s qwZ); each device keeps its f32 master chunk, every device computes with
        the decoded gathered params.
      shard_bucket_bytes: with ``shard_optimizer``: the gradients and params are packed
        into buckets of whole leaves of at most this many bytes (64 MiB by default), each
        reduce-scattered and gathered on its own, so the step's temporaries stay near one
        copy of the gradients (one bucket per dtype would add two more copies of the
        model: the packed buffer and the gathered one).
      shard_params: hybrid sharding (``jaxcomm.hybrid``, as FSDP2's HSDP): params,
        gradients and optimizer state split over the devices of a node (``'intra'``,
        each leaf along the largest dimension ``intra`` divides), replicated over
        ``'inter'``. The loss sees each leaf gathered inside the node (the whole
        params at once, unless ``gather='layer'``), the gradients are reduce-scattered
        inside the node, and the optimizer's ``sync_gradients`` reduces each device's
        block across nodes only: ``1/intra`` of the model's bytes on a node's link,
        compressed as the sync says (elementwise compressors, error feedback, warm-up,
        every algorithm). The optimizer must be
        ``optax.chain(jaxcomm.sync_gradients(...), *transforms)``; ``state.params`` are
        the params, split. Not with ``shard_optimizer``, ``microbatches > 1`` or
        ``local_sgd`` (refused).
      gather: with ``shard_params``, where the params are gathered inside the node:
        ``'whole'`` (the loss sees every leaf gathered at its start; the backward pass
        keeps one gathered copy of the model) or ``'layer'`` (the loss gets the split
        blocks and the model gathers them where it uses them:
        :func:`jaxcomm.gathered_layers` over the layers, a scan whose rematerialised
        body gathers one layer's params, again in the backward pass, and
        :func:`jaxcomm.gather_params` for the rest; a device holds one layer's gathered
        params at a time; a split leaf the loss never gathers is refused when the step
        is traced). ``jaxcomm.models.gpt`` gathers per layer.

    Returns:
      A :class:`DataParallel`: ``state = dp.init(params)``, then
      ``state, metrics = dp(state, batch)``.

    Example:
      >>> mesh = jaxcomm.make_mesh(intra=4)
      >>> tx = optax.chain(jaxcomm.sync_gradients(), optax.sgd(0.1))
      >>> dp = jaxcomm.data_parallel(loss_fn, tx, mesh)
      >>> state = dp.init(params)
      >>> state, metrics = dp(state, {'x': x, 'y': y})
    """
    shard = shard_options("data_parallel", shard_optimizer, param_gather, shard_bucket_bytes)
    if not isinstance(shard_params, bool):
        raise TypeError(f"data_parallel(shard_params={shard_params!r}) must be True or False.")
    return DataParallel(
        loss_fn,
        optimizer,
        mesh,
        axes=check_axes(axes),
        has_aux=has_aux,
        with_model_state=with_model_state,
        compiler_options=compiler_options,
        donate=donate,
        require_sync=require_sync,
        microbatches=microbatches,
        accumulate=accumulate,
        check_replicas=check_replicas,
        shard=shard,
        shard_params=shard_params,
        gather=gather,
    )
