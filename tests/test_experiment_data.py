"""The experiment's input pipelines: the ImageNet-layout folder loader and synthetic data."""

import numpy as np
import pytest

from experiments.data import ImageFolder, SyntheticImages

COLOURS = {"cat": (230, 20, 20), "dog": (20, 230, 20), "fish": (20, 20, 230)}
SIZES = [(20, 30), (40, 24), (33, 33), (64, 18), (25, 50)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x 5 JPEGs of different sizes, one solid colour per class."""
    from PIL import Image

    root = tmp_path_factory.mktemp("imagenet")
    for name, rgb in COLOURS.items():
        (root / name).mkdir()
        for i, size in enumerate(SIZES):
            Image.new("RGB", size, rgb).save(root / name / f"img{i}.JPEG", quality=95)
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def _denormalised_mean(images):
    mean = np.array([0.485, 0.456, 0.406])
    std = np.array([0.229, 0.224, 0.225])
    return images.mean(axis=(1, 2)) * std + mean  # (batch, 3), 0..1


def test_folder_batches_shapes_labels_and_epochs(folder):
    data = ImageFolder(folder, image_size=16, global_batch=4, seed=1, workers=3, prefetch=2)
    assert data.classes == ["cat", "dog", "fish"] and data.num_classes == 3
    assert len(data.files) == 15 and data.batches_per_epoch == 3
    batches = list(data.iterate(start=0, stop=6))
    assert [p for p, _ in batches] == list(range(6))
    for _, b in batches:
        assert b["image"].shape == (4, 16, 16, 3) and b["image"].dtype == np.float32
        assert b["label"].dtype == np.int32
        # the class colour survives decoding, resizing and normalisation
        np.testing.assert_array_equal(np.argmax(_denormalised_mean(b["image"]), -1), b["label"])
    # one epoch reads distinct images; the next epoch is another permutation
    epoch0 = np.concatenate([data.indices(p) for p in range(3)])
    epoch1 = np.concatenate([data.indices(p) for p in range(3, 6)])
    assert len(set(epoch0.tolist())) == 12 and len(set(epoch1.tolist())) == 12
    assert not np.array_equal(epoch0, epoch1)


def test_folder_resumes_at_a_position_and_splits_over_processes(folder):
    data = ImageFolder(folder, image_size=16, global_batch=4, seed=1)
    full = dict(data.iterate(start=0, stop=5))
    resumed = dict(data.iterate(start=3, stop=5))
    assert sorted(resumed) == [3, 4]
    for p in (3, 4):
        np.testing.assert_array_equal(resumed[p]["image"], full[p]["image"])
        np.testing.assert_array_equal(resumed[p]["label"], full[p]["label"])
    parts = [
        ImageFolder(
            folder, image_size=16, global_batch=4, seed=1, process_index=i, process_count=2
        )  # fmt: skip
        for i in range(2)
    ]
    for p in range(4):
        local = [part.load(p) for part in parts]
        assert all(x["image"].shape == (2, 16, 16, 3) for x in local)
        np.testing.assert_array_equal(
            np.concatenate([x["image"] for x in local]), data.load(p)["image"]
        )


def test_folder_closing_early_stops_the_workers(folder):
    data = ImageFolder(folder, image_size=16, global_batch=4, workers=2, prefetch=3)
    it = data.iterate(start=0)  # endless
    position, batch = next(it)
    assert position == 0 and batch["image"].shape[0] == 4
    it.close()  # cancels the prefetched batches and joins the pool


def test_folder_bad_input(folder, tmp_path):
    with pytest.raises(ValueError, match="no images"):
        ImageFolder(tmp_path, image_size=16, global_batch=4)
    with pytest.raises(ValueError, match="is not a directory"):
        ImageFolder(tmp_path / "nope", image_size=16, global_batch=4)
    with pytest.raises(ValueError, match="does not divide by process_count=3"):
        ImageFolder(folder, image_size=16, global_batch=4, process_count=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ImageFolder(folder, image_size=16, global_batch=32)


def test_synthetic_batches_are_sharded_and_deterministic(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P(("inter", "intra")))
    data = SyntheticImages(sharding, global_batch=16, image_size=8, num_classes=5, seed=3)
    a, b = data.batch(7), data.batch(7)
    assert a["image"].shape == (16, 8, 8, 3) and a["image"].sharding == sharding
    np.testing.assert_array_equal(a["image"], b["image"])
    assert 0 <= int(a["label"].min()) and int(a["label"].max()) < 5
    assert not np.array_equal(a["image"], data.batch(8)["image"])
    assert [p for p, _ in data.iterate(start=2, stop=4)] == [2, 3]
