"""jaxcomm.xla: option builders validated against the installed jaxlib, applied per function."""

import os

import jax
import pytest
from helpers import abstract_per_device, shard

import jaxcomm
from jaxcomm import xla


def test_overlap_and_combine_options():
    opts = xla.overlap_options(pipeline=("all-reduce",))
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    pipelined = [k for k in opts if "pipeline" in k and "all_reduce" in k]
    assert len(pipelined) == 1 and xla.flag_available(pipelined[0])
    assert xla.combine_options(all_reduce=0, all_gather=1 << 20, reduce_scatter=30 << 20) == {
        "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 30 << 20,
    }
    assert xla.combine_options() == {}


def test_unknown_flag_is_refused():
    with pytest.raises(xla.XlaOptionError, match="xla_gpu_no_such_flag.*spelling"):
        xla.check_options({"xla_gpu_no_such_flag": True})
    with pytest.raises(xla.XlaOptionError, match="not an XLA flag"):
        xla.check_options({"jax_optimization_level": "O1"})


def test_removed_flag_names_its_replacement():
    with pytest.raises(xla.XlaOptionError, match="xla_gpu_disable_async_collectives"):
        xla.check_options({"xla_gpu_enable_async_collectives": True})
    # Only one spelling of the pipelining flag exists in a given XLA; the other one is
    # refused with the spelling to use instead.
    old, new = "xla_gpu_enable_pipelined_all_reduce", "xla_gpu_pipeline_all_reduce"
    missing, present = (new, old) if xla.flag_available(old) else (old, new)
    assert xla.flag_available(present) and not xla.flag_available(missing)
    with pytest.raises(xla.XlaOptionError, match=present):
        xla.check_options({missing: True})


@pytest.mark.parametrize(
    "kwargs", [{"all_reduce": -1}, {"all_gather": 1.5}, {"all_reduce": True}, {"max_count": 0}]
)
def test_bad_values(kwargs):
    with pytest.raises(xla.XlaOptionError):
        xla.combine_options(**kwargs)


def test_bad_value_type_is_reported():
    with pytest.raises(xla.XlaOptionError, match="rejected"):
        xla.check_options({"xla_gpu_all_reduce_combine_threshold_bytes": "lots"})


def test_merge_joins_disabled_passes():
    merged = xla.merge_options(
        xla.disable_passes("cpu-all-reduce-combiner"),
        {"xla_disable_hlo_passes": "all-gather-combiner"},
        xla.overlap_options(),
    )
    assert merged["xla_disable_hlo_passes"] == "cpu-all-reduce-combiner,all-gather-combiner"
    assert merged["xla_gpu_enable_latency_hiding_scheduler"] is True


def test_options_apply_per_function_only(mesh):
    before = os.environ.get("XLA_FLAGS")
    axes = ("inter", "intra")

    def local(a, b):
        return jax.lax.psum(a[0], axes), jax.lax.psum(b[0], axes)

    f = shard(local, mesh)
    arg = abstract_per_device(mesh, (64,))
    split = jaxcomm.hlo.collectives(
        jax.jit(f, compiler_options=xla.disable_passes("cpu-all-reduce-combiner")), arg, arg
    )
    merged = jaxcomm.hlo.collectives(jax.jit(f), arg, arg)  # same function, no options
    assert [c.num_buffers for c in split.collectives] == [1, 1]
    assert [c.num_buffers for c in merged.collectives] == [2]
    assert os.environ.get("XLA_FLAGS") == before
