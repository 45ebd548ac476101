"""The shortcut audit: probes on tiny models built with and without a shortcut, the metadata baseline on synthetic
facts with and without a label-predicting height, Grad-CAM's border share, and the audit of a run on real images
(JPEG and DICOM, the latter never writing a patient field)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- tiny probe models
class Rule(nn.Module):
    """A 'model' whose PNEUMONIA logit is ``fn(x)`` (N,) and NORMAL logit 0; one conv so Grad-CAM has a layer."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.conv = nn.Conv2d(1, 1, 1, bias=False)
        nn.init.ones_(self.conv.weight)

    def forward(self, x):
        z = self.fn(self.conv(x))
        return torch.stack([torch.zeros_like(z), z], dim=1)


def lesion_reader(x):
    """Reads the image's content: is there a bright blob in the centre (max of a 3x3-smoothed centre region)?"""
    c = nn.functional.avg_pool2d(x[:, :, 8:24, 8:24], 3, stride=1).amax(dim=(1, 2, 3))
    return 80 * (c - 0.9)


def _images(n: int = 120, seed: int = 0):
    """(N, 1, 32, 32) images in [0, 1]: noise 0.3-0.5, a bright laterality marker at the left edge, and for class 1
    (every other image) a bright 6 x 6 blob in the centre; labels (N,)."""
    g = torch.Generator().manual_seed(seed)
    X = 0.3 + 0.2 * torch.rand(n, 1, 32, 32, generator=g)
    X[:, :, 12:20, 1:4] = 1.0  # marker
    y = torch.arange(n) % 2
    X[y == 1, :, 13:19, 13:19] = 0.95
    return X, y


SHORTCUTS = {  # probe -> a model that reads what the probe changes
    "flip": lambda x: 40 * (x[:, :, 12:20, 1:4].mean(dim=(1, 2, 3)) - x[:, :, 12:20, -4:-1].mean(dim=(1, 2, 3)) - 0.2),
    "shift": lambda x: 40 * (torch.cat([x[:, :, -2:, :].flatten(1), x[:, :, :, -2:].flatten(1)], 1).mean(1) - 0.2),
    "contrast": lambda x: 40 * (x.mean(dim=(1, 2, 3)) - 0.47),
}


@pytest.mark.parametrize("probe", ["flip", "shift", "contrast"])
def test_each_probe_flags_a_model_with_its_shortcut_and_not_one_without(probe):
    from hfl_components.audit.probes import TOLERANCE, p_pneumonia, perturb, probe_change

    X, y = _images()
    honest, cheat = Rule(lesion_reader).eval(), Rule(SHORTCUTS[probe]).eval()
    # the honest model reads the label (so it is not trivially flat), the shortcut model is moved by the probe
    p_h = p_pneumonia(honest, X)
    assert (p_h[y.numpy() == 1] > 0.9).all() and (p_h[y.numpy() == 0] < 0.1).all()
    good = probe_change(p_h, p_pneumonia(honest, perturb(X, probe)), n_boot=300)
    bad = probe_change(p_pneumonia(cheat, X), p_pneumonia(cheat, perturb(X, probe)), n_boot=300)
    assert not good["flagged"] and abs(good["mean_change"]) < TOLERANCE, good
    assert bad["flagged"] and abs(bad["mean_change"]) > 0.2 and not bad["ci_low"] <= 0 <= bad["ci_high"], bad


def test_probe_change_is_the_mean_difference_with_a_ci_and_flags_only_beyond_the_tolerance():
    from hfl_components.audit.probes import probe_change

    p0 = np.full(200, 0.5)
    r = probe_change(p0, p0 + 0.03)  # a consistent but small move: inside the tolerance
    assert r["mean_change"] == pytest.approx(0.03) and not r["flagged"]
    r = probe_change(p0, p0 - 0.2)
    assert r["mean_change"] == pytest.approx(-0.2) and r["flagged"]
    noisy = p0 + np.where(np.arange(200) % 2, 0.4, -0.4)  # large per image, zero on average: not a shortcut
    r = probe_change(p0, noisy)
    assert abs(r["mean_change"]) < 1e-12 and r["ci_low"] < 0 < r["ci_high"] and not r["flagged"]


