import jax
import pytest

import jaxcomm


def test_default_mesh_one_process_is_one_node():
    mesh = jaxcomm.make_mesh()
    assert mesh.axis_names == ("inter", "intra")
    assert dict(mesh.shape) == {"inter": 1, "intra": 8}


@pytest.mark.parametrize("intra,shape", [(1, (8, 1)), (2, (4, 2)), (4, (2, 4)), (8, (1, 8))])
def test_intra_splits_devices(intra, shape):
    mesh = jaxcomm.make_mesh(intra)
    assert mesh.devices.shape == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("bad", [0, -1, 3, 5, 16])
def test_bad_intra_names_count_value_and_choices(bad):
    with pytest.raises(ValueError) as e:
        jaxcomm.make_mesh(bad)
    msg = str(e.value)
    assert f"intra={bad}" in msg and "8 devices" in msg and "[1, 2, 4, 8]" in msg


class _FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index = id, process_index

    def __repr__(self):
        return f"D{self.id}@p{self.process_index}"


def test_group_spanning_processes_is_rejected():
    # 3 processes x 2 devices: intra=3 divides 6 but a group would span two processes.
    devs = [_FakeDevice(i, i // 2) for i in range(6)]
    assert jaxcomm.mesh.valid_intra_sizes(devs) == [1, 2]
    with pytest.raises(ValueError, match=r"span two processes.*Valid choices: \[1, 2\]"):
        jaxcomm.make_mesh(3, devices=devs)
