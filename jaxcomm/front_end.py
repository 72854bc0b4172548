"""What every front end provides: the one interface tools such as the profiler drive.

``jaxcomm.data_parallel``, the NNX and Linen decorators and the pmap entry are siblings:
each builds its step on the step core and declares what it offers through
:class:`FrontEnd`. ``jaxcomm.CommProfiler.drive`` takes any object that satisfies it, and
knows no front end by name.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jax.sharding import Mesh, NamedSharding

__all__ = ["FrontEnd"]


@runtime_checkable
class FrontEnd(Protocol):
    """A data-parallel step a tool can drive.

    The methods take the step's arguments as the user calls it (``*args``), or the
    program's state: the first element of :meth:`drive_inputs`' result (a
    ``jaxcomm.TrainState`` for ``data_parallel``, the flat leaves of the Flax objects for
    the decorators).

    Attributes:
      mesh: the device mesh the step runs on.
      num_devices: devices along the data axes.
      batch_sharding: how one value per device (a batch's leading axis) is laid out.
      syncs: the ``jaxcomm.GradientSync`` of each ``sync_gradients`` the step runs, in the
        order it runs them (known once the step is built).
    """

    mesh: Mesh
    num_devices: int
    batch_sharding: NamedSharding
    syncs: list

    def drive_inputs(self, *args: Any) -> tuple[Any, ...]:
        """The inputs of the compiled programs, placed on the mesh (the state first);
        raises ValueError for a step that cannot be driven (donated state)."""
        ...

    def set_feedback(self, feedback: Any, *args: Any) -> Any:
        """Compiles the step with a measured share as its last input (one f32 per device,
        laid out as :attr:`batch_sharding`), written into the optimizer state by
        ``feedback.write(opt_state, share)`` inside the step; every later call passes
        ``feedback.before_step()`` and hands the new state to
        ``feedback.after_step(state)``. Returns the compiled step."""
        ...

    def compile(self, *args: Any, communicate: bool = True) -> Any:
        """The step compiled for these arguments: the program of the phase the step runs
        from them (``jaxcomm.HostPhase``); ``communicate=False`` the compute-only twin
        (every ``sync_gradients`` passes its gradients through)."""
        ...

    def optimizer_states(self, state: Any) -> list[Any]:
        """The optimizer state of each optimizer in the program's ``state``, as optax
        state pytrees (per-device leaves with their leading device axis)."""
        ...

    def with_optimizer_states(self, state: Any, opt_states: list[Any]) -> Any:
        """The program's ``state`` with its optimizer states replaced by ``opt_states``
        (the same structure as :meth:`optimizer_states` returned)."""
        ...
