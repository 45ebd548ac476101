"""Data-loading throughput on ../shared/data/chest_xray_original (a benchmark, not a test).

For input sizes 64/128/224 it measures images/s for
  plain   - full-resolution decode (read_image without a target) + the eval transforms' resize/pad/scale,
  draft   - JPEG draft-mode decode (read_image with target_size=S) + the same resize/pad/scale,
  cached  - one epoch over a MONAI CacheDataset that already holds the resized images,
and prints each as a ratio to plain decode.

    .venv/bin/python -m benchmarks.bench_data [--n 120] [--sizes 64 128 224] [--data DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = Path(os.environ["CXR_DATA"]) if os.environ.get("CXR_DATA") else REPO.parent / "shared" / "data"
    ap.add_argument("--data", default=str(default_data / "chest_xray_original"))
    ap.add_argument("--n", type=int, default=120, help="images per measurement (spread over the width range)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 224])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if not Path(args.data).is_dir():
        print(f"skipped: data not found at {args.data} (set $CXR_DATA or --data)")
        return 0

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
