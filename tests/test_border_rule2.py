"""Second border rule's arms: dense border augmentation (augment: border_dense) and the model's input frame mask
(fusable model spec ``frame_mask``). Hand cases and invariances; no data, no simulator."""
import numpy as np
import pytest
import torch

from chest_xray.transforms import (AUGMENT_BORDER_DENSE, BORDER_PROFILES, RandBandPad, RandBandPadd, add_bands,
                                   build_transforms)
from hfl_components.flare.site_config import AUGMENTS
from hfl_components.models.fusable import apply_frame_mask, build_fusable, frame_mask_width, resolve_fusable_spec
from hfl_components.models.registry import build_model


def test_frame_mask_width_hand_cases():
    assert frame_mask_width(64, 0.08) == 6  # 5.12 -> 6: covers a 6 % band rounded up (3.84 -> 4 px)
    assert frame_mask_width(96, 0.08) == 8  # 7.68 -> 8
    assert frame_mask_width(128, 0.08) == 11  # 10.24 -> 11
    assert frame_mask_width(100, 0.08) == 8  # exact product: no extra pixel
    assert frame_mask_width(64, 0.0) == 0


def test_band_within_mask_leaves_masked_input_unchanged_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 1, 64, 64, generator=g)
    m = frame_mask_width(64, 0.08)
    for value in (0.0, 0.5, 1.0, 0.37):
        banded = x.clone()  # overwrite bands of every width up to the mask's, on all four sides
        for w in range(1, m + 1):
            b = banded.clone()
            b[..., :w, :] = value
            b[..., -w:, :] = value
            b[..., :, :w] = value
            b[..., :, -w:] = value
            assert torch.equal(apply_frame_mask(b, 0.08, 0.5), apply_frame_mask(x, 0.08, 0.5))
    # the inner region is untouched, the frame is the constant
    y = apply_frame_mask(x, 0.08, 0.5)
    assert torch.equal(y[..., m:-m, m:-m], x[..., m:-m, m:-m])
    assert bool((y[..., :m, :] == 0.5).all()) and bool((y[..., :, -m:] == 0.5).all())


def test_band_wider_than_mask_reaches_the_model():
    x = torch.rand(2, 1, 64, 64, generator=torch.Generator().manual_seed(1))
    b = x.clone()
    b[..., :10, :] = 1.0
    assert not torch.equal(apply_frame_mask(b, 0.08, 0.5), apply_frame_mask(x, 0.08, 0.5))


def test_masked_model_ignores_the_frame_and_keeps_the_state_dict():
    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "num_classes": 2}
    torch.manual_seed(0)
    plain = build_fusable(spec)
    masked = build_model({**spec, "frame_mask": 0.08})
    assert set(plain.state_dict()) == set(masked.state_dict())  # no weights: fusion and FedAvg see the same keys
    for p in masked.parameters():  # nonzero class layer, so outputs depend on the input
        torch.nn.init.normal_(p, std=0.1)
    masked.eval()
    x = torch.rand(4, 1, 64, 64, generator=torch.Generator().manual_seed(2))
    b = x.clone()
    b[..., :6, :] = 1.0
    b[..., :, -6:] = 0.0
    with torch.no_grad():
        assert torch.equal(masked(b), masked(x))
        plain.load_state_dict(masked.state_dict())
        plain.eval()
        assert not torch.allclose(plain(b), plain(x))  # the same weights without the mask read the frame


def test_frame_mask_spec_is_checked_and_round_trips():
    spec = {"family": "cnn", "frame_mask": 0.08}
    assert resolve_fusable_spec(spec)["frame_mask"] == 0.08
    assert "frame_mask" not in resolve_fusable_spec({"family": "cnn"})  # unmasked specs resolve as before
    for bad in (-0.1, 0.5, "0.1", True):
        with pytest.raises(ValueError, match="frame_mask"):
            resolve_fusable_spec({"family": "cnn", "frame_mask": bad})


