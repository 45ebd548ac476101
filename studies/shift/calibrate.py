"""Set the population-shift thresholds (:data:`hfl_components.shift.DEFAULT_THRESHOLDS`) on random subsets of the
``tuning`` part of ``chest_xray_224``, and measure how often the built shifts fire.

Per reference seed s (0, 1, 2): the tuning part is split by patient into a "training split" A of 110 images (a
site's training split), a "validation split" V of 15 images and the pool B (the rest). A model is trained on A
(``cnn`` at 64 px, 15 epochs, every class augmented; ``trained``) or left at its random initialisation
(``random``); the reference is built on A (features: distance distribution cross-fitted on A, or measured on V for
the trained model: ``trained+val``). Null batches: random subsets of B of n = 16, 32, 64, 128 images (``--draws``
each), never the same image twice within a batch. Shifted batches: random subsets of B of n = 32, with one built
shift each (gamma 0.6 and 1.6, black / white bands of 8 % of the side, a 75 % central zoom, other file geometry,
DICOM PatientAge of adults). Output: JSON with each group's null quantiles per (model, n) and the share of
shifted batches that warn.

Usage: ``python -m studies.shift.calibrate --data ../shared/data --out studies/shift/results.json``
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from chest_xray import build_transforms
from chest_xray.population import population_facts
from chest_xray.splits import split_rows
from hfl_components import shift
from hfl_components.models import build_model

SIZES = (16, 32, 64, 128)
GROUPS = ("image", "geometry", "features")


def load(root: Path, size: int = 64):
    rows = split_rows("tuning")
    tf = build_transforms(size, "eval")
    X = torch.stack([tf({"image": str(root / r["path"]), "label": 0})["image"] for r in rows])
    y = np.array([int(r["label"] != "NORMAL") for r in rows])
    facts = [population_facts(root / r["path"]) for r in rows]
    return rows, X, y, facts


def patient_split(rows, seed: int, n_a: int = 110, n_v: int = 15):
    pats = sorted({r["patient_id"] for r in rows})
    order = np.random.default_rng(seed).permutation(len(pats))
    by = {}
    for i, r in enumerate(rows):
        by.setdefault(r["patient_id"], []).append(i)
    a, v, b = [], [], []
    for k in order:
        idx = by[pats[k]]
        (a if len(a) < n_a else v if len(v) < n_v else b).extend(idx)
    return np.array(a), np.array(v), np.array(b)


def train(X, y, seed: int, epochs: int = 15):
    from hfl_components.training import train_local
    from chest_xray.transforms import TensorAugmentDataset

    torch.manual_seed(seed)
    m = build_model({"family": "cnn", "num_classes": 2})
    ds = TensorAugmentDataset(X, y.tolist())
    g = torch.Generator().manual_seed(seed)
    train_local(m, torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=g), epochs, lr=0.01,
                seed=seed)
    return m.eval()


def shifted(X: torch.Tensor, kind: str) -> torch.Tensor:
    F = torch.nn.functional
    s = X.shape[-1]
    if kind == "gamma0.6":
        return X ** 0.6
    if kind == "gamma1.6":
        return X ** 1.6
    if kind in ("black_band", "white_band"):
        b = round(0.08 * s)
        inner = F.interpolate(X, size=(s - 2 * b, s - 2 * b), mode="area")
        return F.pad(inner, (b, b, b, b), value=0.0 if kind == "black_band" else 1.0)
    if kind == "zoom":
        c = round(0.125 * s)
        return F.interpolate(X[:, :, c:s - c, c:s - c], size=(s, s), mode="bilinear", align_corners=False)
    return X


def facts_for(facts, kind):
    if kind == "geometry":
        return [{**f, "width": 1024, "height": 800} for f in facts]
    if kind == "adult_age":
        return [{**f, "format": "DICOM", "age_years": 45.0} for f in facts]
    return facts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="studies/shift/results.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    rows, X, y, facts = load(Path(a.data) / "chest_xray_224")
    out = {"settings": {"draws": a.draws, "seeds": a.seeds, "sizes": SIZES, "reference_size": 110,
                        "input_size": 64, "model": "cnn", "train_epochs": 15}, "null": {}, "shifts": {}}
    kinds = ("gamma0.6", "gamma1.6", "black_band", "white_band", "zoom", "geometry", "adult_age")
    for seed in map(int, a.seeds.split(",")):
        rng = np.random.default_rng(100 + seed)
        A, V, B = patient_split(rows, seed)
        torch.manual_seed(seed)
        models = {"random": build_model({"family": "cnn", "num_classes": 2}).eval(), "trained": train(X[A], y[A], seed)}
        for mname, model in models.items():
            st, fe = shift.features_and_statistics(model, X)
            variants = {mname: dict(held_out_features=None)}
            if mname == "trained":
                variants["trained+val"] = dict(held_out_features=fe[V])
            for vname, kw in variants.items():
                ref = shift.build_reference(st[A], [facts[i] for i in A], fe[A], population=shift.KERMANY_POPULATION,
                                            **kw)
                for n in SIZES:
                    key = f"{vname}/n={n}"
                    rec = out["null"].setdefault(key, {g: [] for g in GROUPS} | {"warn": []})
                    for _ in range(a.draws):
                        b = rng.choice(B, n, replace=False)
                        res = shift.check_batch(ref, st[b], [facts[i] for i in b], fe[b])
                        for g in GROUPS:
                            rec[g].append(res["groups"].get(g, {}).get("score", 0.0))
                        rec["warn"].append(res["warn"])
                for kind in kinds:
                    rec = out["shifts"].setdefault(f"{vname}/{kind}", {g: [] for g in GROUPS + ("age",)} | {"warn": []})
                    for _ in range(max(20, a.draws // 10)):
                        b = rng.choice(B, 32, replace=False)
                        s2, f2 = shift.features_and_statistics(model, shifted(X[b], kind))
                        res = shift.check_batch(ref, s2, facts_for([facts[i] for i in b], kind), f2)
                        for g in GROUPS + ("age",):
                            rec[g].append(res["groups"].get(g, {}).get("score", 0.0))
                        rec["warn"].append(res["warn"])
        print(f"seed {seed} done at {time.time() - t0:.0f} s", flush=True)
    summary = {"null": {}, "shifts": {}}
    for key, rec in out["null"].items():
        summary["null"][key] = {g: {"q50": float(np.quantile(rec[g], 0.5)), "q99": float(np.quantile(rec[g], 0.99)),
                                    "q995": float(np.quantile(rec[g], 0.995)), "max": float(np.max(rec[g]))}
                                for g in GROUPS} | {"warn_share": float(np.mean(rec["warn"])), "n": len(rec["warn"])}
    for key, rec in out["shifts"].items():
        summary["shifts"][key] = {g: float(np.median(rec[g])) for g in GROUPS + ("age",)} | {
            "warn_share": float(np.mean(rec["warn"])), "n": len(rec["warn"])}
    summary["settings"] = out["settings"]
    summary["thresholds_used"] = dict(shift.DEFAULT_THRESHOLDS)
    summary["seconds"] = round(time.time() - t0)
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["null"], indent=0)[:3000])


if __name__ == "__main__":
    main()
