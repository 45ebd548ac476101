"""Levers study (studies/levers/RESULTS.md): FedAvg, OHFL's default (average teacher) and OHFL distilling a learned
(stacked) teacher, reduced budget, every arm of a seed on one partition (``nvflare_jobs.compare.compare``), every
model scored on the ``tuning`` part of ``chest_xray_224``. Per seed it writes
``studies/levers/results_seed<k>.json`` (per arm: deployed AUC per site and mean, the global and ensemble AUC,
cost: epochs, wall and server seconds, bytes per site).

    python -m studies.levers.run --seeds 0,1,2 --out /work/runs/i42c/levers
    python -m studies.levers.run --seeds 0 --arms fedavg,ohfl --out /work/runs/i42c/levers   # some arms only
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: arm -> compare method (variant) string; the order is the run order within a seed
ARMS = {"fedavg": "fedavg",
        "ohfl": "ohfl:distill_steps=100",
        "ohfl_stacked": "ohfl:distill_steps=100:distill_teacher=stacked",
        # the amendment (RESULTS.md): the fine-tuning epochs moved before the upload, the same 9 epochs per site
        "ohfl_stacked_9_0": "ohfl:distill_steps=100:distill_teacher=stacked:local_epochs=9:finetune_epochs=0",
        # amendment 2: the same split with the average teacher, to attribute the fourth arm's gain
        "ohfl_9_0": "ohfl:distill_steps=100:local_epochs=9:finetune_epochs=0"}
BUDGET = {"sites": 4, "max_images": 400, "input_sizes": "64,96", "batch_size": 16, "local_epochs": 6,
          "finetune_epochs": 3, "rounds": 3, "distill_steps": 100}
PART = "tuning"


def run_seed(out: Path, data: Path, seed: int, arms: list[str]) -> int:
    """The arms' runs of one seed (finished runs are kept) and the tuning-part evaluation of every saved model."""
    return run_methods(out, data, seed, [ARMS[a] for a in arms])


def run_methods(out: Path, data: Path, seed: int, methods: list[str]) -> int:
    """One ``compare`` call at this study's reduced :data:`BUDGET`: the given method (variant) strings on the seed's
    partition of ``data``, every saved model scored on the ``tuning`` part of the ``chest_xray_224`` beside it
    (no audit). Shared by the studies that reuse this budget (``studies/fens_distilled``). Returns compare's exit
    code."""
    from nvflare_jobs.compare import compare

    b = BUDGET
    return compare(out, methods=",".join(methods), data=str(data), sites=b["sites"],
                   max_images=b["max_images"], input_sizes=b["input_sizes"], batch_size=b["batch_size"],
                   local_epochs=b["local_epochs"], finetune_epochs=b["finetune_epochs"], rounds=b["rounds"],
                   seeds=[seed], external=str(data.parent / "chest_xray_224"), part=PART, no_audit=True, n_boot=200)


def _kind_mean(models: dict, kind: str) -> tuple[float | None, dict]:
    sel = {k: v["auc"] for k, v in models.items() if v.get("kind") == kind and v.get("auc") is not None}
    return (float(np.mean(list(sel.values()))) if sel else None), sel


def summarise_arm(run: Path) -> dict:
    """One arm's tuning-part AUCs and cost from its run folder."""
    from nvflare_jobs.evaluation import external_name

    summ_f = run / "external" / external_name(Path("chest_xray_224"), PART) / "summary.json"
    if not (run / "metrics.json").is_file() or not summ_f.is_file():
        return {"missing": True}
    models = json.loads(summ_f.read_text())["models"]
    met = json.loads((run / "metrics.json").read_text())
    auc, per_site = _kind_mean(models, "deployed")
    row = {"auc": auc, "per_site_auc": per_site}
    for kind in ("global", "ensemble", "fused"):
        m = next((v for v in models.values() if v.get("kind") == kind), None)
        row[f"{kind}_auc"] = None if m is None else m.get("auc")
    row["local_auc"] = _kind_mean(models, "local")[0]
    dist = met.get("distillation") or {}
    row["teacher"] = {g: {k: r.get(k) for k in ("teacher", "stacker") if k in r} for g, r in dist.items()}
    row["gate"] = met.get("gate")
    timing = met.get("timing") or {}
    n_sites = max(1, len(met.get("sites") or {}))
    row["cost"] = {"epochs_per_site": BUDGET["local_epochs"] + BUDGET["finetune_epochs"],
                   "wall_seconds": met.get("wall_time_s"), "server_seconds": met.get("server_seconds"),
                   "site_compute_seconds_per_site": (None if timing.get("site_compute_total_s") is None
                                                     else float(timing["site_compute_total_s"]) / n_sites),
                   "timing": timing, "bytes_per_site": met.get("bytes_per_site")}
    return row


def _run_dir(outs: list[Path], seed: int, method: str) -> Path:
    """The arm's run folder in the first comparison folder that holds it finished (arms may run in parallel
    comparisons on the same partitions: ``compare`` draws a seed's partition from the data and the seed alone)."""
    runs = [o / f"seed{seed}" / method for o in outs]
    return next((r for r in runs if (r / "metrics.json").is_file()), runs[0])


def summarise_seed(outs: list[Path], seed: int) -> dict:
    rows = {arm: summarise_arm(_run_dir(outs, seed, method)) for arm, method in ARMS.items()}
    base = rows.get("fedavg") or {}
    for arm, r in rows.items():
        if arm != "fedavg" and r.get("auc") is not None and base.get("auc") is not None:
            r["minus_fedavg"] = r["auc"] - base["auc"]
    return {"seed": seed, "data": f"sites from chest_xray_original; scored on chest_xray_224 {PART} part",
            "budget": BUDGET, "arms_methods": ARMS, "arms": rows}


def seed_list(text: str) -> list[int]:
    """``--seeds``' comma-separated integers (e.g. ``0,1,2``). Raises argparse.ArgumentTypeError naming the text."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    return seeds


def record_seed(path: Path, res: dict, name: str, rc: int, t0: float, note: str = "") -> None:
    """Write one seed's summary ``res`` (``{"seed", "arms": {arm: {"auc", ...}}}``) to ``path`` as JSON and print
    its progress line (``[name] seed k rc=.. in .. s<note>: arm auc, ...``; ``t0`` from ``time.perf_counter``)."""
    path.write_text(json.dumps(res, indent=1, default=float))
    print(f"[{name}] seed {res['seed']} rc={rc} in {time.perf_counter() - t0:.0f} s{note}: " + ", ".join(
        f"{k} {v.get('auc') if v.get('auc') is not None else math.nan:.3f}" for k, v in res["arms"].items()),
        flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seed_list, default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/levers")
    ap.add_argument("--data", default="../shared/data/chest_xray_original")
    ap.add_argument("--also", default="", help="further comparison folders (comma-separated) holding arms of the "
                    "same seeds, read by the summary")
    ap.add_argument("--summarise-only", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out, data = Path(a.out).resolve(), Path(a.data).resolve()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    for seed in a.seeds:
        t0 = time.perf_counter()
        rc = 0 if a.summarise_only else run_seed(out, data, seed, arms)
        res = summarise_seed([out] + [Path(x).resolve() for x in a.also.split(",") if x], seed)
        record_seed(HERE / f"results_seed{seed}.json", res, "levers", rc, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
