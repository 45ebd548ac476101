"""`cxr-hfl compare`: the local+ft control's epoch budget, paired differences, and a real 2-method comparison on a
tiny subset (both methods on the identical partition), its tables, resumption, and the reports it feeds."""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from tests.sim_helpers import run_cli

IMG = '<img src="data:image/png;base64,'


def _args(**kw):
    from nvflare_jobs.compare import CompareOptions

    return CompareOptions(**{"out": "runs/x", "labels": "binary", **kw})


def test_equal_epoch_budgets_by_default(tmp_path):
    """FedAvg rounds x local epochs = Local's epochs = OHFL's local + fine-tuning epochs."""
    from nvflare_jobs.compare import BudgetError, budget_lines, epoch_plan, simulate_options

    plans = {m: epoch_plan(m, _args()) for m in ("local", "local+ft", "fedavg", "ohfl", "fedsaf")}
    assert plans["ohfl"] == {"rounds": 1, "local_epochs": 20, "finetune_epochs": 10, "total_epochs_per_site": 30}
    assert plans["local"] == plans["local+ft"] == {"rounds": 1, "local_epochs": 30, "finetune_epochs": 0,
                                                   "total_epochs_per_site": 30}
    assert plans["fedavg"] == {"rounds": 15, "local_epochs": 2, "finetune_epochs": 0, "total_epochs_per_site": 30}
    assert plans["fedsaf"] == {"rounds": 10, "local_epochs": 3, "finetune_epochs": 0, "total_epochs_per_site": 30}
    assert budget_lines(plans, False)[0] == "equal budgets: every method trains 30 epochs per site"
    a = _args(local_epochs=4, finetune_epochs=3, rounds=7)  # E = 7
    assert epoch_plan("fedavg", a) == {"rounds": 7, "local_epochs": 1, "finetune_epochs": 0,
                                       "total_epochs_per_site": 7}
    assert epoch_plan("fedavg", _args(local_epochs=4, finetune_epochs=3))["rounds"] == 7  # 7 is odd: 1 epoch/round
    with pytest.raises(BudgetError, match="--unequal-budgets"):
        epoch_plan("fedavg", _args(local_epochs=4, finetune_epochs=3, rounds=2))
    opts = simulate_options("fedavg", tmp_path / "d", 5, _args(local_epochs=1, finetune_epochs=1, rounds=1,
                                                                late_wait=60))
    assert (opts["rounds"], opts["local_epochs"], opts["late_wait"]) == (1, 2, 60)
    r = run_cli("compare", "--methods", "fedavg,ohfl", "--local-epochs", "4", "--finetune-epochs", "3", "--rounds", "2",
                "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "does not divide" in r.stderr


def test_a_variants_own_epochs_are_its_budget(tmp_path):
    """A variant that sets its own epochs is planned, listed and run with them (the budget line used to show the
    method's planned 20 + 10 while simulate ran the variant's 25 + 5)."""
    from nvflare_jobs.compare import budget_lines, epoch_plan, simulate_options

    a = _args()
    split = epoch_plan("ohfl:local_epochs=25:finetune_epochs=5", a)
    assert split == {"rounds": 1, "local_epochs": 25, "finetune_epochs": 5, "total_epochs_per_site": 30}
    opts = simulate_options("ohfl:local_epochs=25:finetune_epochs=5", tmp_path / "d", 0, a)
    assert (int(opts["local_epochs"]), int(opts["finetune_epochs"])) == (25, 5)
    assert epoch_plan("ohfl:rounds=4", a)["total_epochs_per_site"] == 30  # one-shot: rounds are not epochs
    short = epoch_plan("fedavg:rounds=10", a)  # 10 rounds x the planned 2 epochs
    assert (short["rounds"], short["local_epochs"], short["total_epochs_per_site"]) == (10, 2, 20)
    lines = budget_lines({"ohfl": epoch_plan("ohfl", a), "fedavg:rounds=10": short}, False)
    assert lines[0] == "budgets differ between methods"
    assert "fedavg:rounds=10: 10 round(s) x 2 local epochs = 20 epochs per site" in lines
    assert epoch_plan("ohfl:local_epochs=x", a) == epoch_plan("ohfl", a)  # left to check_variant, which refuses it


def test_unequal_budgets_need_the_flag(tmp_path):
    from nvflare_jobs.compare import budget_lines, command_for, epoch_plan, simulate_options

    a = _args(local_epochs=4, finetune_epochs=3, rounds=2, max_train_images=20, unequal_budgets=True)
    assert epoch_plan("local", a)["local_epochs"] == 4
    assert epoch_plan("local", a)["total_epochs_per_site"] == 8
    assert epoch_plan("local+ft", a) == {"rounds": 1, "local_epochs": 11, "finetune_epochs": 0,
                                         "total_epochs_per_site": 11}  # Local's 8 + OHFL's 3 fine-tuning epochs
    assert epoch_plan("ohfl", a) == {"rounds": 1, "local_epochs": 4, "finetune_epochs": 3, "total_epochs_per_site": 7}
    opts = simulate_options("local+ft", tmp_path / "d", 5, a)
    assert (opts["local_epochs"], opts["rounds"], opts["seed"]) == (11, 1, 5)
    cmd = command_for("local+ft", tmp_path / "p", opts, tmp_path / "r")
    assert f"--method local --profile {tmp_path / 'p'}" in cmd and "--local-epochs 11 --rounds 1" in cmd
    ohfl = simulate_options("ohfl", tmp_path / "d", 5, a)
    assert "rounds" not in ohfl and ohfl["finetune_epochs"] == 3
    u = _args(unequal_budgets=True)
    plans = {m: epoch_plan(m, u) for m in ("local", "fedavg", "ohfl")}
    assert [p["total_epochs_per_site"] for p in plans.values()] == [20, 6, 30]  # each method's own defaults
    assert budget_lines(plans, True)[0].startswith("UNEQUAL budgets")


def test_paired_difference_ci():
    """Seeds are the clusters: the three sites of a seed are averaged first, then the Student-t interval over the
    five per-seed means (df 4): 0.1, 0.1, 0.2, 0.0, 0.1."""
    from nvflare_jobs.compare import paired_diff

    diffs = {(s, i): m + (i - 1) * 0.05 for s, m in enumerate((0.1, 0.1, 0.2, 0.0, 0.1)) for i in range(3)}
    rows = [{"method": "local", "seed": s, "site": f"site-{i}", "accuracy": 0.6} for s, i in diffs]
    rows += [{"method": "ohfl", "seed": s, "site": f"site-{i}", "accuracy": 0.6 + d} for (s, i), d in diffs.items()]
    d = paired_diff(rows, "ohfl", "accuracy")
    assert d["n"] == 15 and d["mean"] == pytest.approx(0.1) and d["n_seeds"] == 5
    half = 2.7764 * 0.0707106781 / 5 ** 0.5  # t(0.975, 4) * sd of the seed means / sqrt(5)
    assert d["ci_low"] == pytest.approx(0.1 - half, abs=1e-4) and d["ci_high"] == pytest.approx(0.1 + half, abs=1e-4)
    assert d["verdict"] == "better"
    three = paired_diff([r for r in rows if r["seed"] < 3], "ohfl", "accuracy")
    assert three["verdict"] is None and three["per_seed"] == pytest.approx({"0": 0.1, "1": 0.1, "2": 0.2})
    assert paired_diff(rows, "fedavg", "accuracy")["n"] == 0


def test_unknown_method_is_refused(tmp_path):
    r = run_cli("compare", "--methods", "local,fedfoo", "--out", str(tmp_path))
    assert r.returncode == 2 and "fedfoo" in r.stderr


def test_bad_method_variant_is_refused_before_any_run(tmp_path, capsys):
    """A variant's options are checked as ``simulate`` checks them before anything runs: exit 2, one line naming the
    variant and the option, no comparison folder (before: the run started, failed with rc 2 inside simulate.log
    and compare exited 1, possibly hours later)."""
    from nvflare_jobs.cli import main
    from nvflare_jobs.compare import check_variant

    out = tmp_path / "cmp"
    for variant, says in (("ohfl:repair=foo", "option 'repair' (--repair) must be one of ['none', 'layer', 'channel']"),
                          ("fedproto:lambda=-1", "option 'lam' (--lambda): lambda must be a finite number >= 0"),
                          ("ohfl:bogus=1", "unknown option(s) ['bogus'] for ohfl"),
                          ("fedsaf:paper", "option 'paper' is a preset of ohfl"),
                          # compare's own --finetune-epochs (equal budget) contradicts the paper's 50
                          ("ohfl:paper", "option 'paper' runs the paper's pipeline (option 'finetune_epochs' 50)")):
        assert main(["compare", "--methods", f"local,{variant}", "--dry-run", "--out", str(out)]) == 2, variant
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"cxr-hfl compare: variant {variant}: ") and says in err, err
        assert len(err.splitlines()) == 1 and not out.exists(), err
    for ok in ("ohfl", "ohfl:repair=layer:probe_at=largest", "fedproto:gamma=0.5", "local+ft"):
        assert check_variant(ok) is None, ok


