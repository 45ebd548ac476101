"""``cxr-hfl compare``: every method on the identical partition, label scheme and seeds; comparison tables.

Layout of ``OUT``::

    OUT/seed<k>/partition/          one partition per seed (scanned and split once, reused by every method)
    OUT/seed<k>/<method>/           a run folder written by ``cxr-hfl simulate --profile`` (metrics.json, models...)
    OUT/comparison.csv              one row per (method, seed, site)
    OUT/comparison.md               mean +- std, pooled metrics with 95% CIs, per-site tables, paired differences
    OUT/compare.json                the command and the epoch budget of every method

A method may carry extra ``simulate`` options as a variant, ``ohfl:strategy=cdd`` (benchmarks use this).
Resumable: a run whose ``metrics.json`` exists is not run again. ``local+ft`` is the compute-matched control: the
local method in one round of ``rounds x local_epochs + finetune_epochs`` epochs (Local's budget plus as many extra
epochs as OHFL's fine-tuning; a Local round continues the same model, so this is Local trained F epochs longer).
"""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

METHODS = ("local", "local+ft", "fedavg", "ohfl", "fedsaf", "fedproto", "fedtopo")
PROTO = ("fedsaf", "fedproto", "fedtopo")
COLUMNS = ["method", "seed", "site", "model", "input_size", "n_test", "accuracy", "balanced_accuracy", "auc",
           "sensitivity", "specificity", "threshold", "wall_seconds", "server_seconds", "bytes_up", "bytes_down"]
METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")


def split_variant(method: str) -> tuple[str, list[str]]:
    """``"ohfl:strategy=cdd:weighting=half"`` -> ``("ohfl", ["--strategy", "cdd", "--weighting", "half"])``: a method
    variant passes extra ``cxr-hfl simulate`` options (the run folder and table rows keep the full name)."""
    name, *opts = method.split(":")
    extra = []
    for o in opts:
        k, _, v = o.partition("=")
        extra += [f"--{k.strip().replace('_', '-')}"] + ([v.strip()] if v else [])
    return name, extra


def _base(method: str) -> str:
    name = split_variant(method)[0]
    return "local" if name == "local+ft" else name


def proto_protocol(methods: list[str]) -> bool:
    """True when the methods are prototype methods, with or without Local (issue 16's protocol): sites from
    ``chest_xray_224``'s tuning + probe parts (unless --data), Local on the same heterogeneous backbones and
    training defaults at the same rounds x local epochs, and the site models scored on the evaluation part."""
    bases = {_base(m) for m in methods}
    return bool(bases & set(PROTO)) and bases <= set(PROTO) | {"local"}


def epoch_plan(method: str, args) -> dict[str, int]:
    """Rounds, local epochs per round and fine-tuning epochs a method runs under (simulate's defaults unless
    given)."""
    from nvflare_jobs.profiles import PROTO_LOCAL_EPOCHS, PROTO_ROUNDS

    base = _base(method)
    method = split_variant(method)[0]
    proto = base in PROTO or (base == "local" and getattr(args, "proto_protocol", False))
    rounds = 1 if base == "ohfl" else (args.rounds or (PROTO_ROUNDS if proto else 3))
    local = args.local_epochs if args.local_epochs is not None else (
        20 if base == "ohfl" else PROTO_LOCAL_EPOCHS if proto else 2)
    if base == "local" and not proto and args.rounds is None and args.local_epochs is None:
        rounds, local = 1, 20  # Local = each site's own model trained as in OHFL's local phase (20 epochs)
    ft = args.finetune_epochs if args.finetune_epochs is not None else 10
    if method == "local+ft":  # Local's whole budget in one run plus OHFL's fine-tuning epochs (= OHFL's total)
        rounds, local = 1, rounds * local + ft
    plan = {"rounds": rounds, "local_epochs": local, "finetune_epochs": ft if base == "ohfl" else 0}
    plan["total_epochs_per_site"] = plan["rounds"] * plan["local_epochs"] + plan["finetune_epochs"]
    return plan


def _subset(records: list[dict], n: int | None) -> list[dict]:
    from nvflare_jobs.evaluation import _subset as sub

    return sub(sorted(records, key=lambda r: r["path"]), n)


