"""Border augmentation in the file (augment: border_raw): random bands added to the decoded image before squaring
and intensity scaling, where the border probe (build_transforms(raw_band=...)) adds its bands."""
import numpy as np
import pytest
import torch
from PIL import Image

from chest_xray import transforms as T
from chest_xray.transforms import (AUGMENT_BORDER_DENSE, AUGMENT_BORDER_RAW, BORDER_PROFILES, RAW_BORDER_PROFILES,
                                   RandBandPad, RandBandPadd, build_transforms, image_level)
from hfl_components.flare.site_config import AUGMENTS


def _png(path, h=40, w=56, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((h, w)) * 150 + 50).astype(np.uint8), mode="L").save(path)
    return str(path)


def test_image_level_hand_cases():
    x = np.array([[2.0, 3.0], [5.0, 6.0]])
    assert image_level(x, 0.0) == 2.0 and image_level(x, 1.0) == 6.0 and image_level(x, 0.5) == 4.0
    assert image_level(torch.as_tensor(x), 0.25) == pytest.approx(3.0)


@pytest.mark.parametrize("value,level", [(0.0, 2.0), (0.5, 4.0), (1.0, 6.0)])
def test_image_scaled_band_is_coloured_in_the_images_own_grey_scale(value, level):
    x = np.full((1, 20, 20), 3.0, np.float32)
    x[0, 5, 5], x[0, 6, 6] = 2.0, 6.0
    r = RandBandPad(prob=1.0, fraction_range=(0.1, 0.1), values=(value,), side_prob=1.0,
                    image_scale=True).set_random_state(seed=0)
    out = r(x)
    assert r.params["widths"] == [2, 2, 2, 2]
    ring = np.ones((20, 20), bool)
    ring[2:18, 2:18] = False
    assert np.all(out[0][ring] == level)
    # without image_scale the value is used as is (the post-scaling augmentation)
    plain = RandBandPad(prob=1.0, fraction_range=(0.1, 0.1), values=(value,), side_prob=1.0).set_random_state(seed=0)
    assert np.all(plain(x)[0][ring] == value)


@pytest.mark.parametrize("aspect", ["crop", "stretch"])
@pytest.mark.parametrize("value", [0.0, 0.5, 1.0])
def test_a_raw_band_then_scaled_equals_the_probes_framed_image(tmp_path, monkeypatch, aspect, value):
    f = _png(tmp_path / "a.png")
    monkeypatch.setitem(RAW_BORDER_PROFILES, AUGMENT_BORDER_RAW,
                        {"prob": 1.0, "fraction_range": (0.06, 0.06), "side_prob": 1.0, "uniform_values": False,
                         "values": (value,)})
    train = build_transforms(24, "train", augment_classes=[], aspect=aspect, border_augment=AUGMENT_BORDER_RAW)
    probe = build_transforms(24, "eval", aspect=aspect, raw_band=(0.06, value))
    plain = build_transforms(24, "eval", aspect=aspect)
    item = {"image": f, "label": 1}
    got, want = train(dict(item))["image"], probe(dict(item))["image"]
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, plain(dict(item))["image"], atol=1e-3)


def test_probability_zero_leaves_the_pipeline_unchanged(tmp_path, monkeypatch):
    f = _png(tmp_path / "a.png")
    monkeypatch.setitem(RAW_BORDER_PROFILES, AUGMENT_BORDER_RAW, dict(BORDER_PROFILES[AUGMENT_BORDER_DENSE], prob=0.0))
    train = build_transforms(24, "train", augment_classes=[], aspect="crop", border_augment=AUGMENT_BORDER_RAW)
    plain = build_transforms(24, "eval", aspect="crop")
    for _ in range(5):
        assert torch.equal(train({"image": f, "label": 0})["image"], plain({"image": f, "label": 0})["image"])


def test_every_class_gets_bands_before_scaling_and_none_after(tmp_path):
    assert AUGMENT_BORDER_RAW in AUGMENTS and AUGMENT_BORDER_RAW in T.BORDER_AUGMENTS
    assert RAW_BORDER_PROFILES[AUGMENT_BORDER_RAW] == BORDER_PROFILES[AUGMENT_BORDER_DENSE]
    tf = build_transforms(24, "train", augment_classes=[], aspect="crop", border_augment=AUGMENT_BORDER_RAW)
    pads = [i for i, t in enumerate(tf.transforms) if isinstance(t, RandBandPadd)]
    scale = [i for i, t in enumerate(tf.transforms) if type(t).__name__ == "ScaleIntensityd"]
    assert len(pads) == 1 and pads[0] < scale[0] and tf.transforms[pads[0]].padder.image_scale
    assert tf.transforms[pads[0]].padder.prob == pytest.approx(0.8)
    assert not any(isinstance(t, RandBandPadd) for t in build_transforms(24, "eval", border_augment="border_raw")
                   .transforms)  # eval mode: no augmentation
    f = _png(tmp_path / "a.png")
    plain = build_transforms(24, "eval", aspect="crop")({"image": f, "label": 0})["image"]
    tf.set_random_state(seed=5)
    for label in (0, 1):
        n = 60
        changed = sum(not torch.equal(tf({"image": f, "label": label})["image"], plain) for _ in range(n))
        assert 0.6 * n <= changed <= 0.95 * n  # framed with probability 0.8 (binomial sd 0.05), whatever the class
