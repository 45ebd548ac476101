"""The controlled prototype-method analysis (``studies/confirmatory/proto_controlled.py``): its paired entries equal the
hand-computed seed-level differences, the primary endpoint is the one the protocol names, a 5-seed effect gets a
verdict and a null one does not get "better", and a folder missing a protocol run is refused before anything is
written. No simulator: predictions are built here."""
from __future__ import annotations

import json

import numpy as np
import pytest

from studies.confirmatory import proto_controlled as pc


def _site(ids, y, pred, C=3):
    from hfl_components.stats import site_metric

    y = np.asarray(y)
    p = np.full((len(y), C), 0.2)
    p[np.arange(len(y)), np.asarray(pred)] = 0.6
    return {"ids": np.asarray(ids), "y": y, "probs": p, "balanced_accuracy": site_metric("balanced_accuracy", y, p),
            "auc": site_metric("auc", y, p), "single_class": False}


def _res(seeds, good: dict, rng):
    """collect()-shaped predictions for the four protocol methods at two sites per seed. The external part is one
    pool of 60 images (ids shared by every site); a method's chance of a correct prediction is ``good[m]``."""
    y_ext = np.tile([0, 1, 2], 20)
    res = {}
    for m, acc in good.items():
        for s in seeds:
            for site in ("site-1", "site-2"):
                for evalset, y, ids in (("external", y_ext, np.arange(60)), ("test", np.array([0, 1, 2] * 3),
                                                                               np.arange(9))):
                    ok = rng.random(len(y)) < acc
                    pred = np.where(ok, y, (y + 1) % 3)
                    res.setdefault(m, {}).setdefault(evalset, {})[(s, site)] = _site(ids, y, pred)
    return res


def test_entries_match_the_hand_computed_seed_means_and_mark_one_primary():
    rng = np.random.default_rng(0)
    res = _res(pc.SEEDS, {"fedsaf": 0.9, "fedsaf:alignment=mse": 0.5, "fedtopo": 0.7, "local": 0.7}, rng)
    entries = pc.analyse(res, n_boot=200)
    assert len(entries) == 2 * 2 * 2  # 2 questions x 2 sets x 2 metrics
    prim = [e for e in entries if e["endpoint"] == "primary"]
    assert [(e["method_a"], e["method_b"], e["set"], e["metric"]) for e in prim] == [
        ("fedsaf", "fedsaf:alignment=mse", "external", "balanced_accuracy"),
        ("fedtopo", "local", "external", "balanced_accuracy")]
    e = prim[0]
    ext_a, ext_b = res["fedsaf"]["external"], res["fedsaf:alignment=mse"]["external"]
    per_seed = [np.mean([ext_a[(s, k)]["balanced_accuracy"] - ext_b[(s, k)]["balanced_accuracy"]
                         for k in ("site-1", "site-2")]) for s in pc.SEEDS]
    assert e["diff"] == pytest.approx(np.mean(per_seed))
    assert list(e["per_seed"].values()) == pytest.approx(per_seed)
    # a 40 pp effect at 5 seeds is found; the seed t-interval is the one computed here by hand
    from scipy import stats
    half = stats.t.ppf(0.975, 4) * np.std(per_seed, ddof=1) / np.sqrt(5)
    assert e["t_low"] == pytest.approx(np.mean(per_seed) - half) and e["verdict"] == "better"


def test_result_lines_name_the_primary_and_give_per_seed_values():
    rng = np.random.default_rng(1)
    res = _res(pc.SEEDS, {"fedsaf": 0.6, "fedsaf:alignment=mse": 0.6, "fedtopo": 0.6, "local": 0.6}, rng)
    L = pc.result_lines(pc.analyse(res, n_boot=100), "python -m studies.confirmatory.proto_controlled --compare x", "cxr")
    prim = [ln for ln in L if ln.startswith("| **primary**")]
    assert len(prim) == 2 and all("evaluation part" in ln and "balanced accuracy" in ln for ln in prim)
    assert sum(ln.startswith("| exploratory") for ln in L) == 6
    assert all(ln.count(" / ") == 4 for ln in prim)  # five per-seed values


