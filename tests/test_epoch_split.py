"""The epoch-split study's summary and its committed rule, on fake compare folders with hand-set AUCs."""
from __future__ import annotations

import json

import pytest

from studies.epoch_split import summarise as es

NAME = "chest_xray_224-tuning"


def _write(cmp, seed, arm, site_aucs, ensemble=None, glob=None, uploads=None, adopted=None):
    d = cmp / f"seed{seed}" / arm
    (d / "external" / NAME).mkdir(parents=True)
    models = {f"site-{i}_deployed": {"kind": "deployed", "auc": a} for i, a in enumerate(site_aucs, 1)}
    for i, a in enumerate(uploads or [], 1):
        models[f"site-{i}_local"] = {"kind": "local", "auc": a}
    if ensemble is not None:
        models["ensemble"] = {"kind": "ensemble", "auc": ensemble}
        models["global"] = {"kind": "global", "auc": glob}
    (d / "external" / NAME / "summary.json").write_text(json.dumps({"models": models}))
    (d / "metrics.json").write_text(json.dumps({"gate": {"adopted": adopted}, "task_config": {}}))


def _arm(cmp, arm, deployed, gaps):
    for seed, (dep, gap) in enumerate(zip(deployed, gaps)):
        _write(cmp, seed, arm, [dep - 0.01, dep + 0.01], ensemble=0.95, glob=0.95 - gap, uploads=[0.8, 0.9],
               adopted=1)


def _fixture(cmp, a_dep, a_gap, b_dep, b_gap):
    for seed in range(3):
        _write(cmp, seed, "fedavg", [0.93, 0.93])
        _write(cmp, seed, "local", [0.85, 0.87])
    _arm(cmp, es.DEFAULT, [0.90, 0.90, 0.90], [0.01] * 3)
    _arm(cmp, es.CANDIDATES[0], a_dep, a_gap)
    _arm(cmp, es.CANDIDATES[1], b_dep, b_gap)
    return {arm: [es.seed_summary(cmp, s, arm, NAME) for s in range(3)] for arm in (es.DEFAULT, *es.CANDIDATES)}


def test_seed_values_by_hand(tmp_path):
    rows = _fixture(tmp_path, [0.91, 0.89, 0.92], [0.01] * 3, [0.9] * 3, [0.01] * 3)
    r = rows[es.CANDIDATES[0]][0]
    assert r["deployed_auc"] == pytest.approx(0.91)  # mean of 0.90 and 0.92
    assert r["deployed_minus_fedavg"] == pytest.approx(0.91 - 0.93)
    assert r["deployed_minus_local_ft"] == pytest.approx(0.91 - 0.86)
    assert r["global_gap"] == pytest.approx(0.01) and r["uploads_auc"] == pytest.approx(0.85)
    assert r["ensemble_minus_fedavg"] == pytest.approx(0.02)


def test_rule_needs_two_seeds_a_higher_mean_and_the_gap(tmp_path):
    # A: higher at seeds 0 and 2, mean +0.0067, gaps fine -> qualifies. B: higher everywhere, but a gap of 0.03.
    rows = _fixture(tmp_path, [0.91, 0.89, 0.92], [0.01] * 3, [0.95] * 3, [0.01, 0.03, 0.01])
    rule = es.apply_rule(rows)
    a, b = (rule["candidates"][c] for c in es.CANDIDATES)
    assert (a["higher_at"], a["gap_ok"], a["qualifies"]) == (2, True, True)
    assert a["mean_diff"] == pytest.approx((0.01 - 0.01 + 0.02) / 3)
    assert (b["higher_at"], b["gap_ok"], b["qualifies"]) == (3, False, False)
    assert rule["chosen"] == es.CANDIDATES[0]


def test_rule_keeps_the_default_when_higher_at_two_seeds_but_lower_in_the_mean(tmp_path):
    rows = _fixture(tmp_path, [0.905, 0.905, 0.85], [0.01] * 3, [0.90, 0.90, 0.90], [0.0] * 3)
    rule = es.apply_rule(rows)
    assert rule["candidates"][es.CANDIDATES[0]]["higher_at"] == 2 and not rule["candidates"][es.CANDIDATES[0]][
        "qualifies"]
    assert rule["candidates"][es.CANDIDATES[1]]["higher_at"] == 0  # ties are not higher
    assert rule["chosen"] == es.DEFAULT


def test_of_two_that_qualify_the_higher_mean_wins(tmp_path):
    rows = _fixture(tmp_path, [0.91, 0.91, 0.91], [0.01] * 3, [0.92, 0.92, 0.92], [0.02] * 3)
    assert es.apply_rule(rows)["chosen"] == es.CANDIDATES[1]  # a gap of exactly 0.02 meets the target


