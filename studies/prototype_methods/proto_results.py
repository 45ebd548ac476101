"""Write ``studies/prototype_methods/fedsaf_table3.md`` and ``fedtopo_table1.md`` from ``cxr-hfl compare`` folders run
under the prototype-method protocol (``docs/evaluation.md``: sites from ``chest_xray_224`` tuning + probe, the
prototype methods' defaults, each site model scored on its own test split and on the evaluation part restricted to its classes, paired bootstrap CIs).

    python -m studies.prototype_methods.proto_results --compare "alpha 0.5=runs/grid_a05" \
        --compare "alpha 1.0=runs/a10_s0" --compare "pathological=runs/path_s0" --out /tmp/tables

(the folders are what ``cxr-hfl compare --out`` wrote; the exact commands behind the committed files are written at
the end of their tables). A folder that does not exist or holds no finished run is refused (exit 2) before anything
is written. Regenerating a results file keeps its hand-written analysis: everything from its first line starting
with ``## Outcome (`` is carried over below the new tables.

Each ``--compare LABEL=DIR`` is one compare folder; the section of its ``comparison.md`` is recomputed over every
method found there (methods run at fewer seeds are labelled with their seed count).

``--ablation LABEL=DIR`` writes ``fedsaf_table8.md`` and ``fedtopo_table2.md`` (the papers' ablation tables, at 1
seed) from one compare folder holding the variants of :data:`ABLATIONS`, each paired against the full method:

    cxr-hfl compare --methods local,fedsaf,fedsaf:lam=0:gamma=0,fedsaf:gamma=0,fedsaf:lam=0,fedtopo,\
        fedtopo:ablate=local_topology,fedtopo:ablate=no_reliability,fedtopo:ablate=no_missing_mask,\
        fedtopo:ablate=no_ema --labels subtype --scheme dirichlet --alpha 0.5 --seeds 0 --out runs/ablate_s0
    python -m studies.prototype_methods.proto_results --ablation "Dirichlet alpha 0.5, 6 sites (1 seed)=runs/ablate_s0"
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PAPER = {
    "fedsaf": "FedSAF paper (Table III, CIFAR-10, Dir(0.1)/Dir(0.5)): GCSA over FedProto-MSE by +1.3 to +3.3 pp.",
    "fedtopo": "FedTopo paper (Table I): FedTopo over Local by +1.95 to +6.01 pp.",
}
LABEL = {"local": "Local", "fedproto": "FedProto (MSE)", "fedsaf": "FedSAF (GCSA)", "fedtopo": "FedTopo",
         "fedsaf:alignment=rcsa": "FedSAF (RCSA)", "fedsaf:alignment=cosine": "FedSAF (cosine)"}


def load(label: str, d: Path) -> dict:
    from nvflare_jobs.compare import method_order
    from studies.prototype_methods.proto_eval import section

    methods = method_order(p.parent.name for p in d.glob("seed*/*/metrics.json"))
    text, summary = section(d, methods)
    seeds = {m: sorted({int(p.parent.parent.name[4:]) for p in d.glob(f"seed*/{m}/metrics.json")}) for m in methods}
    cj = json.loads((d / "compare.json").read_text()) if (d / "compare.json").is_file() else {}
    return {"label": label, "dir": d, "summary": summary, "seeds": seeds, "text": text, "compare": cj}


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _paired_cell(summary: dict, a: str, b: str, evalset: str, metric: str = "balanced_accuracy",
                 primary: tuple | None = None) -> str:
    """``Δ pp (CI or per-seed differences), n pairs: **verdict**, primary|exploratory`` of the paired entry
    (``hfl_components.stats`` rule: no interval nor verdict under 5 seeds); ``primary``: ``(a, b, evalset, metric)``
    of the table's primary endpoint."""
    from hfl_components.stats import endpoint_label, paired_cell, verdict_cell

    for d in summary["paired"]:
        if d["method_a"] == a and d["method_b"] == b and d["set"] == evalset and d["metric"] == metric:
            role = endpoint_label((a, b, evalset, metric) == primary)
            return (f"{paired_cell(d, 100, 1, ' pp')}, {d['n_pairs']} pairs: **{verdict_cell(d)}**, {role}")
    return "–"


