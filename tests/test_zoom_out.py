"""Random zoom-out in the file (augment: zoom_out): the border probe's own frame (bands of one share f of each side
on all four sides of the decoded image, the image kept at its size) at a random f, filled with the image's darkest
level, on every class, before squaring, resizing and the intensity scaling."""
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from chest_xray.transforms import (AUGMENT_ZOOM_OUT, BORDER_AUGMENTS, RAW_BORDER_PROFILES, RandBandPad,
                                   RandBandPadd, build_transforms, make_site_dataset)
from hfl_components.flare.site_config import AUGMENTS, SiteConfigError, load_site_config
from hfl_components.models.fusable import apply_frame_mask


def _png(path, h=40, w=56, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((h, w)) * 150 + 50).astype(np.uint8), mode="L").save(path)
    return str(path)


def _force(monkeypatch, fraction, prob=1.0):
    monkeypatch.setitem(RAW_BORDER_PROFILES, AUGMENT_ZOOM_OUT,
                        dict(RAW_BORDER_PROFILES[AUGMENT_ZOOM_OUT], prob=prob, fraction_range=(fraction, fraction)))


@pytest.mark.parametrize("aspect", ["crop", "stretch"])
@pytest.mark.parametrize("fraction", [0.03, 0.06])
def test_a_forced_zoom_out_is_the_probes_black_framed_image(tmp_path, monkeypatch, aspect, fraction):
    f = _png(tmp_path / "a.png")
    _force(monkeypatch, fraction)
    train = build_transforms(24, "train", augment_classes=[], aspect=aspect, border_augment=AUGMENT_ZOOM_OUT)
    probe = build_transforms(24, "eval", aspect=aspect, raw_band=(fraction, 0.0))  # the probe's black band
    plain = build_transforms(24, "eval", aspect=aspect)
    item = {"image": f, "label": 1}
    got, want = train(dict(item))["image"], probe(dict(item))["image"]
    assert torch.equal(got, want)
    assert not torch.allclose(got, plain(dict(item))["image"], atol=1e-3)


@pytest.mark.parametrize("aspect", ["crop", "stretch"])
def test_behind_the_8_percent_mask_and_inner_rescale_it_is_the_probes_grey_and_white_image_too(tmp_path, monkeypatch,
                                                                                              aspect):
    # the model spec frame_mask: 0.08, frame_rescale: true sees the same input for the probe's three colours
    f = _png(tmp_path / "a.png", h=120, w=168)
    _force(monkeypatch, 0.06)
    s = 32
    got = build_transforms(s, "train", augment_classes=[], aspect=aspect,
                           border_augment=AUGMENT_ZOOM_OUT)({"image": f, "label": 0})["image"]
    masked = apply_frame_mask(got[None], 0.08, 0.0, rescale=True)
    for v in (0.5, 1.0):
        probe = build_transforms(s, "eval", aspect=aspect, raw_band=(0.06, v))({"image": f, "label": 0})["image"]
        assert not torch.allclose(probe, got, atol=1e-3)  # another colour before the mask
        assert torch.allclose(apply_frame_mask(probe[None], 0.08, 0.0, rescale=True), masked, atol=1e-5)


@pytest.mark.parametrize("h,w", [(50, 70), (90, 60), (64, 64)])
@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.06])
def test_the_content_keeps_its_aspect_and_shrinks_by_one_over_one_plus_the_padding(h, w, fraction):
    rng = np.random.default_rng(3)
    x = (0.3 + 0.7 * rng.random((1, h, w))).astype(np.float32)
    r = RandBandPad(prob=1.0, fraction_range=(fraction, fraction), values=(0.0,), side_prob=0.5, image_scale=True,
                    symmetric=True).set_random_state(seed=0)
    out = r(x)
    assert out.shape == x.shape
    fill = x.min()
    rows = np.flatnonzero((out[0] != fill).any(axis=1))
    cols = np.flatnonzero((out[0] != fill).any(axis=0))
    ch, cw = rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1
    # centred: equal bands on opposite sides, every band the image's darkest level
    assert rows[0] == h - 1 - rows[-1] and cols[0] == w - 1 - cols[-1]
    assert np.all(out[0, :rows[0]] == fill) and np.all(out[0, :, :cols[0]] == fill)
    # the film, padded by p of its own size in total (p = 2f / (1 - 2f)), then resized back: ratio 1 / (1 + p)
    p = 2 * fraction / (1 - 2 * fraction)
    # each band is rounded to a whole pixel: at most one pixel of the side off in all
    assert abs(ch / h - 1 / (1 + p)) <= 1 / h + 1e-9 and abs(cw / w - 1 / (1 + p)) <= 1 / w + 1e-9
    assert abs(ch / cw - h / w) <= 2 * (h / w) / min(ch, cw)  # aspect kept to a pixel of rounding