def test_missing_evaluation_is_named(tmp_path, capsys):
    _fixture(tmp_path, [0.9] * 3, [0.01] * 3, [0.9] * 3, [0.01] * 3)
    gone = tmp_path / "seed1" / es.CANDIDATES[1] / "external" / NAME / "summary.json"
    gone.unlink()
    with pytest.raises(SystemExit) as e:
        es.main(["--cmp", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and str(gone) in err


def _damage(path, change):
    d = json.loads(path.read_text())
    change(d["models"])
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("arm, change", [
    (es.CANDIDATES[0], lambda m: m.pop("ensemble")),
    (es.CANDIDATES[0], lambda m: m.pop("global")),
    (es.DEFAULT, lambda m: m["ensemble"].update(auc=None)),
    (es.CANDIDATES[1], lambda m: m["site-2_deployed"].pop("auc")),
    ("fedavg", lambda m: m.clear()),
    ("local", lambda m: m["site-1_deployed"].update(auc="0.9")),
])
def test_an_evaluation_without_a_needed_model_is_named(tmp_path, capsys, arm, change):
    """A summary.json without the ensemble / global model, or a deployed model without an AUC, gave a KeyError or
    TypeError traceback (or a mean over the other sites); now one line naming the file, exit 2, nothing written."""
    _fixture(tmp_path, [0.9] * 3, [0.01] * 3, [0.9] * 3, [0.01] * 3)
    bad = tmp_path / "seed1" / arm / "external" / NAME / "summary.json"
    _damage(bad, change)
    out = tmp_path / "res.json"
    with pytest.raises(SystemExit) as e:
        es.main(["--cmp", str(tmp_path), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and str(bad) in err, err
    assert not out.exists()


def test_an_arm_without_upload_scores_prints_a_dash(tmp_path, capsys):
    """The uploads' AUC is reported only (not in the rule): an evaluation without them prints '–' (was a TypeError
    after the rule had been computed)."""
    _fixture(tmp_path, [0.9] * 3, [0.01] * 3, [0.9] * 3, [0.01] * 3)
    _damage(tmp_path / "seed2" / es.DEFAULT / "external" / NAME / "summary.json",
            lambda m: [m.pop(k) for k in [k for k, v in m.items() if v["kind"] == "local"]])
    assert es.main(["--cmp", str(tmp_path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  seed 2") and "uploads –" in ln)
    assert "deployed 0.9000" in line


@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_a_bad_out_is_refused_before_anything_is_read(tmp_path, capsys, where):
    """--out into a missing folder or onto a folder gave a FileNotFoundError / IsADirectoryError traceback after the
    whole summary had been printed; now one line naming --out, exit 2, before any file is read."""
    _fixture(tmp_path / "cmp", [0.9] * 3, [0.01] * 3, [0.9] * 3, [0.01] * 3)
    out = tmp_path / "no" / "r.json" if where == "missing_folder" else tmp_path / "cmp"
    with pytest.raises(SystemExit) as e:
        es.main(["--cmp", str(tmp_path / "cmp"), "--out", str(out)])
    cap = capsys.readouterr()
    assert e.value.code == 2 and len(cap.err.strip().splitlines()) == 1 and f"--out {out}" in cap.err, cap.err
    assert cap.out == "" and not (tmp_path / "no").exists()
    good = tmp_path / "r.json"
    assert es.main(["--cmp", str(tmp_path / "cmp"), "--out", str(good)]) == 0
    assert json.loads(good.read_text())["seeds"] == [0, 1, 2] and sorted(p.name for p in tmp_path.iterdir()) == [
        "cmp", "r.json"]  # no temporary file left beside it


@pytest.mark.parametrize("seeds", ["0,0,1", "0,1,0", "-1,0", "", "0;1"])
def test_seeds_named_twice_or_negative_are_refused(tmp_path, capsys, seeds):
    """--seeds 0,0,1 was accepted and seed 0 counted twice in the rule ("higher at 2 or more seeds" met by one
    seed); now refused with one line naming --seeds."""
    _fixture(tmp_path, [0.9] * 3, [0.01] * 3, [0.9] * 3, [0.01] * 3)
    with pytest.raises(SystemExit) as e:
        es.main(["--cmp", str(tmp_path), f"--seeds={seeds}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"summarise: --seeds {seeds!r}: give distinct non-negative integers " \
                                       "separated by commas"


@pytest.mark.parametrize("kind", ["missing", "a_file"])
def test_a_cmp_that_is_not_a_folder_is_named_as_such(tmp_path, capsys, kind):
    """--cmp naming no folder (or a file) was reported as a missing evaluation deep below it ("run compare with
    --external to the end"), which sends the user to rerun a comparison; now the option is named."""
    cmp = tmp_path / "nope"
    if kind == "a_file":
        cmp.write_text("{}")
    with pytest.raises(SystemExit) as e:
        es.main(["--cmp", str(cmp)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"summarise: --cmp {cmp}: " + ("not a folder" if kind == "a_file" else "no such folder"))