def test_a_variants_epochs_out_of_range_are_refused_before_any_run(tmp_path, capsys):
    """``fedavg:rounds=0`` printed "0 round(s) ... = 0 epochs per site" while the job would run 1 round (the job's
    ``rounds or 1``); ``ohfl:finetune_epochs=-1`` printed "+ -1 fine-tuning epochs = 19"; both passed ``--dry-run``.
    Now refused as ``simulate`` refuses the same flags: exit 2, one line naming the variant, no folder."""
    from nvflare_jobs.cli import main

    out = tmp_path / "cmp"
    for variant, says in (("fedavg:rounds=0", "option 'rounds': must be an integer >= 1, got 0"),
                          ("fedavg:rounds=-2", "option 'rounds': must be an integer >= 1, got -2"),
                          ("fens:rounds=0", "option 'rounds': must be an integer >= 1, got 0"),
                          ("ohfl:finetune_epochs=-1", "option 'finetune_epochs': must be an integer >= 0, got -1")):
        assert main(["compare", "--methods", f"local,{variant}", "--dry-run", "--out", str(out)]) == 2, variant
        err = capsys.readouterr().err.strip()
        assert err == f"cxr-hfl compare: variant {variant}: {says}", err
        assert not out.exists()


def test_a_variant_option_without_its_value_is_refused(tmp_path, capsys):
    """``ohfl:local_epochs`` (no ``=N``) was read as a switch set to True, planned as 1 local epoch ("1 round(s) x 1
    local epochs + 10 ... = 11") and printed as ``--local-epochs`` with no value; the same for method options
    (``fens:fens_epochs``, ``ohfl:distill_steps``). Only an on/off option may be named alone."""
    from nvflare_jobs.cli import main
    from nvflare_jobs.compare import check_variant

    out = tmp_path / "cmp"
    for variant in ("ohfl:local_epochs", "ohfl:finetune_epochs", "fedavg:rounds", "fens:fens_epochs",
                    "ohfl:distill_steps", "ohfl:strategy", "ohfl:local_epochs=25:finetune_epochs"):
        key = variant.rsplit(":", 1)[1]
        assert main(["compare", "--methods", f"local,{variant}", "--dry-run", "--out", str(out)]) == 2, variant
        err = capsys.readouterr().err.strip()
        assert err == f"cxr-hfl compare: variant {variant}: option {key} needs a value ({key}=...); only an on/off " \
                      "option may be named alone", err
        assert not out.exists()
    for ok in ("ohfl:gate", "ohfl:paper", "fens:fens_residual", "ohfl:data_free:distill_steps=0"):  # on/off options
        assert "needs a value" not in (check_variant(ok) or ""), ok