def test_dense_profile_is_a_site_config_value_and_frames_every_class():
    assert AUGMENT_BORDER_DENSE in AUGMENTS and AUGMENT_BORDER_DENSE in BORDER_PROFILES
    tf = build_transforms(16, "train", augment_classes=[], border_augment=AUGMENT_BORDER_DENSE)
    pad = [t for t in tf.transforms if isinstance(t, RandBandPadd)]
    assert len(pad) == 1 and pad[0].padder.prob == pytest.approx(0.8)
    with pytest.raises(ValueError, match="border_augment"):
        build_transforms(16, "train", border_augment="thick")


def test_dense_draws_frame_most_images_on_all_sides_with_any_grey():
    r = RandBandPad(**BORDER_PROFILES[AUGMENT_BORDER_DENSE]).set_random_state(seed=0)
    n, framed, four, values, widest = 4000, 0, 0, [], 0.0
    for _ in range(n):
        r.randomize(None, (1, 100, 100))
        if r.params is None:
            continue
        framed += 1
        w = r.params["widths"]
        four += all(v > 0 for v in w)
        widest = max(widest, max(w) / 100)
        values.append(r.params["value"])
    assert abs(framed / n - 0.8) < 0.03  # binomial sd 0.006
    assert abs(four / framed - 0.75 ** 4) < 0.04  # four sides, each with probability 0.75
    vals = np.array(values)
    share_fixed = np.isin(vals, [0.0, 0.5, 1.0]).mean()
    assert abs(share_fixed - 0.75) < 0.04  # one draw in four is any grey
    assert 0.17 < widest <= 0.20


def test_border_profile_draws_are_unchanged_by_the_new_arguments():
    a = RandBandPad().set_random_state(seed=3)
    b = RandBandPad(**BORDER_PROFILES["border"]).set_random_state(seed=3)
    for _ in range(200):
        a.randomize(None, (1, 50, 60))
        b.randomize(None, (1, 50, 60))
        assert a.params == b.params


