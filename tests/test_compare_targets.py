"""The main job's research milestones (``studies/confirmatory/targets.py``) on hand-made external tables of a compare
folder; compare's own tables and report do not print them."""
from __future__ import annotations

import csv
import json

import pytest


def _write_tables(out):
    """Two seeds of an OHFL run's external rows and its paired verdicts, numbers chosen by hand."""
    cols = ["method", "seed", "model", "kind", "site", "input_size", "n", "auc", "balanced_accuracy", "accuracy",
            "sensitivity", "specificity"]
    rows = []
    for seed, g, locs, deps in ((0, 0.80, (0.90, 0.80), (0.90, 0.90)), (1, 0.60, (0.85, 0.85), (0.80, 0.80))):
        rows.append(["ohfl", seed, "global_64px", "global", "", 64, 10, 0.1, 0.5, 0.5, 1, 0])  # per size: ignored
        rows.append(["ohfl", seed, "global", "global", "", "per site", 10, g, 0.5, 0.5, 1, 0])
        for k, (lo, de) in enumerate(zip(locs, deps), start=1):
            rows.append(["ohfl", seed, f"site-{k}_local", "local", f"site-{k}", 64, 10, lo, 0.7, 0.7, 1, 0])
            rows.append(["ohfl", seed, f"site-{k}_deployed", "deployed", f"site-{k}", 64, 10, de, 0.7, 0.7, 1, 0])
            rows.append(["local", seed, f"site-{k}_deployed", "deployed", f"site-{k}", 64, 10, 0.99, 0.9, 0.9, 1, 0])
    with (out / "comparison_external.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        w.writerows(rows)

    def d(diff, lo, hi, margin):  # a result of hfl_components.stats at 5 seeds, its verdict from the same rule
        from hfl_components.stats import verdict

        return {"diff": diff, "ci_low": lo, "ci_high": hi, "verdict": verdict(lo, hi, margin), "n_pairs": 10,
                "n_seeds": 5, "reliable": True, "margin": margin, "non_inferior": lo > -margin,
                "per_seed": {str(s): diff for s in range(5)}}
    paired = [
        {"comparison": "ohfl vs local+ft (local, same E epochs)", "a": "ohfl", "b": "local", "kind_a": "deployed",
         "kind_b": "deployed", "auc": d(-0.01, -0.015, 0.01, 0.02), "balanced_accuracy": d(-0.05, -0.08, -0.02, 0.03)},
        {"comparison": "ohfl vs FedAvg", "a": "ohfl", "b": "fedavg", "kind_a": "deployed", "kind_b": "deployed",
         "auc": d(0.02, 0.01, 0.03, 0.02), "balanced_accuracy": d(0.0, -0.1, 0.1, 0.03)},
        {"comparison": "ohfl deployed vs its own pre-fusion local models", "a": "ohfl", "b": "ohfl",
         "kind_a": "deployed", "kind_b": "local", "auc": d(0.0, -0.1, 0.1, 0.02),
         "balanced_accuracy": d(0.0, -0.1, 0.1, 0.03)}]
    (out / "paired_external.json").write_text(json.dumps({"name": "chest_xray_224-evaluation", "part": "evaluation",
                                                          "control": "local", "paired": paired}))


def test_targets_from_the_external_tables(tmp_path):
    from nvflare_jobs.compare import load_external
    from studies.confirmatory.targets import ohfl_targets, targets_markdown

    _write_tables(tmp_path)
    t = {x["target"]: x for x in ohfl_targets(load_external(tmp_path))}
    g = t["global model zero-shot mean AUC >= 0.75"]
    assert g["met"] is False and g["value"].startswith("0.700 over 2 seed(s) (seed 0 0.800, seed 1 0.600)")
    s = t["stretch: global within 0.05 of its parents' mean AUC"]  # parents' mean (0.9+0.8+0.85+0.85)/4 = 0.85
    assert s["met"] is False and s["value"] == "0.700 vs 0.850 (gap -0.150)"
    dep = t["deployed models' mean AUC >= the pre-fusion local models' mean"]  # (0.9+0.9+0.8+0.8)/4 = 0.85: equal
    assert dep["met"] is True and dep["value"] == "0.850 (4 models) vs 0.850 (4 models)"
    auc = t["deployed models not worse than local+ft, AUC (non-inferiority, margin 0.02)"]
    assert auc["met"] is True and auc["value"] == "-0.010 (95% CI -0.015 to +0.010): not worse (δ 0.02)"
    ba = t["deployed models not worse than local+ft, balanced accuracy (non-inferiority, margin 0.03)"]
    assert ba["met"] is False and ba["value"] == "-0.050 (95% CI -0.080 to -0.020): worse (δ 0.03)"
    fa = t["verdict against equal-epoch FedAvg, AUC (reported, no threshold)"]
    assert fa["met"] is None and fa["value"].endswith(": better")
    assert len(t) == 7  # the deployed-vs-own-local pair is not a target row
    md = "\n".join(targets_markdown(list(t.values())))
    assert "3 of 5 targets not met." in md and "| **NOT met** |" in md
    assert ohfl_targets(load_external(tmp_path), method="fedsaf") == []


def test_missing_local_ft_control_is_not_reported_as_met(tmp_path):
    """Without a local+ft control (compare --methods ohfl,fedavg) target (4) cannot be judged: one row says
    "not measured" and counts as not met, so the table never ends "All targets met" without it."""
    from nvflare_jobs.compare import load_external
    from studies.confirmatory.targets import ohfl_targets, targets_markdown

    _write_tables(tmp_path)
    pj = json.loads((tmp_path / "paired_external.json").read_text())
    pj["control"] = None
    pj["paired"] = [p for p in pj["paired"] if p["b"] != "local"]
    (tmp_path / "paired_external.json").write_text(json.dumps(pj))
    t = {x["target"]: x for x in ohfl_targets(load_external(tmp_path))}
    miss = t["deployed models not worse than local+ft"]
    assert miss["met"] is False and miss["value"].startswith("not measured: no local+ft control")
    assert not any(k.startswith("deployed models not worse than local+ft, ") for k in t)
    # global 0.700 (not met), stretch (not met), deployed = local (met), the missing control (not met); FedAvg reported
    assert "3 of 4 targets not met." in "\n".join(targets_markdown(list(t.values())))


def test_compare_report_html_no_longer_carries_the_research_targets(tmp_path):
    from nvflare_jobs.compare.tables import COLUMNS
    from nvflare_jobs.report import render_report

    _write_tables(tmp_path)
    (tmp_path / "comparison.csv").write_text(",".join(COLUMNS) + "\n")  # compare's header, no site rows
    html = render_report(tmp_path).read_text()
    assert "cxr-hfl method comparison" in html and "targets" not in html.lower()


def test_the_checklist_prints_for_a_compare_folder_and_refuses_one_without_external_tables(tmp_path, capsys):
    from studies.confirmatory.targets import main

    _write_tables(tmp_path)
    assert main([str(tmp_path)]) == 0
    assert "3 of 5 targets not met." in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 2
    assert "no comparison_external.csv" in capsys.readouterr().err


def test_fewer_than_five_seeds_give_no_verdict_and_the_target_is_not_met(tmp_path):
    """A paired result under 5 seeds (or one written before the rule, without ``reliable``) has no verdict: the
    non-inferiority target shows the per-seed differences and is not met."""
    from nvflare_jobs.compare import load_external
    from studies.confirmatory.targets import ohfl_targets

    _write_tables(tmp_path)
    pj = json.loads((tmp_path / "paired_external.json").read_text())
    pj["paired"][0]["auc"] = {"diff": 0.05, "ci_low": 0.01, "ci_high": 0.09, "verdict": None, "n_seeds": 3,
                              "reliable": False, "margin": 0.02, "non_inferior": None,
                              "per_seed": {"0": 0.07, "1": 0.01, "2": 0.07}}
    pj["paired"][0]["balanced_accuracy"] = {"diff": 0.04, "ci_low": 0.01, "ci_high": 0.07, "verdict": "better",
                                            "n_pairs": 18}  # the old format: no seed rule recorded
    (tmp_path / "paired_external.json").write_text(json.dumps(pj))
    t = {x["target"]: x for x in ohfl_targets(load_external(tmp_path))}
    auc = t["deployed models not worse than local+ft, AUC (non-inferiority, margin 0.02)"]
    assert auc["met"] is False
    assert auc["value"] == "+0.050; per seed +0.070 / +0.010 / +0.070 (3 seed(s): no reliable interval): " \
        "no verdict (3 seed(s) < 5)"
    old = t["deployed models not worse than local+ft, balanced accuracy (non-inferiority, margin 0.03)"]
    assert old["met"] is False and old["value"].endswith(": no verdict (? seed(s) < 5)")  # its stored verdict ignored


def test_no_targets_without_an_external_evaluation(tmp_path):
    from nvflare_jobs.compare import load_external

    assert load_external(tmp_path) is None


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
