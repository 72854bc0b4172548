"""The instruments around the library: what measures, models and launches a step.

Nothing in the library (collectives, compression, sync, the step core, the front ends)
imports from here; the tools import the library's public surface.

- :mod:`~jaxcomm.tools.profiler`: times a front end's sync in the running step and drives
  adaptive compression (``jaxcomm.CommProfiler``).
- :mod:`~jaxcomm.tools.wire`: bytes each collective of a compiled step sends
  (``jaxcomm.wire_bytes``).
- :mod:`~jaxcomm.tools.schedule`: the order XLA scheduled a step's collectives in.
- :mod:`~jaxcomm.tools.simulate`, :mod:`~jaxcomm.tools.step_model`,
  :mod:`~jaxcomm.tools.calibration`: the step-time simulator, its model and its fitted
  constants (``python -m jaxcomm.tools.simulate``).
- :mod:`~jaxcomm.tools.testbed`: an emulated two-level network in network namespaces
  (``python -m jaxcomm.tools.testbed``).
- :mod:`~jaxcomm.tools.launch`: starts a multi-process run on one machine
  (``python -m jaxcomm.tools.launch``).
"""

# The command-line tools (calibration, launch, simulate, step_model, testbed) are imported
# by name (``from jaxcomm.tools import testbed``), not here: ``python -m`` runs a module
# that an import of the package has not loaded yet.
from jaxcomm.tools import profiler, schedule, wire

__all__ = ["profiler", "schedule", "wire"]
