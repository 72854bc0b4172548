"""XLA compiler options for overlap and batching, checked against the installed jaxlib.

Whether a GPU idles while gradients travel, and whether hundreds of small all-reduces are
combined into a few large ones, are decisions of the XLA compiler: the latency-hiding
scheduler places compute between the ``-start`` and ``-done`` of an async collective,
pipelining moves a loop's collectives into the next iteration, and the combiners merge
collectives up to a threshold of bytes. This module builds the ``compiler_options`` dicts
that set them for ONE function (``jax.jit(f, compiler_options=...)`` or
``jaxcomm.data_parallel(..., compiler_options=...)``); it never touches the process-wide
``XLA_FLAGS`` (an unknown name there aborts the process, and it would change every other
function the user compiles).

Every builder checks its flag names against the installed jaxlib when called: an unknown or
removed flag raises :class:`XlaOptionError` naming its replacement. The check compiles a
trivial function with the option (``No such compile option`` is a catchable error there),
once per name and process.

Defaults of the installed XLA (GPU, jax 0.10/0.11, read from the installed jaxlib): latency hiding
off, collectives async, combine thresholds 31457287 bytes for all-reduce, all-gather and
reduce-scatter, pipelined collectives off. On CPU the GPU flags are accepted and ignored;
XLA:CPU combines all-reduces itself (pass ``cpu-all-reduce-combiner``, no threshold), which
:func:`disable_passes` turns off so that explicit buckets stay visible in the HLO.

References:
  XLA flags: ``xla/debug_options_flags.cc``; the latency-hiding scheduler:
  ``xla/service/latency_hiding_scheduler.cc``. Production values: MaxText GPU configs
  (all-reduce/all-gather threshold 134217728, reduce-scatter 67108864, latency hiding on).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm.validate import check_int

__all__ = [
    "COMBINE_FLAGS",
    "REMOVED_FLAGS",
    "XlaOptionError",
    "check_options",
    "combine_options",
    "disable_passes",
    "flag_available",
    "merge_options",
    "overlap_options",
]

#: Collective kind -> the GPU flag that sets its combine threshold (bytes).
COMBINE_FLAGS: dict[str, str] = {
    "all-reduce": "xla_gpu_all_reduce_combine_threshold_bytes",
    "all-gather": "xla_gpu_all_gather_combine_threshold_bytes",
    "reduce-scatter": "xla_gpu_reduce_scatter_combine_threshold_bytes",
}
_COUNT_FLAG = "xla_gpu_collective_combine_threshold_count"
_LHS_FLAG = "xla_gpu_enable_latency_hiding_scheduler"

# Pipelined collectives: XLA is renaming ``xla_gpu_enable_pipelined_<kind>`` (bool) to
# ``xla_gpu_pipeline_<kind>`` (on|off|default); whichever the installed XLA has is used.
_PIPELINE_FLAGS: dict[str, tuple[str, str]] = {
    "all-reduce": ("xla_gpu_enable_pipelined_all_reduce", "xla_gpu_pipeline_all_reduce"),
    "all-gather": ("xla_gpu_enable_pipelined_all_gather", "xla_gpu_pipeline_all_gather"),
    "reduce-scatter": (
        "xla_gpu_enable_pipelined_reduce_scatter",
        "xla_gpu_pipeline_reduce_scatter",
    ),
}

_ASYNC_NOTE = (
    "collectives are async by default in current XLA; list the kinds to keep synchronous "
    "in xla_gpu_disable_async_collectives (e.g. 'ALLREDUCE,ALLGATHER')"
)
#: Flags that XLA removed or renamed -> what to use instead.
REMOVED_FLAGS: dict[str, str] = {
    "xla_gpu_enable_async_collectives": _ASYNC_NOTE,
    "xla_gpu_enable_async_all_reduce": _ASYNC_NOTE,
    "xla_gpu_enable_async_all_gather": _ASYNC_NOTE,
    "xla_gpu_enable_async_reduce_scatter": _ASYNC_NOTE,
    "xla_gpu_enable_async_collective_permute": _ASYNC_NOTE,
    "xla_gpu_enable_async_all_to_all": _ASYNC_NOTE,
    "xla_gpu_enable_async_collective_broadcast": _ASYNC_NOTE,
    **{old: f"{new}='on'" for old, new in _PIPELINE_FLAGS.values()},
    **{new: f"{old}=True" for old, new in _PIPELINE_FLAGS.values()},
}


class XlaOptionError(ValueError):
    """An XLA option the installed jaxlib does not accept (unknown, removed, bad value)."""


@functools.cache
def _probe(name: str, value: Any) -> str | None:
    """Compiles a trivial function with ``{name: value}``; returns the error text or None."""
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32))
    try:
        lowered.compile({name: value})
    except Exception as e:  # jaxlib raises JaxRuntimeError(INVALID_ARGUMENT: ...)
        return str(e)
    return None


def _probe_value(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def flag_available(name: str) -> bool:
    """Whether the installed jaxlib knows the option ``name`` (e.g. ``'xla_gpu_...'``)."""
    # Any error other than "No such compile option" means the name exists and only the
    # probe value was rejected (e.g. a string or enum flag).
    err = _probe(name, True)
    return err is None or "No such compile option" not in err


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Checks every name and value of ``options`` against the installed jaxlib.

    Args:
      options: ``{flag_name: value}`` as passed to ``jax.jit(..., compiler_options=...)``.

    Returns:
      A plain ``dict`` copy of ``options``.

    Raises:
      XlaOptionError: a name the installed XLA does not know (the message names the
        replacement when the flag was removed or renamed) or a value it rejects.

    Example:
      >>> jaxcomm.xla.check_options({'xla_gpu_enable_latency_hiding_scheduler': True})
    """
    out = dict(options)
    for name, value in out.items():
        if not isinstance(name, str) or not name.startswith("xla_"):
            raise XlaOptionError(
                f"compiler option name {name!r} is not an XLA flag; names start with 'xla_' "
                "(e.g. 'xla_gpu_enable_latency_hiding_scheduler'). jax config options such "
                "as jax_optimization_level go through jax.config.update instead."
            )
        err = _probe(name, _probe_value(value))
        if err is None:
            continue
        if "No such compile option" in err:
            hint = REMOVED_FLAGS.get(name)
            fix = (
                f"this XLA version does not have it (removed, renamed, or newer); use {hint} "
                "instead"
                if hint
                else "check the spelling against XLA's flag list (xla/debug_options_flags.cc)"
            )
            raise XlaOptionError(
                f"XLA option {name!r} is not known to the installed jaxlib "
                f"(jax {jax.__version__}): {fix}."
            )
        raise XlaOptionError(f"XLA option {name}={value!r} was rejected: {err.strip()}")
    return out


