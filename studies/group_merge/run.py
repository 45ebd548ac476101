"""Group merge study (studies/group_merge/RESULTS.md): FedAvg, OHFL's default (pairwise fusion) and OHFL with each
architecture's models merged at once (``fusion_order=group``) on 9 sites (three per architecture), the levers study's
reduced epoch budget, every arm of a seed in one ``compare`` call (one partition), every model scored on the
``tuning`` part of ``chest_xray_224``. Per seed it writes ``studies/group_merge/results_seed<k>.json`` (per arm:
deployed AUC per site and mean, the fused / global / ensemble AUC, cost: epochs, wall and server fusion seconds,
bytes per site; for the group arm the group merges' members, sweeps and convergence).

    python -m studies.group_merge.run --seeds 0 --out runs/group_merge/cmp
    python -m studies.group_merge.run --seeds 1,2 --out runs/group_merge/cmp     # after seed 0's futility check
    python -m studies.group_merge.run --full --seeds 0,1,2 --out runs/group_merge/full   # the confirmation
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from studies.levers.run import BUDGET as LEVERS_BUDGET
from studies.levers.run import PART, record_seed, seed_list, summarise_arm

HERE = Path(__file__).resolve().parent
#: arm -> compare method (variant) string; the order is the run order within a seed
ARMS = {"fedavg": "fedavg", "ohfl": "ohfl:distill_steps=100", "ohfl_group": "ohfl:distill_steps=100:fusion_order=group"}
#: the levers study's reduced budget on 9 sites (all 850 images, about 94 per site as the levers' 100)
BUDGET = {**LEVERS_BUDGET, "sites": 9, "max_images": 850}
#: the confirmation: the main job's budget (30 epochs per site, 300 distillation steps, 64 / 96 / 128 px) on 9 sites
FULL_ARMS = {"fedavg": "fedavg", "ohfl": "ohfl", "ohfl_group": "ohfl:fusion_order=group"}
FULL = {"sites": 9, "max_images": 850}
FUTILITY = 0.02  # seed 0: the group arm stops when its deployed AUC is more than this below the pairwise arm's


def run_seed(out: Path, data: Path, seed: int, arms: list[str], full: bool) -> int:
    """The arms' runs of one seed in one ``compare`` call (finished runs are kept); returns compare's exit code."""
    from nvflare_jobs.compare import compare

    table = FULL_ARMS if full else ARMS
    common = dict(methods=",".join(table[a] for a in arms), data=str(data), seeds=[seed],
                  external=str(data.parent / "chest_xray_224"), part=PART, no_audit=True, n_boot=200)
    if full:
        return compare(out, sites=FULL["sites"], max_images=FULL["max_images"], **common)
    b = BUDGET
    return compare(out, sites=b["sites"], max_images=b["max_images"], input_sizes=b["input_sizes"],
                   batch_size=b["batch_size"], local_epochs=b["local_epochs"], finetune_epochs=b["finetune_epochs"],
                   rounds=b["rounds"], **common)


def fusion_summary(run: Path) -> dict:
    """Server fusion seconds (``metrics.json``) and, from ``alignment_record.json``, the pairwise steps and the
    group merges (members, sweeps, converged) of every fusable family."""
    met = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else {}
    out = {"fusion_total_s": (met.get("server_seconds") or {}).get("fusion_total"),
           "phase_seconds": met.get("server_fusion_s")}
    rec_f = run / "alignment_record.json"
    if rec_f.is_file():
        rec = json.loads(rec_f.read_text())
        recs = [rec] if "pairs" in rec else list(rec.values())
        out["pairwise_steps"] = sum(len(r.get("pairs", [])) for r in recs)
        out["group_merges"] = [{k: m.get(k) for k in ("members", "sweeps", "converged", "changes")}
                               for r in recs for m in r.get("group_merges", [])]
    return out


def summarise_seed(out: Path, seed: int, full: bool) -> dict:
    table = FULL_ARMS if full else ARMS
    rows = {}
    for arm, method in table.items():
        run = out / f"seed{seed}" / method
        rows[arm] = summarise_arm(run)
        if full and "cost" in rows[arm]:
            rows[arm]["cost"]["epochs_per_site"] = 30  # compare's equal budget at its defaults
        if arm != "fedavg" and not rows[arm].get("missing"):
            rows[arm]["fusion"] = fusion_summary(run)
    base = rows["fedavg"].get("auc")
    for arm, r in rows.items():
        if arm != "fedavg" and r.get("auc") is not None and base is not None:
            r["minus_fedavg"] = r["auc"] - base
    g, p = rows["ohfl_group"], rows["ohfl"]
    if g.get("auc") is not None and p.get("auc") is not None:
        g["minus_pairwise"] = g["auc"] - p["auc"]
    return {"seed": seed, "data": f"sites from chest_xray_original; scored on chest_xray_224 {PART} part",
            "budget": "compare defaults on 9 sites" if full else BUDGET, "arms_methods": table, "arms": rows}


def futile(seed0: dict) -> bool:
    """The futility rule at seed 0: the group arm's deployed AUC more than :data:`FUTILITY` below the pairwise arm's."""
    g, p = seed0["arms"]["ohfl_group"].get("auc"), seed0["arms"]["ohfl"].get("auc")
    return g is not None and p is not None and g < p - FUTILITY


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seed_list, default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/group_merge/cmp")
    ap.add_argument("--data", default="../shared/data/chest_xray_original")
    ap.add_argument("--full", action="store_true", help="the main job's budget on 9 sites (the confirmation)")
    ap.add_argument("--summarise-only", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out, data = Path(a.out).resolve(), Path(a.data).resolve()
    tag = "full_" if a.full else ""
    for seed in a.seeds:
        arms = [x.strip() for x in a.arms.split(",") if x.strip()]
        seed0 = HERE / f"{tag}results_seed0.json"
        if seed > 0 and "ohfl_group" in arms and seed0.is_file() and futile(json.loads(seed0.read_text())):
            arms.remove("ohfl_group")
            print(f"[group_merge] seed {seed}: the group arm stopped by the futility rule at seed 0", flush=True)
        t0 = time.perf_counter()
        rc = 0 if a.summarise_only else run_seed(out, data, seed, arms, a.full)
        res = summarise_seed(out, seed, a.full)
        record_seed(HERE / f"{tag}results_seed{seed}.json", res, "group_merge", rc, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
