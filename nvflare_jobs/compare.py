"""``cxr-hfl compare``: every method on the identical partition, label scheme and seeds, at an equal epoch budget;
comparison tables, optionally on an external evaluation set with paired bootstrap CIs.

Layout of ``OUT``::

    OUT/seed<k>/partition/          one partition per seed (scanned and split once, reused by every method)
    OUT/seed<k>/<method>/           a run folder written by ``cxr-hfl simulate --profile`` (metrics.json, models...)
    OUT/seed<k>/<method>/external/<name>/   with --external: ``cxr-hfl evaluate`` of every saved model of the run
    OUT/comparison.csv              one row per (method, seed, site): the sites' own test splits
    OUT/comparison_external.csv     with --external: one row per (method, seed, model) on the external set
    OUT/comparison.md               budget, mean +- std, pooled CIs, per-site tables, paired differences
    OUT/compare.json                the command that ran (dry runs apart) and the epoch budget of every method

**Equal budgets (default).** Every method trains the same number of epochs per site, E = OHFL's local epochs +
fine-tuning epochs (``--local-epochs`` L, default 20, ``--finetune-epochs`` F, default 10): Local (and ``local+ft``,
the same control under equal budgets) trains one run of E epochs; FedAvg and the prototype methods run R rounds of
E / R local epochs (``--rounds`` R must divide E; default 2 epochs per round for FedAvg, 3 for the prototype
methods, or the largest divisor of E below that); OHFL trains L local epochs, fuses, and fine-tunes F epochs.
``--unequal-budgets`` restores each method's own defaults (``--rounds`` and ``--local-epochs`` are then passed
through as they are), and the budget table says so.

**External evaluation.** ``--external DIR`` (optionally ``--part evaluation`` of ``chest_xray_224``) evaluates every
saved model of every run (each site's deployed and, for OHFL, pre-fusion local model, and the global model at each
site's size) with :func:`nvflare_jobs.evaluation.evaluate_run`, which leaves out the OHFL probe pool. The
endpoints are each site's deployed-model AUC and balanced accuracy on that set; the paired differences (same seed,
same site) against ``local+ft`` and against FedAvg carry 95% intervals with seeds as clusters and one shared image
draw (:func:`hfl_components.stats.paired_crossed`) and, from :data:`hfl_components.stats.MIN_SEEDS` seeds on, a
verdict; the deployed models' AUC against local+ft is the primary endpoint, every other verdict exploratory.

A method may carry extra ``simulate`` options as a variant, ``ohfl:strategy=cdd`` (benchmarks use this).
Resumable: a run whose ``metrics.json`` exists is not run again, nor an external evaluation already written.
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

from hfl_components.flare.catalogue import METHODS as _CATALOGUE_METHODS
from hfl_components.flare.catalogue import PROTOTYPE_METHODS

# the method catalogue's methods, plus the local+ft control (Local's budget plus OHFL's fine-tuning) after Local
METHODS = ("local", "local+ft", *(m for m in _CATALOGUE_METHODS if m != "local"))
PROTO = PROTOTYPE_METHODS
COLUMNS = ["method", "seed", "site", "model", "input_size", "n_test", "accuracy", "balanced_accuracy", "auc",
           "sensitivity", "specificity", "threshold", "deploy_rule", "deployed_round", "wall_seconds", "server_seconds",
           "bytes_up", "bytes_down"]
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


def check_variant(method: str, args=None) -> str | None:
    """Why the method variant ``method`` (e.g. ``ohfl:repair=foo``) would be refused by ``cxr-hfl simulate``, as one
    line naming the variant and the option, or None when its options parse and pass ``catalogue.validate_options``
    (the same checks ``simulate`` runs before anything starts), so a bad variant is refused before any run. With
    the compare ``args``, the whole command line compare would give ``simulate`` is checked (epochs included, e.g.
    ``ohfl:paper`` against the equal budget's fine-tuning epochs)."""
    import argparse
    import contextlib
    import io

    from nvflare_jobs.commands import simulate

    name, extra = split_variant(method)
    if not extra and args is None:
        return None

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    p = _Parser(prog="cxr-hfl simulate", add_help=False)
    simulate._add_method_args(p)
    p.add_argument("--out")
    p.add_argument("--overwrite", action="store_true")
    argv = ["--method", "local" if name == "local+ft" else name, *extra]
    if args is not None:
        try:
            argv = simulate_argv(method, Path("RUN"), Path("PROFILE"), Path("DATA"), 0, args)[1:]
        except BudgetError:  # refused with its own message once the budgets are planned
            pass
    try:
        a = p.parse_args(argv)
        with contextlib.redirect_stderr(io.StringIO()):  # warnings are printed again when the run starts
            simulate._defaults(a)
    except ValueError as e:
        return f"{'variant ' if extra else ''}{method}: {e}"
    except SystemExit as e:
        return f"{'variant ' if extra else ''}{method}: {str(e.code).removeprefix('cxr-hfl: ')}"
    return None


def _base(method: str) -> str:
    name = split_variant(method)[0]
    return "local" if name == "local+ft" else name


def proto_protocol(methods: list[str]) -> bool:
    """True when the methods are prototype methods, with or without Local (the prototype-method protocol): sites from
    ``chest_xray_224``'s tuning + probe parts (unless --data), Local on the same heterogeneous backbones and
    training defaults at the same rounds x local epochs, and the site models scored on the evaluation part."""
    bases = {_base(m) for m in methods}
    return bool(bases & set(PROTO)) and bases <= set(PROTO) | {"local"}


class BudgetError(ValueError):
    """The requested rounds cannot split the common epoch budget evenly."""


def _divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


def epoch_plan(method: str, args) -> dict[str, int]:
    """Rounds, local epochs per round and fine-tuning epochs a method runs under.

    Equal budgets (default, ``args.unequal_budgets`` false): E = L + F with L = ``args.local_epochs`` (default 20)
    and F = ``args.finetune_epochs`` (default 10) -- OHFL: L local + F fine-tuning epochs; local and local+ft: one
    round of E epochs; round-based methods: R rounds of E / R epochs (R = ``args.rounds``, which must divide E;
    default 2 epochs per round for FedAvg, 3 for prototype methods, or the largest divisor of E below that).
    Unequal budgets: each method's own defaults (simulate's), ``--rounds`` / ``--local-epochs`` passed through;
    local+ft = Local's budget plus F extra epochs.

    Returns:
        ``{"rounds", "local_epochs", "finetune_epochs", "total_epochs_per_site"}``.

    Prototype-method comparisons (``args.proto_protocol``, :func:`proto_protocol`): every method, Local included,
    runs the prototype methods' default rounds x local epochs (``--rounds`` / ``--local-epochs`` override).

    Raises:
        BudgetError: ``args.rounds`` does not divide E (equal budgets).
    """
    base = _base(method)
    method = split_variant(method)[0]
    from hfl_components.flare.catalogue import method_defaults

    if getattr(args, "proto_protocol", False):  # every method at the prototype methods' rounds x epochs
        d = method_defaults(PROTO[0])
        plan = {"rounds": args.rounds or d["rounds"],
                "local_epochs": args.local_epochs if args.local_epochs is not None else d["local_epochs"],
                "finetune_epochs": 0}
        plan["total_epochs_per_site"] = plan["rounds"] * plan["local_epochs"]
        return plan

    ohfl = method_defaults("ohfl")
    ft_given = args.finetune_epochs if args.finetune_epochs is not None else ohfl["finetune_epochs"]
    if not getattr(args, "unequal_budgets", False):
        L = args.local_epochs if args.local_epochs is not None else ohfl["local_epochs"]
        E = L + ft_given
        if base == "ohfl":
            rounds, local, ft = 1, L, ft_given
        elif base == "local":
            rounds, local, ft = 1, E, 0
        else:
            if args.rounds:
                if E % args.rounds:
                    raise BudgetError(f"--rounds {args.rounds} does not divide the common budget of {E} epochs per "
                                      f"site (--local-epochs {L} + --finetune-epochs {ft_given}); choose rounds that "
                                      "divide it, or pass --unequal-budgets")
                rounds = args.rounds
            else:
                rounds = E // _divisor_at_most(E, 3 if base in PROTO else 2)
            local, ft = E // rounds, 0
    else:
        d = method_defaults(base)
        rounds = 1 if base == "ohfl" else (args.rounds or d["rounds"])
        local = args.local_epochs if args.local_epochs is not None else d["local_epochs"]
        if base == "local" and args.rounds is None and args.local_epochs is None:
            rounds, local = 1, 20  # Local = each site's own model trained as in OHFL's local phase (20 epochs)
        if method == "local+ft":  # Local's whole budget in one run plus OHFL's fine-tuning epochs (= OHFL's total)
            rounds, local = 1, rounds * local + ft_given
        ft = ft_given if base == "ohfl" else 0
    plan = {"rounds": rounds, "local_epochs": local, "finetune_epochs": ft}
    plan["total_epochs_per_site"] = plan["rounds"] * plan["local_epochs"] + plan["finetune_epochs"]
    return plan


def budget_lines(plans: dict[str, dict], unequal: bool) -> list[str]:
    """Human-readable budget: one line per method, and whether the budgets are equal."""
    totals = {p["total_epochs_per_site"] for p in plans.values()}
    head = (f"equal budgets: every method trains {totals.pop()} epochs per site" if len(totals) == 1 else
            "UNEQUAL budgets (--unequal-budgets): epochs per site differ between methods")
    if not unequal and len({p["total_epochs_per_site"] for p in plans.values()}) > 1:
        head = "budgets differ between methods"
    lines = [head]
    for m, p in plans.items():
        lines.append(f"{m}: {p['rounds']} round(s) x {p['local_epochs']} local epochs"
                     + (f" + {p['finetune_epochs']} fine-tuning epochs" if p.get("finetune_epochs") else "")
                     + f" = {p['total_epochs_per_site']} epochs per site")
    return lines


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
    from nvflare_jobs.profiles import PROTO_MIN_EVAL_PER_CLASS

    res = partition_records(records, args.sites, args.scheme, alpha=args.alpha, seed=seed,
                            class_names=CLASS_NAMES[args.labels],
                            min_eval_per_class=PROTO_MIN_EVAL_PER_CLASS if getattr(args, "proto_protocol", False)
                            else 0)
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
    if getattr(args, "late_wait", None) is not None:
        argv += ["--late-wait", str(args.late_wait)]
    extra = split_variant(method)[1]
    probe = getattr(args, "probe", None)
    if base == "ohfl" and probe and "--probe" not in extra:
        argv += ["--probe", str(probe)]
    return argv + extra


def probe_part_csv(data: Path, out: Path) -> Path | None:
    """When the sites come from ``chest_xray_original`` and its sibling ``chest_xray_224`` exists, write the
    committed ``probe`` part of ``chest_xray_224`` as ``OUT/probe_part.csv`` (absolute paths) for every OHFL run, so
    the server's probe never touches the tuning or evaluation parts. None otherwise."""
    from chest_xray.splits import POOL, split_rows

    pool = data.parent / POOL
    if data.name != "chest_xray_original" or not pool.is_dir():
        return None
    dest = out / "probe_part.csv"
    with dest.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["path", "label"])
        w.writerows([str((pool / r["path"]).resolve()), r["label"]] for r in split_rows("probe"))
    return dest


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


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``cxr-hfl <args>`` (shell-quoted)."""
    import shlex

    argv = sys.argv[1:] if argv is None else argv
    return "cxr-hfl " + " ".join(shlex.quote(a) for a in argv)


def record_command(out: Path, cmd: str, dry_run: bool, info: dict) -> dict:
    """Write ``OUT/compare.json``: ``command`` is the first command that actually ran (a ``--dry-run`` is listed
    under ``dry_runs`` and never becomes the command), later real runs under ``resumed_by``."""
    f = out / "compare.json"
    prev = json.loads(f.read_text()) if f.is_file() else {}
    rec = {**prev, **info, "command": prev.get("command"), "dry_runs": prev.get("dry_runs", []),
           "resumed_by": prev.get("resumed_by", [])}
    if prev and "dry_runs" not in prev and "--dry-run" in (prev.get("command") or ""):
        rec["command"] = None  # written by an older version that recorded a dry run as the command
    if dry_run:
        rec["dry_runs"] = rec["dry_runs"] + [cmd]
        rec.update({k: prev[k] for k in info if k in prev})  # a dry run changes nothing the real run recorded
    elif rec["command"] is None:
        rec["command"] = cmd
    else:
        rec["resumed_by"] = rec["resumed_by"] + [cmd]
    f.write_text(json.dumps(rec, indent=1))
    return rec


def run_compare(args) -> int:
    from nvflare_jobs.profiles import DataNotFoundError, resolve_data

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if split_variant(m)[0] not in METHODS]
    if bad or not methods:
        print(f"cxr-hfl compare: unknown method(s) {bad}; choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    for m in methods:
        why = check_variant(m, args)
        if why:
            print(f"cxr-hfl compare: {why}", file=sys.stderr)
            return 2
    args.proto_protocol = proto_protocol(methods)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unequal = bool(getattr(args, "unequal_budgets", False))
    if not unequal and "local" in methods and "local+ft" in methods:
        methods.remove("local+ft")
        print("[compare] equal budgets: local+ft is the same run as local (E epochs); running local once, reported "
              "as the local+ft control")
    try:
        plans = {m: epoch_plan(m, args) for m in methods}
    except BudgetError as e:
        print(f"cxr-hfl compare: {e}", file=sys.stderr)
        return 2
    try:
        data = None
        if args.proto_protocol and not args.data:  # chest_xray_224's tuning + probe parts
            from nvflare_jobs.profiles import proto_training_data

            data = proto_training_data(out / "data_pool.csv")
        data = data or resolve_data(args.data)
    except DataNotFoundError as e:
        print(f"cxr-hfl compare: {e}", file=sys.stderr)
        return 2
    ext = getattr(args, "external", None)
    if ext and not Path(ext).exists():
        print(f"cxr-hfl compare: no external data at {ext}", file=sys.stderr)
        return 2
    if getattr(args, "part", None) and not ext:
        print("cxr-hfl compare: --part needs --external (the chest_xray_224 root)", file=sys.stderr)
        return 2
    prev = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if prev:
        done = len(list(out.glob("seed*/*/metrics.json")))
        print(f"[compare] {out} holds an earlier comparison ({done} finished run(s)): resuming -- finished runs are "
              f"kept, unfinished ones are run again. To replace it instead, delete {out} or choose another --out.",
              flush=True)
    for line in budget_lines(plans, unequal):
        print(f"[compare] budget: {line}")
    if not getattr(args, "probe", None) and any(_base(m) == "ohfl" for m in methods):
        args.probe = probe_part_csv(data, out)
        if args.probe:
            print(f"[compare] OHFL probe: the committed probe part of chest_xray_224 ({args.probe})")
    record_command(out, command_line(getattr(args, "_argv", None)), args.dry_run, {
        "data": str(data), "methods": methods, "seeds": args.seeds, "sites": args.sites, "scheme": args.scheme,
        "labels": args.labels, "epoch_plan": plans, "unequal_budgets": unequal,
        "external": str(Path(ext).resolve()) if ext else None, "part": getattr(args, "part", None),
        "probe": str(args.probe) if getattr(args, "probe", None) else None})
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
        if ext:
            print(f"[compare] then: every saved model of every run evaluated on {ext}"
                  + (f" (part {args.part})" if getattr(args, "part", None) else ""))
        return 0
    if ext:
        failed += evaluate_external(out, ext, getattr(args, "part", None), getattr(args, "external_max_images", None),
                                    args.labels)
    rows = write_tables(out, plans, n_boot=getattr(args, "n_boot", 1000))
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


def evaluate_external(out: Path, data: str | Path, part: str | None, max_images: int | None,
                      labels: str) -> list[str]:
    """``cxr-hfl evaluate`` of every run under ``out`` on ``data`` (skipping runs already evaluated on it with the
    same image cap). Returns the runs that could not be evaluated."""
    from nvflare_jobs.evaluation import LeakageError, evaluate_run, external_name

    name = external_name(data, part)
    failed = []
    for method, seed, m in collect_runs(out):
        run = Path(m["_run_dir"])
        summ = run / "external" / name / "summary.json"
        if summ.is_file() and json.loads(summ.read_text()).get("max_images") == max_images:
            continue
        t0 = time.perf_counter()
        try:
            res = evaluate_run(run, data, labels, max_images=max_images, part=part, n_boot=0, log=lambda *_: None)
        except (LeakageError, FileNotFoundError, ValueError) as e:
            print(f"[compare] seed {seed} {method}: external evaluation FAILED: {e}", file=sys.stderr)
            failed.append(f"{method}/seed{seed} (external)")
            continue
        s = json.loads(res["summary"].read_text())
        s["max_images"] = max_images
        res["summary"].write_text(json.dumps(s, indent=1))
        print(f"[compare] seed {seed} {method}: {len(res['models'])} models evaluated on {res['n_images']} external "
              f"images ({res['probe_images_excluded']} probe images left out) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return failed


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
    split (binary runs with saved models, ``thresholds=True``), else the argmax rule of the site's own metrics.
    ``deploy_rule`` / ``deployed_round``: which model the site deployed (``metrics.json`` ``sites.<site>.deploy``,
    e.g. ``best_val`` and the round chosen on its validation split; empty for runs that did not record it)."""
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
                         **{k: t.get(k) for k in METRICS}, "threshold": t.get("threshold"),
                         "deploy_rule": (b.get("deploy") or {}).get("rule"),
                         "deployed_round": (b.get("deploy") or {}).get("round"), "wall_seconds": m.get("wall_time_s"),
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
    """Paired difference ``method - ref`` over matching (seed, site) rows (one metric value per site test split):
    :func:`hfl_components.stats.paired_summaries` (seeds as clusters, seed-level t-interval); ``n`` = pairs."""
    from hfl_components.stats import paired_summaries

    a = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == method}
    b = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == ref}
    d = paired_summaries(a, b, metric)
    return {**d, "n": d["n_pairs"], "mean": d["diff"]}


