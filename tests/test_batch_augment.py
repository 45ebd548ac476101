"""Batch-level augmentation (chest_xray.batch_augment): exact geometry on small tensors, parameter ranges
as the per-image MONAI transforms', determinism, class selection, channel counts and float16."""
import math

import pytest
import torch

from chest_xray.batch_augment import (BatchAugmentCollate, CachedTensorDataset, affine_theta, apply_affine,
                                      batch_augment, sample_augment_params)
from chest_xray.transforms import MAX_ROTATION_DEG, MAX_TRANSLATE_FRACTION


def _params(n, flip=False, affine=False, angle=0.0, shift=(0.0, 0.0)):
    return {"flip": torch.full((n,), flip), "affine": torch.full((n,), affine),
            "angle": torch.full((n,), float(angle), dtype=torch.float64),
            "shift": torch.tensor([shift] * n, dtype=torch.float64)}


def _shifted(x, dy, dx):
    """roll with zero fill: the independent reference of an integer translation."""
    y = torch.roll(x, shifts=(dy, dx), dims=(-2, -1))
    if dy > 0:
        y[..., :dy, :] = 0
    elif dy < 0:
        y[..., dy:, :] = 0
    if dx > 0:
        y[..., :, :dx] = 0
    elif dx < 0:
        y[..., :, dx:] = 0
    return y


def test_identity_parameters_give_the_input_exactly():
    x = torch.rand(3, 1, 7, 7)
    theta = affine_theta(torch.zeros(3), torch.zeros(3, 2), 7, 7)
    assert torch.allclose(apply_affine(x, theta), x, atol=1e-6)  # grid_sample itself: exact to float rounding
    # an affine with zero angle and shift (drawn affine, no change) is exact too, and no affine copies exactly
    assert torch.equal(batch_augment(x, params=_params(3, affine=True)), x)
    assert torch.equal(batch_augment(x, params=_params(3)), x)


@pytest.mark.parametrize("k", [1, 2, -1])
def test_quarter_and_half_turns_match_rot90(k):
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).reshape(2, 3, 6, 6)
    out = batch_augment(x, params=_params(2, affine=True, angle=k * math.pi / 2))
    assert torch.allclose(out, torch.rot90(x, k, dims=(-2, -1)), atol=1e-4)


@pytest.mark.parametrize("dy,dx", [(1, 0), (0, 2), (-2, 1), (3, -3)])
def test_integer_translation_matches_roll_with_zero_fill(dy, dx):
    x = torch.rand(2, 1, 8, 8) + 1.0  # no zeros inside, so the fill is visible
    out = batch_augment(x, params=_params(2, affine=True, shift=(dy, dx)))
    assert torch.allclose(out, _shifted(x, dy, dx), atol=1e-5)


def test_translation_on_a_non_square_image():
    x = torch.rand(1, 1, 6, 10) + 1.0
    out = batch_augment(x, params=_params(1, affine=True, shift=(2, -3)))
    assert torch.allclose(out, _shifted(x, 2, -3), atol=1e-5)


def test_flip_is_index_reversal():
    x = torch.rand(4, 3, 5, 5)
    assert torch.equal(batch_augment(x, params=_params(4, flip=True)), x.flip(-1))


def test_parameter_ranges_match_the_per_image_transform():
    s = 128
    p = sample_augment_params(20000, s, s, generator=torch.Generator().manual_seed(0))
    max_rot = math.radians(MAX_ROTATION_DEG)
    max_shift = MAX_TRANSLATE_FRACTION * s  # 7.68 px, as RandAffined's translate_range=(0.06 S, 0.06 S)
    a, t = p["angle"][p["affine"]], p["shift"][p["affine"]]
    assert a.abs().max() <= max_rot and a.abs().max() > 0.99 * max_rot
    assert t.abs().max() <= max_shift and t.abs().max() > 0.99 * max_shift
    # uniform: mean |angle| = r/2, mean |shift| = m/2 (standard errors ~0.3 %)
    assert abs(a.abs().mean() / max_rot - 0.5) < 0.02 and abs(t.abs().mean() / max_shift - 0.5) < 0.02
    assert abs((~p["affine"]).double().mean() - 0.2) < 0.015  # p(no affine) = 1 - 0.8
    assert abs(p["flip"].double().mean() - 0.5) < 0.015
    assert torch.all(p["angle"][~p["affine"]] == 0) and torch.all(p["shift"][~p["affine"]] == 0)


