"""Running a comparison: partitions per seed, each method's profile and simulation, external evaluation, the
recorded command (``compare.json``)."""
from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path


from nvflare_jobs.compare.plan import (CONTROL, METHODS, BudgetError, CompareOptions, base_method, entry_of, budget_lines, check_variant,
                                       command_for, epoch_plan, families_ignored, proto_protocol, simulate_options,
                                       split_variant)
from nvflare_jobs.compare.tables import collect_runs, write_tables

PROFILE_DIR = "site_configs"  # a run folder's generated profile (one <site>.yaml per site)


def _subset(records: list[dict], n: int | None) -> list[dict]:
    from chest_xray.sampling import stratified_subset as sub

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
                            min_eval_per_class=PROTO_MIN_EVAL_PER_CLASS if args.proto_protocol
                            else 0)
    write_partition(res, part)
    (part / "scan_report.json").write_text(json.dumps(report, indent=1, default=str))
    return part


def probe_part_csv(data: Path, out: Path, write: bool = True) -> Path | None:
    """When the sites come from ``chest_xray_original`` and its sibling ``chest_xray_224`` exists, write the
    committed ``probe`` part of ``chest_xray_224`` as ``OUT/probe_part.csv`` (absolute paths) for every OHFL run, so
    the server's probe never touches the tuning or evaluation parts. None otherwise. ``write`` False (a dry run):
    the path only, nothing written."""
    from chest_xray.splits import POOL, split_rows

    pool = data.parent / POOL
    if data.name != "chest_xray_original" or not pool.is_dir():
        return None
    dest = out / "probe_part.csv"
    if not write:
        return dest
    with dest.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["path", "label"])
        w.writerows([str((pool / r["path"]).resolve()), r["label"]] for r in split_rows("probe"))
    return dest


def _input_sizes(args) -> list[int]:
    if args.input_sizes:
        return [int(x) for x in args.input_sizes.split(",")]
    if args.proto_protocol:
        from nvflare_jobs.profiles import PROTO_TRAINING

        return [PROTO_TRAINING["input_size"]]
    return [64, 96, 128]


def write_method_profile(part: Path, run_dir: Path, method: str, seed: int, args) -> Path:
    from nvflare_jobs.profiles import write_profile

    base = base_method(method)
    plan = epoch_plan(method, args)
    settings = {"batch_size": args.batch_size or 16, "local_epochs": plan["local_epochs"],
                # the one-shot method's own fine-tuning epochs, 0 included (the site configs record what runs)
                "finetune_epochs": (plan["finetune_epochs"] if entry_of(method).schedule == "one_shot"
                                    else plan["finetune_epochs"] or 10), "seed": seed, "threads": 1,
                "max_train_images": args.max_train_images, "feature_dim": 64,
                "aspect": args.aspect, "augment": args.augment, "frame_mask": args.frame_mask,
                "frame_rescale": args.frame_rescale}
    proto = True if args.proto_protocol else None  # Local on the prototype methods' backbones
    return write_profile(part, run_dir / PROFILE_DIR, base, args.labels, _input_sizes(args), settings, proto=proto,
                         families=args.families)