def _write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    """Write ``rows`` as a CSV with ``columns``: None as empty, floats rounded to 4 decimals."""
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (round(r[k], 4) if isinstance(r[k], float) else r[k]))
                        for k in columns})


def write_tables(out: Path, plans: dict | None = None, n_boot: int = 1000) -> list[dict]:
    """Write ``comparison.csv`` and ``comparison.md`` (and, after an external evaluation,
    ``comparison_external.csv`` and ``paired_external.json``) from the run folders under ``out``."""
    out = Path(out)
    runs = collect_runs(out)
    rows = comparison_rows(runs)
    _write_csv(out / "comparison.csv", rows, COLUMNS)
    ext = external_tables(out, runs, n_boot=n_boot)
    (out / "comparison.md").write_text(comparison_markdown(out, runs, rows, plans, ext))
    return rows


# ------------------------------------------------------------------------------------------------ external
EXT_COLUMNS = ["method", "seed", "model", "kind", "site", "input_size", "n", "auc", "balanced_accuracy", "accuracy",
               "sensitivity", "specificity"]


def _external_name(out: Path) -> tuple[str | None, dict]:
    from nvflare_jobs.evaluation import external_name

    cj = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if not cj.get("external"):
        return None, cj
    return external_name(cj["external"], cj.get("part")), cj