def test_a_folder_missing_a_protocol_run_is_refused_before_writing(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    (cmp / "seed20" / "local").mkdir(parents=True)
    (cmp / "seed20" / "local" / "metrics.json").write_text(json.dumps({}))
    out = tmp_path / "out"
    assert pc.main(["--compare", str(cmp), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed20/fedsaf" in err and "seed24/fedtopo" in err and "seed20/local," not in err
    assert not out.exists()
    assert pc.main(["--compare", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert pc.main(["--compare", str(cmp), "--seeds", "2x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


METHODS = ("local", "fedsaf", "fedsaf:alignment=mse", "fedtopo")


def _runs(root, seeds, method_of=lambda m: m):
    """A compare folder with each protocol run's metrics.json (as compare records it: a variant's full name)."""
    for s in seeds:
        for m in METHODS:
            (root / f"seed{s}" / m).mkdir(parents=True, exist_ok=True)
            (root / f"seed{s}" / m / "metrics.json").write_text(json.dumps({"method": method_of(m), "seed": s}))
    return root


def _refused(argv, capsys, *says):
    assert pc.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for x in says:
        assert x in err, err


@pytest.mark.parametrize("rel, content, says", [
    ("seed20/fedsaf", "", "not readable as JSON"),
    ("seed20/fedtopo", json.dumps({"method": "ohfl", "seed": 20}), "records method 'ohfl', seed 20"),
    ("seed20/local", json.dumps({"method": "local", "seed": 21}), "records method 'local', seed 21"),
    ("seed20/fedsaf:alignment=mse", json.dumps({"method": "fedsaf", "seed": 20}),
     "not its folder's 'fedsaf:alignment=mse'"),
])
def test_a_run_file_that_is_not_its_folders_is_refused_before_writing(tmp_path, capsys, rel, content, says):
    """0-byte metrics.json files or another method's (OHFL) gave rc 0 and an empty RESULT.md."""
    cmp, out = _runs(tmp_path / "cmp", [20]), tmp_path / "out"
    f = cmp / rel / "metrics.json"
    f.write_text(content)
    _refused(["--compare", str(cmp), "--out", str(out), "--seeds", "20"], capsys, str(f), says, "nothing was written")
    assert not out.exists()


def test_no_pair_for_a_question_is_refused_rather_than_an_empty_table(tmp_path, capsys, monkeypatch):
    """Well-formed runs without predictions gave `entries: []`; a question missing a seed is refused too, and
    complete predictions are written."""
    import studies.prototype_methods.proto_eval as pe

    cmp, out = _runs(tmp_path / "cmp", [20, 21]), tmp_path / "out"
    argv = ["--compare", str(cmp), "--out", str(out), "--seeds", "20,21"]
    _refused(argv, capsys, "Q1 (fedsaf vs fedsaf:alignment=mse): no (seed, site) pair", "nothing was written")
    assert not out.exists()
    res = _res((20, 21), {m: 0.7 for m in METHODS}, np.random.default_rng(2))
    monkeypatch.setattr(pe, "collect", lambda d, *a: res)
    monkeypatch.setattr(pc, "N_BOOT", 50)  # the refusal does not depend on the replicates; keep the test fast
    full = res["fedtopo"]["external"]
    res["fedtopo"]["external"] = {k: v for k, v in full.items() if k[0] != 21}
    _refused(argv, capsys, "Q2 (fedtopo vs local): no (seed, site) pair at seed(s) 21")
    assert not out.exists()
    res["fedtopo"]["external"] = full
    assert pc.main(argv) == 0
    r = json.loads((out / "result.json").read_text())
    assert sum(e["endpoint"] == "primary" for e in r["entries"]) == 2


def test_help_names_the_defaults(capsys):
    with pytest.raises(SystemExit):
        pc.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--compare DIR" in text and "default: studies/confirmatory/protocols/proto_controlled" in text


def test_default_out_is_the_repositorys_results_folder_from_any_working_folder(tmp_path, capsys, monkeypatch):
    """Without --out the result goes to studies/confirmatory/protocols/proto_controlled of the repository (beside
    PROTOCOL.md), resolved from the script, not from the working folder: run from another folder, nothing is written there."""
    from pathlib import Path

    import studies.prototype_methods.proto_eval as pe

    assert pc.RESULTS == Path(pc.__file__).resolve().parent / "protocols" / "proto_controlled"
    assert (pc.RESULTS / "PROTOCOL.md").is_file()
    cmp = _runs(tmp_path / "cmp", [20, 21])
    monkeypatch.setattr(pe, "collect", lambda d, *a: _res((20, 21), {m: 0.7 for m in METHODS},
                                                          np.random.default_rng(3)))
    monkeypatch.setattr(pc, "N_BOOT", 50)
    monkeypatch.setattr(pc, "RESULTS", tmp_path / "repo_results")  # stands for the committed folder: kept intact
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert pc.main(["--compare", str(cmp), "--seeds", "20,21"]) == 0
    assert (tmp_path / "repo_results" / "result.json").is_file() and list(elsewhere.iterdir()) == []
