"""Bad input to the offline fusion/gate benchmarks (bench_fusion_runs.py, bench_gate.py) is refused with exit 2
and one line naming the folder or option, before any image cache is read or built."""
from __future__ import annotations

import importlib
import re
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def _run(capsys):
    where = {"bench_fusion_runs": "studies.fusion_defaults", "bench_gate": "studies.fusion_defaults",
             "augment_accuracy": "studies.augmentation"}

    def run(script, *args):
        name = script.removesuffix(".py")
        mod = importlib.import_module(f"{where[name]}.{name}")
        rc = mod.main([str(a) for a in args])
        return rc, capsys.readouterr().err.strip()
    return run


def _fake_run(tmp_path: Path, with_models: bool) -> Path:
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"sites": {"site-1": {"n_train": 10}, "site-2": {"n_train": 12}}}))
    (run / "job_options.json").write_text(json.dumps({"probe": "generated", "seed": 0, "probe_size": 8}))
    if with_models:
        (run / "models" / "site-1_local.pt").write_bytes(b"")
    return run


@pytest.mark.parametrize("script", ["bench_fusion_runs.py", "bench_gate.py"])
def test_missing_run_folder_exit_2_one_line(script, tmp_path, _run):
    rc, err = _run(script, tmp_path / "nope")
    assert rc == 2 and str(tmp_path / "nope") in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_fusion_runs_refuses_unknown_config_and_a_run_without_site_models(tmp_path, _run):
    run = _fake_run(tmp_path, with_models=True)
    rc, err = _run("bench_fusion_runs.py", run, "--configs", "default,bogus")
    assert rc == 2 and "unknown --configs ['bogus']" in err and "channel+own" in err and len(err.splitlines()) == 1
    # site-2 has no models/site-2_local.pt: named, site-1's (present) is not
    rc, err = _run("bench_fusion_runs.py", run, "--configs", "channel+own")
    assert rc == 2 and "site-2_local.pt" in err and "site-1_local.pt" not in err and len(err.splitlines()) == 1, err


def test_gate_refuses_unequal_control_count(tmp_path, _run):
    run = _fake_run(tmp_path, with_models=False)
    rc, err = _run("bench_gate.py", run, run, "--control", run)
    assert rc == 2 and "2 run(s) but 1 --control run(s)" in err and len(err.splitlines()) == 1, err


def test_tune_fedproto_opts_are_typed_and_checked(monkeypatch):
    """tune_fedproto.py --opts: values typed and checked by the catalogue; a malformed item, an unknown key (was
    silently ignored and recorded in the summary as if used) or a bad value is refused naming it."""
    from studies.proto_tuning.tune_fedproto import parse_opts

    base = {"rounds": 20, "local_epochs": 1, "seed": 0}
    o = parse_opts("fedproto", "lam=0,gamma=0.015625,rounds=3", base)
    assert (o["lam"], o["gamma"], o["rounds"], o["alignment"]) == (0.0, 1 / 64, 3, "mse")
    assert parse_opts("fedsaf", "", base)["lam"] == 1.0 and base == {"rounds": 20, "local_epochs": 1, "seed": 0}
    for text, says in (("lam", "'lam' is not key=value"), ("bogus=1", "'bogus' is not an option of fedproto"),
                       ("lam=-1", "lambda must be a finite number >= 0"), ("rounds=x", "rounds='x': expected"),
                       ("gamma=abc", "expected float, got 'abc'")):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_opts("fedproto", text, base)


def test_tune_deploy_selects_rounds_as_the_site_runtime_does(monkeypatch):
    """studies/proto_tuning/tune_deploy.py's post-hoc rule equals SiteRuntime.deploy_round's: best own-val balanced accuracy,
    ties -> the later round, None -> -1, a one-class validation split -> the last round."""
    from studies.proto_tuning.tune_deploy import select_round

    assert select_round([0.4, 0.6, None, 0.6, 0.3], 3) == 3
    assert select_round([None, None], 2) == 1
    assert select_round([0.9, 0.1, 0.2], 1) == 2
    assert select_round([0.7, 0.1, 0.2], 2) == 0


