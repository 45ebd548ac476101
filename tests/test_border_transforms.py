"""Border augmentation by design and the inference-time band crop: the deterministic op by hand, the random
transform's determinism given its parameters and seed, every class framed, the raw-pipeline band probe."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from chest_xray.transforms import (
    BAND_VALUES,
    BandPad,
    RandBandPad,
    RandBandPadd,
    add_bands,
    build_transforms,
    crop_uniform_bands,
    uniform_band_widths,
)

torch.set_num_threads(1)


def test_add_bands_by_hand():
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
    # no resize: plain constant padding
    assert add_bands(x, (1, 0, 0, 2), 9.0, keep_size=False).tolist() == [[[9, 9, 9, 9, 9, 9], [0, 1, 2, 3, 9, 9],
                                                                           [4, 5, 6, 7, 9, 9], [8, 9, 10, 11, 9, 9],
                                                                           [12, 13, 14, 15, 9, 9]]]
    # size kept: bands of 2 px left and right, the 4 x 4 content area-averaged into 4 x 0 ... here 4 x 2 columns
    y = add_bands(x, (0, 0, 1, 1), -1.0)
    assert y.shape == (1, 4, 4) and (y[..., 0] == -1).all() and (y[..., 3] == -1).all()
    assert y[0, :, 1:3].tolist() == [[0.5, 2.5], [4.5, 6.5], [8.5, 10.5], [12.5, 14.5]]  # pairs of columns averaged
    assert torch.equal(add_bands(torch.as_tensor(x), (0, 0, 1, 1), -1.0), torch.as_tensor(y))  # tensor in, tensor out
    assert np.array_equal(add_bands(x, (0, 0, 0, 0), 5.0), x)
    with pytest.raises(ValueError, match=">= 0"):
        add_bands(x, (-1, 0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="no content"):
        add_bands(x, (2, 2, 0, 0), 0.0)


def test_random_band_is_deterministic_given_its_parameters_and_seed():
    x = torch.rand(1, 40, 40, generator=torch.Generator().manual_seed(0))
    t = RandBandPad(prob=1.0)
    t.set_random_state(7)
    out = t(x)
    p = t.params
    assert p is not None and any(p["widths"]) and p["value"] in BAND_VALUES.values()
    assert all(w == 0 or round(0.02 * 40) <= w <= round(0.12 * 40) for w in p["widths"])
    # the deterministic op with the drawn parameters gives the same image
    assert torch.equal(out, BandPad(p["widths"], p["value"])(x))
    # the same seed draws the same sequence of parameters
    a, b = RandBandPad(prob=0.5), RandBandPad(prob=0.5)
    a.set_random_state(3)
    b.set_random_state(3)
    seq_a, seq_b = [], []
    for _ in range(20):
        a(x)
        b(x)
        seq_a.append(a.params)
        seq_b.append(b.params)
    assert seq_a == seq_b and any(s is None for s in seq_a) and any(s is not None for s in seq_a)
    # every colour occurs
    c = RandBandPad(prob=1.0)
    c.set_random_state(0)
    seen = set()
    for _ in range(60):
        c(x)
        seen.add(c.params["value"])
    assert seen == set(BAND_VALUES.values())
    with pytest.raises(ValueError, match="fraction_range"):
        RandBandPad(fraction_range=(0.2, 0.6))


def test_dictionary_version_frames_the_image_and_keeps_the_label():
    x = torch.rand(1, 32, 32, generator=torch.Generator().manual_seed(1))
    t = RandBandPadd(keys="image", prob=1.0)
    t.set_random_state(5)
    d = t({"image": x, "label": 1})
    p = t.padder.params
    assert d["label"] == 1 and torch.equal(d["image"], BandPad(p["widths"], p["value"])(x))


def test_border_augmentation_frames_every_class(tmp_path):
    """With augment_classes = [] (no flip / affine for any class) the band still reaches both classes."""
    rng = np.random.default_rng(0)
    f = tmp_path / "img.png"
    Image.fromarray((rng.random((48, 48)) * 200 + 30).astype(np.uint8)).save(f)
    ref = build_transforms(48, "eval")({"image": str(f), "label": 0})["image"]
    t = build_transforms(48, "train", augment_classes=[], border_augment=True)
    t.set_random_state(seed=0)
    changed = {0: 0, 1: 0}
    for _ in range(16):
        for label in (0, 1):
            changed[label] += int(not torch.equal(t({"image": str(f), "label": label})["image"], ref))
    assert changed[0] >= 4 and changed[1] >= 4  # p = 0.5 each
    plain = build_transforms(48, "train", augment_classes=[])
    assert all(torch.equal(plain({"image": str(f), "label": 0})["image"], ref) for _ in range(4))


def test_uniform_band_crop_removes_an_added_border_only():
    rng = np.random.default_rng(2)
    film = rng.random((60, 50)).astype(np.float32) * 0.8 + 0.1
    framed = add_bands(film, (5, 0, 3, 7), 0.0, keep_size=False)
    assert uniform_band_widths(framed) == (5, 0, 3, 7)
    assert np.array_equal(crop_uniform_bands(framed[None]), film[None])
    assert uniform_band_widths(film) == (0, 0, 0, 0)
    # a grey band, and a band wider than the limit is cut at the limit
    grey = add_bands(film, (30, 0, 0, 0), 0.5, keep_size=False)
    assert uniform_band_widths(grey, max_fraction=0.25) == (int(0.25 * 90), 0, 0, 0)


def test_raw_band_probe_and_crop_in_the_pipeline(tmp_path):
    """A border in the file (raw pipeline): black / grey / white bands of 6 % change the model input; with
    crop_bands the pipeline cuts them off again, giving back (nearly) the unframed input."""
    rng = np.random.default_rng(3)
    a = (rng.random((80, 100)) * 180 + 40).astype(np.uint8)
    f = tmp_path / "film.png"
    Image.fromarray(a).save(f)
    plain = build_transforms(32, "eval")({"image": str(f), "label": 0})["image"]
    for value in BAND_VALUES.values():
        framed = build_transforms(32, "eval", raw_band=(0.06, value))({"image": str(f), "label": 0})["image"]
        assert framed.shape == plain.shape and not torch.allclose(framed, plain, atol=0.05)
        if value in (0.0, 1.0):  # the band is the image's darkest / brightest level
            edge = framed[0, 0, :]
            assert torch.allclose(edge, torch.full_like(edge, value), atol=1e-5)
    # write the framed file itself, then read it with the crop: the film comes back
    boxed = np.pad(a, ((6, 6), (8, 8)), constant_values=0)
    g = tmp_path / "boxed.png"
    Image.fromarray(boxed).save(g)
    cropped = build_transforms(32, "eval", crop_bands=True)({"image": str(g), "label": 0})["image"]
    assert torch.allclose(cropped, plain, atol=1e-5)
