"""A public Flax NNX LM training script's shape (the JAX AI Stack's miniGPT tutorial:
``tests/nnx_lm_script.py``) ported to jaxcomm, hybrid-sharded, in at most 10 changed lines
(``tests/nnx_lm_script_ported.py``): both train three steps on 8 fake devices and log the
same losses within f32 rounding; the port's params are stored split over 'intra'."""

import jax
import nnx_lm_script
import nnx_lm_script_ported
import numpy as np
from flax import nnx
from helpers import assert_copies_equal
from test_pmap import HERE, changed_lines


def test_the_port_changes_at_most_10_lines():
    original = (HERE / "nnx_lm_script.py").read_text()
    ported = (HERE / "nnx_lm_script_ported.py").read_text()
    n = changed_lines(original, ported)
    assert 0 < n <= 10, n


def test_port_trains_as_the_script_hybrid_sharded():
    config = {"num_steps": 3, "batch_size": 16, "log_every": 1}
    _, losses = nnx_lm_script.train(**config)
    model, ported = nnx_lm_script_ported.train(**config)
    assert len(losses) == 3 and losses[-1] < losses[0]
    np.testing.assert_allclose(ported, losses, rtol=1e-5)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    split = [p for p in params if "intra" in str(p.sharding.spec)]
    assert len(split) == len(params)  # every leaf of this model divides by intra=4
    assert assert_copies_equal(nnx.state(model)) > 0