@pytest.mark.slow
def test_compare_local_vs_ohfl_on_identical_partition(data_root, tmp_path):
    out = tmp_path / "cmp"
    args = ["compare", "--methods", "local,ohfl", "--data", str(data_root / "chest_xray_original"), "--sites", "2",
            "--seeds", "0", "--max-images", "120", "--max-train-images", "16", "--local-epochs", "1",
            "--finetune-epochs", "1", "--rounds", "1", "--input-sizes", "32,48", "--late-wait", "60", "--out", str(out)]
    r = run_cli(*args, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert {(x["method"], x["site"]) for x in rows} == {(m, s) for m in ("local", "ohfl") for s in ("site-1", "site-2")}
    assert set(rows[0]) >= {"accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "wall_seconds",
                            "server_seconds", "bytes_up", "bytes_down"}
    ohfl = [x for x in rows if x["method"] == "ohfl"]
    assert all(int(x["bytes_up"]) > 0 for x in ohfl)
    assert all(int(x["bytes_up"]) == 0 for x in rows if x["method"] == "local")
    # identical partition: every method's sites read the same manifests
    for m in ("local", "ohfl"):
        cfg = json.loads((out / "seed0" / m / "resolved_configs" / "site-1.json").read_text())
        assert cfg["data"]["manifest"] == str(out / "seed0" / "partition" / "sites" / "site-1.csv")
    # sensitivity/specificity at thresholds chosen on each site's validation split; the reloaded deployed models
    # reproduce the accuracy each site reported
    for m in ("local", "ohfl"):
        vt = json.loads((out / "seed0" / m / "val_threshold_metrics.json").read_text())
        met = json.loads((out / "seed0" / m / "metrics.json").read_text())
        for site, v in vt.items():
            assert v["argmax_accuracy"] == pytest.approx(met["sites"][site]["test"]["accuracy"])
            assert v["n_val"] > 0 and 0.0 <= v["threshold"] <= 1.0
    assert all(x["threshold"] != "" for x in rows)
    md = (out / "comparison.md").read_text()
    for part in ("## Mean ± std per method", "95% bootstrap CI", "## Per-site accuracy", "## Paired difference vs Local",
                 "| ohfl | 2 |"):
        assert part in md, part
    # resumable: nothing is run again
    r = run_cli(*args, timeout=120)
    assert r.returncode == 0 and r.stdout.count("done already, skipped") == 2
    # the reports of one run (OHFL figures) and of the comparison
    r = run_cli("report", str(out / "seed0" / "ohfl"))
    assert r.returncode == 0, r.stderr
    html = (out / "seed0" / "ohfl" / "report.html").read_text()
    for cap in ("Per-site test accuracy", "OHFL fine-tuning curves", "OHFL CKA cost heatmap with the layer map, fusion 1",
                "Confusion matrix site-1", "Confusion matrix site-2"):
        assert f"<figcaption>{cap}</figcaption>" in html, cap
    assert html.count(IMG) >= 5 and "data manifest sha256" in html
    r = run_cli("report", str(out))
    assert r.returncode == 0, r.stderr
    html = (out / "report.html").read_text()
    assert "<figcaption>Per-site accuracy by method</figcaption>" in html and html.count(IMG) >= 3
    assert "Paired difference vs Local" in html


def test_method_variants_and_reproduce_budget():
    import subprocess
    import sys

    from nvflare_jobs.compare import split_variant
    from tests.sim_helpers import REPO_ROOT

    assert split_variant("ohfl:strategy=cdd:alignment=random") == ("ohfl", {"strategy": "cdd", "alignment": "random"})
    assert split_variant("fedtopo:ablate=no_ema:ablate=no_topq:lambda=0") == (
        "fedtopo", {"ablate": ["no_ema", "no_topq"], "lam": "0"})
    assert split_variant("ohfl:paper") == ("ohfl", {"paper": True})
    assert split_variant("local+ft") == ("local+ft", {})
    r = subprocess.run([sys.executable, "-m", "benchmarks.reproduce", "--dry-run", "--seeds", "0,1"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "34 simulator runs" in r.stdout and "equal budgets: every method trains 3 epochs" in r.stdout and "ohfl:strategy=rand" in r.stdout and "k6" in r.stdout
    from benchmarks.reproduce import ordering_note

    assert "differs" in ordering_note([("a", "80.0", "90"), ("b", "85.0", "88")])[0]
    assert "Same ordering" in ordering_note([("a", "91.0", "90"), ("b", "85.0", "88")])[0]
    tie = ordering_note([("a", "60.0", "90"), ("b", "60.0", "88"), ("c", "40.0", "89")])[0]
    assert "differs" in tie and "a = b > c" in tie and "a > c > b" in tie


# ------------------------------------------------------------------------------------ fake compare folders (fast)
def _fake_run(run, part, method: str, seed: int) -> None:
    """A finished run in the simulate layout with real manifests and untrained model files (no simulator)."""
    import torch

    from hfl_components.models import build_model

    specs = {"site-1": ({"family": "cnn", "depth": "shallow", "width": 1.0}, 32),
             "site-2": ({"family": "cnn", "depth": "deep", "width": 1.0}, 48)}
    (run / "resolved_configs").mkdir(parents=True)
    (run / "models").mkdir()
    sites = {}

    def save(path, spec, size, site, k):
        torch.manual_seed(1000 * seed + k + 37 * len(method))
        model = build_model(spec)
        with torch.no_grad():  # untrained but image-dependent outputs (a fresh head may answer a constant)
            for prm in model.parameters():
                prm.normal_(0.0, 0.05 if prm.dim() > 1 else 0.1)  # larger saturates the softmax
        from hfl_components.models import save_model_file

        save_model_file(path, spec, model.state_dict(), input_size=size or None, labels="binary", site=site)
    for i, (site, (spec, size)) in enumerate(specs.items()):
        spec = {**spec, "in_channels": 1, "num_classes": 2}
        (run / "resolved_configs" / f"{site}.json").write_text(json.dumps(
            {"data": {"manifest": str(part / "sites" / f"{site}.csv"), "labels": "binary"}, "model": spec,
             "input_size": size}))
        save(run / "models" / f"{site}_deployed.pt", spec, size, site, i)
        if method == "ohfl":
            save(run / "models" / f"{site}_local.pt", spec, size, site, 10 + i)
        sites[site] = {"model": spec, "input_size": size, "n_test": 2,
                       "test": {"accuracy": 0.5, "balanced_accuracy": 0.5, "auc": 0.5}}
    if method != "local":
        save(run / "global_model.pt", specs["site-2"][0] | {"in_channels": 1, "num_classes": 2}, None, None, 99)
    (run / "metrics.json").write_text(json.dumps({"method": method, "labels": "binary", "seed": seed,
                                                  "sites": sites, "pooled": {}}))


def test_dry_run_then_real_run_records_the_real_command_and_external_paired_cis(data_root, tmp_path, capsys):
    """Runs already done (fake, untrained models): `compare --dry-run` then the real `compare --external` -- the
    comparison.md and report.html show the command that ran; every saved model is evaluated on the external set;
    the paired differences equal the mean of the per-(seed, site) differences of the runs' own summaries."""
    import numpy as np

    from tests.sim_helpers import make_partition

    out = tmp_path / "cmp"
    for seed in (0, 1):
        part = make_partition(data_root, out / f"seed{seed}" / "partition", 2, max_images=40)
        for m in ("local", "fedavg", "ohfl"):
            _fake_run(out / f"seed{seed}" / m, part, m, seed)
    ext = tmp_path / "ext.csv"
    rows = [{"path": str(f), "label": cls} for cls in ("NORMAL", "PNEUMONIA")
            for f in sorted((data_root / "chest_xray_224" / "train" / cls).glob("*.jpeg"))[:6]]
    with ext.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["path", "label"])
        w.writeheader()
        w.writerows(rows)
    base = ["compare", "--methods", "local,fedavg,ohfl", "--data", str(data_root / "chest_xray_original"),
            "--sites", "2", "--seeds", "0,1", "--local-epochs", "1", "--finetune-epochs", "1", "--out", str(out)]
    from nvflare_jobs.cli import main

    assert main([*base, "--dry-run"]) == 0  # in-process: the same parser and records as the CLI, no start-up
    assert "budget: equal budgets: every method trains 2 epochs per site" in capsys.readouterr().out
    real = base + ["--external", str(ext), "--n-boot", "40"]
    assert main(real) == 0, capsys.readouterr()
    cj = json.loads((out / "compare.json").read_text())
    assert "--dry-run" not in cj["command"] and "--external" in cj["command"] and "dry_runs" not in cj
    md = (out / "comparison.md").read_text()
    assert f"Command: `cxr-hfl {' '.join(real[:1])}" in md and "--dry-run" not in md and "--n-boot 40" in md
    assert "- ohfl: 1 round(s) x 1 local epochs + 1 fine-tuning epochs = 2 epochs per site" in md
    # every saved model of every run, on the external set (12 images)
    ext_rows = list(csv.DictReader((out / "comparison_external.csv").open()))
    got = {(x["method"], x["seed"], x["model"]) for x in ext_rows}
    for seed in ("0", "1"):
        assert {("local", seed, "site-1_deployed"), ("fedavg", seed, "global"), ("ohfl", seed, "site-2_local"),
                ("ohfl", seed, "global_48px")} <= got
        assert not {("local", seed, "global")} & got
    assert all(x["n"] == "12" for x in ext_rows)
    paired = {p["comparison"]: p for p in json.loads((out / "paired_external.json").read_text())["paired"]}
    assert set(paired) == {"fedavg vs local+ft (local, same E epochs)", "ohfl vs local+ft (local, same E epochs)",
                           "ohfl vs FedAvg", "ohfl deployed vs its own pre-fusion local models"}

    def summ(m, seed):
        return json.loads((out / f"seed{seed}" / m / "external" / "ext" / "summary.json").read_text())["models"]
    for metric in ("auc", "balanced_accuracy"):
        want = np.mean([summ("ohfl", s)[f"{k}_deployed"][metric] - summ("fedavg", s)[f"{k}_deployed"][metric]
                        for s in (0, 1) for k in ("site-1", "site-2")])
        d = paired["ohfl vs FedAvg"][metric]
        assert d["n_pairs"] == 4 and d["diff"] == pytest.approx(want, abs=1e-6)
        # 2 seeds: per-seed differences, no reliable interval, no verdict
        assert d["per_seed"].keys() == {"0", "1"} and d["verdict"] is None and not d["reliable"]
    assert paired["ohfl vs FedAvg"]["auc"]["diff"] != 0  # the fake models' scores differ: not a 0 == 0 check
    assert paired["ohfl vs local+ft (local, same E epochs)"]["primary"] == "auc"  # the one primary endpoint
    assert [p["primary"] for p in paired.values()].count("auc") == 1
    for part_ in ("## Budget", "## External evaluation", "### Paired differences (same seed, same site)",
                  "| ohfl vs FedAvg | 2 | 4 |", "no verdict (2 seed(s) < 5), exploratory", "global (site mean)",
                  "pre-fusion local (per site)"):
        assert part_ in md, part_
    assert main(["report", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "--dry-run" not in html and "--n-boot 40" in html
    # resumed: nothing is run or evaluated again
    capsys.readouterr()
    assert main(real) == 0
    so = capsys.readouterr().out
    assert so.count("done already, skipped") == 6 and "models evaluated" not in so
    assert json.loads((out / "compare.json").read_text())["command"] == cj["command"]


def test_comparison_rows_name_the_deployed_round():
    """comparison.csv says which round each site deployed (deploy: best_val picks it on the site's validation
    split); runs that did not record it leave the cells empty."""
    from nvflare_jobs.compare import COLUMNS, comparison_rows

    m = {"sites": {"site-1": {"test": {"accuracy": 0.5, "balanced_accuracy": 0.4}, "n_test": 10,
                              "deploy": {"rule": "best_val", "round": 7, "score": 0.8}},
                   "site-2": {"test": {"accuracy": 0.9}, "n_test": 12}},
         "wall_time_s": 3.0}
    rows = {r["site"]: r for r in comparison_rows([("fedsaf", 0, m)], thresholds=False)}
    assert (rows["site-1"]["deploy_rule"], rows["site-1"]["deployed_round"]) == ("best_val", 7)
    assert (rows["site-2"]["deploy_rule"], rows["site-2"]["deployed_round"]) == (None, None)
    assert rows["site-1"]["balanced_accuracy"] == 0.4 and set(rows["site-1"]) == set(COLUMNS)


def test_aspect_option_is_written_into_every_generated_site_config(data_root, tmp_path, capsys, monkeypatch):
    """`compare --aspect crop` gives every method's every site `aspect: crop` (the options the command line
    parses, through the partition and profile writers a run calls); without it the configs carry no aspect key, so
    the site default (stretch) applies; and `simulate --aspect` is a site option, refused with --profile like the
    other site options."""
    import yaml

    import nvflare_jobs.compare as C
    from nvflare_jobs.cli import main
    from nvflare_jobs.runner import SITE_OPTIONS

    parsed = []
    monkeypatch.setattr(C, "run_compare", lambda a: parsed.append(a) or 0)  # the options compare would run with
    base = ["compare", "--methods", "local,ohfl", "--data", str(data_root / "chest_xray_original"), "--sites", "2",
            "--seeds", "0", "--max-images", "40"]
    assert main([*base, "--aspect", "crop", "--out", str(tmp_path / "crop")]) == 0
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    for a in parsed:
        part = C.prepare_partition(data_root / "chest_xray_original", Path(a.out) / "seed0", a)
        for m in ("local", "ohfl"):
            C.write_method_profile(part, Path(a.out) / "seed0" / m, m, 0, a)
    crop = sorted((tmp_path / "crop").glob("seed0/*/site_configs/*.yaml"))
    plain = sorted((tmp_path / "plain").glob("seed0/*/site_configs/*.yaml"))
    assert len(crop) == 4 and len(plain) == 4
    assert {yaml.safe_load(f.read_text()).get("aspect") for f in crop} == {"crop"}
    assert {yaml.safe_load(f.read_text()).get("aspect") for f in plain} == {None}
    assert SITE_OPTIONS["aspect"] == "aspect"
    with pytest.raises(SystemExit) as e:  # argparse refuses an unknown squaring, naming the choices
        main(["compare", "--methods", "local", "--aspect", "square", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and "stretch" in capsys.readouterr().err


def test_dry_run_prints_the_budget_and_every_command_and_writes_nothing(data_root, tmp_path, capsys):
    """`compare --dry-run` (its help: prints only) leaves OUT absent: no compare.json, partition, site configs or
    probe_part.csv; it prints the budget and one simulate command per (seed, method) naming the paths the run will
    write (the run's profile folder, OUT/probe_part.csv as OHFL's probe)."""
    from nvflare_jobs.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "local,ohfl", "--data", str(data_root / "chest_xray_original"), "--sites",
                 "2", "--seeds", "0,1", "--max-images", "40", "--dry-run", "--out", str(out)]) == 0
    so = capsys.readouterr().out
    assert not out.exists(), sorted(out.rglob("*"))
    assert "budget: equal budgets" in so and "dry run: nothing written" in so
    cmds = [ln for ln in so.splitlines() if "cxr-hfl simulate" in ln]
    assert len(cmds) == 4
    for seed in (0, 1):
        for m in ("local", "ohfl"):
            line = next(ln for ln in cmds if ln.startswith(f"[compare] seed {seed} {m}: "))
            assert f"--profile {out / f'seed{seed}' / m / 'site_configs'} " in line
            assert f"--out {out / f'seed{seed}' / m} " in line
            assert (f"--probe {out / 'probe_part.csv'}" in line) == (m == "ohfl")
