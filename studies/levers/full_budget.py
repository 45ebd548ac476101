"""Full-budget indication of the levers study (studies/levers/RESULTS.md, last section): one arm at the main job's
budget (``compare``'s defaults: 6 sites, ``chest_xray_original``, 30 epochs per site, 300 distillation steps), one
seed, scored on the ``tuning`` part; writes ``studies/levers/full_budget_seed<k>_<arm>.json`` (the same summary as
:func:`studies.levers.run.summarise_arm`).

    python -m studies.levers.full_budget --seed 0 --arm ohfl_stacked_30_0 --out /work/runs/i42c/full_stacked
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from studies.levers.run import HERE, PART, summarise_arm

ARMS = {"fedavg": "fedavg",
        "ohfl_stacked_30_0": "ohfl:distill_teacher=stacked:local_epochs=30:finetune_epochs=0",
        "ohfl_30_0": "ohfl:local_epochs=30:finetune_epochs=0"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arm", choices=sorted(ARMS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default="../shared/data/chest_xray_original")
    a = ap.parse_args(argv)
    import torch

    from nvflare_jobs.compare import compare

    torch.set_num_threads(1)
    out, data = Path(a.out).resolve(), Path(a.data).resolve()
    rc = compare(out, methods=ARMS[a.arm], data=str(data), seeds=[a.seed], external=str(data.parent / "chest_xray_224"),
                 part=PART, no_audit=True, n_boot=200)
    row = summarise_arm(out / f"seed{a.seed}" / ARMS[a.arm])
    row["budget"] = "compare defaults (6 sites, 30 epochs per site, 300 distillation steps)"
    (HERE / f"full_budget_seed{a.seed}_{a.arm}.json").write_text(json.dumps(row, indent=1, default=float))
    print(f"[levers full] seed {a.seed} {a.arm} rc={rc}: deployed AUC {row.get('auc')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
