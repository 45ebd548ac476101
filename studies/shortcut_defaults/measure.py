"""Measure the main job's shortcut-relevant defaults on finished comparison folders (tuning part only).

For every OHFL run of every arm (``ARM=COMPARE_FOLDER``; each folder evaluated by ``cxr-hfl compare --external
../shared/data/chest_xray_224 --part tuning``), per seed:

* the deployed models' mean AUC, balanced accuracy and sensitivity (argmax rule) on the tuning part, and the global
  model's AUC (``external/<name>/summary.json``);
* the audit's border (6 % shift) probe as the mean change of p(NORMAL) of the deployed models, and their mean AUC
  margin over the metadata baseline (``audit.json``);
* the aspect probe on the sites' own test splits (``chest_xray_original``, not square, never used to choose
  anything else): the mean change of p(PNEUMONIA) when a deployed model sees the centred square crop of each of its
  own site's test images instead of its own squaring (a ``crop`` model: the stretched image instead);
* the pooled accuracy and sensitivity on the sites' own test splits (``metrics.json``).

Seeds are the unit: values are averaged over the six sites of a seed and shown per seed (3 seeds: no interval, no
verdict; ``hfl_components.stats.MIN_SEEDS``).

``python -m studies.shortcut_defaults.measure stretch=runs/def_stretch crop=runs/def_crop --json OUT.json``
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

NAME = "chest_xray_224-tuning"


def _aspect_probe(run: Path) -> dict[str, float]:
    """Per deployed model: mean change of p(PNEUMONIA) on its own site's test split, other squaring minus own."""
    import torch

    from hfl_components.audit.probes import p_pneumonia
    from nvflare_jobs.audit import _Images
    from nvflare_jobs.evaluation import load_model_file, model_aspect, site_rows

    torch.set_num_threads(1)
    out = {}
    for site, rows in site_rows(run).items():
        f = run / "models" / f"{site}_deployed.pt"
        test = [r for r in rows if r["split"] == "test"]
        if not f.is_file() or not test:
            continue
        model, blob = load_model_file(f)
        size = int(blob.get("input_size"))
        aspect = model_aspect(blob, run)
        imgs = _Images(test)
        alt = "crop" if aspect != "crop" else "stretch"
        out[site] = float(np.mean(p_pneumonia(model, imgs.get(size, alt)) - p_pneumonia(model, imgs.get(size, aspect))))
    return out


def _value(v):
    """A pooled metric of ``metrics.json``: a plain number or ``{"value", "ci_low", "ci_high"}``."""
    return v.get("value") if isinstance(v, dict) else v


def measure_run(run: Path) -> dict:
    summ = json.loads((run / "external" / NAME / "summary.json").read_text())
    audit_f = run / "external" / NAME / "audit.json"
    audit = json.loads(audit_f.read_text()) if audit_f.is_file() else {}
    met = json.loads((run / "metrics.json").read_text())
    dep = {k: v for k, v in summ["models"].items() if v.get("kind") == "deployed"}
    probes = (audit.get("probes") or {}).get("models") or {}
    margins = (audit.get("metadata") or {}).get("margins") or {}
    pooled = met.get("pooled") or {}
    asp = _aspect_probe(run)
    return {
        "tuning_auc": float(np.mean([v["auc"] for v in dep.values()])),
        "tuning_bal_acc": float(np.mean([v["balanced_accuracy"] for v in dep.values()])),
        "tuning_sensitivity": float(np.mean([v.get("sensitivity") for v in dep.values()
                                              if v.get("sensitivity") is not None] or [np.nan])),
        "global_auc": (summ["models"].get("global") or {}).get("auc"),
        "gap_global": (summ["models"].get("global") or {}).get("gap_to_ensemble_auc"),
        "border_dp_normal": float(np.mean([-probes[k]["shift"]["mean_change"] for k in dep if k in probes])),
        "metadata_margin": float(np.mean([margins[k]["margin"] for k in dep if k in margins])),
        "aspect_dp_pneumonia_own_test": float(np.mean(list(asp.values()))) if asp else None,
        "aspect_abs_dp_own_test": float(np.mean(np.abs(list(asp.values())))) if asp else None,
        "own_test_accuracy": _value(pooled.get("accuracy")), "own_test_sensitivity": _value(pooled.get("sensitivity")),
        "adopted": float(np.mean([bool((v.get("gate") or {}).get("adopted")) for v in met["sites"].values()])),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arms", nargs="+", help="ARM=COMPARE_FOLDER")
    ap.add_argument("--method", default="ohfl")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    res: dict = {}
    for arm in args.arms:
        label, folder = arm.split("=", 1)
        res[label] = {}
        for run in sorted(Path(folder).glob(f"seed*/{args.method}")):
            if (run / "external" / NAME / "summary.json").is_file():
                res[label][run.parent.name] = measure_run(run)
                print(label, run.parent.name, json.dumps(res[label][run.parent.name]), flush=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    keys = next(iter(next(iter(res.values())).values())).keys() if any(res.values()) else []
    print("\n| quantity | " + " | ".join(res) + " |\n|---|" + "---|" * len(res))
    for k in keys:
        cells = [" / ".join("–" if v.get(k) is None else f"{v[k]:+.3f}" for v in res[a].values()) for a in res]
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
