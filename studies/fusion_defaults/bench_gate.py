"""Deployment-gate criteria of OHFL, checked offline on the committed ``tuning`` part (not a test).

For each site of finished OHFL runs: the two candidates the gate chose between -- the site's pre-fusion local model
(``models/<site>_local.pt``) and the fine-tuned federated model (``models/<site>_federated.pt``, kept since issue
11) -- and their validation metrics as the site measured them (``metrics.json`` -> ``sites.<site>.gate``). Each
criterion picks one candidate per site from the *validation* metrics only; the picked models are then scored on
the ``tuning`` part of ``chest_xray_224`` (735 images, at the site's input size, argmax rule; never the
``evaluation`` part), next to the local+ft control when its run is given.

    python -m studies.fusion_defaults.bench_gate RUN_DIR [RUN_DIR ...] [--control LOCAL_RUN_DIR ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

from studies.fusion_defaults import bench_fusion_ladder as L  # noqa: E402


def _key(m, keys):
    def v(k):
        x = m.get(k)
        if x is None:
            return -1e9
        return -float(x) if k == "log_loss" else float(x)
    return tuple(v(k) for k in keys)


CRITERIA = {
    "auc>bacc>logloss (gate today)": lambda f, l: _key(f, ("auc", "balanced_accuracy", "log_loss"))
    > _key(l, ("auc", "balanced_accuracy", "log_loss")),
    "auc>logloss": lambda f, l: _key(f, ("auc", "log_loss")) > _key(l, ("auc", "log_loss")),
    "logloss": lambda f, l: _key(f, ("log_loss",)) > _key(l, ("log_loss",)),
    "bacc>auc>logloss": lambda f, l: _key(f, ("balanced_accuracy", "auc", "log_loss"))
    > _key(l, ("balanced_accuracy", "auc", "log_loss")),
    "always federated (no gate)": lambda f, l: True,
    "always local": lambda f, l: False,
}


@torch.no_grad()
def score(path: Path) -> dict:
    """``{"auc", "bacc"}`` of a model file on the ``tuning`` part at its own input size (argmax rule)."""
    from hfl_components.models.files import load_model_file

    model, head = load_model_file(path)
    d = L.data("tuning", int(head["input_size"]))
    p = torch.cat([torch.softmax(model(d["x"][i:i + 256]), 1)[:, 1] for i in range(0, len(d["x"]), 256)]).numpy()
    y = d["y"].numpy()
    return {"auc": L.auc(y, p), "bacc": L.bacc(y, p)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--control", nargs="*", default=[], help="local+ft runs (same seeds, same order)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.control and len(a.control) != len(a.runs):
        print(f"bench_gate: {len(a.runs)} run(s) but {len(a.control)} --control run(s); give one per run, same order",
              file=sys.stderr)
        return 2
    for run in map(Path, [*a.runs, *a.control]):
        if not (run / "metrics.json").is_file():
            print(f"bench_gate: {run}: no metrics.json (not a finished run folder)", file=sys.stderr)
            return 2
    from studies.fusion_defaults.bench_fusion_runs import ensure_tuning_cache

    ensure_tuning_cache()
    torch.set_num_threads(1)
    sites = []
    for k, run in enumerate(map(Path, a.runs)):
        met = json.loads((run / "metrics.json").read_text())
        for site, v in sorted(met["sites"].items()):
            g = v.get("gate") or {}
            fed_f = run / "models" / f"{site}_federated.pt"
            if not g or not fed_f.is_file():
                continue
            row = {"run": str(run), "site": site, "fed_val": g["federated_val"], "local_val": g["local_val"],
                   "fed": score(fed_f), "local": score(run / "models" / f"{site}_local.pt")}
            if a.control:
                row["control"] = score(Path(a.control[k]) / "models" / f"{site}_deployed.pt")
            sites.append(row)
            print(f"{run.parent.name} {site}: local {row['local']['auc']:.3f}/{row['local']['bacc']:.3f}  federated "
                  f"{row['fed']['auc']:.3f}/{row['fed']['bacc']:.3f}" + (f"  local+ft {row['control']['auc']:.3f}/"
                  f"{row['control']['bacc']:.3f}" if a.control else "") + "  (tuning AUC/bal.acc)", flush=True)
    if not sites:
        print("bench_gate: no site with a gate record and models/<site>_federated.pt in "
              + ", ".join(a.runs) + " (OHFL runs with the gate on)", file=sys.stderr)
        return 2
    print(f"\n{len(sites)} sites; mean tuning AUC / balanced accuracy of the deployed models per criterion")
    out = {}
    for name, crit in CRITERIA.items():
        pick = [r["fed"] if crit(r["fed_val"], r["local_val"]) else r["local"] for r in sites]
        n_fed = sum(crit(r["fed_val"], r["local_val"]) for r in sites)
        out[name] = {"auc": float(np.mean([p["auc"] for p in pick])), "bacc": float(np.mean([p["bacc"] for p in pick])),
                     "adopted": n_fed}
        line = f"  {name:<30} AUC {out[name]['auc']:.3f}  bal.acc {out[name]['bacc']:.3f}  adopted {n_fed}"
        if a.control:
            d_auc = np.mean([p["auc"] - r["control"]["auc"] for p, r in zip(pick, sites)])
            d_bacc = np.mean([p["bacc"] - r["control"]["bacc"] for p, r in zip(pick, sites)])
            line += f"  (vs local+ft: ΔAUC {d_auc:+.3f}, Δbal.acc {d_bacc:+.3f})"
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"sites": sites, "criteria": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