def control_method(methods, cj: dict) -> str | None:
    """The local+ft control among ``methods``: ``local+ft``, or under equal budgets ``local`` (the same run)."""
    if "local+ft" in methods:
        return "local+ft"
    if "local" in methods and not cj.get("unequal_budgets"):
        return "local"
    return None


def _paired_arrays(runs_by: dict, ma: str, mb: str, name: str, kind_a: str = "deployed", kind_b: str = "deployed"):
    """(y, A (S, K, N), B (S, K, N), seeds, sites) of the pneumonia-vs-normal scores of matching (seed, site) models
    on the images both methods' evaluations share; None when nothing pairs."""
    seeds = sorted(s for (m, s) in runs_by if m == ma and (mb, s) in runs_by)
    if not seeds:
        return None
    npz = {}
    for s in seeds:
        for m in (ma, mb):
            f = Path(runs_by[(m, s)]) / "external" / name / "predictions.npz"
            if not f.is_file():
                return None
            npz[(m, s)] = dict(np.load(f))
    sites = sorted({k.rsplit("_", 1)[0] for k in npz[(ma, seeds[0])] if k.endswith(f"_{kind_a}")}
                   & {k.rsplit("_", 1)[0] for k in npz[(mb, seeds[0])] if k.endswith(f"_{kind_b}")},
                   key=lambda x: (len(x), x))
    if not sites:
        return None
    common = set.intersection(*[set(d["paths"].tolist()) for d in npz.values()])
    paths = sorted(common)
    if not paths:
        return None
    ref = npz[(ma, seeds[0])]
    pos = {p: i for i, p in enumerate(ref["paths"].tolist())}
    y = (ref["y"][[pos[p] for p in paths]] > 0).astype(np.int64)

    def stack(m, kind):
        arr = []
        for s in seeds:
            d = npz[(m, s)]
            ix = {p: i for i, p in enumerate(d["paths"].tolist())}
            idx = [ix[p] for p in paths]
            arr.append([1.0 - d[f"{site}_{kind}"][idx, 0] for site in sites])
        return np.asarray(arr, dtype=np.float64)
    return y, stack(ma, kind_a), stack(mb, kind_b), seeds, sites