def overlap_options(
    *,
    latency_hiding: bool = True,
    pipeline: Iterable[str] = (),
) -> dict[str, Any]:
    """Compiler options that let XLA overlap collectives with compute (GPU).

    Args:
      latency_hiding: turn on the latency-hiding scheduler, which moves independent
        compute between each async collective's ``-start`` and ``-done``.
      pipeline: collective kinds ('all-reduce', 'all-gather', 'reduce-scatter') whose
        instances inside a loop (e.g. a ``lax.scan`` over microbatches or layers) XLA may
        pipeline into the neighbouring iteration. Uses the installed XLA's spelling
        (``xla_gpu_enable_pipelined_<kind>`` or the newer ``xla_gpu_pipeline_<kind>``).

    Returns:
      A ``compiler_options`` dict, checked against the installed jaxlib.

    Raises:
      XlaOptionError: a flag the installed jaxlib lacks, or an unknown kind.

    Example:
      >>> opts = jaxcomm.xla.overlap_options(pipeline=('all-reduce',))
      >>> dp = jaxcomm.data_parallel(loss_fn, tx, mesh, compiler_options=opts)
    """
    opts: dict[str, Any] = {_LHS_FLAG: bool(latency_hiding)}
    for kind in pipeline:
        if kind not in _PIPELINE_FLAGS:
            raise XlaOptionError(
                f"pipeline kind {kind!r} is not supported; choose from {sorted(_PIPELINE_FLAGS)}."
            )
        opts.update(_pipeline_option(kind))
    return check_options(opts)


