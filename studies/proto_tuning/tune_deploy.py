"""Choose the prototype methods' deploy rule and split policy on *validation* images only.

One in-process federation (:func:`studies.proto_tuning.tune_fedproto.run`: the method's real controller and site
handlers) on
``chest_xray_224``'s tuning + probe parts, Dirichlet alpha 0.5, 6 sites, the prototype defaults. After every
round each site's model is scored on its own validation split (what ``deploy: best_val`` ranks rounds by) and on
the validation images of the *other five* sites restricted to the classes it holds ("others' val": images the
selection never saw, the validation analogue of the external evaluation part). Printed per rule: ``last`` = the
last round's model, ``best_val`` = the round chosen as the site runtime chooses it (best own-val balanced
accuracy, ties -> later, a one-class val split -> last). Test splits and the evaluation part are never read.

    python -m studies.proto_tuning.tune_deploy --method local --seed 0 --min-eval-per-class 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch



def select_round(val_scores: list[float | None], n_val_classes: int) -> int:
    """The round ``deploy: best_val`` deploys: argmax of the own-val balanced accuracies (None -> -1), ties -> the
    later round; the last round when the validation split holds fewer than two classes."""
    if n_val_classes < 2:
        return len(val_scores) - 1
    s = [-1.0 if v is None else float(v) for v in val_scores]
    return max(range(len(s)), key=lambda i: (s[i], i))


def select_round_window(val_scores: list[float | None], n_val_classes: int, w: int) -> int:
    """:func:`select_round` on the validation curve smoothed over rounds ``r-w..r+w`` (clipped at the ends; ``w = 0``
    is :func:`select_round`); ties -> the later round, a one-class validation split -> the last round."""
    if n_val_classes < 2:
        return len(val_scores) - 1
    s = [-1.0 if v is None else float(v) for v in val_scores]
    # rounded so that equal windows tie exactly (float sums of the same values in another order can differ in the
    # last bit, which would break the tie towards the earlier round)
    sm = [round(float(np.mean(s[max(0, i - w):i + w + 1])), 12) for i in range(len(s))]
    return max(range(len(sm)), key=lambda i: (sm[i], i))


def _record_problem(line: str) -> str | None:
    """Why one line of a ``--json`` file cannot be re-ranked (None: it can)."""
    try:
        r = json.loads(line)
    except ValueError:
        return "not JSON"
    if not isinstance(r, dict) or not isinstance(r.get("method"), str) or type(r.get("seed")) is not int:
        return "no method (text) / seed (integer)"
    per = r.get("per_round")
    if not isinstance(per, dict) or not per:
        return "no per-round records"
    for site, recs in per.items():
        if not isinstance(recs, list) or not recs:
            return f"site {site} has no rounds"
        for i, x in enumerate(recs):
            ok = (isinstance(x, dict) and (x.get("val_bal") is None or _score(x.get("val_bal")))
                  and _score(x.get("others_bal")) and type(x.get("val_classes")) is int
                  and type(x.get("others_single")) is bool)
            if not ok:
                return (f"site {site} round {i} lacks a val_bal (a score in [0, 1] or null), an others_bal score in "
                        "[0, 1], an integer val_classes or a boolean others_single")
    return None


def _score(v) -> bool:
    """A finite balanced accuracy in [0, 1] (not a bool; JSON's NaN / Infinity are refused)."""
    return type(v) in (int, float) and bool(np.isfinite(v)) and 0.0 <= v <= 1.0


def rerank(json_path: str, windows: tuple[int, ...] = (0, 1, 2, 3),
           min_rounds: tuple[int, ...] = (5, 10, 15)) -> list[str]:
    """Re-rank the per-round records of earlier ``--json`` runs (no training) under ``last``, ``best_val`` restricted
    to rounds >= k (seventh pass) and the smoothed ``best_val`` (eighth pass; window 0 = ``best_val`` itself). A
    markdown table: per rule, the mean others'-validation balanced accuracy of each (method, seed) run, their mean,
    and the count of site models predicting one class on the others' validation images.

    Raises:
        SystemExit (one line naming the file and line): a missing, unreadable or malformed records file, or two
            records of the same (method, seed)."""
    path = Path(json_path)
    if not str(json_path).strip():
        raise SystemExit("tune_deploy: --rerank needs a records file")
    if path.is_dir():
        raise SystemExit(f"tune_deploy: {path} is a folder, not a --json records file")
    if not path.is_file():
        raise SystemExit(f"tune_deploy: no records file {path} (write one with --json)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise SystemExit(f"tune_deploy: {path} is not a text (UTF-8) records file")
    runs = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            why = _record_problem(line)
            if why:
                raise SystemExit(f"tune_deploy: {path} line {n} is not a --json record: {why}")
            runs.append(json.loads(line))
    if not runs:
        raise SystemExit(f"tune_deploy: {path} holds no records")
    seen: dict[tuple, int] = {}
    for n, r in enumerate(runs, 1):
        if (r["method"], r["seed"]) in seen:
            raise SystemExit(f"tune_deploy: {path}: two records of {r['method']} seed {r['seed']} (records "
                             f"{seen[(r['method'], r['seed'])]} and {n}); keep one")
        seen[(r["method"], r["seed"])] = n

    def pick(recs: list[dict], rule: str) -> int:
        if rule == "last":
            return len(recs) - 1
        if rule.startswith("best_val, r >= "):
            k = int(rule.rsplit(" ", 1)[1])
            return k + select_round([x["val_bal"] for x in recs[k:]], recs[-1]["val_classes"]) if k < len(recs) \
                else len(recs) - 1
        return select_round_window([x["val_bal"] for x in recs], recs[-1]["val_classes"], int(rule.split()[1]))

    rules = ["last", *[f"window {w}" + (" (= best_val)" if w == 0 else "") for w in windows],
             *[f"best_val, r >= {k}" for k in min_rounds]]
    rows = ["| rule | " + " | ".join(f"{r['method']} seed {r['seed']}" for r in runs)
            + " | mean | single-class on others' val |", "|---" * (len(runs) + 3) + "|"]
    for rule in rules:
        vals, single = [], 0
        for r in runs:
            picks = [recs[pick(recs, rule)] for recs in r["per_round"].values()]
            vals.append(float(np.mean([p["others_bal"] for p in picks])))
            single += sum(bool(p["others_single"]) for p in picks)
        rows.append(f"| {rule} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {np.mean(vals):.4f} | {single} |")
    return rows


def main() -> None:
    from studies.proto_tuning.tune_fedproto import parse_opts, run
    from studies.proto_tuning.tune_proto import build_sites, pooled_val_loader
    from hfl_components.training import compute_metrics, predict_proba
    from nvflare_jobs.profiles import PROTO_TRAINING

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/chest_xray_224"))
    ap.add_argument("--method", default="local")
    ap.add_argument("--opts", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--min-eval-per-class", type=int, default=0)
    ap.add_argument("--json", help="append the summary as one JSON line to this file")
    ap.add_argument("--rerank", metavar="JSONL", help="no training: re-rank the per-round records of earlier --json "
                    "runs under last and smoothed best_val rules (window 0 = the current rule) and print the table")
    a = ap.parse_args()
    if a.rerank is not None:
        try:
            print("\n".join(rerank(a.rerank)))
        except SystemExit as e:  # bad input: one line, exit 2 like the other benchmarks
            print(e, file=sys.stderr)
            raise SystemExit(2)
        return
    torch.set_num_threads(1)
    opts = parse_opts(a.method, a.opts, {"rounds": a.rounds, "local_epochs": 1, "seed": a.seed})
    t0 = time.perf_counter()
    per: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        profile = build_sites(a.seed, work, 0.5, "dirichlet", 64, Path(a.data),
                              min_eval_per_class=a.min_eval_per_class)
        for cfg in profile.values():
            cfg.update({k: v for k, v in PROTO_TRAINING.items() if k != "input_size"})
        loaders = {}

        def on_result(site, rt, rnd, metrics):
            if site not in loaders:
                loaders[site] = pooled_val_loader(profile, rt, exclude_own=True)
            pp, py = predict_proba(rt.model, loaders[site])
            pm = compute_metrics(py, pp, rt.num_classes)
            v = metrics.get("val") or {}
            per.setdefault(site, []).append({"round": rnd, "val_bal": v.get("balanced_accuracy"),
                                             "val_classes": int(sum(1 for c in v.get("class_counts", []) if c)),
                                             "val_pred_classes": int(sum(1 for c in np.sum(
                                                 v.get("confusion_matrix", [[0]]), axis=0) if c)),
                                             "others_bal": pm["balanced_accuracy"],
                                             "others_single": bool(len(np.unique(pp.argmax(1))) == 1)})

        run(a.method, profile, opts, work / "ws", on_result=on_result)
    out = {"method": a.method, "opts": a.opts, "seed": a.seed, "rounds": a.rounds,
           "min_eval_per_class": a.min_eval_per_class}
    for rule in ("last", "best_val"):
        picks = {}
        for site, recs in per.items():
            i = len(recs) - 1 if rule == "last" else select_round([r["val_bal"] for r in recs], recs[-1]["val_classes"])
            picks[site] = recs[i]
        out[rule] = {"own_val_bal": float(np.mean([p["val_bal"] for p in picks.values()])),
                     "others_val_bal": float(np.mean([p["others_bal"] for p in picks.values()])),
                     "own_val_single": int(sum(p["val_classes"] >= 2 and p["val_pred_classes"] == 1
                                               for p in picks.values())),
                     "others_single": int(sum(p["others_single"] for p in picks.values())),
                     "rounds": {s: p["round"] for s, p in picks.items()}}
    out["wall_s"] = round(time.perf_counter() - t0)
    print("SUMMARY", json.dumps(out), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({**out, "per_round": per}) + "\n")


if __name__ == "__main__":
    main()