def test_shift_moves_content_up_left_with_a_zero_border_and_flip_mirrors():
    from hfl_components.audit.probes import SHIFT_FRACTION, perturb

    X = torch.rand(2, 1, 50, 50) + 0.5
    s = perturb(X, "shift")
    band = int(np.floor(SHIFT_FRACTION * 50))
    assert s[:, :, :, -band:].abs().max() == 0 and s[:, :, -band:, :].abs().max() == 0
    assert s[:, :, : 50 - band - 1, : 50 - band - 1].min() > 0.4
    assert torch.equal(perturb(X, "flip"), X.flip(-1))
    with pytest.raises(ValueError, match="unknown probe"):
        perturb(X, "aspect")


def _write_png(path: Path, arr: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray((np.clip(arr, 0, 1) * 255).astype(np.uint8), mode="L").save(path)


def test_aspect_probe_flags_a_model_reading_what_the_square_crop_removes(tmp_path):
    """Landscape 2:1 files with a marker near the left edge: stretched, the marker is in the model's left columns;
    cut to the centred square it is gone. A model reading that edge is flagged, the centre-blob reader is not;
    square files make the probe not applicable."""
    from nvflare_jobs.audit import _Images, probe_model

    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        a = 0.25 + 0.1 * rng.random((48, 96))
        a[18:30, 0:9] = 1.0  # marker, outside the centred 48 x 48 square
        if i % 2:
            a[14:34, 36:60] = 1.0  # the 'lesion', inside both views' centre
        _write_png(tmp_path / f"img{i}.png", a)
        rows.append({"path": str(tmp_path / f"img{i}.png"), "label": i % 2})
    imgs = _Images(rows)
    edge = Rule(lambda x: 40 * (x[:, :, 13:19, 0:2].mean(dim=(1, 2, 3)) - 0.75)).eval()
    honest = Rule(lesion_reader).eval()
    r_edge = probe_model(edge, 32, "stretch", imgs, square=False, n_boot=200)["aspect"]
    r_honest = probe_model(honest, 32, "stretch", imgs, square=False, n_boot=200)
    assert r_edge["flagged"] and r_edge["mean_change"] < -0.3 and r_edge["compared"] == "crop vs stretch"
    assert not r_honest["aspect"]["flagged"] and abs(r_honest["aspect"]["mean_change"]) < 0.05
    assert probe_model(honest, 32, "stretch", imgs, square=True, n_boot=50)["aspect"] == {
        "applicable": False, "reason": "every probed image is square"}


def test_balanced_subsample_is_seeded_and_class_balanced():
    from hfl_components.audit.probes import all_square, balanced_subsample

    y = np.array([0] * 30 + [1] * 200)
    a, b = balanced_subsample(y, 40, seed=3), balanced_subsample(y, 40, seed=3)
    assert np.array_equal(a, b) and (y[a] == 0).sum() == 20 and (y[a] == 1).sum() == 20
    assert len(balanced_subsample(y, 300)) == 30 + 150  # the small class gives all it has
    assert all_square([(224, 224), (100, 100)]) and not all_square([(224, 224), (300, 200)])


# ------------------------------------------------------------------------------------------- metadata baseline
def _facts(n: int, predictive: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    h = 1000 + rng.normal(0, 80, n) + (300 * y if predictive else 0)
    w = 1400 + rng.normal(0, 80, n)
    facts = [{"width": int(wi), "height": int(hi), "aspect": wi / hi, "area": wi * hi / 1e6, "mode": "L",
              "bit_depth": 8, "file_kb": float(rng.uniform(100, 200)), "format": "JPEG", "photometric": None,
              "manufacturer": None} for wi, hi in zip(w, h)]
    return facts, y


def test_metadata_baseline_finds_a_predictive_height_and_not_a_random_one():
    from hfl_components.audit.metadata import metadata_baseline

    facts, y = _facts(160, predictive=True)
    r = metadata_baseline(facts, y, n_boot=300)
    assert r["auc"] > 0.9 and r["ci_low"] > 0.8 and next(iter(r["fact_aucs"])) == "height"
    assert r["fact_aucs"]["height"] > 0.95
    assert set(r["not_applicable"]) == {"bit_depth", "mode", "format", "photometric", "manufacturer"}
    facts, y = _facts(160, predictive=False)
    r = metadata_baseline(facts, y, n_boot=300)
    # out-of-fold scores of a forest on noise can fall below 0.5 (it learns noise that does not generalise)
    assert r["auc"] < 0.6 and r["ci_low"] < 0.5 and r["fact_aucs"]["height"] < 0.65


def test_metadata_geometry_of_identical_images_is_reported_not_applicable():
    from hfl_components.audit.metadata import metadata_baseline

    rng = np.random.default_rng(1)
    y = np.arange(60) % 2
    facts = [{"width": 224, "height": 224, "aspect": 1.0, "area": 0.050176, "mode": "RGB", "bit_depth": 8,
              "file_kb": float(8 + 4 * yi + rng.normal(0, 1)), "format": "JPEG", "photometric": None,
              "manufacturer": None} for yi in y]
    r = metadata_baseline(facts, y, n_boot=200)
    for g in ("width", "height", "aspect", "area"):
        assert r["not_applicable"][g] == "every image is 224 x 224 px"
    assert r["features"] == ["file_kb"] and r["auc"] > 0.9  # file size alone still carries the label here


def test_auc_margin_pairs_the_model_with_the_baseline():
    from hfl_components.audit.metadata import auc_margin

    rng = np.random.default_rng(0)
    y = np.arange(200) % 2
    perfect, coin = y + 0.01 * rng.random(200), rng.random(200)
    r = auc_margin(y, perfect, coin, n_boot=300)
    assert r["model_auc"] == 1.0 and r["margin"] == pytest.approx(1.0 - r["metadata_auc"])
    assert r["beats_metadata"] and not r["covers_zero"]
    r = auc_margin(y, coin, coin, n_boot=300)
    assert r["margin"] == 0 and r["covers_zero"] and r["beats_metadata"] is False


# ------------------------------------------------------------------------------------------- saliency
def test_border_share_of_uniform_and_centred_maps():
    from hfl_components.audit.saliency import border_share, uniform_border_share

    u = np.ones((1, 40, 40))
    assert border_share(u)[0] == pytest.approx(uniform_border_share()) == pytest.approx(1 - 0.8 ** 2)
    c = np.zeros((1, 40, 40))
    c[0, 15:25, 15:25] = 1
    e = np.zeros((1, 40, 40))
    e[0, :, :2] = 1
    assert border_share(c)[0] == 0 and border_share(e)[0] == 1 and np.isnan(border_share(np.zeros((1, 8, 8))))[0]


def test_gradcam_of_a_border_reading_model_sits_in_the_border():
    """Two feature maps, one carrying the image border and one its centre (fixed masks before the last conv); a
    model reading the first has its Grad-CAM in the border band, one reading the second in the centre."""
    from hfl_components.audit.saliency import border_share, gradcam_maps

    border = torch.zeros(32, 32)
    border[:3, :], border[-3:, :], border[:, :3], border[:, -3:] = 1, 1, 1, 1
    centre = torch.zeros(32, 32)
    centre[12:20, 12:20] = 1

    class Net(nn.Module):
        def __init__(self, read: int):
            super().__init__()
            self.register_buffer("masks", torch.stack([border, centre])[None])
            self.conv = nn.Conv2d(2, 2, 1, bias=False)
            nn.init.eye_(self.conv.weight[:, :, 0, 0])
            self.read = read

        def forward(self, x):
            a = self.conv(x * self.masks)
            z = a[:, self.read].mean(dim=(1, 2))
            return torch.stack([-z, z], 1)

    torch.manual_seed(0)
    X = torch.rand(4, 1, 32, 32) + 0.1
    share = {k: float(np.nanmean(border_share(gradcam_maps(Net(k).eval(), X)))) for k in (0, 1)}
    assert share[0] > 0.9 and share[1] < 0.1, share


# ------------------------------------------------------------------------------------------- on a run
SPECS = {"site-1": ({"family": "cnn", "depth": "shallow", "width": 0.5}, 32),
         "site-2": ({"family": "cnn", "depth": "medium", "width": 0.5}, 40)}


def _fake_run(root: Path, manifest_rows: list[list]) -> Path:
    """A run folder in the simulate layout with untrained model files (no simulator)."""
    from hfl_components.models import build_model, save_model_file

    run = root / "run"
    (run / "resolved_configs").mkdir(parents=True)
    (run / "models").mkdir()
    man = root / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        w.writerows(manifest_rows)
    sites = {}
    for i, (site, (spec, size)) in enumerate(SPECS.items()):
        spec = {**spec, "in_channels": 1, "num_classes": 2}
        (run / "resolved_configs" / f"{site}.json").write_text(json.dumps(
            {"data": {"manifest": str(man), "labels": "binary"}, "model": spec, "input_size": size}))
        torch.manual_seed(i)
        op = {"temperature": 1.5, "threshold": 0.4, "target": 0.95} if i == 0 else None
        save_model_file(run / "models" / f"{site}_deployed.pt", spec, build_model(spec).state_dict(),
                        input_size=size, labels="binary", site=site, kind="deployed", operating_point=op)
        sites[site] = {"model": spec, "input_size": size, "n_train": 1, "n_test": 1, "test": {"accuracy": 0.5}}
    (run / "metrics.json").write_text(json.dumps({"method": "ohfl", "labels": "binary", "seed": 0, "sites": sites,
                                                  "pooled": {}, "operating_point": {"threshold": 0.4,
                                                                                    "target": 0.95}}))
    return run


def _csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows(rows)
    return path


def test_evaluate_writes_audit_json_and_report_shows_it(data_root, tmp_path):
    """224 x 224 images: the geometric facts and the aspect probe are reported not applicable; the audit writes
    audit.json with every model's probes and a montage; the report and `report` show them."""
    from nvflare_jobs.evaluation import evaluate_run
    from tests.sim_helpers import run_cli

    base = data_root / "chest_xray_224" / "train"
    files = {c: sorted((base / c).glob("*.jpeg")) for c in ("NORMAL", "PNEUMONIA")}
    train = [[str(f), k, "val" if j % 2 else "train", f"t{k}{j}"]
             for k, c in enumerate(files) for j, f in enumerate(files[c][:4])]
    run = _fake_run(tmp_path, train)
    ext = _csv(tmp_path / "ext.csv", [(str(f), c) for c in files for f in files[c][-12:]])
    logs: list[str] = []
    res = evaluate_run(run, ext, n_boot=20, log=logs.append)
    a = json.loads((res["dir"] / "audit.json").read_text())
    assert a["n_images"] == 24 and a["class_counts"] == {"NORMAL": 12, "PNEUMONIA": 12}
    md = a["metadata"]
    assert md["not_applicable"]["height"] == "every image is 224 x 224 px"
    assert "metadata: feature height not applicable (every image is 224 x 224 px)" in a["skipped"]
    assert "width" not in md["features"] and set(md["margins"]) == set(res["models"])
    models = a["probes"]["models"]
    assert set(models) == set(res["models"]) and a["probes"]["aspect_applicable"] is False
    for r in models.values():
        assert set(r) >= {"flip", "shift", "contrast", "aspect"} and r["aspect"]["applicable"] is False
        assert r["flip"]["n"] == 24 and r["flip"]["ci_low"] <= r["flip"]["mean_change"] <= r["flip"]["ci_high"]
    assert any("aspect not applicable" in s for s in a["skipped"])
    assert any("operating point: 1 deployed models carry no federated threshold" in s for s in a["skipped"])
    op = a["operating_point"]["models"]["site-1_deployed"]
    assert op["threshold"] == 0.4 and op["temperature"] == 1.5 and op["sensitivity"]["value"] is not None
    assert (res["dir"] / a["saliency"]["montage"]).is_file() and a["saliency"]["crude"] is True
    assert any(line.startswith("[audit] metadata baseline AUC") for line in logs)
    r = run_cli("report", str(run))
    assert r.returncode == 0, r.stderr
    assert "audit (ext): metadata baseline AUC" in r.stdout
    html = (run / "report.html").read_text()
    assert "Shortcut audit" in html and "Grad-CAM for PNEUMONIA" in html and "not applicable (square images)" in html
    assert "This number is crude" in html and "<b>Shortcut audit</b> (section below)" in html
    # --no-audit: evaluate alone
    (res["dir"] / "audit.json").unlink()
    evaluate_run(run, ext, n_boot=0, log=lambda *_: None, audit=False, overwrite=True)  # other options: overwrite
    assert not (res["dir"] / "audit.json").exists()


def test_audit_of_dicom_input_never_writes_patient_fields(data_root, tmp_path):
    """DICOM files carry patient names; an audit on them (some without the optional Manufacturer tag) writes
    only technical facts: no patient, study or institution value appears in any file it writes."""
    import pydicom

    from nvflare_jobs.audit import audit_external

    dcm = sorted((data_root / "dicom").glob("*.dcm"))
    if len(dcm) < 3:
        pytest.skip(f"needs the DICOM files of {data_root / 'dicom'}")
    secret = set()
    for f in dcm:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        for kw in ("PatientName", "PatientID", "PatientBirthDate", "InstitutionName", "AccessionNumber",
                   "StudyInstanceUID"):
            v = str(ds.get(kw, "") or "").strip()
            if len(v) >= 4:
                secret.add(v)
    assert "CompressedSamples^RG1" in secret  # the files do carry names
    base = data_root / "chest_xray_224" / "train"
    rows = [(str(f), "NORMAL") for f in dcm]
    rows += [(str(f), "NORMAL") for f in sorted((base / "NORMAL").glob("*.jpeg"))[:5]]
    rows += [(str(f), "PNEUMONIA") for f in sorted((base / "PNEUMONIA").glob("*.jpeg"))[:8]]
    train = sorted((base / "PNEUMONIA").glob("*.jpeg"))[-1]  # not among the audited images
    run = _fake_run(tmp_path, [[str(train), 1, "train", "x"]])
    ext = _csv(tmp_path / "ext.csv", rows)
    from nvflare_jobs.evaluation import evaluate_run

    res = evaluate_run(run, ext, n_boot=10, log=lambda *_: None, audit=False)
    a = audit_external(run, res["dir"], n_boot=20, log=lambda *_: None, probe_images=16, saliency_images=4)
    assert a["metadata"]["auc"] is not None and "manufacturer=absent" in a["metadata"]["features"]
    assert a["probes"]["aspect_applicable"] is True  # one DICOM is 1841 x 1955
    for f in res["dir"].iterdir():
        if f.suffix in (".json", ".html", ".csv", ".txt"):
            text = f.read_text(errors="ignore")
            leaked = [s for s in secret if s in text]
            assert not leaked, (f.name, leaked)


# ------------------------------------------------------------------------------------------- site check
def test_site_check_warns_when_file_facts_predict_the_training_labels(data_root, tmp_path):
    """chest_xray_original: PNEUMONIA images are smaller, so the facts alone predict the label and the check names
    them; the same files with labels that do not follow the class folder give no warning. Counts and feature
    names only: no file name on the screen."""
    from nvflare_jobs.site_check import check_site, format_report
    from hfl_components.flare.site_config import write_site_config

    root = data_root / "chest_xray_original" / "train"
    pool = {k: sorted((root / c).glob("*.jpeg"))[:16] for k, c in enumerate(("NORMAL", "PNEUMONIA"))}
    files = [(f, k) for k in (0, 1) for f in pool[k][:14]]
    held = [(f, k) for k in (0, 1) for f in pool[k][14:]]  # distinct files for val / test
    for name, label_of in (("real", lambda i, k: k), ("shuffled", lambda i, k: (i // 2) % 2)):
        man = tmp_path / f"{name}.csv"
        with man.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label", "split", "patient_id"])
            for i, (f, k) in enumerate(files):
                w.writerow([str(f), label_of(i, k), "train", f"p{i}"])
            for j, (f, k) in enumerate(held):  # val/test rows so the check has every split
                w.writerow([str(f), k, "val" if j % 2 else "test", f"q{j}"])
        cfg = tmp_path / f"{name}.yaml"
        write_site_config({"data": {"manifest": str(man), "labels": "binary"},
                           "model": {"family": "cnn", "depth": "shallow", "width": 0.25}, "input_size": 16,
                           "batch_size": 4, "threads": 1, "seed": 0}, cfg)
        rep = check_site(cfg)
        warn = [w for w in rep["warnings"] if w.startswith("file facts alone predict")]
        if name == "real":
            assert rep["metadata"]["auc"] >= 0.8 and len(warn) == 1 and "strongest:" in warn[0], rep["warnings"]
            screen = format_report(rep)
            assert "file facts alone predict the training labels" in screen
            assert not any(f.name in screen for f, _ in files)
        else:
            assert not warn and rep["metadata"]["auc"] < 0.8


@pytest.mark.slow
def test_ohfl_run_without_a_placeable_positive_sets_no_threshold_and_says_why(data_root, tmp_path):
    """A real OHFL simulator run without the acceptance gate (``--no-gate``: the pooled federated threshold; with the
    gate each model gets its own threshold) whose three sites have 4 validation positives each (fewer than the 5 a histogram
    cell needs): no threshold is set. The run's summary says why in one line; metrics.json keeps the reason and
    each site's temperature; every deployed model file carries its temperature, no threshold and the reason (local
    models carry nothing); evaluate (on images of the tuning part) and the report say so instead of scoring a
    threshold."""
    import csv as _csv_mod

    from chest_xray.splits import split_rows
    from hfl_components.models import read_model_header
    from nvflare_jobs.evaluation import evaluate_run
    from tests.sim_helpers import load_metrics, make_partition, make_profile, run_cli

    part = make_partition(data_root, tmp_path / "p", 3)
    for s in ("site-1", "site-2", "site-3"):
        with (part / "sites" / f"{s}.csv").open() as fh:
            assert sum(r["split"] == "val" and r["label"] == "1" for r in _csv_mod.DictReader(fh)) == 4
    profile = make_profile(part, tmp_path / "profile", "ohfl")
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--profile", str(profile), "--probe",
                str(data_root / "chest_xray_224"), "--probe-size", "24", "--target-sensitivity", "0.9",
                "--no-gate", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("operating point:")]
    assert lines == ["operating point: NO federated threshold: no site sent >= 5 validation positives (the minimum "
                     "count per cell), so no positive can be placed on the grid (site-1, site-2, site-3 sent fewer)"]
    m = load_metrics(run)
    op = m["operating_point"]
    assert op["target"] == 0.9 and op["n_sites"] == 3 and op["threshold"] is None and op["n_positive"] == 0
    assert op["left_out"] == ["site-1", "site-2", "site-3"] and op["unresolved"] in lines[0]
    for s in ("site-1", "site-2", "site-3"):
        h = read_model_header(run / "models" / f"{s}_deployed.pt")["operating_point"]
        assert h["threshold"] is None and h["temperature"] > 0 and h["unresolved"] == op["unresolved"]
        assert m["sites"][s]["operating_point"] == {"temperature": pytest.approx(h["temperature"]), "threshold": None}
        assert "operating_point" not in read_model_header(run / "models" / f"{s}_local.pt")
    root = data_root / "chest_xray_224"
    rows = split_rows("tuning")
    ext = _csv(tmp_path / "tuning.csv", [(str(root / r["path"]), r["label"]) for r in rows[:12] + rows[-12:]])
    res = evaluate_run(run, ext, n_boot=20, log=lambda *_: None)
    a = json.loads((res["dir"] / "audit.json").read_text())
    assert a["operating_point"]["models"] == {} and "operating_point" not in res["models"]["site-1_deployed"]
    assert any(s.startswith("operating point: 3 deployed models carry no federated threshold")
               and "the federation set no threshold: no site sent >= 5" in s for s in a["skipped"])
    r = run_cli("report", str(run))
    assert r.returncode == 0, r.stderr
    html = (run / "report.html").read_text()
    sec = html.split("<h2>Clinical operating point</h2>", 1)[1]
    assert sec.lstrip().startswith("<p class='warn'><b>operating point: NO federated threshold: no site sent &gt;= 5")


def test_bootstrap_aucs_are_the_weighted_aucs_of_each_draw():
    from sklearn.metrics import roc_auc_score

    from hfl_components.audit.metadata import _auc, _draws, bootstrap_aucs

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 120)
    s1, s2 = np.round(rng.random(120) + 0.5 * y, 1), rng.random(120)  # s1 with ties
    W = _draws(y, 30, seed=1)
    assert (W[:, y == 1].sum(1) == (y == 1).sum()).all()  # class-stratified draws
    got = bootstrap_aucs(y, [s1, s2], W)
    want = np.array([[roc_auc_score(y, s1, sample_weight=w), roc_auc_score(y, s2, sample_weight=w)] for w in W])
    assert np.allclose(got, want)
    assert _auc(y, s1) == pytest.approx(roc_auc_score(y, s1))

def test_audit_cli_bad_input_gives_one_line_and_exit_2(tmp_path, capsys):
    from nvflare_jobs.cli import main

    assert main(["audit", "--run", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"cxr-hfl audit: no run folder {tmp_path / 'nope'}"
    (tmp_path / "run").mkdir()
    assert main(["audit", "--run", str(tmp_path / "run")]) == 2
    assert "0 evaluated sets under external/" in capsys.readouterr().err
    assert main(["audit", "--run", str(tmp_path / "run"), "--data", str(tmp_path / "ext.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("run `cxr-hfl evaluate --run " + str(tmp_path / "run") + " --data ...` first")
    assert len(err.splitlines()) == 1


def test_predict_applies_a_deployed_models_federated_operating_point(data_root, tmp_path):
    """A model file carrying a temperature and a threshold: predict writes calibrated probabilities and calls
    PNEUMONIA at the federated threshold; an explicit --threshold still wins."""
    from hfl_components.operating_point import apply_temperature
    from nvflare_jobs.evaluation import predict_files

    files = sorted((data_root / "chest_xray_224" / "train" / "PNEUMONIA").glob("*.jpeg"))[:4]
    run = _fake_run(tmp_path, [[str(files[0]), 1, "train", "x"]])
    with_op, plain = run / "models" / "site-1_deployed.pt", tmp_path / "plain.pt"
    from hfl_components.models import load_model_file, save_model_file

    model, h = load_model_file(with_op)
    save_model_file(plain, h["spec"], model.state_dict(), input_size=h["input_size"], labels="binary")
    rows = {}
    for name, f in (("op", with_op), ("plain", plain)):
        out = tmp_path / f"{name}.csv"
        s = predict_files(f, [str(x) for x in files], out)
        with out.open() as fh:
            rows[name] = list(csv.DictReader(fh))
        assert s["calibrated"] is (name == "op")
    raw = np.array([[float(r["p_NORMAL"]), float(r["p_PNEUMONIA"])] for r in rows["plain"]])
    cal = np.array([float(r["p_PNEUMONIA"]) for r in rows["op"]])
    assert np.allclose(cal, apply_temperature(raw, 1.5)[:, 1], atol=1e-4)
    assert [r["predicted"] for r in rows["op"]] == ["PNEUMONIA" if p >= 0.4 else "NORMAL" for p in cal]
    s = predict_files(with_op, [str(x) for x in files], tmp_path / "t.csv", threshold=1.0)
    assert s["threshold"] == 1.0


def test_predict_does_not_apply_a_degenerate_federated_threshold(data_root, tmp_path, capsys):
    """A federated threshold of 0 (histograms too coarse for the target) would call every image PNEUMONIA: predict
    warns, naming the model file, and predicts at argmax of the calibrated probabilities instead."""
    from hfl_components.models import load_model_file, save_model_file
    from hfl_components.operating_point import apply_temperature
    from nvflare_jobs.evaluation import predict_files

    files = sorted((data_root / "chest_xray_224" / "train" / "NORMAL").glob("*.jpeg"))[:4]
    run = _fake_run(tmp_path, [[str(files[0]), 0, "train", "x"]])
    model, h = load_model_file(run / "models" / "site-1_deployed.pt")
    zero, plain = tmp_path / "zero.pt", tmp_path / "plain.pt"
    save_model_file(zero, h["spec"], model.state_dict(), input_size=h["input_size"], labels="binary",
                    operating_point={"temperature": 1.5, "threshold": 0.0})
    save_model_file(plain, h["spec"], model.state_dict(), input_size=h["input_size"], labels="binary")
    capsys.readouterr()
    s = predict_files(zero, [str(x) for x in files], tmp_path / "zero.csv")
    err = capsys.readouterr().err
    assert "federated threshold is 0" in err and str(zero) in err and len(err.strip().splitlines()) == 1
    assert s["threshold"] is None and s["calibrated"] is True
    predict_files(plain, [str(x) for x in files], tmp_path / "plain.csv")
    with (tmp_path / "plain.csv").open() as fh:
        raw = np.array([[float(r["p_NORMAL"]), float(r["p_PNEUMONIA"])] for r in csv.DictReader(fh)])
    cal = apply_temperature(raw, 1.5)
    with (tmp_path / "zero.csv").open() as fh:
        got = [r["predicted"] for r in csv.DictReader(fh)]
    assert got == ["PNEUMONIA" if c[1] > c[0] else "NORMAL" for c in cal]