def test_deterministic_under_a_seed_and_varies_otherwise():
    x = torch.rand(8, 1, 16, 16)
    torch.manual_seed(3)
    a = batch_augment(x)
    torch.manual_seed(3)
    b = batch_augment(x)
    c = batch_augment(x)
    assert torch.equal(a, b) and not torch.equal(b, c)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(batch_augment(x, generator=g1), batch_augment(x, generator=g2))


def test_only_the_augment_classes_change():
    x = torch.rand(16, 1, 12, 12)
    y = torch.tensor([0, 1] * 8)
    out = batch_augment(x, y, augment_classes=[0], params=_params(16, flip=True, affine=True, angle=0.1))
    assert torch.equal(out[1::2], x[1::2])
    assert not torch.allclose(out[0::2], x[0::2])
    with pytest.raises(ValueError, match="labels"):
        batch_augment(x, None, augment_classes=[0])
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        batch_augment(x[0])


def test_three_channels_and_float16():
    x = torch.rand(4, 3, 10, 10)
    p = sample_augment_params(4, 10, 10, generator=torch.Generator().manual_seed(1))
    out32 = batch_augment(x, params=p)
    out16 = batch_augment(x.half(), params=p)
    assert out16.dtype == torch.float16 and out16.shape == x.shape
    assert torch.allclose(out16.float(), out32, atol=2e-3)
    # a grey image copied to 3 channels stays grey: the channels share one grid
    g = torch.rand(2, 1, 10, 10).expand(2, 3, 10, 10).contiguous()
    o = batch_augment(g, params=sample_augment_params(2, 10, 10, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(o[:, 0], o[:, 1]) and torch.equal(o[:, 0], o[:, 2])


def test_collate_in_a_dataloader():
    imgs = torch.rand(10, 1, 8, 8)
    ds = CachedTensorDataset(imgs, [0, 1] * 5)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=BatchAugmentCollate(augment_classes=[]))
    batches = list(loader)
    assert [b["image"].shape[0] for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b["image"] for b in batches]), imgs)  # no class augmented -> exact copy
    assert torch.equal(torch.cat([b["label"] for b in batches]), torch.tensor([0, 1] * 5))
    torch.manual_seed(0)
    aug = next(iter(torch.utils.data.DataLoader(ds, batch_size=10, collate_fn=BatchAugmentCollate([1]))))
    assert torch.equal(aug["image"][0::2], imgs[0::2]) and not torch.equal(aug["image"][1::2], imgs[1::2])
    with pytest.raises(ValueError, match="3 labels"):
        CachedTensorDataset(imgs, [0, 1, 0])


def test_site_config_augment_key_default_and_errors(tmp_path):
    import yaml

    from hfl_components.flare.site_config import SiteConfigError, load_site_config, validate_site_config

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    assert validate_site_config(dict(base), "s", check_files=False)["augment"] == "monai"
    assert validate_site_config({**base, "augment": "monai"}, "s", check_files=False)["augment"] == "monai"
    f = tmp_path / "hospital-a.yaml"
    f.write_text(yaml.safe_dump({**base, "augment": "gpu"}))
    with pytest.raises(SiteConfigError) as e:
        load_site_config("hospital-a", f, check_files=False)
    assert str(f) in str(e.value) and "'augment'" in str(e.value) and "monai, batch" in str(e.value)