def test_probability_zero_leaves_the_pipeline_unchanged(tmp_path, monkeypatch):
    f = _png(tmp_path / "a.png")
    monkeypatch.setitem(RAW_BORDER_PROFILES, AUGMENT_ZOOM_OUT, dict(RAW_BORDER_PROFILES[AUGMENT_ZOOM_OUT], prob=0.0))
    train = build_transforms(24, "train", augment_classes=[], aspect="crop", border_augment=AUGMENT_ZOOM_OUT)
    plain = build_transforms(24, "eval", aspect="crop")
    for label in (0, 1):
        assert torch.equal(train({"image": f, "label": label})["image"], plain({"image": f, "label": label})["image"])


def test_every_class_is_zoomed_out_before_scaling_at_its_probability(tmp_path):
    assert AUGMENT_ZOOM_OUT in AUGMENTS and AUGMENT_ZOOM_OUT in BORDER_AUGMENTS
    tf = build_transforms(24, "train", augment_classes=[], aspect="crop", border_augment=AUGMENT_ZOOM_OUT)
    pads = [i for i, t in enumerate(tf.transforms) if isinstance(t, RandBandPadd)]
    scale = [i for i, t in enumerate(tf.transforms) if type(t).__name__ == "ScaleIntensityd"]
    assert len(pads) == 1 and pads[0] < scale[0]
    pad = tf.transforms[pads[0]].padder
    assert pad.symmetric and pad.image_scale and pad.values == (0.0,)
    assert pad.prob == pytest.approx(0.8) and pad.fraction_range == (0.0, 0.06)
    assert not any(isinstance(t, RandBandPadd) for t in build_transforms(24, "eval", border_augment=AUGMENT_ZOOM_OUT)
                   .transforms)  # eval mode: no augmentation
    f = _png(tmp_path / "a.png", h=200, w=280)  # a share below 1/400 of a side rounds to no band: 4 % of draws
    plain = build_transforms(24, "eval", aspect="crop")({"image": f, "label": 0})["image"]
    tf.set_random_state(seed=5)
    for label in (0, 1):
        n = 60
        changed = sum(not torch.equal(tf({"image": f, "label": label})["image"], plain) for _ in range(n))
        assert 0.6 * n <= changed <= 0.95 * n  # about 0.8 x 0.96 (binomial sd 0.055), whatever the class


def test_a_bad_augment_value_is_refused_naming_the_site_config_file(tmp_path):
    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    f = tmp_path / "hospital-z.yaml"
    f.write_text(yaml.safe_dump({**base, "augment": "zoom_in"}))
    with pytest.raises(SiteConfigError) as e:
        load_site_config("hospital-z", f, check_files=False)
    assert str(f) in str(e.value) and "'augment'" in str(e.value) and "zoom_out" in str(e.value)
    f.write_text(yaml.safe_dump({**base, "augment": "zoom_out", "fast_augment": True}))
    with pytest.raises(SiteConfigError, match="zoom_out has no effect with fast_augment") as e:
        load_site_config("hospital-z", f, check_files=False)
    assert str(f) in str(e.value)
    f.write_text(yaml.safe_dump({**base, "augment": "zoom_out"}))
    assert load_site_config("hospital-z", f, check_files=False)["augment"] == "zoom_out"


def test_a_disk_cache_of_the_decoded_images_has_its_own_folder(tmp_path):
    # the disk cache is keyed by path and label only: a squared 16 x 16 image cached by the eval pipeline must never
    # be read back as the decoded image that the zoom-out frames
    rows = [{"path": _png(tmp_path / f"i{k}.png", seed=k), "label": k % 2} for k in range(2)]
    make_site_dataset(rows, 16, "eval", [], cache_dir=tmp_path / "c", aspect="crop")[0]
    ds = make_site_dataset(rows, 16, "train", [], cache_dir=tmp_path / "c", aspect="crop",
                           border_augment=AUGMENT_ZOOM_OUT, seed=0)
    assert ds[0]["image"].shape == (1, 16, 16)
    assert {d.name for d in (tmp_path / "c").iterdir()} == {"s16-crop-zoom_out", "s16-crop"}


def test_a_site_with_augment_zoom_out_trains_on_it_and_evaluates_without_it(tmp_path):
    import csv

    from hfl_components.flare.site_tasks import SiteRuntime

    man = tmp_path / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k in range(4):
            w.writerow([_png(tmp_path / f"img{k}.png", seed=k), k % 2, "train", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 16, "batch_size": 4, "augment_classes": [],
           "augment": "zoom_out", "aspect": "crop", "data": {"labels": "binary", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 2}}
    rt = SiteRuntime(cfg, tmp_path / "ws")

    def pads(loader):
        return [t.padder for t in loader.dataset.transform.transforms if isinstance(t, RandBandPadd)]
    assert [p.symmetric for p in pads(rt.loader("train"))] == [True]
    assert pads(rt.loader("train", train_mode=False)) == []
