"""Choose the prototype methods' training defaults on the sites' *validation* splits only.

Sites: ``chest_xray_224``'s tuning + probe parts (:data:`chest_xray.splits.TRAINING_PARTS`, 1,055 images; the
``evaluation`` part is never read), 3 subtype classes, Dirichlet alpha 0.5, 6 sites, the prototype methods'
heterogeneous backbones at one input size. Each site trains alone (the Local method, which is what every prototype
method does in its warm-up / round 0) through the real :class:`~hfl_components.flare.site_tasks.SiteRuntime`, one
epoch at a time, and after each epoch its model is scored on its own validation split. Reported: mean site balanced
accuracy on validation per (setting, epoch), the share of sites whose validation predictions are a single class.
Test splits and the evaluation part are never touched.

    python -m studies.proto_tuning.tune_proto --seeds 0,1 --epochs 30 --out runs/studies/proto_tuning.md
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

SETTINGS = {  # name -> site-config overrides; a setting is "+"-joined names, e.g. "sampler+adam+bs8"
    "plain": {"class_weights": None, "balanced_sampling": False, "fast_augment": True},
    "weights": {"class_weights": "balanced", "balanced_sampling": False, "fast_augment": True},
    "sampler": {"class_weights": None, "balanced_sampling": True, "fast_augment": True},
    "sgd": {"optimizer": "sgd"},
    "adam": {"optimizer": "adam"},
    "adamw": {"optimizer": "adamw", "weight_decay": 0.05},
    "cos": {"lr_schedule": "cosine"},
    "bs8": {"batch_size": 8},
    "bs32": {"batch_size": 32},
}


def overrides(setting: str) -> dict:
    """Site-config overrides of a "+"-joined setting name (see :data:`SETTINGS`). Raises KeyError on unknown names."""
    out: dict = {}
    for part in setting.split("+"):
        out.update(SETTINGS[part])
    return out


def build_sites(seed: int, work: Path, alpha: float, scheme: str, input_size: int, data: Path,
                extra_roots: tuple = (), min_eval_per_class: int = 0) -> dict:
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition
    from chest_xray.splits import TRAINING_PARTS, write_pool_csv
    from nvflare_jobs.profiles import write_profile
    from hfl_components.flare.site_config import load_profile

    csv_ = write_pool_csv(TRAINING_PARTS, data, work / "pool.csv", extra_roots=extra_roots)
    records, _ = scan_dataset(csv_, labels="subtype", verify=False)
    res = partition_records(records, 6, scheme, alpha=alpha, seed=seed, class_names=CLASS_NAMES["subtype"],
                            min_eval_per_class=min_eval_per_class)
    part = work / f"part{seed}"
    write_partition(res, part)
    prof = write_profile(part, work / f"prof{seed}", "fedtopo", "subtype", [input_size],
                         {"batch_size": 16, "local_epochs": 1, "seed": seed, "threads": 1, "feature_dim": 64})
    return load_profile(prof)


def parse_extra(ap: argparse.ArgumentParser, text: str) -> dict:
    """``--extra 'key=YAML;key=YAML'`` -> site-config overrides, parsed once; an entry without ``=`` or a key that
    is not a site-config key stops the script with an argparse error (exit 2) naming it."""
    from hfl_components.flare.site_config import DEFAULTS

    out = {}
    for kv in filter(None, text.split(";")):
        k, sep, v = kv.partition("=")
        if not sep or k.strip() not in DEFAULTS:
            ap.error(f"--extra {kv!r}: expected key=value with a site-config key ({', '.join(sorted(DEFAULTS))})")
        out[k.strip()] = yaml.safe_load(v)
    return out


def pooled_val_loader(profile: dict, rt, only: str | None = None,
                      exclude_own: bool = False) -> torch.utils.data.DataLoader:
    """Every site's *validation* images (the union of the sites' val splits, still tuning + probe images only)
    restricted to the classes ``rt``'s site holds in training, at its input size: a steadier validation signal
    than the site's own 4-30 val images, scored the way the external evaluation scores a site model.
    ``exclude_own``: leave out ``rt``'s own val split (for scoring a model selected on that split)."""
    from chest_xray import make_site_dataset, read_site_manifest

    held = set(np.flatnonzero(rt.class_counts() > 0).tolist())
    rows = [r for s, cfg in profile.items() if not (exclude_own and s == rt.site)
            for r in read_site_manifest(cfg["data"]["manifest"])
            if r["split"] == "val" and int(r["label"]) in held and (only is None or only in r["path"])]
    ds = make_site_dataset(rows, int(rt.cfg["input_size"]), "eval")
    return torch.utils.data.DataLoader(ds, batch_size=128, shuffle=False)


