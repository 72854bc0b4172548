"""The schedule report on known programs: hand-written GPU HLO and a compiled CPU step."""
# ruff: noqa: E501

import jax
from helpers import abstract_per_device, sharded

import jaxcomm
from jaxcomm.tools.schedule import parse_schedule

AXES = ("inter", "intra")

# A scheduled module in XLA:GPU's form: an all-reduce pair over 'inter' with two fusions and a
# GEMM between start and done, a reduce-scatter as async-start/async-done over 'intra' with
# nothing between, a synchronous all-gather, and an is_sync-marked pair.
# (HLO lines are long by nature.)
GPU_HLO = """HloModule step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%wrapped_reduce_scatter (p: f32[1024]) -> f32[256] {
  %p = f32[1024]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[256]{0} reduce-scatter(f32[1024]{0} %p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[1024], b: f32[64,64], c: bf16[512]) -> (f32[1024], f32[256], f32[64,64], f32[2048], bf16[512]) {
  %a = f32[1024]{0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  %c = bf16[512]{0} parameter(2)
  %all-reduce-start = f32[1024]{0} all-reduce-start(f32[1024]{0} %a), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %fusion.1 = f32[64,64]{1,0} fusion(f32[64,64]{1,0} %b), kind=kLoop, calls=%add
  %gte.0 = f32[64,64]{1,0} bitcast(f32[64,64]{1,0} %fusion.1)
  %cublas-gemm.1 = f32[64,64]{1,0} custom-call(f32[64,64]{1,0} %gte.0, f32[64,64]{1,0} %gte.0), custom_call_target="__cublas$gemm"
  %fusion.2 = f32[64,64]{1,0} fusion(f32[64,64]{1,0} %cublas-gemm.1), kind=kLoop, calls=%add
  %all-reduce-done = f32[1024]{0} all-reduce-done(f32[1024]{0} %all-reduce-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) async-start(f32[1024]{0} %a), calls=%wrapped_reduce_scatter, backend_config={"collective_backend_config":{"is_sync":false}}
  %reduce-scatter-done = f32[256]{0} async-done(((f32[1024]{0}), f32[256]{0}) %reduce-scatter-start), calls=%wrapped_reduce_scatter
  %all-gather = f32[2048]{0} all-gather(f32[256]{0} %reduce-scatter-done), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %all-reduce-start.1 = bf16[512]{0} all-reduce-start(bf16[512]{0} %c), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %fusion.3 = f32[64,64]{1,0} fusion(f32[64,64]{1,0} %fusion.2), kind=kLoop, calls=%add
  %all-reduce-done.1 = bf16[512]{0} all-reduce-done(bf16[512]{0} %all-reduce-start.1)
  ROOT %t = (f32[1024]{0}, f32[256]{0}, f32[64,64]{1,0}, f32[2048]{0}, bf16[512]{0}) tuple(%all-reduce-done, %reduce-scatter-done, %fusion.3, %all-gather, %all-reduce-done.1)
}
"""


# jaxlib 0.11's XLA:GPU types an async all-reduce-start as (operands..., results...), one
# operand here and two combined there (lines as printed by jax 0.11.2 on an H200).
GPU_HLO_0_11 = """HloModule jit_step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (a: f32[1024], b: f32[256], c: f32[256]) -> (f32[1024], f32[256], f32[256]) {
  %a = f32[1024]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %c = f32[256]{0} parameter(2)
  %all-reduce-start = (f32[1024]{0}, f32[1024]{0}) all-reduce-start(f32[1024]{0} %a), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[1024]{0} all-reduce-done((f32[1024]{0}, f32[1024]{0}) %all-reduce-start)
  %all-reduce-start.1 = ((f32[256]{0}, f32[256]{0}), (f32[256]{0}, f32[256]{0})) all-reduce-start(f32[256]{0} %b, f32[256]{0} %c), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %all-reduce-done.1 = (f32[256]{0}, f32[256]{0}) all-reduce-done(((f32[256]{0}, f32[256]{0}), (f32[256]{0}, f32[256]{0})) %all-reduce-start.1)
  %gte.0 = f32[256]{0} get-tuple-element(%all-reduce-done.1), index=0
  %gte.1 = f32[256]{0} get-tuple-element(%all-reduce-done.1), index=1
  ROOT %t = (f32[1024]{0}, f32[256]{0}, f32[256]{0}) tuple(%all-reduce-done, %gte.0, %gte.1)
}
"""


