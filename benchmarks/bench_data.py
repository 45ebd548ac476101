"""Data-loading throughput on ../shared/data/chest_xray_original (a benchmark, not a test).

For input sizes 64/128/224 it measures images/s for
  plain   - full-resolution decode (read_image without a target) + the eval transforms' resize/pad/scale,
  draft   - JPEG draft-mode decode (read_image with target_size=S) + the same resize/pad/scale,
  cached  - one epoch over a MONAI CacheDataset that already holds the resized images,
and prints each as a ratio to plain decode.

``--scan`` times what ``cxr-hfl partition`` pays before it splits: ``scan_dataset(verify=True)`` of the whole data
root (every file decoded and checked), ``--repeat`` times, and prints the median wall and CPU seconds and their
ratios to the baseline recorded in ``benchmarks/results/scan_baseline.json`` (``--record-baseline`` writes that file;
the budget is :data:`SCAN_BUDGET` times the baseline). The machine's load moves wall seconds most: time a baseline
and a change back to back.

    .venv/bin/python -m benchmarks.bench_data [--n 120] [--sizes 64 128 224] [--data DIR]
    .venv/bin/python -m benchmarks.bench_data --scan [--repeat 3] [--record-baseline]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCAN_BASELINE = REPO / "benchmarks" / "results" / "scan_baseline.json"
#: The scan may take at most this many times the recorded baseline.
SCAN_BUDGET = 1.3


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the scan's worker processes)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_scan(data: str | Path, repeat: int = 3) -> list[tuple[float, float]]:
    """``(wall seconds, CPU seconds)`` of ``scan_dataset(data, verify=True)``, ``repeat`` times (one header-only
    scan first, so the file cache is warm for every timed run). CPU seconds count the worker processes too; on a
    shared machine they move less with the load than wall seconds."""
    from chest_xray import scan_dataset

    scan_dataset(data, verify=False)
    out = []
    for _ in range(repeat):
        c0, t0 = _cpu_seconds(), time.perf_counter()
        scan_dataset(data, verify=True)
        out.append((time.perf_counter() - t0, _cpu_seconds() - c0))
    return out


def run_scan(data: str | Path, repeat: int, record: bool, baseline_path: Path = SCAN_BASELINE) -> int:
    """Time the scan and print it against the recorded baseline (or record it). Returns the exit code (0)."""
    import json
    import statistics
    import subprocess

    runs = time_scan(data, repeat)
    wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
    print(f"scan of {data}: median {wall:.2f} s wall, {cpu:.2f} s CPU over {len(runs)} run(s) "
          f"({', '.join(f'{w:.2f}/{c:.2f}' for w, c in runs)})")
    if record:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, check=False).stdout.strip() or None
        except OSError:
            commit = None
        baseline_path.parent.mkdir(parents=True, exist_ok=True)
        baseline_path.write_text(json.dumps({"data": Path(data).name, "runs_wall_cpu_s": runs, "median_s": wall,
                                             "median_cpu_s": cpu, "commit": commit}, indent=2) + "\n")
        print(f"baseline -> {baseline_path}")
        return 0
    if not baseline_path.is_file():
        print(f"no baseline at {baseline_path} (run with --record-baseline on the reference code first)")
        return 0
    base = json.loads(baseline_path.read_text())
    ratio, cpu_ratio = wall / float(base["median_s"]), cpu / float(base["median_cpu_s"])
    print(f"ratio to the baseline (commit {base.get('commit')}: {base['median_s']:.2f} s wall, "
          f"{base['median_cpu_s']:.2f} s CPU): wall {ratio:.2f}x, CPU {cpu_ratio:.2f}x (budget {SCAN_BUDGET}x: "
          f"{'within' if max(ratio, cpu_ratio) <= SCAN_BUDGET else 'OVER'})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = Path(os.environ["CXR_DATA"]) if os.environ.get("CXR_DATA") else REPO.parent / "shared" / "data"
    ap.add_argument("--data", default=str(default_data / "chest_xray_original"))
    ap.add_argument("--n", type=int, default=120, help="images per measurement (spread over the width range)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 224])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scan", action="store_true", help="time the verifying scan of the data root instead")
    ap.add_argument("--repeat", type=int, default=3, help="--scan: timed scans (default: %(default)s)")
    ap.add_argument("--record-baseline", action="store_true", help="--scan: write the timings as the baseline")
    args = ap.parse_args(argv)
    if not Path(args.data).is_dir():
        print(f"skipped: data not found at {args.data} (set $CXR_DATA or --data)")
        return 0
    if args.scan:
        return run_scan(args.data, max(1, args.repeat), args.record_baseline)

    import torch
    from monai.data import CacheDataset
    from monai.transforms import Compose

    from chest_xray import build_transforms, read_image, scan_dataset

    torch.set_num_threads(args.threads)
    records, _ = scan_dataset(args.data, verify=False)
    records.sort(key=lambda r: (r["width"], r["path"]))
    step = max(1, len(records) // args.n)
    paths = [r["path"] for r in records[::step][: args.n]]
    print(f"{len(paths)} images from {args.data} (widths {records[0]['width']}-{records[-1]['width']} px), "
          f"torch threads {args.threads}")
    print(f"{'size':>5} {'plain img/s':>12} {'draft img/s':>12} {'draft/plain':>12} {'cached img/s':>13} "
          f"{'cached/plain':>13}")
    for s in args.sizes:
        tail = Compose(build_transforms(s, "eval").transforms[1:])  # everything after the load step

        def run(target):
            t0 = time.perf_counter()
            for p in paths:
                tail({"image": read_image(p, target_size=target)[0], "label": 0})
            return len(paths) / (time.perf_counter() - t0)

        tail({"image": read_image(paths[0])[0], "label": 0})  # warm-up (first-call allocations)
        plain = run(None)
        draft = run(s)
        ds = CacheDataset([{"image": p, "label": 0} for p in paths], build_transforms(s, "eval"), num_workers=1,
                          progress=False)
        t0 = time.perf_counter()
        for i in range(len(ds)):
            ds[i]
        cached = len(ds) / (time.perf_counter() - t0)
        print(f"{s:>5} {plain:>12.1f} {draft:>12.1f} {draft / plain:>11.1f}x {cached:>13.0f} "
              f"{cached / plain:>12.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
