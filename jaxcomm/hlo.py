"""Read the collectives of a compiled program from its optimized HLO text.

Bytes on the wire and the communication schedule are properties of what XLA compiled, not
of the Python that asked for it (XLA combines, splits and reorders collectives), so every
jaxcomm claim about communication is read from ``jit(f).lower(...).compile().as_text()``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcomm.backend import MATERIALIZE_SCOPE

__all__ = [
    "Collective",
    "HloModule",
    "collectives",
    "compiled_text",
    "OrderingHazard",
    "instructions",
    "is_materializing",
    "ordering_hazards",
    "parse_collectives",
    "parse_replica_groups",
]

COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY_RE = re.compile(r"([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn)?)?)\[([0-9,]*)\]")
_CALLS_RE = re.compile(
    r"(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled HLO module.

    Attributes:
      kind: 'all-reduce', 'reduce-scatter', 'all-gather', 'all-to-all',
        'collective-permute' or 'collective-broadcast' (async ``-start`` ops are reported
        under their base kind with ``is_async=True``; ``-done`` ops are not listed).
      name: the HLO instruction name.
      dtype: element type of the (first) operand, e.g. 'f32', 'bf16', 's8'.
      operand_elements: elements of the input buffer(s), summed over a combined tuple.
      result_elements: elements of the output buffer(s).
      operand_bytes: bytes of the input buffer(s).
      group_size: devices per replica group (for collective-permute: the number of pairs).
      replica_groups: the groups as tuples of logical device ids.
      source_target_pairs: for collective-permute, the (source, target) pairs.
      axes: the mesh axes the groups span, when a mesh was given and the groups match.
      computation: the HLO computation holding the instruction.
      is_async: an async ``-start`` op (GPU).
      num_buffers: number of arrays combined into this collective.
    """

    kind: str
    name: str
    dtype: str
    operand_elements: int
    result_elements: int
    operand_bytes: float
    group_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    axes: tuple[str, ...] | None
    computation: str
    is_async: bool
    num_buffers: int


@dataclasses.dataclass(frozen=True)
class HloModule:
    """Parsed structure of a compiled module.

    Attributes:
      text: the HLO text.
      collectives: the collectives in text order.
      calls: computation name -> names of computations it calls.
      branches: branch computation name -> (conditional instruction, branch index).
      entry: name of the entry computation.
    """

    text: str
    collectives: tuple[Collective, ...]
    calls: Mapping[str, tuple[str, ...]]
    branches: Mapping[str, tuple[str, int]]
    entry: str

    def branch_chain(self, computation: str) -> tuple[tuple[str, int], ...]:
        """The ``(conditional, branch index)`` pairs that ``computation`` runs under,
        outermost first (``()`` outside any conditional)."""
        parents: dict[str, str] = {}
        for caller, callees in self.calls.items():
            for c in callees:
                parents.setdefault(c, caller)
        chain, seen, node = [], set(), computation
        while node is not None and node not in seen:
            seen.add(node)
            if node in self.branches:
                chain.append(self.branches[node])
            node = parents.get(node)
        return tuple(reversed(chain))


