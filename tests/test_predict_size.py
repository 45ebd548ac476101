"""The input size ``cxr-hfl predict`` scores a model at: a site's model at the size its file records; a global model
(which records none) at ``--size`` or else the largest input size of its run's sites, never a silent fixed size; the
size used and why is in the output line. Probabilities are checked against the model run here at that size."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nvflare_jobs.cli import main

SPEC = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}


def _model(path: Path, size: int | None) -> Path:
    """A model file whose classifier has random weights (an untrained one starts at zero: p = 0.5 for any input)."""
    from hfl_components.models import build_model, save_model_file

    torch.manual_seed(0)
    m = build_model(SPEC)
    with torch.no_grad():
        torch.nn.init.normal_(m.classifier.weight, std=0.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model_file(path, SPEC, m.state_dict(), input_size=size, labels="binary",
                    kind="global" if size is None else "deployed", site=None if size is None else "site-1")
    return path


@pytest.fixture()
def case(tmp_path, data_root):
    """A run folder whose sites trained at 32 and 48 px with its global model, a site model, two real images."""
    run = tmp_path / "run"
    (run / "resolved_configs").mkdir(parents=True)
    for site, size in (("site-1", 32), ("site-2", 48)):
        (run / "resolved_configs" / f"{site}.json").write_text(json.dumps({"input_size": size, "model": SPEC}))
    imgs = tmp_path / "in"
    imgs.mkdir()
    for f in sorted((data_root / "chest_xray_224" / "train" / "PNEUMONIA").glob("*.jpeg"))[:2]:
        shutil.copy(f, imgs / f.name)
    return {"global": _model(run / "global_model.pt", None), "site": _model(run / "models" / "site-1_deployed.pt", 32),
            "imgs": imgs, "tmp": tmp_path}


def _probs_at(model_file: Path, imgs: Path, size: int) -> dict[str, float]:
    from chest_xray import build_transforms
    from hfl_components.models import load_model_file

    model, _ = load_model_file(model_file)
    tf = build_transforms(size, "eval", aspect="stretch")
    out = {}
    for f in sorted(imgs.iterdir()):
        with torch.no_grad():
            out[f.name] = float(torch.softmax(model(tf({"image": str(f), "label": 0})["image"][None]), 1)[0, 1])
    return out


def _predict(capsys, model: Path, imgs: Path, out: Path, *extra: str) -> tuple[int, str, str, dict]:
    rc = main(["predict", "--model", str(model), "--data", str(imgs), "--out", str(out), *extra])
    o, e = capsys.readouterr()
    rows = {Path(r["path"]).name: float(r["p_PNEUMONIA"]) for r in csv.DictReader(out.open())} if rc == 0 else {}
    return rc, o, e, rows


def test_global_model_is_scored_at_its_runs_largest_size_or_at_size(case, capsys):
    g, imgs, tmp = case["global"], case["imgs"], case["tmp"]
    at = {s: _probs_at(g, imgs, s) for s in (32, 48, 64)}
    assert not np.allclose(list(at[48].values()), list(at[64].values()))  # the size matters for this model
    rc, out, _, rows = _predict(capsys, g, imgs, tmp / "a.csv")
    assert rc == 0 and "2 of 2 files predicted at 48 px (global model: the largest input size of its run's sites " \
                      "(32, 48 px);" in out
    assert rows == pytest.approx(at[48], abs=1e-4)
    rc, out, _, rows = _predict(capsys, g, imgs, tmp / "b.csv", "--size", "32")
    assert rc == 0 and "predicted at 32 px (--size;" in out and rows == pytest.approx(at[32], abs=1e-4)


def test_site_model_keeps_its_own_size_and_a_lone_global_model_needs_size(case, capsys):
    site, imgs, tmp = case["site"], case["imgs"], case["tmp"]
    rc, out, _, rows = _predict(capsys, site, imgs, tmp / "a.csv")
    assert rc == 0 and "predicted at 32 px (the size the model file records;" in out
    assert rows == pytest.approx(_probs_at(site, imgs, 32), abs=1e-4)
    rc, _, err, _ = _predict(capsys, site, imgs, tmp / "b.csv", "--size", "48")
    assert rc == 2 and err.strip() == (f"cxr-hfl predict: --size 48: {site} was trained at 32 px (its file records "
                                       "it); --size is for a global model, which has no input size of its own")
    lone = tmp / "elsewhere" / "global_model.pt"
    lone.parent.mkdir()
    shutil.copy(case["global"], lone)
    rc, _, err, _ = _predict(capsys, lone, imgs, tmp / "c.csv")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(lone) in err and "give --size" in err
    assert not (tmp / "b.csv").exists() and not (tmp / "c.csv").exists()
    with pytest.raises(SystemExit) as e:
        main(["predict", "--model", str(lone), "--data", str(imgs), "--out", str(tmp / "d.csv"), "--size", "8"])
    assert e.value.code == 2 and "at least 16 px" in capsys.readouterr().err


@pytest.fixture()
def mixed(tmp_path, case):
    """A mixed-family OHFL run folder: cnn sites at 32 px, densenet at 48, resnet at 64; one global model per group
    (``global_models/<group>.pt`` + ``groups.json``), as the OHFL controller writes them."""
    run = tmp_path / "mixed"
    (run / "resolved_configs").mkdir(parents=True)
    groups = {"cnn": ["site-1", "site-2"], "densenet": ["site-3", "site-4"], "resnet": ["site-5", "site-6"]}
    for g, size in (("cnn", 32), ("densenet", 48), ("resnet", 64)):
        for s in groups[g]:
            (run / "resolved_configs" / f"{s}.json").write_text(json.dumps({"input_size": size}))
    (run / "global_models").mkdir()
    (run / "global_models" / "groups.json").write_text(json.dumps({g: {"sites": v} for g, v in groups.items()}))
    for name in ("cnn", "cnn_fused"):
        shutil.copy(case["global"], run / "global_models" / f"{name}.pt")
    return run


def test_a_groups_global_model_is_scored_at_its_own_groups_largest_size(mixed, case, capsys):
    imgs, tmp = case["imgs"], case["tmp"]
    at32 = _probs_at(mixed / "global_models" / "cnn.pt", imgs, 32)
    assert not np.allclose(list(at32.values()), list(_probs_at(case["global"], imgs, 64).values()))
    for name in ("cnn", "cnn_fused"):
        rc, out, _, rows = _predict(capsys, mixed / "global_models" / f"{name}.pt", imgs, tmp / f"{name}.csv")
        assert rc == 0 and "predicted at 32 px (global model: the largest input size of the cnn group's sites " \
                          "site-1, site-2 (32 px);" in out, out
        assert rows == pytest.approx(at32, abs=1e-4)


def test_size_a_global_models_sites_never_trained_at_is_refused(mixed, case, capsys):
    imgs, tmp = case["imgs"], case["tmp"]
    rc, _, err, _ = _predict(capsys, case["global"], imgs, tmp / "a.csv", "--size", "5000")
    assert rc == 2 and err.strip() == (f"cxr-hfl predict: --size 5000: {case['global']} serves sites that trained at "
                                       "32, 48 px (its run's sites); give one of these")
    g = mixed / "global_models" / "cnn.pt"
    rc, _, err, _ = _predict(capsys, g, imgs, tmp / "b.csv", "--size", "48")  # densenet's size, not cnn's
    assert rc == 2 and err.strip() == (f"cxr-hfl predict: --size 48: {g} serves sites that trained at 32 px (the cnn "
                                       "group's sites site-1, site-2); give one of these")
    assert not (tmp / "a.csv").exists() and not (tmp / "b.csv").exists()