def prepare_partition(data: Path, seed_dir: Path, args) -> Path:
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition

    part = seed_dir / "partition"
    if (part / "partition.json").is_file():
        return part
    records, report = scan_dataset(data, labels=args.labels)
    records = _subset(records, args.max_images)
    seed = int(seed_dir.name.removeprefix("seed"))
    res = partition_records(records, args.sites, args.scheme, alpha=args.alpha, seed=seed,
                            class_names=CLASS_NAMES[args.labels])
    write_partition(res, part)
    (part / "scan_report.json").write_text(json.dumps(report, indent=1, default=str))
    return part


def simulate_argv(method: str, run_dir: Path, profile: Path, data: Path, seed: int, args) -> list[str]:
    plan = epoch_plan(method, args)
    base = _base(method)
    argv = ["simulate", "--method", base, "--profile", str(profile), "--data", str(data), "--labels", args.labels,
            "--seed", str(seed), "--out", str(run_dir), "--overwrite", "--local-epochs", str(plan["local_epochs"])]
    if base != "ohfl":
        argv += ["--rounds", str(plan["rounds"])]
    else:
        argv += ["--finetune-epochs", str(plan["finetune_epochs"])]
    if args.max_train_images:
        argv += ["--max-train-images", str(args.max_train_images)]
    if args.batch_size:
        argv += ["--batch-size", str(args.batch_size)]
    return argv + split_variant(method)[1]


def _input_sizes(args) -> list[int]:
    if getattr(args, "input_sizes", None):
        return [int(x) for x in args.input_sizes.split(",")]
    if getattr(args, "proto_protocol", False):
        from nvflare_jobs.profiles import PROTO_TRAINING

        return [PROTO_TRAINING["input_size"]]
    return [64, 96, 128]


def write_method_profile(part: Path, run_dir: Path, method: str, seed: int, args) -> Path:
    from nvflare_jobs.profiles import write_profile

    base = _base(method)
    plan = epoch_plan(method, args)
    settings = {"batch_size": args.batch_size or 16, "local_epochs": plan["local_epochs"],
                "finetune_epochs": plan["finetune_epochs"] or 10, "seed": seed, "threads": 1,
                "max_train_images": args.max_train_images, "feature_dim": 64}
    proto = True if getattr(args, "proto_protocol", False) else None  # Local on the prototype methods' backbones
    return write_profile(part, run_dir / "site_configs", base, args.labels, _input_sizes(args), settings, proto=proto)


