"""``cxr-hfl simulate`` (run a method in the NVFlare simulator) and ``cxr-hfl export-job``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hfl_components.flare import catalogue
from chest_xray import ASPECTS

ABLATIONS = catalogue.TOPOLOGY_ABLATIONS


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or any(not 16 <= x <= 1024 for x in v):  # a site config's input_size range (site_config.py)
        raise argparse.ArgumentTypeError(f"input sizes must be integers from 16 to 1024 px, got {s!r}")
    return v


def _sizes_text(s: str) -> str:
    """argparse type of a pass-through ``--input-sizes`` (``cxr-hfl compare``): checked as :func:`_ints` checks
    it, kept as the text given."""
    _ints(s)
    return s


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


LOG_MODES = ("concise", "msg_only", "full", "verbose", "reload")  # nvflare.fuel.utils.log_utils.LogMode


def _log_config(s: str) -> str:
    """argparse type of ``--log-config``: an NVFlare log mode, or an existing log config file (as an absolute
    path); anything else is refused in one line before the run folder is made (NVFlare failed on it only after
    the data were partitioned and its simulator had started)."""
    if s in LOG_MODES:
        return s
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"expected a log mode ({'|'.join(LOG_MODES[:4])}) or an existing log "
                                         f"config file, got {s!r} (no such file)")
    return str(Path(s).resolve())


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
                "feature_dim": "--feature-dim", "labels": "--labels", "families": "--families",
                "aspect": "--aspect"}
SITE_KEYS = {"input_sizes": "input_size", "batch_size": "batch_size", "max_train_images": "max_train_images",
             "feature_dim": "model.feature_dim", "labels": "data.labels", "families": "model.family",
             "aspect": "aspect"}


def _add_method_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=catalogue.methods(), required=True,
                   help="; ".join(f"{m}: {e.summary}" for m, e in catalogue.CATALOGUE.items()))
    protos = "/".join(catalogue.prototype_methods())
    p.add_argument("--data", help="data root (Kaggle layout, class folders, or CSV); default $CXR_DATA, ../shared/data "
                                  f"(chest_xray_original; {protos}: the tuning + probe parts of "
                                  "chest_xray_224, see chest_xray/splits.py)")
    p.add_argument("--profile", help="folder of <site>.yaml site configs (skips partitioning; default: none, --data "
                                     "is partitioned into --sites simulated sites)")
    p.add_argument("--sites", type=int, default=6, help="number of simulated hospital sites (default 6)")
    p.add_argument("--scheme", choices=("width", "dirichlet", "pathological"), default="width",
                   help="how the simulated sites are partitioned: width (OHFL resolution split, site-1 narrowest), "
                        "dirichlet (label skew, --alpha) or pathological (a fixed number of classes per site) "
                        "(default width)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha (dirichlet scheme; default 0.5)")
    p.add_argument("--labels", choices=("binary", "subtype"),
                   help="label scheme (default: the method's: " + ", ".join(
                       f"{m} {e.labels}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--rounds", type=_at_least(1), help="federated rounds (default: the method's: " + ", ".join(
        f"{m} {e.rounds}" for m, e in catalogue.CATALOGUE.items())
        + "; OHFL is one-shot; FENS: aggregator rounds after its one upload)")
    p.add_argument("--local-epochs", type=_at_least(0), help="local epochs per round, at least 1 (OHFL, FENS: before "
                   "the upload; "
                   "default: the method's: " + ", ".join(f"{m} {e.local_epochs}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--finetune-epochs", type=_at_least(0), help="OHFL fine-tuning epochs at each site (default "
                   f"{catalogue.entry('ohfl').finetune_epochs})")
    p.add_argument("--input-sizes", type=_ints,
                   help="input sizes (16 to 1024 px), smallest to largest, assigned to sites by image width (default 64,96,128; "
                        f"{protos}: 64)")
    p.add_argument("--batch-size", type=_at_least(1), default=16,
                   help="training batch size of every simulated site (default 16)")
    p.add_argument("--max-train-images", type=_at_least(1),
                   help="cap each site's training images (quick tests; default: no cap)")
    p.add_argument("--seed", type=_at_least(0), default=0,
                   help="seed of the run: partition, model initialisation and training (default 0)")
    fam_methods = ", ".join(m for m in catalogue.methods() if not catalogue.is_prototype(m))
    p.add_argument("--families", help=f"{fam_methods}: one model family per site, comma-separated in site order "
                   "(cnn, vgg11, hetero_cnn, densenet, resnet, efficientnet), e.g. the mixed-family variant "
                   "cnn,cnn,densenet,densenet,resnet,resnet (default: cnn at every site)")
    p.add_argument("--aspect", choices=ASPECTS, help="how every site makes non-square images square: stretch "
                   "(default), letterbox (zero padding) or crop (centred square); written into each generated site "
                   "config (docs/decisions.md)")
    p.add_argument("--min-sites", type=_at_least(1), help="fewest usable sites for a round to proceed (default N-1)")
    p.add_argument("--server-device", type=_device, default="auto",
                   help=catalogue.entry("ohfl").option("server_device").help)
    p.add_argument("--late-wait", type=_at_least(0), default=None,
                   help="fixed seconds to wait for the remaining sites once --min-sites have answered (0 = wait for "
                        "every live site). Default: adaptive, max(60 s, 3 x the slowest answering site's compute "
                        "time), keeping sites that still send heartbeats. Sites that are not running or have gone "
                        "silent are dropped at once either way.")
    p.add_argument("--feature-dim", type=_at_least(1), default=64, help="common feature dimension d of the site backbones "
                   f"({protos}; default 64)")
    _add_catalogue_options(p)
    from nvflare_jobs.jobs import add_tracking_args

    add_tracking_args(p)
    g = p.add_argument_group("OHFL")
    g.add_argument("--paper", action="store_true",
                   help="the OHFL paper's pipeline exactly: Sinkhorn (eps 0.01), wts, linear CKA, no repair, probe at "
                        "the largest size, per-site initialisation, no gate, no distillation, 20 local + 50 fine-tuning "
                        "epochs")
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
        elif any("(default" in h for h in helps):  # the help says it in its own words (--probe)
            dflt = ""
        else:
            dflt = " (default: none)"
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
    p.add_argument("--log-config", type=_log_config, help="NVFlare log mode or config file (concise|msg_only|full|verbose|FILE); "
                                        "overrides the quiet default and --verbose")
    p.add_argument("--gpu", type=_gpu_ids,
                   help="NVFlare simulator GPU option: GPU ids for the site processes, e.g. 0 or 0,1 (sites are "
                        "spread over them); a site uses its GPU when its config says device: auto or cuda (default: "
                        "none, no GPU ids are given to the simulator)")
    p.set_defaults(func=run_simulate)
    e = sub.add_parser("export-job", help="write an NVFlare job folder for `nvflare job submit -j`")
    _add_method_args(e)
    e.add_argument("--out", required=True, help="folder to export the job into")
    # site options given with --profile are refused (see SITE_OPTIONS): None tells "not given" from a default
    e.set_defaults(func=run_export, sites=None, scheme=None, alpha=None, input_sizes=None, batch_size=None,
                   feature_dim=None, families=None)


def options_from_argv(argv: list[str]) -> tuple[str, dict]:
    """``cxr-hfl simulate`` flags (without ``--out``) as ``(method, options)`` for
    :func:`nvflare_jobs.simulation.simulate` (``options["profile"]`` when ``--profile`` is given). Raises SystemExit
    (argparse's usage error, exit 2) for a bad flag."""
    from nvflare_jobs.simulation import DEFAULTS, method_option_defaults

    p = argparse.ArgumentParser(prog="cxr-hfl simulate", allow_abbrev=False)  # as the CLI's parsers
    _add_method_args(p)
    args = p.parse_args(argv)
    keys = {*DEFAULTS, *method_option_defaults(), "probe"}
    opts = {k: v for k, v in vars(args).items() if k in keys}
    if args.profile:
        opts["profile"] = args.profile
    return args.method, opts


def run_simulate(args) -> int:
    """``cxr-hfl simulate``: :func:`nvflare_jobs.simulation.simulate` with the command line's options."""
    from nvflare_jobs.simulation import DEFAULTS, SimulateError, method_option_defaults, simulate

    if args.profile and getattr(args, "aspect", None):  # the profile's site configs decide it; never drop it silently
        print(f"cxr-hfl simulate: --aspect {args.aspect}: with --profile each site config's aspect: key decides how "
              f"its images are squared; set it in {args.profile}/<site>.yaml, or drop the option", file=sys.stderr)
        return 2
    keys = {*DEFAULTS, *method_option_defaults(), "probe"}
    options = {k: v for k, v in vars(args).items() if k in keys}
    try:
        run = simulate(args.method, args.profile, options, args.out, overwrite=args.overwrite, verbose=args.verbose,
                       log_config=args.log_config, gpu=getattr(args, "gpu", None), command=" ".join(sys.argv))
    except SimulateError as e:
        sys.exit(f"cxr-hfl: {e}")
    return run.rc


def run_export(args) -> int:
    from nvflare_jobs.jobs import build_job
    from hfl_components.flare.site_config import load_profile

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
    from nvflare_jobs.simulation import _defaults, _options

    _defaults(args)
    profile = load_profile(args.profile, check_files=False, require_data=False)
    opts = _options(args, None, None, on_server=True)
    job = build_job(args.method, profile, opts, tracking=getattr(args, "tracking", "tensorboard"),
                    tracking_uri=getattr(args, "tracking_uri", None))
    out = Path(args.out).resolve()
    from nvflare_jobs.deploy import export_portable

    export_portable(job, out)  # site script path made relative to the app's custom/ folder (portable to sites)
    from hfl_components.flare.privacy import what_leaves

    print(f"[cxr-hfl] exported job {job.name} to {out / job.name} for sites {', '.join(profile)}")
    print(f"[cxr-hfl] each site sends: {what_leaves(args.method)}")
    from hfl_components.flare.catalogue import entry, resolve

    sends = getattr(resolve(entry(args.method).controller), "payload_summary", None)  # a method that says it (FENS)
    if sends is not None:
        print(f"[cxr-hfl] {sends(profile, opts)}")
    print(f"submit with: nvflare job submit -j {out / job.name} --startup-kit <your coordinator kit folder>")
    print(f"   (POC:     cxr-hfl poc submit --workspace <POC folder> --job {out / job.name})")
    return 0