@pytest.mark.parametrize("augment", ["batch", "monai"])
def test_site_train_loader_per_augment_key(tmp_path, augment):
    """Both implementations serve the train split; with no class augmented both equal the eval-mode images."""
    import csv

    import numpy as np
    from PIL import Image

    from hfl_components.flare.site_tasks import SiteRuntime

    rng = np.random.default_rng(0)
    man = tmp_path / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k in range(6):
            f = tmp_path / f"img{k}.png"
            Image.fromarray((rng.random((40, 50)) * 150 + 60).astype(np.uint8)).save(f)
            w.writerow([str(f), k % 2, "train", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 16, "batch_size": 6, "augment_classes": [],
           "augment": augment, "data": {"labels": "binary", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 2}}
    rt = SiteRuntime(cfg, tmp_path / "ws")
    train, ev = rt.loader("train"), rt.loader("train", train_mode=False)
    assert isinstance(train.dataset, CachedTensorDataset) == (augment == "batch")
    xt = next(iter(train))
    xe = next(iter(ev))
    order_t, order_e = xt["label"].argsort(stable=True), xe["label"].argsort(stable=True)
    assert tuple(xt["image"].shape) == (6, 1, 16, 16)
    assert torch.equal(torch.sort(xt["image"].flatten(1).sum(1)).values, torch.sort(xe["image"].flatten(1).sum(1)).values)
    assert torch.equal(xt["label"][order_t], xe["label"][order_e])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_equals_cpu_for_the_same_parameters():
    x = torch.rand(6, 1, 20, 20)
    p = sample_augment_params(6, 20, 20, generator=torch.Generator().manual_seed(4))
    out = batch_augment(x.cuda(), params=p)
    assert out.device.type == "cuda"
    assert torch.allclose(out.cpu(), batch_augment(x, params=p), atol=1e-5)
    assert batch_augment(x.cuda().half(), params=p).dtype == torch.float16


def test_site_config_refuses_augment_monai_with_fast_augment(tmp_path):
    """fast_augment: true trains on cached tensors (flip + shift), so an explicit augment: monai would be ignored
    without a word; the config is refused naming the file and the key. fast_augment with the default augment (or an
    explicit batch) stays valid: the prototype methods' profiles write fast_augment: true."""
    import yaml

    from hfl_components.flare.site_config import SiteConfigError, load_site_config, validate_site_config

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}, "fast_augment": True}
    assert validate_site_config(dict(base), "s", check_files=False)["augment"] == "monai"
    assert validate_site_config({**base, "augment": "batch"}, "s", check_files=False)["fast_augment"] is True
    f = tmp_path / "hospital-b.yaml"
    f.write_text(yaml.safe_dump({**base, "augment": "monai"}))
    with pytest.raises(SiteConfigError) as e:
        load_site_config("hospital-b", f, check_files=False)
    msg = str(e.value)
    assert str(f) in msg and "'augment'" in msg and "fast_augment: false" in msg and "\n" not in msg


def test_site_config_augment_border_frames_training_images_only(tmp_path):
    """augment: border is accepted, refused with fast_augment (the tensor path would drop it), and reaches the site
    dataset: with no class flipped or shifted (augment_classes []), the train split differs from the eval-mode
    images only by bands, and some of 12 images (each framed with probability BORDER_PROB) are framed; the eval
    loader of the same split is never framed."""
    import csv

    import numpy as np
    import yaml
    from PIL import Image

    from chest_xray.transforms import AUGMENT_BORDER
    from hfl_components.flare.site_config import SiteConfigError, load_site_config, validate_site_config
    from hfl_components.flare.site_tasks import SiteRuntime

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    assert validate_site_config({**base, "augment": AUGMENT_BORDER}, "s", check_files=False)["augment"] == "border"
    f = tmp_path / "hospital-c.yaml"
    f.write_text(yaml.safe_dump({**base, "augment": "border", "fast_augment": True}))
    with pytest.raises(SiteConfigError, match="border has no effect with fast_augment"):
        load_site_config("hospital-c", f, check_files=False)

    rng = np.random.default_rng(1)
    man = tmp_path / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k in range(12):
            img = tmp_path / f"img{k}.png"
            Image.fromarray((rng.random((40, 40)) * 100 + 80).astype(np.uint8)).save(img)
            w.writerow([str(img), k % 2, "train", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 16, "batch_size": 12, "augment_classes": [],
           "augment": "border", "data": {"labels": "binary", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 2}}
    rt = SiteRuntime(cfg, tmp_path / "ws")
    eval_imgs = torch.cat([b["image"] for b in rt.loader("train", train_mode=False)])
    framed = 0
    for _ in range(3):  # three epochs: 36 draws at probability 0.5
        xt = next(iter(rt.loader("train")))["image"]
        # a band is a constant run along an edge: an unframed image equals an eval image exactly
        same = [(xt[i:i + 1] == eval_imgs).flatten(1).all(1).any().item() for i in range(len(xt))]
        framed += sum(not s for s in same)
    assert framed > 0
    # the eval-mode loader never frames: two passes give identical images
    again = torch.cat([b["image"] for b in rt.loader("train", train_mode=False)])
    assert torch.equal(again, eval_imgs)
