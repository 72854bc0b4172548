"""The data-parallel train step builder: ``jit`` + ``shard_map`` with explicit state specs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.collectives import check_axes
from jaxcomm.mesh import DATA_AXES
from jaxcomm.microbatch import accumulate_gradients, check_accumulate
from jaxcomm.state import stack_local, state_partition_specs, unstack_local
from jaxcomm.sync import sync_probe
from jaxcomm.validate import check_int

__all__ = ["DataParallel", "TrainState", "data_parallel"]


class TrainState(NamedTuple):
    """Everything a step reads and writes (and so everything a checkpoint holds).

    Attributes:
      step: int32 scalar, number of steps taken.
      params: model parameters, replicated.
      opt_state: optimizer state; replicated except subtrees marked ``PerDevice``, which
        carry a leading axis of one entry per device, sharded along the data axes.
      model_state: non-trained model state such as batch-norm statistics (replicated,
        averaged across devices every step), or ``None``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None


def _pmean_floats(tree: Any, axes: tuple[str, ...]) -> Any:
    def f(x):
        x = jnp.asarray(x)
        return lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(f, tree)


class DataParallel:
    """A compiled data-parallel train step; build it with :func:`data_parallel`.

    Attributes:
      mesh: the device mesh.
      axes: data-parallel axis names.
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
    ):
        microbatches = check_int("microbatches", microbatches, minimum=1, fix="1 turns it off")
        check_accumulate(accumulate)
        if microbatches > 1 and with_model_state:
            raise ValueError(
                "microbatches > 1 with with_model_state=True is not supported: model state "
                "such as batch-norm statistics would be updated once per microbatch instead "
                "of once per step. Use microbatches=1 for such models."
            )
        missing = [a for a in axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"data_parallel(axes={axes}): axes {missing} are not in the mesh axes "
                f"{mesh.axis_names}. Build the mesh with jaxcomm.make_mesh()."
            )
        self.mesh = mesh
        self.axes = axes
        self.optimizer = optimizer
        self._loss_fn = loss_fn
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
        self._compiled_step: Any = None

    # -- state ------------------------------------------------------------------------
    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of a (global) TrainState."""
        return TrainState(
            step=P(),
            params=jax.tree.map(lambda _: P(), state.params),
            opt_state=state_partition_specs(state.opt_state, self.axes),
            model_state=jax.tree.map(lambda _: P(), state.model_state),
        )

    def state_shardings(self, state: TrainState) -> TrainState:
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.state_specs(state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Places params on the mesh and initialises the optimizer state.

        Per-device state is created inside ``shard_map``, so a transform may make it differ
        across devices (``lax.axis_index``).
        """
        params = jax.device_put(params, self.replicated)
        if model_state is not None:
            model_state = jax.device_put(model_state, self.replicated)
        # The structure (which subtrees are PerDevice) comes from an abstract run inside
        # shard_map, so that init may use lax.axis_index.
        abstract = jax.eval_shape(
            jax.shard_map(
                self.optimizer.init,
                mesh=self.mesh,
                in_specs=(P(),),
                out_specs=P(),
                check_vma=False,
            ),
            params,
        )
        opt_specs = state_partition_specs(abstract, self.axes)
        init_fn = jax.shard_map(
            lambda p: stack_local(self.optimizer.init(p)),
            mesh=self.mesh,
            in_specs=(P(),),
            out_specs=opt_specs,
            check_vma=False,
        )
        opt_state = jax.jit(init_fn)(params)
        return TrainState(
            step=jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
            params=params,
            opt_state=opt_state,
            model_state=model_state,
        )

    # -- batch ------------------------------------------------------------------------
    def shard_batch(self, batch: Any) -> Any:
        """Puts a batch on the mesh, split along its leading axis over the data axes.

        On one process ``batch`` is the global batch; with several processes, each passes
        its own part (``jax.make_array_from_process_local_data``).
        """

        def put(x):
            if isinstance(x, jax.Array) and x.sharding == self.batch_sharding:
                return x
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
    def _local_step(self, state: TrainState, batch: Any):
        opt_state = unstack_local(state.opt_state)
        update = self.optimizer.update
        if self._with_model_state:

            def loss(p):
                return self._loss_fn(p, state.model_state, batch)

            (value, (model_state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(
                state.params
            )
            model_state = _pmean_floats(model_state, self.axes)
        elif self.microbatches > 1:
            value, aux, grads, update = accumulate_gradients(
                self._loss_fn,
                self.optimizer,
                state.params,
                opt_state,
                batch,
                microbatches=self.microbatches,
                accumulate=self.accumulate,
                has_aux=self._has_aux,
                axes=self.axes,
            )
            model_state = state.model_state
        else:
            out, grads = jax.value_and_grad(self._loss_fn, has_aux=self._has_aux)(
                state.params, batch
            )
            value, aux = out if self._has_aux else (out, {})
            model_state = state.model_state
        with sync_probe() as calls:
            updates, opt_state = update(grads, opt_state, state.params)
        if self._require_sync and not calls:
            raise ValueError(
                "the optimizer passed to data_parallel never synchronises gradients, so "
                "params would drift apart across devices. Put jaxcomm.sync_gradients() first "
                "in the optax.chain, or pass require_sync=False if you reduce them yourself."
            )
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": value, **dict(aux or {})}
        metrics = jax.tree.map(lambda m: lax.pmean(jnp.asarray(m, jnp.float32), self.axes), metrics)
        new_state = TrainState(state.step + 1, params, stack_local(opt_state), model_state)
        return new_state, metrics

    def step_fn(self, state: TrainState) -> Callable:
        """The jitted ``(state, batch) -> (state, metrics)`` for states shaped like ``state``."""
        specs = self.state_specs(state)
        mapped = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(specs, P(self.axes)),
            out_specs=(specs, P()),
            # ring/tree collectives built from ppermute are replicated in value but not in
            # shard_map's type system; the sync probe above guards against missing syncs.
            check_vma=False,
        )
        return jax.jit(
            mapped,
            donate_argnums=(0,) if self._donate else (),
            compiler_options=self.compiler_options or None,
        )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """Runs one step; returns ``(new_state, metrics)`` with metrics averaged over devices."""
        if self._compiled_step is None:
            self._compiled_step = self.step_fn(state)
        out = self._compiled_step(state, self.shard_batch(batch))
        if jax.default_backend() == "cpu":
            # XLA:CPU: several queued executions of a program with collectives can deadlock
            # the in-process rendezvous (seen on 2-core machines with 8 fake devices: a
            # 40 s termination abort), so CPU runs keep one step in flight. GPU and TPU
            # keep asynchronous dispatch.
            jax.block_until_ready(out)
        return out

    def lower(self, state: TrainState, batch: Any):
        """``jax.stages.Lowered`` of the step, for HLO inspection (``jaxcomm.hlo``)."""
        return self.step_fn(state).lower(state, self.shard_batch(batch))


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
) -> DataParallel:
    """Builds a data-parallel train step over ``mesh``.

    The batch is split along its leading axis over ``axes``; params, model state and
    ordinary optimizer state are replicated; optimizer state wrapped in
    ``jaxcomm.PerDevice`` is sharded along ``axes``. Each device computes the gradient of
    ``loss_fn`` on its shard; the optimizer (which must contain ``jaxcomm.sync_gradients``)
    averages them.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``-> (loss, metrics)`` with
        ``has_aux``); with ``with_model_state``,
        ``loss_fn(params, model_state, batch) -> (loss, (new_model_state, metrics))``.
        The loss is the mean over the local batch.
      optimizer: an optax transform, e.g. ``optax.chain(jaxcomm.sync_gradients(), ...)``.
      mesh: from :func:`jaxcomm.make_mesh`.
      axes: data-parallel axes of ``mesh``.
      has_aux: ``loss_fn`` also returns a dict of metrics (averaged over devices).
      with_model_state: ``loss_fn`` takes and returns model state (batch statistics);
        its float leaves are averaged across devices every step.
      compiler_options: XLA options for this step only (``jaxcomm.xla`` builds them).
      donate: donate the input state's buffers to the output.
      require_sync: raise if the optimizer never calls ``sync_gradients``.
      microbatches: split each device's batch into this many microbatches, run one after
        the other in a ``lax.scan`` (activation memory of one microbatch), and accumulate
        their gradients as ``accumulate`` says. The loss must be a mean over the batch; the
        result then equals ``microbatches=1`` (to f32 rounding; with a compressor, in
        'local' mode). Not supported with ``with_model_state``.
      accumulate: how microbatch gradients reach the optimizer (``jaxcomm.microbatch``):
        ``'local'`` (default) sums them on each device in f32 and synchronises once per
        step -- the bytes of ``microbatches=1``, with any compressor, error feedback and
        warm-up; ``'overlap'`` reduces microbatch i while microbatch i+1 computes -- ``N``
        reductions per step (``N`` times the bytes, compressor state threaded through the
        scan, ``SyncGradientsState.count`` advancing per reduction), one extra gradient of
        memory, and never a shorter step than 'local' in the simple model (``N C + R``
        vs ``C + (N-1) max(C, R) + R``), hence the default.

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
    )
