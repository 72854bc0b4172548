"""The names renamed or moved in 0.2.0 (README, "Names changed in 0.2.0"): each still
works for one release and warns with a ``DeprecationWarning`` that names the new call."""

import runpy
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_device, sharded
from jax import P

import jaxcomm
from jaxcomm.compression import quantize

ROOT = Path(__file__).parent.parent
TOOLS = "calibration launch profiler schedule simulate step_model testbed wire".split()
PROGRAMS = ("calibration", "launch", "simulate", "testbed")


def test_the_version_is_the_packages_and_the_changelogs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert jaxcomm.__version__ == project["version"]
    assert f"## {jaxcomm.__version__}" in (ROOT / "CHANGELOG.md").read_text()
    assert jaxcomm.deprecated.REMOVED_IN > jaxcomm.__version__


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_imported_from_jaxcomm_is_the_tools_module(tool):
    with pytest.warns(DeprecationWarning, match=rf"jaxcomm.{tool} .*use jaxcomm.tools.{tool}\."):
        module = getattr(jaxcomm, tool)
    assert module is sys.modules[f"jaxcomm.tools.{tool}"]


def test_import_of_a_moved_module_binds_the_module_itself():
    sys.modules.pop("jaxcomm.testbed", None)
    with pytest.warns(DeprecationWarning, match=r"use jaxcomm.tools.testbed\."):
        import jaxcomm.testbed as old
    from jaxcomm.tools import testbed

    assert old is testbed


# In this process the tools are imported already (a real `python -m` imports them first).
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("tool", PROGRAMS)
def test_python_m_of_a_moved_tool_runs_the_tool(tool, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"jaxcomm.{tool}", "--help"])
    monkeypatch.delitem(sys.modules, f"jaxcomm.{tool}", raising=False)  # the shim runs
    with pytest.warns(DeprecationWarning, match=rf"use python -m jaxcomm.tools.{tool}\."):
        with pytest.raises(SystemExit) as e:
            runpy.run_module(f"jaxcomm.{tool}", run_name="__main__", alter_sys=True)
    assert e.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_sharded_data_parallel_is_data_parallel():
    with pytest.warns(DeprecationWarning, match=r"use jaxcomm.DataParallel\."):
        assert jaxcomm.ShardedDataParallel is jaxcomm.DataParallel


def test_xla_cpu_is_backend():
    with pytest.warns(DeprecationWarning, match=r"use jaxcomm.backend\."):
        from jaxcomm import xla_cpu
    assert xla_cpu is jaxcomm.backend


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'ShardedDataParalel'"):
        jaxcomm.ShardedDataParalel  # noqa: B018


def test_sync_request_found_and_warming_up():
    found = []
    with pytest.warns(DeprecationWarning, match=r"use SyncRequest\(on_sync=found.append\)"):
        request = jaxcomm.SyncRequest(communicate=False, found=found)
    request.on_sync("sync")
    assert found == ["sync"] and request.communicate is False
    with pytest.warns(DeprecationWarning, match=r"HostPhase\(warming_up=...\)"):
        request = jaxcomm.SyncRequest(warming_up=True)
    assert request == jaxcomm.SyncRequest(phase=jaxcomm.HostPhase(warming_up=True))
    assert isinstance(request, jaxcomm.SyncRequest)


def test_old_keywords_of_the_compressors_warn_and_are_ignored(mesh):
    """``bf16(via=...)``, ``bf16_codec(via=...)``, ``int_codec(..., materialize=...)``:
    the platform's route; a sync with the old call averages as the new one, bit for bit."""
    C = jaxcomm.compression
    with pytest.warns(DeprecationWarning, match=r"bf16\(via='exchange'\).*use jaxcomm.comp"):
        old = C.bf16(via="exchange")
    with pytest.warns(DeprecationWarning, match=r"use jaxcomm.compression.bf16_codec\(\)"):
        C.bf16_codec(via="exchange")
    with pytest.warns(DeprecationWarning, match=r"materialize=True.*use int_codec\(bits"):
        quantize.int_codec(8, 64, stochastic=False, materialize=True)
    old_sync = jaxcomm.gradient_sync(compression=old, min_size=1)
    new_sync = jaxcomm.gradient_sync(compression=C.bf16(), min_size=1)

    def both(g):
        g = g[0]
        return old_sync.reduce(g, old_sync.init(g))[0], new_sync.reduce(g, new_sync.init(g))[0]

    g = per_device(mesh, np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32))
    a, b = sharded(both, mesh, out_specs=P())(g)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_warming_up_of_reduce_and_step_fn(mesh):
    """``GradientSync.reduce(..., warming_up=)`` and ``DataParallel.step_fn(state,
    warming_up=)``: the programs of ``phase=HostPhase(warming_up=...)``."""
    sync = jaxcomm.gradient_sync(compression=jaxcomm.compression.int8(), warmup_steps=2)
    phase = jaxcomm.HostPhase(warming_up=False)

    def both(g):
        g = g[0]
        with pytest.warns(DeprecationWarning, match=r"reduce\(..., phase=jaxcomm.HostPhase"):
            old = sync.reduce(g, sync.init(g), warming_up=False)[0]
        return old, sync.reduce(g, sync.init(g), phase=phase)[0]

    g = per_device(mesh, np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32))
    a, b = sharded(both, mesh, out_specs=P())(g)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def loss_fn(params, batch):
        return jnp.mean((batch @ params["w"]) ** 2)

    tx = optax.chain(jaxcomm.sync_gradients(warmup_steps=2), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(loss_fn, tx, mesh)
    state = dp.init({"w": jnp.ones((4, 2))})
    batch = jax.device_put(np.ones((16, 4), np.float32), dp.batch_sharding)
    with pytest.warns(DeprecationWarning, match=r"use dp.step_fn\(state, phase=jaxcomm.Host"):
        old = dp.step_fn(state, warming_up=True)
    new = dp.step_fn(state, phase=jaxcomm.HostPhase(warming_up=True))
    assert old.lower(state, batch).as_text() == new.lower(state, batch).as_text()


def test_adaptive_states_and_replace_adaptive_of_data_parallel(mesh):
    C = jaxcomm.compression
    tx = optax.chain(jaxcomm.sync_gradients(compression=C.adaptive()), optax.sgd(0.1))
    dp = jaxcomm.data_parallel(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh)
    state = dp.init({"w": jnp.ones((64, 64))})
    with pytest.warns(DeprecationWarning, match=r"use jaxcomm.compression.adaptive_states\(dp"):
        old = dp.adaptive_states(state)
    assert len(old) == 1
    assert jax.tree.structure(old) == jax.tree.structure(
        C.adaptive_states(dp.optimizer_states(state)[0])
    )
    with pytest.warns(DeprecationWarning, match=r"use dp.with_optimizer_states\(state, "):
        replaced = dp.replace_adaptive(state, lambda s: s._replace(level=s.level + 1))
    got = C.adaptive_states(dp.optimizer_states(replaced)[0])[0]
    np.testing.assert_array_equal(np.asarray(got.level), np.asarray(old[0].level) + 1)
