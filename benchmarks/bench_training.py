"""Training throughput benchmark (not a test).

1. Model-only: SGD training steps (forward + backward + update, batch 16) on random tensors, for the fusable
   ``cnn`` depths and every heterogeneous backbone, at each input size -> images/s and seconds per batch.
2. Data pipeline: the same training step fed by ``chest_xray.make_site_dataset`` (MONAI CacheDataset, train-mode
   augmentation) on real images, for each ``--augment`` implementation side by side (``monai``: per-image MONAI
   ``RandFlipd`` + ``RandAffined``; ``batch``: the cached eval tensors with ``chest_xray.batch_augment`` per
   collated batch, the sites' default); ratio = pipeline images/s / model-only images/s (data-pipeline efficiency, 1.0 =
   the data layer costs nothing). The one-off cache fill (decode + resize) is timed separately.

   Both the first epoch (cache fill + one epoch: what a site pays once) and the cached epoch are set against
   model-only throughput (target: cached >= 0.9x model-only). The model-only rate of each (model, size)
   is measured again immediately before its pipeline run (side by side, so both see the same machine load), and
   the plain full-resolution decoding rate of the same images (``read_image`` without a target + the eval
   resize/pad/scale, as ``bench_data.py``) immediately before that: the cache fill (JPEG draft-mode decoding +
   resize) and the first epoch are also given as ratios to it (target: first epoch >= 2x plain decoding).

3. Federation overhead (``--simulate local,fedavg,ohfl``): one ``cxr-hfl simulate`` run per method, one after the
   other in the same invocation (default arguments: the main job's, 6 width sites), and from each metrics.json
   ``timing`` block simulator wall time / the sites' critical-path compute (the slowest site per round, summed;
   ratio = federation overhead, 1.0 = free; target <= 1.3 for the main job) and / the summed compute of all sites;
   for OHFL also the server's fusion seconds per phase and their share of the wall time.

Usage::

    .venv/bin/python -m benchmarks.bench_training [--sizes 64,96,128] [--threads 1] [--batches 10]
        [--data ../shared/data/chest_xray_original] [--n-images 128] [--out bench.json]
        [--simulate local,fedavg,ohfl] [--sim-args "--sites 6 --scheme width"] [--skip-throughput]
        [--pipeline-only] [--augment monai,batch]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]

from hfl_components.models import build_model, count_parameters  # noqa: E402
from hfl_components.models.hetero import hetero_pool_specs  # noqa: E402
from hfl_components.training import train_local  # noqa: E402

BATCH = 16


def model_specs(num_classes: int = 2) -> list[dict]:
    """cnn shallow/medium/deep plus the default heterogeneous pool."""
    cnn = [{"family": "cnn", "depth": d, "width": 1.0, "in_channels": 1, "num_classes": num_classes}
           for d in ("shallow", "medium", "deep")]
    return cnn + [s for s in hetero_pool_specs(num_classes=num_classes) if s["family"] != "hetero_cnn"
                  or s["depth"] == "shallow"]


def spec_name(spec: dict) -> str:
    return spec["family"] + (f"/{spec['depth']}" if "depth" in spec else "")


def model_only(spec: dict, size: int, batches: int, warmup: int = 2) -> dict:
    """Seconds per SGD step and images/s on random (BATCH, 1, size, size) inputs."""
    torch.manual_seed(0)
    model = build_model(spec).train()
    x = torch.rand(BATCH, 1, size, size)
    y = torch.randint(0, spec["num_classes"], (BATCH,))
    loader = [(x, y)] * (warmup + batches)
    train_local(model, loader[:warmup], epochs=1)
    t0 = time.perf_counter()
    train_local(model, loader[warmup:], epochs=1)
    secs = (time.perf_counter() - t0) / batches
    return {"model": spec_name(spec), "size": size, "params": count_parameters(model), "s_per_batch": secs,
            "images_per_s": BATCH / secs}


def pipeline(spec: dict, size: int, rows: list[dict], epochs: int = 2, augment: str = "monai") -> dict:
    """Training images/s through make_site_dataset (in-memory cache; augmentation in train mode).

    ``augment``: ``monai`` = the per-image MONAI train transforms (``RandFlipd`` + ``RandAffined`` per item);
    ``batch`` = the eval-mode cache held as one tensor (:class:`chest_xray.batch_augment.CachedTensorDataset`)
    and the same flip + affine applied per collated batch (:class:`~chest_xray.batch_augment.BatchAugmentCollate`),
    as a site with ``augment: batch`` trains.

    ``images_per_s`` (the cached epoch) is the rate of the last of ``epochs`` epochs; ``first_epoch_images_per_s``
    is what a site sees the first time: images / (cache fill, i.e. decode + resize, + the first training epoch);
    ``loader_images_per_s`` is one pass over the loader without a model (augmentation + collation alone).
    """
    from chest_xray import default_augment_classes, make_site_dataset

    t0 = time.perf_counter()
    if augment == "batch":
        from chest_xray.batch_augment import BatchAugmentCollate, CachedTensorDataset

        base = make_site_dataset(rows, size, "eval")
        items = [base[i] for i in range(len(base))]
        ds = CachedTensorDataset(torch.stack([torch.as_tensor(it["image"]) for it in items]),
                                 [int(it["label"]) for it in items])
        collate = BatchAugmentCollate(default_augment_classes(rows))
    elif augment == "monai":
        ds, collate = make_site_dataset(rows, size, "train", seed=0), None
    else:
        raise ValueError(f"unknown augment {augment!r}; expected monai or batch")
    cache_s = time.perf_counter() - t0
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=0, collate_fn=collate)
    t0 = time.perf_counter()
    n_loader = sum(len(b["label"]) for b in loader)
    loader_rate = n_loader / (time.perf_counter() - t0)
    torch.manual_seed(0)
    model = build_model(spec)
    timed = _TimedLoader(loader)
    hist = train_local(model, timed, epochs=epochs, seed=0)
    first = len(rows) / (cache_s + len(rows) / hist[0]["images_per_s"])
    return {"model": spec_name(spec), "size": size, "augment": augment, "n_images": len(rows),
            "cache_fill_s": cache_s, "loader_images_per_s": loader_rate, "images_per_s": hist[-1]["images_per_s"],
            "first_epoch_images_per_s": first,
            "model_share": 1.0 - timed.data_s / hist[-1]["seconds"]}


class _TimedLoader:
    """Iterates ``loader`` and sums the seconds spent waiting for its batches in the current epoch (``data_s``),
    so that the data layer's share of one training epoch is measured inside that epoch (same machine load)."""

    def __init__(self, loader):
        self.loader, self.dataset, self.data_s = loader, loader.dataset, 0.0

    def __iter__(self):
        self.data_s = 0.0
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            self.data_s += time.perf_counter() - t0
            yield b


