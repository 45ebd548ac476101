"""The confirmatory run's analysis (studies/confirmatory/confirmatory.py) on a comparison folder built by hand: the per-seed
summaries, their seed-level t-intervals and the primary endpoint's row, checked against values computed here."""
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from studies.confirmatory import confirmatory as C


def _write(p, obj):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))


def _fake_cmp(root, seeds, name="chest_xray_224-evaluation"):
    rng = np.random.default_rng(0)
    truth = {"gap": {}, "border": {}, "sens": {}, "adopted": {}, "eval_sens": {}, "eval_min": {}}
    for s in seeds:
        run = root / f"seed{s}" / "ohfl"
        gap = float(rng.uniform(0, 0.05))
        shifts = rng.uniform(-0.2, 0.1, size=3)
        sens = float(rng.uniform(0.8, 1.0))
        adopted = [bool(x) for x in rng.integers(0, 2, size=3)]
        truth["gap"][s], truth["border"][s], truth["sens"][s] = gap, float(np.mean(-shifts)), sens
        truth["adopted"][s] = float(np.mean(adopted))
        ev = rng.uniform(0.7, 1.0, size=3)  # each deployed model's sensitivity on the evaluation images
        truth["eval_sens"][s], truth["eval_min"][s] = float(ev.mean()), float(ev.min())
        _write(run / "metrics.json", {"method": "ohfl", "seed": s, "sites": {
            f"site-{k + 1}": {"gate": {"adopted": a}} for k, a in enumerate(adopted)}})
        for m in ("local", "fedavg"):  # every method of the protocol has its run at every seed
            _write(root / f"seed{s}" / m / "metrics.json", {"method": m, "seed": s, "sites": {}})
        models = {f"site-{k + 1}_deployed": {"kind": "deployed", "auc": 0.9} for k in range(3)}
        models["global"] = {"kind": "global", "auc": 0.9, "gap_to_ensemble_auc": gap}
        _write(run / "external" / name / "summary.json", {"models": models})
        _write(run / "external" / name / "audit.json", {
            "probes": {"models": {f"site-{k + 1}_deployed": {"kind": "deployed", "shift": {
                "mean_change": float(shifts[k]), "flagged": bool(abs(shifts[k]) > 0.05)}} for k in range(3)}},
            "metadata": {"auc": 0.8, "margins": {f"site-{k + 1}_deployed": {"margin": 0.1, "covers_zero": False}
                                                 for k in range(3)}},
            "operating_point": {"federated": {"threshold": 0.3, "sensitivity": sens, "specificity": 0.5,
                                              "site_sensitivity": {}},
                                "models": {f"site-{k + 1}_{kind}": {"sensitivity": {"value": float(ev[k]) - off},
                                                                    "specificity": {"value": 0.5}}
                                           for k in range(3) for kind, off in (("deployed", 0.0), ("local", 0.3))}}})
    prim = {"metric": "auc", "a": 0.93, "b": 0.92, "diff": 0.01, "per_seed": {str(s): 0.01 for s in seeds},
            "ci_low": -0.005, "ci_high": 0.025, "interval": "cluster bootstrap-t", "t_low": -0.001, "t_high": 0.02,
            "reliable": len(seeds) >= 5, "verdict": "not worse" if len(seeds) >= 5 else None, "margin": 0.02,
            "n_seeds": len(seeds)}
    bal = {**prim, "metric": "balanced_accuracy", "margin": 0.03}
    _write(root / "paired_external.json", {"name": name, "data": "chest_xray_224", "part": "evaluation",
                                          "n_images": [1715], "paired": [
        {"comparison": "ohfl vs local+ft", "primary": "auc", "seeds": list(seeds), "auc": prim,
         "balanced_accuracy": bal}]})
    return truth


def _plan(root, control="local", looks=None):
    """An α plan with one primary test of ohfl vs ``control`` (AUC, non-inferiority 0.02) at the total 0.05, or a
    legacy bonferroni-look plan at 0.05 / ``looks``; returns the file (outside the results folder)."""
    root.mkdir(parents=True, exist_ok=True)
    f = root / f"plan_{control}_{looks}.json"
    test = {"id": "primary", "a": "ohfl", "b": control, "metric": "auc", "hypothesis": "non-inferiority",
            "margin": 0.02, "alpha": 0.05 / (looks or 1), **({"looks": looks} if looks else {})}
    f.write_text(json.dumps({"schema": "cxr-hfl alpha plan 1", "total_alpha": 0.05, "exploratory_verdicts": True,
                             "procedure": "bonferroni-look" if looks else "single", "tests": [test]}))
    return str(f)


