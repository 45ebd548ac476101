"""Site operations (fast): the site keys device/amp, mixed precision, the server's fusion device, `cxr-hfl site
check`, an unreadable image reported as the file and reason (not MONAI's wrapper), the example consortium profile,
export-job refusing site options, `poc prepare` reporting every problem at once, and the POC CLI's one-line answers
when the POC is down. CUDA behaviour is checked by test_cuda_site_training_and_fusion_match_cpu (skipped without a
GPU)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.deploy_helpers import REPO_ROOT, run_cli, tiny_manifests, tiny_profile

CUDA = torch.cuda.is_available()


def base_method(**kw):
    return {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}, **kw}


# ------------------------------------------------------------------------------------------------ part 4: devices
def test_device_and_amp_keys_are_validated_naming_the_file(tmp_path):
    from hfl_components.flare.site_config import SiteConfigError, load_site_config, validate_site_config

    assert validate_site_config(base_method(), "s", check_files=False)["device"] == "auto"
    assert validate_site_config(base_method(), "s", check_files=False)["amp"] is False
    for ok in ("cpu", "cuda", "cuda:3", "AUTO"):
        assert validate_site_config(base_method(device=ok), "s", check_files=False)["device"] == ok.lower()
    f = tmp_path / "hospital-a.yaml"
    for bad in ("gpu", "cuda:x", "cuda:", 0, "mps"):
        f.write_text(yaml.safe_dump(base_method(device=bad)))
        with pytest.raises(SiteConfigError) as e:
            load_site_config("hospital-a", f, check_files=False)
        assert str(f) in str(e.value) and "'device'" in str(e.value) and "auto | cpu | cuda | cuda:N" in str(e.value)
    f.write_text(yaml.safe_dump(base_method(amp="yes")))
    with pytest.raises(SiteConfigError, match="'amp': must be true or false"):
        load_site_config("hospital-a", f, check_files=False)


def test_resolve_device_follows_what_torch_sees():
    from hfl_components.training import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    if not CUDA:
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"only {n} CUDA device"):
            resolve_device(f"cuda:{n}")


def _tiny_loader(n=24, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, size, size, generator=g)
    y = torch.tensor([i % 2 for i in range(n)])
    x[y == 1] += 0.5  # a learnable difference between the classes
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, n, 8)]


def _model(seed=0):
    from hfl_components.models import build_model

    torch.manual_seed(seed)
    return build_model({"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2})


def test_mixed_precision_on_cpu_runs_in_bfloat16_close_to_float32():
    """amp=True autocasts the forward pass (bfloat16 on the CPU): the losses differ from float32 by rounding only;
    the weights stay float32."""
    from hfl_components.training import train_local

    ref = train_local(_model(), _tiny_loader(16), 1, lr=0.01, seed=0)
    m = _model()
    amp = train_local(m, _tiny_loader(16), 1, lr=0.01, seed=0, amp=True)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    a, b = np.array([h["loss"] for h in ref]), np.array([h["loss"] for h in amp])
    assert np.all(np.isfinite(b))
    assert np.abs(a - b).max() < 0.05 * a.max(), (a, b)
    assert np.abs(a - b).max() > 0, "autocast changed nothing: bfloat16 was not used"


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch")
def test_cuda_site_training_and_fusion_match_cpu(tmp_path, data_root):
    """On a GPU: a site runtime with device cuda trains and evaluates on the GPU, saves a CPU state and gives the
    CPU's numbers (float32, same seed) up to GPU rounding; amp trains in float16; the server's fusion with
    device cuda gives the CPU's fused model."""
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.fusion import aggregate_models
    from hfl_components.training import train_local
    from hfl_components.flare.site_config import load_site_config

    ref = train_local(_model(), _tiny_loader(), 2, lr=0.01, seed=0)
    mc = _model()
    gpu = train_local(mc, _tiny_loader(), 2, lr=0.01, seed=0, device="cuda")
    assert next(mc.parameters()).is_cuda
    assert np.allclose([h["loss"] for h in ref], [h["loss"] for h in gpu], rtol=1e-3, atol=1e-4)
    amp = train_local(_model(), _tiny_loader(), 2, lr=0.01, seed=0, device="cuda", amp=True)
    assert np.allclose([h["loss"] for h in ref], [h["loss"] for h in amp], rtol=0.05)

    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"])
    prof = tiny_profile(man, tmp_path / "prof", "local", **{"hospital-a": {"device": "cuda", "amp": True}})
    rt = SiteRuntime(load_site_config("hospital-a", prof / "hospital-a.yaml"), tmp_path / "ws")
    assert rt.device.type == "cuda"
    hist = rt.train(1, 0.01)
    assert np.isfinite(hist[0]["loss"]) and next(rt.model.parameters()).is_cuda
    m = rt.evaluate("test")
    assert m["n"] == 6
    rt.save_state(deployed=True)
    blob = torch.load(rt.state_dir / "deployed_model.pt", map_location="cpu", weights_only=True)
    assert all(not v.is_cuda for v in blob["state_dict"].values())

    from hfl_components.models import build_model

    specs = [{"family": "cnn", "depth": d, "width": 0.5, "in_channels": 1, "num_classes": 2}
             for d in ("shallow", "medium")]
    models = []
    for i, s in enumerate(specs):
        torch.manual_seed(i)
        models.append({"name": f"s{i}", "spec": s, "state_dict": build_model(s).state_dict(), "n_samples": 10 + i,
                       "val_acc": 0.5})
    probe = torch.rand(16, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    _, sd_cpu, _ = aggregate_models(models, probe=probe, repair=True, device="cpu")
    _, sd_gpu, _ = aggregate_models(models, probe=probe, repair=True, device="cuda")
    for k in sd_cpu:
        assert not sd_gpu[k].is_cuda
        assert torch.allclose(sd_cpu[k], sd_gpu[k], rtol=1e-3, atol=1e-4), k


def test_simulate_passes_the_gpu_option_and_the_server_device_through():
    from nvflare_jobs.cli import build_parser
    from nvflare_jobs.jobs import make_controller

    a = build_parser().parse_args(["simulate", "--method", "ohfl", "--out", "x", "--gpu", "0,1",
                                   "--server-device", "cuda:1"])
    assert a.gpu == "0,1" and a.server_device == "cuda:1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--method", "ohfl", "--out", "x", "--server-device", "gpu"])
    prof = {s: {"model": {"family": "cnn", "depth": "shallow", "width": 1.0, "in_channels": 1, "num_classes": 2}}
            for s in ("a", "b")}
    ctl = make_controller("ohfl", prof, {"probe": "generated", "server_device": "cuda:1"})
    assert ctl.fusion_device == "cuda:1"


