"""MONAI per-site transforms: shape, the three aspect choices (stretch default, letterbox padding, crop), orientation,
class-restricted augmentation, caching."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from chest_xray import ApplyToClassesd, build_transforms, default_augment_classes, make_site_dataset

torch.set_num_threads(1)

# narrowest (437 px), widest (2890 px), a portrait image, an RGB image
REAL_FILES = [
    "train/PNEUMONIA/person1689_bacteria_4474.jpeg",
    "train/NORMAL/IM-0521-0001.jpeg",
    "train/NORMAL/IM-0595-0001.jpeg",
    "train/PNEUMONIA/person1052_virus_1751.jpeg",
]


@pytest.fixture(scope="module")
def real_files(data_root):
    root = data_root / "chest_xray_original"
    files = [root / f for f in REAL_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"real images missing: {missing}")
    return files


def _padding_extent(img: np.ndarray) -> tuple[int, int]:
    """Number of all-zero rows and columns of a (S, S) array."""
    return int((img.max(axis=1) == 0).sum()), int((img.max(axis=0) == 0).sum())


@pytest.mark.parametrize("size", [32, 64, 128, 224])
def test_real_images_stretch_fill_the_square(real_files, size):
    """The default (stretch) keeps every row and column of the image: no all-zero padding band on any side."""
    t = build_transforms(size, "eval")
    for f in real_files:
        x = t({"image": str(f), "label": 0})["image"]
        assert type(x) is torch.Tensor and x.dtype == torch.float32 and tuple(x.shape) == (1, size, size)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.5
        assert _padding_extent(x[0].numpy()) == (0, 0)
        # the first and last rows and columns are image content, not zero padding
        assert min(float(x[0, 0].max()), float(x[0, -1].max()), float(x[0, :, 0].max()), float(x[0, :, -1].max())) > 0


@pytest.mark.parametrize("size", [32, 64, 128, 224])
def test_real_images_letterbox_shape_and_aspect(real_files, size):
    t = build_transforms(size, "eval", aspect="letterbox")
    for f in real_files:
        with Image.open(f) as im:
            w, h = im.size
        out = t({"image": str(f), "label": 0})
        x = out["image"]
        assert type(x) is torch.Tensor and x.dtype == torch.float32 and tuple(x.shape) == (1, size, size)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.5
        img = x[0].numpy()
        short = round(size * min(w, h) / max(w, h))
        pad = size - short
        if w > h:  # landscape: padding rows split above and below, no padded columns
            top = int(np.argmax(img.max(axis=1) > 0))
            assert abs(top - pad // 2) <= 1 and img[:, size // 2].max() > 0
            if pad >= 4:
                assert img[: pad // 2 - 1].max() == 0 and img[size - (pad - pad // 2 - 1):].max() == 0
        else:  # portrait: padding columns left and right
            left = int(np.argmax(img.max(axis=0) > 0))
            assert abs(left - pad // 2) <= 1 and img[size // 2, :].max() > 0
            if pad >= 4:
                assert img[:, : pad // 2 - 1].max() == 0 and img[:, size - (pad - pad // 2 - 1):].max() == 0


def test_stretch_and_crop_geometry_hand_built(tmp_path):
    """60 rows x 120 columns: value 50 on columns 0..59, 250 on 60..119, a 255 block at rows 0..11 x columns
    0..23 and a 0 block at rows 48..59 x columns 60..71. Stretch to 64 x 64 maps column c to 64 c / 120 and row
    r to 64 r / 60: the 50/250 edge lands at column 32, the 255 block covers rows and columns 0..12.8, the 0 block
    rows 51.2..64 x columns 32..38.4, and no row or column is padding. The central 60 x 60 crop keeps columns
    30..89 (scale 64/60): the edge lands at column 32, the 0 block at columns 32..44.8, the 255 block is cut away
    (so 250 is the maximum). Letterbox pads 16 zero rows above and below the 32 x 64 image."""
    a = np.full((60, 120), 50, np.uint8)
    a[:, 60:] = 250
    a[:12, :24] = 255
    a[48:, 60:72] = 0
    f = tmp_path / "wide.png"
    Image.fromarray(a).save(f)
    x = build_transforms(64, "eval")({"image": str(f), "label": 0})["image"][0].numpy()
    assert x.shape == (64, 64) and _padding_extent(x) == (0, 0)
    assert np.allclose(x[13:, :31], 50 / 255) and np.allclose(x[:50, 32:], 250 / 255) and np.allclose(x[:, 39:], 250 / 255)
    assert np.allclose(x[:12, :12], 1.0) and np.allclose(x[52:, 32:38], 0.0)
    z = build_transforms(64, "eval", aspect="crop")({"image": str(f), "label": 0})["image"][0].numpy()
    assert z.shape == (64, 64) and _padding_extent(z) == (0, 0)
    assert np.allclose(z[:, :31], 50 / 250) and np.allclose(z[:50, 32:], 1.0) and np.allclose(z[52:, 32:44], 0.0)
    lb = build_transforms(64, "eval", aspect="letterbox")({"image": str(f), "label": 0})["image"][0].numpy()
    assert _padding_extent(lb) == (16 + 16, 0) and lb[:16].max() == 0 and lb[48:].max() == 0
    assert np.allclose(lb[16:22, :6], 1.0) and lb[16:48].max(axis=1).min() > 0
    with pytest.raises(ValueError, match="aspect"):
        build_transforms(64, "eval", aspect="pad")


def test_non_square_orientation_and_padding_location(tmp_path):
    # 60 rows x 120 columns: bright block in the top-left corner, mid-gray elsewhere (letterbox geometry)
    a = np.full((60, 120), 100, np.uint8)
    a[:20, :30] = 250
    f = tmp_path / "wide.png"
    Image.fromarray(a).save(f)
    x = build_transforms(64, "eval", aspect="letterbox")({"image": str(f), "label": 0})["image"][0].numpy()
    rows_pad, cols_pad = _padding_extent(x)
    assert (rows_pad, cols_pad) == (32, 0)  # 60x120 -> 32x64, padded with 16 rows above and 16 below
    assert x[:16].max() == 0 and x[48:].max() == 0 and x[16:48].min() > 0
    assert x[16:26, :14].mean() > 0.95 and x[30:48, 20:].mean() < 0.45  # block stays top-left, not transposed
    # portrait: 120 rows x 60 columns -> padding columns
    g = tmp_path / "tall.png"
    Image.fromarray(np.ascontiguousarray(a.T)).save(g)
    y = build_transforms(64, "eval", aspect="letterbox")({"image": str(g), "label": 0})["image"][0].numpy()
    assert _padding_extent(y) == (0, 32)
    assert y[:14, 16:26].mean() > 0.95


def test_augmentation_only_touches_chosen_class(tmp_path):
    rng = np.random.default_rng(0)
    a = (rng.random((48, 64)) * 200 + 30).astype(np.uint8)
    a[:10, :10] = 255
    f = tmp_path / "img.png"
    Image.fromarray(a).save(f)
    ref = build_transforms(48, "eval")({"image": str(f), "label": 0})["image"]
    t = build_transforms(48, "train", augment_classes=[1])
    t.set_random_state(seed=0)
    changed = {0: 0, 1: 0}
    for _ in range(12):
        for label in (0, 1):
            out = t({"image": str(f), "label": label})
            assert tuple(out["image"].shape) == (1, 48, 48) and out["label"] == label
            changed[label] += int(not torch.equal(out["image"], ref))
    assert changed[0] == 0 and changed[1] >= 6  # p(unchanged) = 0.5 * 0.2 per draw
    # None = every class
    t_all = build_transforms(48, "train", augment_classes=None)
    t_all.set_random_state(seed=1)
    assert sum(not torch.equal(t_all({"image": str(f), "label": 0})["image"], ref) for _ in range(8)) >= 5


def test_default_augment_classes():
    rows = [{"label": 0}] * 30 + [{"label": 1}] * 70 + [{"label": 2}] * 50
    assert default_augment_classes(rows) == [0, 2]
    assert default_augment_classes([{"label": 1}] * 3 + [{"label": 0}] * 3) == []
    assert default_augment_classes([]) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        build_transforms(64, "test")
    with pytest.raises(ValueError, match="input_size"):
        build_transforms(4, "eval")


def test_site_dataset_cached_in_memory_and_on_disk(real_files, tmp_path):
    rows = [{"path": str(f), "label": k % 2, "split": "train"} for k, f in enumerate(real_files)]
    ref = build_transforms(64, "eval")
    ds = make_site_dataset(rows, 64, "eval")
    assert len(ds) == len(rows)
    for i, r in enumerate(rows):
        item = ds[i]
        assert set(item) == {"image", "label"} and item["label"] == r["label"]
        assert torch.equal(item["image"], ref({"image": r["path"], "label": r["label"]})["image"])
    pds = make_site_dataset(rows, 64, "eval", cache_dir=tmp_path / "cache")
    first = [pds[i]["image"] for i in range(len(rows))]
    assert any((tmp_path / "cache" / "s64-stretch").iterdir())
    # another aspect gets its own cache folder: a letterboxed cache is never served as stretched images
    lds = make_site_dataset(rows, 64, "eval", cache_dir=tmp_path / "cache", aspect="letterbox")
    assert any(_padding_extent(lds[i]["image"][0].numpy()) != (0, 0) for i in range(len(rows)))
    assert any((tmp_path / "cache" / "s64-letterbox").iterdir())
    assert all(torch.equal(a, ds[i]["image"]) for i, a in enumerate(first))
    # train mode (None: every class is augmented, as in build_transforms); a DataLoader batches it
    tr = make_site_dataset(rows[:3], 32, "train", seed=0)
    gate = [t for t in tr.transform.transforms if isinstance(t, ApplyToClassesd)]
    assert len(gate) == 1 and gate[0].classes is None  # None: no class filter (majority class 0 augmented too)
    none = make_site_dataset(rows[:3], 32, "train", augment_classes=[])
    assert [t.classes for t in none.transform.transforms if isinstance(t, ApplyToClassesd)] == [frozenset()]
    loader = torch.utils.data.DataLoader(tr, batch_size=3)
    batch = next(iter(loader))
    assert tuple(batch["image"].shape) == (3, 1, 32, 32) and batch["label"].tolist() == [0, 1, 0]


def test_unreadable_file_raises_named_error(tmp_path):
    from chest_xray import ImageReadError

    f = tmp_path / "bad.jpeg"
    f.write_text("nope")
    with pytest.raises(Exception) as e:  # MONAI wraps transform errors in RuntimeError("applying transform ...")
        build_transforms(32, "eval")({"image": str(f), "label": 0})
    err = e.value
    while err is not None and not isinstance(err, ImageReadError):
        err = err.__cause__
    assert isinstance(err, ImageReadError) and "bad.jpeg" in str(err)


def test_augmentation_without_metadata_tracking_is_bitwise_the_same():
    """ApplyToClassesd runs RandFlipd + RandAffined with MONAI's metadata tracking off and a cached sampling grid
    (the fast path): the pixels must be exactly those of the plain transforms with tracking on, for the same seed, and the
    global setting is restored."""
    import monai
    from monai.transforms import Compose

    from chest_xray.transforms import ApplyToClassesd

    aug = [t for t in build_transforms(64, "train").transforms if isinstance(t, ApplyToClassesd)][0]
    assert isinstance(aug.transform, Compose)
    g = torch.Generator().manual_seed(3)
    xs = [torch.rand(1, 64, 64, generator=g) for _ in range(40)]
    aug.set_random_state(7)
    fast = torch.stack([torch.as_tensor(aug({"image": x, "label": 1})["image"]).as_subclass(torch.Tensor) for x in xs])
    assert monai.data.get_track_meta() is True  # restored after every call
    # the reference: the same flip + affine built plainly (no cached grid), the same seed, MONAI's tracking on
    import math

    from monai.transforms import RandAffined, RandFlipd

    from chest_xray.transforms import MAX_ROTATION_DEG, MAX_TRANSLATE_FRACTION

    shift = MAX_TRANSLATE_FRACTION * 64
    plain = Compose([RandFlipd(keys="image", prob=0.5, spatial_axis=1),
                     RandAffined(keys="image", prob=0.8, rotate_range=math.radians(MAX_ROTATION_DEG),
                                 translate_range=(shift, shift), mode="bilinear", padding_mode="zeros")])
    plain.set_random_state(7)
    ref = torch.stack([torch.as_tensor(plain({"image": x, "label": 1})["image"]).as_subclass(torch.Tensor)
                       for x in xs])
    assert torch.equal(fast, ref)
    changed = [not torch.equal(f, x) for f, x in zip(fast, xs)]
    assert 30 <= sum(changed) <= 40  # p(no flip and no affine) = 0.5 * 0.2 = 0.1: most images were moved
    # restored also when the wrapped transform raises
    class Boom:
        def __call__(self, d):
            raise RuntimeError("boom")
    bad = ApplyToClassesd(Boom(), None)
    with pytest.raises(RuntimeError):
        bad({"image": xs[0], "label": 0})
    assert monai.data.get_track_meta() is True
