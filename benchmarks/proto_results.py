"""Write ``benchmarks/results/fedsaf_table3.md`` and ``fedtopo_table1.md`` from ``cxr-hfl compare`` folders run
under issue 16's protocol (sites from ``chest_xray_224`` tuning + probe, the prototype methods' defaults, each site
model scored on its own test split and on the evaluation part restricted to its classes, paired bootstrap CIs).

    PYTHONPATH=$PWD python benchmarks/proto_results.py --compare "alpha 0.5=runs/proto_a05" \
        --compare "alpha 1.0=runs/proto_a10" --compare "pathological=runs/proto_path" --out benchmarks/results

Each ``--compare LABEL=DIR`` is one compare folder; the section of its ``comparison.md`` is recomputed over every
method found there (methods run at fewer seeds are labelled with their seed count).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PAPER = {
    "fedsaf": "FedSAF paper (Table III, CIFAR-10, Dir(0.1)/Dir(0.5)): GCSA over FedProto-MSE by +1.3 to +3.3 pp.",
    "fedtopo": "FedTopo paper (Table I): FedTopo over Local by +1.95 to +6.01 pp.",
}
LABEL = {"local": "Local", "fedproto": "FedProto (MSE)", "fedsaf": "FedSAF (GCSA)", "fedtopo": "FedTopo",
         "fedsaf:alignment=rcsa": "FedSAF (RCSA)", "fedsaf:alignment=cosine": "FedSAF (cosine)"}


def load(label: str, d: Path) -> dict:
    from nvflare_jobs.compare import _order
    from nvflare_jobs.proto_eval import section

    methods = _order(p.parent.name for p in d.glob("seed*/*/metrics.json"))
    text, summary = section(d, methods)
    seeds = {m: sorted({int(p.parent.parent.name[4:]) for p in d.glob(f"seed*/{m}/metrics.json")}) for m in methods}
    cj = json.loads((d / "compare.json").read_text()) if (d / "compare.json").is_file() else {}
    return {"label": label, "dir": d, "summary": summary, "seeds": seeds, "text": text, "compare": cj}


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _paired_cell(summary: dict, a: str, b: str, evalset: str, metric: str = "balanced_accuracy") -> str:
    for d in summary["paired"]:
        if d["method_a"] == a and d["method_b"] == b and d["set"] == evalset and d["metric"] == metric:
            ci = f" [{100 * d['ci_low']:+.1f}, {100 * d['ci_high']:+.1f}]" if d["ci_low"] is not None else ""
            return f"{100 * d['diff']:+.1f}{ci} pp, {d['n_pairs']} pairs: **{d['verdict']}**"
    return "–"


def table(blocks: list[dict], methods: list[str], ref: str) -> list[str]:
    L = []
    for b in blocks:
        s = b["summary"]
        ms = [m for m in methods if m in s["methods"]]
        if not ms:
            continue
        walls = [json.loads(p.read_text()).get("wall_time_s") for p in Path(b["dir"]).glob("seed*/*/metrics.json")]
        wall = (f" Sum of the {len(walls)} simulate runs' wall times: {sum(w or 0 for w in walls) / 60:.0f} min "
                "(2 shared CPU cores)." if walls else "")
        L += [f"### {b['label']}", "", f"Compare folder `{b['dir']}`; command `{b['compare'].get('command', '?')}`."
              + wall, "",
              "| method | seeds | test bal. acc. % | test AUC % | external bal. acc. % | external AUC % | single-class "
              f"sites (test / ext.) | Δ bal. acc. vs {LABEL[ref]}, test | Δ vs {LABEL[ref]}, external |",
              "|---|---|---|---|---|---|---|---|---|"]
        for m in ms:
            v = s["methods"][m]
            flag = " ⚠ majority-class sites" if v["single_class_test"] or v["single_class_external"] else ""
            seeds = ",".join(map(str, b["seeds"].get(m, [])))
            n1 = " (1 seed)" if len(b["seeds"].get(m, [])) == 1 else ""
            L.append(f"| {LABEL.get(m, m)}{n1}{flag} | {seeds} | {_pct(v['test_bal_acc'])} | {_pct(v['test_auc'])} | "
                     f"{_pct(v['external_bal_acc'])} | {_pct(v['external_auc'])} | {v['single_class_test']} / "
                     f"{v['single_class_external']} | "
                     + ("–" if m == ref else _paired_cell(s, m, ref, "test")) + " | "
                     + ("–" if m == ref else _paired_cell(s, m, ref, "external")) + " |")
        L.append("")
    return L


def outcome(b: dict) -> list[str]:
    """The pass/fail learning floor per method and the two verdicts the issue asks for (FedSAF vs FedProto, FedTopo
    vs Local; balanced accuracy and AUC on both sets), as text, for one compare folder."""
    from nvflare_jobs.proto_eval import FLOOR

    s = b["summary"]
    from nvflare_jobs.compare import _order

    ms = [m for m in _order(list(s["methods"])) if m in LABEL and ":" not in m]  # the plain methods, report order
    if not ms:
        return []
    ok = all(s["methods"][m]["floor_met"] for m in ms)
    L = [f"#### Outcome: {b['label']}", "",
         f"**Learning floor (mean site balanced accuracy >= {FLOOR} on the sites' test splits and on the external "
         f"evaluation part, no site whose test split holds >= 2 classes predicting one class): "
         f"{'met by every method' if ok else 'NOT met'}.** Test / external mean site balanced accuracy, single-class "
         "site models (test / external):", ""]
    for m in ms:
        v = s["methods"][m]
        L.append(f"- {LABEL[m]}: {v['test_bal_acc']:.3f} / {v['external_bal_acc']:.3f}; single-class "
                 f"{v['single_class_test']} / {v['single_class_external']} of {v['pairs']}: "
                 f"{'met' if v['floor_met'] else 'NOT met'}")
    L.append("")
    for a, ref in (("fedsaf", "fedproto"), ("fedtopo", "local"), ("fedsaf", "local"), ("fedproto", "local")):
        if a in s["methods"] and ref in s["methods"]:
            cells = [f"{metric.replace('balanced_accuracy', 'bal. acc.').replace('auc', 'AUC')} {evalset} "
                     + _paired_cell(s, a, ref, evalset, metric)
                     for metric in ("balanced_accuracy", "auc") for evalset in ("test", "external")]
            L.append(f"- {LABEL[a]} vs {LABEL[ref]}: " + "; ".join(cells))
    L.append("")
    return L


def main() -> None:
    from nvflare_jobs.proto_eval import FLOOR, NOTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", action="append", required=True, help="LABEL=DIR (repeatable)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    blocks = [load(*c.split("=", 1)[:1], Path(c.split("=", 1)[1])) for c in a.compare]
    head = ["Protocol (issue 16): 6 sites from the `tuning` + `probe` parts of `chest_xray_224` (1,055 images, "
            "3 classes NORMAL / BACTERIAL / VIRAL, patient-grouped 80/10/10 site splits in which every class a site "
            "holds >= 8 images of has >= 2 images in val and in test: `PROTO_MIN_EVAL_PER_CLASS`), label skew by "
            "Dirichlet or "
            "pathological partition, heterogeneous backbones (hetero_cnn, densenet, resnet, efficientnet) at 64 px, "
            "the prototype methods' defaults (`nvflare_jobs/profiles.py`: PROTO_TRAINING, PROTO_ROUNDS x "
            "PROTO_LOCAL_EPOCHS, chosen on the sites' validation splits in `proto_tuning.md`), every method at "
            "equal local epochs (20 rounds x 1 epoch). Each site deploys the round whose validation balanced accuracy "
            "at the site is best (`deploy: best_val`; ties -> later round; a one-class validation split -> the last "
            "round), the same rule for every method. Each site's deployed model is scored on its own test split and on the committed "
            "`evaluation` part (1,715 images, never trained on) restricted to the classes the site holds. "
            "Balanced accuracy = mean recall over the classes present; AUC = macro one-vs-rest. Δ: paired "
            "difference over (seed, site) pairs with a joint seeds x images bootstrap 95% CI (500 replicates) "
            "and the verdict better / no difference detected / worse. Rows flagged ⚠ hold at least one site "
            "model that predicts a single class although its images hold >= 2 classes (majority-class "
            f"prediction). Learning floor (pass/fail): mean site balanced accuracy >= {FLOOR} on both sets and no "
            "single-class test-split site model. FedProto runs at its paper weights (instance-level MSE only, "
            "gamma 1/64 = the reference code's lambda 1 at its per-element MSE scale; `proto_tuning.md`, third pass); "
            "FedSAF and FedTopo at lambda = gamma = 1.", ""]
    outs = [ln for b in blocks for ln in outcome(b)]
    notes = ["## Caveats", "", *[f"- {n}" for n in NOTES], ""]
    saf = ["# FedSAF Table III analogue: alignment function (issue 16 protocol)", "", PAPER["fedsaf"], "", *head,
           *table(blocks, ["fedproto", "fedsaf", "fedsaf:alignment=rcsa", "fedsaf:alignment=cosine", "local"],
                  "fedproto"), *outs, *notes,
           "Runs at 1 seed are labelled (1 seed); their paired CIs rest on 6 site pairs and resample images only.", ""]
    topo = ["# FedTopo Table I analogue: Local / FedProto / FedSAF / FedTopo (issue 16 protocol)", "",
            PAPER["fedtopo"], "", *head,
            *table(blocks, ["local", "fedproto", "fedsaf", "fedtopo"], "local"), *outs, *notes, ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fedsaf_table3.md").write_text("\n".join(saf))
    (out / "fedtopo_table1.md").write_text("\n".join(topo))
    for b in blocks:
        print(b["label"], json.dumps({m: {k: v[k] for k in ("test_bal_acc", "external_bal_acc", "floor_met")}
                                      for m, v in b["summary"]["methods"].items()}))


if __name__ == "__main__":
    main()
