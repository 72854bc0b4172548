"""``python -m experiments.bench compression --calibration``: the codec figures of the cost model,
measured on the devices present, in the calibration file format."""

import json

import pytest

from experiments.bench import compression as bc
from jaxcomm import cost
from jaxcomm.tools import calibration as cal


def test_codec_calibration_writes_a_loadable_codec_section():
    doc = bc.codec_calibration(
        devices=4, nbytes=1 << 20, block=64, repeats=1, kernels=("int4-nearest", "copy")
    )
    assert set(doc["codec"]) == {"int4-nearest", "copy"}
    c = cal.from_dict(json.loads(json.dumps(doc)))
    for kernel in ("int4-nearest", "copy"):
        assert c.codec[kernel].encode_s_per_byte > 0 and c.codec[kernel].decode_s_per_byte > 0
    assert doc["meta"]["devices_at_once"] == 4 and doc["meta"]["block"] == 64
    # the simulator reads it: the int4 row's codec time comes from these figures
    comp = cost.parse_compression("int4(block=64, stochastic=False)")
    assert cost.codec_seconds(comp, 1e6, 2, c.codec) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=5), "devices=5: must be even"),
        (dict(devices=64), "at most|devices present"),
        (dict(devices=4, nbytes=1_000_000), "must divide"),
        (dict(devices=4, kernels=("int9",)), r"\['int9'\]; choose from"),
    ],
)
def test_codec_calibration_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bc.codec_calibration(repeats=1, **kwargs)