def table(blocks: list[dict], methods: list, ref: str, paper_col: str | None = None,
          ref_label: str | None = None, primary: tuple[str, str] | None = None) -> list[str]:
    """One markdown table per compare block: a row per method (mean site balanced accuracy / AUC on the test splits
    and on the external part, single-class site counts, paired Δ balanced accuracy vs ``ref`` with its CI and
    verdict, looked up in the block's ``summary["paired"]``).

    ``methods``: method names (row label from :data:`LABEL`) or ``(method, row label, paper cell)`` triples (the same
    run may appear under two labels, e.g. FedTopo's 'w/o top-q' = full FedTopo); ``paper_col``: when given, the
    header of a last column holding each triple's paper cell (absent otherwise, so the plain tables are unchanged);
    ``ref_label``: how the Δ column headers name ``ref`` (default: its row label); ``primary``: ``(method,
    "test"|"external")``, the table's primary endpoint (that method's Δ balanced accuracy vs ``ref`` on that set);
    every other Δ is labelled exploratory, and so is every one when None.
    """
    L = []
    pkey = (primary[0], ref, primary[1], "balanced_accuracy") if primary else None
    rows_all = [(m, LABEL.get(m, m), None) if isinstance(m, str) else m for m in methods]
    ref_label = ref_label or next((lab for m, lab, _ in rows_all if m == ref), LABEL.get(ref, ref))
    for b in blocks:
        s = b["summary"]
        rows = [r for r in rows_all if r[0] in s["methods"]]
        if not rows:
            continue
        walls = [json.loads(p.read_text()).get("wall_time_s") for p in Path(b["dir"]).glob("seed*/*/metrics.json")]
        wall = (f" Sum of the {len(walls)} simulate runs' wall times: {sum(w or 0 for w in walls) / 60:.0f} min "
                "(2 shared CPU cores)." if walls else "")
        L += [f"### {b['label']}", "", f"Compare folder `{b['dir']}`; command `{b['compare'].get('command', '?')}`."
              + wall, "",
              "| method | seeds | test bal. acc. % | test AUC % | external bal. acc. % | external AUC % | single-class "
              f"sites (test / ext.) | Δ bal. acc. vs {ref_label}, test | Δ vs {ref_label}, external |"
              + (f" {paper_col} |" if paper_col else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if paper_col else "")]
        if primary and primary[0] in s["methods"]:
            L[-3:-3] = [f"Primary endpoint of this table: {LABEL.get(primary[0], primary[0])} vs {ref_label}, Δ "
                        f"balanced accuracy on the {'external part' if primary[1] == 'external' else 'test splits'}; "
                        "every other Δ is exploratory (no multiplicity correction).", ""]
        else:
            L[-3:-3] = ["No primary endpoint in this table: every Δ is exploratory.", ""]
        for m, label, paper in rows:
            v = s["methods"][m]
            flag = " ⚠ majority-class sites" if v["single_class_test"] or v["single_class_external"] else ""
            seeds = ",".join(map(str, b["seeds"].get(m, [])))
            n1 = " (1 seed)" if len(b["seeds"].get(m, [])) == 1 else ""
            L.append(f"| {label}{n1}{flag} | {seeds} | {_pct(v['test_bal_acc'])} | {_pct(v['test_auc'])} | "
                     f"{_pct(v['external_bal_acc'])} | {_pct(v['external_auc'])} | {v['single_class_test']} / "
                     f"{v['single_class_external']} | "
                     + ("–" if m == ref else _paired_cell(s, m, ref, "test", primary=pkey)) + " | "
                     + ("–" if m == ref else _paired_cell(s, m, ref, "external", primary=pkey)) + " |"
                     + (f" {paper or '–'} |" if paper_col else ""))
        L.append("")
    return L