def plain_decode(rows: list[dict], size: int) -> float:
    """Images/s of plain full-resolution decoding (no JPEG draft mode) + the eval transforms after the load step
    (resize / pad / scale to ``size``) on ``rows``' images: the baseline of the draft-mode cache fill."""
    from monai.transforms import Compose

    from chest_xray import build_transforms, read_image

    tail = Compose(build_transforms(size, "eval").transforms[1:])
    tail({"image": read_image(rows[0]["path"])[0], "label": 0})  # warm-up
    t0 = time.perf_counter()
    for r in rows:
        tail({"image": read_image(r["path"])[0], "label": 0})
    return len(rows) / (time.perf_counter() - t0)


def load_rows(data: Path, n_images: int) -> list[dict]:
    from chest_xray import scan_dataset

    records, _ = scan_dataset(data, labels="binary", verify=False)
    step = max(1, len(records) // n_images)
    return records[::step][:n_images]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,96,128")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 shared cores: 1 per site)")
    ap.add_argument("--batches", type=int, default=10, help="timed batches per model and size")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "chest_xray_original"))
    ap.add_argument("--n-images", type=int, default=128, help="real images for the pipeline measurement")
    ap.add_argument("--pipeline-models", default="cnn/shallow,cnn/deep",
                    help="comma list of model names measured through the data pipeline")
    ap.add_argument("--augment", default="monai,batch",
                    help="comma list of training augmentations measured side by side: monai (per-image MONAI "
                         "RandFlipd + RandAffined) and/or batch (chest_xray.batch_augment on the collated batch)")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--simulate", default=None,
                    help="comma list of methods (e.g. local,fedavg,ohfl): run `cxr-hfl simulate --method M` for each "
                         "and print the overhead ratios side by side")
    ap.add_argument("--sim-args", default="--sites 6 --scheme width",
                    help="arguments of every simulate run (default: the main job's defaults)")
    ap.add_argument("--skip-throughput", action="store_true", help="only the --simulate part")
    ap.add_argument("--pipeline-only", action="store_true",
                    help="skip the model-only table of every backbone; only the data-pipeline table (whose model-only "
                         "rates are measured side by side) and --simulate")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    specs = model_specs()

    import os

    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    if args.skip_throughput:
        specs, sizes = [], []
        args.data = "/nonexistent"
    print(f"model-only training throughput (batch {BATCH}, {args.threads} thread(s), SGD step incl. backward)")
    print(f"{'model':<20}{'params':>10}" + "".join(f"{f'{s}px s/b':>12}{'img/s':>8}" for s in sizes))
    model_rows = []
    for spec in ([] if args.pipeline_only else specs):
        res = [model_only(spec, s, args.batches) for s in sizes]
        model_rows += res
        print(f"{res[0]['model']:<20}{res[0]['params']:>10,}"
              + "".join(f"{r['s_per_batch']:>12.3f}{r['images_per_s']:>8.0f}" for r in res), flush=True)

    pipe_rows = []
    data = Path(args.data)
    try:
        import chest_xray

        have_pipeline = hasattr(chest_xray, "make_site_dataset") and data.exists()
    except ImportError:
        have_pipeline = False
    if not have_pipeline:
        print(f"\ndata pipeline: skipped (no chest_xray.make_site_dataset or no data at {data})")
    else:
        rows = load_rows(data, args.n_images)
        wanted = [s for s in specs if spec_name(s) in args.pipeline_models.split(",")]
        print(f"\ndata-pipeline efficiency on {len(rows)} images of {data} (ratio = pipeline / model-only img/s)")
        print("(model-only and plain decoding re-measured right before each pipeline run; fill = cache fill img/s;\n"
              " in-epoch = 1 - the cached epoch's seconds waiting for batches / its seconds: the same ratio measured\n"
              " inside one epoch, free of the load's drift between two measurements)")
        augments = args.augment.split(",")
        print(f"{'model':<14}{'size':>5}{'aug':>6}{'plain dec':>10}{'fill':>7}{'loader':>8}{'1st ep':>8}{'cached':>8}"
              f"{'model':>7}{'fill/plain':>11}{'1st/plain':>10}{'1st/model':>10}{'cached/model':>13}{'in-epoch':>9}")
        for spec in wanted:
            for s in sizes:
                plain = plain_decode(rows, s)
                for aug in augments:  # side by side: model-only re-measured before each
                    m = model_only(spec, s, args.batches)
                    p = pipeline(spec, s, rows, augment=aug)
                    p["plain_decode_images_per_s"] = plain
                    p["cache_fill_images_per_s"] = len(rows) / p["cache_fill_s"]
                    p["model_only_images_per_s"] = m["images_per_s"]
                    p["ratio"] = p["images_per_s"] / m["images_per_s"]
                    p["first_epoch_ratio"] = p["first_epoch_images_per_s"] / m["images_per_s"]
                    p["fill_vs_plain"] = p["cache_fill_images_per_s"] / plain
                    p["first_epoch_vs_plain"] = p["first_epoch_images_per_s"] / plain
                    pipe_rows.append(p)
                    print(f"{p['model']:<14}{s:>5}{aug:>6}{plain:>10.0f}{p['cache_fill_images_per_s']:>7.0f}"
                          f"{p['loader_images_per_s']:>8.0f}{p['first_epoch_images_per_s']:>8.0f}"
                          f"{p['images_per_s']:>8.0f}"
                          f"{m['images_per_s']:>7.0f}{p['fill_vs_plain']:>11.2f}{p['first_epoch_vs_plain']:>10.2f}"
                          f"{p['first_epoch_ratio']:>10.2f}{p['ratio']:>13.2f}{p['model_share']:>9.2f}", flush=True)
    overhead = None
    if args.simulate:
        overhead = {m: simulate_overhead(m, args.sim_args, data) for m in args.simulate.split(",")}
        print("\nfederation overhead (wall / critical-path site compute), one run each, side by side:")
        for m, t in overhead.items():
            fus = t.get("server_fusion_s")
            share = "" if not fus else (f"; server fusion {sum(fus.values()):.1f} s = "
                                        f"{100 * sum(fus.values()) / t['wall_s']:.1f}% of wall "
                                        f"({', '.join(f'{k} {v:.1f}' for k, v in fus.items())})")
            print(f"  {m:<8} wall {t.get('wall_s', float('nan')):7.1f} s  critical path "
                  f"{t.get('site_compute_critical_path_s', float('nan')):7.1f} s  ratio {t.get('overhead_ratio')}{share}")
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": args.threads, "batch": BATCH, "model_only": model_rows,
                                              "pipeline": pipe_rows, "federation": overhead}, indent=2))
    return 0