def parse_replica_groups(attr: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Parses an HLO ``replica_groups`` value: explicit ``{{0,1},{2,3}}`` or iota form
    ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``. ``{}`` means one group of all devices."""
    attr = attr.strip()
    if attr.startswith("["):
        m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attr)
        if not m:
            raise ValueError(f"unrecognised iota replica groups {attr!r}")
        out_shape = [int(v) for v in m.group(1).split(",")]
        in_shape = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(int(np.prod(in_shape))).reshape(in_shape)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        ids = ids.reshape(out_shape[0], -1)
        return tuple(tuple(int(v) for v in row) for row in ids)
    groups = re.findall(r"\{([0-9,\s]*)\}", attr)
    groups = [g for g in groups if g.strip()]
    if not groups:
        return (tuple(range(num_devices)),) if num_devices else ()
    return tuple(tuple(int(v) for v in g.split(",")) for g in groups)


def _mesh_axis_partitions(mesh: Mesh) -> dict[frozenset, tuple[str, ...]]:
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.devices.shape)
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    out: dict[frozenset, tuple[str, ...]] = {}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            rest = [i for i in range(len(names)) if i not in subset]
            size = int(np.prod([shape[i] for i in subset]))
            moved = ids.transpose(rest + list(subset)).reshape(-1, size)
            key = frozenset(frozenset(int(v) for v in row) for row in moved)
            out.setdefault(key, tuple(names[i] for i in subset))
    return out


def _arrays(type_str: str) -> list[tuple[str, int]]:
    return [
        (dt, int(np.prod([int(v) for v in dims.split(",")])) if dims else 1)
        for dt, dims in _ARRAY_RE.findall(type_str)
    ]


def _operand_count(rest: str) -> int:
    """Operands of an instruction, from the text after its opcode's ``(``."""
    depth, count, seen = 0, 0, False
    for ch in rest:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            count += 1
        elif not ch.isspace():
            seen = True
    return count + 1 if seen else 0


def _attr(rest: str, key: str) -> str | None:
    i = rest.find(key + "=")
    if i < 0:
        return None
    j = i + len(key) + 1
    if rest[j] == "{":
        depth = 0
        for k in range(j, len(rest)):
            depth += {"{": 1, "}": -1}.get(rest[k], 0)
            if depth == 0:
                return rest[j : k + 1]
    # iota replica groups ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` contain commas
    m = re.match(r"\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?|[^\s,]+", rest[j:])
    return m.group(0) if m else None


def parse_collectives(text: str, mesh: Mesh | None = None) -> HloModule:
    """Parses optimized HLO text into an :class:`HloModule`.

    Args:
      text: ``compiled.as_text()``.
      mesh: the mesh the program was compiled for; maps replica groups to axis names.

    Returns:
      The parsed module.
    """
    partitions = _mesh_axis_partitions(mesh) if mesh is not None else {}
    comps: dict[str, list[str]] = {}
    branches: dict[str, tuple[str, int]] = {}
    found: list[Collective] = []
    current, entry = "", ""
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m:
            current = m.group(2)
            comps.setdefault(current, [])
            if m.group(1):
                entry = current
            continue
        im = _INSTR_RE.match(line)
        if not im:
            continue
        name, _, _, rest = im.groups()
        _note_calls(comps, branches, current, name, rest)
        collective = _collective(im.groups(), current, mesh, partitions)
        if collective is not None:
            found.append(collective)
    return HloModule(
        text=text,
        collectives=tuple(found),
        calls={k: tuple(v) for k, v in comps.items()},
        branches=branches,
        entry=entry,
    )


def _note_calls(
    comps: dict[str, list[str]],
    branches: dict[str, tuple[str, int]],
    current: str,
    name: str,
    rest: str,
) -> None:
    """Records the computations instruction ``name`` of ``current`` calls, and the
    branches of a conditional (``branch_computations`` or true / false)."""
    comps.setdefault(current, []).extend(c for _, c in _CALLS_RE.findall(rest))
    bm = _BRANCHES_RE.search(rest)
    if bm:
        names = [b.strip().lstrip("%") for b in bm.group(1).split(",") if b.strip()]
        comps[current].extend(names)
        branches.update({b: (name, i) for i, b in enumerate(names)})
    tc = re.search(r"true_computation=%?([\w.\-]+)", rest)
    fc = re.search(r"false_computation=%?([\w.\-]+)", rest)
    if tc and fc:
        branches[tc.group(1)] = (name, 0)
        branches[fc.group(1)] = (name, 1)


def _collective(
    groups: tuple[str, str, str, str],
    current: str,
    mesh: Mesh | None,
    partitions: dict[frozenset, tuple[str, ...]],
) -> Collective | None:
    """The :class:`Collective` of one instruction (``name, type, opcode, rest`` of its
    line, in computation ``current``), or None for another opcode."""
    name, type_str, opcode, rest = groups
    num_devices = int(mesh.devices.size) if mesh is not None else None
    base = opcode.removesuffix("-start")
    if base not in COLLECTIVE_KINDS:
        return None
    is_async = opcode.endswith("-start")
    arrays = _arrays(type_str)
    if is_async and base in ("all-gather", "collective-permute") and len(arrays) >= 2:
        arrays = arrays[len(arrays) // 2 :]  # ((operands), (results)) -> results
    elif is_async and len(arrays) == 2 * _operand_count(rest):
        # XLA:GPU in jaxlib 0.11 types an all-reduce-start as (operands..., results...):
        # counted whole, every async all-reduce showed twice its bytes (seen on an H200).
        arrays = arrays[len(arrays) // 2 :]
    groups_attr = _attr(rest, "replica_groups")
    replica = parse_replica_groups(groups_attr, num_devices) if groups_attr else ()
    pairs_attr = _attr(rest, "source_target_pairs")
    pair_strs = re.findall(r"\{(\d+,\d+)\}", pairs_attr) if pairs_attr else []
    pairs = tuple(tuple(int(v) for v in p.split(",")) for p in pair_strs)
    if base == "collective-permute":
        gsize = len(pairs)
    else:
        gsize = len(replica[0]) if replica else (num_devices or 1)
    result = sum(n for _, n in arrays)
    operand = {"reduce-scatter": result * gsize, "all-gather": result // max(gsize, 1)}.get(
        base, result
    )
    axes = None
    if replica and partitions:
        axes = partitions.get(frozenset(frozenset(g) for g in replica))
    elif pairs and mesh is not None:
        axes = _permute_axes(pairs, mesh)
    return Collective(
        kind=base,
        name=name,
        dtype=arrays[0][0] if arrays else "?",
        operand_elements=operand,
        result_elements=result,
        operand_bytes=sum(
            _DTYPE_BYTES.get(dt, 4) * (n * operand / max(result, 1)) for dt, n in arrays
        ),
        group_size=gsize,
        replica_groups=replica,
        source_target_pairs=pairs,
        axes=axes,
        computation=current,
        is_async=is_async,
        num_buffers=len(arrays),
    )


def is_materializing(line: str) -> bool:
    """Whether an instruction of compiled HLO text (its line, or the part after its opcode)
    is the CPU row's materialising ``conditional`` (``jaxcomm.backend.materialized``, named
    by its metadata): a buffer for a producer XLA:CPU would fuse into every consumer, not
    a decision. It exists only where the host runs the program, so it is no host round
    trip.

    Example:
      >>> lines = [l for l in text.splitlines() if " conditional(" in l]
      >>> decisions = [l for l in lines if not is_materializing(l)]
    """
    return f"/{MATERIALIZE_SCOPE}/cond" in line


def instructions(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Computation name -> its instructions ``(name, opcode, rest of line)`` in text order
    (for a scheduled module, ``is_scheduled=true``, that is execution order)."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = ""
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m:
            current = m.group(2)
            comps.setdefault(current, [])
            continue
        im = _INSTR_RE.match(line)
        if im:
            name, _, opcode, rest = im.groups()
            comps.setdefault(current, []).append((name, opcode, rest))
    return comps


@dataclasses.dataclass(frozen=True)
class OrderingHazard:
    """A collective that may start while an earlier control-flow op still runs collectives.

    Attributes:
      computation: the HLO computation holding both instructions.
      control_flow: the ``conditional`` or ``while`` instruction whose nested computations
        hold collectives.
      collective: the later instruction that issues collectives (a collective, or another
        control-flow op holding some) without depending on ``control_flow``'s result.
    """

    computation: str
    control_flow: str
    collective: str


_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_CONTROL_FLOW = ("conditional", "while", "call")


def _called(rest: str) -> list[str]:
    names = [c for _, c in _CALLS_RE.findall(rest)]
    bm = _BRANCHES_RE.search(rest)
    if bm:
        names += [b.strip().lstrip("%") for b in bm.group(1).split(",") if b.strip()]
    return names


def ordering_hazards(text: str) -> list[OrderingHazard]:
    """Collectives a scheduled module may issue in a different order on different devices.

    XLA:CPU runs a computation's instructions as a dataflow graph. Collectives are chained
    one after the other only by *scheduling* edges: the next may start once the previous
    one's ``Execute`` returned. A ``conditional`` (``lax.cond`` / ``lax.switch``) or
    ``while`` (``lax.scan``) runs its body on a nested executor that can return before the
    collectives inside it finish, so a later collective that does not depend on its result
    can run concurrently with them. Gloo pairs the operations of one communicator in the
    order they are issued (one tag for all), so two devices that interleave them
    differently exchange the wrong buffers or wait for each other forever. A module is safe
    when every collective-bearing instruction after a collective-bearing control-flow op
    in the same computation depends on that op's result (an execution edge).

    Steps:
      1. Split the scheduled text into computations and instructions (execution order).
      2. Mark the computations that issue collectives, directly or through the
         computations they call.
      3. In every computation, for each control-flow op that issues collectives, report the
         later collective-bearing instructions that do not depend on it transitively.

    Args:
      text: optimized, scheduled HLO text (``compiled.as_text()``).

    Returns:
      The hazards, in text order (empty: the order of collectives is fixed by data).

    Example:
      >>> hazards = jaxcomm.hlo.ordering_hazards(dp.lower(state, batch).compile().as_text())
      >>> assert not hazards, hazards
    """
    comps = {
        comp: [
            (name, opcode, _OPERAND_RE.findall(rest.split(", metadata=")[0].split(")")[0]),
             _called(rest))
            for name, opcode, rest in instrs
        ]
        for comp, instrs in instructions(text).items()
    }  # fmt: skip

    issues: dict[str, bool] = {}

    def issues_collectives(comp: str) -> bool:
        if comp not in issues:
            issues[comp] = False  # a cycle never issues more than its members
            issues[comp] = any(
                opcode.removesuffix("-start") in COLLECTIVE_KINDS
                or any(issues_collectives(c) for c in called)
                for _, opcode, _, called in comps.get(comp, [])
            )
        return issues[comp]

    hazards: list[OrderingHazard] = []
    for comp, instrs in comps.items():
        depends: dict[str, set[str]] = {}
        bearing: list[tuple[str, bool]] = []  # (name, control flow with collectives)
        for name, opcode, operands, called in instrs:
            deps: set[str] = set()
            for o in operands:
                if o in depends:
                    deps |= depends[o] | {o}
            depends[name] = deps
            nested = any(issues_collectives(c) for c in called)
            if opcode.removesuffix("-start") in COLLECTIVE_KINDS or nested:
                bearing.append((name, nested and opcode in _CONTROL_FLOW))
        for i, (name, is_control_flow) in enumerate(bearing):
            if is_control_flow:
                hazards += [
                    OrderingHazard(comp, name, later)
                    for later, _ in bearing[i + 1 :]
                    if name not in depends[later]
                ]
    return hazards


def _permute_axes(pairs: Sequence[tuple[int, int]], mesh: Mesh) -> tuple[str, ...] | None:
    """Mesh axes along which a collective-permute moves data (coordinates that change)."""
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), -1)
    changed = set()
    for s, t in pairs:
        changed |= {i for i in range(coords.shape[1]) if coords[s, i] != coords[t, i]}
    return tuple(mesh.axis_names[i] for i in sorted(changed)) or None


def compiled_text(
    fn: Callable, *args: Any, compiler_options: Mapping[str, Any] | None = None, **kwargs: Any
) -> str:
    """Compiles ``fn`` for ``args`` (arrays or ``jax.ShapeDtypeStruct``) and returns the
    optimized HLO text. ``fn`` may be jitted already; otherwise it is wrapped in ``jax.jit``.
    A ``jax.stages.Compiled`` (e.g. ``dp.lower(state, batch).compile()``) is read as it is,
    with no second compilation."""
    if isinstance(fn, jax.stages.Compiled):
        return fn.as_text()
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    return compiled.as_text()


def collectives(
    fn: Callable,
    *args: Any,
    mesh: Mesh | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> HloModule:
    """Compiles ``fn(*args)`` and lists its collectives.

    Args:
      fn: a function or jitted function.
      *args: arrays or ``jax.ShapeDtypeStruct`` (with shardings where the function needs them).
      mesh: maps replica groups to mesh axis names.
      compiler_options: XLA options for this compilation.

    Returns:
      An :class:`HloModule`; ``.collectives`` is the list.

    Example:
      >>> mod = jaxcomm.hlo.collectives(step, grads, mesh=mesh)
      >>> [(c.kind, c.axes, c.operand_elements) for c in mod.collectives]
    """
    text = compiled_text(fn, *args, compiler_options=compiler_options, **kwargs)
    return parse_collectives(text, mesh)