# Spellings of "on" for the enum flags xla_gpu_pipeline_<kind>: XLA_FLAGS takes 'on', but
# jax.jit's compiler_options set the proto field, whose enum value names differ (jaxlib
# 0.11.2 refuses 'on' there: "'on' is not a valid enum value").
_PIPELINE_ON = ("on", "PIPELINE_ON", "PIPELINE_MODE_ON", "ON")


def _pipeline_option(kind: str) -> dict[str, Any]:
    """The installed XLA's option that pipelines collectives of ``kind`` (cached per name)."""
    old, new = _PIPELINE_FLAGS[kind]
    if flag_available(new):
        for value in _PIPELINE_ON:
            if _probe(new, value) is None:
                return {new: value}
    if flag_available(old):
        return {old: True}
    raise XlaOptionError(
        f"the installed jaxlib accepts neither {old!r} nor {new!r} (tried values "
        f"{list(_PIPELINE_ON)}); it cannot pipeline {kind}. Drop {kind!r} from pipeline=."
    )


def combine_options(
    *,
    all_reduce: int | None = None,
    all_gather: int | None = None,
    reduce_scatter: int | None = None,
    max_count: int | None = None,
) -> dict[str, Any]:
    """Compiler options for XLA's collective combiners (GPU): bytes per combined collective.

    XLA merges independent collectives of one kind into one tuple-typed collective up to the
    threshold. ``0`` turns combining off for that kind (one collective per buffer); ``None``
    keeps XLA's default (31457287 bytes in jax 0.10/0.11).

    Args:
      all_reduce: all-reduce threshold in bytes.
      all_gather: all-gather threshold in bytes.
      reduce_scatter: reduce-scatter threshold in bytes.
      max_count: most collectives combined into one (XLA default 2048).

    Returns:
      A ``compiler_options`` dict, checked against the installed jaxlib.

    Raises:
      XlaOptionError: a negative value, or a flag the installed jaxlib lacks.

    Example:
      >>> jaxcomm.xla.combine_options(all_reduce=1 << 20)
      {'xla_gpu_all_reduce_combine_threshold_bytes': 1048576}
    """
    opts: dict[str, Any] = {}
    for kind, value in (
        ("all-reduce", all_reduce),
        ("all-gather", all_gather),
        ("reduce-scatter", reduce_scatter),
    ):
        if value is None:
            continue
        name = kind.replace("-", "_")
        fix = "bytes; 0 turns combining off"
        opts[COMBINE_FLAGS[kind]] = check_int(name, value, minimum=0, fix=fix, error=XlaOptionError)
    if max_count is not None:
        opts[_COUNT_FLAG] = check_int("max_count", max_count, minimum=1, error=XlaOptionError)
    return check_options(opts)


def disable_passes(*passes: str) -> dict[str, Any]:
    """Compiler options that turn off named HLO passes for one function.

    ``disable_passes('cpu-all-reduce-combiner')`` keeps XLA:CPU from merging all-reduces,
    so explicit gradient buckets show one all-reduce each in the compiled HLO.

    Args:
      *passes: HLO pass names.

    Returns:
      ``{'xla_disable_hlo_passes': 'a,b'}``, checked against the installed jaxlib.

    Example:
      >>> jax.jit(f, compiler_options=jaxcomm.xla.disable_passes('cpu-all-reduce-combiner'))
    """
    if not passes or not all(isinstance(p, str) and p and "," not in p for p in passes):
        raise XlaOptionError(f"disable_passes{passes!r}: give one or more pass names.")
    return check_options({"xla_disable_hlo_passes": ",".join(passes)})


def merge_options(*options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merges option dicts; later ones win, except ``xla_disable_hlo_passes`` lists join.

    Example:
      >>> opts = merge_options(overlap_options(), combine_options(all_reduce=0))
    """
    out: dict[str, Any] = {}
    for opts in options:
        for name, value in (opts or {}).items():
            if name == "xla_disable_hlo_passes" and name in out:
                seen = out[name].split(",")
                value = ",".join(seen + [p for p in str(value).split(",") if p not in seen])
            out[name] = value
    return out
