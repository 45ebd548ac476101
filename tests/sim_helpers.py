"""Helpers shared by the simulator tests: a small real-data partition and profile, and a CLI runner."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_partition(data_root: Path, out: Path, n_sites: int, labels: str = "binary", max_images: int = 240,
                   seed: int = 0) -> Path:
    """Partition a small, class-balanced real subset of chest_xray_original into ``n_sites`` width sites."""
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition

    if (out / "partition.json").is_file():
        return out
    records, _ = scan_dataset(data_root / "chest_xray_original", labels=labels, verify=False)
    by_class: dict[int, list] = {}
    for r in sorted(records, key=lambda r: r["path"]):
        by_class.setdefault(r["label"], []).append(r)
    per = max_images // len(by_class)
    subset = [r for rows in by_class.values() for r in rows[::max(1, len(rows) // per)][:per]]
    res = partition_records(subset, n_sites, "width", seed=seed, class_names=CLASS_NAMES[labels])
    write_partition(res, out)
    return out


def make_profile(partition: Path, out: Path, method: str, labels: str = "binary", sizes=(64,), **settings) -> Path:
    from nvflare_jobs.profiles import write_profile

    base = {"batch_size": 16, "local_epochs": 1, "finetune_epochs": 1, "seed": 0, "threads": 1,
            "max_train_images": 24}
    base.update(settings)
    return write_profile(partition, out, method, labels, list(sizes), base)


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cxr-hfl`` in a subprocess (the simulator spawns site processes of its own)."""
    return subprocess.run([sys.executable, "-m", "nvflare_jobs.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def load_metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


CANONICAL_KEYS = {"method", "labels", "seed", "wall_time_s", "sites", "pooled", "mean", "std", "bytes_uploaded",
                  "bytes_downloaded"}
SITE_KEYS = {"model", "input_size", "n_train", "n_test", "test"}


def assert_canonical(m: dict, sites: list[str]) -> None:
    assert CANONICAL_KEYS <= set(m), CANONICAL_KEYS - set(m)
    assert sorted(m["sites"]) == sorted(sites)
    for s in sites:
        b = m["sites"][s]
        assert SITE_KEYS <= set(b), (s, SITE_KEYS - set(b))
        t = b["test"]
        assert t["n"] == b["n_test"] > 0
        assert 0.0 <= t["accuracy"] <= 1.0
        assert sum(map(sum, t["confusion_matrix"])) == b["n_test"]
    n_all = sum(m["sites"][s]["n_test"] for s in sites)
    pooled_acc = m["pooled"]["accuracy"]
    # the pooled accuracy is the test-size-weighted mean of the site accuracies
    expect = sum(m["sites"][s]["test"]["accuracy"] * m["sites"][s]["n_test"] for s in sites) / n_all
    assert abs(pooled_acc["value"] - expect) < 1e-9
    assert pooled_acc["ci_low"] <= pooled_acc["value"] <= pooled_acc["ci_high"]


def read_status(run: Path) -> dict:
    """The server's live ``status.json`` of a simulator run folder (``{}`` while it is absent or half-written)."""
    p = Path(run) / "workspace" / "server" / "simulate_job" / "cxr_hfl_results" / "status.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
