"""The ablation rows as plain data: each row adds one communication technique to the one before.

A row holds ``jaxcomm.sync_gradients`` keyword arguments, the step's XLA ``compiler_options``
and whether the mesh and the cost model follow the detected topology, all built from
jaxcomm's public API when this module is imported (an unknown name fails here, like in any
other code). Two settings depend on the running job and are resolved when a row is built:
``compiler_options`` may be a function returning the options (``jaxcomm.xla.overlap_options``
checks them against the installed jaxlib), and ``topology=True`` calls
``jaxcomm.topology.detect()`` (a file named by ``JAXCOMM_TOPO_FILE``, which the testbed
writes, or one node per process) and hands the result to ``make_mesh`` and
``sync_gradients``. Changing a technique is a one-line edit of :data:`ROWS`.

Rows accumulate: row ``i`` runs with the settings of rows ``0..i`` (later rows override
earlier keys), and each result lists the techniques it ran with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

import jaxcomm

__all__ = ["ADAPTIVE", "ROWS", "Resolved", "Row", "pin_adaptive", "resolve_rows"]

Options = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Row:
    """One ablation row: the technique it adds on top of the rows before it.

    Attributes:
      config: the row's name in the table (``'baseline'``, ``'+hierarchical'``, ...).
      technique: what the row adds, in words.
      sync: ``sync_gradients`` keyword arguments it sets.
      compiler_options: XLA options it adds: a dict, or a function returning one (called
        when the row is built, so it can check the installed jaxlib).
      topology: order the mesh by the detected topology and give it to the cost model.
      local: ``jaxcomm.local_sgd`` keyword arguments (not ``inner``, which is the
        experiment's optimizer): from this row on, the optimizer takes local steps and
        synchronises every ``sync_every`` steps; ``sync_every='link'`` lets the experiment
        choose it for the link (:func:`experiments.ablation.sync_period`). The rows'
        ``algorithm`` and ``topology`` carry over to its outer sync.
      data_parallel: ``jaxcomm.data_parallel`` keyword arguments it sets: where the state
        lives (e.g. ``shard_params=True``, the hybrid-sharded layout).
    """

    config: str
    technique: str
    sync: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compiler_options: Options | None = None
    topology: bool = False
    local: Mapping[str, Any] | None = None
    data_parallel: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# The rows of the seed's table. The compression row is the seed's "dynamic bit width": the
# adaptive compressor on the inter-node stage (full precision on the fast intra-node links),
# starting at int8 and moving one rung per window of 2 steps between f32, bf16, int8 and
# int4 by the error of the mean and the measured communication share (the ablation drives
# it with jaxcomm.CommProfiler.drive for the preset's adapt_windows before timing it).
# Its int rungs round to nearest in blocks of 64 (the residual carries every rounding
# error into the next step), which keeps int4's error of the mean on ResNet-18 inside the
# default band (0.05-0.25); stochastic rounding in blocks of 256 errs above it and sends
# the ladder back to int8 (docs/benchmarks.md).
ADAPTIVE_ARGS: dict[str, Any] = dict(
    min_compression=0.0, max_compression=1.0, ladder=("f32", "bf16", "int8", "int4"),
    adjustment_step=2, block=64, stochastic=False,
)  # fmt: skip
ADAPTIVE = jaxcomm.compression.adaptive(0.75, **ADAPTIVE_ARGS)


def pin_adaptive(sync: Mapping[str, Any], rung: str) -> dict[str, Any]:
    """``sync`` with :data:`ADAPTIVE` held on one rung: the same compressor with a ladder of
    that rung alone (its codec, error feedback and error sketch), so a program that is not
    driven sends what a driven row sent at ``rung``.

    Raises:
      ValueError: ``sync`` does not compress with :data:`ADAPTIVE`.
    """
    if sync.get("compression") is not ADAPTIVE:
        raise ValueError(f"pin_adaptive: {sync!r} does not compress with rows.ADAPTIVE.")
    pinned = jaxcomm.compression.adaptive(0.75, **{**ADAPTIVE_ARGS, "ladder": (rung,)})
    return {**sync, "compression": pinned}


ROWS: tuple[Row, ...] = (
    Row("baseline", "flat psum, f32, no overlap options", sync={"algorithm": "flat"}),
    Row("+hierarchical", "hierarchical all-reduce", sync={"algorithm": "hierarchical"}),
    Row(
        "+overlap",
        "async collectives + latency-hiding scheduler",
        compiler_options=jaxcomm.xla.overlap_options,
    ),
    Row(
        "+compression",
        "adaptive f32/bf16/int8/int4 (nearest, blocks of 64) on the inter-node stage",
        sync={"compression": ADAPTIVE, "compress_stage": "inter"},
    ),
    Row(
        "+topology",
        "topology-ordered mesh, cost-model algorithm",
        sync={"algorithm": "auto"},
        topology=True,
    ),
    # Buckets sized by the cost model: cut for overlap where collectives can overlap the
    # backward pass; where they cannot (XLA:CPU runs them synchronously), the fewest, since
    # each extra bucket adds inter-node collectives that pay the link's latency.
    Row(
        "+batching",
        "gradient buckets chosen by the cost model",
        sync={"bucket_bytes": "auto"},
    ),
    # Beyond the seed: local SGD (DiLoCo), the rare outer syncs int8-compressed. H is chosen
    # for the link (ablation.sync_period), the outer optimizer is the one that kept the
    # digits guard within a point of per-step sync on short runs (docs/benchmarks.md).
    Row(
        "+local steps",
        "local SGD: H local steps per int8 outer sync, H chosen for the link",
        local={
            "sync_every": "link",
            "compression": jaxcomm.compression.int8(block=64),
            "outer": optax.sgd(1.0, momentum=0.5, nesterov=True),
        },
    ),
)


def _text(value: Any) -> Any:
    """A JSON-friendly description of a setting (compressors by name, functions by path)."""
    if isinstance(value, jaxcomm.compression.Compressor):
        return f"jaxcomm.compression.{value.name}"
    if callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return value


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A row with its accumulated settings.

    Attributes:
      row: the row.
      techniques: configs of the rows up to and including this one.
      sync: accumulated ``sync_gradients`` keyword arguments.
      compiler_options: accumulated option sources (dicts or functions returning one).
      topology: whether the mesh and cost model follow the detected topology.
      local: accumulated ``local_sgd`` keyword arguments, or ``None``.
      data_parallel: accumulated ``jaxcomm.data_parallel`` keyword arguments (the layout).
    """

    row: Row
    techniques: tuple[str, ...]
    sync: Mapping[str, Any]
    compiler_options: tuple[Options, ...]
    topology: bool
    local: Mapping[str, Any] | None = None
    data_parallel: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def build(self) -> tuple[dict, dict, dict]:
        """``(sync_kwargs, compiler_options, make_mesh_kwargs)`` for the running job."""
        sync = dict(self.sync)
        mesh: dict = {}
        if self.topology:
            topo = jaxcomm.topology.detect()
            sync["topology"] = mesh["topology"] = topo
        options: dict = {}
        for src in self.compiler_options:
            options.update(src() if callable(src) else src)
        return sync, options, mesh

    def describe(self) -> dict:
        """JSON-friendly settings."""
        return {
            "sync_gradients": {k: _text(v) for k, v in self.sync.items()},
            "compiler_options": [_text(s) for s in self.compiler_options],
            "topology": "jaxcomm.topology.detect()" if self.topology else None,
            "local_sgd": None
            if self.local is None
            else {k: _text(v) for k, v in self.local.items()},
            "data_parallel": {k: _text(v) for k, v in self.data_parallel.items()},
        }


def resolve_rows(rows: Sequence[Row] = ROWS) -> list[Resolved]:
    """Accumulates the settings of every row over the rows before it."""
    out: list[Resolved] = []
    sync: dict = {}
    options: list = []
    techniques: list[str] = []
    topology = False
    local: dict | None = None
    layout: dict = {}
    for row in rows:
        sync.update(row.sync)
        layout.update(row.data_parallel)
        if row.compiler_options is not None:
            options.append(row.compiler_options)
        topology = topology or row.topology
        if row.local is not None:
            local = {**(local or {}), **row.local}
        techniques.append(row.config)
        out.append(
            Resolved(row, tuple(techniques), dict(sync), tuple(options), topology,
                     None if local is None else dict(local), dict(layout))
        )  # fmt: skip
    return out