def test_tune_deploy_smoothed_rule_and_rerank_of_saved_records(monkeypatch, tmp_path):
    """The smoothed best_val (eighth pass): window 0 is the current rule; window 1 ranks 3-round means (hand values:
    0.6, 0.5, 0.433, 0.567, 0.7, 0.7 -> the later of the tied last two); --rerank scores the picked rounds."""
    import json

    from studies.proto_tuning.tune_deploy import rerank, select_round, select_round_window

    curve = [0.9, 0.3, 0.3, 0.7, 0.7, 0.7]
    assert select_round_window(curve, 2, 0) == select_round(curve, 2) == 0
    assert select_round_window(curve, 2, 1) == 5
    # window means 0.25, 0.5, 0.667, 0.5, 0.25 -> round 2; exact ties (values exact in binary: window means 0.5, 0.333,
    # 0.333, 0.333, 0.5) go to the later round
    assert select_round_window([0.0, 0.5, 1.0, 0.5, 0.0], 2, 1) == 2
    assert select_round_window([0.5, 0.5, 0.0, 0.5, 0.5], 2, 1) == 4
    # windows of equal sums whose float means differ in the last bit still tie (-> later)
    assert float(np.mean([0.1, 0.2, 0.3])) != float(np.mean([0.3, 0.2, 0.1]))
    assert select_round_window([0.1, 0.2, 0.3, 0.0, 0.3, 0.2, 0.1], 2, 1) == 5
    assert select_round_window(curve, 1, 1) == 5 and select_round_window([0.9, 0.1, 0.1], 1, 0) == 2
    recs = [{"val_bal": v, "val_classes": 2, "others_bal": 0.1 * i, "others_single": i == 0}
            for i, v in enumerate(curve)]
    f = tmp_path / "deploy.jsonl"
    f.write_text(json.dumps({"method": "local", "seed": 0, "per_round": {"site-1": recs}}) + "\n")
    rows = rerank(str(f), windows=(0, 1), min_rounds=(2, 9))
    assert rows[0] == "| rule | local seed 0 | mean | single-class on others' val |"
    assert rows[2] == "| last | 0.500 | 0.5000 | 0 |"
    assert rows[3] == "| window 0 (= best_val) | 0.000 | 0.0000 | 1 |"
    assert rows[4] == "| window 1 | 0.500 | 0.5000 | 0 |"
    assert rows[5] == "| best_val, r >= 2 | 0.500 | 0.5000 | 0 |"  # rounds 2-5: 0.3, 0.7, 0.7, 0.7 -> 5
    assert rows[6] == "| best_val, r >= 9 | 0.500 | 0.5000 | 0 |"  # past the last round -> the last round
    # bad records files: one line naming the file (and the line)
    good = {"val_bal": 0.5, "val_classes": 2, "others_bal": 0.5, "others_single": False}
    later_bad = json.dumps({"method": "local", "seed": 0, "per_round": {"site-1": [good, {**good, "others_bal": None}]}})
    for text, says in (("", "holds no records"), ("{not json\n", "line 1 is not a --json record: not JSON"),
                       ('{"seed": 0}\n', "no method"),
                       ('{"method": "local", "seed": 0, "per_round": {"site-1": [{"val_bal": 1}]}}\n', "round 0 lacks"),
                       (later_bad + "\n", "site site-1 round 1 lacks"),
                       (json.dumps({"method": "local", "seed": 0, "per_round": {"site-1": [{**good, "val_bal": True}]}})
                        + "\n", "round 0 lacks"),
                       ('{"method": "local", "seed": 0, "per_round": {"site-1": [{"val_bal": NaN, "val_classes": 2, '
                        '"others_bal": 0.5, "others_single": false}]}}\n', "round 0 lacks"),
                       (json.dumps({"method": "local", "seed": 0, "per_round": {"site-1": [{**good, "others_bal": 7.5}]}})
                        + "\n", "round 0 lacks"),
                       (json.dumps({"method": None, "seed": 0, "per_round": {"site-1": [good]}}) + "\n", "no method"),
                       (2 * (json.dumps({"method": "local", "seed": 0, "per_round": {"site-1": [good]}}) + "\n"),
                        "two records of local seed 0")):
        f.write_text(text)
        with pytest.raises(SystemExit, match=says):
            rerank(str(f))
    with pytest.raises(SystemExit, match="no records file"):
        rerank(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit, match="is a folder"):
        rerank(str(tmp_path))
    with pytest.raises(SystemExit, match="needs a records file"):
        rerank("")
    f.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SystemExit, match="not a text"):
        rerank(str(f))