def test_analysis_summaries_match_a_hand_computed_seed_t_interval(tmp_path):
    seeds = [10, 11, 12, 13, 14]
    truth = _fake_cmp(tmp_path / "cmp", seeds)
    assert C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"),
                   "--plan", _plan(tmp_path)]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    for key, tk in (("gap_global", "gap"), ("border_dp_normal", "border"), ("fed_sensitivity", "sens"),
                    ("adopted", "adopted"), ("eval_sensitivity", "eval_sens"), ("eval_min_sensitivity", "eval_min")):
        v = np.array([truth[tk][s] for s in seeds])
        half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
        d = r["secondary"][key]
        assert d["mean"] == pytest.approx(v.mean()) and d["reliable"]
        assert d["ci_low"] == pytest.approx(v.mean() - half) and d["ci_high"] == pytest.approx(v.mean() + half)
    assert r["primary"]["comparison"] == "ohfl vs local+ft" and r["primary"]["verdict"] == "not worse"
    md = (tmp_path / "res" / "RESULT.md").read_text()
    assert "not worse (δ 0.02)" in md and "exploratory" in md


def test_analysis_with_fewer_than_five_seeds_gives_per_seed_values_and_no_interval(tmp_path):
    truth = _fake_cmp(tmp_path / "cmp", [10, 11])
    assert C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"),
                   "--seeds", "10,11", "--plan", _plan(tmp_path)]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    d = r["secondary"]["gap_global"]
    assert d["ci_low"] is None and not d["reliable"]
    assert d["per_seed"] == {str(s): pytest.approx(truth["gap"][s]) for s in (10, 11)}
    md = (tmp_path / "res" / "RESULT.md").read_text()
    assert "no reliable interval" in md and "no verdict" in md


def _refused(args, capsys, *says):
    assert C.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for x in says:
        assert x in err, err
    return err


def test_analysis_refuses_a_missing_seed_and_writes_nothing(tmp_path, capsys):
    """A folder without seed 12's runs was analysed with the paired rows over 5 seeds and the summaries over 4."""
    import shutil

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    _fake_cmp(cmp, [10, 11, 12, 13, 14])
    shutil.rmtree(cmp / "seed12")
    err = _refused(["analyse", "--cmp", str(cmp), "--results", str(res)], capsys,
                   "seed12/local", "seed12/fedavg", "seed12/ohfl", "nothing was written")
    assert "seed11" not in err and not res.exists()
    (cmp / "seed12" / "ohfl").mkdir(parents=True)  # one method's run missing is refused too
    _write(cmp / "seed12" / "ohfl" / "metrics.json", {"method": "ohfl", "seed": 12, "sites": {}})
    err = _refused(["analyse", "--cmp", str(cmp), "--results", str(res)], capsys, "seed12/local, seed12/fedavg")
    assert "seed12/ohfl" not in err and not res.exists()


def test_analysis_refuses_runs_or_paired_rows_at_other_seeds(tmp_path, capsys):
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    _fake_cmp(cmp, [10, 11, 12, 13, 14])
    _refused(["analyse", "--cmp", str(cmp), "--results", str(res), "--seeds", "10,11,12,13"], capsys,
             "seed(s) 14, outside the analysed seeds 10,11,12,13")
    pj = cmp / "paired_external.json"
    paired = json.loads(pj.read_text())
    paired["paired"][0]["seeds"] = [10, 11, 13, 14]
    _write(pj, paired)
    _refused(["analyse", "--cmp", str(cmp), "--results", str(res)], capsys, str(pj), "seeds 10,11,13,14")
    assert not res.exists()


@pytest.mark.parametrize("src", ["seed11/fedavg", "seed12/ohfl"])
def test_analysis_refuses_a_run_file_of_another_method_or_seed(tmp_path, capsys, src):
    """fedavg's (or another seed's OHFL) metrics.json copied over seed11/ohfl's was analysed as OHFL seed 11."""
    import shutil

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    _fake_cmp(cmp, [10, 11, 12, 13, 14])
    dst = cmp / "seed11" / "ohfl" / "metrics.json"
    shutil.copy(cmp / src / "metrics.json", dst)
    _refused(["analyse", "--cmp", str(cmp), "--results", str(res)], capsys, str(dst), "not its folder's 'ohfl', seed 11",
             "nothing was written")
    assert not res.exists()


