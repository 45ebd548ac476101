"""OHFL with distillation as a federation: a mixed-family job (cnn, cnn, densenet) end to end in the simulator,
then `evaluate` with the site-ensemble and fusion-alone references."""
from __future__ import annotations

import json

import pytest
import torch

from tests.sim_helpers import assert_canonical, load_metrics, make_partition, run_cli

torch.set_num_threads(1)


@pytest.mark.slow
def test_mixed_family_ohfl_job_in_simulator_then_evaluate(data_root, tmp_path):
    from nvflare_jobs.profiles import write_profile

    part = make_partition(data_root, tmp_path / "p3", 3)
    profile = write_profile(part, tmp_path / "profile", "ohfl", "binary", [32, 48],
                            {"batch_size": 16, "local_epochs": 1, "finetune_epochs": 1, "seed": 0, "threads": 1,
                             "max_train_images": 24, "feature_dim": 8},
                            families=["cnn", "cnn", "densenet"])
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--profile", str(profile), "--probe",
                str(data_root / "chest_xray_224"), "--probe-size", "8", "--distill-probe-size", "16",
                "--distill-steps", "2", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    assert m["groups"] == {"cnn": ["site-1", "site-2"], "densenet": ["site-3"]}
    d = m["distillation"]
    assert d["cnn"]["start"] == "fusion" and d["densenet"]["start"] == "site site-3"
    for g in ("cnn", "densenet"):  # every upload teaches every group's student, at the group's own sizes
        assert d[g]["teachers"] == sites and 1 <= d[g]["steps_run"] <= 2 and d[g]["mode"] == "probe"
        assert (run / "global_models" / f"{g}.pt").is_file() and (run / "global_models" / f"{g}_fused.pt").is_file()
    assert m["server_seconds"]["distillation"] > 0
    for s, fam in zip(sites, ("cnn", "cnn", "densenet")):  # each site received its own family's global model
        b = m["sites"][s]
        assert b["model"]["family"] == fam and b["global_zero_shot"]["n"] == b["n_test"]
    # what a site uploads does not change: its own model, once
    from hfl_components.models import build_model

    specs = [json.loads((run / "resolved_configs" / f"{s}.json").read_text())["model"] for s in sites]
    assert m["bytes_uploaded"] == sum(4 * sum(v.numel() for v in build_model(sp).state_dict().values())
                                      for sp in specs)
    r = run_cli("evaluate", "--run", str(run), "--data", str(data_root / "chest_xray_224"), "--part", "tuning",
                "--max-images", "24",
                "--n-boot", "0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summ = json.loads(next((run / "external").glob("*/summary.json")).read_text())["models"]
    assert summ["ensemble"]["members"] == [f"{s}_local" for s in sites]
    assert {"global", "fused"} <= set(summ)
    assert summ["global"]["gap_to_ensemble_auc"] == pytest.approx(summ["ensemble"]["auc"] - summ["global"]["auc"])
