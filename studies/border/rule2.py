"""The border study's second rule (``studies/border_frame/RESULTS.md``): its table, its staged decision and the
supplementary wide-band probe of the masked arm.

The arms' per-seed summaries are ``measure.py``'s (``studies/border/results2/seed<k>/summary.csv``); criterion (b)
compares with ``default``'s row of the first rule (``studies/border/results/seed<k>/summary.csv``).

``python -m studies.border.rule2 --table --seeds 0`` prints the per-seed table with criteria (a)-(c) and the operating-point
endpoints; ``--decide`` the rule's decision as JSON; ``--wide RUN_FOLDER --arm ARM --seeds K`` probes every deployed
model of a run with bands of ``--fraction`` (default 0.12) of each side and writes
``results2/seed<k>/<arm>/wide_<fraction>.json``.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

ARMS = ["mask_crop", "dense_crop", "maskscale_crop"]  # ties: the arm without the mask, then this order
HERE = Path(__file__).parent


def _rows(folder: Path, k: int) -> dict:
    f = folder / f"seed{k}" / "summary.csv"
    return {r["arm"]: r for r in csv.DictReader(f.open(newline=""))} if f.is_file() else {}


def criteria(results: Path, first: Path, seeds=(0, 1, 2)) -> dict:
    """Per arm and seed: (a) all within, (b) mean tuning AUC >= default's - 0.01 (None without default's row),
    (c) margin >= 0.12, and the pooled own-test AUC; None where the arm has no row at that seed."""
    out: dict = {}
    for k in seeds:
        rows, base = _rows(results, k), _rows(first, k).get("default")
        for arm in ARMS:
            r = rows.get(arm)
            out.setdefault(arm, {})[k] = None if r is None else {
                "a": r["all_within"] == "True",
                "b": None if base is None else float(r["mean_tuning_auc"]) >= float(base["mean_tuning_auc"]) - 0.01,
                "c": float(r["margin"]) >= 0.12, "own_test_auc": float(r["own_test_auc"])}
    return out


def decide(results: Path, first: Path, seeds=(0, 1, 2)) -> dict:
    """The staged rule: an arm stops at its first seed failing a criterion; eligible = (a)(b)(c) at every seed;
    among the eligible the highest mean pooled own-test AUC, within 0.005 the arm without the mask."""
    crit = criteria(results, first, seeds)
    status, eligible = {}, []
    for arm, per in crit.items():
        failed = [k for k, v in per.items() if v is not None and not (v["a"] and v["b"] and v["c"])]
        if failed:
            status[arm] = f"stopped: fails at seed {failed[0]}"
        elif all(v is not None for v in per.values()):
            status[arm] = "eligible"
            eligible.append(arm)
        else:
            status[arm] = "open: seeds " + ",".join(str(k) for k, v in per.items() if v is None) + " not run"
    score = {a: float(np.mean([v["own_test_auc"] for v in crit[a].values()])) for a in eligible}
    chosen = None
    if eligible:
        best = max(score.values())
        tied = [a for a in eligible if score[a] >= best - 0.005]
        chosen = next((a for a in tied if "mask" not in a), tied[0])
    return {"criteria": crit, "status": status, "eligible": eligible, "own_test_auc_mean": score, "chosen": chosen}


def endpoints_line(results: Path, arm: str, k: int) -> str | None:
    """One markdown cell group of a run's operating-point endpoints (tuning_endpoints' JSON), or None."""
    f = results / f"endpoints_{arm}" / f"tuning_seed{k}.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def table(results: Path, first: Path, seeds=(0, 1, 2)) -> str:
    """Markdown: per seed and arm, the border, AUC and margin columns with criteria (a)-(c)."""
    crit = criteria(results, first, seeds)
    out = ["| seed | arm | models within +-0.05 | worst change | mean tuning AUC (default's) | margin | pooled own-test "
           "AUC / bal. acc. (n) | (a) (b) (c) |", "|---|---|---|---|---|---|---|---|"]
    for k in seeds:
        rows, base = _rows(results, k), _rows(first, k).get("default")
        for arm in ARMS:
            r, c = rows.get(arm), crit[arm][k]
            if r is None:
                continue
            abc = " ".join("-" if c[x] is None else ("yes" if c[x] else "no") for x in "abc")
            d = "-" if base is None else f"{float(base['mean_tuning_auc']):.3f}"
            out.append(f"| {k} | {arm} | {r['n_within']} / {r['n_models']} | {float(r['worst_change']):+.3f} | "
                       f"{float(r['mean_tuning_auc']):.3f} ({d}) | {float(r['margin']):+.3f} | "
                       f"{float(r['own_test_auc']):.3f} / {float(r['own_test_bal_acc']):.3f} ({r['own_test_n']}) | "
                       f"{abc} |")
    return "\n".join(out)


def model_table(results: Path, seeds=(0, 1, 2)) -> str:
    """Markdown: per model the black / grey / white changes (tuning / own test), tuning AUC, and its operating
    point on the tuning part (sensitivity, specificity, efficiency, acceptance) from the endpoints JSON."""
    out = ["| seed | arm | site | black | grey | white | tuning AUC | within | sens / spec at its op. point | "
           "efficiency | acceptance |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in seeds:
        for arm in ARMS:
            ep = endpoints_line(results, arm, k) or {}
            for f in sorted((results / f"seed{k}" / arm).glob("site-*.json")):
                m = json.loads(f.read_text())
                cells = []
                for c in ("black", "grey", "white"):
                    cells.append(f"{m['tuning']['border'][c]['mean']:+.3f} / {m['own_test']['border'][c]['mean']:+.3f}")
                e = (ep.get("models") or {}).get(m["site"]) or {}
                sens = (e.get("sensitivity") or {}).get("value")
                spec = (e.get("specificity") or {}).get("value")
                op = "-" if sens is None else f"{sens:.3f} / {spec:.3f}"
                eff = e.get("efficiency")
                out.append(f"| {k} | {arm} | {m['site']} | {' | '.join(cells)} | {m['tuning']['auc']:.3f} | "
                           f"{'yes' if m['within'] else 'no'} | {op} | {'-' if eff is None else f'{eff:.3f}'} | "
                           f"{e.get('acceptance') or '-'} |")
    return "\n".join(out)


def wide_probe(run: Path, arm: str, seed: int, fraction: float, data_root: Path, out: Path) -> dict:
    """Supplementary: every deployed model's mean p(PNEUMONIA) change on the tuning part for black / grey / white
    bands of ``fraction`` of each side (wider than the mask), with :func:`measure.p_positive`."""
    from hfl_components.audit.intervals import mean_ci
    from nvflare_jobs.evaluation import load_model_file, model_aspect, site_rows
    from studies.border.measure import COLOURS, p_positive, tuning_rows

    tuning, res = tuning_rows(data_root), {}
    for site in sorted(site_rows(run)):
        f = run / "models" / f"{site}_deployed.pt"
        if not f.is_file():
            continue
        model, blob = load_model_file(f)
        size, aspect = int(blob["input_size"]), model_aspect(blob, run)
        p0 = p_positive(model, tuning, size, aspect)
        res[site] = {c: mean_ci(p_positive(model, tuning, size, aspect, band=v, fraction=fraction) - p0,
                                n_boot=1000, seed=0) for c, v in COLOURS.items()}
        print(f"[wide] {arm} seed {seed} {site}: " + " ".join(f"{c} {res[site][c]['mean']:+.3f}" for c in COLOURS),
              flush=True)
    d = out / f"seed{seed}" / arm
    d.mkdir(parents=True, exist_ok=True)
    (d / f"wide_{fraction:g}.json").write_text(json.dumps({"arm": arm, "seed": seed, "fraction": fraction,
                                                            "tuning": res}, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(HERE / "results2"))
    ap.add_argument("--first", default=str(HERE / "results"))
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--decide", action="store_true")
    ap.add_argument("--wide", help="a comparison folder of one arm: probe with wider bands")
    ap.add_argument("--arm")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the tables / the wide probe")
    ap.add_argument("--fraction", type=float, default=0.12)
    ap.add_argument("--data-root", default="../shared/data")
    a = ap.parse_args(argv)
    res, first = Path(a.results), Path(a.first)
    seeds = tuple(int(k) for k in a.seeds.split(","))
    if a.table:
        print(table(res, first, seeds) + "\n\n" + model_table(res, seeds))
    if a.decide:
        print(json.dumps(decide(res, first), indent=1))
    if a.wide:
        import torch

        torch.set_num_threads(1)
        for k in seeds:
            wide_probe(Path(a.wide) / f"seed{k}" / "ohfl", a.arm, k, a.fraction, Path(a.data_root), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