@pytest.mark.parametrize("damage", ["truncate", "empty", "no_paths", "missing"])
def test_rebuild_refuses_an_unreadable_predictions_file_before_writing(tmp_path, capsys, damage):
    """A copy without the paired tables is rebuilt from its predictions; a truncated predictions.npz gave a
    traceback after comparison_external.csv was already written into --cmp."""
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    _fake_cmp(cmp, [10, 11, 12, 13, 14])
    (cmp / "paired_external.json").unlink()
    _write(cmp / "compare.json", {"methods": ["local", "fedavg", "ohfl"], "external": "x", "part": "evaluation",
                                  "external_name": "chest_xray_224-evaluation"})
    for s in (10, 11, 12, 13, 14):  # every protocol run has an external evaluation
        for m in ("local", "fedavg", "ohfl"):
            d = cmp / f"seed{s}" / m / "external" / "chest_xray_224-evaluation"
            d.mkdir(parents=True, exist_ok=True)
            np.savez(d / "predictions.npz", paths=np.array(["a.png", "b.png"]), y=np.array([0, 1]),
                     **{"site-1_deployed": np.eye(2)})
    bad = cmp / "seed12" / "ohfl" / "external" / "chest_xray_224-evaluation" / "predictions.npz"
    raw = bad.read_bytes()
    if damage == "missing":  # a non-primary method's predictions: its rows would silently vanish
        bad = cmp / "seed13" / "fedavg" / "external" / "chest_xray_224-evaluation" / "predictions.npz"
        bad.unlink()
        bad = bad.relative_to(cmp)
    elif damage == "truncate":
        bad.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        np.savez(bad, y=np.array([0, 1]))
    before = sorted(p.relative_to(cmp) for p in cmp.rglob("*"))
    _refused(["analyse", "--cmp", str(cmp), "--results", str(res)], capsys, str(bad), "nothing was written")
    assert sorted(p.relative_to(cmp) for p in cmp.rglob("*")) == before and not res.exists()


def test_a_share_interval_is_printed_clipped_to_0_1_and_says_so(tmp_path):
    """Gate adoption shares 1, 1, 1, 1, 0.5 over 5 seeds: mean 0.90, the seed t-interval 0.62 to 1.18 (computed here);
    a share's printed interval stops at 1 and its row says it is clipped; result.json keeps the t-interval."""
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    seeds = [10, 11, 12, 13, 14]
    _fake_cmp(cmp, seeds)
    shares = [1.0, 1.0, 1.0, 1.0, 0.5]
    for s, v in zip(seeds, shares):
        f = cmp / f"seed{s}" / "ohfl" / "metrics.json"
        met = json.loads(f.read_text())
        met["sites"] = {"site-1": {"gate": {"adopted": True}}, "site-2": {"gate": {"adopted": v == 1.0}}}
        _write(f, met)
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(res), "--plan", _plan(tmp_path)]) == 0
    half = stats.t.ppf(0.975, 4) * np.std(shares, ddof=1) / np.sqrt(5)
    assert 0.9 + half > 1.0
    r = json.loads((res / "result.json").read_text())["secondary"]["adopted"]
    assert r["ci_high"] == pytest.approx(0.9 + half)
    row = next(ln for ln in (res / "RESULT.md").read_text().splitlines() if "gate adopted" in ln)
    assert "clipped to [0, 1]" in row and f"95% CI {0.9 - half:.2f} to 1.00)" in row and "1.18" not in row
    gap = next(ln for ln in (res / "RESULT.md").read_text().splitlines() if "AUC gap to the site ensemble" in ln)
    assert "clipped" not in gap


def test_analysis_without_a_comparison_says_so(tmp_path, capsys):
    assert C.main(["analyse", "--cmp", str(tmp_path / "none"), "--results", str(tmp_path / "res")]) == 2
    assert "run the protocol first" in capsys.readouterr().err