# ------------------------------------------------------------------------------------------------ part 6: site check
def test_site_check_on_real_images_reports_counts_sizes_model_and_device(tmp_path, data_root):
    from nvflare_jobs.site_check import check_site, format_report

    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"])
    prof = tiny_profile(man, tmp_path / "prof", "local")
    rep = check_site(prof / "hospital-a.yaml")
    assert rep["errors"] == [] and rep["site"] == "hospital-a"
    assert rep["counts"] == {"train": {"NORMAL": 4, "PNEUMONIA": 4}, "val": {"NORMAL": 2, "PNEUMONIA": 2},
                             "test": {"NORMAL": 3, "PNEUMONIA": 3}}
    assert rep["formats"] == {"JPEG": 18} and rep["unreadable"] == []
    assert rep["resolution"]["width"] == {"min": 224, "median": 224.0, "max": 224}
    assert rep["device"].startswith("cuda:0 (") if CUDA else rep["device"] == "cpu"
    assert rep["model"]["family"] == "cnn" and rep["input_size"] == 32 and rep["n_params"] > 0
    # the default "all" augments every class (with "auto", the classes smaller than the largest: none here)
    assert rep["augment_classes"] == ["NORMAL", "PNEUMONIA"] and rep["augment_config"] == "all"
    screen = format_report(rep)
    assert len(screen.splitlines()) <= 25 and "result: OK" in screen
    assert "augment     training images of NORMAL, PNEUMONIA (augment_classes: all)" in screen
    cfg = yaml.safe_load((prof / "hospital-a.yaml").read_text())
    (tmp_path / "hospital-a.yaml").write_text(yaml.safe_dump({**cfg, "augment_classes": "auto"}))
    rep_auto = check_site(tmp_path / "hospital-a.yaml", read_images=False)  # balanced split: no minority class
    assert rep_auto["augment_classes"] == [] and rep_auto["errors"] == []
    # no patient data on the screen: no image path, file name or patient id of the manifest
    with open(man["hospital-a"]) as fh:
        for row in csv.DictReader(fh):
            assert Path(row["path"]).name not in screen and row["patient_id"] not in screen