def outcome(b: dict) -> list[str]:
    """The pass/fail learning floor per method and the two verdicts the issue asks for (FedSAF vs FedProto, FedTopo
    vs Local; balanced accuracy and AUC on both sets), as text, for one compare folder."""
    from studies.prototype_methods.proto_eval import FLOOR

    s = b["summary"]
    from nvflare_jobs.compare import method_order

    ms = [m for m in method_order(list(s["methods"])) if m in LABEL and ":" not in m]  # the plain methods, report order
    if not ms:
        return []
    ok = all(s["methods"][m]["floor_met"] for m in ms)
    L = [f"#### Outcome: {b['label']}", "",
         f"**Learning floor (mean site balanced accuracy >= {FLOOR} on the sites' test splits and on the external "
         f"evaluation part, no site whose test split holds >= 2 classes predicting one class): "
         f"{'met by every method' if ok else 'NOT met'}.** Test / external mean site balanced accuracy (point "
         "estimates, which the floor is judged on; in brackets, from 5 seeds on, a 95% seed-level t-interval of the "
         "per-seed means), single-class site models (test / external); the verdicts below are exploratory:", ""]

    def ci(c) -> str:
        return f" [{c[0]:.3f}, {c[1]:.3f}]" if c else ""

    for m in ms:
        v = s["methods"][m]
        L.append(f"- {LABEL[m]}: {v['test_bal_acc']:.3f}{ci(v.get('test_bal_acc_ci'))} / "
                 f"{v['external_bal_acc']:.3f}{ci(v.get('external_bal_acc_ci'))}; single-class "
                 f"{v['single_class_test']} / {v['single_class_external']} of {v['pairs']}: "
                 f"{'met' if v['floor_met'] else 'NOT met'}")
    flagged = [r for r in s.get("rows", []) if r["set"] == "test" and r["single_class"] and r["method"] in LABEL]
    if flagged:
        L += ["", "Single-class test splits: the test split's images per class (NORMAL+BACTERIAL+VIRAL) and P(single), "
              "the chance that this model predicts one class for the whole split were each image predicted like the "
              "external images of its class (a diagnostic, not part of the floor):", ""]
        L += [f"- {LABEL[r['method']]} seed {r['seed']} {r['site']}: test "
              f"{'+'.join(str(c) for c in r.get('class_counts', []))}; P(single) "
              + ("–" if r.get("single_class_chance") is None else f"{r['single_class_chance']:.2f}")
              for r in flagged]
    L.append("")
    for a, ref in (("fedsaf", "fedproto"), ("fedtopo", "local"), ("fedsaf", "local"), ("fedproto", "local")):
        if a in s["methods"] and ref in s["methods"]:
            cells = [f"{metric.replace('balanced_accuracy', 'bal. acc.').replace('auc', 'AUC')} {evalset} "
                     + _paired_cell(s, a, ref, evalset, metric)
                     for metric in ("balanced_accuracy", "auc") for evalset in ("test", "external")]
            L.append(f"- {LABEL[a]} vs {LABEL[ref]}: " + "; ".join(cells))
    L.append("")
    return L


