"""Privacy / utility runs (studies/privacy/RESULTS.md): the main job (OHFL) at epsilon inf / 8 / 1 and FedAvg at
epsilon inf / 8, reduced budget, each seed's arms on one partition, deployed models scored on the ``tuning`` part of
``chest_xray_224``. Built with the library (``nvflare_jobs.compare``'s partition and evaluation helpers,
``nvflare_jobs.profiles.write_profile``, ``nvflare_jobs.spec.resolve(...).simulate``); the site configs of a DP arm
carry ``dp: {epsilon: e}``. Per seed it writes ``studies/privacy/results_seed<k>.json`` (per arm: deployed AUC and
balanced accuracy on the tuning part, per-site dp records).

    python -m studies.privacy.run --seeds 0,1,2,3,4 --out runs/privacy
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
#: arm -> (method, epsilon or None)
ARMS = {"ohfl": ("ohfl", None), "ohfl_eps8": ("ohfl", 8.0), "ohfl_eps1": ("ohfl", 1.0),
        "fedavg": ("fedavg", None), "fedavg_eps8": ("fedavg", 8.0)}
BUDGET = {"sites": 4, "max_images": 400, "input_sizes": [64, 96], "batch_size": 16, "ohfl_local": 6,
          "ohfl_finetune": 3, "distill_steps": 100, "fedavg_rounds": 3, "fedavg_local": 3}
PART = "tuning"


def _options(method: str, data: Path, seed: int, profile: Path, probe: Path | None) -> dict:
    b = BUDGET
    opts = {"data": str(data), "labels": "binary", "seed": seed, "profile": str(profile), "batch_size": b["batch_size"]}
    if method == "ohfl":
        opts.update(local_epochs=b["ohfl_local"], finetune_epochs=b["ohfl_finetune"],
                    distill_steps=b["distill_steps"], probe=str(probe) if probe else "generated")
    else:
        opts.update(rounds=b["fedavg_rounds"], local_epochs=b["fedavg_local"])
    return opts


def _profile(part: Path, run_dir: Path, method: str, seed: int, eps: float | None) -> Path:
    from nvflare_jobs.profiles import write_profile

    b = BUDGET
    local = b["ohfl_local"] if method == "ohfl" else b["fedavg_local"]
    prof = write_profile(part, run_dir / "site_configs", method, "binary", b["input_sizes"],
                         {"batch_size": b["batch_size"], "local_epochs": local, "finetune_epochs": b["ohfl_finetune"],
                          "seed": seed, "threads": 1})
    if eps is not None:
        for f in sorted(prof.glob("*.yaml")):
            cfg = yaml.safe_load(f.read_text())
            cfg["dp"] = {"epsilon": float(eps)}
            f.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return prof


def run_seed(out: Path, data: Path, seed: int) -> None:
    """Every unfinished arm of one seed, then the tuning-part evaluation of each."""
    from nvflare_jobs.compare import evaluate_external, prepare_partition, probe_part_csv
    from nvflare_jobs.spec import resolve

    args = SimpleNamespace(labels="binary", max_images=BUDGET["max_images"], sites=BUDGET["sites"], scheme="width",
                           alpha=0.5, proto_protocol=False)
    seed_dir = out / f"seed{seed}"
    part = prepare_partition(data, seed_dir, args)
    probe = probe_part_csv(data, out)
    for arm, (method, eps) in ARMS.items():
        run_dir = seed_dir / arm
        if (run_dir / "metrics.json").is_file():
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        prof = _profile(part, run_dir, method, seed, eps)
        t0 = time.perf_counter()
        res = resolve(method, _options(method, data, seed, prof, probe)).simulate(
            run_dir, overwrite=True, isolate=True, log=run_dir / "simulate.log", command=f"studies.privacy.run {arm}")
        print(f"[privacy] seed {seed} {arm}: rc={res.rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    evaluate_external(out, data.parent / "chest_xray_224", PART, None, "binary", audit=False)


def summarise_seed(out: Path, seed: int) -> dict:
    """Per arm: deployed AUC / balanced accuracy (mean over sites, tuning part), per-site values, collapse, dp."""
    from nvflare_jobs.evaluation import external_name

    name = external_name(Path("chest_xray_224"), PART)
    rows = {}
    for arm in ARMS:
        run = out / f"seed{seed}" / arm
        summ_f = run / "external" / name / "summary.json"
        if not summ_f.is_file():
            rows[arm] = {"missing": True}
            continue
        summ = json.loads(summ_f.read_text())
        met = json.loads((run / "metrics.json").read_text())
        dep = {k: v for k, v in summ["models"].items() if v.get("kind") == "deployed"}
        dp = {s: b.get("dp") for s, b in met.get("sites", {}).items()}
        rows[arm] = {
            "auc": float(np.mean([v["auc"] for v in dep.values()])),
            "balanced_accuracy": float(np.mean([v["balanced_accuracy"] for v in dep.values()])),
            "per_site_auc": {k: v["auc"] for k, v in dep.items()},
            "collapsed_sites": sorted(k for k, v in dep.items() if abs(float(v["balanced_accuracy"]) - 0.5) < 1e-9),
            "dp": {s: (None if not d or not d.get("dp") else
                       {"epsilon": d["epsilon"], "noise_multiplier": (d["sessions"].get("train") or {}).get("noise_multiplier"),
                        "steps": (d["sessions"].get("train") or {}).get("steps"),
                        "sample_rate": (d["sessions"].get("train") or {}).get("sample_rate")})
                   for s, d in dp.items()}}
    return {"seed": seed, "data": f"chest_xray_224 {PART} part", "budget": BUDGET, "arms": rows}


def audit_seed(out: Path, seed: int) -> dict:
    """Loss-threshold membership inference (``nvflare_jobs.privacy_audit``, no shadows; members = the site's
    training split, non-members = its test split) on each site's upload: OHFL's local model (sent once), FedAvg's
    final global model (the average of the last round's uploads). Per arm: attack AUC and TPR at 1 % FPR, mean
    over sites, and per site with the bootstrap interval of the AUC."""
    from nvflare_jobs.privacy_audit import privacy_audit

    res = {}
    for arm, (method, _eps) in ARMS.items():
        run = out / f"seed{seed}" / arm
        if not (run / "metrics.json").is_file():
            continue
        per = {}
        for cfg in sorted((run / "site_configs").glob("*.yaml")):
            site = cfg.stem
            f = run / "models" / (f"{site}_local.pt" if method == "ohfl" else f"{site}_deployed.pt")
            doc = privacy_audit(cfg, site, [f], run / "privacy_audit" / site, n_boot=200, seed=seed)
            a = next(x for x in doc["models"][0]["attacks"] if x.get("attack", "loss_threshold") == "loss_threshold")
            per[site] = {k: a.get(k) for k in ("auc", "auc_low", "auc_high", "tpr_at_fpr", "n_members",
                                               "n_nonmembers")}
        res[arm] = {"upload": "local model" if method == "ohfl" else "final global model",
                    "auc": float(np.mean([v["auc"] for v in per.values()])),
                    "tpr_at_1pct_fpr": float(np.mean([v["tpr_at_fpr"] for v in per.values()])), "per_site": per}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--out", default="runs/privacy")
    ap.add_argument("--data", default="../shared/data/chest_xray_original")
    ap.add_argument("--audit-only", action="store_true", help="only evaluate finished runs, audit them and write "
                    "the results files (no new runs)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out, data = Path(a.out).resolve(), Path(a.data).resolve()
    for seed in [int(s) for s in a.seeds.split(",")]:
        if a.audit_only:
            from nvflare_jobs.compare import evaluate_external

            evaluate_external(out, data.parent / "chest_xray_224", PART, None, "binary", audit=False)
        else:
            run_seed(out, data, seed)
        res = summarise_seed(out, seed)
        res["attack"] = audit_seed(out, seed)
        (HERE / f"results_seed{seed}.json").write_text(json.dumps(res, indent=1, default=float))
        print(f"[privacy] seed {seed}: " + ", ".join(f"{k} {v.get('auc', math.nan):.3f}" for k, v in res["arms"].items()),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
