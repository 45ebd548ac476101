"""Does ``augment: batch`` (the faster, opt-in data pipeline) train site models as good as ``augment: monai``?

The main job (OHFL, 6 width sites on ``chest_xray_original``, defaults) is run per seed twice on the identical
partition: once at the defaults (``monai``), once with the same site configs plus ``augment: batch``
(``--profile``). Compared: each deployed site model's test predictions, paired by (seed, site), balanced accuracy
(argmax) and AUC, batch - monai with seeds as clusters (:func:`hfl_components.stats.paired_nested`: each site's test
split its own image pool) and the reporting rule of ``hfl_components.stats`` (per-seed differences and no verdict
under 5 seeds).

    python -m studies.augmentation.augment_accuracy --seeds 0,1,2 --out runs/aug

Finished runs (``<out>/<arm>_s<seed>/metrics.json``) are reused. ~3-7 min a run on 2 shared cores.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np


def _check(run) -> None:
    if not run.ok:
        raise RuntimeError(f"simulate {run.method} -> {run.out} failed (rc={run.rc}); see {run.log}")


def run_arms(seed: int, out: Path, probe: str) -> None:
    """Run the monai (default) arm, then the batch arm on the monai arm's site configs (each an isolated
    :meth:`nvflare_jobs.spec.RunSpec.simulate`). Raises RuntimeError naming the failed run and its log."""
    from nvflare_jobs.spec import resolve

    mon, bat = out / f"monai_s{seed}", out / f"batch_s{seed}"
    if not (mon / "metrics.json").is_file():
        _check(resolve("ohfl", {"sites": 6, "scheme": "width", "seed": seed}).simulate(mon, overwrite=True,
                                                                                      isolate=True))
    if not (bat / "metrics.json").is_file():
        prof = out / f"prof_batch_s{seed}"
        prof.mkdir(parents=True, exist_ok=True)
        for f in sorted((mon / "site_configs").glob("*.yaml")):
            (prof / f.name).write_text(f.read_text().rstrip("\n") + "\naugment: batch\n")
        _check(resolve("ohfl", {"profile": str(prof), "probe": probe, "seed": seed}).simulate(bat, overwrite=True,
                                                                                             isolate=True))


def _preds(d: Path) -> dict:
    rows = csv.DictReader(open(d / "test_predictions.csv"))
    return {(r["site"], int(r["index"])): (int(r["label"]), float(r["p_PNEUMONIA"])) for r in rows}


def compare(out: Path, seeds: list[int], n_boot: int = 2000) -> dict:
    """Paired batch - monai differences of the site models' balanced accuracy and AUC
    (:func:`hfl_components.stats.paired_nested`). Raises ValueError when the two arms of a seed scored different
    test images."""
    from hfl_components.stats import paired_nested

    pairs, per_seed, n = [], {}, 0
    for s in seeds:
        a, b = _preds(out / f"monai_s{s}"), _preds(out / f"batch_s{s}")
        if a.keys() != b.keys():
            raise ValueError(f"seed {s}: the two arms scored different test images")
        n += len(a)
        for site in sorted({k[0] for k in a}):
            k = sorted(i for i in a if i[0] == site)
            pa, pb = np.asarray([b[i][1] for i in k]), np.asarray([a[i][1] for i in k])
            pairs.append({"seed": s, "site": site, "pool": (s, site), "ids": np.arange(len(k)),
                          "y": np.asarray([a[i][0] for i in k]), "pa": np.stack([1 - pa, pa], 1),
                          "pb": np.stack([1 - pb, pb], 1)})
        per_seed[s] = {arm: {key: json.load(open(out / f"{arm}_s{s}" / "metrics.json")).get(key)
                             for key in ("pooled", "gate", "wall_time_s")} for arm in ("monai", "batch")}
    res = {"seeds": seeds, "n_images": n, "per_seed": per_seed}
    for name in ("balanced_accuracy", "auc"):
        d = paired_nested(pairs, name, n_boot=n_boot, seed=0)
        res[name] = {**d, "monai": d["b"], "batch": d["a"]}
    return res


def main(argv=None) -> int:
    """Run (unless ``--no-run``) and compare the arms. Returns the exit code: 2 with one line on stderr for bad
    input (malformed ``--seeds``, a seed without finished runs under ``--no-run``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated distinct integer seeds (default: %(default)s)")
    ap.add_argument("--out", default="runs/aug")
    ap.add_argument("--probe", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/chest_xray_224"))
    ap.add_argument("--no-run", action="store_true", help="only analyse finished runs")
    a = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        print(f"augment_accuracy.py: --seeds must be distinct integers separated by commas, got {a.seeds!r}",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    if a.no_run:
        missing = [str(out / f"{arm}_s{s}" / f) for s in seeds for arm in ("monai", "batch")
                   for f in ("test_predictions.csv", "metrics.json") if not (out / f"{arm}_s{s}" / f).is_file()]
        if missing:
            print(f"augment_accuracy.py: --no-run: no finished run: {missing[0]} is missing ({len(missing)} file(s) "
                  "in all); run without --no-run first", file=sys.stderr)
            return 2
    else:
        for s in seeds:
            run_arms(s, out, a.probe)
    res = compare(out, seeds)
    (out / "augment_accuracy.json").write_text(json.dumps(res, indent=1))
    for s, d in res["per_seed"].items():
        print(f"seed {s}: " + "  ".join(f"{arm} acc {d[arm]['pooled']['accuracy']['value']:.3f} gate "
                                         f"{(d[arm]['gate'] or {}).get('adopted')}/6" for arm in ("monai", "batch")))
    from hfl_components.stats import paired_cell, verdict_cell

    for m in ("balanced_accuracy", "auc"):
        r = res[m]
        print(f"{m}: monai {r['monai']:.3f}  batch {r['batch']:.3f}  batch - monai {paired_cell(r)} over "
              f"{r['n_pairs']} (seed, site) pairs, {res['n_images']} images: {verdict_cell(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
