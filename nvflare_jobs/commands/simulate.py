"""``cxr-hfl simulate`` (run a method in the NVFlare simulator) and ``cxr-hfl export-job``."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from hfl_components.flare import catalogue

METHODS = catalogue.METHODS  # kept name; the method catalogue is the one list
# OHFL fusion defaults, chosen on the fusion ladder (studies/fusion_defaults/RESULTS.md, tuning part only): the
# catalogue's OHFL options that the command line leaves unset until --paper has been applied.
OHFL_DEFAULTS = {o.key: o.default for o in catalogue.entry("ohfl").options
                 if o.cli_default is None and o.key != "alignment"}
# The OHFL paper's pipeline (OHFL paper, Sec. 4.2): Sinkhorn eps 0.01, "wts", 20 local / 50 fine-tuning epochs.
PAPER = {"ot": "sinkhorn", "ground_metric": "wts", "repair": "none", "cka": "linear", "probe_at": "largest",
         "init": "site", "gate": False, "strategy": "cid", "alignment": "cka", "local_epochs": 20,
         "finetune_epochs": 50}
ABLATIONS = catalogue.TOPOLOGY_ABLATIONS


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or any(x < 16 for x in v):
        raise argparse.ArgumentTypeError(f"input sizes must be integers >= 16, got {s!r}")
    return v


def _at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (a count, epochs or seconds), else a one-line error naming it."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {v}")
        return v
    parse.__name__ = "int"
    return parse


def _gpu_ids(s: str) -> str:
    ids = [x.strip() for x in s.split(",")]
    if not ids or not all(x.isdigit() for x in ids):
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids such as 0 or 0,1, got {s!r}")
    return ",".join(ids)


def _device(s: str) -> str:
    from hfl_components.training.device import check_device_name

    try:
        return check_device_name(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# options that describe the simulated sites (partition and per-site configs); with --profile the site configs
# decide them, so export-job refuses them instead of silently dropping them
SITE_OPTIONS = {"data": "--data", "sites": "--sites", "scheme": "--scheme", "alpha": "--alpha",
                "input_sizes": "--input-sizes", "batch_size": "--batch-size", "max_train_images": "--max-train-images",
                "feature_dim": "--feature-dim", "labels": "--labels"}
SITE_KEYS = {"input_sizes": "input_size", "batch_size": "batch_size", "max_train_images": "max_train_images",
             "feature_dim": "model.feature_dim", "labels": "data.labels"}


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, required=True,
                   help="; ".join(f"{m}: {e.summary}" for m, e in catalogue.CATALOGUE.items()))
    protos = "/".join(catalogue.PROTOTYPE_METHODS)
    p.add_argument("--data", help="data root (Kaggle layout, class folders, or CSV); default $CXR_DATA, ../shared/data "
                                  f"(chest_xray_original; {protos}: the tuning + probe parts of "
                                  "chest_xray_224, see chest_xray/splits.py)")
    p.add_argument("--profile", help="folder of <site>.yaml site configs (skips partitioning)")
    p.add_argument("--sites", type=int, default=6, help="number of simulated hospital sites (default 6)")
    p.add_argument("--scheme", choices=("width", "dirichlet", "pathological"), default="width")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha (dirichlet scheme)")
    p.add_argument("--labels", choices=("binary", "subtype"),
                   help="label scheme (default: the method's: " + ", ".join(
                       f"{m} {e.labels}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--rounds", type=_at_least(1), help="federated rounds (default: the method's: " + ", ".join(
        f"{m} {e.rounds}" for m, e in catalogue.CATALOGUE.items()) + "; OHFL is one-shot)")
    p.add_argument("--local-epochs", type=_at_least(0), help="local epochs per round (OHFL: before upload; default: "
                   "the method's: " + ", ".join(f"{m} {e.local_epochs}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--finetune-epochs", type=_at_least(0), help="OHFL fine-tuning epochs at each site (default "
                   f"{catalogue.entry('ohfl').finetune_epochs})")
    p.add_argument("--input-sizes", type=_ints,
                   help="input sizes, smallest to largest, assigned to sites by image width (default 64,96,128; "
                        f"{protos}: 64)")
    p.add_argument("--batch-size", type=_at_least(1), default=16)
    p.add_argument("--max-train-images", type=_at_least(1), help="cap each site's training images (quick tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-sites", type=_at_least(1), help="fewest usable sites for a round to proceed (default N-1)")
    p.add_argument("--server-device", type=_device, default="auto",
                   help=catalogue.entry("ohfl").option("server_device").help)
    p.add_argument("--late-wait", type=_at_least(0), default=None,
                   help="fixed seconds to wait for the remaining sites once --min-sites have answered (0 = wait for "
                        "every live site). Default: adaptive, max(60 s, 3 x the slowest answering site's compute "
                        "time), keeping sites that still send heartbeats. Sites that are not running or have gone "
                        "silent are dropped at once either way.")
    p.add_argument("--feature-dim", type=int, default=64, help="common feature dimension d of the site backbones "
                   f"({protos})")
    _add_catalogue_options(p)
    from nvflare_jobs.jobs import add_tracking_args

    add_tracking_args(p)
    g = p.add_argument_group("OHFL")
    g.add_argument("--paper", action="store_true",
                   help="the OHFL paper's pipeline exactly: Sinkhorn (eps 0.01), wts, linear CKA, no repair, probe at "
                        "the largest size, per-site initialisation, no gate, 20 local + 50 fine-tuning epochs")
    g.add_argument("--no-repair", dest="repair", action="store_const", const="none", help="same as --repair none")


def _add_catalogue_options(p: argparse.ArgumentParser) -> None:
    """One flag per option key of the method catalogue (``hfl_components.flare.catalogue``), grouped by the first
    method that has it; the help says which methods read it and their defaults. Values are checked per method by
    ``catalogue.validate_options`` (``_defaults``)."""
    done = {a.dest for a in p._actions}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, users in catalogue.all_options().items():
        if key in done:
            continue
        first = users[0][1]
        g = groups.setdefault(users[0][0], p.add_argument_group(f"{users[0][0]} options"))
        helps = list(dict.fromkeys(o.help for _, o in users if o.help))
        defaults = {m: (o.default if o.fixed is catalogue._UNSET else f"{o.fixed} (fixed)") for m, o in users
                    if o.default is not None and o.default != []}
        if defaults and len({repr(v) for v in defaults.values()}) == 1:
            dflt = f" (default {next(iter(defaults.values()))})"
        elif defaults:
            dflt = " (default " + ", ".join(f"{m} {v}" for m, v in defaults.items()) + ")"
        else:
            dflt = ""
        kw = {"dest": key, "default": first.argparse_default,
              "help": f"[{', '.join(m for m, _ in users)}] " + "; ".join(helps) + dflt}
        choices = [c for _, o in users for c in (o.choices or ())]
        if choices and all(o.choices for _, o in users):
            kw["choices"] = list(dict.fromkeys(choices))
        if first.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif first.type is list:
            kw["action"] = "append"
            kw["default"] = []
        elif first.type in (int, float):
            kw["type"] = first.type
        g.add_argument(first.cli_flag, **kw)


def register(sub) -> None:
    p = sub.add_parser("simulate", help="run a method on simulated hospital sites in the NVFlare simulator")
    _add_method_args(p)
    p.add_argument("--out", required=True, help="run folder (metrics.json, plots, models, logs)")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    p.add_argument("--verbose", action="store_true",
                   help="show NVFlare's INFO logs on the console (by default they go only to the workspace's "
                        "log files and the console shows live progress)")
    p.add_argument("--log-config", help="NVFlare log mode or config file (concise|msg_only|full|verbose|FILE); "
                                        "overrides the quiet default and --verbose")
    p.add_argument("--gpu", type=_gpu_ids,
                   help="NVFlare simulator GPU option: GPU ids for the site processes, e.g. 0 or 0,1 (sites are "
                        "spread over them); a site uses its GPU when its config says device: auto or cuda")
    p.set_defaults(func=run_simulate)
    e = sub.add_parser("export-job", help="write an NVFlare job folder for `nvflare job submit -j`")
    _add_method_args(e)
    e.add_argument("--out", required=True, help="folder to export the job into")
    # site options given with --profile are refused (see SITE_OPTIONS): None tells "not given" from a default
    e.set_defaults(func=run_export, sites=None, scheme=None, alpha=None, input_sizes=None, batch_size=None,
                   feature_dim=None)


def _ohfl_defaults(args) -> None:
    """Fill the OHFL fusion options left unset: from PAPER with --paper (an explicit conflicting option is an
    error), else from OHFL_DEFAULTS."""
    names = {"ot": "--ot", "ground_metric": "--ground-metric", "cka": "--cka", "probe_at": "--probe-at",
             "init": "--init", "gate": "--gate", "repair": "--repair", "strategy": "--strategy",
             "alignment": "--alignment"}
    if getattr(args, "paper", False):
        if args.method != "ohfl":
            sys.exit("cxr-hfl: --paper is an OHFL option (the OHFL paper's pipeline)")
        for k, v in PAPER.items():
            cur = getattr(args, k, None)
            if cur is not None and cur != v and k in names:
                def flag(x, f=names[k]):  # booleans as the flags a user types: --gate / --no-gate
                    return (f if x else f"--no-{f[2:]}") if isinstance(x, bool) else f"{f} {x}"
                sys.exit(f"cxr-hfl: --paper runs the paper's pipeline ({flag(v)}); drop {flag(cur)}")
            if k in ("local_epochs", "finetune_epochs") and cur is not None and cur != v:
                sys.exit(f"cxr-hfl: --paper uses the paper's {v} {k.replace('_', ' ')}; drop --{k.replace('_', '-')}")
            setattr(args, k, v)
    for k, v in OHFL_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def _check_method_options(args) -> None:
    """Fill the method's own options left unset with their catalogue defaults and check them with
    ``catalogue.validate_options`` (exit with the message naming the option); an option of another method given
    a value other than its default is ignored with a warning (refused for ``strict`` options such as ``--eval``)."""
    e = catalogue.entry(args.method)
    for key, users in catalogue.all_options().items():
        if e.option(key) is None:
            opt = users[0][1]
            v = getattr(args, key, None)
            if v not in (None, [], opt.argparse_default, opt.default):
                given = (opt.cli_flag if v else f"--no-{opt.cli_flag[2:]}") if opt.type is bool else f"{opt.cli_flag} {v}"
                msg = (f"{given} is not an option of {args.method} (it is one of "
                       f"{', '.join(m for m, _ in users)})")
                if any(o.strict for _, o in users):
                    sys.exit(f"cxr-hfl: {msg}")
                print(f"WARNING: {msg}; ignored", file=sys.stderr)
    for o in e.options:
        if getattr(args, o.key, None) is None:
            setattr(args, o.key, list(o.default) if isinstance(o.default, list) else o.default)
    try:
        catalogue.validate_options(args.method, {o.key: getattr(args, o.key, None) for o in e.options},
                                   require=False)
    except ValueError as err:
        sys.exit(f"cxr-hfl: {err}")


def _defaults(args) -> None:
    _ohfl_defaults(args)
    from hfl_components.flare.catalogue import method_defaults

    d = method_defaults(args.method)
    proto = catalogue.is_prototype(args.method)
    if args.labels is None:
        args.labels = d["labels"]
    if args.rounds is None:
        args.rounds = d["rounds"]
    if getattr(args, "input_sizes", None) is None:
        from nvflare_jobs.profiles import PROTO_TRAINING

        args.input_sizes = [PROTO_TRAINING["input_size"]] if proto else [64, 96, 128]
    _check_method_options(args)
    if catalogue.entry(args.method).option("prototypes") is not None and args.labels == "binary":
        print("WARNING: with 2 classes the prototype-level structural loss is constant (centred 2x2 Gram, a single "
              "RDM entry); only the instance-level term acts. Use --labels subtype for 3 classes.", file=sys.stderr)
    # Epochs given on the command line apply to every site (job-level task_config); otherwise each site's own config
    # decides (a config without them: the method default, hfl_components.flare.catalogue), and partition-generated
    # profiles get these defaults written into every site config.
    args.default_local_epochs = d["local_epochs"]
    args.default_finetune_epochs = d["finetune_epochs"]


def prepare_profile(args, run_dir: Path) -> tuple[Path, dict, Path | None, Path | None]:
    """Partition (unless --profile) and write the site-config profile. Returns (profile_dir, profile, data_root,
    partition_dir)."""
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition
    from nvflare_jobs.profiles import PROTO_MIN_EVAL_PER_CLASS, proto_training_data, resolve_data, write_profile
    from nvflare_jobs.site_config import load_profile

    if args.profile:
        from nvflare_jobs.site_config import SiteConfigError, load_site_config

        profile_dir = Path(args.profile).resolve()
        profile = load_profile(profile_dir, check_files=False)
        for site, cfg in profile.items():  # the sites check their own files; warn here, but let the run go on
            try:
                load_site_config(site, cfg["config_path"])
            except SiteConfigError as e:
                print(f"WARNING: {e} -- this site will fail its tasks and be left out", file=sys.stderr)
        data = Path(args.data).resolve() if args.data else None
        return profile_dir, profile, data, None
    data = None
    if catalogue.is_prototype(args.method) and not args.data:
        data = proto_training_data(run_dir / "data_pool.csv")
    data = data or resolve_data(args.data)
    print(f"[cxr-hfl] data: {data}")
    records, report = scan_dataset(data, labels=args.labels)
    skipped = report.get("skipped", []) if isinstance(report, dict) else []
    print(f"[cxr-hfl] scanned {len(records)} usable images ({len(skipped)} skipped, see partition/scan_report.json)")
    if not records:
        raise SystemExit(f"cxr-hfl: no usable images under {data}")
    part_dir = run_dir / "partition"
    res = partition_records(records, args.sites, args.scheme, alpha=args.alpha, seed=args.seed,
                            class_names=CLASS_NAMES[args.labels],
                            min_eval_per_class=PROTO_MIN_EVAL_PER_CLASS if catalogue.is_prototype(args.method) else 0)
    write_partition(res, part_dir, extra={"labels": args.labels, "data_root": str(data)})
    (part_dir / "scan_report.json").write_text(json.dumps(report, indent=1, default=str))
    settings = {"batch_size": args.batch_size,
                "local_epochs": args.local_epochs if args.local_epochs is not None else args.default_local_epochs,
                "finetune_epochs": (args.finetune_epochs if args.finetune_epochs is not None
                                    else args.default_finetune_epochs), "seed": args.seed, "threads": 1,
                "max_train_images": args.max_train_images, "feature_dim": args.feature_dim}
    profile_dir = write_profile(part_dir, run_dir / "site_configs", args.method, args.labels, args.input_sizes, settings)
    return profile_dir, load_profile(profile_dir), data, part_dir


RUN_OUTPUTS = ("metrics.json", "models.json", "sites.csv", "rounds.csv", "test_predictions.csv", "job_options.json",
               "global_model.pt", "nvflare_log_config.json", "alignment_record.json", "report.html", "models", "workspace",
               "resolved_configs", "site_configs", "partition", "external", "data_pool.csv")


def _prepare_run_dir(run_dir: Path, overwrite: bool, keep: Path | None = None) -> None:
    """Refuse to mix a new run with an earlier one in the same folder, unless --overwrite clears the old one.
    ``keep``: a path inside the folder that this run reads (a --profile kept there, as `cxr-hfl compare` does)."""
    old = [n for n in RUN_OUTPUTS if (run_dir / n).exists() and (run_dir / n).resolve() != keep]
    if old and not overwrite:
        what = "finished" if (run_dir / "metrics.json").exists() else "unfinished: interrupted or failed"
        raise FileExistsError(f"run folder {run_dir} already holds a run ({what}; {', '.join(old[:4])}...). "
                              "A simulate run cannot be resumed: rerun with --overwrite to replace it, or choose "
                              "another --out "
                              "(`cxr-hfl compare` resumes its unfinished runs when rerun with the same --out)")
    for n in old:
        p = run_dir / n
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if old:
        for png in run_dir.glob("*.png"):
            png.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def _options(args, data_root, part_dir, on_server: bool = False) -> dict:
    """The job options. ``on_server`` (export-job): the probe is a path on the server machine, checked there at
    job start (before any site trains), so it must be absolute and is not looked up here."""
    from nvflare_jobs.profiles import default_probe

    probe = args.probe
    if catalogue.entry(args.method).option("probe") is not None and not probe:
        probe = default_probe(data_root, part_dir) if data_root else None
        if not probe:
            raise SystemExit("cxr-hfl: OHFL needs a public probe set for CKA: pass --probe DIR (public images, no "
                             "site's patients), a probe.csv from `cxr-hfl partition --probe-fraction`, or "
                             "--probe generated")
    if on_server and probe and probe != "generated":
        if not os.path.isabs(probe):
            raise SystemExit(f"cxr-hfl: --probe {probe}: give the probe's absolute path on the server machine "
                             "(the server checks it when the job starts, before any site trains)")
        probe = os.path.normpath(probe)
    elif probe and probe != "generated":
        probe = str(Path(probe).resolve())
        if not Path(probe).exists():
            raise SystemExit(f"cxr-hfl: --probe {probe} does not exist")
    opts = {"rounds": args.rounds, "local_epochs": args.local_epochs, "finetune_epochs": args.finetune_epochs,
            "seed": args.seed, "min_sites": args.min_sites, "late_wait_s": args.late_wait,
            "paper": bool(getattr(args, "paper", False))}
    opts.update({k: getattr(args, k, None) for k in catalogue.all_options()})  # every method's options
    opts.update({"probe": probe, "server_device": args.server_device})
    return opts


def run_simulate(args) -> int:
    from chest_xray import CLASS_NAMES
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.profiles import DataNotFoundError
    from nvflare_jobs.results import assemble_run, find_server_results
    from nvflare_jobs.site_config import ENV_DIR, SiteConfigError

    _defaults(args)
    t0 = time.perf_counter()
    if args.sites < 1:
        raise ValueError(f"--sites must be at least 1, got {args.sites}")
    if args.probe and args.probe != "generated" and not Path(args.probe).exists():
        raise FileNotFoundError(f"--probe {args.probe} does not exist (a folder or probe.csv of public images, "
                                "or 'generated')")
    run_dir = Path(args.out).resolve()
    _prepare_run_dir(run_dir, args.overwrite, Path(args.profile).resolve() if args.profile else None)
    try:
        profile_dir, profile, data_root, part_dir = prepare_profile(args, run_dir)
    except (DataNotFoundError, SiteConfigError) as e:
        print(f"cxr-hfl: {e}", file=sys.stderr)
        return 2
    labels = next(iter(profile.values()))["data"]["labels"]
    if args.profile and labels != args.labels:
        print(f"[cxr-hfl] labels {labels} taken from the profile")
    opts = _options(args, data_root, part_dir)
    (run_dir / "resolved_configs").mkdir(exist_ok=True)
    for site, cfg in profile.items():
        (run_dir / "resolved_configs" / f"{site}.json").write_text(json.dumps(cfg, indent=1))
    (run_dir / "job_options.json").write_text(json.dumps(opts, indent=1))
    print(f"[cxr-hfl] {args.method}: {len(profile)} sites: " + ", ".join(
        f"{s}={c['model']['family']}/{c['model'].get('depth', '')}@{c['input_size']}px" for s, c in profile.items()))
    sharing = [s for s, c in profile.items() if c.get("share_predictions")]
    if sharing:
        print(f"[cxr-hfl] note: {len(sharing)} of {len(profile)} simulated sites send per-image test probabilities "
              "to the server for pooled metrics (share_predictions: true); a real site's default is false")
    job = build_job(args.method, profile, opts, tracking=getattr(args, "tracking", "tensorboard"),
                    tracking_uri=getattr(args, "tracking_uri", None))
    ws = run_dir / "workspace"
    if ws.exists():
        shutil.rmtree(ws)
    os.environ[ENV_DIR] = str(profile_dir)  # each simulated site finds <its name>.yaml here
    from nvflare_jobs.progress import LiveProgress
    from nvflare_jobs.proctree import INTERRUPTED, unique_simulator_ports

    unique_simulator_ports()  # see its docstring: the port race behind "Connection reset by peer" at start

    log_config = args.log_config or ("concise" if args.verbose else str(quiet_log_config(run_dir)))
    print(f"[cxr-hfl] NVFlare logs: {ws}/<server|site>/log.txt" + ("" if args.verbose or args.log_config else
                                                                     " (--verbose shows them here)"))
    with LiveProgress(ws, list(profile), stream=sys.stdout if args.verbose else sys.stderr) as live:
        rc = job.simulator_run(str(ws), threads=len(profile), log_config=log_config,
                                   gpu=getattr(args, "gpu", None))
    if INTERRUPTED.is_set():  # NVFlare's runner swallows the KeyboardInterrupt and returns -9
        raise KeyboardInterrupt
    try:
        server_results = find_server_results(ws)
    except FileNotFoundError as e:
        print(f"cxr-hfl: the simulation failed (rc={rc}): {e}; see {ws}/*/log.txt", file=sys.stderr)
        return 1
    record = json.loads(Path(server_results).read_text())
    models_dir = run_dir / "models"
    models_dir.mkdir(exist_ok=True)
    for site in profile:
        for name in ("deployed_model.pt", "local_model.pt", "federated_model.pt"):
            src = ws / site / "cxr_hfl_state" / name
            if src.is_file():
                shutil.copy2(src, models_dir / f"{site}_{name.replace('_model.pt', '')}.pt")
    for stale in [p for p in models_dir.glob("*.pt") if p.name.split("_")[0] not in _final_sites(server_results)]:
        stale.unlink()  # a site that failed the final evaluation deploys nothing from this run
    metrics = assemble_run(server_results, run_dir, labels=labels, seed=args.seed,
                           wall_time_s=time.perf_counter() - t0, class_names=CLASS_NAMES[labels],
                           extra={"command": " ".join(sys.argv), "profile": str(profile_dir)})
    _print_summary(metrics, run_dir)
    if record.get("failed"):
        print(f"cxr-hfl: the run failed: {record['failed']}; partial results "
              f"in {run_dir}, logs in {ws}/*/log.txt", file=sys.stderr)
        return 3
    if live.last_status and live.last_status.get("phase") not in ("done", None):
        print(f"cxr-hfl: the server stopped in phase {live.last_status.get('phase')!r}; see {ws}/server/log.txt",
              file=sys.stderr)
    return 0 if rc in (0, None) else int(rc)


def quiet_log_config(run_dir: Path) -> Path:
    """NVFlare's log config with the console handler at ERROR: INFO/WARNING lines go only to the workspace's
    ``log.txt`` files (simulator server and every site), the console keeps errors and the live progress."""
    import copy

    from nvflare.fuel.utils.log_utils import concise_log_dict

    cfg = copy.deepcopy(concise_log_dict)
    cfg["handlers"]["consoleHandler"]["level"] = "ERROR"
    cfg["handlers"]["consoleHandler"]["stream"] = "ext://sys.stderr"
    path = run_dir / "nvflare_log_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _final_sites(server_results: Path) -> set[str]:
    return set(json.loads(Path(server_results).read_text()).get("sites", {}))


def _print_summary(m: dict, run_dir: Path) -> None:
    print(f"\n[cxr-hfl] {m['method']} finished in {m['wall_time_s']:.0f} s -> {run_dir}")
    print(f"{'site':<10}{'model':<22}{'size':>5}{'n_test':>8}{'acc':>8}{'bal_acc':>9}{'auc':>7}")
    for site, b in m["sites"].items():
        t = b.get("test") or {}
        spec = b.get("model") or {}
        name = f"{spec.get('family')}/{spec.get('depth', spec.get('feature_dim', ''))}"

        def f(v):
            return "   -" if v is None else f"{v:.3f}"
        print(f"{site:<10}{name:<22}{b.get('input_size') or '':>5}{b.get('n_test') or '':>8}{f(t.get('accuracy')):>8}"
              f"{f(t.get('balanced_accuracy')):>9}{f(t.get('auc')):>7}")
    gate = m.get("gate")
    if gate:
        print(f"deployment gate: {gate['adopted']} of {gate['sites']} sites adopted the federated model"
              + (f"; kept their own local model: {', '.join(gate['kept_local'])}" if gate.get("kept_local") else ""))
    deploy = {s: b["deploy"] for s, b in m["sites"].items() if isinstance(b.get("deploy"), dict)}
    if deploy:  # deploy: best_val (metrics.json sites.<site>.deploy)
        print("deployed round (deploy: best_val): " + "; ".join(
            f"{s} round {d.get('round')} ({d.get('rule')}, validation balanced accuracy "
            + (f"{d['score']:.3f})" if isinstance(d.get("score"), (int, float)) and d["score"] >= 0 else "n/a)")
            for s, d in deploy.items()))
    if m.get("pooled"):
        acc = m["pooled"].get("accuracy") or {}
        if isinstance(acc, dict) and acc.get("value") is not None:
            print(f"pooled accuracy {acc['value']:.3f} (95% CI {acc['ci_low']:.3f}-{acc['ci_high']:.3f})")
    for site, b in m["sites"].items():
        cm = (b.get("test") or {}).get("confusion_matrix")
        if cm and sum(1 for col in zip(*cm) if sum(col) > 0) == 1:
            print(f"WARNING: {site}'s deployed model predicts a single class for every test image "
                  f"(confusion matrix {cm}); it has not learned a usable decision rule")
    if m.get("excluded_sites"):
        print("excluded sites (metrics.json: excluded_sites):")
        for site, events in m["excluded_sites"].items():
            reasons = list(dict.fromkeys(ev.get("reason") for ev in events))
            where = ", ".join(f"round {ev.get('round')} {ev.get('task')}" for ev in events)
            print(f"  {site}: {where}: " + " / ".join(str(r) for r in reasons))
    for note in m.get("notes") or []:  # FedSAF/FedTopo run reports (e.g. no_topq identical to the default)
        print(f"note: {note}")
    if m.get("tensorboard"):
        print(f"training curves (per-site loss, validation): tensorboard --logdir {m['tensorboard']}")


def run_export(args) -> int:
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.site_config import load_profile

    if not args.profile:
        print("cxr-hfl export-job: --profile DIR (the consortium's site names and model specs) is required",
              file=sys.stderr)
        return 2
    given = [k for k in SITE_OPTIONS if getattr(args, k, None) is not None]
    if given:
        keys = ", ".join(f"{SITE_OPTIONS[k]} (site key {SITE_KEYS[k]})" if k in SITE_KEYS else SITE_OPTIONS[k]
                         for k in given)
        print(f"cxr-hfl export-job: {keys}: with --profile each hospital's <site>.yaml decides this; a job does "
              "not carry it. Set it in the profile's site configs (and in each hospital's own config), or drop "
              "the option.", file=sys.stderr)
        return 2
    _defaults(args)
    profile = load_profile(args.profile, check_files=False, require_data=False)
    opts = _options(args, None, None, on_server=True)
    job = build_job(args.method, profile, opts, tracking=getattr(args, "tracking", "tensorboard"),
                    tracking_uri=getattr(args, "tracking_uri", None))
    out = Path(args.out).resolve()
    from nvflare_jobs.deploy import export_portable

    export_portable(job, out)  # site script path made relative to the app's custom/ folder (portable to sites)
    from nvflare_jobs.privacy import what_leaves

    print(f"[cxr-hfl] exported job {job.name} to {out / job.name} for sites {', '.join(profile)}")
    print(f"[cxr-hfl] each site sends: {what_leaves(args.method)}")
    print(f"submit with: nvflare job submit -j {out / job.name} --startup-kit <your coordinator kit folder>")
    print(f"   (POC:     cxr-hfl poc submit --workspace <POC folder> --job {out / job.name})")
    return 0