def external_tables(out: Path, runs, n_boot: int = 1000) -> dict | None:
    """Rows of every run's external evaluation (``comparison_external.csv``) and the paired differences of the
    deployed models against the local+ft control and FedAvg (``paired_external.json``). None without one."""
    from hfl_components.stats import PAIRED_METRICS, paired_crossed

    name, cj = _external_name(out)
    if not name:
        return None
    rows, runs_by, summaries = [], {}, {}
    for method, seed, m in runs:
        f = Path(m["_run_dir"]) / "external" / name / "summary.json"
        if not f.is_file():
            continue
        summ = json.loads(f.read_text())
        runs_by[(method, seed)] = m["_run_dir"]
        summaries[(method, seed)] = summ
        for model, v in summ["models"].items():
            rows.append({"method": method, "seed": seed, "model": model, "kind": v.get("kind"), "site": v.get("site"),
                         "input_size": v.get("input_size"), "n": summ.get("n_images"),
                         **{k: v.get(k) for k in EXT_COLUMNS[7:]}})
    if not rows:
        return None
    _write_csv(out / "comparison_external.csv", rows, EXT_COLUMNS)
    methods = _order({m for m, _ in runs_by})
    control = control_method(methods, cj)
    pairs = []
    for ref, label in ((control, "local+ft"), ("fedavg" if "fedavg" in methods else None, "FedAvg")):
        if not ref:
            continue
        for m in methods:
            if m != ref and not (label == "FedAvg" and m == control):
                pairs.append((m, "deployed", ref, "deployed", f"{m} vs {label}" + (" (local, same E epochs)"
                                                                                  if ref == "local" else "")))
    for m in methods:
        if _base(m) == "ohfl":
            pairs.append((m, "deployed", m, "local", f"{m} deployed vs its own pre-fusion local models"))
    # the primary endpoint: the main job's deployed models' AUC against local+ft (every other verdict exploratory)
    primary = next(((m, "deployed", control, "deployed") for m in sorted(methods, key=lambda m: m != "ohfl")
                    if _base(m) == "ohfl" and control), None)
    paired = []
    for ma, ka, mb, kb, label in pairs:
        arr = _paired_arrays(runs_by, ma, mb, name, ka, kb)
        if arr is None:
            continue
        y, A, B, seeds, sites = arr
        if len(set(y.tolist())) < 2:
            continue
        res = {"comparison": label, "a": ma, "b": mb, "kind_a": ka, "kind_b": kb, "seeds": seeds, "sites": sites,
               "primary": "auc" if (ma, ka, mb, kb) == primary else None}
        for metric in PAIRED_METRICS:
            res[metric] = paired_crossed(y, A, B, metric, n_boot=n_boot, seed=0, seeds=seeds)
        paired.append(res)
    first = next(iter(summaries.values()))
    info = {"name": name, "data": first.get("data"), "part": first.get("part"),
            "n_images": sorted({v.get("n_images") for v in summaries.values()}),
            "probe_images_excluded": sorted({v.get("probe_images_excluded", 0) for v in summaries.values()}),
            "control": control, "n_boot": n_boot, "paired": paired}
    (out / "paired_external.json").write_text(json.dumps(info, indent=1))
    return {**info, "rows": rows}


