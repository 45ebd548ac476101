"""Calibrated attack and one-run audit for one setting and seed (studies/privacy/RESULTS.md, "LiRA and the one-run
canary audit"): for each arm in ``ARMS_ATTACKED`` at seed ``SEED``, every site's upload (OHFL's local model) is
attacked with the loss threshold and offline LiRA (shadows trained on the public ``probe`` part of
``chest_xray_224``), and one canary audit run per site (Steinke, Nasr & Jagielski 2023) gives an empirical epsilon
lower bound beside the accountant's epsilon. Built on ``nvflare_jobs.privacy_audit.privacy_audit``; writes
``studies/privacy/lira_seed<k>.json``.

    python -m studies.privacy.lira --runs runs/privacy --out runs/privacy_lira
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from studies.privacy.run import HERE

SEED = 0
ARMS_ATTACKED = ("ohfl", "ohfl_eps8")
#: shadow models per attacked model, their epochs (OHFL's local epochs), canary-run epochs, bootstrap replicates
PLAN = {"shadows": 8, "shadow_epochs": 6, "canary_epochs": 6, "n_boot": 1000, "fpr": 0.01}

_KEEP = ("auc", "auc_low", "auc_high", "tpr_at_fpr", "tpr_low", "tpr_high", "n_members", "n_nonmembers")


def audit_arm(runs: Path, out: Path, arm: str, pool: Path) -> dict:
    """Per site: loss-threshold and LiRA metrics on the site's local model, and the canary audit."""
    from nvflare_jobs.privacy_audit import privacy_audit

    run = runs / f"seed{SEED}" / arm
    per = {}
    for cfg in sorted((run / "site_configs").glob("*.yaml")):
        site = cfg.stem
        t0 = time.perf_counter()
        doc = privacy_audit(cfg, site, [run / "models" / f"{site}_local.pt"], out / arm / site, probe=pool,
                            shadows=PLAN["shadows"], shadow_epochs=PLAN["shadow_epochs"],
                            canary_epochs=PLAN["canary_epochs"], fpr=PLAN["fpr"], n_boot=PLAN["n_boot"], seed=SEED)
        m = doc["models"][0]
        attacks = {a["attack"]: {k: a.get(k) for k in _KEEP} for a in m["attacks"]}
        c = doc["canary"] or {}
        per[site] = {"dp_epsilon": m.get("dp_epsilon"), "attacks": attacks,
                     "canary": {k: c.get(k) for k in ("epsilon_lower_bound", "correct", "guesses", "canaries",
                                                      "delta", "accountant_epsilon", "trained_on", "epochs")}}
        print(f"[lira] {arm} {site}: " + ", ".join(f"{k} AUC {v['auc']:.3f}" for k, v in attacks.items())
              + f", canary eps >= {c.get('epsilon_lower_bound', float('nan')):.2f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/privacy", help="the privacy study's run folder (holds seed<k>/<arm>)")
    ap.add_argument("--out", default="runs/privacy_lira")
    ap.add_argument("--pool", default="../shared/data/chest_xray_224", help="chest_xray_224 root (its probe part)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    runs, out = Path(a.runs).resolve(), Path(a.out).resolve()
    res = {"seed": SEED, "plan": PLAN, "members": "site train split", "nonmembers": "site test split",
           "shadow_pool": "probe part of chest_xray_224", "upload": "OHFL local model",
           "arms": {arm: audit_arm(runs, out, arm, Path(a.pool).resolve()) for arm in ARMS_ATTACKED}}
    (HERE / f"lira_seed{SEED}.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