def run_compare(args) -> int:
    from nvflare_jobs.profiles import DataNotFoundError, resolve_data

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if split_variant(m)[0] not in METHODS]
    if bad or not methods:
        print(f"cxr-hfl compare: unknown method(s) {bad}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    args.proto_protocol = proto_protocol(methods)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = None
        if args.proto_protocol and not args.data:  # issue 16: chest_xray_224's tuning + probe parts
            from nvflare_jobs.profiles import proto_training_data

            data = proto_training_data(out / "data_pool.csv")
        data = data or resolve_data(args.data)
    except DataNotFoundError as e:
        print(f"cxr-hfl compare: {e}", file=sys.stderr)
        return 2
    plans = {m: epoch_plan(m, args) for m in methods}
    prev = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    (out / "compare.json").write_text(json.dumps({"command": prev.get("command", " ".join(sys.argv)),
                                                  "resumed_by": prev.get("resumed_by", []) + ([" ".join(sys.argv)]
                                                                                              if prev else []),
                                                  "data": str(data),
                                                  "methods": methods, "seeds": args.seeds, "sites": args.sites,
                                                  "scheme": args.scheme, "labels": args.labels,
                                                  "epoch_plan": plans}, indent=1))
    failed = []
    for seed in args.seeds:
        seed_dir = out / f"seed{seed}"
        part = prepare_partition(data, seed_dir, args)
        for m in methods:
            run_dir = seed_dir / m
            if (run_dir / "metrics.json").is_file():
                print(f"[compare] seed {seed} {m}: done already, skipped")
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            profile = write_method_profile(part, run_dir, m, seed, args)
            argv = simulate_argv(m, run_dir, profile, data, seed, args)
            print(f"[compare] seed {seed} {m}: cxr-hfl {' '.join(argv)}", flush=True)
            if args.dry_run:
                continue
            t0 = time.perf_counter()
            with open(run_dir / "simulate.log", "w") as log:
                rc = subprocess.call([sys.executable, "-m", "nvflare_jobs.cli", *argv], stdout=log,
                                     stderr=subprocess.STDOUT)
            ok = (run_dir / "metrics.json").is_file()
            if ok and m != _base(m):  # the run folder says which control / variant it is
                met = json.loads((run_dir / "metrics.json").read_text())
                met["method"] = m
                met["compare_plan"] = plans[m]
                (run_dir / "metrics.json").write_text(json.dumps(met, indent=1))
            print(f"[compare] seed {seed} {m}: rc={rc} in {time.perf_counter() - t0:.0f} s"
                  + ("" if ok else f" FAILED, see {run_dir / 'simulate.log'}"), flush=True)
            if not ok:
                failed.append(f"{m}/seed{seed}")
    if args.dry_run:
        return 0
    rows = write_tables(out, plans)
    print(f"[compare] {len(rows)} rows -> {out / 'comparison.csv'}, {out / 'comparison.md'}")
    if args.proto_protocol:
        from nvflare_jobs.proto_eval import write_section

        try:
            summary = write_section(out, _order(methods))
        except (FileNotFoundError, ValueError) as e:
            print(f"[compare] site models not scored on the evaluation part: {e}", file=sys.stderr)
        else:
            for m, v in summary["methods"].items():
                print(f"[compare] {m}: mean site balanced accuracy test {v['test_bal_acc']:.3f}, external "
                      f"{v['external_bal_acc']:.3f}; single-class sites {v['single_class_test']} (test) / "
                      f"{v['single_class_external']} (external); floor {'met' if v['floor_met'] else 'NOT met'}")
    if failed:
        print(f"[compare] failed runs (rerun the same command to retry them): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ tables
def _server_seconds(m: dict) -> float | None:
    s = m.get("server_seconds") or {}
    if isinstance(s, dict):
        if "total" in s:
            return float(s["total"])
        vals = [v for v in s.values() if isinstance(v, (int, float))]
        return float(sum(vals)) if vals else None
    return float(s) if isinstance(s, (int, float)) else None


def collect_runs(out: Path) -> list[tuple[str, int, dict]]:
    """``(method, seed, metrics)`` for every ``OUT/seed<k>/<method>/metrics.json``."""
    runs = []
    for f in sorted(Path(out).glob("seed*/*/metrics.json")):
        m = json.loads(f.read_text())
        seed = int(f.parent.parent.name.removeprefix("seed"))
        m["_run_dir"] = str(f.parent)
        runs.append((f.parent.name, seed, m))
    return runs


def val_threshold_metrics(run_dir: str | Path) -> dict[str, dict]:
    """Binary runs: each site's deployed model re-evaluated on its own test split at the decision threshold chosen
    (Youden's J) on its own validation split. Cached in ``RUN/val_threshold_metrics.json``; ``{}`` when the run has
    no deployed models or is not binary.

    Returns:
        ``{site: {"threshold", "n_val", "test": compute_metrics(..., threshold), "argmax_accuracy"}}``; the argmax
        accuracy is the reloaded model's and must equal the site's own reported accuracy.
    """
    import torch

    from chest_xray import make_site_dataset
    from hfl_components.training import choose_threshold, compute_metrics, predict_proba
    from nvflare_jobs.evaluation import load_model_file, site_rows

    run = Path(run_dir)
    cache = run / "val_threshold_metrics.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    met = json.loads((run / "metrics.json").read_text())
    out: dict[str, dict] = {}
    if met.get("labels") != "binary":
        return out
    rows = site_rows(run)
    for site in met.get("sites", {}):
        f = run / "models" / f"{site}_deployed.pt"
        if not f.is_file() or site not in rows:
            continue
        model, blob = load_model_file(f)
        size = int(blob.get("input_size") or met["sites"][site].get("input_size") or 64)
        probs = {}
        for split in ("val", "test"):
            part = [r for r in rows[site] if r["split"] == split]
            dl = torch.utils.data.DataLoader(make_site_dataset(part, size, "eval"), batch_size=64) if part else []
            probs[split] = predict_proba(model, dl)
        (pv, yv), (pt, yt) = probs["val"], probs["test"]
        if yt.size == 0:
            continue
        thr = choose_threshold(yv, pv[:, 1]) if yv.size else 0.5
        out[site] = {"threshold": thr, "n_val": int(yv.size), "test": compute_metrics(yt, pt, 2, threshold=thr),
                     "argmax_accuracy": compute_metrics(yt, pt, 2)["accuracy"]}
    cache.write_text(json.dumps(out, indent=1))
    return out


def comparison_rows(runs: list[tuple[str, int, dict]], thresholds: bool = True) -> list[dict[str, Any]]:
    """One row per (method, seed, site). Sensitivity/specificity: at the threshold chosen on the site's validation
    split (binary runs with saved models, ``thresholds=True``), else the argmax rule of the site's own metrics."""
    rows = []
    for method, seed, m in runs:
        vt = {}
        if thresholds and m.get("_run_dir"):
            try:
                vt = val_threshold_metrics(m["_run_dir"])
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                print(f"[compare] {method} seed {seed}: no validation thresholds ({e})")
        for site, b in m.get("sites", {}).items():
            t = dict(b.get("test") or {})
            if site in vt:
                t.update({k: vt[site]["test"][k] for k in ("sensitivity", "specificity", "threshold")})
            spec = b.get("model") or {}
            rows.append({"method": method, "seed": seed, "site": site,
                         "model": "/".join(str(spec[k]) for k in ("family", "depth") if spec.get(k)),
                         "input_size": b.get("input_size"), "n_test": b.get("n_test"),
                         **{k: t.get(k) for k in METRICS}, "threshold": t.get("threshold"), "wall_seconds": m.get("wall_time_s"),
                         "server_seconds": _server_seconds(m), "bytes_up": m.get("bytes_uploaded"),
                         "bytes_down": m.get("bytes_downloaded")})
    return rows


def _fmt(v, nd=3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _mean_std(vals: list) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "–"
    if len(v) == 1:
        return _fmt(v[0])
    return f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}"


def paired_diff(rows: list[dict], method: str, metric: str, ref: str = "local") -> dict[str, Any]:
    """Mean paired difference ``method - ref`` over matching (seed, site) pairs with a t-based 95% CI."""
    from scipy import stats

    a = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == method}
    b = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == ref}
    d = np.asarray([a[k] - b[k] for k in a if k in b and a[k] is not None and b[k] is not None], dtype=float)
    if d.size == 0:
        return {"n": 0, "mean": None, "ci_low": None, "ci_high": None}
    mean = float(d.mean())
    if d.size < 2:
        return {"n": 1, "mean": mean, "ci_low": None, "ci_high": None}
    half = float(stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    return {"n": int(d.size), "mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def write_tables(out: Path, plans: dict | None = None) -> list[dict]:
    """Write ``comparison.csv`` and ``comparison.md`` from the run folders under ``out``."""
    out = Path(out)
    runs = collect_runs(out)
    rows = comparison_rows(runs)
    with (out / "comparison.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (round(r[k], 4) if isinstance(r[k], float) else r[k]))
                        for k in COLUMNS})
    (out / "comparison.md").write_text(comparison_markdown(out, runs, rows, plans))
    return rows


def _order(methods) -> list[str]:
    def key(m):
        name = split_variant(m)[0]
        return (METHODS.index(name) if name in METHODS else 99, m)
    return sorted(set(methods), key=key)


def comparison_markdown(out: Path, runs, rows, plans: dict | None = None) -> str:
    if plans is None and (out / "compare.json").is_file():
        plans = json.loads((out / "compare.json").read_text()).get("epoch_plan")
    plans = plans or {}
    methods = _order(r["method"] for r in rows)
    seeds = sorted({r["seed"] for r in rows})
    sites = sorted({r["site"] for r in rows}, key=lambda s: (len(s), s))
    labels = {m.get("labels") for _, _, m in runs}
    L = ["# Method comparison", ""]
    if (out / "compare.json").is_file():
        cj = json.loads((out / "compare.json").read_text())
        L += [f"Command: `{cj.get('command')}`", "",
              f"Data: `{cj.get('data')}` · {cj.get('sites')} sites, scheme `{cj.get('scheme')}` · labels "
              f"`{cj.get('labels')}` · seeds {', '.join(map(str, cj.get('seeds', [])))}", ""]
    L += [f"Runs: {len(runs)} ({len(methods)} methods x {len(seeds)} seeds); label scheme(s): "
          f"{', '.join(sorted(x for x in labels if x))}. Every method ran on the identical partition per seed "
          "(`seed<k>/partition`).", ""]
    L += ["## Mean ± std per method", "",
          "Over all (seed, site) test sets. Sensitivity/specificity (binary labels) are at the decision threshold "
          "chosen (Youden's J) on each site's own validation split, never on test (`threshold` column of "
          "comparison.csv; empty = argmax rule); accuracy, balanced accuracy and AUC are the sites' own argmax "
          "metrics.", "",
          "| method | epochs/site | " + " | ".join(METRICS) + " | wall s | server s | bytes up | bytes down |",
          "|---|---|" + "---|" * (len(METRICS) + 4)]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        runs_m = {(r["seed"]): r for r in rs}
        plan = plans.get(m, {})
        ep = plan.get("total_epochs_per_site", "–")
        L.append(f"| {m} | {ep} | " + " | ".join(_mean_std([r[k] for r in rs]) for k in METRICS) + " | "
                 + " | ".join(_mean_std([r[k] for r in runs_m.values()]) if k.endswith("seconds") else
                              f"{np.mean([r[k] or 0 for r in runs_m.values()]):,.0f}"
                              for k in ("wall_seconds", "server_seconds", "bytes_up", "bytes_down")) + " |")
    L += ["", "## Pooled test metrics with 95% bootstrap CI", "",
          "| method | seed | n | accuracy | balanced accuracy | AUC |", "|---|---|---|---|---|---|"]
    for method, seed, m in sorted(runs, key=lambda x: (_order([r[0] for r in runs]).index(x[0]), x[1])):
        p = m.get("pooled") or {}

        def ci(k):
            v = p.get(k) or {}
            if v.get("value") is None:
                return "–"
            return f"{v['value']:.3f} ({_fmt(v.get('ci_low'))}–{_fmt(v.get('ci_high'))})"
        L.append(f"| {method} | {seed} | {p.get('n', '–')} | {ci('accuracy')} | {ci('balanced_accuracy')} | "
                 f"{ci('auc')} |")
    for metric in ("accuracy", "balanced_accuracy", "auc"):
        L += ["", f"## Per-site {metric.replace('_', ' ')} (mean over seeds)", "",
              "| method | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
        for m in methods:
            cells = []
            for s in sites:
                v = [r[metric] for r in rows if r["method"] == m and r["site"] == s and r[metric] is not None]
                cells.append(_fmt(float(np.mean(v))) if v else "–")
            L.append(f"| {m} | " + " | ".join(cells) + " |")
    if "local" in methods and len(methods) > 1:
        L += ["", "## Paired difference vs Local", "",
              "Mean of (method − Local) over matching (seed, site) test sets, 95% t-interval.", "",
              "| method | pairs | Δ accuracy | Δ balanced accuracy | Δ AUC |", "|---|---|---|---|---|"]
        for m in methods:
            if m == "local":
                continue
            cells = []
            n = 0
            for k in ("accuracy", "balanced_accuracy", "auc"):
                d = paired_diff(rows, m, k)
                n = max(n, d["n"])
                cells.append("–" if d["mean"] is None else
                             f"{d['mean']:+.3f}" + (f" ({d['ci_low']:+.3f} to {d['ci_high']:+.3f})"
                                                    if d["ci_low"] is not None else ""))
            L.append(f"| {m} | {n} | " + " | ".join(cells) + " |")
    L += ["", "## Notes", ""]
    if "fedavg" in methods:
        L.append("- FedAvg runs under its own rule: every site trains the deepest architecture (one shared model), "
                 "so its sites do not keep their own depth/width as under Local, local+ft and OHFL.")
    if "local+ft" in methods:
        L.append("- `local+ft` is the compute-matched control: each site's local model trained for Local's epochs "
                 "plus as many extra epochs as OHFL's fine-tuning (one round of rounds x local_epochs + "
                 "finetune_epochs).")
    for m in methods:
        if m in plans:
            p = plans[m]
            L.append(f"- {m}: {p['rounds']} round(s) x {p['local_epochs']} local epochs"
                     + (f" + {p['finetune_epochs']} fine-tuning epochs" if p.get("finetune_epochs") else "")
                     + f" = {p['total_epochs_per_site']} epochs per site.")
    L.append("- With few test images per site the per-site numbers are noisy; read the pooled CIs and the paired "
             "intervals before ranking methods.")
    return "\n".join(L) + "\n"
