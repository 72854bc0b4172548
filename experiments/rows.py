"""The ablation rows as data: each row adds one communication technique to the one before.

A row names what it adds to ``jaxcomm.sync_gradients`` keyword arguments, to the step's XLA
``compiler_options`` and to ``jaxcomm.make_mesh`` keyword arguments. Values that come from a
jaxcomm module are written as :class:`Call` (a dotted path under ``jaxcomm`` plus keyword
arguments), called only when the row runs. A row is *available* when every path it names
exists and ``sync_gradients`` / ``make_mesh`` accept its keywords; otherwise it is reported
as missing with the reason, never run with a stand-in. Enabling or changing a technique is a
one-line edit of :data:`ROWS`.

Rows accumulate: row ``i`` runs with the settings of every *available* row ``0..i``
(later rows override earlier keys), so a missing technique drops out of the rows after it
and each result lists the techniques it really ran with.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROWS", "Call", "Resolved", "Row", "resolve_rows"]


@dataclasses.dataclass(frozen=True)
class Call:
    """A jaxcomm factory named by path, e.g. ``Call('compression.bf16')``.

    Attributes:
      path: dotted attribute path under the ``jaxcomm`` package.
      kwargs: keyword arguments of the call.
      call: call the attribute (``True``) or use it as it is (``False``).
    """

    path: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    call: bool = True

    def lookup(self) -> Any:
        """The attribute, importing ``jaxcomm.<module>`` submodules on the way.

        Raises:
          LookupError: a part of the path does not exist (with the path in the message).
        """
        import jaxcomm

        obj: Any = jaxcomm
        prefix = "jaxcomm"
        for part in self.path.split("."):
            prefix = f"{prefix}.{part}"
            if not hasattr(obj, part) and inspect.ismodule(obj):
                try:
                    importlib.import_module(prefix)
                except ModuleNotFoundError as e:
                    if e.name is not None and prefix.startswith(e.name):
                        raise LookupError(f"{prefix} does not exist") from None
                    raise
            if not hasattr(obj, part):
                raise LookupError(f"{prefix} does not exist")
            obj = getattr(obj, part)
        return obj

    def __call__(self) -> Any:
        fn = self.lookup()
        return fn(**dict(self.kwargs)) if self.call else fn

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"jaxcomm.{self.path}({args})" if self.call else f"jaxcomm.{self.path}"


@dataclasses.dataclass(frozen=True)
class Row:
    """One ablation row: the technique it adds on top of the rows before it.

    Attributes:
      config: the row's name in the table (``'baseline'``, ``'+hierarchical'``, ...).
      technique: what the row adds, in words.
      sync: ``sync_gradients`` keyword arguments it sets (values may be :class:`Call`).
      compiler_options: XLA options it adds: a dict, or a :class:`Call` returning one.
      mesh: ``make_mesh`` keyword arguments it sets (values may be :class:`Call`).
      requires: further ``jaxcomm`` paths that must exist (e.g. ``'CommProfiler'``). A
        ``sync['algorithm']`` must also be registered in ``jaxcomm.collectives``.
    """

    config: str
    technique: str
    sync: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compiler_options: Mapping[str, Any] | Call | None = None
    mesh: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    requires: tuple[str, ...] = ()

    def calls(self) -> list[Call]:
        values = [*self.sync.values(), *self.mesh.values(), self.compiler_options]
        return [v for v in values if isinstance(v, Call)]

    def missing(self) -> str | None:
        """Why the row cannot run in this installation, or ``None`` when it can."""
        import jaxcomm
        from jaxcomm.collectives import ALGORITHMS

        for c in [*self.calls(), *(Call(p, call=False) for p in self.requires)]:
            try:
                c.lookup()
            except LookupError as e:
                return str(e)
        for fn, kwargs in ((jaxcomm.sync_gradients, self.sync), (jaxcomm.make_mesh, self.mesh)):
            params = inspect.signature(fn).parameters
            unknown = [k for k in kwargs if k not in params]
            if unknown:
                return f"jaxcomm.{fn.__name__} has no argument {', '.join(unknown)}"
        algorithm = self.sync.get("algorithm")
        if isinstance(algorithm, str) and algorithm not in ALGORITHMS:
            return f"all-reduce algorithm {algorithm!r} is not registered"
        return None


# The rows of the seed's table. To enable or change a technique, edit its line.
ROWS: tuple[Row, ...] = (
    Row("baseline", "flat psum, f32, no overlap options", sync={"algorithm": "flat"}),
    Row("+hierarchical", "hierarchical all-reduce", sync={"algorithm": "hierarchical"}),
    Row(
        "+overlap",
        "async collectives + latency-hiding scheduler",
        compiler_options=Call("xla.overlap_options"),
    ),  # fmt: skip
    Row(
        "+compression",
        "bf16 on the inter-node stage (full precision inside a node)",
        sync={"compression": Call("compression.bf16"), "compress_stage": "inter"},
    ),  # fmt: skip
    Row(
        "+topology",
        "topology-ordered mesh, cost-model algorithm",
        sync={"algorithm": "auto", "topology": Call("topology.detect")},
        mesh={"topology": Call("topology.detect")},
    ),  # fmt: skip
    Row("+batching", "gradient buckets 1-10 MiB", sync={"bucket_bytes": (1 << 20, 10 << 20)}),
)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A row with its accumulated settings (not yet called).

    Attributes:
      row: the row.
      missing: why the row's own technique cannot run, or ``None``.
      techniques: configs of the available rows up to and including this one.
      sync: accumulated ``sync_gradients`` keyword arguments.
      compiler_options: accumulated option sources (dicts or :class:`Call`).
      mesh: accumulated ``make_mesh`` keyword arguments.
    """

    row: Row
    missing: str | None
    techniques: tuple[str, ...]
    sync: Mapping[str, Any]
    compiler_options: tuple[Mapping[str, Any] | Call, ...]
    mesh: Mapping[str, Any]

    def build(self) -> tuple[dict, dict, dict]:
        """Calls the :class:`Call` values: ``(sync_kwargs, compiler_options, mesh_kwargs)``."""

        def value(v):
            return v() if isinstance(v, Call) else v

        sync = {k: value(v) for k, v in self.sync.items()}
        mesh = {k: value(v) for k, v in self.mesh.items()}
        options: dict = {}
        for src in self.compiler_options:
            options.update(value(src))
        return sync, options, mesh

    def describe(self) -> dict:
        """JSON-friendly settings (Calls as text)."""

        def text(v):
            return str(v) if isinstance(v, Call) else v

        return {
            "sync_gradients": {k: text(v) for k, v in self.sync.items()},
            "compiler_options": [text(s) for s in self.compiler_options],
            "make_mesh": {k: text(v) for k, v in self.mesh.items()},
        }


def resolve_rows(rows: Sequence[Row] = ROWS) -> list[Resolved]:
    """Checks every row and accumulates the settings of the available ones."""
    out: list[Resolved] = []
    sync: dict = {}
    mesh: dict = {}
    options: list = []
    techniques: list[str] = []
    for row in rows:
        missing = row.missing()
        if missing is None:
            sync.update(row.sync)
            mesh.update(row.mesh)
            if row.compiler_options is not None:
                options.append(row.compiler_options)
            techniques.append(row.config)
        out.append(
            Resolved(row, missing, tuple(techniques), dict(sync), tuple(options), dict(mesh))
        )
    return out