# The fusion targets for the main job (3 seeds, external evaluation part), checked on every compare with OHFL.
GLOBAL_AUC_TARGET = 0.75   # the fused global model's zero-shot mean AUC
STRETCH_GAP = 0.05         # stretch: global within this of its parents' (pre-fusion local models') mean AUC


def load_external(out: Path) -> dict | None:
    """The external evaluation tables compare wrote (``comparison_external.csv``, ``paired_external.json``) as
    ``{"rows": [...], "paired": [...], ...}`` with numbers as floats; None when either file is missing."""
    out = Path(out)
    f_rows, f_pair = out / "comparison_external.csv", out / "paired_external.json"
    if not (f_rows.is_file() and f_pair.is_file()):
        return None
    rows = []
    with f_rows.open(newline="") as fh:
        for r in csv.DictReader(fh):
            for k in EXT_COLUMNS[7:]:
                r[k] = float(r[k]) if r.get(k) not in (None, "") else None
            r["seed"] = int(r["seed"])
            rows.append(r)
    return {**json.loads(f_pair.read_text()), "rows": rows}


def ohfl_targets(ext: dict, method: str = "ohfl") -> list[dict]:
    """The fusion targets for ``method`` (the main job) from an external evaluation (:func:`external_tables` or
    :func:`load_external`): one ``{"target", "value", "met"}`` per target, ``met`` True/False, or None for a number
    reported without a threshold (the verdict against FedAvg). ``[]`` when ``method`` has no external rows.

    Targets: (1) the global model's zero-shot AUC (site input sizes averaged), mean over seeds, >= 0.75;
    (2) stretch: within 0.05 of the pre-fusion local models' mean; (3) the deployed models' mean AUC >= the
    pre-fusion local models' mean; (4) the deployed models are not worse than local+ft, for AUC and for balanced
    accuracy: non-inferiority, the interval's lower bound above minus the margin of
    :data:`hfl_components.stats.MARGINS` (with fewer than :data:`hfl_components.stats.MIN_SEEDS` seeds there is no
    verdict and the target is not met; without a local+ft control in the comparison: one row "not measured", not
    met, rather than no row and "All targets met"); (5) the paired verdict against FedAvg, reported as it is.
    """
    from hfl_components.stats import MARGINS, paired_cell, verdict_cell

    rows = [r for r in ext.get("rows", []) if r["method"] == method]
    if not rows:
        return []
    seeds = sorted({r["seed"] for r in rows})

    def mean(kind, model=None):
        v = [r["auc"] for r in rows if r["kind"] == kind and (model is None or r["model"] == model)
             and r["auc"] is not None]
        return (float(np.mean(v)), len(v)) if v else (None, 0)

    per_seed = {s: next((r["auc"] for r in rows if r["seed"] == s and r["model"] == "global"), None) for s in seeds}
    g, _ = mean("global", "global")
    loc, n_loc = mean("local")
    dep, n_dep = mean("deployed")
    out = []
    if g is not None:
        seeds_txt = ", ".join(f"seed {s} {'–' if v is None else f'{v:.3f}'}" for s, v in per_seed.items())
        out.append({"target": f"global model zero-shot mean AUC >= {GLOBAL_AUC_TARGET}",
                    "value": f"{g:.3f} over {len(seeds)} seed(s) ({seeds_txt})", "met": g >= GLOBAL_AUC_TARGET})
        if loc is not None:
            out.append({"target": f"stretch: global within {STRETCH_GAP} of its parents' mean AUC",
                        "value": f"{g:.3f} vs {loc:.3f} (gap {g - loc:+.3f})", "met": g >= loc - STRETCH_GAP})
    if dep is not None and loc is not None:
        out.append({"target": "deployed models' mean AUC >= the pre-fusion local models' mean",
                    "value": f"{dep:.3f} ({n_dep} models) vs {loc:.3f} ({n_loc} models)", "met": dep >= loc})
    seen_control = False
    for p in ext.get("paired", []):
        if p.get("a") != method or p.get("kind_a") != "deployed" or p.get("kind_b") != "deployed":
            continue
        vs_fedavg = p.get("b") == "fedavg"
        if not vs_fedavg and (not ext.get("control") or p.get("b") != ext.get("control")):
            continue
        seen_control = seen_control or not vs_fedavg
        for metric, label in (("auc", "AUC"), ("balanced_accuracy", "balanced accuracy")):
            d = p.get(metric) or {}
            if d.get("diff") is None:
                continue
            value = f"{paired_cell(d)}: {verdict_cell(d)}"
            if vs_fedavg:
                out.append({"target": f"verdict against equal-epoch FedAvg, {label} (reported, no threshold)",
                            "value": value, "met": None})
            else:  # non-inferiority with the margin fixed in advance; no verdict (too few seeds) is not met
                m = d.get("margin", MARGINS.get(metric))
                out.append({"target": f"deployed models not worse than local+ft, {label} (non-inferiority, "
                                      f"margin {m:g})", "value": value, "met": bool(d.get("non_inferior"))})
    if not seen_control:  # target (4) cannot be judged: say so instead of leaving it out ("All targets met")
        out.append({"target": "deployed models not worse than local+ft",
                    "value": "not measured: no local+ft control run in this comparison (add local to --methods)",
                    "met": False})
    return out