def test_dense_augmentation_independent_of_label():
    x = torch.rand(1, 32, 32, generator=torch.Generator().manual_seed(4))
    outs = {}
    for label in (0, 1):
        t = RandBandPadd(keys="image", **BORDER_PROFILES[AUGMENT_BORDER_DENSE]).set_random_state(seed=7)
        outs[label] = [t({"image": x, "label": label})["image"] for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert sum(not torch.equal(o, x) for o in outs[0]) >= 10  # most are framed
    assert torch.equal(add_bands(x, (0, 0, 0, 0), 1.0), add_bands(x, (0, 0, 0, 0), 0.0))


def test_write_profile_puts_frame_mask_into_every_model_spec(tmp_path):
    import yaml

    from hfl_components.flare.site_config import load_site_config
    from nvflare_jobs.profiles import write_profile

    (tmp_path / "part" / "sites").mkdir(parents=True)
    for i in (1, 2):
        (tmp_path / "part" / "sites" / f"site-{i}.csv").write_text("path,label,split\n")
    out = write_profile(tmp_path / "part", tmp_path / "cfg", "ohfl", "binary", [64, 96],
                        {"frame_mask": 0.08, "frame_rescale": True, "augment": "border_dense", "aspect": "crop",
                         "feature_dim": 64})
    for i in (1, 2):
        raw = yaml.safe_load((out / f"site-{i}.yaml").read_text())
        assert raw["model"]["frame_mask"] == 0.08 and raw["augment"] == "border_dense" and "frame_mask" not in raw
        cfg = load_site_config(f"site-{i}", out / f"site-{i}.yaml", require_data=False)
        assert cfg["model"]["frame_mask"] == 0.08 and cfg["model"]["frame_rescale"] is True
    plain = write_profile(tmp_path / "part", tmp_path / "cfg2", "ohfl", "binary", [64, 96], {"frame_mask": None})
    assert "frame_mask" not in yaml.safe_load((plain / "site-1.yaml").read_text())["model"]


def _summary(folder, k, rows):
    import csv

    from studies.border.measure import SUMMARY_COLUMNS

    d = folder / f"seed{k}"
    d.mkdir(parents=True, exist_ok=True)
    with (d / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for arm, within, auc, margin, own in rows:
            w.writerow({"arm": arm, "seed": k, "n_models": 6, "n_within": 6 if within else 0, "all_within": within,
                        "worst_change": 0.01, "mean_tuning_auc": auc, "metadata_auc": auc - margin, "margin": margin,
                        "own_test_auc": own, "own_test_bal_acc": 0.9, "own_test_n": 87, "aspect_abs_dp_own_test": 0})


def test_rule2_staged_decision_hand_cases(tmp_path):
    from studies.border.rule2 import decide

    first, res = tmp_path / "first", tmp_path / "res"
    for k in (0, 1, 2):
        _summary(first, k, [("default", False, 0.955, 0.115, 0.97)])
    # mask_crop: (a)(b)(c) at seeds 0-2; dense_crop: fails (a) at seed 0 and stops
    _summary(res, 0, [("mask_crop", True, 0.950, 0.125, 0.960), ("dense_crop", False, 0.96, 0.13, 0.97)])
    d = decide(res, first)
    assert d["status"]["dense_crop"] == "stopped: fails at seed 0"
    assert d["status"]["mask_crop"] == "open: seeds 1,2 not run" and d["chosen"] is None
    _summary(res, 1, [("mask_crop", True, 0.950, 0.121, 0.962)])
    _summary(res, 2, [("mask_crop", True, 0.944, 0.121, 0.964)])  # 0.944 < 0.955 - 0.01: (b) fails at seed 2
    d = decide(res, first)
    assert d["status"]["mask_crop"] == "stopped: fails at seed 2" and d["chosen"] is None
    _summary(res, 2, [("mask_crop", True, 0.946, 0.121, 0.964)])
    d = decide(res, first)
    assert d["eligible"] == ["mask_crop"] and d["chosen"] == "mask_crop"
    assert abs(d["own_test_auc_mean"]["mask_crop"] - (0.960 + 0.962 + 0.964) / 3) < 1e-12


def test_frame_rescale_makes_the_inner_input_independent_of_the_band_colour():
    # a whole-image min-max (the pipeline's ScaleIntensity) after a white band darkens the film; the model's inner
    # rescaling undoes any affine change of the inner region, so black / grey / white bands give the same input
    g = torch.Generator().manual_seed(5)
    film = 0.2 + 0.6 * torch.rand(2, 1, 64, 64, generator=g)  # content in [0.2, 0.8]
    outs = []
    for value in (0.0, 0.5, 1.0):
        b = film.clone()
        for sl in ((..., slice(0, 4), slice(None)), (..., slice(-4, None), slice(None)),
                   (..., slice(None), slice(0, 4)), (..., slice(None), slice(-4, None))):
            b[sl] = value
        lo, hi = b.amin(dim=(-2, -1), keepdim=True), b.amax(dim=(-2, -1), keepdim=True)
        scaled = (b - lo) / (hi - lo)  # ScaleIntensity over the whole framed image
        outs.append(scaled)
    dark = [float(o[..., 6:-6, 6:-6].mean()) for o in outs]
    outs = [apply_frame_mask(o, 0.08, 0.5, rescale=True) for o in outs]
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[0], outs[2], atol=1e-6)
    m = frame_mask_width(64, 0.08)
    assert dark[2] < dark[0] - 0.05  # without the rescale, the same pixels darker after a white band's scaling
    inner = outs[0][..., m:-m, m:-m]
    assert float(inner.amin()) == 0.0 and abs(float(inner.amax()) - 1.0) < 1e-6
    assert resolve_fusable_spec({"family": "cnn", "frame_mask": 0.08, "frame_rescale": True})["frame_rescale"]
    with pytest.raises(ValueError, match="frame_rescale"):
        resolve_fusable_spec({"family": "cnn", "frame_rescale": True})  # only with a mask


def test_compare_command_line_passes_the_frame_options(tmp_path):
    from nvflare_jobs.cli import build_parser
    from nvflare_jobs.compare import CompareOptions

    def opts(*extra):
        return CompareOptions.from_mapping(vars(build_parser().parse_args(
            ["compare", "--out", str(tmp_path / "c"), "--augment", "border_dense", *extra])))

    a = opts("--frame-mask", "0.08", "--frame-rescale")
    assert (a.frame_mask, a.frame_rescale, a.augment) == (0.08, True, "border_dense")
    b = opts()
    assert (b.frame_mask, b.frame_rescale) == (None, False)  # defaults: no mask
