"""data_parallel(shard_params=True) with jaxcomm.local_sgd: each node trains its own local
params (each device its blocks, the node's gradient reduce-scattered inside it every
step), and every H steps the outer gradient's blocks are averaged across 'inter' only.

Reference: the replicated layout's local SGD on a 2 x 1 mesh (one device per node) fed
the same global batch, so each of its devices sees a node's examples: equal within f32
rounding (f32, and bf16 on the wire, which rounds each element alike whether the leaf is
split or whole). Also: copies across 'inter' equal by their bits after every step, every
device's local blocks the new anchor's bits right after a sync step, the HLO census (only
the sync crosses 'inter', in the sync branch; the gathers and reduce-scatters stay
inside the node), the leaf kept whole the same on every device of a node, PowerSGD of
the blocks as the outer compressor, refusals.
"""

import jax
import numpy as np
import optax
import pytest
from helpers import AX, assert_copies_equal
from jax.sharding import Mesh
from mlp import mlp_batches, mlp_init, mlp_loss

import jaxcomm
from jaxcomm.hybrid import param_dims

C = jaxcomm.compression
H = 2
STEPS = 3  # local, sync (after the 2nd step), local
SIZES = (12, 64, 3)  # every leaf splits over intra=4 but the last bias (3,), kept whole


def _tx(compression=None):
    outer = optax.sgd(1.0, momentum=0.5, nesterov=True)
    return jaxcomm.local_sgd(
        optax.adam(1e-2), outer=outer, sync_every=H, compression=compression, min_size=0
    )


@pytest.fixture(scope="module")
def params():
    return mlp_init(jax.random.key(1), SIZES)


@pytest.fixture(scope="module")
def node_mesh():
    """One device per node: the replicated layout's local SGD of a node's batch."""
    return Mesh(np.array(jax.devices()[:2]).reshape(2, 1), AX)


def _blocks_of(params, mesh):
    """Per device (mesh order), each param leaf's block as hybrid sharding splits it."""
    intra = int(mesh.shape["intra"])
    dims = param_dims(params, intra)
    out = []
    for d in range(mesh.devices.size):
        j = d % intra  # the device's position in its node
        out.append(
            [
                np.asarray(x) if k is None else np.split(np.asarray(x), intra, axis=k)[j]
                for x, k in zip(jax.tree.leaves(params), dims, strict=True)
            ]
        )
    return out


