"""Names that moved or changed in a release: they keep working for one more release and
warn (``DeprecationWarning``) with the call to write instead.

One table per kind of change, read by ``jaxcomm/__init__.py`` (a module ``__getattr__``
for the moved names), by the shims of the moved command-line tools (``python -m
jaxcomm.testbed``) and by the functions that still take an old keyword. Each entry is
removed in :data:`REMOVED_IN`; CHANGELOG.md lists them per release.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "moved_attribute", "moved_module", "warn"]

#: The release that removes every name below.
REMOVED_IN = "0.3.0"

#: ``jaxcomm.<old>`` -> (module, attribute or None for the module itself), since 0.2.0.
MOVED: dict[str, tuple[str, str | None]] = {
    "ShardedDataParallel": ("jaxcomm.train", "DataParallel"),
    "xla_cpu": ("jaxcomm.backend", None),
    **{
        tool: (f"jaxcomm.tools.{tool}", None)
        for tool in (
            "calibration",
            "launch",
            "profiler",
            "schedule",
            "simulate",
            "step_model",
            "testbed",
            "wire",
        )
    },
}


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated, naming ``new``, the call to write instead.

    Args:
      old: what the script wrote, e.g. ``'jaxcomm.testbed'``.
      new: what to write instead, e.g. ``'jaxcomm.tools.testbed'``.
      stacklevel: the frame the warning names: 3 is the caller of the function that calls
        :func:`warn`.
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in jaxcomm {REMOVED_IN}: use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def moved_attribute(name: str) -> Any:
    """``jaxcomm.<name>`` for a name of :data:`MOVED`, with its warning; raises
    ``AttributeError`` for any other name (the module ``__getattr__`` of ``jaxcomm``)."""
    if name not in MOVED:
        raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
    module, attribute = MOVED[name]
    new = module if attribute is None else f"jaxcomm.{attribute}"
    warn(f"jaxcomm.{name}", new, stacklevel=4)  # the script's line, past __getattr__
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)


def moved_module(name: str, *, old: str, new: str) -> ModuleType | None:
    """The body of a moved module's shim (``jaxcomm/testbed.py``): warns, then runs ``new``
    as the program (``python -m old``, where ``name`` is ``'__main__'``) or makes the
    import of ``old`` return ``new`` itself.

    Args:
      name: the shim's ``__name__``.
      old: the module's old name, ``'jaxcomm.testbed'``.
      new: where it lives now, ``'jaxcomm.tools.testbed'``.

    Returns:
      The module ``new`` when imported (never returns when run as a program).
    """
    if name == "__main__":
        warn(f"python -m {old}", f"python -m {new}")
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        raise SystemExit(0)
    warn(old, new, stacklevel=4)
    module = importlib.import_module(new)
    sys.modules[name] = module  # `import old` binds the module itself, not the shim
    return module
