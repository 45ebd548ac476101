"""The square-resize choice (``aspect``: stretch by default, letterbox, crop) is one
site-config key, and the site's loaders, the server's probe and ``evaluate``'s image cache all use the same default.

Letterboxing ``chest_xray_original`` (longer side -> S, zero padding) gives pneumonia images more padding than normal
ones (they are narrower), so site models learned the padded share as a cue; ``chest_xray_224`` is stretched and has no
padding, so the cue flipped there (zero-shot global AUC 0.30 on its tuning part)."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

torch.set_num_threads(1)


def _padded_rows_cols(img: torch.Tensor) -> tuple[int, int]:
    a = torch.as_tensor(img).reshape(img.shape[-2], img.shape[-1]).numpy()
    return int((a.max(axis=1) == 0).sum()), int((a.max(axis=0) == 0).sum())


@pytest.fixture()
def wide_pngs(tmp_path):
    """Four 40 x 100 images (rows x columns), textured, never 0 inside: letterbox to 32 px pads 32 - 13 = 19 rows."""
    rng = np.random.default_rng(0)
    files = []
    for k in range(4):
        a = (rng.random((40, 100)) * 150 + 60).astype(np.uint8)
        f = tmp_path / "imgs" / f"img{k}.png"
        f.parent.mkdir(exist_ok=True)
        Image.fromarray(a).save(f)
        files.append(f)
    return files


def test_site_config_aspect_key_default_and_errors(tmp_path):
    from hfl_components.flare.site_config import SiteConfigError, load_site_config, validate_site_config

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    assert validate_site_config(dict(base), "s", check_files=False)["aspect"] == "stretch"
    for ok in ("letterbox", "crop", "stretch"):
        assert validate_site_config({**base, "aspect": ok}, "s", check_files=False)["aspect"] == ok
    f = tmp_path / "hospital-a.yaml"
    f.write_text(yaml.safe_dump({**base, "aspect": "pad"}))
    with pytest.raises(SiteConfigError) as e:
        load_site_config("hospital-a", f, check_files=False)
    assert str(f) in str(e.value) and "'aspect'" in str(e.value) and "stretch, letterbox, crop" in str(e.value)


@pytest.mark.parametrize("aspect, pad", [(None, (0, 0)), ("stretch", (0, 0)), ("letterbox", (19, 0)), ("crop", (0, 0))])
def test_site_loader_follows_the_aspect_key(tmp_path, wide_pngs, aspect, pad):
    from hfl_components.flare.site_tasks import SiteRuntime

    man = tmp_path / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k, f in enumerate(wide_pngs):
            w.writerow([str(f), k % 2, "test", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 32, "batch_size": 4, "augment_classes": "auto",
           "data": {"labels": "binary", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 2}}
    if aspect is not None:
        cfg["aspect"] = aspect
    rt = SiteRuntime(cfg, tmp_path / "ws")
    batch = next(iter(rt.loader("test")))
    x = batch["image"]
    assert tuple(x.shape) == (4, 1, 32, 32)
    assert all(_padded_rows_cols(x[i]) == pad for i in range(4))


def test_probe_and_evaluate_use_the_sites_default(wide_pngs):
    from chest_xray import build_transforms, make_site_dataset
    from hfl_components.flare.probe import load_probe
    from nvflare_jobs.evaluation import ProbCache

    folder = wide_pngs[0].parent
    probe = load_probe(str(folder), 32, n=4)
    assert tuple(probe.shape) == (4, 1, 32, 32)
    assert all(_padded_rows_cols(probe[i]) == (0, 0) for i in range(4))
    lb = load_probe(str(folder), 32, n=4, aspect="letterbox")
    assert all(_padded_rows_cols(lb[i]) == (19, 0) for i in range(4))
    # evaluate's decoded-image cache is the sites' eval dataset at the default aspect
    rows = [{"path": str(f), "label": k % 2} for k, f in enumerate(wide_pngs)]
    xb = next(iter(ProbCache(batch_size=4).loader("ext", rows, 32)))[0]
    ref = torch.stack([build_transforms(32, "eval")({"image": str(f), "label": 0})["image"] for f in wide_pngs])
    assert torch.equal(xb, ref) and torch.equal(xb, torch.stack([make_site_dataset(rows, 32, "eval")[i]["image"]
                                                                 for i in range(4)]))
