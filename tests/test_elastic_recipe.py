"""docs/elastic.md's recipe runs as written: started as PyTorch's elastic agent starts a
worker (its variables, one process), on 8 CPU devices; its newest checkpoint dropped (as a
write cut short by a lost node leaves it); started again on 4 devices, it restores the
checkpoint written on 8 and finishes with the params of the uninterrupted run."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
from helpers import ROOT

from experiments.elastic import read_params
from jaxcomm.checkpoint import Checkpointer
from jaxcomm.tools.launch import free_port

DOC = ROOT / "docs" / "elastic.md"


def _recipe() -> str:
    section = DOC.read_text().split("### In your own script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(script, folder, devices):
    env = {
        **os.environ,
        "XLA_FLAGS": "",  # the device count is the recipe's (agent_env's local_devices)
        "PYTHONPATH": str(ROOT),
        "LOCAL_DEVICES": str(devices),
        "CHECKPOINT_DIR": str(folder),
        # what torchrun gives the worker it starts
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_RUN_ID": "recipe",
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_recipe_runs_as_written(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_recipe())
    folder = tmp_path / "ckpt"
    _run(script, folder, 8)
    straight = read_params(str(folder / "6"))
    assert Checkpointer(folder).saved_data(4)["devices"] == 8
    shutil.rmtree(folder / "6")
    _run(script, folder, 4)
    ckpt = Checkpointer(folder)
    assert ckpt.all_steps() == [4, 6] and ckpt.saved_data(6)["devices"] == 4
    ckpt.close()
    resumed = read_params(str(folder / "6"))
    for k in ("w", "b"):  # f32 rounding of another reduction order
        np.testing.assert_allclose(resumed[k], straight[k], rtol=2e-5, atol=2e-6)
    assert np.abs(straight["w"]).max() > 0
