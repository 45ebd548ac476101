"""Helpers for the deployment tests: tiny real-data site manifests/profiles and a CLI runner."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
from hfl_components.flare.catalogue import deployable, is_prototype, methods  # noqa: E402,F401 - the one method list

METHODS = methods()
JOB_METHODS = tuple(m for m in METHODS if deployable(m))  # those that export as a job (not the pooled reference)


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvflare_jobs.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def tiny_manifests(data_root: Path, out: Path, sites: list[str], n_train: int = 8, n_val: int = 4,
                   n_test: int = 6) -> dict[str, Path]:
    """Per-site CSV manifests (path,label,split,patient_id,width,height) of distinct real 224x224 images, class
    balanced within each split; one patient never spans two sites or splits."""
    from chest_xray.dataset import patient_id_from_name

    base = data_root / "chest_xray_224" / "train"
    pools = {0: sorted((base / "NORMAL").glob("*.jpeg")), 1: sorted((base / "PNEUMONIA").glob("*.jpeg"))}
    used: set[str] = set()
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    for site in sites:
        rows = []
        for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
            for label in (0, 1):
                k = 0
                for p in pools[label]:
                    pid = patient_id_from_name(p)
                    if pid in used:
                        continue
                    used.add(pid)
                    rows.append([str(p), label, split, pid, 224, 224])
                    k += 1
                    if k == n // 2:
                        break
        f = out / f"{site}.csv"
        with f.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label", "split", "patient_id", "width", "height"])
            w.writerows(rows)
        res[site] = f
    return res


def tiny_profile(manifests: dict[str, Path], out: Path, method: str = "local", input_size: int = 32,
                 **extra) -> Path:
    """One <site>.yaml per manifest: fusable cnn models for local/fedavg/ohfl, heterogeneous backbones with a common
    feature_dim for fedsaf/fedproto/fedtopo."""
    from hfl_components.flare.site_config import write_site_config

    proto = is_prototype(method)
    labels = "subtype" if proto else "binary"
    fams = ("hetero_cnn", "resnet")
    depths = ("shallow", "medium")
    out.mkdir(parents=True, exist_ok=True)
    for i, (site, man) in enumerate(manifests.items()):
        model = ({"family": fams[i % 2], "feature_dim": 16} if proto
                 else {"family": "cnn", "depth": depths[i % 2], "width": 0.5})
        cfg = {"data": {"manifest": str(man), "labels": labels}, "model": model, "input_size": input_size,
               "batch_size": 4, "local_epochs": 1, "finetune_epochs": 1, "threads": 1, "seed": 0}
        cfg.update(extra.get(site, {}))
        write_site_config(cfg, out / f"{site}.yaml")
    return out