def protocol_head(floor: float) -> list[str]:
    """The protocol paragraph every results file opens with, as markdown lines."""
    return ["Protocol (prototype methods, `docs/evaluation.md`): 6 sites from the `tuning` + `probe` parts of `chest_xray_224` (1,055 images, "
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
            "difference, mean over seeds of the seed's mean over its sites, with a 95% interval with seeds as "
            "clusters (`hfl_components.stats`: on the external part a cluster bootstrap-t, 500 replicates, one "
            "shared image draw; on the test splits the seed-level t-interval) "
            "and the verdict better / not worse (margin 3 pp) / worse / inconclusive; under 5 seeds the per-seed "
            "differences are shown and there is no interval and no verdict. Rows flagged ⚠ hold at least one site "
            "model that predicts a single class although its images hold >= 2 classes (majority-class "
            f"prediction). Learning floor (pass/fail): mean site balanced accuracy >= {floor} on both sets and no "
            "single-class test-split site model. FedProto runs at its paper weights (instance-level MSE only, "
            "gamma 1/64 = the reference code's lambda 1 at its per-element MSE scale; `proto_tuning.md`, third pass); "
            "FedSAF and FedTopo at lambda = gamma = 1.", ""]


# The paper ablation tables regenerated at 1 seed: rows (method variant, row label, paper cell), the full
# method every variant is paired against, and what the paper numbers are.
ABLATIONS = {
    "fedsaf_table8": {
        "title": "# FedSAF Table VIII analogue: GCSA loss terms (prototype-methods protocol, 1 seed)",
        "paper": "FedSAF paper Table VIII (CIFAR-10, Dir(0.1), HtFE9, GCSA): test accuracy %, mean ± std over the "
                 "paper's runs; IV (both terms) is the best, I (neither term) the worst, by 3.2 pp. The paper ran this "
                 "ablation on Dir(0.1) only; our column is Dir(0.5) at 6 sites, so the paper numbers are a reference, "
                 "not a target.",
        "paper_col": "paper (CIFAR-10 Dir(0.1), acc. %)",
        "ref": "fedsaf",
        "ref_label": "IV (full FedSAF)",
        "rows": [("fedsaf", "IV: both terms (GCSA, λ = γ = 1; full FedSAF)", "88.03 ± 0.13"),
                 ("fedsaf:lam=0", "III: instance level only (λ = 0)", "87.02 ± 0.13"),
                 ("fedsaf:gamma=0", "II: prototype level only (γ = 0)", "86.45 ± 0.11"),
                 ("fedsaf:lam=0:gamma=0", "I: neither term (λ = γ = 0)", "84.87 ± 0.15"),
                 ("local", "Local (reference; not a Table VIII row)", None)],
    },
    "fedtopo_table2": {
        "title": "# FedTopo Table II analogue: FedTopo ablations (prototype-methods protocol, 1 seed)",
        "paper": "FedTopo paper Table II (CIFAR-10, Dirichlet alpha = 0.1, the only setting the paper ablates): "
                 "test accuracy %, and in brackets the paper's Δ = full FedTopo minus the variant (positive = the "
                 "variant is worse). Its 'w/o Topo. Loss' row is standalone local training, i.e. our Local. Our "
                 "column is Dir(0.5) at 6 sites, so the paper numbers are a reference, not a target.",
        "paper_col": "paper (CIFAR-10 Dir(0.1), acc. % (Δ))",
        "ref": "fedtopo",
        "ref_label": "full FedTopo",
        "rows": [("fedtopo", "FedTopo (full)", "87.38 (0.00)"),
                 ("fedtopo:ablate=local_topology", "w/ local topology", "86.01 (1.37)"),
                 ("fedtopo:ablate=no_reliability", "w/o reliability S^g", "86.44 (0.94)"),
                 ("fedtopo", "w/o top-q (= full FedTopo: top_q 3 >= C - 1 = 2; same run, not rerun)", "85.84 (1.54)"),
                 ("fedtopo:ablate=no_missing_mask", "w/o missing mask", "86.09 (1.29)"),
                 ("fedtopo:ablate=no_ema", "w/o topology EMA", "86.36 (1.02)"),
                 ("local", "w/o topology loss (= Local)", "85.43 (1.95)")],
    },
}
ABLATION_LIMITS = {
    "fedsaf_table8": "With 3 classes GCSA's prototype-level term compares 3 x 3 centred Gram matrices of the class "
                     "prototypes (a site holding 2 classes contributes one off-diagonal entry), so terms II and III "
                     "have little class-relation structure to transfer; I (λ = γ = 0) trains each site on plain "
                     "cross-entropy, i.e. Local training inside the FedSAF job (compare it with the Local row).",
    "fedtopo_table2": "With 3 classes the topology R is a 3 x 3 matrix and top-q (q = 3, clipped to C - 1 = 2) keeps "
                      "every negative class, so 'w/o top-q' is full FedTopo by construction "
                      "(`hfl_components/topology/loss.py`: q_eff = min(q, C - 1) = C - 1 either way) and was not "
                      "rerun; 'w/o missing mask' drops the mask of the classes a site does not hold, so it is a "
                      "no-op at a site that holds all 3 classes in training; the other ablations change a 3 x 3 "
                      "guidance whose off-diagonal has 3 entries.",
}