@pytest.fixture(scope="module")
def runs(mesh, node_mesh, params):
    """Hybrid and node-reference local SGD (f32; bf16 on the wire), hybrid with int8 (its
    scales from each device's buffer of blocks and the leaf kept whole): the states and
    loss rows after every step; the hybrid states checked across 'inter' after each."""
    batches = mlp_batches(STEPS, size=32)
    out = {"batches": batches}
    both = (("hyb", mesh, {"shard_params": True}), ("ref", node_mesh, {}))
    for name, comp, kinds in (
        ("f32", None, both), ("bf16", C.bf16(), both), ("int8", C.int8(), both[:1]),
    ):  # fmt: skip
        for kind, m, kw in kinds:
            dp = jaxcomm.data_parallel(mlp_loss, _tx(comp), m, **kw)
            state, states, losses = dp.init(params), [], []
            for b in batches:
                state, metrics = dp(state, b)
                if kind == "hyb":
                    assert assert_copies_equal(state) > 0
                states.append(state)
                losses.append(np.asarray(metrics["loss"]))
            out[name, kind] = (dp, states, losses)
    return out


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_equals_the_replicated_local_sgd_of_a_node(runs, params, name):
    (dp, hyb, l_hyb), (_, ref, l_ref) = runs[name, "hyb"], runs[name, "ref"]
    assert dp.layout.local_sgd
    for t in range(STEPS):
        # the loss rows: one per device, their mean over a node the node's loss
        np.testing.assert_allclose(l_hyb[t].reshape(2, 4).mean(1), l_ref[t], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(hyb[t].params), jax.tree.leaves(ref[t].params),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    moved = [
        np.abs(np.asarray(a) - np.asarray(p)).max()
        for a, p in zip(jax.tree.leaves(hyb[-1].params), jax.tree.leaves(params), strict=True)
    ]
    assert max(moved) > 1e-3  # the sync step moved the anchor (the test can fail)


@pytest.mark.parametrize("name", ["f32", "int8"])
def test_local_blocks_are_the_anchor_after_a_sync_and_per_node_between(runs, name):
    """Each device's local params are its blocks: after the sync step every device's
    row holds the new anchor's block bit for bit; after a local step the nodes differ
    (each trained on its own examples). The leaf kept whole is the same bits on every
    device of a node after every step (int8 quantizes it with each device's blocks: the
    node takes its first device's)."""
    dp, states, _ = runs[name, "hyb"]
    assert any(".local" in p for p in dp.per_device_paths), dp.per_device_paths
    assert any(".inner" in p for p in dp.per_device_paths), dp.per_device_paths
    mesh = dp.mesh
    for t, state in enumerate(states):
        rows = [np.asarray(x) for x in jax.tree.leaves(state.opt_state.local.value)]
        anchor = _blocks_of(jax.device_get(state.params), mesh)
        synced = (t + 1) % H == 0
        for d in range(mesh.devices.size):
            for k, r in enumerate(rows):
                same = r[d].tobytes() == anchor[d][k].tobytes()
                assert same == synced, (t, d, k)
        if not synced:  # node 0's device j and node 1's device j hold different blocks
            assert not np.array_equal(rows[0][0], rows[0][4])
        whole = [k for k, d in enumerate(param_dims(state.params, 4)) if d is None]
        assert whole
        for k in whole:
            for node in range(2):
                assert len({rows[k][4 * node + j].tobytes() for j in range(4)}) == 1, (t, k)


def _census(dp, state, batch):
    """The one program of every step (local SGD's lax.switch on the devices)."""
    wb = jaxcomm.wire_bytes(dp.step_fn(state), state, dp.shard_batch(batch), mesh=dp.mesh)
    return wb


def test_only_the_sync_crosses_inter(runs, params):
    """HLO census of the step (its switch on the devices): outside the switch only
    collectives over 'intra' (the params' all-gathers, the gradients' reduce-scatters,
    the leaf kept whole taken from the node's first device); across 'inter' only the sync
    branch's reduction of the outer gradient's blocks (f32: one all-reduce of the blocks
    and the leaf kept whole; bf16: half its bytes on the link); the no-sync branch sends
    nothing."""
    dims = param_dims(params, 4)
    block_bytes = sum(
        x.nbytes / (1 if d is None else 4)
        for x, d in zip(jax.tree.leaves(params), dims, strict=True)
    )  # the leaf kept whole counted in full
    link = {}
    for name in ("f32", "bf16"):
        dp, states, _ = runs[name, "hyb"]
        wb = _census(dp, states[-1], runs["batches"][0])
        outside = [c for c in wb["collectives"] if not c["branch"]]
        assert {c["axes"] for c in outside} == {("intra",)}, outside
        assert {"all-gather", "reduce-scatter"} <= {c["kind"] for c in outside}
        cross = [c for c in wb["collectives"] if "inter" in c["axes"]]
        assert cross and all(c["axes"] == ("inter",) and c["branch"] for c in cross), cross
        (switch,) = [b for b in wb["branches"].values() if len(b) == 3]
        assert {int(i): v > 0 for i, v in switch.items()} == {0: True, 1: False, 2: False}
        if name == "f32":
            assert [c["kind"] for c in cross] == ["all-reduce"], cross
            assert cross[0]["operand_bytes"] == block_bytes
        link[name] = sum(c["bytes"] for c in cross)
        print(f"\n{name}: {link[name]:.0f} B across 'inter' per device per sync step "
              f"({block_bytes:.0f} B of f32 blocks)")  # fmt: skip
    assert link["bf16"] <= 0.55 * link["f32"], link


def test_powersgd_of_the_blocks_as_the_outer_compressor(mesh, params):
    """PowerSGD compresses each device's block of the outer gradient: its factors and
    residuals per device, copies across 'inter' bitwise equal after the sync step, the
    anchor moved, finite."""
    dp = jaxcomm.data_parallel(mlp_loss, _tx(C.powersgd(rank=1)), mesh, shard_params=True)
    state = dp.init(params)
    for b in mlp_batches(H, size=32):
        state, metrics = dp(state, b)
        assert assert_copies_equal(state) > 0
    assert any(".q[" in p for p in dp.per_device_paths), dp.per_device_paths
    assert np.isfinite(np.asarray(metrics["loss"])).all()
    moved = max(
        np.abs(np.asarray(a) - np.asarray(p)).max()
        for a, p in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3


def test_refusals(mesh):
    # an inner optimizer that does not split over the blocks, probed before any sync
    clip = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))
    tx = jaxcomm.local_sgd(clip, sync_every=10)
    dp = jaxcomm.data_parallel(mlp_loss, tx, mesh, shard_params=True)
    with pytest.raises(ValueError, match="different updates of a leaf kept whole"):
        dp.init(mlp_init(jax.random.key(1), SIZES))
    sync = jaxcomm.local_sgd(optax.sgd(0.1), sync_every=2, axes=("inter",))
    dp = jaxcomm.data_parallel(mlp_loss, sync, mesh, shard_params=True)
    with pytest.raises(ValueError, match=r"axes=\('inter',\)\) differs"):
        dp.init(mlp_init(jax.random.key(1), SIZES))
