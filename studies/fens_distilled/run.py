"""FENS distilled at the site (studies/fens_distilled/RESULTS.md): FedAvg, FENS and FENS with each site distilling
the ensemble into its own model (``fens_distill_epochs``), reduced budget, every arm of a seed in one ``compare`` call
(one partition), every model scored on the ``tuning`` part of ``chest_xray_224``. Per seed it writes
``studies/fens_distilled/results_seed<k>.json``.

    python -m studies.fens_distilled.run --seeds 0,1,2 --out /work/runs/fensd/cmp
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from studies.levers.run import BUDGET as LEVERS_BUDGET
from studies.levers.run import PART, record_seed, seed_list, run_methods

HERE = Path(__file__).resolve().parent
DISTILL_EPOCHS = 3
#: arm -> compare method (variant) string
ARMS = {"fedavg": "fedavg", "fens": "fens", "fens_distilled": f"fens:fens_distill_epochs={DISTILL_EPOCHS}"}
#: the levers study's reduced budget (its distillation steps are OHFL's only)
BUDGET = {k: v for k, v in LEVERS_BUDGET.items() if k != "distill_steps"}


def run_seed(out: Path, data: Path, seed: int, arms: list[str]) -> int:
    """The arms' runs of one seed (one ``compare`` call, so every arm shares the seed's partition)."""
    return run_methods(out, data, seed, [ARMS[a] for a in arms])


def summarise_arm(run: Path, arm: str) -> dict:
    from nvflare_jobs.evaluation import external_name

    summ_f = run / "external" / external_name(Path("chest_xray_224"), PART) / "summary.json"
    if not (run / "metrics.json").is_file() or not summ_f.is_file():
        return {"missing": True}
    models = json.loads(summ_f.read_text())["models"]
    met = json.loads((run / "metrics.json").read_text())
    dep = {k: v["auc"] for k, v in models.items() if v.get("kind") == "deployed" and v.get("auc") is not None}
    loc = [v["auc"] for v in models.values() if v.get("kind") == "local" and v.get("auc") is not None]
    timing = met.get("timing") or {}
    n_sites = max(1, len(met.get("sites") or {}))
    epochs = BUDGET["local_epochs"] + BUDGET["finetune_epochs"]
    return {"auc": float(np.mean(list(dep.values()))) if dep else None, "per_site_auc": dep,
            "local_auc": float(np.mean(loc)) if loc else None,
            "deployed_families": sorted({str(v.get("family") or v.get("spec", {}).get("family")) for k, v in
                                         models.items() if v.get("kind") == "deployed"}),
            "cost": {"epochs_per_site": epochs, "extra_distill_epochs_per_site":
                     DISTILL_EPOCHS if arm == "fens_distilled" else 0,
                     "wall_seconds": met.get("wall_time_s"), "server_seconds": met.get("server_seconds"),
                     "site_compute_seconds_per_site": (None if timing.get("site_compute_total_s") is None
                                                       else float(timing["site_compute_total_s"]) / n_sites),
                     "bytes_per_site": met.get("bytes_per_site")}}


def summarise_seed(out: Path, seed: int) -> dict:
    rows = {arm: summarise_arm(out / f"seed{seed}" / method, arm) for arm, method in ARMS.items()}
    base = rows["fedavg"].get("auc")
    for arm, r in rows.items():
        if arm != "fedavg" and r.get("auc") is not None and base is not None:
            r["minus_fedavg"] = r["auc"] - base
    if rows["fens_distilled"].get("auc") is not None and rows["fens"].get("auc") is not None:
        rows["fens_distilled"]["minus_fens"] = rows["fens_distilled"]["auc"] - rows["fens"]["auc"]
    return {"seed": seed, "data": f"sites from chest_xray_original; scored on chest_xray_224 {PART} part",
            "budget": BUDGET, "arms_methods": ARMS, "arms": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seed_list, default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/fens_distilled")
    ap.add_argument("--data", default="../shared/data/chest_xray_original")
    ap.add_argument("--summarise-only", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out, data = Path(a.out).resolve(), Path(a.data).resolve()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    for seed in a.seeds:
        t0 = time.perf_counter()
        rc = 0 if a.summarise_only else run_seed(out, data, seed, arms)
        res = summarise_seed(out, seed)
        record_seed(HERE / f"results_seed{seed}.json", res, "fensd", rc, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
