"""Per-seed summary and the committed rule of the epoch-split study (``studies/epoch_split/RESULTS.md``).

    python -m studies.epoch_split.summarise --cmp runs/def_stretch --seeds 0,1,2 \\
        --out studies/epoch_split/results.json

For every arm (an OHFL run folder of each seed: the default and the candidate splits of the 30-epoch budget) and
seed: the deployed models' AUC (mean of the sites), the site ensemble's AUC, the distilled global model's zero-shot
AUC and its gap to that ensemble, the uploads' mean AUC, and the deployed models minus equal-epoch FedAvg and minus
local+ft (the same ``fedavg`` and ``local`` runs for every arm), all on one ``evaluate`` part. Then the rule: a
candidate replaces the default only if its deployed AUC is higher at 2 or more seeds and in the mean over seeds, and
its gap to its own ensemble is at most 0.02 AUC at every seed; of two that qualify, the higher mean wins. Seeds are
the unit of training randomness; with 3 seeds the values are per seed, with no interval and no verdict. A missing
run or evaluation is refused with one line naming it (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from studies.mixed_family.summarise import Missing, _mean, _read, _summary

DEFAULT = "ohfl:distill_steps=300"
CANDIDATES = ("ohfl:local_epochs=25:finetune_epochs=5", "ohfl:local_epochs=30:finetune_epochs=0")
GAP_TARGET = 0.02


def _is_auc(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _deployed(models: dict, kind: str = "deployed", where: Path | None = None) -> float | None:
    """Mean AUC of the ``kind`` models; with ``where`` (the summary file), :class:`Missing` naming it when there is
    no such model or one has no finite AUC (a mean over the other sites would hide it)."""
    ms = {k: v for k, v in models.items() if isinstance(v, dict) and v.get("kind") == kind}
    if where is not None:
        if not ms:
            raise Missing(f"{where}: no {kind} model (not an evaluation of this run's deployed models)")
        bad = sorted(k for k, v in ms.items() if not _is_auc(v.get("auc")))
        if bad:
            raise Missing(f"{where}: {', '.join(bad)} without an AUC")
    return _mean(v.get("auc") for v in ms.values())


def _auc(models: dict, key: str, where: Path) -> float:
    """The AUC of the ``key`` model (``ensemble``, ``global``); :class:`Missing` naming ``where`` when absent."""
    v = models.get(key)
    if not isinstance(v, dict) or not _is_auc(v.get("auc")):
        raise Missing(f"{where}: no '{key}' model with an AUC (not an OHFL run's evaluation?)")
    return float(v["auc"])


def _where(cmp: Path, seed: int, run: str, name: str) -> Path:
    return cmp / f"seed{seed}" / run / "external" / name / "summary.json"


def baselines(cmp: Path, seed: int, name: str) -> tuple[float, float]:
    """(FedAvg, local+ft) deployed mean AUC at one seed, the same for every arm; :class:`Missing` naming the file."""
    return tuple(_deployed(_summary(cmp, seed, m, name), where=_where(cmp, seed, m, name)) for m in ("fedavg", "local"))


def seed_summary(cmp: Path, seed: int, arm: str, name: str, base: tuple[float, float] | None = None) -> dict:
    """One arm's numbers at one seed (module docstring); ``base``: :func:`baselines` of that seed when already read.
    Raises :class:`Missing` naming what is absent (a run's evaluation, its deployed models, or the arm's
    ``ensemble`` / ``global`` model)."""
    def where(m: str) -> Path:
        return _where(cmp, seed, m, name)

    oh = _summary(cmp, seed, arm, name)
    fedavg, local = base or baselines(cmp, seed, name)
    dep = _deployed(oh, where=where(arm))
    ens, glob = _auc(oh, "ensemble", where(arm)), _auc(oh, "global", where(arm))
    met = _read(cmp / f"seed{seed}" / arm / "metrics.json")
    return {"seed": seed, "arm": arm, "deployed_auc": dep, "ensemble_auc": ens,
            "global_auc": glob, "global_gap": ens - glob,
            "uploads_auc": _deployed(oh, "local"), "fedavg_auc": fedavg, "local_ft_auc": local,
            "deployed_minus_fedavg": dep - fedavg, "deployed_minus_local_ft": dep - local,
            "ensemble_minus_fedavg": ens - fedavg,
            "gate_adopted": (met.get("gate") or {}).get("adopted"),
            "task_config": met.get("task_config")}


def apply_rule(rows: dict[str, list[dict]], default: str = DEFAULT, candidates=CANDIDATES,
               gap_target: float = GAP_TARGET) -> dict:
    """The committed rule on per-seed rows (``{arm: [seed_summary, ...]}``, the same seeds in the same order).

    Returns ``{"chosen": arm, "candidates": {arm: {"higher_at": int, "mean_diff": float, "gap_ok": bool,
    "qualifies": bool}}}``; ``chosen`` is ``default`` when no candidate qualifies. Raises ValueError when an arm's
    seeds differ from the default's.
    """
    base = rows[default]
    seeds = [r["seed"] for r in base]
    out = {}
    for c in candidates:
        if [r["seed"] for r in rows[c]] != seeds:
            raise ValueError(f"{c}: seeds {[r['seed'] for r in rows[c]]} differ from {default}'s {seeds}")
        diffs = [r["deployed_auc"] - b["deployed_auc"] for r, b in zip(rows[c], base)]
        higher = sum(d > 0 for d in diffs)
        gap_ok = all(r["global_gap"] <= gap_target + 1e-9 for r in rows[c])  # 1e-9: float rounding
        out[c] = {"higher_at": higher, "mean_diff": float(np.mean(diffs)), "per_seed_diff": diffs, "gap_ok": gap_ok,
                  "qualifies": bool(higher * 2 > len(diffs) and np.mean(diffs) > 0 and gap_ok),
                  "mean_deployed_auc": float(np.mean([r["deployed_auc"] for r in rows[c]]))}
    ok = [c for c in candidates if out[c]["qualifies"]]
    chosen = max(ok, key=lambda c: out[c]["mean_deployed_auc"]) if ok else default
    return {"chosen": chosen, "default": default, "candidates": out}


def _num(v) -> str:
    return "–" if v is None else f"{v:.4f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--cmp", type=Path, required=True, help="the compare folder (seed<k>/<arm>/external/<name>)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--name", default="chest_xray_224-tuning", help="the evaluation's name under external/")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and the rule's outcome here (JSON)")
    a = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:  # a seed twice would count twice in the rule
        ap.exit(2, f"summarise: --seeds {a.seeds!r}: give distinct non-negative integers separated by commas\n")
    if not a.cmp.is_dir():
        ap.exit(2, f"summarise: --cmp {a.cmp}: {'not a folder' if a.cmp.exists() else 'no such folder'} (give the "
                   "compare folder, with seed<k>/<arm>/external/<name>)\n")
    if a.out and (a.out.is_dir() or not a.out.parent.is_dir()):
        ap.exit(2, f"summarise: --out {a.out}: " + ("is a folder; give a file name\n" if a.out.is_dir() else
                                                     f"no folder {a.out.parent}\n"))
    try:
        base = {s: baselines(a.cmp, s, a.name) for s in seeds}  # FedAvg and local+ft, read once per seed
        rows = {arm: [seed_summary(a.cmp, s, arm, a.name, base[s]) for s in seeds] for arm in (DEFAULT, *CANDIDATES)}
    except Missing as e:
        ap.exit(2, f"summarise: {e}\n")
    rule = apply_rule(rows)
    for arm, rs in rows.items():
        print(arm)
        for r in rs:
            print(f"  seed {r['seed']}: deployed {r['deployed_auc']:.4f}  ensemble {r['ensemble_auc']:.4f}  "
                  f"global {r['global_auc']:.4f} (gap {r['global_gap']:.4f})  uploads {_num(r['uploads_auc'])}  "
                  f"-FedAvg {r['deployed_minus_fedavg']:+.4f}  -local+ft {r['deployed_minus_local_ft']:+.4f}  "
                  f"ensemble-FedAvg {r['ensemble_minus_fedavg']:+.4f}  adopted {r['gate_adopted']}")
    print(json.dumps(rule, indent=1))
    if a.out:
        tmp = a.out.with_name(a.out.name + ".tmp")  # never a half-written results file
        tmp.write_text(json.dumps({"data": a.name, "seeds": seeds, "rows": rows, "rule": rule}, indent=1) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