def main() -> None:
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.training import compute_metrics, predict_proba

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/chest_xray_224"))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--configs", default="plain@0.01,weights@0.01,sampler@0.01,sampler@0.03",
                    help="setting@lr list; settings: " + ", ".join(SETTINGS))
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--out", help="markdown results file")
    ap.add_argument("--extra-original", action="store_true",
                    help="append every image of the sibling chest_xray_original to the training pool")
    ap.add_argument("--min-eval-per-class", type=int, default=0,
                    help="partition_records(min_eval_per_class=...) (the prototype default is 2)")
    ap.add_argument("--extra", default="", help="site-config overrides for every setting, ';'-separated YAML values, e.g. "
                         "'weight_ema=0.98;augment_classes=[0, 1, 2]'")
    a = ap.parse_args()
    extra = parse_extra(ap, a.extra)
    torch.set_num_threads(1)
    seeds = [int(s) for s in a.seeds.split(",")]
    configs = [(c.split("@")[0], float(c.split("@")[1])) for c in a.configs.split(",")]
    curves: dict[tuple[str, float], list[np.ndarray]] = {}
    single: dict[tuple[str, float], list[np.ndarray]] = {}
    aucs: dict[tuple[str, float], list[np.ndarray]] = {}
    pooled: dict[tuple[str, float], list[np.ndarray]] = {}
    psingle: dict[tuple[str, float], list[np.ndarray]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for seed in seeds:
            extra_roots = (Path(a.data).parent / "chest_xray_original",) if a.extra_original else ()
            profile = build_sites(seed, work, a.alpha, "dirichlet", a.input_size, Path(a.data),
                                  extra_roots=extra_roots, min_eval_per_class=a.min_eval_per_class)
            for name, lr in configs:
                if True:
                    for site, cfg in profile.items():
                        cfg = {**cfg, **overrides(name), **extra, "lr": lr}
                        rt = SiteRuntime(cfg, work / f"ws_{seed}_{name}_{lr}_{site}")
                        ba, one, au, pba, pone = [], [], [], [], []
                        pool = pooled_val_loader(profile, rt, only="chest_xray_224" if a.extra_original else None)
                        for ep in range(a.epochs):
                            rt.train(1, lr, rnd=ep, total_rounds=a.epochs)
                            pp, py = predict_proba(rt.eval_model, pool)
                            pm = compute_metrics(py, pp, rt.num_classes)
                            pba.append(pm["balanced_accuracy"])
                            pone.append(float(len(np.unique(pp.argmax(1))) == 1))
                            m = rt.evaluate("val")
                            ba.append(m["balanced_accuracy"] if m["balanced_accuracy"] is not None else np.nan)
                            au.append(m["auc"] if m["auc"] is not None else np.nan)
                            cm = np.asarray(m["confusion_matrix"])
                            one.append(float((cm.sum(axis=0) > 0).sum() == 1 and (cm.sum(axis=1) > 0).sum() > 1))
                        vc = np.bincount([int(r["label"]) for r in rt.rows("val")], minlength=rt.num_classes)
                        print(f"  {site} {cfg['model']['family']}: train counts {rt.class_counts().tolist()} val "
                              f"counts {vc.tolist()} last-5 val bal acc {np.nanmean(ba[-5:]):.2f} single-class "
                              f"epochs {int(sum(one[-5:]))}/5; pooled val ({len(pool.dataset)} images) bal acc "
                              f"{np.mean(pba[-5:]):.2f} single-class epochs {int(sum(pone[-5:]))}/5", flush=True)
                        curves.setdefault((name, lr), []).append(np.asarray(ba))
                        pooled.setdefault((name, lr), []).append(np.asarray(pba))
                        psingle.setdefault((name, lr), []).append(np.asarray(pone))
                        single.setdefault((name, lr), []).append(np.asarray(one))
                        aucs.setdefault((name, lr), []).append(np.asarray(au))
                    c = np.nanmean(np.stack(curves[(name, lr)]), axis=0)
                    ca = np.nanmean(np.stack(aucs[(name, lr)]), axis=0)
                    sc = np.mean(np.stack(single[(name, lr)]), axis=0)
                    cp = np.mean(np.stack(pooled[(name, lr)]), axis=0)
                    spp = np.mean(np.stack(psingle[(name, lr)]), axis=0)
                    k = min(5, a.epochs)
                    print(f"seed {seed} {name} lr {lr}: pooled val bal acc by epoch " + " ".join(f"{v:.2f}" for v in cp)
                          + f" | last {k}: {cp[-k:].mean():.3f} single-class {spp[-k:].mean():.2f}", flush=True)
                    print(f"seed {seed} {name} lr {lr}: val bal acc by epoch "
                          + " ".join(f"{v:.2f}" for v in c)
                          + f" | last {k}: bal acc {c[-k:].mean():.3f} AUC {ca[-k:].mean():.3f} single-class "
                          f"{sc[-k:].mean():.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    checkpoints = [e for e in (5, 10, 15, 20, 25, 30, 40, 50) if e <= a.epochs]
    L = ["# Prototype methods: training defaults chosen on validation", "",
         f"Command: `python -m studies.proto_tuning.tune_proto --seeds {a.seeds} --epochs {a.epochs} "
         f"--configs {a.configs} "
         f"--input-size {a.input_size}`", "",
         "Sites from `chest_xray_224` tuning + probe parts (the evaluation part is never read), 3 subtype classes, "
         f"Dirichlet alpha {a.alpha}, 6 sites, seeds {a.seeds}, heterogeneous backbones at {a.input_size} px, each "
         "site trained alone (optimiser, lr schedule and batch size as the setting says; default SGD, momentum 0.9, batch 16). Mean site balanced accuracy on the sites' own "
         "**validation** splits (about 10 % of each site, patient-grouped) after each number of epochs; in brackets "
         "the share of site-seed validation sets that hold >= 2 classes but get a single predicted class. Test "
         "splits are never evaluated here.", "",
         "| setting | lr | " + " | ".join(f"{e} ep" for e in checkpoints) + " |",
         "|---|---|" + "---|" * len(checkpoints)]
    summary = {}
    for (name, lr), cs in curves.items():
        c = np.nanmean(np.stack(cs), axis=0)
        s = np.mean(np.stack(single[(name, lr)]), axis=0)
        summary[f"{name}@{lr}"] = {"val_bal_acc": c.tolist(), "single_class_share": s.tolist()}
        L.append(f"| {name} | {lr} | " + " | ".join(f"{c[e - 1]:.3f} ({s[e - 1]:.2f})" for e in checkpoints) + " |")
    L += ["", f"Wall time {time.perf_counter() - t0:.0f} s on 2 shared CPU cores (1 thread).", ""]
    text = "\n".join(L)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
