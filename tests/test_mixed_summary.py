"""studies/mixed_family/summarise.py on a compare folder built by hand: the family gaps and the deployed-minus-local+ft
differences are recomputed here from the hand values, for the default OHFL run folder and for a compare variant."""
import json

import numpy as np
import pytest

from studies.mixed_family import summarise as S

NAME = "chest_xray_224-tuning"
GROUPS = {"cnn": ["site-1", "site-2"], "resnet": ["site-3", "site-4"]}


def _write(p, obj):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))


def _fake(root, seed, ohfl, rng):
    """One seed: OHFL (run folder ``ohfl``), local and FENS evaluations with random AUCs; returns the hand values."""
    v = {"ens": float(rng.uniform(0.9, 1.0)), "glob": {g: rng.uniform(0.8, 0.95, size=2) for g in GROUPS},
         "dep": rng.uniform(0.8, 0.95, size=4), "loc": rng.uniform(0.7, 0.9, size=4), "fens": float(rng.uniform(0.9, 1))}
    sites = [s for g in GROUPS.values() for s in g]
    oh = {"ensemble": {"kind": "ensemble", "auc": v["ens"]}, "global": {"kind": "global", "auc": 0.9}}
    for g in GROUPS:
        for k, size in enumerate((64, 96)):
            oh[f"global-{g}_{size}px"] = {"kind": "global", "auc": float(v["glob"][g][k])}
    for i, s in enumerate(sites):
        oh[f"{s}_deployed"] = {"kind": "deployed", "auc": float(v["dep"][i]), "balanced_accuracy": 0.8}
    lo = {f"{s}_deployed": {"kind": "deployed", "auc": float(v["loc"][i]), "balanced_accuracy": 0.7}
          for i, s in enumerate(sites)}
    run = root / f"seed{seed}"
    _write(run / ohfl / "external" / NAME / "summary.json", {"models": oh})
    _write(run / "local" / "external" / NAME / "summary.json", {"models": lo})
    _write(run / "fens" / "external" / NAME / "summary.json",
           {"models": {"global": {"kind": "global", "auc": v["fens"], "balanced_accuracy": 0.9}}})
    _write(run / ohfl / "global_models" / "groups.json", {g: {"sites": s} for g, s in GROUPS.items()})
    _write(run / ohfl / "metrics.json", {"method": "ohfl", "seed": seed,
                                         "sites": {s: {"gate": {"adopted": True}} for s in sites}})
    return v


@pytest.mark.parametrize("ohfl", ["ohfl", "ohfl:distill_steps=300"])
def test_family_gaps_and_differences_match_hand_values(tmp_path, ohfl):
    rng = np.random.default_rng(1)
    truth = {s: _fake(tmp_path / "cmp", s, ohfl, rng) for s in (0, 1)}
    out = tmp_path / "r.json"
    args = ["--cmp", str(tmp_path / "cmp"), "--seeds", "0,1", "--out", str(out)]
    assert S.main(args + ([] if ohfl == "ohfl" else ["--ohfl", ohfl])) == 0
    r = json.loads(out.read_text())
    assert r["ohfl_run"] == ohfl
    for row in r["seeds"]:
        t = truth[row["seed"]]
        for gi, g in enumerate(GROUPS):
            f = row["families"][g]
            assert f["global_gap"] == pytest.approx(t["ens"] - t["glob"][g].mean())
            assert f["deployed_minus_local_ft_auc"] == pytest.approx(
                t["dep"][2 * gi:2 * gi + 2].mean() - t["loc"][2 * gi:2 * gi + 2].mean())
        assert row["fens_auc"] - row["ohfl_deployed_auc"] == pytest.approx(t["fens"] - t["dep"].mean())


def test_a_variant_folder_that_is_absent_is_named(tmp_path, capsys):
    _fake(tmp_path / "cmp", 0, "ohfl", np.random.default_rng(2))
    assert S.main(["--cmp", str(tmp_path / "cmp"), "--seeds", "0", "--out", str(tmp_path / "r.json"),
                   "--ohfl", "ohfl:distill_steps=300"]) == 2
    err = capsys.readouterr().err
    assert "ohfl:distill_steps=300" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_an_evaluation_without_the_ensemble_is_named_in_one_line(tmp_path, capsys):
    """A summary.json without the ``ensemble`` entry (an evaluation of another kind of run) is refused in one line
    naming the seed folder and the missing entry (it printed only ``summarise: 'ensemble'``)."""
    _fake(tmp_path, 0, "ohfl", np.random.default_rng(0))
    f = tmp_path / "seed0" / "ohfl" / "external" / NAME / "summary.json"
    d = json.loads(f.read_text())
    del d["models"]["ensemble"]
    f.write_text(json.dumps(d))
    assert S.main(["--cmp", str(tmp_path), "--seeds", "0", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "seed0") in err and "'ensemble'" in err
    assert not (tmp_path / "r.json").exists()