def relative(path) -> str:
    """``path`` relative to the working directory (``compare.json`` records no machine paths); a path on another
    drive stays as given."""
    import os

    try:
        return os.path.relpath(Path(path).resolve(), Path.cwd())
    except ValueError:
        return str(path)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``cxr-hfl <args>`` (shell-quoted), absolute paths made relative to the working
    directory."""
    import shlex

    argv = sys.argv[1:] if argv is None else argv
    return "cxr-hfl " + " ".join(shlex.quote(relative(a) if a.startswith("/") else a) for a in argv)


def record_command(out: Path, cmd: str, info: dict) -> dict:
    """Write ``OUT/compare.json``: ``command`` is the first command that actually ran, later runs under
    ``resumed_by`` (a ``--dry-run`` writes nothing; a ``dry_runs`` list of an older version's record is kept)."""
    f = out / "compare.json"
    prev = json.loads(f.read_text()) if f.is_file() else {}
    rec = {**prev, **info, "command": prev.get("command"), "resumed_by": prev.get("resumed_by", [])}
    if "--dry-run" in (rec["command"] or ""):
        rec["command"] = None  # written by an older version that recorded a dry run as the command
    if rec["command"] is None:
        rec["command"] = cmd
    else:
        rec["resumed_by"] = rec["resumed_by"] + [cmd]
    f.write_text(json.dumps(rec, indent=1))
    return rec


def compare(out: str | Path, **options) -> int:
    """Run a comparison from a library caller (a study, a benchmark): the same as ``cxr-hfl compare`` with the
    options of :class:`~nvflare_jobs.compare.plan.CompareOptions` as keywords (``methods="local,fedavg,ohfl"``,
    ``seeds=[0, 1]``, ``external=...``, ``part="tuning"``), in this process; nothing shells out to the command line.

    Returns:
        0, 1 (some runs failed; rerun to resume) or 2 (refused before any run, one line on stderr).

    Raises:
        ValueError: an option that is not a comparison option, named.
    """
    return run_compare(CompareOptions.from_mapping({"out": str(out), **options}))


def run_compare(args: CompareOptions) -> int:
    """``cxr-hfl compare``: check the methods and budgets, run every (seed, method) not finished yet, then the
    external evaluation and the tables. Returns 0, 1 (some runs failed) or 2 (bad input, one line on stderr).
    ``args`` is a :class:`~nvflare_jobs.compare.plan.CompareOptions` (or an object with the same attributes)."""
    try:
        methods, plans, data, ext, out = _checked(args)
    except _Refused as e:
        print(f"cxr-hfl compare: {e}", file=sys.stderr)
        return 2
    prev = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if prev:
        done = len(list(out.glob("seed*/*/metrics.json")))
        print(f"[compare] {out} holds an earlier comparison ({done} finished run(s)): resuming -- finished runs are "
              f"kept, unfinished ones are run again. To replace it instead, delete {out} or choose another --out.",
              flush=True)
    for line in budget_lines(plans, bool(args.unequal_budgets)):
        print(f"[compare] budget: {line}")
    if not args.probe and any(entry_of(m).option("probe") is not None for m in methods):
        args.probe = probe_part_csv(data, out, write=not args.dry_run)
        if args.probe:
            print(f"[compare] OHFL probe: the committed probe part of chest_xray_224 ({args.probe})")
    if not args.dry_run:
        _record(args, out, methods, plans, data, ext)
    failed = [f for seed in args.seeds for f in _run_seed(args, out, seed, methods, plans, data)]
    if args.dry_run:
        if ext:
            print(f"[compare] then: every saved model of every run evaluated on {ext}"
                  + (f" (part {args.part})" if args.part else ""))
        print(f"[compare] dry run: nothing written; the run writes the partitions, site configs and runs under {out}")
        return 0
    if ext:
        failed += evaluate_external(out, ext, args.part, args.external_max_images,
                                    args.labels, audit=not args.no_audit)
    rows = write_tables(out, plans, n_boot=args.n_boot)
    print(f"[compare] {len(rows)} rows -> {out / 'comparison.csv'}, {out / 'comparison.md'}")
    if failed:
        print(f"[compare] failed runs (rerun the same command to retry them): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


class _Refused(ValueError):
    """A comparison refused before any run (the message is the one line ``cxr-hfl compare`` prints)."""


def _check_augments(methods: list[str], augment) -> None:
    """Raise :class:`_Refused` when ``augment`` cannot go into a method's site configs (``--augment`` goes into the
    site configs compare writes, not through :func:`check_variant`)."""
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import check_augment, cli_message

    for m in methods:
        try:
            check_augment(base_method(m), augment)
        except SimulateError as e:
            raise _Refused(cli_message(e)) from None


def _checked(args) -> tuple[list[str], dict, Path, str | None, Path]:
    """``(methods, plans, data root, external set, out folder)`` of a comparison; raises :class:`_Refused`."""
    from nvflare_jobs.evaluation import part_required
    from nvflare_jobs.profiles import DataNotFoundError, resolve_data, site_options_problem

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if split_variant(m)[0] not in METHODS]
    if bad or not methods:
        raise _Refused(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}" if bad else
                       f"--methods is empty; choose from {', '.join(METHODS)}")
    if twice := sorted({m for m in methods if methods.count(m) > 1}):
        raise _Refused(f"--methods names {', '.join(twice)} more than once (one run folder per seed and method)")
    if twice := sorted({s for s in args.seeds if list(args.seeds).count(s) > 1}):
        raise _Refused(f"--seeds names {', '.join(map(str, twice))} more than once (one run folder per seed and method)")
    for m in methods:
        why = check_variant(m, args)
        if why:
            raise _Refused(why)
    ext, part = args.external, args.part
    if why := site_options_problem(args) or (ext and part_required(ext, part, "--external")):
        raise _Refused(why)  # before the output folder and the partitions are written
    if ext and not Path(ext).exists():
        raise _Refused(f"no external data at {ext}")
    if part and not ext:
        raise _Refused("--part needs --external (the chest_xray_224 root)")
    probe = args.probe
    if probe and probe not in ("generated", "none"):  # every OHFL run would fail on it, one after the other
        from hfl_components.flare.probe import list_probe_files

        try:
            if not list_probe_files(probe):
                raise _Refused(f"--probe {probe}: lists no images (a folder of public JPEG/PNG/DICOM images, a "
                               "probe.csv with a path column, or 'generated')")
        except (FileNotFoundError, ValueError) as e:
            raise _Refused(f"--probe {probe}: {e}") from None
    args.proto_protocol = proto_protocol(methods)
    _check_augments(methods, args.augment)
    out = Path(args.out).resolve()
    if not args.unequal_budgets and CONTROL in methods and "local+ft" in methods:
        methods.remove("local+ft")
        print("[compare] equal budgets: local+ft is the same run as local (E epochs); running local once, reported "
              "as the local+ft control")
    if args.families is not None:
        _families_notice(methods)
    try:
        plans = {m: epoch_plan(m, args) for m in methods}
    except BudgetError as e:
        raise _Refused(str(e)) from None
    try:
        data = None
        if args.proto_protocol and not args.data:  # chest_xray_224's tuning + probe parts
            from nvflare_jobs.profiles import proto_pool_root, proto_training_data

            if args.dry_run:  # the manifest the run would write
                data = out / "data_pool.csv" if proto_pool_root() else None
            else:
                out.mkdir(parents=True, exist_ok=True)
                data = proto_training_data(out / "data_pool.csv")
        data = data or resolve_data(args.data)
    except DataNotFoundError as e:
        raise _Refused(str(e)) from None
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)  # every check passed
    return methods, plans, data, ext, out