def test_copy_of_a_seed_keeps_the_layout_and_no_machine_path(tmp_path):
    """copy_seed: a run's records land in the comparison folder's own layout, the predictions byte for byte, and the
    comparison folder's absolute path and the checkout's are replaced in every text file."""
    import re

    cmp = tmp_path / "cmp"
    run = cmp / "seed10" / "ohfl"
    checkout = Path(C.__file__).resolve().parents[2]  # the folder that holds studies/, tests/ and README.md
    assert (checkout / "README.md").is_file() and (checkout / "tests").is_dir()
    _write(run / "metrics.json", {"run": str(run), "data": str(checkout.parent / "shared" / "data" / "x")})
    _write(run / "external" / "set" / "summary.json", {"run": str(run)})
    np.savez(run / "external" / "set" / "predictions.npz", y=np.arange(5))
    _write(cmp / "compare.json", {"out": str(cmp)})
    dest = C.copy_seed(cmp, tmp_path / "res", 10)
    assert dest == tmp_path / "res" / "seeds" / "seed10"
    met = json.loads((dest / "ohfl" / "metrics.json").read_text())
    assert met == {"run": "runs/cmp/seed10/ohfl", "data": "../shared/data/x"}
    assert (np.load(dest / "ohfl" / "external" / "set" / "predictions.npz")["y"] == np.arange(5)).all()
    machine = re.compile(str(tmp_path))
    assert not any(machine.search(f.read_text()) for f in (tmp_path / "res").rglob("*.json"))


def test_a_protocol_with_fedavg_as_its_primary_control_reports_that_row(tmp_path):
    """``analyse --primary fedavg``: the primary endpoint is the OHFL vs FedAvg row (its own numbers), the local+ft
    row moves to the secondary table, and exactly one row is flagged primary."""
    seeds = [30, 31, 32, 33, 34]
    _fake_cmp(tmp_path / "cmp", seeds)
    pj = tmp_path / "cmp" / "paired_external.json"
    paired = json.loads(pj.read_text())
    fed = {"metric": "auc", "a": 0.95, "b": 0.96, "diff": -0.01, "per_seed": {str(s): -0.01 for s in seeds},
           "ci_low": -0.031, "ci_high": 0.011, "interval": "cluster bootstrap-t", "reliable": True,
           "verdict": "inconclusive", "margin": 0.02, "n_seeds": 5}
    paired["paired"].append({"comparison": "ohfl vs FedAvg", "primary": None, "seeds": seeds, "auc": fed,
                             "balanced_accuracy": {**fed, "metric": "balanced_accuracy", "margin": 0.03}})
    pj.write_text(json.dumps(paired))
    assert C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"), "--seeds",
                   ",".join(map(str, seeds)), "--primary", "fedavg", "--plan", _plan(tmp_path, "fedavg")]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    assert r["primary"]["comparison"] == "ohfl vs FedAvg" and r["primary"]["diff"] == -0.01
    assert r["primary"]["verdict"] == "inconclusive"
    assert [q["comparison"] for q in r["paired"] if q.get("primary")] == ["ohfl vs FedAvg"]
    md = (tmp_path / "res" / "RESULT.md").read_text()
    primary_section = md.split("## Secondary")[0]
    assert "ohfl vs FedAvg, AUC" in primary_section and "ohfl vs local+ft" not in primary_section
    assert "| ohfl vs local+ft | auc |" in md


def test_the_run_command_without_the_audit_passes_no_audit_to_compare():
    """The protocol's options are comparison options as a library caller passes them (no command line): they build
    a CompareOptions, the audit switch reaches it, and the recorded command says --no-audit exactly when it is off."""
    from nvflare_jobs.compare import CompareOptions

    off = C.compare_options([30], Path("runs/x"), None, "ext", "evaluation", audit=False)
    on = C.compare_options([30], Path("runs/x"), None, "ext", "evaluation")
    assert CompareOptions.from_mapping(off).no_audit is True and CompareOptions.from_mapping(on).no_audit is False
    assert off["argv"][-1] == "--no-audit" and "--no-audit" not in on["argv"]
    assert CompareOptions.from_mapping(on).seeds == [30] and CompareOptions.from_mapping(on).methods == C.METHODS


def test_compare_options_refuse_an_unknown_key_by_name():
    from nvflare_jobs.compare import compare

    with pytest.raises(ValueError, match="unknown option.*'epochs'"):
        compare("runs/x", epochs=3)


