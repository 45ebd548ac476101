"""External validation (`cxr-hfl evaluate`), prediction (`cxr-hfl predict`) and the HTML report on a run folder
built from a real partition and real model files (untrained weights; no simulator, so these are fast)."""
from __future__ import annotations

import base64
import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.sim_helpers import make_partition, run_cli

torch.set_num_threads(1)

SPECS = {"site-1": ({"family": "cnn", "depth": "shallow", "width": 1.0}, 32),
         "site-2": ({"family": "cnn", "depth": "deep", "width": 1.0}, 48)}


def _save(path: Path, spec: dict, size: int | None, site: str | None, seed: int) -> None:
    from hfl_components.models import build_model, save_model_file

    torch.manual_seed(seed)
    m = build_model(spec)
    save_model_file(path, spec, m.state_dict(), input_size=size, labels=None if size is None else "binary", site=site)


@pytest.fixture(scope="module")
def fake_run(data_root, tmp_path_factory) -> Path:
    """A run folder in the simulate layout: partition/, resolved_configs/, models/, global_model.pt,
    metrics.json -- real manifests and real model files with untrained weights."""
    run = tmp_path_factory.mktemp("run")
    part = make_partition(data_root, run / "partition", 2, max_images=80)
    (run / "resolved_configs").mkdir()
    (run / "models").mkdir()
    sites = {}
    for i, (site, (spec, size)) in enumerate(SPECS.items()):
        spec = {**spec, "in_channels": 1, "num_classes": 2}
        cfg = {"data": {"manifest": str(part / "sites" / f"{site}.csv"), "labels": "binary"}, "model": spec,
               "input_size": size}
        (run / "resolved_configs" / f"{site}.json").write_text(json.dumps(cfg))
        _save(run / "models" / f"{site}_deployed.pt", spec, size, site, i)
        _save(run / "models" / f"{site}_local.pt", spec, size, site, 10 + i)
        sites[site] = {"model": spec, "input_size": size, "n_train": 1, "n_test": 2,
                       "test": {"n": 2, "accuracy": 0.5, "balanced_accuracy": 0.5, "auc": 0.5, "sensitivity": 1.0,
                                "specificity": 0.0, "confusion_matrix": [[0, 1], [0, 1]]}}
    _save(run / "global_model.pt", SPECS["site-2"][0] | {"in_channels": 1, "num_classes": 2}, None, None, 99)
    (run / "metrics.json").write_text(json.dumps({"method": "ohfl", "labels": "binary", "seed": 0, "sites": sites,
                                                  "pooled": {}, "command": "cxr-hfl simulate --method ohfl"}))
    return run


def _external_csv(data_root: Path, out: Path, n_per_class: int = 8) -> Path:
    """A small labelled external set: chest_xray_224 images (patient-disjoint from chest_xray_original)."""
    root = data_root / "chest_xray_224"
    rows = []
    for cls in ("NORMAL", "PNEUMONIA"):
        files = sorted((root / "train" / cls).glob("*.jpeg"))[:n_per_class]
        rows += [{"path": str(f), "label": cls} for f in files]
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["path", "label"])
        w.writeheader()
        w.writerows(rows)
    return out


