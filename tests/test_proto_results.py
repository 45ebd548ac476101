"""The 1-seed ablation tables of ``studies/prototype_methods/proto_results.py`` (FedSAF Table VIII, FedTopo Table II):
the variant specs they are run with parse to the intended ``simulate`` options, and the table writer turns a tiny
hand-made compare summary into the rows, paired Δ, verdicts and flags computed here by hand. No simulator."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from studies.prototype_methods import proto_results as pr


def _simulate_args(method: str):
    """The resolved run a compare method variant gives (split_variant, then spec.resolve)."""
    from nvflare_jobs.compare import split_variant
    from nvflare_jobs.spec import resolve

    name, extra = split_variant(method)
    return name, resolve(name, extra)


def test_ablation_variant_specs_set_lambda_gamma_and_ablate():
    from nvflare_jobs.compare import check_variant

    expect = {"fedsaf": (1.0, 1.0, []), "fedsaf:lam=0": (0.0, 1.0, []), "fedsaf:gamma=0": (1.0, 0.0, []),
              "fedsaf:lam=0:gamma=0": (0.0, 0.0, []), "fedtopo": (1.0, 1.0, []),
              "fedtopo:ablate=no_ema": (1.0, 1.0, ["no_ema"]),
              "fedtopo:ablate=local_topology:ablate=no_reliability": (1.0, 1.0, ["local_topology", "no_reliability"])}
    for m, (lam, gamma, ablate) in expect.items():
        assert check_variant(m) is None, m
        name, a = _simulate_args(m)
        assert (name, a.lam, a.gamma, a.options.get("ablate", [])) == (m.split(":")[0], lam, gamma, ablate), m
    # every row of the two ablation tables is a variant compare accepts
    for spec in pr.ABLATIONS.values():
        for m, _, _ in spec["rows"]:
            assert check_variant(m) is None, m
    assert "unknown ablation ['no_such']" in check_variant("fedtopo:ablate=no_such")


def _pred(y, pred, C=3):
    """Probabilities whose argmax is ``pred`` (0.6 on it, 0.2 elsewhere)."""
    p = np.full((len(y), C), 0.2)
    p[np.arange(len(y)), pred] = 0.6
    return p


def _site(ids, y, pred):
    from hfl_components.stats import site_metric
    from studies.prototype_methods.proto_eval import single_class

    y, probs = np.asarray(y), _pred(np.asarray(y), np.asarray(pred))
    return {"ids": np.asarray(ids), "y": y, "probs": probs, "single_class": single_class(y, probs),
            "balanced_accuracy": site_metric("balanced_accuracy", y, probs), "auc": site_metric("auc", y, probs)}


def _res():
    """collect()-shaped predictions of full FedTopo, its no_ema ablation and Local at seed 0 on two sites.
    Balanced accuracies (test): full 1.0 / 2/3, no_ema 0.5 (one class predicted) / 1.0, local 1.0 / 1.0;
    no_missing_mask predicts exactly as full FedTopo."""
    y1, y2 = [0, 0, 1, 1], [0, 1, 2]
    preds = {"fedtopo": ([0, 0, 1, 1], [0, 1, 1]), "fedtopo:ablate=no_ema": ([0, 0, 0, 0], [0, 1, 2]),
             "fedtopo:ablate=no_missing_mask": ([0, 0, 1, 1], [0, 1, 1]), "local": ([0, 0, 1, 1], [0, 1, 2])}
    res = {}
    for m, (p1, p2) in preds.items():
        sets = {"test": {(0, "site-1"): _site([0, 1, 2, 3], y1, p1), (0, "site-2"): _site([0, 1, 2], y2, p2)},
                "external": {(0, "site-1"): _site([0, 1, 2, 3], y1, p1), (0, "site-2"): _site([4, 5, 6], y2, p2)}}
        res[m] = sets
    return res


def test_ablation_pairs_give_the_hand_computed_paired_difference():
    res = _res()
    pairs = pr.ablation_pairs(res, "fedtopo", ["fedtopo", "fedtopo:ablate=no_ema", "fedtopo", "local"], n_boot=50)
    # 2 methods (full skipped, duplicate dropped) x 2 sets x 2 metrics
    assert len(pairs) == 8
    assert pr.same_predictions(res, "fedtopo:ablate=no_missing_mask", "fedtopo")
    assert not pr.same_predictions(res, "fedtopo:ablate=no_ema", "fedtopo")
    assert not pr.same_predictions(res, "fedtopo:ablate=no_reliability", "fedtopo")  # absent
    mask = pr.ablation_pairs(res, "fedtopo", ["fedtopo:ablate=no_missing_mask"], n_boot=20)
    assert all(d["diff"] == 0 for d in mask) and len(mask) == 4
    assert {(d["method_a"], d["method_b"]) for d in pairs} == {("fedtopo:ablate=no_ema", "fedtopo"),
                                                               ("local", "fedtopo")}
    d = next(d for d in pairs if d["method_a"] == "fedtopo:ablate=no_ema" and d["set"] == "test"
             and d["metric"] == "balanced_accuracy")
    # site-1: 0.5 - 1.0; site-2: 1.0 - 2/3 -> mean -1/12
    assert d["diff"] == pytest.approx(-1 / 12) and d["n_pairs"] == 2
    assert d["a"] == pytest.approx(0.75) and d["b"] == pytest.approx(5 / 6)
    # one seed: its six sites are not independent replicates, so there is no interval and no verdict
    assert d["ci_low"] is None and d["verdict"] is None and d["per_seed"] == {"0": pytest.approx(-1 / 12)}
    loc = next(d for d in pairs if d["method_a"] == "local" and d["set"] == "external"
               and d["metric"] == "balanced_accuracy")
    assert loc["diff"] == pytest.approx(1 / 6)  # site-1 equal, site-2 1.0 - 2/3, over 2 pairs
    assert pr.ablation_pairs(res, "fedsaf", ["fedsaf:lam=0"]) == []  # absent methods: nothing


def test_ablation_file_rows_flags_paper_numbers_and_1_seed_headings(tmp_path):
    res = _res()
    methods = {}
    for m, sets in res.items():
        t, e = sets["test"], sets["external"]
        methods[m] = {"pairs": 2, "test_bal_acc": float(np.mean([v["balanced_accuracy"] for v in t.values()])),
                      "external_bal_acc": float(np.mean([v["balanced_accuracy"] for v in e.values()])),
                      "test_auc": float(np.mean([v["auc"] for v in t.values()])),
                      "external_auc": float(np.mean([v["auc"] for v in e.values()])),
                      "single_class_test": sum(v["single_class"] for v in t.values()),
                      "single_class_external": sum(v["single_class"] for v in e.values()), "floor_met": False}
    rows = [{"method": m, "set": k, "seed": s, "site": site, "n": len(v["y"]), "single_class": v["single_class"]}
            for m in res for k in ("test", "external") for (s, site), v in res[m][k].items()]
    b = {"label": "toy (1 seed)", "dir": tmp_path, "seeds": {m: [0] for m in res}, "text": "",
         "compare": {"command": "cxr-hfl compare --methods local,fedtopo,fedtopo:ablate=no_ema --seeds 0"},
         "summary": {"methods": methods, "paired": pr.ablation_pairs(res, "fedtopo", list(res), n_boot=50),
                     "rows": rows}, "identical": {"fedtopo:ablate=no_missing_mask"}}
    L = pr.ablation_file(b, "fedtopo_table2", 0.55, ["a caveat"], "python -m studies.prototype_methods.proto_results --ablation x",
                         wall_s=150)
    text = "\n".join(L)
    assert all("1 seed" in ln for ln in L if ln.startswith("#")), [ln for ln in L if ln.startswith("#")]
    row = {ln.split(" | ")[0]: ln for ln in L if ln.startswith("| ")}
    full = row["| FedTopo (full) (1 seed)"]
    # full: test bal. acc. (1 + 2/3) / 2 = 83.3 %, external the same; its Δ cells are '–'; paper 87.38 (0.00)
    assert "| 0 | 83.3 |" in full and full.endswith("| – | – | 87.38 (0.00) |")
    topq = next(v for k, v in row.items() if k.startswith("| w/o top-q"))
    assert topq.split(" | ")[1:] == full.split(" | ")[1:-1] + ["85.84 (1.54) |"]  # same run, own paper cell
    ema = row["| w/o topology EMA (1 seed) ⚠ majority-class sites"]
    assert "| 75.0 |" in ema and "| 1 / 1 |" in ema and "2 pairs" in ema
    assert "-8.3 pp; per seed -8.3 (1 seed(s): no reliable interval), 2 pairs: **no verdict (1 seed(s) < 5)**, " \
        "exploratory" in ema
    assert "86.36 (1.02)" in ema
    assert "⚠" not in row["| w/o topology loss (= Local) (1 seed)"]
    assert "fedtopo:ablate=no_ema seed 0 site-1 (test, 4 images)" in text
    assert "Not run in this folder: w/ local topology; w/o reliability S^g." in text
    assert "Identical to full FedTopo: every site model of w/o missing mask gives exactly" in text
    assert "| Δ bal. acc. vs full FedTopo, test | Δ vs full FedTopo, external |" in text
    assert "No primary endpoint in this table: every Δ is exploratory." in text and "[" not in ema
    assert "the compare command took 2 min wall-clock in all" in text
    mask = row["| w/o missing mask (1 seed)"]
    assert "| 83.3 |" in mask and "+0.0 pp; per seed +0.0 (1 seed(s): no reliable interval), 2 pairs" in mask
    assert "q_eff = min(q, C - 1) = C - 1" in text and "- a caveat" in text
    assert "paper (CIFAR-10 Dir(0.1), acc. % (Δ))" in text


def test_mean_ci_is_a_seed_level_t_interval():
    """The interval of the mean site balanced accuracy averages the sites within each seed first (they are not
    independent), then takes the Student-t interval over the seeds (df = seeds - 1); none under 5 seeds. NaN values
    (a site without a metric) are dropped."""
    from scipy import stats as st

    from studies.prototype_methods.proto_eval import mean_ci

    per = [0.6, 0.7, 0.65, 0.5, 0.55]
    vals = {(s, k): per[s] + d for s in range(5) for k, d in enumerate((-0.1, 0.1, 0.0))}
    half = st.t.ppf(0.975, 4) * np.std(per, ddof=1) / np.sqrt(5)
    assert mean_ci(vals) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))
    assert mean_ci({**vals, (0, 9): float("nan")}) == mean_ci(vals)
    assert mean_ci({k: 0.6 for k in vals}) == (pytest.approx(0.6), pytest.approx(0.6))
    assert mean_ci({k: v for k, v in vals.items() if k[0] < 4}) is None and mean_ci({}) is None


def _onehot(pred, n_cls=3):
    return np.eye(n_cls)[np.asarray(pred)]


def test_single_class_chance_hand_cases():
    """sum_k prod_c R[c,k]^n_c on hand-built external rates."""
    from studies.prototype_methods.proto_eval import single_class_chance

    # external: class 0 -> always 0; class 1 -> 0 six times, 1 once, 2 three times; test 15 x class 0 + 1 x class 1
    ext_y = [0] * 10 + [1] * 10
    ext_p = _onehot([0] * 10 + [0] * 6 + [1] + [2] * 3)
    assert single_class_chance([0] * 15 + [1], ext_y, ext_p) == pytest.approx(0.6)
    # class 0 -> 0 at 0.9, 2 at 0.1; class 2 -> 0 at 0.5, 2 at 0.5; test 2 + 2: 0.9^2 0.5^2 + 0.1^2 0.5^2
    ext_y = [0] * 10 + [2] * 4
    ext_p = _onehot([0] * 9 + [2] + [0, 0, 2, 2])
    assert single_class_chance([0, 0, 2, 2], ext_y, ext_p) == pytest.approx(0.81 * 0.25 + 0.01 * 0.25)
    # a model that always separates the classes never gives a single-class test split
    assert single_class_chance([0, 1], [0, 1], _onehot([0, 1])) == 0.0
    # one test class: not defined; a test class with no external image: no rate
    assert single_class_chance([0, 0], ext_y, ext_p) is None
    assert single_class_chance([0, 1], ext_y, ext_p) is None
    # soft probabilities: the rates come from the arg-max, not from averaged probabilities. Class 0's external images
    # are all predicted 0 (p0 = 0.4 > 0.3, 0.3: mean p0 would be 0.4); class 1's: one predicted 1 (0.6), one 0 (0.5)
    soft = np.array([[0.4, 0.3, 0.3], [0.4, 0.3, 0.3], [0.2, 0.6, 0.2], [0.5, 0.4, 0.1]])
    assert single_class_chance([0, 0, 1], [0, 0, 1, 1], soft) == pytest.approx(1.0 * 0.5)
    # a tie goes to the lower class index, as in single_class
    tie = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    assert single_class_chance([0, 1], [0, 1], tie) == 0.0  # class 0 -> 0, class 1 -> 1
    assert single_class_chance([0, 0, 1], [0, 1], np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])) == 1.0
    # bad input: one clear ValueError
    for args, says in ((([0, 1], [0, 1], np.ones(2)), "must be"), (([0, 1], [0, 1, 1], tie), "must be"),
                       (([0, 1], [0, 1], np.array([[np.nan, 1, 0], [0, 1, 0]])), "non-finite"),
                       (([0, 1.5], [0, 1], tie), "integer class indices"), (([0, 3], [0, 1], tie), "0..2"),
                       (([[0, 1]], [0, 1], tie), "1-D"), (([0, 1], [[0], [1]], tie), "1-D"),
                       (([0, 1], [0, 1], np.zeros((2, 0))), "C >= 1"), (([0, 1j], [0, 1], tie), "real")):
        with pytest.raises(ValueError, match=says):
            single_class_chance(*args)


def test_single_class_chance_matches_a_simulation_of_the_test_split():
    """Monte Carlo: draw each test image's prediction from its class's external rates, count single-class splits."""
    from studies.prototype_methods.proto_eval import single_class_chance

    rng = np.random.default_rng(0)
    R = np.array([[0.8, 0.1, 0.1], [0.5, 0.3, 0.2], [0.6, 0.1, 0.3]])
    ext_y = np.repeat([0, 1, 2], 1000)
    ext_pred = np.concatenate([np.repeat([0, 1, 2], (R[c] * 1000).astype(int)) for c in range(3)])
    test_y = np.array([0] * 4 + [1] * 2 + [2])
    sims = rng.random((100_000, test_y.size))[:, :, None] > np.cumsum(R[test_y], axis=1)[None]
    draws = sims.sum(axis=2)  # index of the sampled class per image
    freq = float(np.mean((draws == draws[:, :1]).all(axis=1)))
    p = single_class_chance(test_y, ext_y, _onehot(ext_pred))
    assert p == pytest.approx(freq, abs=0.005)
    assert p == pytest.approx(sum(np.prod(R[test_y, k]) for k in range(3)))


def test_section_flags_a_single_class_test_split_with_its_counts_and_chance(tmp_path, monkeypatch):
    """A site model whose 3-image test split (2 x class 0, 1 x class 1) is all predicted 0, and which predicts class 1
    as 0 for half of the external class-1 images: flagged with 'test 2+1+0' and P(single) = 1^2 x 0.5 = 0.5."""
    import studies.prototype_methods.proto_eval as pe

    test = _site([0, 1, 2], [0, 0, 1], [0, 0, 0])
    ext = _site(list(range(6)), [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1])
    ok = _site([0, 1], [0, 1], [0, 1])
    res = {"local": {"test": {(0, "site-1"): test, (0, "site-2"): ok},
                     "external": {(0, "site-1"): ext, (0, "site-2"): ok}}}
    monkeypatch.setattr(pe, "collect", lambda out, data_root=None: res)
    text, summary = pe.section(tmp_path, ["local"])
    assert "**local seed 0 site-1 (test)** (test 2+1+0; P(single) 0.500)" in text
    chance = {(r["site"], r["set"]): r.get("single_class_chance") for r in summary["rows"]}
    assert chance[("site-1", "test")] == pytest.approx(0.5)
    assert chance[("site-2", "test")] == 0.0 and ("site-1", "external") not in {
        k for k, v in chance.items() if v is not None}
    assert summary["methods"]["local"]["single_class_test"] == 1


def test_proto_results_refuses_bad_folders_before_writing_and_keeps_the_hand_written_outcome(tmp_path, capsys):
    """A missing / empty folder or a spec without '=' exits 2 with one line and writes nothing; an --out that is a
    file is refused; a hand-written '## Outcome (' section of an existing results file survives regeneration."""
    out = tmp_path / "res"
    out.mkdir()
    (out / "fedsaf_table3.md").write_text("old table\n\n## Outcome (by hand)\n\nkept text\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for spec, says in ((f"X={tmp_path / 'nope'}", "no folder"), (f"X={empty}", "no finished run"),
                       ("X", "expected LABEL=DIR"), ("=runs", "expected LABEL=DIR")):
        with pytest.raises(SystemExit) as e:
            pr.main(["--compare", spec, "--out", str(out)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert (out / "fedsaf_table3.md").read_text().startswith("old table")
    with pytest.raises(SystemExit) as e:
        pr.main(["--ablation", f"X={empty}", "--out", str(out)])
    assert e.value.code == 2
    afile = tmp_path / "a_file"
    afile.write_text("")
    assert pr.kept_outcome(out / "fedsaf_table3.md") == "\n## Outcome (by hand)\n\nkept text\n"
    assert pr.kept_outcome(afile) == "" and pr.kept_outcome(tmp_path / "missing.md") == ""
    run = tmp_path / "cmp" / "seed0" / "local"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        pr.main(["--compare", f"X={tmp_path / 'cmp'}", "--out", str(afile)])
    assert e.value.code == 2 and "is a file" in capsys.readouterr().err