def ablation_pairs(res: dict, ref: str, methods: list[str], n_boot: int = 500) -> list[dict]:
    """Paired differences of every method in ``methods`` (but ``ref``) against ``ref``: balanced accuracy and AUC on
    the sites' test splits and on the external part, each a :func:`studies.prototype_methods.proto_eval.paired` result (seeds as
    clusters, ``n_boot`` replicates) with ``method_a`` / ``method_b`` / ``set`` added, the entries
    :func:`_paired_cell` looks up. ``res``: :func:`studies.prototype_methods.proto_eval.collect`'s per-(seed, site) predictions.
    Methods absent from ``res`` are skipped."""
    from studies.prototype_methods.proto_eval import paired

    out = []
    for m in dict.fromkeys(methods):
        if m == ref or m not in res or ref not in res:
            continue
        for evalset in ("test", "external"):
            for metric in ("balanced_accuracy", "auc"):
                d = paired(res, m, ref, evalset, metric, n_boot)
                if d is not None:
                    out.append({**d, "method_a": m, "method_b": ref, "set": evalset})
    return out


def same_predictions(res: dict, a: str, b: str) -> bool:
    """True when methods ``a`` and ``b`` hold the same (seed, site) pairs on both evaluation sets and every site
    model gives exactly the same class probabilities on the same images (e.g. an ablation that is a no-op on this
    partition). ``res``: :func:`studies.prototype_methods.proto_eval.collect`'s output."""
    if a not in res or b not in res:
        return False
    for evalset in ("test", "external"):
        ra, rb = res[a].get(evalset, {}), res[b].get(evalset, {})
        if set(ra) != set(rb):
            return False
        for k in ra:
            if not (np.array_equal(ra[k]["ids"], rb[k]["ids"]) and np.array_equal(ra[k]["probs"], rb[k]["probs"])):
                return False
    return True