def targets_markdown(targets: list[dict]) -> list[str]:
    """Markdown lines of :func:`ohfl_targets` (a table; empty when there are none)."""
    if not targets:
        return []
    L = ["", "### Issue 11 targets (OHFL main job, external evaluation)", "",
         "| target | value | met |", "|---|---|---|"]
    for t in targets:
        L.append(f"| {t['target']} | {t['value']} | "
                 + {True: "met", False: "**NOT met**", None: "reported"}[t["met"]] + " |")
    n_not = sum(t["met"] is False for t in targets)
    L += ["", f"{n_not} of {sum(t['met'] is not None for t in targets)} targets not met." if n_not
          else "All targets met."]
    return L


def _ci_cell(d: dict) -> str:
    from hfl_components.stats import paired_cell

    return paired_cell(d)


def external_markdown(ext: dict, plans: dict) -> list[str]:
    rows = ext["rows"]
    methods = _order({r["method"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    L = ["", f"## External evaluation: `{ext['data']}`" + (f", part `{ext['part']}`" if ext.get("part") else ""), "",
         f"{'/'.join(map(str, ext['n_images']))} images per run after leaving out "
         f"{'/'.join(map(str, ext['probe_images_excluded']))} probe images; seeds {', '.join(map(str, seeds))}. "
         "Every saved model of every run was evaluated (`cxr-hfl evaluate`, argmax decision); the global model is "
         "scored at each site's input size and averaged over sites.", "",
         "### Endpoints: each site's deployed model", "",
         "Mean ± std over (seed, site) pairs.", "",
         "| method | epochs/site | model | n models | AUC | balanced accuracy | accuracy |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        ep = plans.get(m, {}).get("total_epochs_per_site", "–")
        for kind, label in (("deployed", "deployed (per site)"), ("local", "pre-fusion local (per site)"),
                            ("federated", "fine-tuned federated, before the gate (per site)"),
                            ("global", "global (site mean)")):
            rs = [r for r in rows if r["method"] == m and r["kind"] == kind
                  and (kind != "global" or r["model"] == "global")]
            if not rs:
                continue
            L.append(f"| {m} | {ep} | {label} | {len(rs)} | " + " | ".join(
                _mean_std([r[k] for r in rs]) for k in ("auc", "balanced_accuracy", "accuracy")) + " |")
    sites = sorted({r["site"] for r in rows if r["kind"] == "deployed"}, key=lambda s: (len(s), s))
    L += ["", "### Per-site deployed-model AUC (mean over seeds)", "",
          "| method | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
    for m in methods:
        cells = []
        for s in sites:
            v = [r["auc"] for r in rows if r["method"] == m and r["site"] == s and r["kind"] == "deployed"
                 and r["auc"] is not None]
            cells.append(_fmt(float(np.mean(v))) if v else "–")
        L.append(f"| {m} | " + " | ".join(cells) + " |")
    from hfl_components.stats import MARGINS, RULE_TEXT, endpoint_label, verdict_cell

    L += ["", "### Paired differences (same seed, same site)", "",
          "Mean over seeds of the seed's mean (A − B) over its sites' deployed models. 95% interval: cluster "
          f"bootstrap-t ({ext['n_boot']} replicates, `hfl_components.stats`): seeds resampled as clusters with their "
          "sites, one image draw per replicate shared by every seed and site, the replicates' standard error with "
          "the t quantile at seeds − 1 degrees of freedom; beside it the seed-level t-interval of the per-seed "
          "differences, an interval for these images only. Verdict: better (lower bound > 0) / not worse "
          f"(non-inferiority, lower bound > −δ; δ {MARGINS['auc']} AUC, {MARGINS['balanced_accuracy']} balanced "
          "accuracy) / worse (upper bound < 0) / inconclusive. " + RULE_TEXT + " Only the primary endpoint's verdict "
          "is confirmatory; the others are exploratory (no multiplicity correction). Pneumonia vs normal; balanced "
          "accuracy at the argmax rule.", ""]
    if ext.get("control") == "local":
        L += ["Under equal budgets `local` is the local+ft control (each site's own model trained the same E epochs).",
              ""]
    L += ["| comparison | seeds | pairs | Δ AUC | verdict | Δ balanced accuracy | verdict |",
          "|---|---|---|---|---|---|---|"]
    for p in ext["paired"]:
        a, b = p["auc"], p["balanced_accuracy"]
        role = {k: endpoint_label(p.get("primary") == k) for k in ("auc", "balanced_accuracy")}
        L.append(f"| {p['comparison']} | {len(p['seeds'])} | {a['n_pairs']} | {_ci_cell(a)} | "
                 f"{verdict_cell(a)}, {role['auc']} | {_ci_cell(b)} | {verdict_cell(b)}, {role['balanced_accuracy']} |")
    if "ohfl" in methods:
        L += targets_markdown(ohfl_targets(ext))
    return L


def _order(methods) -> list[str]:
    def key(m):
        name = split_variant(m)[0]
        return (METHODS.index(name) if name in METHODS else 99, m)
    return sorted(set(methods), key=key)


def comparison_markdown(out: Path, runs, rows, plans: dict | None = None, ext: dict | None = None) -> str:
    cj = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if plans is None:
        plans = cj.get("epoch_plan")
    plans = plans or {}
    methods = _order(r["method"] for r in rows)
    seeds = sorted({r["seed"] for r in rows})
    sites = sorted({r["site"] for r in rows}, key=lambda s: (len(s), s))
    labels = {m.get("labels") for _, _, m in runs}
    L = ["# Method comparison", ""]
    if cj:
        L += [f"Command: `{cj.get('command') or '(not recorded)'}`", "",
              f"Data: `{cj.get('data')}` · {cj.get('sites')} sites, scheme `{cj.get('scheme')}` · labels "
              f"`{cj.get('labels')}` · seeds {', '.join(map(str, cj.get('seeds', [])))}", ""]
    if plans:
        L += ["## Budget", ""] + [f"- {x}" for x in budget_lines(plans, bool(cj.get("unequal_budgets")))] + [""]
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
        from hfl_components.stats import RULE_TEXT, paired_cell, verdict_cell

        L += ["", "## Paired difference vs Local", "",
              "Mean over seeds of the seed's mean (method − Local) over its sites' own test sets; 95% seed-level "
              "t-interval (seeds − 1 degrees of freedom; the sites of a seed are not independent). " + RULE_TEXT
              + " Verdicts here are exploratory.", "",
              "| method | pairs | Δ accuracy | Δ balanced accuracy | Δ AUC | verdict (balanced accuracy) |",
              "|---|---|---|---|---|---|"]
        for m in methods:
            if m == "local":
                continue
            ds = {k: paired_diff(rows, m, k) for k in ("accuracy", "balanced_accuracy", "auc")}
            n = max(d["n"] for d in ds.values())
            L.append(f"| {m} | {n} | " + " | ".join(paired_cell(d) for d in ds.values())
                     + f" | {verdict_cell(ds['balanced_accuracy'])} |")
    if ext:
        L += external_markdown(ext, plans)
    L += ["", "## Notes", ""]
    if "fedavg" in methods:
        L.append("- FedAvg runs under its own rule: every site trains the deepest architecture (one shared model), "
                 "so its sites do not keep their own depth/width as under Local, local+ft and OHFL.")
    if "local+ft" in methods and cj.get("unequal_budgets"):
        L.append("- `local+ft` is the compute-matched control: each site's local model trained for Local's epochs "
                 "plus as many extra epochs as OHFL's fine-tuning (one round of rounds x local_epochs + "
                 "finetune_epochs).")
    elif plans and not cj.get("unequal_budgets"):
        L.append("- Equal budgets: Local (= the local+ft control), FedAvg (rounds x local epochs) and OHFL (local + "
                 "fine-tuning epochs) train the same number of epochs per site.")
    L.append("- With few test images per site the per-site numbers are noisy; read the pooled CIs and the paired "
             "intervals before ranking methods.")
    return "\n".join(L) + "\n"