def test_evaluate_writes_every_model_with_val_threshold(fake_run, data_root, tmp_path):
    from nvflare_jobs.evaluation import evaluate_run

    ext = _external_csv(data_root, tmp_path / "ext.csv")
    res = evaluate_run(fake_run, ext, n_boot=50, log=lambda *_: None)
    names = set(res["models"])
    assert names == {"site-1_deployed", "site-1_local", "site-2_deployed", "site-2_local", "global_32px",
                     "global_48px"}
    assert res["dir"] == fake_run / "external" / "ext"
    for name in names:
        d = json.loads((fake_run / "external" / "ext" / f"{name}.json").read_text())
        assert d["n"] == 16 and sum(map(sum, d["test"]["confusion_matrix"])) == 16
        assert {"accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "log_loss"} <= set(d["test"])
        assert d["test"]["threshold"] is None  # same rule as the sites' own test splits (argmax)
        assert 0.0 <= d["val_threshold"] <= 1.0 and d["val_n"] > 0
        assert d["test_at_val_threshold"]["threshold"] == pytest.approx(d["val_threshold"])
    assert res["models"]["site-1_deployed"]["input_size"] == 32
    assert res["models"]["site-2_local"]["input_size"] == 48
    assert res["models"]["global_48px"]["input_size"] == 48
    s = json.loads((fake_run / "external" / "ext" / "summary.json").read_text())
    assert s["overlap"]["shared_file_names"] == 0 and not s["forced"] and s["probe_images_excluded"] == 0
    # the global model: scored at each site's size (site-1 32 px, site-2 48 px) and averaged over the sites
    g = s["models"]["global"]
    for k in ("accuracy", "balanced_accuracy", "auc"):
        assert g[k] == pytest.approx((s["models"]["global_32px"][k] + s["models"]["global_48px"][k]) / 2)
    assert g["site_sizes"] == {"site-1": 32, "site-2": 48}
    # per-image probabilities for paired comparisons, reproducing the stored metrics
    from sklearn.metrics import roc_auc_score

    npz = np.load(fake_run / "external" / "ext" / "predictions.npz")
    assert npz["y"].shape == (16,) and npz["site-1_deployed"].shape == (16, 2)
    assert roc_auc_score(npz["y"], npz["site-1_deployed"][:, 1]) == pytest.approx(s["models"]["site-1_deployed"]["auc"],
                                                                                 abs=1e-6)


def test_each_data_set_gets_its_own_folder(fake_run, data_root, tmp_path):
    from nvflare_jobs.evaluation import evaluate_run, external_name

    a = _external_csv(data_root, tmp_path / "set_a.csv", 4)
    b = _external_csv(data_root, tmp_path / "set_b.csv", 6)
    evaluate_run(fake_run, a, n_boot=0, log=lambda *_: None, global_sizes="largest")
    evaluate_run(fake_run, b, n_boot=0, log=lambda *_: None, global_sizes="largest")
    assert json.loads((fake_run / "external" / "set_a" / "summary.json").read_text())["n_images"] == 8
    assert json.loads((fake_run / "external" / "set_b" / "summary.json").read_text())["n_images"] == 12
    assert external_name(data_root / "chest_xray_224", "evaluation") == "chest_xray_224-evaluation"
    assert external_name(tmp_path / "set_a.csv") == "set_a"


def _probe_run(fake_run: Path, tmp_path: Path, probe) -> Path:
    run = tmp_path / "run"
    shutil.copytree(fake_run, run, ignore=shutil.ignore_patterns("external"))
    (run / "job_options.json").write_text(json.dumps({"probe": str(probe), "probe_size": 64}))
    return run


def test_probe_images_are_never_scored(fake_run, data_root, tmp_path):
    """The probe pool as a folder, as a probe.csv, and as the committed probe part: its images are left out and
    counted in summary.json."""
    from chest_xray.splits import split_rows
    from nvflare_jobs.evaluation import evaluate_run, probe_pool

    root = data_root / "chest_xray_224"
    ext = _external_csv(data_root, tmp_path / "ext.csv")  # 16 images, 8 per class
    ext_rows = list(csv.DictReader(ext.open()))
    probe_part = [r for r in split_rows("probe")]
    extra = [probe_part[0], next(r for r in probe_part if r["label"] == "PNEUMONIA")]
    with ext.open("a", newline="") as fh:  # two images of the committed probe part join the external set
        csv.writer(fh).writerows([[str(root / r["path"]), r["label"]] for r in extra])
    folder = tmp_path / "probe_dir" / "x"
    folder.mkdir(parents=True)
    for r in ext_rows[:3]:  # a probe folder holding 3 of the external images (same file names)
        shutil.copy(r["path"], folder / Path(r["path"]).name)
    pcsv = tmp_path / "probe.csv"
    with pcsv.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows([[r["path"], ""] for r in ext_rows[5:10]])
    committed = Path(__file__).resolve().parents[1] / "chest_xray" / "splits" / "chest_xray_224_probe.csv"
    # the chest_xray_224 root as the probe folder stands for its probe part (the server reads only that part)
    cases = [(folder.parent, 3), (pcsv, 5), ("part:probe", 2), (committed, 2), (root, 2), ("generated", 0)]
    for i, (probe, n_out) in enumerate(cases):
        run = _probe_run(fake_run, tmp_path / f"c{i}", probe)
        names, _ = probe_pool(run)
        assert len(names) == {0: 3, 1: 5, 5: 0}.get(i, 320), probe
        res = evaluate_run(run, ext, n_boot=0, log=lambda *_: None, global_sizes="largest")
        s = json.loads(res["summary"].read_text())
        assert s["probe_images_excluded"] == n_out and s["n_images"] == 18 - n_out, probe
        npz = np.load(res["dir"] / "predictions.npz")
        assert not {Path(p).name.lower() for p in npz["paths"]} & names
    # file names the server recorded as used (metrics.json probe.files) are left out too
    run = _probe_run(fake_run, tmp_path / "rec", "generated")
    met = json.loads((run / "metrics.json").read_text())
    met["probe"] = {"source": "x", "files": [Path(r["path"]).name for r in ext_rows[:4]]}
    (run / "metrics.json").write_text(json.dumps(met))
    res = evaluate_run(run, ext, n_boot=0, log=lambda *_: None, global_sizes="largest")
    assert json.loads(res["summary"].read_text())["probe_images_excluded"] == 4
    # a set made only of probe images: a clear error, nothing scored
    run = _probe_run(fake_run, tmp_path / "all", pcsv)
    only = tmp_path / "only.csv"
    with only.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows([[r["path"], r["label"]] for r in ext_rows[5:10]])
    with pytest.raises(ValueError, match="all 5 images .* probe pool"):
        evaluate_run(run, only, n_boot=0, log=lambda *_: None)
    # a probe pool that no longer exists: the exclusion cannot be honoured
    run = _probe_run(fake_run, tmp_path / "gone", tmp_path / "no_such_probe")
    with pytest.raises(FileNotFoundError, match="no longer exists"):
        probe_pool(run)


def test_part_keeps_only_the_committed_part(data_root, tmp_path):
    """--part evaluation on a chest_xray_224-shaped root keeps exactly the evaluation part's images."""
    from chest_xray.splits import split_rows
    from nvflare_jobs.evaluation import load_external

    src = data_root / "chest_xray_224"
    root = tmp_path / "chest_xray_224"
    picked = {p: split_rows(p)[:3] + [r for r in split_rows(p) if r["label"] == "PNEUMONIA"][:3]
              for p in ("probe", "tuning", "evaluation")}
    for rows in picked.values():
        for r in rows:
            (root / r["path"]).parent.mkdir(parents=True, exist_ok=True)
            (root / r["path"]).symlink_to(src / r["path"])
    recs, rep = load_external(root, "binary", "evaluation")
    assert sorted(Path(r["path"]).name for r in recs) == sorted(Path(r["path"]).name for r in picked["evaluation"])
    assert rep["part"] == "evaluation"
    other = tmp_path / "other"  # a valid layout holding none of the part's images
    for cls in ("NORMAL", "PNEUMONIA"):
        (other / cls).mkdir(parents=True)
        f = sorted((data_root / "chest_xray_original" / "train" / cls).glob("*.jpeg"))[0]
        (other / cls / f.name).symlink_to(f)
    with pytest.raises(ValueError, match="chest_xray_224 root"):
        load_external(other, "binary", "evaluation")


def test_evaluate_refuses_training_images_unless_forced(fake_run, tmp_path):
    from chest_xray import read_site_manifest

    rows = read_site_manifest(fake_run / "partition" / "sites" / "site-1.csv")[:6]
    leak = tmp_path / "leak.csv"
    with leak.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["path", "label"])
        w.writeheader()
        w.writerows({"path": r["path"], "label": str(r["label"])} for r in rows)
    r = run_cli("evaluate", "--run", str(fake_run), "--data", str(leak), timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "REFUSED" in r.stderr and "file names" in r.stderr and "--force" in r.stderr
    r = run_cli("evaluate", "--run", str(fake_run), "--data", str(leak), "--force", "--global-sizes", "largest",
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" in r.stdout and "NOT an external validation" in r.stdout
    s = json.loads((fake_run / "external" / "leak" / "summary.json").read_text())
    assert s["forced"] is True and "global_32px" not in s["models"] and "global" not in s["models"]


def test_predict_skips_unreadable_files_with_reason(fake_run, data_root, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    good = sorted((data_root / "chest_xray_224" / "train" / "NORMAL").glob("*.jpeg"))[0]
    shutil.copy(good, src / "a.jpeg")
    (src / "broken.jpg").write_bytes(b"not an image")
    (src / "empty.png").write_bytes(b"")
    dicoms = sorted((data_root / "dicom").glob("*.dcm")) if (data_root / "dicom").is_dir() else []
    out = tmp_path / "pred.csv"
    r = run_cli("predict", "--model", str(fake_run / "models" / "site-1_deployed.pt"), "--data", str(src),
                *map(str, dicoms), str(tmp_path / "missing.png"), "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {Path(x["path"]).name: x for x in csv.DictReader(out.open())}
    assert len(rows) == 4 + len(dicoms)
    ok = rows["a.jpeg"]
    assert ok["status"] == "ok" and ok["predicted"] in ("NORMAL", "PNEUMONIA")
    assert abs(float(ok["p_NORMAL"]) + float(ok["p_PNEUMONIA"]) - 1) < 1e-3
    for bad in ("broken.jpg", "empty.png", "missing.png"):
        assert rows[bad]["status"] == "skipped" and rows[bad]["reason"] and rows[bad]["predicted"] == ""
    assert "empty" in rows["empty.png"]["reason"]
    for d in dicoms:  # every DICOM either predicted or skipped with a reason, never a crash
        row = rows[d.name]
        assert (row["status"] == "ok" and row["predicted"]) or (row["status"] == "skipped" and row["reason"])


def test_report_embeds_figures_and_model_card(fake_run):
    from nvflare_jobs.report import render_report

    out = render_report(fake_run)
    text = out.read_text()
    assert text.count('<img src="data:image/png;base64,') >= 2  # one confusion matrix per site
    assert "Confusion matrix site-1" in text and "Confusion matrix site-2" in text
    assert "doi:10.17632/rscbjbr9sj.2" in text and "CC BY 4.0" in text and "paediatric" in text
    assert "Not validated on" in text and "data manifest sha256" in text and "torch" in text
    b64 = text.split('<img src="data:image/png;base64,')[1].split('"')[0]
    assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"


def test_predict_skips_what_is_not_a_chest_radiograph(fake_run, data_root, tmp_path):
    """A 1x1 PNG, colourful charts and a broken symlink are skipped with a reason; a real X-ray saved as RGB
    (chest_xray_224 is RGB with R=G=B) is predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from chest_xray.screening import MIN_IMAGE_SIDE, screen_image

    src = tmp_path / "in"
    src.mkdir()
    xray = sorted((data_root / "chest_xray_224" / "train" / "PNEUMONIA").glob("*.jpeg"))[0]
    shutil.copy(xray, src / "xray.jpeg")
    assert Image.open(src / "xray.jpeg").mode == "RGB"
    Image.new("L", (1, 1), 0).save(src / "dot.png")
    Image.new("L", (MIN_IMAGE_SIDE - 1, 500), 90).save(src / "strip.png")
    fig, ax = plt.subplots()
    ax.bar([1, 2, 3], [3, 1, 2], color=["C0", "C1", "C2"])
    fig.savefig(src / "bars.png")
    plt.close(fig)
    fig, ax = plt.subplots()
    ax.plot([1, 3, 2])
    ax.plot([2, 1, 3])
    fig.savefig(src / "lines.png")
    plt.close(fig)
    (src / "dead.png").symlink_to(tmp_path / "gone.png")
    out = tmp_path / "pred.csv"
    r = run_cli("predict", "--model", str(fake_run / "models" / "site-1_deployed.pt"), "--data", str(src),
                "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {Path(x["path"]).name: x for x in csv.DictReader(out.open())}
    assert set(rows) == {"xray.jpeg", "dot.png", "strip.png", "bars.png", "lines.png", "dead.png"}
    assert rows["xray.jpeg"]["status"] == "ok" and rows["xray.jpeg"]["predicted"]
    for name, why in [("dot.png", "too small"), ("strip.png", "too small"), ("bars.png", "colour"),
                      ("lines.png", "colour"), ("dead.png", "broken symbolic link")]:
        assert rows[name]["status"] == "skipped" and why in rows[name]["reason"], (name, rows[name])
        assert rows[name]["predicted"] == ""
    # every real JPEG of the data set passes the screen (a sample of each set; the full set is checked offline)
    for sub in ("chest_xray_224", "chest_xray_original"):
        for cls in ("NORMAL", "PNEUMONIA"):
            for f in sorted((data_root / sub / "train" / cls).glob("*.jpeg"))[::25]:
                assert screen_image(f) is None, f


def test_predict_bad_arguments_give_one_line_errors(fake_run, data_root, tmp_path):
    model = str(fake_run / "models" / "site-1_deployed.pt")
    xray = sorted((data_root / "chest_xray_224" / "train" / "NORMAL").glob("*.jpeg"))[0]
    (tmp_path / "empty").mkdir()
    (tmp_path / "outdir").mkdir()
    cases = [
        (["--model", model, "--data", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "a.csv")],
         "no such file or folder"),
        (["--model", model, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "b.csv")], "no image files"),
        (["--model", str(xray), "--data", str(xray), "--out", str(tmp_path / "c.csv")], "not a cxr-hfl model file"),
        (["--model", model, "--data", str(xray), "--out", str(tmp_path / "outdir")], "is a folder"),
    ]
    for argv, msg in cases:
        r = run_cli("predict", *argv, timeout=300)
        assert r.returncode == 2, (argv, r.stdout + r.stderr)
        assert msg in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "c.csv").exists()
    # every file skipped: rc 1 with the reason said
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "x.png").write_bytes(b"")
    r = run_cli("predict", "--model", model, "--data", str(tmp_path / "only"), "--out", str(tmp_path / "d.csv"))
    assert r.returncode == 1 and "no file could be predicted" in r.stderr


def test_evaluate_and_predict_reject_out_of_range_numbers(tmp_path):
    r = run_cli("evaluate", "--run", str(tmp_path), "--data", str(tmp_path), "--max-images", "0")
    assert r.returncode == 2 and "--max-images" in r.stderr and "positive integer" in r.stderr
    r = run_cli("predict", "--model", "m.pt", "--data", str(tmp_path), "--out", str(tmp_path / "p.csv"),
                "--threshold", "5")
    assert r.returncode == 2 and "--threshold" in r.stderr and "[0, 1]" in r.stderr


def test_predict_applies_exif_orientation(fake_run, data_root, tmp_path):
    """A sideways-stored image with EXIF Orientation 6 gets exactly the upright image's probabilities (it goes
    through ``read_image``, which applies the orientation first); the same sideways pixels without the EXIF tag
    do not. Built from a real image as lossless PNGs, so "exactly" is exact."""
    from PIL import Image

    src = sorted((data_root / "chest_xray_original" / "train" / "NORMAL").glob("*.jpeg"))
    if not src:
        pytest.skip("chest_xray_original missing")
    d = tmp_path / "in"
    d.mkdir()
    with Image.open(src[0]) as im:
        upright = im.convert("L")
    sideways = upright.transpose(Image.Transpose.ROTATE_90)  # stored turned; Orientation 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    upright.save(d / "upright.png")
    sideways.save(d / "sideways_exif6.png", exif=exif)
    sideways.save(d / "sideways_no_exif.png")
    raw_name = os.fsencode(d) + b"/upright-t\xf3rax.png"  # cp1252 bytes from a Windows zip: not UTF-8
    shutil.copy(d / "upright.png", raw_name)
    # an untrained model's classifier starts at zero (p = 0.5 for every input); random classifier weights make
    # the probabilities depend on the input
    from hfl_components.models import build_model

    spec = {**SPECS["site-1"][0], "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    m = build_model(spec)
    with torch.no_grad():
        torch.nn.init.normal_(m.classifier.weight, std=0.5)
    model = tmp_path / "sharp.pt"
    from hfl_components.models import save_model_file

    save_model_file(model, spec, m.state_dict(), input_size=32, labels="binary", site="site-1", kind="deployed")
    out = tmp_path / "pred.csv"
    r = run_cli("predict", "--model", str(model), "--data", str(d), "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with out.open(newline="", encoding="utf-8", errors="surrogateescape") as fh:
        rows = {Path(x["path"]).name: x for x in csv.DictReader(fh)}
    assert all(x["status"] == "ok" for x in rows.values()), rows
    p = {n: (float(x["p_NORMAL"]), float(x["p_PNEUMONIA"])) for n, x in rows.items()}
    assert p["sideways_exif6.png"] == p["upright.png"] == p[os.fsdecode(b"upright-t\xf3rax.png")]
    assert out.read_bytes().count(raw_name) == 1  # the exact bytes of the name
    assert p["sideways_no_exif.png"] != p["upright.png"]


def test_predict_and_evaluate_feed_a_model_images_the_way_its_site_made_them_square(data_root, tmp_path):
    """A site trained with ``aspect: letterbox`` writes that into its model file; ``predict`` (and ``evaluate``)
    then letterbox, not stretch, a non-square image: its probabilities equal the model run on the letterboxed
    tensor and differ from the stretched one. Files without the key keep the default (stretch)."""
    from PIL import Image

    from chest_xray import build_transforms
    from hfl_components.models import build_model, load_model_file, save_model_file
    from nvflare_jobs.evaluation import model_aspect, predict_files

    src = next(p for p in sorted(Path(data_root).rglob("*.jpeg")) if (lambda s: s[0] != s[1])(Image.open(p).size))
    spec = {**SPECS["site-1"][0], "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    m = build_model(spec)
    with torch.no_grad():
        torch.nn.init.normal_(m.classifier.weight, std=0.5)
    m.eval()
    probs = {}
    for aspect in ("letterbox", None):
        f = save_model_file(tmp_path / f"{aspect}.pt", spec, m.state_dict(), input_size=32, labels="binary",
                            site="site-1", kind="deployed", aspect=aspect)
        assert load_model_file(f)[1]["aspect"] == aspect
        predict_files(f, [str(src)], tmp_path / f"{aspect}.csv")
        with (tmp_path / f"{aspect}.csv").open() as fh:
            row = next(csv.DictReader(fh))
        probs[aspect] = float(row["p_PNEUMONIA"])
    with torch.no_grad():
        want = {a: torch.softmax(m(torch.as_tensor(build_transforms(32, "eval", aspect=a)({"image": str(src), "label": 0})["image"])[None]
                                    .float()), 1)[0, 1].item()
                for a in ("letterbox", "stretch")}
    assert probs["letterbox"] == pytest.approx(want["letterbox"], abs=1e-5)
    assert probs[None] == pytest.approx(want["stretch"], abs=1e-5)
    assert abs(want["letterbox"] - want["stretch"]) > 1e-4
    with pytest.raises(ValueError, match="aspect must be one of stretch, letterbox, crop, got 'squash'"):
        save_model_file(tmp_path / "x.pt", spec, m.state_dict(), input_size=32, aspect="squash")
    # a global model has no aspect of its own: the one its run's sites used, else the default
    (tmp_path / "resolved_configs").mkdir()
    for s, a in (("site-1", "crop"), ("site-2", "crop")):
        (tmp_path / "resolved_configs" / f"{s}.json").write_text(json.dumps({"aspect": a}))
    assert model_aspect({"aspect": None}, tmp_path) == "crop"
    assert model_aspect({"aspect": "letterbox"}, tmp_path) == "letterbox"
    (tmp_path / "resolved_configs" / "site-2.json").write_text(json.dumps({"aspect": "stretch"}))
    assert model_aspect({"aspect": None}, tmp_path) == "stretch"


def test_evaluate_refuses_a_label_scheme_the_models_cannot_give_and_keeps_the_earlier_results(tmp_path):
    """A binary run evaluated with --labels subtype: one line naming the model file and --labels, exit 2, before
    the data are read; the earlier evaluation of the same set (external/<name>/) is left as it was."""
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    _save(run / "models" / "site-1_deployed.pt", {**SPECS["site-1"][0], "in_channels": 1, "num_classes": 2}, 32,
          "site-1", 0)
    data = tmp_path / "ext"
    data.mkdir()  # an empty folder: were it read, the message would be about the data
    earlier = run / "external" / "ext" / "summary.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"earlier": true}')
    r = run_cli("evaluate", "--run", str(run), "--data", str(data), "--labels", "subtype", "--no-audit", timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, r.stdout + err
    assert "site-1_deployed.pt" in err and "--labels subtype" in err and "2-class" in err, err
    assert earlier.read_text() == '{"earlier": true}'


def test_evaluate_never_replaces_an_evaluation_made_with_other_options_without_overwrite(fake_run, data_root,
                                                                                            tmp_path, capsys):
    """An evaluation of the same set with fewer images, or without the audit an earlier one has, is refused in one
    line naming the folder and what differs, and the earlier folder is left byte for byte; a rerun with the same
    options replaces it; --overwrite replaces it whatever the options."""
    from nvflare_jobs.cli import main

    ext = _external_csv(data_root, tmp_path / "ext_overwrite.csv")
    cmd = ["evaluate", "--run", str(fake_run), "--data", str(ext), "--n-boot", "0", "--no-audit"]
    assert main(cmd) == 0
    out = fake_run / "external" / "ext_overwrite"
    assert json.loads((out / "summary.json").read_text())["n_images"] == 16
    assert main(cmd) == 0  # the same options: a rerun replaces it
    capsys.readouterr()
    (out / "audit.json").write_text("{}")  # stands for the audit an earlier evaluation without --no-audit wrote
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    for extra, says in ((["--max-images", "4"], "4 images (was 16); max-images 4 (was none); no audit (it has "
                                                "audit.json)"),
                        ([], "no audit (it has audit.json)")):
        assert main(cmd + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"cxr-hfl evaluate: {out} already holds an evaluation of this set made with other options "
                       f"({says}); give --overwrite to replace it (its results and audit are deleted), or keep it")
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert main(cmd + ["--max-images", "4", "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["n_images"] == 4 and not (out / "audit.json").exists()
    assert "--overwrite" in run_cli("evaluate", "--help").stdout


def test_evaluate_says_in_one_line_when_it_adds_the_audit_to_an_earlier_no_audit_evaluation(tmp_path, capsys,
                                                                                              monkeypatch):
    """Evaluating again with the audit a set evaluated earlier with --no-audit (same options otherwise) is allowed
    (nothing is lost) but said in one stdout line naming the folder; a plain rerun with the same options says
    nothing of it. Hand-made images and an untrained model; the audit itself is stubbed (it is tested in
    test_audit.py), only whether evaluate runs it matters here."""
    from PIL import Image

    import nvflare_jobs.audit as audit_mod
    from nvflare_jobs.cli import main

    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    _save(run / "models" / "site-1_deployed.pt", {**SPECS["site-1"][0], "in_channels": 1, "num_classes": 2}, 32,
          "site-1", 0)
    data = tmp_path / "ext"
    rng = np.random.default_rng(0)
    for cls in ("NORMAL", "PNEUMONIA"):
        (data / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (40, 40), dtype=np.uint8)).save(data / cls / f"{cls}_{i}.png")
    audits = []

    def fake_audit(run, ext_dir, log=print):
        audits.append(ext_dir)
        (ext_dir / "audit.json").write_text("{}")

    monkeypatch.setattr(audit_mod, "audit_external", fake_audit)
    cmd = ["evaluate", "--run", str(run), "--data", str(data), "--n-boot", "0"]
    folder = run.resolve() / "external" / "ext"
    says = f"adding the shortcut audit to the earlier evaluation in {folder}"
    assert main(cmd + ["--no-audit"]) == 0 and audits == []
    assert main(cmd + ["--no-audit"]) == 0 and says not in capsys.readouterr().out  # a rerun: nothing added
    assert main(cmd) == 0 and audits == [folder]
    out = capsys.readouterr().out
    assert sum(says in line for line in out.splitlines()) == 1, out
    assert (folder / "audit.json").is_file() and (folder / "summary.json").is_file()
    assert main(cmd) == 0 and says not in capsys.readouterr().out  # it has its audit now: a plain rerun