def _families_notice(methods: list[str]) -> None:
    """With ``--families``: refuse (:class:`_Refused`) when no method of the comparison takes it; when only some
    do, one line saying which methods ignore it (:func:`~nvflare_jobs.compare.plan.families_ignored`)."""
    from nvflare_jobs.profiles import family_methods

    ignored = families_ignored(methods)
    why = ("prototype methods" + (f" (and {CONTROL} beside them)" if any(base_method(m) == CONTROL for m in ignored) else "")
           + " train the heterogeneous backbone pool")
    if len(ignored) == len(methods):
        raise _Refused(f"--families: no method in --methods takes it ({', '.join(ignored)}: {why}); it is for "
                       f"{', '.join(family_methods())} compared without prototype methods; drop --families")
    if ignored:
        print(f"[compare] --families: used by {', '.join(m for m in methods if m not in ignored)}; ignored by "
              f"{', '.join(ignored)} ({why})")


def _record(args, out: Path, methods: list[str], plans: dict, data: Path, ext) -> None:
    """``compare.json``: the command and settings, every path relative to the working directory."""
    from nvflare_jobs.evaluation import external_name

    record_command(out, command_line(args.argv), {
        "data": relative(data), "methods": methods, "seeds": args.seeds, "sites": args.sites, "scheme": args.scheme,
        "labels": args.labels, "epoch_plan": plans, "unequal_budgets": bool(args.unequal_budgets),
        "external": relative(ext) if ext else None, "part": args.part,
        "external_name": external_name(ext, args.part) if ext else None,
        "probe": relative(args.probe) if args.probe else None,
        "paths": "relative to the working directory the command ran in"})