def _npz_cmp(root, seeds, name, n=60, sites=3):
    """OHFL and FedAvg runs whose deployed models' probabilities are drawn here; returns (y, A, B) as
    ``paired_crossed`` takes them, built directly from the drawn arrays."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=n)
    y[:2] = [0, 1]
    paths = np.array([f"img{i}.png" for i in range(n)])
    arrays = {}
    for m, shift in (("ohfl", 0.0), ("fedavg", 0.3)):
        A = np.empty((len(seeds), sites, n))
        for i, s in enumerate(seeds):
            d = root / f"seed{s}" / m
            _write(d / "metrics.json", {"method": m, "seed": s})
            probs = {}
            for k in range(sites):
                p = 1 / (1 + np.exp(-(y * 2.0 - 1.0 + shift + rng.normal(0, 1.5, size=n))))
                A[i, k] = p
                probs[f"site-{k + 1}_deployed"] = np.stack([1 - p, p], axis=1)
            (d / "external" / name).mkdir(parents=True)
            np.savez(d / "external" / name / "predictions.npz", paths=paths, y=y, **probs)
        arrays[m] = A
    order = np.argsort(paths)  # the analysis pairs the images by path, in sorted order (the bootstrap draws by index)
    return y[order], arrays["ohfl"][..., order], arrays["fedavg"][..., order]


def test_the_corrected_primary_is_the_same_bootstrap_at_alpha_over_looks(tmp_path):
    """``analyse --looks 2``: the primary row recomputed from the predictions at alpha 0.025 equals ``paired_crossed``
    on arrays assembled here, and its interval contains the 95 % one (same replicates, a wider quantile)."""
    from hfl_components.stats import paired_crossed

    seeds, name = [30, 31, 32, 33, 34], "chest_xray_224-evaluation"
    y, A, B = _npz_cmp(tmp_path, seeds, name)
    prim = {"comparison": "ohfl vs FedAvg", "a": "ohfl", "b": "fedavg", "kind_a": "deployed", "kind_b": "deployed"}
    got = C.corrected_primary(tmp_path, name, prim, looks=2, n_boot=200)
    want = paired_crossed(y, A, B, "auc", n_boot=200, seed=0, seeds=seeds, alpha=0.025)
    at95 = paired_crossed(y, A, B, "auc", n_boot=200, seed=0, seeds=seeds, alpha=0.05)
    assert got["looks"] == 2 and got["alpha"] == pytest.approx(0.025)
    assert (got["diff"], got["ci_low"], got["ci_high"]) == pytest.approx((want["diff"], want["ci_low"], want["ci_high"]))
    assert got["ci_low"] <= at95["ci_low"] and got["ci_high"] >= at95["ci_high"] and got["diff"] == at95["diff"]
    assert C.corrected_primary(tmp_path, name, {**prim, "b": "local"}, looks=2) is None  # nothing pairs


def test_the_corrected_row_decides_in_result_md(tmp_path):
    seeds = [30, 31, 32, 33, 34]
    _fake_cmp(tmp_path / "cmp", seeds)
    assert C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"), "--seeds",
                   ",".join(map(str, seeds)), "--plan", _plan(tmp_path)]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    assert "primary_corrected" not in r and "verdict_from" not in r  # one look: no corrected row, the 95 % decides
    corr = {**r["primary"], "alpha": 0.025, "ci_low": -0.03, "ci_high": 0.04, "verdict": "inconclusive", "looks": 2}
    md = C.markdown({**r, "primary_corrected": corr})
    first, second = [ln for ln in md.splitlines() if ln.startswith("| ohfl vs local+ft, AUC") or
                     ln.startswith("| the same, corrected")]
    assert "95% CI" in first and first.endswith("| none: the corrected row decides |")
    assert "97.5% CI -0.030 to +0.040" in second and "corrected for 2 tests" in second
    assert second.endswith("| inconclusive (δ 0.02) |")
    with pytest.raises(SystemExit):
        C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--looks", "0"])


def _looks_cmp(root, seeds, name="chest_xray_224-evaluation"):
    """A folder of the protocol (local, fedavg, ohfl at ``seeds``) whose OHFL and FedAvg runs hold predictions and
    whose paired file has the OHFL vs FedAvg row as compare writes it (the compared methods named)."""
    _npz_cmp(root, seeds, name)
    _fake_cmp(root, seeds, name)
    pj = root / "paired_external.json"
    paired = json.loads(pj.read_text())
    row = {**paired["paired"][0], "comparison": "ohfl vs FedAvg", "primary": None, "a": "ohfl", "b": "fedavg",
           "kind_a": "deployed", "kind_b": "deployed"}
    paired["paired"].append(row)
    pj.write_text(json.dumps(paired))
    return ["analyse", "--cmp", str(root), "--results", str(root.parent / "res"), "--seeds", ",".join(map(str, seeds)),
            "--primary", "fedavg", "--looks", "2", "--plan", _plan(root.parent, "fedavg", 2)]


@pytest.mark.parametrize("damage", ["missing", "truncated", "no_names"])
def test_looks_without_the_primary_pairs_predictions_is_refused(tmp_path, capsys, damage):
    """``--looks 2`` when the corrected row cannot be recomputed: a seed's predictions of a compared method missing
    or unreadable wrote RESULT.md with the uncorrected 95 % verdict as the decision (exit 0), a primary row without
    the compared methods gave a KeyError traceback; now one line naming the file, exit 2, nothing written."""
    seeds = [30, 31, 32, 33, 34]
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    args = _looks_cmp(cmp, seeds)
    assert C.main(args) == 0  # the intact folder: the corrected row is there and decides
    r = json.loads((res / "result.json").read_text())
    assert r["primary_corrected"]["looks"] == 2 and r["primary_corrected"]["comparison"] == "ohfl vs FedAvg"
    assert r["verdict_from"] == "primary_corrected"
    import shutil
    shutil.rmtree(res)
    capsys.readouterr()
    bad = cmp / "seed32" / "fedavg" / "external" / "chest_xray_224-evaluation" / "predictions.npz"
    if damage == "missing":
        bad.unlink()
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:100])
    else:
        pj = bad = cmp / "paired_external.json"
        paired = json.loads(pj.read_text())
        for k in ("a", "b"):
            del paired["paired"][1][k]
        pj.write_text(json.dumps(paired))
    _refused(args, capsys, str(bad), "nothing was written")
    assert not res.exists()


def test_a_primary_control_without_its_row_is_refused(tmp_path, capsys):
    """``--primary fedavg`` on a folder whose paired file has no OHFL vs FedAvg row (compare leaves a row out when
    a method's predictions are missing) wrote a RESULT.md without a primary endpoint, exit 0; now refused like a
    folder without the local+ft primary row."""
    seeds = [30, 31, 32, 33, 34]
    _fake_cmp(tmp_path / "cmp", seeds)
    for looks in ("1", "2"):
        _refused(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"), "--seeds",
                  ",".join(map(str, seeds)), "--primary", "fedavg", "--looks", looks,
                  "--plan", _plan(tmp_path, "fedavg", int(looks) if looks != "1" else None)], capsys,
                 str(tmp_path / "cmp" / "paired_external.json"), "'ohfl vs FedAvg'", "nothing was written")
        assert not (tmp_path / "res").exists()


def test_the_margin_sentence_names_the_interval_that_decides(tmp_path):
    """With ``--looks 2`` the sentence under the primary table said "the interval's lower bound" under a table with a
    95 % and a 97.5 % interval; it names the one that decides (the protocol's 97.5 % corrected interval). With one
    interval in the table it keeps the earlier protocols' wording (their RESULT.md is rewritten byte for byte)."""
    seeds = [30, 31, 32, 33, 34]
    _fake_cmp(tmp_path / "cmp", seeds)
    assert C.main(["analyse", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"), "--seeds",
                   ",".join(map(str, seeds)), "--plan", _plan(tmp_path)]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    one = C.markdown(r)
    assert "not worse when the interval's lower bound is above -δ" in one
    corr = {**r["primary"], "alpha": 0.025, "ci_low": -0.03, "ci_high": 0.04, "verdict": "inconclusive", "looks": 2}
    two = C.markdown({**r, "primary_corrected": corr})
    assert "not worse when the lower bound of the corrected row's 97.5% interval is above -δ" in two


def test_copied_predictions_key_images_by_paths_relative_to_the_evaluated_root(tmp_path):
    """copy_seed: a predictions.npz whose images carry machine paths is copied with each path relative to the
    evaluated set's root (the ``data`` of the summary beside it); every other array unchanged, the sorted order of
    the paths the same (the analysis pairs images by sorted path)."""
    cmp = tmp_path / "cmp"
    ext = cmp / "seed10" / "ohfl" / "external" / "set"
    root = tmp_path / "data" / "chest_xray_224"
    names = ["train/PNEUMONIA/person1_virus_2.jpeg", "train/NORMAL/IM-0115-0001.jpeg", "train/NORMAL/IM-0002.jpeg"]
    probs = np.random.default_rng(0).random((3, 2)).astype(np.float32)
    _write(ext / "summary.json", {"data": str(root)})
    np.savez_compressed(ext / "predictions.npz", paths=np.asarray([str(root / n) for n in names]),
                        y=np.array([1, 0, 0]), **{"site-1_deployed": probs})
    dest = C.copy_seed(cmp, tmp_path / "res", 10)
    z = np.load(dest / "ohfl" / "external" / "set" / "predictions.npz")
    assert z["paths"].tolist() == names
    assert np.argsort(z["paths"]).tolist() == [2, 1, 0]
    assert (z["y"] == [1, 0, 0]).all() and np.array_equal(z["site-1_deployed"], probs)
    assert z["site-1_deployed"].dtype == np.float32


def test_a_predicted_image_outside_the_evaluated_root_is_refused_by_name(tmp_path):
    cmp = tmp_path / "cmp"
    ext = cmp / "seed10" / "ohfl" / "external" / "set"
    _write(ext / "summary.json", {"data": str(tmp_path / "data")})
    np.savez_compressed(ext / "predictions.npz", paths=np.asarray([str(tmp_path / "elsewhere" / "a.jpeg")]),
                        y=np.array([0]))
    with pytest.raises(ValueError, match="predictions.npz: image .*a.jpeg is not under"):
        C.copy_seed(cmp, tmp_path / "res", 10)


PROTOCOLS = Path(C.__file__).resolve().parent / "protocols"


@pytest.mark.parametrize("extra, says", [
    ([], "no α plan"),
    (["--plan", str(PROTOCOLS / "confirmatory_10seeds" / "alpha_plan.json"), "--primary", "local"],
     "lists no test of ohfl vs local on auc"),
    (["--plan", str(PROTOCOLS / "confirmatory_10seeds" / "alpha_plan.json"), "--looks", "1"],
     "--looks 1: the plan tests its primary at alpha 0.025 (2 looks)"),
    (["--plan", str(PROTOCOLS / "confirmatory_300" / "alpha_plan.json"), "--looks", "2"],
     "--looks 2: the plan tests its primary at alpha 0.05 (one look)"),
    (["--plan", "OPEN", "--primary", "local"],  # protocol 4's plan before PROTOCOL.md completed it
     "the plan's primary test is ohfl vs fedavg (vs_local_ft comes later in its sequence)"),
])
def test_the_analysis_refuses_a_test_its_plan_does_not_list(tmp_path, capsys, extra, says):
    """Without a plan, or asked for a primary comparison or a number of looks the plan does not list: one line
    naming the plan, exit 2, nothing written."""
    seeds = [30, 31, 32, 33, 34]
    args = _looks_cmp(tmp_path / "cmp", seeds)
    base = args[:args.index("--primary")]
    extra = [str(_open_plan(tmp_path / "plan")) if x == "OPEN" else x for x in extra]
    _refused([*base, *extra], capsys, "a test the plan does not list" if extra else "alpha_plan.json", says,
             "nothing was written")
    assert not (tmp_path / "res").exists()


def _open_plan(tmp_path):
    """Protocol 4's plan as it stood before its PROTOCOL.md completed it (a superiority primary, the one-sample
    thresholds still null): the analysis then tests the primary only and needs no ``central`` runs."""
    plan = json.loads((PROTOCOLS / "protocol4" / "alpha_plan.json").read_text())
    plan["tests"][0]["hypothesis"] = "superiority"
    plan["tests"][0].pop("margin", None)
    for t in plan["tests"]:
        if t["id"] in ("specificity", "operating_point_efficiency", "refusal_rate"):
            t["threshold"] = None
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / "plan_open.json"
    p.write_text(json.dumps(plan))
    return p


def test_a_fallback_plan_tests_its_primary_at_its_level_and_gives_other_rows_no_verdict(tmp_path):
    """Protocol 4's plan: the primary (ohfl vs FedAvg) at its share 0.025 (a 97.5 % interval, the same bootstrap as
    :func:`corrected_primary` at that alpha), no verdict on any row the plan does not list as tested here."""
    seeds = [30, 31, 32, 33, 34]
    args = _looks_cmp(tmp_path / "cmp", seeds)
    base = args[:args.index("--primary")]
    plan = _open_plan(tmp_path)
    assert C.main([*base, "--plan", str(plan)]) == 0
    r = json.loads((tmp_path / "res" / "result.json").read_text())
    c = r["primary_corrected"]
    assert c["alpha"] == pytest.approx(0.025) and c["procedure"] == "fallback" and "looks" not in c
    assert r["plan"]["primary"] == "primary" and r["verdict_from"] == "primary_corrected"
    others = [q[m] for q in r["paired"] for m in ("auc", "balanced_accuracy") if q.get("primary") != m]
    assert others and all(d["verdict"] is None for d in others)
    md = (tmp_path / "res" / "RESULT.md").read_text()
    assert "at the α plan's level (fallback procedure, alpha 0.025; its hypothesis: superiority, rejected only if " \
        "better)" in md
    assert "none: the plan-level row decides" in md and "## Other rows (described" in md
    assert "lower bound of the plan-level row's 97.5% interval" in md


def _complete_plan(tmp_path):
    """Protocol 4's plan before PROTOCOL.md with its open thresholds filled in (values for the test)."""
    plan = json.loads(_open_plan(tmp_path).read_text())
    fill = {"specificity": 0.5, "operating_point_efficiency": 0.8, "refusal_rate": 0.2}
    for t in plan["tests"]:
        if t["id"] in fill:
            t["threshold"] = fill[t["id"]]
    p = tmp_path / "plan_complete.json"
    p.write_text(json.dumps(plan))
    return p, plan


def test_a_complete_fallback_plan_runs_every_test_in_order_and_needs_every_method(tmp_path, capsys):
    """With its thresholds fixed, protocol 4's plan adds ``central`` to the methods every seed must have (a folder
    without it is refused in one line naming the missing runs), and its sequence tests the primary at 0.025 with the
    same interval as :func:`corrected_primary`, then each later test at the level the fallback rule gives it; an
    endpoint the runs do not provide (no operating-point records, no central runs here) does not succeed."""
    from studies.confirmatory.alpha_plan import fallback_levels

    seeds = [30, 31, 32, 33, 34]
    args = _looks_cmp(tmp_path / "cmp", seeds)
    path, plan = _complete_plan(tmp_path)
    assert C.plan_methods(plan) == "local,fedavg,ohfl,central" and C.plan_complete(plan)
    assert not C.plan_complete(json.loads(_open_plan(tmp_path).read_text()))
    assert C.plan_complete(json.loads((PROTOCOLS / "protocol4" / "alpha_plan.json").read_text()))
    base = args[:args.index("--primary")]
    assert C.main([*base, "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "seed30/central" in err and "nothing was written" in err
    assert not (tmp_path / "res" / "result.json").exists()
    name = "chest_xray_224-evaluation"
    seq = C.sequence(tmp_path / "cmp", name, plan, n_boot=200)
    assert [r["id"] for r in seq] == [t["id"] for t in plan["tests"]]
    prim = C.paired_at_level(tmp_path / "cmp", name, "ohfl", "fedavg", 0.025, n_boot=200)
    assert seq[0]["level"] == pytest.approx(0.025) and seq[0]["ci_low"] == pytest.approx(prim["ci_low"])
    assert seq[0]["succeeded"] == (prim["ci_low"] > 0)
    assert not any(r["succeeded"] for r in seq if r["id"] in ("sensitivity", "refusal_rate", "vs_pooled_reference"))
    outcomes = [r["succeeded"] for r in seq]
    assert [r["level"] for r in seq] == pytest.approx(fallback_levels([t["alpha"] for t in plan["tests"]], outcomes))


def test_the_run_command_runs_and_copies_every_method_its_plan_names(tmp_path, monkeypatch):
    """``run --plan``: the comparison gets the plan's methods (protocol 4's plan adds ``central`` to the first
    protocols' three), one seed at a time, and each finished seed's copy holds every one of them; an unreadable
    plan runs nothing and says so in one line."""
    import nvflare_jobs.compare as compare_mod

    plan = Path(C.__file__).resolve().parent / "protocols" / "protocol4" / "alpha_plan.json"
    calls = []

    def fake_compare(**opts):
        calls.append((opts["methods"], list(opts["seeds"])))
        cmp = Path(opts["out"])
        for m in opts["methods"].split(","):
            _write(cmp / f"seed{opts['seeds'][-1]}" / m / "metrics.json", {"method": m, "seed": opts["seeds"][-1]})
        _write(cmp / "compare.json", {"methods": opts["methods"].split(",")})
        return 0

    monkeypatch.setattr(compare_mod, "compare", fake_compare)
    args = ["run", "--cmp", str(tmp_path / "cmp"), "--results", str(tmp_path / "res"), "--seeds", "50,51"]
    assert C.main([*args, "--plan", str(plan)]) == 0
    assert calls == [("local,fedavg,ohfl,central", [50]), ("local,fedavg,ohfl,central", [50, 51])]
    for s in (50, 51):
        assert {p.name for p in (tmp_path / "res" / "seeds" / f"seed{s}").iterdir() if p.is_dir()} == {
            "local", "fedavg", "ohfl", "central"}
    calls.clear()
    assert C.main([*args, "--plan", str(tmp_path / "nope.json")]) == 2 and calls == []
