"""`cxr-hfl site privacy-audit`: a site attacks model files with its own images (train = members, test =
non-members), writes JSON / CSV / PNG and sends nothing; bad input is one line and exit 2."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from tests.deploy_helpers import tiny_manifests, tiny_profile

pytestmark = [pytest.mark.privacy, pytest.mark.realdata]
SPEC = {"family": "cnn", "depth": "shallow", "width": 0.5, "num_classes": 2}


def _site(tmp_path, data_root):
    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"], n_train=20)
    return tiny_profile(man, tmp_path / "profile") / "hospital-a.yaml"


def _model_file(tmp_path, name="m", labels="binary", dp=None):
    from hfl_components.models import build_model
    from hfl_components.models.files import save_model_file

    spec = {**SPEC, "num_classes": 3 if labels == "subtype" else 2}
    torch.manual_seed(0)
    f = tmp_path / f"{name}.pt"
    prov = {"method": "local", "dp": dp} if dp else None
    save_model_file(f, spec, build_model(spec).state_dict(), input_size=32, labels=labels, kind="deployed",
                    **({"provenance": prov} if prov else {}))
    return f


def test_privacy_audit_writes_json_csv_png_with_loss_attack_metrics(tmp_path, data_root, capsys):
    from nvflare_jobs.cli import main

    cfg = _site(tmp_path, data_root)
    files = [_model_file(tmp_path, "upload"), _model_file(tmp_path, "other", labels="subtype")]
    out = tmp_path / "audit"
    assert main(["site", "privacy-audit", "--config", str(cfg), "--model", str(files[0]), "--model", str(files[1]),
                 "--out", str(out), "--boot", "50"]) == 0
    said = capsys.readouterr().out
    assert "nothing sent" in said and "loss_threshold" in said and "refused" in said
    doc = json.loads((out / "privacy_audit.json").read_text())
    assert doc["sent"] == "nothing" and doc["canary"] is None
    up, other = doc["models"]
    assert other["refused"].startswith("site hospital-a uses labels 'binary'")
    a = up["attacks"][0]
    # a zero class layer gives every image the same loss: the attack is exactly at chance
    assert a["attack"] == "loss_threshold" and a["auc"] == 0.5 and a["tpr_at_fpr"] == 0.0
    assert (a["n_members"], a["n_nonmembers"]) == (20, 6) and a["fpr_resolution"] == pytest.approx(1 / 6)
    rows = list(csv.DictReader((out / "privacy_audit.csv").open()))
    assert [(r["model"], r["attack"]) for r in rows] == [("upload", "loss_threshold"), ("other", "")]
    assert (out / "privacy_audit_roc.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_privacy_audit_lira_on_public_shadows_and_one_run_canary_bound_under_dp(tmp_path, data_root):
    """LiRA with two shadows trained on the public probe part (320 images decoded) and a one-run canary audit
    trained under dp: about a minute on one busy CPU."""
    from hfl_components.privacy import DPSpec
    from nvflare_jobs.privacy_audit import privacy_audit

    cfg = _site(tmp_path, data_root)
    files = [_model_file(tmp_path, "upload")]
    doc = privacy_audit(cfg, "hospital-a", [files[0]], tmp_path / "audit2", probe=data_root / "chest_xray_224",
                        shadows=2, shadow_epochs=1, canary_epochs=1, n_boot=50,
                        dp=DPSpec(epsilon=8.0, accountant="rdp"))
    lira = doc["models"][0]["attacks"][1]
    assert lira["attack"] == "lira_offline" and lira["shadows"] == 2 and lira["pool_images"] == 320
    assert 0.0 <= lira["auc_low"] <= lira["auc"] <= lira["auc_high"] <= 1.0
    c = doc["canary"]
    assert c["canaries"] == 20 and c["guesses"] == 4 and 4 <= c["trained_on"] < 20
    assert c["dp"]["steps"] == c["dp"]["planned_steps"] and c["accountant_epsilon"] <= 8.0
    assert c["epsilon_lower_bound"] <= c["accountant_epsilon"]


@pytest.mark.parametrize("extra, says", [
    (["--shadows", "2"], "--shadows needs --probe"),
    (["--fpr", "1.5"], "--fpr 1.5: out of range"),
    (["--boot", "0"], "--boot 0: out of range"),
    (["--model", "NOPE.pt"], "NOPE.pt: no such file"),
])
def test_privacy_audit_bad_input_is_one_line_and_exit_2(tmp_path, data_root, capsys, extra, says):
    from nvflare_jobs.cli import main

    cfg = _site(tmp_path, data_root)
    f = _model_file(tmp_path)
    assert main(["site", "privacy-audit", "--config", str(cfg), "--model", str(f), "--out", str(tmp_path / "o"),
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cxr-hfl site privacy-audit: ") and says in err[0]


def test_a_refused_canary_budget_leaves_no_output_folder(tmp_path, data_root, capsys):
    """The canary run's dp budget is checked after the attacks (a batch larger than the training set): the audit is
    refused in one line (exit 2) and no empty --out folder is left behind."""
    from nvflare_jobs.cli import main

    cfg = _site(tmp_path, data_root)
    import re

    text = re.sub(r"(?m)^batch_size:.*$", "batch_size: 64", cfg.read_text())
    assert "batch_size: 64" in text  # the profile sets a batch size; a second key would be refused as YAML
    cfg.write_text(text + "\ndp: {epsilon: 8}\n")
    out = tmp_path / "o"
    assert main(["site", "privacy-audit", "--config", str(cfg), "--model", str(_model_file(tmp_path)),
                 "--out", str(out), "--canary-epochs", "1", "--boot", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch size 64 exceeds" in err[0], err
    assert not out.exists()