def test_augment_accuracy_refuses_bad_seeds_and_missing_runs_in_one_line(tmp_path, _run):
    """augment_accuracy.py: a malformed or repeated --seeds, and --no-run without finished runs, exit 2 with one
    line (they were tracebacks: int('a'), open(.../test_predictions.csv))."""
    for seeds in ("a", "0,0", ""):
        rc, err = _run("augment_accuracy.py", "--seeds", seeds, "--no-run", "--out", tmp_path)
        assert rc == 2 and f"got {seeds!r}" in err and len(err.splitlines()) == 1, err
    (tmp_path / "monai_s0").mkdir()
    (tmp_path / "monai_s0" / "test_predictions.csv").write_text("site,index,label,p_PNEUMONIA\n")
    rc, err = _run("augment_accuracy.py", "--seeds", "0", "--no-run", "--out", tmp_path)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{tmp_path / 'monai_s0' / 'metrics.json'} is missing (3 file(s) in all)" in err


def test_bench_startup_help_explains_instead_of_running():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "studies.speed.bench_startup", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith("usage: bench_startup.py") and "CXR_SCAN_WORKERS" in r.stdout
    assert "reached simulator_run" not in r.stdout


def test_tune_logit_adjust_hand_case(monkeypatch):
    """Post-hoc logit adjustment (Menon et al. 2021, Eq. 3): logits (2, 0, 1), training counts (90, 10, 0), tau 1 ->
    (2 - ln .9, 0 - ln .1, 1 - ln .9) = (2.105, 2.303, 1.105): class 1; tau 0 -> class 0; the absent class gets the
    majority's log prior (no boost); no training images is refused."""
    from studies.proto_tuning.tune_logit_adjust import adjusted_predictions

    L = np.array([[2.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert adjusted_predictions(L, np.array([90, 10, 0]), 1.0).tolist() == [1, 1]
    assert adjusted_predictions(L, np.array([90, 10, 0]), 0.0).tolist() == [0, 2]
    # tau 0.5 on (0, 0, 1): (0.053, 1.151, 1.053) -> the rare class 1 overtakes the absent class 2's logit lead
    assert adjusted_predictions(L[1:], np.array([90, 10, 0]), 0.5).tolist() == [1]
    with pytest.raises(ValueError, match="no training images"):
        adjusted_predictions(L, np.array([0, 0, 0]), 1.0)


def test_tune_logit_adjust_bad_input_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    """A missing folder, a manifest without labels, a missing validation image, a corrupt model file and non-finite
    --taus: exit 2 with one line naming the folder / file / option (were tracebacks)."""
    from PIL import Image

    from studies.proto_tuning import tune_logit_adjust as tla

    def run(*args):
        with pytest.raises(SystemExit) as e:
            tla.main(list(args))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        return err

    assert "no folder" in run("--compare", str(tmp_path / "nope"))
    cmp_dir = tmp_path / "cmp"
    models = cmp_dir / "seed0" / "local" / "models"
    models.mkdir(parents=True)
    (models / "site-1_deployed.pt").write_bytes(b"not a model")
    assert "no partition manifests" in run("--compare", str(cmp_dir))
    sites = cmp_dir / "seed0" / "partition" / "sites"
    sites.mkdir(parents=True)
    img = tmp_path / "a.png"
    Image.new("L", (8, 8), 128).save(img)
    man = sites / "site-1.csv"
    man.write_text(f"path,label,split\n{img},x,train\n")
    assert "integer label" in run("--compare", str(cmp_dir))
    man.write_text(f"path,label,split\n{img},0,train\n{tmp_path / 'gone.png'},1,val\n")
    assert "gone.png does not exist" in run("--compare", str(cmp_dir))
    man.write_text(f"path,label,split\n{img},0,train\n{img},1,val\n")
    assert "site-1_deployed.pt: cannot load the model" in run("--compare", str(cmp_dir))
    assert "finite" in run("--compare", str(cmp_dir), "--taus", "0,inf")
    assert "comma-separated" in run("--compare", str(cmp_dir), "--taus", "1,,2")


def test_shortcut_probe_transforms_and_pooled_change(monkeypatch):
    """flip reverses the columns; the 6 % shift of a 50-px image moves the content 3 px and zero-fills the vacated
    border; the pooled change is the mean over sites of each site's mean change of p(its minority classes)."""
    import torch

    from studies.shortcut.shortcut_probe import summary, transform

    X = torch.arange(50.0).repeat(1, 1, 50, 1)  # column index as the pixel value
    assert torch.equal(transform(X, "flip")[0, 0, 0], torch.arange(49.0, -1.0, -1.0))
    ones = torch.ones(1, 1, 50, 50)
    sh = transform(ones, "shift")[0, 0]
    assert torch.allclose(sh[3:-4, :-4], torch.ones(43, 46), atol=1e-5)  # interior kept
    assert sh[:, -3:].abs().max() < 1e-5 and sh[-3:, :].abs().max() < 1e-5  # 3-px zero border (right, bottom)
    y = np.zeros(2, int)
    base = np.array([[0.5, 0.5], [0.5, 0.5]])
    sites = {"a": {"minority": [0], "y": y, "p": {"none": base, **{t: base + [[0.2, -0.2], [0.4, -0.4]]
                                                                    for t in ("flip", "shift", "rotate+shift")}}},
             "b": {"minority": [1], "y": y, "p": {"none": base, **{t: base for t in ("flip", "shift", "rotate+shift")}}},
             "c": {"minority": [], "y": y, "p": {"none": base, **{t: base + 0.3 for t in ("flip", "shift", "rotate+shift")}}}}
    res = summary(sites, n_boot=50)
    assert res["flip"]["mean_change"] == pytest.approx((0.3 + 0.0) / 2)  # site c (no minority class) is left out
    assert res["flip"]["per_site"] == pytest.approx({"a": 0.3, "b": 0.0})


def test_shortcut_probe_paired_arms_hand_case(monkeypatch):
    """B - A paired by (run = seed, site), every site scoring the same images: balanced accuracies B - A are +0.5 and
    0 (run 0) and -0.5 (run 1); the mean over seeds of the per-seed means is (0.25 - 0.5) / 2. A site missing from
    arm B is not a pair; 2 seeds give no interval and no verdict; one shared image pool with seeds as clusters."""
    from studies.shortcut.shortcut_probe import paired_arms

    y = np.array([0, 0, 1, 1])
    right, zero = np.eye(2)[y], np.eye(2)[[0, 0, 0, 0]]  # balanced accuracy 1 / 0.5

    def site(p):
        return {"y": y, "p": {"none": p}}
    a = [{"s1": site(zero), "s2": site(right), "s3": site(right)}, {"s1": site(right)}]
    b = [{"s1": site(right), "s2": site(right)}, {"s1": site(zero)}]
    d = paired_arms(a, b, "balanced_accuracy", n_boot=20)
    assert d["n_pairs"] == 3 and d["diff"] == pytest.approx(-0.125)
    assert d["per_seed"] == pytest.approx({"0": 0.25, "1": -0.5}) and d["verdict"] is None and not d["reliable"]
    with pytest.raises(ValueError, match="different images"):
        paired_arms(a, [{"s1": {"y": y[::-1], "p": {"none": right}}}, {}], "auc")

@pytest.mark.parametrize("value", ["-1", "x"])
def test_server_scaling_refuses_negative_distill_steps_before_any_process(value, capsys, monkeypatch):
    """--distill-steps -1 started a process per site count, each failed inside the distillation, and the benchmark
    exited 1 (failed) for what is bad input: argparse refuses it (exit 2, one line naming the option)."""
    import subprocess

    from benchmarks import bench_server_scaling

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a run"))
    with pytest.raises(SystemExit) as e:
        bench_server_scaling.main(["--sites", "2,3", "--distill-steps", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"argument --distill-steps: (must be an integer >= 0|expected an integer)", err), err
