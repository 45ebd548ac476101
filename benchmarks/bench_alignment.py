"""FedSAF alignment benchmark (not a test): the paper's Tables III, VIII and IX on chest X-rays.

Setting (sized for 2 CPU cores; every number below is a command-line option):

* data: a fixed 3-class (NORMAL / BACTERIAL / VIRAL) partition of ../shared/data/chest_xray_224 into **4 sites**
  by Dirichlet label skew, alpha **0.1** and **0.5** (partition seed 0, patient-grouped 80/10/10 splits per site);
  each site's training split capped at **120** images (class-stratified), test on the site's whole test split;
* models: one backbone per site from the heterogeneous pool, **hetero_cnn, densenet, resnet, efficientnet** (four
  types), common feature dim **64**, input **64 px**, batch 16, SGD lr 0.01;
* federation: **5 rounds** x **1 local epoch**, FedProto weighted-mean global prototypes, lambda = gamma = 1;
  round 0 is supervised only; evaluation with each site's own head;
* seeds **0, 1, 2** (training seeds; the partition stays fixed).

Tables (mean +- std over seeds of the mean site test accuracy):

* Table III analogue: alignment function MSE, cosine, GCSA, RCSA, per alpha;
* Table VIII analogue: GCSA with the prototype level only (gamma = 0), the instance level only (lambda = 0) and both;
* Table IX analogue: client seconds per round (mean over sites and rounds) of each configuration.

Runs execute the real FedSAF server workflow and site handlers in process (see ``fedbench.py``). Results go to
``benchmarks/results/bench_alignment.json`` after every run; rerunning the same command resumes. The whole budget is
printed before anything runs.

    .venv/bin/python -m benchmarks.bench_alignment                      # full grid (36 runs)
    .venv/bin/python -m benchmarks.bench_alignment --tiny               # smoke test: 1 alpha, 1 seed, 2 rounds, 24 imgs
    .venv/bin/python -m benchmarks.bench_alignment --budget-only
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.fedbench import (RESULTS, ResultStore, estimate_seconds, fmt_s, make_partition, make_profile,
                                  mean_std, run_federation)

KINDS = ("mse", "cosine", "gcsa", "rcsa")
LEVELS = {"proto-only": (1.0, 0.0), "instance-only": (0.0, 1.0), "both": (1.0, 1.0)}
S_PER_IMAGE = 0.006  # rough seconds per training image at 64 px with 2 threads (forward+backward, these backbones)


def configs(alphas, seeds, ablation_kind):
    out = []
    for a in alphas:
        for seed in seeds:
            for kind in KINDS:
                out.append({"alpha": a, "kind": kind, "level": "both", "seed": seed})
            for level in ("proto-only", "instance-only"):
                out.append({"alpha": a, "kind": ablation_kind, "level": level, "seed": seed})
    return out


def key(c):
    return f"alpha={c['alpha']}|{c['kind']}|{c['level']}|seed={c['seed']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--max-train-images", type=int, default=120)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--feature-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablation-kind", default="gcsa", choices=("gcsa", "rcsa"))
    ap.add_argument("--tiny", action="store_true", help="smoke test: alpha 0.5, seed 0, 2 rounds, 24 images, "
                                                        "results in bench_alignment_tiny.json")
    ap.add_argument("--results", help="results JSON (default benchmarks/results/bench_alignment[_tiny].json)")
    ap.add_argument("--fresh", action="store_true", help="discard earlier results in the results file")
    ap.add_argument("--budget-only", action="store_true")
    a = ap.parse_args(argv)
    if a.tiny:
        a.alphas, a.seeds, a.rounds, a.max_train_images = "0.5", "0", 2, 24
    alphas = [float(x) for x in a.alphas.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    grid = configs(alphas, seeds, a.ablation_kind)
    settings = {"sites": a.sites, "rounds": a.rounds, "local_epochs": a.local_epochs,
                "max_train_images": a.max_train_images, "input_size": a.input_size, "feature_dim": a.feature_dim,
                "prototypes": "fedproto", "partition_seed": 0, "data": "chest_xray_224 subtype"}
    path = Path(a.results) if a.results else RESULTS / ("bench_alignment_tiny.json" if a.tiny else "bench_alignment.json")
    store = ResultStore(path, settings, fresh=a.fresh)
    todo = [c for c in grid if not store.done(key(c))]
    est = estimate_seconds(len(todo), a.sites, a.rounds, a.local_epochs, a.max_train_images, S_PER_IMAGE * 2 / a.threads)
    print("=" * 78)
    print(f"bench_alignment budget: {len(grid)} runs ({len(grid) - len(todo)} already in {path}), {len(todo)} to go")
    print(f"  alphas {alphas} x seeds {seeds} x [MSE, cosine, GCSA, RCSA + {a.ablation_kind} proto-only/instance-only]")
    print(f"  each run: {a.sites} sites (hetero_cnn/densenet/resnet/efficientnet), {a.rounds} rounds x "
          f"{a.local_epochs} epoch(s), <= {a.max_train_images} train images/site, {a.input_size} px, "
          f"{a.threads} threads")
    print(f"  estimated time: ~{fmt_s(est)} (rough: {S_PER_IMAGE} s/image/epoch at 2 threads + cache fill)")
    print("=" * 78, flush=True)
    if a.budget_only:
        return 0
    parts = {al: make_partition(f"dirichlet_a{al}_s{a.sites}", a.sites, "dirichlet", alpha=al) for al in alphas}
    base = {"batch_size": 16, "local_epochs": a.local_epochs, "seed": 0, "threads": a.threads,
            "max_train_images": a.max_train_images, "feature_dim": a.feature_dim,
            "cache_dir": str(RESULTS / "cache")}
    t_start = time.perf_counter()
    for i, c in enumerate(todo):
        lam, gamma = LEVELS[c["level"]]
        work = RESULTS / "work" / "alignment"
        profile = make_profile(parts[c["alpha"]], work / "profile", "fedsaf", a.input_size,
                               {**base, "seed": c["seed"]})
        opts = {"rounds": a.rounds, "local_epochs": a.local_epochs, "seed": c["seed"], "alignment": c["kind"],
                "prototypes": "fedproto", "lam": lam, "gamma": gamma, "min_sites": 1}
        t0 = time.perf_counter()
        res = run_federation("fedsaf", profile, opts, work / "run", log=print)
        res.update(c)
        store.put(key(c), res)
        done = i + 1
        eta = (time.perf_counter() - t_start) / done * (len(todo) - done)
        print(f"[{done}/{len(todo)}] {key(c)}: mean site acc {res['mean_site_accuracy']:.3f}, "
              f"{res['client_seconds_per_round']:.1f} client s/round, {time.perf_counter() - t0:.0f} s "
              f"(ETA {fmt_s(eta)})", flush=True)
    report(store, alphas, seeds, a.ablation_kind)
    return 0


def report(store, alphas, seeds, abl):
    def cell(alpha, kind, level):
        rs = [store.get(key({"alpha": alpha, "kind": kind, "level": level, "seed": s})) for s in seeds]
        rs = [r for r in rs if r]
        acc = mean_std([r["mean_site_accuracy"] for r in rs])
        sec = mean_std([r["client_seconds_per_round"] for r in rs])
        return acc, sec, len(rs)

    def f(ms):
        return "   -   " if ms[0] is None else f"{100 * ms[0]:5.1f}+-{100 * ms[1]:.1f}"

    print("\nTable III analogue: mean site test accuracy (%), mean +- std over seeds")
    print(f"{'alignment':<12}" + "".join(f"{'alpha=' + str(al):>16}" for al in alphas))
    for kind in KINDS:
        print(f"{kind:<12}" + "".join(f"{f(cell(al, kind, 'both')[0]):>16}" for al in alphas))
    print(f"\nTable VIII analogue ({abl}): level ablation, mean site test accuracy (%)")
    for level in ("proto-only", "instance-only", "both"):
        print(f"{level:<14}" + "".join(f"{f(cell(al, abl, level)[0]):>16}" for al in alphas))
    print("\nTable IX analogue: client seconds per round (mean over sites, rounds and seeds)")
    rows = [(k, "both") for k in KINDS] + [(abl, "proto-only"), (abl, "instance-only")]
    for kind, level in rows:
        secs = [cell(al, kind, level)[1][0] for al in alphas]
        print(f"{kind + ' ' + level:<22}" + "".join("      -" if s is None else f"{s:9.2f}" for s in secs))


if __name__ == "__main__":
    sys.exit(main())
