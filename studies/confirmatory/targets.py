"""The research milestones of the one-shot main job, checked on a finished ``cxr-hfl compare`` folder with an
external evaluation: the fused global model's zero-shot AUC (:data:`GLOBAL_AUC_TARGET`), its gap to its parents
(:data:`STRETCH_GAP`), the deployed models against their pre-fusion local models and against local+ft, and the
verdict against FedAvg as it is. A research checklist, not a product output: compare's tables and reports do not
print it.

    python -m studies.confirmatory.targets runs/cmp
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

from hfl_components.flare import catalogue
from nvflare_jobs.compare import load_external

GLOBAL_AUC_TARGET = 0.75   # the fused global model's zero-shot mean AUC
STRETCH_GAP = 0.05         # stretch: global within this of its parents' (pre-fusion local models') mean AUC


def ohfl_targets(ext: dict, method: str | None = None) -> list[dict]:
    """The fusion targets for ``method`` (the one-shot method, by default) from an external evaluation (:func:`external_tables` or
    :func:`load_external`): one ``{"target", "value", "met"}`` per target, ``met`` True/False, or None for a number
    reported without a threshold (the verdict against FedAvg). ``[]`` when ``method`` has no external rows.

    Targets: (1) the global model's zero-shot AUC (site input sizes averaged), mean over seeds, >= 0.75;
    (2) stretch: within 0.05 of the pre-fusion local models' mean; (3) the deployed models' mean AUC >= the
    pre-fusion local models' mean; (4) the deployed models are not worse than local+ft, for AUC and for balanced
    accuracy: non-inferiority, the interval's lower bound above minus the margin of
    :data:`hfl_components.stats.MARGINS` (with fewer than :data:`hfl_components.stats.MIN_SEEDS` seeds there is no
    verdict and the target is not met; without a local+ft control in the comparison: one row "not measured", not
    met, rather than no row and "All targets met"); (5) the paired verdict against FedAvg, reported as it is.
    """
    from hfl_components.stats import MARGINS, paired_cell, verdict_cell

    method = method or catalogue.with_schedule("one_shot")
    rows = [r for r in ext.get("rows", []) if r["method"] == method]
    if not rows:
        return []
    seeds = sorted({r["seed"] for r in rows})

    def mean(kind, model=None):
        v = [r["auc"] for r in rows if r["kind"] == kind and (model is None or r["model"] == model)
             and r["auc"] is not None]
        return (float(np.mean(v)), len(v)) if v else (None, 0)

    per_seed = {s: next((r["auc"] for r in rows if r["seed"] == s and r["model"] == "global"), None) for s in seeds}
    g, _ = mean("global", "global")
    loc, n_loc = mean("local")
    dep, n_dep = mean("deployed")
    out = []
    if g is not None:
        seeds_txt = ", ".join(f"seed {s} {'–' if v is None else f'{v:.3f}'}" for s, v in per_seed.items())
        out.append({"target": f"global model zero-shot mean AUC >= {GLOBAL_AUC_TARGET}",
                    "value": f"{g:.3f} over {len(seeds)} seed(s) ({seeds_txt})", "met": g >= GLOBAL_AUC_TARGET})
        if loc is not None:
            out.append({"target": f"stretch: global within {STRETCH_GAP} of its parents' mean AUC",
                        "value": f"{g:.3f} vs {loc:.3f} (gap {g - loc:+.3f})", "met": g >= loc - STRETCH_GAP})
    if dep is not None and loc is not None:
        out.append({"target": "deployed models' mean AUC >= the pre-fusion local models' mean",
                    "value": f"{dep:.3f} ({n_dep} models) vs {loc:.3f} ({n_loc} models)", "met": dep >= loc})
    seen_control = False
    for p in ext.get("paired", []):
        if p.get("a") != method or p.get("kind_a") != "deployed" or p.get("kind_b") != "deployed":
            continue
        vs_fedavg = p.get("b") == catalogue.with_role("reference")
        if not vs_fedavg and (not ext.get("control") or p.get("b") != ext.get("control")):
            continue
        seen_control = seen_control or not vs_fedavg
        for metric, label in (("auc", "AUC"), ("balanced_accuracy", "balanced accuracy")):
            d = p.get(metric) or {}
            if d.get("diff") is None:
                continue
            value = f"{paired_cell(d)}: {verdict_cell(d)}"
            if vs_fedavg:
                out.append({"target": f"verdict against equal-epoch FedAvg, {label} (reported, no threshold)",
                            "value": value, "met": None})
            else:  # non-inferiority with the margin fixed in advance; no verdict (too few seeds) is not met
                m = d.get("margin", MARGINS.get(metric))
                out.append({"target": f"deployed models not worse than local+ft, {label} (non-inferiority, "
                                      f"margin {m:g})", "value": value, "met": bool(d.get("non_inferior"))})
    if not seen_control:  # target (4) cannot be judged: say so instead of leaving it out ("All targets met")
        out.append({"target": "deployed models not worse than local+ft",
                    "value": "not measured: no local+ft control run in this comparison (add local to --methods)",
                    "met": False})
    return out


def targets_markdown(targets: list[dict]) -> list[str]:
    """Markdown lines of :func:`ohfl_targets` (a table; empty when there are none)."""
    if not targets:
        return []
    L = ["", "### Main-job targets (OHFL, external evaluation)", "",
         "| target | value | met |", "|---|---|---|"]
    for t in targets:
        L.append(f"| {t['target']} | {t['value']} | "
                 + {True: "met", False: "**NOT met**", None: "reported"}[t["met"]] + " |")
    n_not = sum(t["met"] is False for t in targets)
    L += ["", f"{n_not} of {sum(t['met'] is not None for t in targets)} targets not met." if n_not
          else "All targets met."]
    return L


def main(argv: list[str] | None = None) -> int:
    """Print the targets of the compare folder ``argv[0]``; exit 2 without its external tables."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m studies.confirmatory.targets COMPARE_FOLDER", file=sys.stderr)
        return 2
    ext = load_external(Path(args[0]))
    if ext is None:
        print(f"targets: {args[0]}: no comparison_external.csv and paired_external.json (compare --external)",
              file=sys.stderr)
        return 2
    print("\n".join(targets_markdown(ohfl_targets(ext))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