def ablation_file(b: dict, name: str, floor: float, notes: list[str], command: str,
                  wall_s: float | None = None) -> list[str]:
    """The lines of ``studies/prototype_methods/<name>.md`` (``name`` a key of :data:`ABLATIONS`) for one compare block
    whose ``summary["paired"]`` already holds :func:`ablation_pairs` against the spec's full method; ``wall_s``: the
    compare command's wall-clock seconds when known (recorded in the run record)."""
    spec = ABLATIONS[name]
    ref, rows = spec["ref"], spec["rows"]
    ref_label = spec["ref_label"]
    s = b["summary"]
    present = [r for r in rows if r[0] in s["methods"]]
    missing = [lab for m, lab, _ in rows if m not in s["methods"]]
    seeds = sorted({x for r in present for x in b["seeds"].get(r[0], [])})
    new = [p for p in Path(b["dir"]).glob("seed*/*/metrics.json") if ":" in p.parent.name]
    wall = sum(json.loads(p.read_text()).get("wall_time_s") or 0 for p in new)
    L = [spec["title"], "", spec["paper"], "", *protocol_head(floor),
         f"**1 seed** (seed{'s' if len(seeds) != 1 else ''} {','.join(map(str, seeds))}): every row is one (seed 0) "
         "run of 6 sites. The 6 sites of one seed are not independent replicates, so no interval is reliable and "
         "no verdict is given: each Δ is that seed's difference.", "",
         *table([b], present, ref, spec["paper_col"], ref_label)]
    if missing:
        L += [f"Not run in this folder: {'; '.join(missing)}.", ""]
    same = [lab for m, lab, _ in present if m != ref and m in b.get("identical", ())]
    if same:
        L += [f"Identical to {ref_label}: every site model of {'; '.join(same)} gives exactly the same class "
              "probabilities as the full method's on both sets (the ablation changes nothing on this partition).", ""]
    L += [f"#### Every variant vs {ref_label} (1 seed): balanced accuracy and AUC, both sets", ""]
    for m, lab, _ in present:
        if m == ref:
            continue
        cells = [f"{metric.replace('balanced_accuracy', 'bal. acc.').replace('auc', 'AUC')} {evalset} "
                 + _paired_cell(s, m, ref, evalset, metric)
                 for metric in ("balanced_accuracy", "auc") for evalset in ("test", "external")]
        L.append(f"- {lab}: " + "; ".join(cells))
    flagged = [f"{r['method']} seed {r['seed']} {r['site']} ({r['set']}, {r['n']} images)"
               for r in s.get("rows", []) if r["single_class"] and r["method"] in {m for m, _, _ in present}]
    L += ["", "#### Majority-class site models (1 seed)", "",
          ("Site models predicting one class on images of >= 2 classes (the ⚠ rows): "
           + "; ".join(flagged) + ".") if flagged else "No site model predicts a single class on either set.", "",
          "#### What this ablation can and cannot show (1 seed)", "",
          f"- {ABLATION_LIMITS[name]}",
          "- One seed says nothing about another seed's partition and training noise: a difference "
          "here, in either direction, is not evidence that a term helps or is useless.",
          "- The paper's numbers are CIFAR-10 at Dir(0.1) with 20 clients; ours are chest X-ray subtypes (3 classes) "
          "at Dir(0.5) with 6 sites. Neither the paper's ordering nor its gaps are expected to carry over, and none "
          "is claimed.", "",
          "## Caveats shared with the 3-seed tables (they hold here too, with 6 pairs, 1 seed)", "",
          *[f"- {n}" for n in notes], "",
          "## Run record (1 seed)", "",
          f"Compare command: `{b['compare'].get('command', '?')}`. Table: `{command}`. The plain-method runs "
          "(no ':' in the folder name) are the 3-seed grid's seed-0 runs, copied into the folder so that compare "
          f"skipped them (same partition, same code); the {len(new)} variant runs were new: sum of their simulate "
          f"wall times {wall / 60:.0f} min on 2 shared CPU cores"
          + (f"; the compare command took {wall_s / 60:.0f} min wall-clock in all (runs, their evaluation on the "
             "external part, tables)." if wall_s else "."), ""]
    return L


HAND_WRITTEN = "## Outcome ("  # a results file's hand-written analysis starts at a line beginning with this


def kept_outcome(f: Path) -> str:
    """The hand-written part of an existing results file (from its first line starting with ``HAND_WRITTEN`` to the
    end), to be kept below the regenerated tables; empty when there is none."""
    if not f.is_file():
        return ""
    lines = f.read_text().splitlines(keepends=True)
    for i, ln in enumerate(lines):
        if ln.startswith(HAND_WRITTEN):
            return "\n" + "".join(lines[i:])
    return ""


def compare_dir_problem(spec: str) -> str | None:
    """Why ``LABEL=DIR`` cannot be tabulated (None: it can): no ``=``, no folder, or no finished run in it."""
    label, sep, d = spec.partition("=")
    if not sep or not label or not d:
        return "expected LABEL=DIR"
    if not Path(d).is_dir():
        return f"no folder {d}"
    if not any(Path(d).glob("seed*/*/metrics.json")):
        return f"no finished run in {d} (expected seed*/<method>/metrics.json from cxr-hfl compare)"
    return None