def test_async_all_reduce_counts_operands_once(mesh):
    """An (operands, results)-typed all-reduce-start counts its operands' bytes once."""
    rep = parse_schedule(GPU_HLO_0_11, mesh=mesh)
    rows = [
        (s.collective.operand_bytes, s.collective.num_buffers, s.is_async) for s in rep.collectives
    ]
    assert rows == [(4096, 1, True), (2048, 2, True)]


def test_report_on_known_gpu_program(mesh):
    rep = parse_schedule(GPU_HLO, mesh=mesh)
    rows = [
        (s.collective.kind, s.collective.axes, s.collective.operand_bytes, s.is_async,
         s.ops_between, s.sync_marked, s.compute_after)
        for s in rep.collectives
    ]  # fmt: skip
    assert rows == [
        ("all-reduce", ("inter",), 4096, True, 3, False, 1),
        ("reduce-scatter", ("intra",), 4096, True, 0, False, 1),
        ("all-gather", AXES, 1024, False, None, False, 1),
        ("all-reduce", AXES, 1024, True, 1, True, 0),
    ]
    first = rep.collectives[0]
    assert first.done == "all-reduce-done"
    assert first.opcodes_between == ("fusion", "custom-call", "fusion")  # the bitcast is free
    assert [s.overlapped for s in rep.collectives] == [True, False, False, False]
    summary = rep.by_kind_axes()
    assert summary[("all-reduce", ("inter",))] == {
        "count": 1, "bytes": 4096, "async": 1, "overlapped": 1, "ops_between": 3,
        "interleaved": 1,
    }  # fmt: skip
    text = rep.format()
    assert "reduce-scatter" in text and "(sync)" in text
    assert '"ops_between": 3' in rep.to_json()


def test_report_on_compiled_cpu_step(mesh):
    def local(x, y):
        return jaxcomm.allreduce(x[0], algorithm="hierarchical", op="sum"), jax.lax.psum(y[0], AXES)

    f = sharded(local, mesh)
    args = (abstract_per_device(mesh, (4096,)), abstract_per_device(mesh, (100,)))
    rep = jaxcomm.tools.schedule.schedule_report(
        f, *args, mesh=mesh, compiler_options=jaxcomm.xla.disable_passes("cpu-all-reduce-combiner")
    )
    summary = rep.by_kind_axes()
    assert summary[("reduce-scatter", ("intra",))]["bytes"] == 4096 * 4
    assert summary[("all-reduce", ("inter",))]["bytes"] == 1024 * 4
    assert summary[("all-gather", ("intra",))]["bytes"] == 1024 * 4
    assert summary[("all-reduce", AXES)]["bytes"] == 400
    # XLA:CPU collectives are synchronous: no pairs, no overlap, and the table says so.
    assert not any(s.is_async or s.ops_between for s in rep.collectives)
    assert "synchronous" in rep.format()


def test_bench_cpu_variant_runs(tmp_path, capsys):
    import json

    from experiments.bench import schedule as bench

    out = tmp_path / "s.json"
    argv = ["--model", "mlp", "--width", "64", "--depth", "3", "--algorithm", "flat"]
    assert bench.main(argv + ["--bucket", "4096,16384", "--json", str(out)]) == 0
    assert "GPU variant needs a GPU" in capsys.readouterr().out
    res = json.loads(out.read_text())["results"]
    # 3 layers x (64*64 + 64) f32 = 49920 bytes -> buckets of 4096, 16384, 16384, 13056 bytes,
    # one all-reduce each with the CPU combiner off, plus the loss pmean.
    grads = [r for r in res["defaults"]["report"]["collectives"] if r["bytes"] > 4]
    assert sorted(r["bytes"] for r in grads) == [4096, 13056, 16384, 16384]
    assert res["cpu-combiner-on"]["collectives"] < res["defaults"]["collectives"]
