"""Controlled prototype-method comparisons under the pre-registered protocol
``studies/confirmatory/protocols/proto_controlled/PROTOCOL.md``: FedSAF (GCSA) against the same FedSAF job with MSE
alignment (identical weights lambda = gamma = 1, the FedSAF paper's Table III question) and FedTopo against Local (the FedTopo
paper's Table I question), at 5 seeds, with seeds as clusters (``hfl_components.stats``).

    cxr-hfl compare --methods local,fedsaf,fedsaf:alignment=mse,fedtopo --labels subtype --scheme dirichlet \\
        --alpha 0.5 --seeds 20,21,22,23,24 --out runs/proto_ctrl
    python -m studies.confirmatory.proto_controlled --compare runs/proto_ctrl \\
        --out studies/confirmatory/protocols/proto_controlled

Writes ``RESULT.md`` and ``result.json`` into ``--out``. Each question has one primary endpoint (Δ site balanced
accuracy on the external ``evaluation`` part, restricted to each site's classes; cluster bootstrap-t, one shared
image draw per replicate); AUC and the sites' own test splits are secondary (exploratory). A folder missing a method
at a protocol seed, a run whose ``metrics.json`` is unreadable or records another method or seed than its folder, and
a question without a (seed, site) pair at every seed on the external part are refused (exit 2, one line) before
anything is written: the protocol's seeds are run in full or re-run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: (method A, method B, question) of the protocol, in its order
QUESTIONS = (
    ("fedsaf", "fedsaf:alignment=mse",
     "Q1: does FedSAF's GCSA alignment beat MSE alignment in the same FedSAF job (lambda = gamma = 1)?"),
    ("fedtopo", "local", "Q2: does FedTopo beat Local training at the same local epochs?"),
)
SEEDS = (20, 21, 22, 23, 24)
PRIMARY = ("external", "balanced_accuracy")
N_BOOT = 1000
LABELS = {"local": "Local", "fedsaf": "FedSAF (GCSA)", "fedsaf:alignment=mse": "FedSAF (MSE alignment)",
          "fedtopo": "FedTopo"}
#: the committed results folder beside PROTOCOL.md, resolved from this file (the same from any working folder)
RESULTS = Path(__file__).resolve().parent / "protocols" / "proto_controlled"
SET_TEXT = {"external": "evaluation part (restricted to the site's classes)", "test": "the sites' own test splits"}


def missing_runs(d: Path, seeds=SEEDS) -> list[str]:
    """``seed<k>/<method>`` folders of the protocol that hold no finished run (``metrics.json``) under ``d``."""
    methods = dict.fromkeys(m for q in QUESTIONS for m in q[:2])
    return [f"seed{s}/{m}" for s in seeds for m in methods if not (d / f"seed{s}" / m / "metrics.json").is_file()]


def bad_run(d: Path, seeds=SEEDS) -> str | None:
    """One line naming the first protocol run under ``d`` whose ``seed<k>/<method>/metrics.json`` is unreadable or
    not a JSON object, or records another ``method`` or ``seed`` than its folder (compare records a variant's full
    name, ``fedsaf:alignment=mse``, as the run's ``method``); None when every run is its folder's."""
    from nvflare_jobs.evaluation import run_metrics

    methods = dict.fromkeys(m for q in QUESTIONS for m in q[:2])
    for s in seeds:
        for m in methods:
            f = d / f"seed{s}" / m / "metrics.json"
            try:
                met = run_metrics(f.parent)
            except ValueError as e:
                return str(e)
            if met.get("method") != m or met.get("seed") != s:
                return (f"{f}: records method {met.get('method')!r}, seed {met.get('seed')!r}, not its folder's "
                        f"{m!r}, seed {s} (a run copied from another method or seed?)")
    return None


def unanswered(entries: list[dict], seeds=SEEDS) -> str | None:
    """Why :func:`analyse`'s ``entries`` cannot be written as the protocol's result, naming the question: a question
    without its primary entry (no (seed, site) pair with both methods' predictions on the external part) or whose
    primary entry lacks a protocol seed; None when every question has its primary entry at every seed."""
    for a, b, q in QUESTIONS:
        prim = next((e for e in entries if (e["method_a"], e["method_b"], e["endpoint"]) == (a, b, "primary")), None)
        if prim is None:
            return (f"{q.split(':')[0]} ({a} vs {b}): no (seed, site) pair with both methods' predictions on the "
                    f"{PRIMARY[0]} set (are their evaluations missing?)")
        miss = [s for s in seeds if str(s) not in {str(k) for k in prim.get("per_seed") or {}}]
        if miss:
            return (f"{q.split(':')[0]} ({a} vs {b}): no (seed, site) pair at seed(s) {','.join(map(str, miss))} on "
                    f"the {PRIMARY[0]} set")
    return None


def analyse(res: dict, n_boot: int = N_BOOT) -> list[dict]:
    """Every paired entry of the protocol: for each question, metric and evaluation set, a
    :func:`studies.prototype_methods.proto_eval.paired` result with ``question``, ``method_a``, ``method_b``, ``set`` and
    ``endpoint`` (``primary`` for :data:`PRIMARY`, else ``exploratory``). ``res``:
    :func:`studies.prototype_methods.proto_eval.collect`'s per-(seed, site) predictions."""
    from studies.prototype_methods.proto_eval import paired

    out = []
    for a, b, q in QUESTIONS:
        for evalset in ("external", "test"):
            for metric in ("balanced_accuracy", "auc"):
                d = paired(res, a, b, evalset, metric, n_boot)
                if d is not None:
                    out.append({**d, "question": q, "method_a": a, "method_b": b, "set": evalset,
                                "endpoint": "primary" if (evalset, metric) == PRIMARY else "exploratory"})
    return out


def result_lines(entries: list[dict], command: str, compare_cmd: str) -> list[str]:
    """The markdown lines of ``RESULT.md`` from :func:`analyse`'s entries."""
    from hfl_components.stats import paired_cell, per_seed_text, verdict_cell

    L = ["# Controlled prototype-method comparisons: result", "",
         "Protocol: [PROTOCOL.md](PROTOCOL.md) (committed before the runs). Compare command: "
         f"`{compare_cmd}`. Analysis: `{command}`.", "",
         "Δ = A - B, the mean over seeds of each seed's mean over its sites, in percentage points. External part: "
         "cluster bootstrap-t 95% interval (seeds resampled as clusters, one image draw per replicate shared by "
         f"every seed and site, {N_BOOT} replicates) with the seed-level t-interval beside it; test splits: the "
         "seed-level t-interval (df = seeds - 1). Verdicts: better when the lower bound is above 0; not worse when "
         "it is above -δ (δ 3 pp balanced accuracy, 2 pp AUC); worse when the upper bound is below 0; else "
         "inconclusive. Each question has one primary endpoint; the other rows are exploratory (no multiplicity "
         "correction).", ""]
    for a, b, q in QUESTIONS:
        L += [f"## {q}", "", f"A = {LABELS[a]}, B = {LABELS[b]}.", "",
              "| endpoint | set | metric | A % | B % | Δ A - B | verdict | per-seed Δ (pp) |",
              "|---|---|---|---|---|---|---|---|"]
        rows = [e for e in entries if e["method_a"] == a and e["method_b"] == b]
        rows.sort(key=lambda e: (e["endpoint"] != "primary", e["set"] != "external", e["metric"]))
        for e in rows:
            metric = "balanced accuracy" if e["metric"] == "balanced_accuracy" else "AUC"
            L.append(f"| {'**primary**' if e['endpoint'] == 'primary' else 'exploratory'} | {SET_TEXT[e['set']]} | "
                     f"{metric} | {100 * e['a']:.1f} | {100 * e['b']:.1f} | {paired_cell(e, 100, 1, ' pp')} | "
                     f"**{verdict_cell(e)}** | {per_seed_text(e, 100, 1)} |")
        if not rows:
            L.append("| – | – | – | – | – | – | no (seed, site) pair with both methods | – |")
        L.append("")
    return L


def main(argv: list[str] | None = None) -> int:
    import shlex

    from studies.prototype_methods.proto_eval import collect

    ap = argparse.ArgumentParser(prog="python -m studies.confirmatory.proto_controlled",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, metavar="DIR",
                    help="the compare folder the protocol's compare command wrote (seed<k>/<method>/ run folders; "
                         "required, no default)")
    ap.add_argument("--out", default=str(RESULTS), metavar="DIR",
                    help="where RESULT.md and result.json are written (default: "
                         "studies/confirmatory/protocols/proto_controlled of this repository, the committed results "
                         "folder beside PROTOCOL.md, whatever the working folder; give a scratch folder for a trial)")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                    help="comma-separated seeds (default: the protocol's; other seeds are for testing the script)")
    a = ap.parse_args(argv)
    d, out = Path(a.compare), Path(a.out)
    try:
        seeds = tuple(int(s) for s in a.seeds.split(","))
    except ValueError:
        print(f"proto_controlled.py: --seeds {a.seeds!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    if not d.is_dir():
        print(f"proto_controlled.py: --compare {d}: no such folder", file=sys.stderr)
        return 2
    miss = missing_runs(d, seeds)
    if miss:
        print(f"proto_controlled.py: --compare {d}: no finished run in {', '.join(miss)} (the protocol's seeds are "
              "run in full; rerun the same compare command to finish them)", file=sys.stderr)
        return 2
    why = bad_run(d, seeds)
    if why:
        print(f"proto_controlled.py: {why}; nothing was written", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"proto_controlled.py: --out {out} is a file, not a folder", file=sys.stderr)
        return 2
    res = collect(d)
    res = {m: {s: {k: v for k, v in per.items() if k[0] in seeds} for s, per in r.items()} for m, r in res.items()}
    entries = analyse(res, N_BOOT)
    why = unanswered(entries, seeds)
    if why:
        print(f"proto_controlled.py: --compare {d}: {why}; nothing was written", file=sys.stderr)
        return 2
    cj = json.loads((d / "compare.json").read_text()) if (d / "compare.json").is_file() else {}
    command = "python -m studies.confirmatory.proto_controlled " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv))
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULT.md").write_text("\n".join(result_lines(entries, command, cj.get("command", "?"))))
    (out / "result.json").write_text(json.dumps({"seeds": list(seeds), "n_boot": N_BOOT, "entries": entries},
                                                  indent=1, default=str))
    for e in entries:
        if e["endpoint"] == "primary":
            print(f"{e['method_a']} vs {e['method_b']}: {100 * e['diff']:+.1f} pp, {e['verdict']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
