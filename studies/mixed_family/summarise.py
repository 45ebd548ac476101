"""Per-seed summary of the mixed-family main job from one compare folder scored with --external.

OHFL with several architecture families, FENS and local+ft at equal budgets:

    python -m studies.mixed_family.summarise --cmp runs/mixed3 --name chest_xray_224-tuning \\
        --out studies/mixed_family/results.json

For every seed: the site ensemble's AUC (averaged probabilities of OHFL's six uploads), each family's global model
(fused within the family where it can be, then distilled) scored at its sites' input sizes and its AUC gap to the
ensemble (target <= 0.02), the fused-only gap beside it, each family's deployed models against the same sites'
local+ft models (AUC and balanced accuracy, mean over the family's sites), and the FENS aggregator beside them.
Seeds are the unit of training randomness; with fewer than 5 seeds the values are per seed, with no interval and no
verdict. A missing run or evaluation is refused with one line naming it (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

METHODS = ("ohfl", "local", "fens")


class Missing(Exception):
    pass


def _read(p: Path) -> dict:
    """The JSON object in ``p`` (the runs' own reader); :class:`Missing` naming ``p`` when absent or unreadable."""
    from nvflare_jobs.evaluation.run_folder import run_metrics

    if not p.is_file():
        raise Missing(f"no {p}")
    try:
        return run_metrics(p.parent, p.name)
    except ValueError as e:
        raise Missing(str(e)) from None


def _summary(cmp: Path, seed: int, method: str, name: str) -> dict:
    p = cmp / f"seed{seed}" / method / "external" / name / "summary.json"
    if not p.is_file():
        raise Missing(f"no evaluation {p} (run compare with --external to the end)")
    models = _read(p).get("models")
    if not isinstance(models, dict):
        raise Missing(f"{p}: no 'models' (not an evaluation summary)")
    return models


def _groups(cmp: Path, seed: int, ohfl: str = "ohfl") -> dict[str, list[str]]:
    p = cmp / f"seed{seed}" / ohfl / "global_models" / "groups.json"
    if not p.is_file():
        raise Missing(f"no {p}: not a mixed-family OHFL run")
    return {g: list(v.get("sites", [])) for g, v in _read(p).items()}


def _mean(vals) -> float | None:
    v = [x for x in vals if x is not None]
    return float(np.mean(v)) if v else None


def seed_summary(cmp: Path, seed: int, name: str, ohfl: str = "ohfl") -> dict:
    """One seed's numbers (see the module docstring); ``ohfl``: the OHFL run folder of each seed (a compare variant
    such as ``ohfl:distill_steps=300``). Raises :class:`Missing` naming what is absent."""
    oh, lo, fe = (_summary(cmp, seed, ohfl if m == "ohfl" else m, name) for m in METHODS)
    groups = _groups(cmp, seed, ohfl)
    ens = oh["ensemble"]["auc"]
    met = _read(cmp / f"seed{seed}" / ohfl / "metrics.json")
    out = {"seed": seed, "ohfl_run": ohfl, "ensemble_auc": ens, "global_auc": oh["global"]["auc"],
           "global_gap": oh["global"].get("gap_to_ensemble_auc"), "fused_gap": (oh.get("fused") or {}).get(
               "gap_to_ensemble_auc"), "fens_auc": fe["global"]["auc"],
           "fens_ensemble_auc": (fe.get("ensemble") or {}).get("auc"),
           "ohfl_deployed_auc": _mean(v["auc"] for v in oh.values() if v["kind"] == "deployed"),
           "local_ft_auc": _mean(v["auc"] for v in lo.values() if v["kind"] == "deployed"),
           "server_seconds": met.get("server_seconds"), "references": met.get("references"),
           "bytes_downloaded_per_site": (met["bytes_downloaded"] / len(met.get("sites") or [1])
                                         if met.get("bytes_downloaded") else None),
           "distillation": {g: {k: v.get(k) for k in ("best_step", "steps_run", "stopped", "seconds")}
                            for g, v in (met.get("distillation") or {}).items() if isinstance(v, dict)},
           "families": {}}
    for g, sites in sorted(groups.items()):
        gl = [v["auc"] for k, v in oh.items() if v["kind"] == "global" and k.startswith(f"global-{g}_")]
        fu = [v["auc"] for k, v in oh.items() if v["kind"] == "fused" and k.startswith(f"fused-{g}_")]
        dep = {s: oh[f"{s}_deployed"] for s in sites}
        loc = {s: lo[f"{s}_deployed"] for s in sites}
        fam = {"sites": sites, "global_auc": _mean(gl), "fused_auc": _mean(fu),
               "global_gap": None if not gl else ens - _mean(gl), "fused_gap": None if not fu else ens - _mean(fu),
               "adopted": [((met.get("sites") or {}).get(s, {}).get("gate") or {}).get("adopted") for s in sites]}
        for metric in ("auc", "balanced_accuracy"):
            d, lc = _mean(v[metric] for v in dep.values()), _mean(v[metric] for v in loc.values())
            fam[f"deployed_{metric}"], fam[f"local_ft_{metric}"] = d, lc
            fam[f"deployed_minus_local_ft_{metric}"] = None if d is None or lc is None else d - lc
            fam[f"fens_minus_local_ft_{metric}"] = None if lc is None else fe["global"][metric] - lc
        out["families"][g] = fam
    return out


def markdown(rows: list[dict]) -> str:
    """Per-seed tables (seed order) of :func:`seed_summary`'s rows, as markdown."""
    def cell(vals, nd=3, sign=False):
        return " / ".join("–" if v is None else (f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}") for v in vals)

    fams = sorted({g for r in rows for g in r["families"]})
    L = [f"Seeds {', '.join(str(r['seed']) for r in rows)} (values per seed).", "",
         "| quantity | value per seed |", "|---|---|",
         f"| site ensemble AUC (OHFL's six uploads, averaged) | {cell(r['ensemble_auc'] for r in rows)} |",
         f"| global models, AUC at each site's size, site mean | {cell(r['global_auc'] for r in rows)} |",
         f"| gap ensemble - global (target <= 0.02) | {cell(r['global_gap'] for r in rows)} |",
         f"| gap ensemble - fused (before distillation) | {cell(r['fused_gap'] for r in rows)} |"]
    for g in fams:
        f = [r["families"].get(g, {}) for r in rows]
        L += [f"| {g}: global model AUC | {cell(x.get('global_auc') for x in f)} |",
              f"| {g}: gap ensemble - global (target <= 0.02) | {cell(x.get('global_gap') for x in f)} |",
              f"| {g}: gap ensemble - fused | {cell(x.get('fused_gap') for x in f)} |",
              f"| {g}: deployed AUC (mean of its sites) | {cell(x.get('deployed_auc') for x in f)} |",
              f"| {g}: local+ft AUC (same sites) | {cell(x.get('local_ft_auc') for x in f)} |",
              f"| {g}: deployed - local+ft, AUC | {cell((x.get('deployed_minus_local_ft_auc') for x in f), sign=True)} |",
              f"| {g}: deployed - local+ft, balanced accuracy | "
              f"{cell((x.get('deployed_minus_local_ft_balanced_accuracy') for x in f), sign=True)} |",
              f"| {g}: gate adopted the federated model (sites) | "
              f"{' / '.join(str(sum(bool(a) for a in x.get('adopted', []))) + ' of ' + str(len(x.get('adopted', []))) for x in f)} |"]
    L += [f"| OHFL deployed AUC, mean of six | {cell(r['ohfl_deployed_auc'] for r in rows)} |",
          f"| local+ft AUC, mean of six | {cell(r['local_ft_auc'] for r in rows)} |",
          f"| FENS deployed AUC (one model at every site) | {cell(r['fens_auc'] for r in rows)} |",
          f"| FENS - OHFL deployed (mean), AUC | {cell((r['fens_auc'] - r['ohfl_deployed_auc'] for r in rows), sign=True)} |"]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cmp", required=True, help="the compare folder")
    ap.add_argument("--name", default="chest_xray_224-tuning", help="the external evaluation's folder name")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="studies/mixed_family/results.json")
    ap.add_argument("--ohfl", default="ohfl", help="the OHFL run folder in each seed (a compare variant such as "
                    "'ohfl:distill_steps=300'; default: ohfl)")
    a = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        print(f"summarise: --seeds {a.seeds!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    rows = []
    for s in seeds:
        try:
            rows.append(seed_summary(Path(a.cmp), s, a.name, a.ohfl))
        except Missing as e:
            print(f"summarise: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError) as e:  # an evaluation without an entry the summary reads (ensemble, global, ...)
            where = Path(a.cmp) / f"seed{s}"
            print(f"summarise: {where}: the runs' evaluations under external/{a.name} lack {e} (an entry or an AUC "
                  "this summary reads); re-run evaluate on them", file=sys.stderr)
            return 2
    Path(a.out).write_text(json.dumps({"cmp": Path(a.cmp).name, "name": a.name, "ohfl_run": a.ohfl, "seeds": rows},
                                      indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