def _run_seed(args, out: Path, seed: int, methods: list[str], plans: dict, data: Path) -> list[str]:
    """Run (or, dry, print without writing anything) every unfinished method of one seed on its partition; returns
    the failed runs."""
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    failed = []
    seed_dir = out / f"seed{seed}"
    part = None if args.dry_run else prepare_partition(data, seed_dir, args)
    for m in methods:
        run_dir = seed_dir / m
        if (run_dir / "metrics.json").is_file():
            print(f"[compare] seed {seed} {m}: done already, skipped")
            continue
        if args.dry_run:  # the command as the run will print it (its profile is written then)
            print(f"[compare] seed {seed} {m}: "
                  f"{command_for(m, run_dir / PROFILE_DIR, simulate_options(m, data, seed, args), run_dir)}")
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        profile = write_method_profile(part, run_dir, m, seed, args)
        opts = simulate_options(m, data, seed, args)
        cmd = command_for(m, profile, opts, run_dir)
        print(f"[compare] seed {seed} {m}: {cmd}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = resolve(base_method(m), {**opts, "profile": str(profile)}).simulate(
                run_dir, overwrite=True, isolate=True, log=run_dir / "simulate.log", command=cmd).rc
        except SimulateError as e:  # checked before any run (check_variant); kept as a failed run if it happens
            (run_dir / "simulate.log").write_text(f"cxr-hfl simulate: error: {e}\n")
            rc = 2
        ok = (run_dir / "metrics.json").is_file()
        if ok and m != base_method(m):  # the run folder says which control / variant it is
            met = json.loads((run_dir / "metrics.json").read_text())
            met["method"] = m
            met["compare_plan"] = plans[m]
            (run_dir / "metrics.json").write_text(json.dumps(met, indent=1))
        print(f"[compare] seed {seed} {m}: rc={rc} in {time.perf_counter() - t0:.0f} s"
              + ("" if ok else f" FAILED, see {run_dir / 'simulate.log'}"), flush=True)
        if not ok:
            failed.append(f"{m}/seed{seed}")
    return failed


def evaluate_external(out: Path, data: str | Path, part: str | None, max_images: int | None,
                      labels: str, audit: bool = True) -> list[str]:
    """``cxr-hfl evaluate`` of every run under ``out`` on ``data`` (skipping runs already evaluated on it with the
    same image cap; ``audit``: with the shortcut audit, added to an earlier evaluation that lacks it). Returns the
    runs that could not be evaluated."""
    from nvflare_jobs.evaluation import LeakageError, evaluate_run, external_name

    name = external_name(data, part)
    failed = []
    for method, seed, m in collect_runs(out):
        run = Path(m["_run_dir"])
        summ = run / "external" / name / "summary.json"
        if summ.is_file() and json.loads(summ.read_text()).get("max_images") == max_images:
            if audit and not (summ.parent / "audit.json").is_file():
                from nvflare_jobs.audit import audit_external

                audit_external(run, summ.parent, log=lambda *_: None)
            continue
        t0 = time.perf_counter()
        try:
            res = evaluate_run(run, data, labels, max_images=max_images, part=part, n_boot=0, log=lambda *_: None,
                               audit=audit, overwrite=True)  # an earlier one with another image cap is replaced
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