def simulate_overhead(method: str, sim_args: str, data: Path) -> dict:
    """Run the simulator once and print wall time against the sites' own compute time."""
    import shlex
    import tempfile

    from nvflare_jobs.commands.simulate import options_from_argv
    from nvflare_jobs.spec import resolve

    out = Path(tempfile.mkdtemp(prefix="bench_sim_")) / "run"
    method, opts = options_from_argv(["--method", method, *(["--data", str(data)] if data.exists() else []),
                                      *shlex.split(sim_args)])
    print(f"\nfederation overhead: simulate {method} {opts} -> {out}", flush=True)
    t0 = time.perf_counter()
    run = resolve(method, opts).simulate(out, isolate=True)
    wall = time.perf_counter() - t0
    if not run.ok:
        print(f"simulation failed (rc={run.rc}): {run.log.read_text()[-2000:]}")
        return {"error": run.rc}
    m = json.loads((out / "metrics.json").read_text())
    t = m["timing"]
    t["process_wall_s"] = round(wall, 2)
    t["server_fusion_s"] = m.get("server_fusion_s")
    t["server_seconds"] = m.get("server_seconds")
    t["run_dir"] = str(out)
    print(f"wall {t['wall_s']:.1f} s (process {wall:.1f} s); site compute: critical path "
          f"{t['site_compute_critical_path_s']:.1f} s, all sites summed {t['site_compute_total_s']:.1f} s; server "
          f"{t['server_total_s']:.1f} s")
    print(f"ratio wall / critical path = {t['overhead_ratio']}; wall / summed compute = "
          f"{t['wall_s'] / max(t['site_compute_total_s'], 1e-9):.2f} (below 1: sites overlapped)")
    return t


if __name__ == "__main__":
    raise SystemExit(main())
