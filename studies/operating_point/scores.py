"""Each site's deployed model's p(class) on its own validation and test splits of a finished run (for ``study.py
real``). Site splits only: never the `evaluation` part of chest_xray_224.

Usage: python -m studies.operating_point.scores RUN OUT.json [PARTITION]   (PARTITION: default RUN/partition)
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch

from chest_xray import build_transforms
from hfl_components.models import load_model_file
from nvflare_jobs.evaluation import model_aspect


def site_scores(run: Path, part: Path) -> dict:
    torch.set_num_threads(1)
    out = {}
    for f in sorted((run / "models").glob("*_deployed.pt")):
        site = f.name.removesuffix("_deployed.pt")
        model, blob = load_model_file(f)
        model.eval()
        tf = build_transforms(int(blob.get("input_size") or 64), "eval", aspect=model_aspect(blob))
        rows = list(csv.DictReader((part / "sites" / f"{site}.csv").open()))
        out[site] = {"op": blob.get("operating_point")}
        for split in ("val", "test"):
            sel = [r for r in rows if r["split"] == split]
            x = torch.stack([tf({"image": r["path"], "label": 0})["image"] for r in sel])
            with torch.no_grad():
                p = torch.softmax(model.head(model.features(x)), 1).numpy().astype(float)
            out[site][split] = {"probs": p.tolist(), "y": [int(r["label"]) for r in sel]}
    return out


if __name__ == "__main__":
    run = Path(sys.argv[1])
    part = Path(sys.argv[3]) if len(sys.argv) > 3 else run / "partition"
    Path(sys.argv[2]).write_text(json.dumps(site_scores(run, part)))