def test_site_check_names_a_missing_image_and_a_bad_key_and_exits_non_zero(tmp_path, data_root):
    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"])
    rows = man["hospital-a"].read_text().splitlines()
    gone = rows[5].split(",")[0].replace("/train/", "/train_gone/")
    rows[5] = ",".join([gone, *rows[5].split(",")[1:]])
    man["hospital-a"].write_text("\n".join(rows) + "\n")
    prof = tiny_profile(man, tmp_path / "prof", "local")
    r = run_cli("site", "check", "--config", str(prof / "hospital-a.yaml"), "--json", str(tmp_path / "rep.json"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"line 6: {gone}: cannot open file" in r.stdout and "17 read, 1 unreadable" in r.stdout
    assert "result: FAILED" in r.stdout and "Traceback" not in r.stderr
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert [(u["line"], u["path"]) for u in rep["unreadable"]] == [(6, gone)]

    from nvflare_jobs.site_check import check_site

    cfg = yaml.safe_load((prof / "hospital-a.yaml").read_text())
    cfg["batchsize"] = 8
    bad = tmp_path / "hospital-a.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    rep = check_site(bad)
    assert len(rep["errors"]) == 1 and str(bad) in rep["errors"][0] and "'batchsize'" in rep["errors"][0]


def test_unreadable_image_is_reported_as_the_file_and_reason_not_monai_wrapper(tmp_path, data_root):
    """The site's task fails with the ImageReadError (file, reason, manifest line); what the server records has
    the reason without the path."""
    from chest_xray import ImageReadError
    from hfl_components.flare.site_tasks import SiteRuntime, describe_error
    from hfl_components.flare.privacy import redact_paths
    from hfl_components.flare.site_config import load_site_config

    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"])
    rows = man["hospital-a"].read_text().splitlines()
    gone = str(tmp_path / "missing_folder" / "person1_virus_1.jpeg")
    rows[3] = ",".join([gone, *rows[3].split(",")[1:]])
    man["hospital-a"].write_text("\n".join(rows) + "\n")
    prof = tiny_profile(man, tmp_path / "prof", "local")
    rt = SiteRuntime(load_site_config("hospital-a", prof / "hospital-a.yaml"), tmp_path / "ws")
    with pytest.raises(Exception) as e:
        rt.loader("train")
    msg = describe_error(e.value)
    assert msg.startswith(f"ImageReadError: {gone}: cannot open file"), msg
    assert "line 4, train split" in msg and "Lambdad" not in msg and "applying transform" not in msg
    # MONAI's wrapper around the same error is unwrapped as well (e.g. a lazily cached dataset during training)
    try:
        try:
            raise ImageReadError(gone, "truncated JPEG")
        except ImageReadError as inner:
            raise RuntimeError("applying transform <monai.transforms.Lambdad object at 0x7f>") from inner
    except RuntimeError as wrapped:
        assert describe_error(wrapped) == f"ImageReadError: {gone}: truncated JPEG"
    sent = redact_paths(f"site hospital-a: task local_train failed: {msg}")
    assert "missing_folder" not in sent and "person1_virus_1" not in sent and "cannot open file" in sent


# ------------------------------------------------------------------------------------------------ part 5: deployment
def test_example_consortium_profiles_name_the_six_hospitals_and_export(tmp_path):
    from nvflare_jobs.deploy import check_job_folder, load_project
    from hfl_components.flare.site_config import load_profile

    hospitals = [q["name"] for q in load_project(REPO_ROOT / "site_configs" / "project.yml")["participants"]
                 if q["type"] == "client"]
    for name in ("consortium", "consortium_proto"):
        prof = load_profile(REPO_ROOT / "site_configs" / name, check_files=False, require_data=False)
        assert sorted(prof) == sorted(hospitals)
        assert all(c["data"]["manifest"] is None for c in prof.values()), "a coordinator's profile has no data paths"
    r = run_cli("export-job", "--method", "ohfl", "--profile", "site_configs/consortium/", "--probe", "generated",
                "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    meta = check_job_folder(tmp_path / "jobs" / "cxr_hfl_ohfl")
    assert sorted(s for t in meta["deploy_map"].values() for s in t if s != "server") == sorted(hospitals)
    assert "--startup-kit" in r.stdout and "each site sends: one trained model" in r.stdout


def test_export_job_refuses_site_options_with_a_profile(tmp_path, capsys):
    from nvflare_jobs.cli import main

    rc = main(["export-job", "--method", "local", "--profile", str(REPO_ROOT / "site_configs" / "consortium"),
               "--batch-size", "8", "--max-train-images", "10", "--input-sizes", "64", "--out", str(tmp_path / "jobs")])
    err = capsys.readouterr().err
    assert rc == 2
    for opt, key in (("--batch-size", "batch_size"), ("--max-train-images", "max_train_images"),
                     ("--input-sizes", "input_size")):
        assert f"{opt} (site key {key})" in err
    assert not (tmp_path / "jobs").exists(), "nothing is exported when options would be dropped"


def test_poc_prepare_reports_every_problem_at_once(tmp_path, data_root):
    from nvflare_jobs.deploy import DeployError, Poc

    man = tiny_manifests(data_root, tmp_path / "data", ["site-1", "site-2", "site-3"])
    prof = tiny_profile(man, tmp_path / "prof", "local", **{"site-3": {"device": "tpu"}})
    (prof / "site-1.yaml").write_text((prof / "site-1.yaml").read_text() + "epochs: 3\n")
    rows = man["site-2"].read_text().splitlines()
    rows[2] = rows[2].replace("/train/", "/gone/")
    man["site-2"].write_text("\n".join(rows) + "\n")
    seen = []
    with pytest.raises(DeployError) as e:
        Poc(tmp_path / "poc").prepare(prof, report=lambda site, r: seen.append(site))
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "site-1.yaml key 'epochs'" in msg and "site-3.yaml key 'device'" in msg
    assert "site site-2: 1 of 18 images cannot be read" in msg
    assert seen == ["site-2"], "the valid config's images were read; invalid configs were reported, not checked"
    assert not (tmp_path / "poc" / "nvflare_poc").exists(), "nothing provisioned for a broken profile"


def test_poc_commands_answer_in_one_line_when_the_poc_is_down(tmp_path, capsys):
    """A prepared POC whose server is not running: submit/download/status say so in one line; stop says it was
    already stopped."""
    ws = tmp_path / "poc"
    prod = ws / "nvflare_poc" / "p" / "prod_00"
    (prod / "server").mkdir(parents=True)
    kit = prod / "coordinator"
    kit.mkdir()
    ws.joinpath("cxr_hfl_poc.json").write_text(json.dumps({
        "prod_dir": str(prod), "sites": ["site-1"], "admin_kit": str(kit), "coordinator": "c", "jobs": [
            {"job_id": "abc"}]}))
    job = tmp_path / "job"
    (job / "app_site-1" / "config").mkdir(parents=True, exist_ok=True)
    (job / "meta.json").write_text(json.dumps({"name": "j", "deploy_map": {"app_site-1": ["site-1"]}}))
    from nvflare_jobs.cli import main

    for args in (["submit", "--job", str(job)], ["download"]):
        rc = main(["poc", *args, "--workspace", str(ws)])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1, err
        assert "is not running: its server is down" in err and "{" not in err and "nvflare " not in err
    rc = main(["poc", "status", "--workspace", str(ws)])
    out = capsys.readouterr().out
    assert rc == 0 and ": stopped;" in out and "running" not in out
    rc = main(["poc", "stop", "--workspace", str(ws)])
    assert rc == 0 and "already stopped" in capsys.readouterr().out


def test_run_findings_name_excluded_sites_and_single_class_models():
    from nvflare_jobs.deploy import run_findings

    m = {"excluded_sites": {"site-2": [{"round": 0, "task": "local_train", "reason": "ImageReadError: <path>: x"}]},
         "sites": {"site-1": {"test": {"confusion_matrix": [[3, 0], [3, 0]]}},
                   "site-3": {"test": {"confusion_matrix": [[2, 1], [1, 2]]}}}}
    out = run_findings(m)
    assert out[0] == "site site-2 left out of round 0 (local_train): ImageReadError: <path>: x"
    assert len(out) == 2 and out[1].startswith("WARNING: site-1's deployed model predicts a single class")


def test_site_check_config_path_that_is_a_folder_or_missing_says_which(tmp_path, capsys):
    import argparse

    from nvflare_jobs.commands.site import run_check

    for path, says in ((tmp_path, "a folder, not a <site>.yaml file"), (tmp_path / "none.yaml", "no such file")):
        assert run_check(argparse.Namespace(config=str(path), site=None, no_images=True, json=None)) == 2
        assert capsys.readouterr().err.strip() == f"cxr-hfl site check: --config {path}: {says}"


def test_sample_site_config_shows_the_defaults_of_every_commented_key(tmp_path):
    """The template a provisioned kit ships (``<site>.yaml.sample``): each commented ``# key: value`` line is the
    value the site gets when the key is left out (it said ``augment: batch`` while the default is monai, and
    ``local_epochs: 2`` while an absent key means the method's default); the file validates once the manifest
    exists, and it mentions every key of the site config."""
    import re

    from hfl_components.flare.site_config import DEFAULTS, validate_site_config, write_sample_config

    text = write_sample_config(tmp_path, "hospital-a").read_text()
    shown = {m.group(1): yaml.safe_load(m.group(2)) for m in re.finditer(r"^# (\w+): (\S+)", text, re.M)}
    assert shown["augment"] == "monai" and shown["local_epochs"] is None and shown["fast_augment"] is False
    assert {k: v for k, v in shown.items() if k in DEFAULTS} == {k: DEFAULTS[k] for k in shown if k in DEFAULTS}
    assert set(shown) <= set(DEFAULTS), set(shown) - set(DEFAULTS)  # every commented key is a site-config key
    mentioned = set(re.findall(r"^#? ?(\w+):", text, re.M))
    assert set(DEFAULTS) - mentioned == set(), set(DEFAULTS) - mentioned
    cfg = yaml.safe_load(text)
    (tmp_path / "m.csv").write_text("path,label,split\n")
    cfg["data"]["manifest"] = str(tmp_path / "m.csv")
    assert validate_site_config(cfg, "hospital-a", check_files=False)["augment"] == "monai"


@pytest.mark.parametrize("where", ["folder", "missing_parent"])
def test_site_check_refuses_an_unwritable_json_path_before_checking(tmp_path, where):
    """--json naming a folder (or a file in a folder that does not exist): one line naming --json, exit 2, before
    the (possibly long) image check -- not an errno message after it."""
    cfg = tmp_path / "hospital-a.yaml"
    cfg.write_text("data:\n  manifest: /nonexistent/site.csv\n")
    target = tmp_path if where == "folder" else tmp_path / "no_such_dir" / "rep.json"
    r = run_cli("site", "check", "--config", str(cfg), "--json", str(target), "--no-images")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "--json" in err[0] and "Errno" not in err[0], r.stderr
    assert r.stdout == "", r.stdout  # refused before the check ran


@pytest.mark.parametrize("text, says", [
    ("data:\n  manifest: /nonexistent/site.csv\n", "key 'data.manifest'"),
    ("data:\n  manifest: /nonexistent/site.csv\nbatchsize: 8\n", "'batchsize'"),
])
def test_site_check_and_site_score_both_refuse_a_bad_config_as_bad_input(tmp_path, capsys, text, says):
    """The same unreadable config: `site check` and `site score` both exit 2 with one line naming the config
    file and the key (check writes its --json report all the same)."""
    from hfl_components.models import build_model, save_model_file
    from nvflare_jobs.cli import main

    cfg = tmp_path / "hospital-a.yaml"
    cfg.write_text(text)
    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    model = tmp_path / "m.pt"
    save_model_file(model, spec, build_model(spec).state_dict(), input_size=32, labels="binary", site="x")
    for cmd in (["check", "--no-images", "--json", str(tmp_path / "rep.json")], ["score", "--model", str(model)]):
        rc = main(["site", cmd[0], "--config", str(cfg), *cmd[1:]])
        out, err = capsys.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1, (cmd, rc, err)
        assert err.startswith(f"cxr-hfl site {cmd[0]}: ") and str(cfg) in err and says in err, err
    assert json.loads((tmp_path / "rep.json").read_text())["bad_config"] is True


def test_site_check_no_images_names_a_manifest_row_whose_file_does_not_exist(tmp_path, capsys):
    """--no-images decodes nothing but still stats every file: a missing one is named with its manifest line and
    fails the check (exit 1), as an unreadable image does without --no-images; present files pass."""
    from nvflare_jobs.cli import main

    rows = ["path,label,split"]
    for split in ("train", "val", "test"):
        for label in (0, 1):
            (tmp_path / f"{split}_{label}.jpeg").write_bytes(b"")  # exists; --no-images never decodes it
            rows.append(f"{split}_{label}.jpeg,{label},{split}")
    (tmp_path / "site.csv").write_text("\n".join(rows) + "\n")
    cfg = tmp_path / "hospital-a.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"manifest": str(tmp_path / "site.csv")}, "input_size": 32, "threads": 1,
                                   "model": {"family": "cnn", "depth": "shallow", "width": 0.5}}))
    assert main(["site", "check", "--config", str(cfg), "--no-images"]) == 0
    assert "result: OK" in capsys.readouterr().out
    (tmp_path / "site.csv").write_text("\n".join(rows[:3] + ["gone/missing.jpeg,1,train"] + rows[3:]) + "\n")
    rep_file = tmp_path / "rep.json"
    assert main(["site", "check", "--config", str(cfg), "--no-images", "--json", str(rep_file)]) == 1
    out = capsys.readouterr().out
    gone = tmp_path / "gone" / "missing.jpeg"
    assert f"line 4: {gone}: no such file" in out and "result: FAILED (1 errors" in out, out
    assert [(m["line"], m["path"]) for m in json.loads(rep_file.read_text())["missing"]] == [(4, str(gone))]