def main(argv: list[str] | None = None) -> None:
    import shlex
    import sys

    from studies.prototype_methods.proto_eval import FLOOR, NOTES, collect

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", action="append", default=[], help="LABEL=DIR (repeatable): fedsaf_table3.md and "
                    "fedtopo_table1.md from these folders")
    ap.add_argument("--ablation", metavar="LABEL=DIR", help="fedsaf_table8.md and fedtopo_table2.md (1 seed) from "
                    "this compare folder of the ablation variants (see ABLATIONS)")
    ap.add_argument("--wall-s", type=float, help="the ablation compare command's wall-clock seconds (as measured by "
                    "whoever ran it), written to the run record")
    ap.add_argument("--out", default="studies/prototype_methods")
    a = ap.parse_args(argv)
    if not a.compare and not a.ablation:
        ap.error("give --compare LABEL=DIR and/or --ablation LABEL=DIR")
    specs = [*(("--compare", c) for c in a.compare), *((("--ablation", a.ablation),) if a.ablation else ())]
    for opt, spec in specs:  # every folder is checked before anything is written
        why = compare_dir_problem(spec)
        if why:
            print(f"proto_results.py: {opt} {spec!r}: {why}", file=sys.stderr)
            raise SystemExit(2)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        print(f"proto_results.py: --out {out} is a file, not a folder", file=sys.stderr)
        raise SystemExit(2)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m studies.prototype_methods.proto_results " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    notes = ["## Caveats", "", *[f"- {n}" for n in NOTES], ""]
    blocks = [load(*c.split("=", 1)[:1], Path(c.split("=", 1)[1])) for c in a.compare]
    if blocks:
        head = protocol_head(FLOOR)
        outs = [ln for b in blocks for ln in outcome(b)]
        saf = ["# FedSAF Table III analogue: alignment function (prototype-methods protocol)", "", PAPER["fedsaf"], "", *head,
               *table(blocks, ["fedproto", "fedsaf", "fedsaf:alignment=rcsa", "fedsaf:alignment=cosine", "local"],
                      "fedproto", primary=("fedsaf", "external")), *outs, *notes,
               "Runs at 1 seed are labelled (1 seed); like every row under 5 seeds they show per-seed differences, no "
               "interval and no verdict.",
               ""]
        topo = ["# FedTopo Table I analogue: Local / FedProto / FedSAF / FedTopo (prototype-methods protocol)", "",
                PAPER["fedtopo"], "", *head,
                *table(blocks, ["local", "fedproto", "fedsaf", "fedtopo"], "local", primary=("fedtopo", "external")),
                *outs, *notes, ""]
        for name, lines in (("fedsaf_table3", saf), ("fedtopo_table1", topo)):
            f = out / f"{name}.md"
            text = "\n".join([*lines, f"Table: `{command}`.", ""])
            (out / f"{name}.md").write_text(text + kept_outcome(f))
    if a.ablation:
        label, _, d = a.ablation.partition("=")
        b = load(label, Path(d))
        res = collect(Path(d))
        for name, spec in ABLATIONS.items():
            b["summary"]["paired"] += ablation_pairs(res, spec["ref"], [m for m, _, _ in spec["rows"]])
            b["identical"] = {m for m, _, _ in spec["rows"]
                              if m != spec["ref"] and same_predictions(res, m, spec["ref"])}
            (out / f"{name}.md").write_text("\n".join(ablation_file(b, name, FLOOR, NOTES, command, a.wall_s)))
        blocks.append(b)
    for b in blocks:
        print(b["label"], json.dumps({m: {k: v[k] for k in ("test_bal_acc", "external_bal_acc", "floor_met")}
                                      for m, v in b["summary"]["methods"].items()}))

if __name__ == "__main__":
    main()
