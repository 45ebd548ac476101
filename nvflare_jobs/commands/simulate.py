"""``cxr-hfl simulate`` (run a method in the NVFlare simulator) and ``cxr-hfl export-job``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hfl_components.flare import catalogue
from chest_xray import ASPECTS
from hfl_components.flare.site_config import AUGMENTS
from nvflare_jobs.deploy import not_a_job
from nvflare_jobs.runner import SimulateError
from nvflare_jobs.spec import RUN_OPTIONS, cli_message, option, resolve

ABLATIONS = catalogue.TOPOLOGY_ABLATIONS


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or any(not 16 <= x <= 1024 for x in v):  # a site config's input_size range (site_config.py)
        raise argparse.ArgumentTypeError(f"input sizes must be integers from 16 to 1024 px, got {s!r}")
    return v


def sizes_text(s: str) -> str:
    """argparse type of a pass-through ``--input-sizes`` (``cxr-hfl compare``): checked as :func:`_ints` checks
    it, kept as the text given."""
    _ints(s)
    return s


def at_least(minimum: int):
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


def device_arg(s: str) -> str:
    from hfl_components.training.device import check_device_name

    try:
        return check_device_name(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _help(key: str, extra: str = "") -> str:
    """The help of a run option, with its default as :data:`nvflare_jobs.spec.RUN_OPTIONS` declares it."""
    o = option(key)
    dflt = "" if o.default is None or "(default" in o.help else f" (default {o.default})"
    return o.help + extra + dflt


def _add_method_args(p: argparse.ArgumentParser) -> None:
    """The flags of one run: the run options (:data:`nvflare_jobs.spec.RUN_OPTIONS`) and every catalogue method's
    options. No flag holds a default: a flag not given is absent from the namespace, and
    :func:`nvflare_jobs.spec.resolve` fills it in from the declarations (one owner per default)."""
    S = argparse.SUPPRESS
    p.add_argument("--method", choices=catalogue.methods(), required=True,
                   help="; ".join(f"{m}: {e.summary}" for m, e in catalogue.CATALOGUE.items()))
    protos = "/".join(catalogue.prototype_methods())
    p.add_argument("--data", default=S, help=_help("data", f" ({protos}: the tuning + probe parts of "
                                                            "chest_xray_224, see chest_xray/splits.py)"))
    p.add_argument("--profile", default=S, help=_help("profile"))
    p.add_argument("--sites", type=int, default=S, help=_help("sites"))  # checked with the other site options
    p.add_argument("--scheme", choices=option("scheme").choices, default=S, help=_help("scheme"))
    p.add_argument("--alpha", type=float, default=S, help=_help("alpha"))
    p.add_argument("--labels", choices=option("labels").choices, default=S,
                   help="label scheme (default: the method's: " + ", ".join(
                       f"{m} {e.labels}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--rounds", type=at_least(1), default=S,
                   help="federated rounds (default: the method's: " + ", ".join(
                       f"{m} {e.rounds}" for m, e in catalogue.CATALOGUE.items())
                   + "; OHFL is one-shot; FENS: aggregator rounds after its one upload)")
    p.add_argument("--local-epochs", type=at_least(0), default=S,
                   help="local epochs per round, at least 1 (OHFL, FENS: before the upload; default: the method's: "
                        + ", ".join(f"{m} {e.local_epochs}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--finetune-epochs", type=at_least(0), default=S,
                   help=f"OHFL fine-tuning epochs at each site (default {catalogue.entry('ohfl').finetune_epochs})")
    p.add_argument("--input-sizes", type=_ints, default=S,
                   help="input sizes (16 to 1024 px), smallest to largest, assigned to sites by image width "
                        "(default: the method's: " + ", ".join(
                            f"{m} {','.join(map(str, e.input_sizes))}" for m, e in catalogue.CATALOGUE.items()) + ")")
    p.add_argument("--batch-size", type=at_least(1), default=S, help=_help("batch_size"))
    p.add_argument("--max-train-images", type=at_least(1), default=S, help=_help("max_train_images"))
    p.add_argument("--seed", type=at_least(0), default=S, help=_help("seed"))
    fam_methods = ", ".join(m for m in catalogue.methods() if not catalogue.is_prototype(m))
    p.add_argument("--families", default=S, help=f"{fam_methods}: " + _help("families"))
    p.add_argument("--aspect", choices=ASPECTS, default=S, help=_help("aspect"))
    p.add_argument("--augment", choices=AUGMENTS, default=S, help=_help("augment"))
    p.add_argument("--min-sites", type=at_least(1), default=S, help=_help("min_sites"))
    p.add_argument("--server-device", type=device_arg, default=S,
                   help=catalogue.entry("ohfl").option("server_device").help)
    p.add_argument("--late-wait", type=at_least(0), default=S, help=_help("late_wait"))
    p.add_argument("--feature-dim", type=at_least(1), default=S, help=f"{protos}: " + _help("feature_dim"))
    _add_catalogue_options(p)
    p.add_argument("--tracking", choices=option("tracking").choices, default=S, help=_help("tracking"))
    p.add_argument("--tracking-uri", default=S, help=_help("tracking_uri"))
    g = p.add_argument_group("OHFL")
    g.add_argument("--paper", action="store_true", default=S,
                   help="the OHFL paper's pipeline exactly: " + ", ".join(
                       f"{k}={v}" for k, v in catalogue.entry("ohfl").presets["paper"].items()))
    g.add_argument("--no-repair", dest="repair", action="store_const", const="none", default=S,
                   help="same as --repair none")


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
        defaults = {m: (f"{o.fixed} (fixed)" if o.has_fixed else o.default) for m, o in users
                    if o.default is not None and o.default != []}
        if defaults and len({repr(v) for v in defaults.values()}) == 1:
            dflt = f" (default {next(iter(defaults.values()))})"
        elif defaults:
            dflt = " (default " + ", ".join(f"{m} {v}" for m, v in defaults.items()) + ")"
        elif any("(default" in h for h in helps):  # the help says it in its own words (--probe)
            dflt = ""
        else:
            dflt = " (default: none)"
        kw = {"dest": key, "default": argparse.SUPPRESS,
              "help": f"[{', '.join(m for m, _ in users)}] " + "; ".join(helps) + dflt}
        choices = [c for _, o in users for c in (o.choices or ())]
        if choices and all(o.choices for _, o in users):
            kw["choices"] = list(dict.fromkeys(choices))
        if first.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif first.type is list:
            kw["action"] = "append"
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
    e = sub.add_parser("export-job", help="write an NVFlare job folder for `cxr-hfl submit`")
    _add_method_args(e)
    e.add_argument("--out", required=True, help="folder to export the job into")
    # site options given with --profile are refused (see SITE_OPTIONS): None tells "not given" from a default
    e.set_defaults(func=run_export)


def given_options(args: argparse.Namespace) -> dict:
    """The run options given on a command line parsed by :func:`_add_method_args` (flags not given are absent)."""
    keys = {o.key for o in RUN_OPTIONS} | set(catalogue.all_options())
    return {k: v for k, v in vars(args).items() if k in keys}


def options_from_argv(argv: list[str]) -> tuple[str, dict]:
    """``cxr-hfl simulate`` flags (without ``--out``) as ``(method, given options)`` for
    :func:`nvflare_jobs.spec.resolve`. Raises SystemExit (argparse's usage error, exit 2) for a bad flag."""
    p = argparse.ArgumentParser(prog="cxr-hfl simulate", allow_abbrev=False)  # as the CLI's parsers
    _add_method_args(p)
    args = p.parse_args(argv)
    return args.method, given_options(args)


def warn(line: str) -> None:
    """Print one of a spec's warnings as the command line says it (options as flags)."""
    line = cli_message(line)
    print(line if line.startswith("WARNING") else f"WARNING: {line}", file=sys.stderr)


def cli_spec(argv: list[str]):
    """``cxr-hfl simulate`` flags as a resolved spec, its warnings printed: what the command does before it runs.
    Raises SystemExit with the command's one-line message for a bad option."""
    method, given = options_from_argv(argv)
    try:
        spec = resolve(method, given)
    except SimulateError as e:
        raise SystemExit(f"cxr-hfl: {cli_message(e)}") from None
    for w in spec.warnings:
        warn(w)
    return spec


def run_simulate(args) -> int:
    """``cxr-hfl simulate``: :meth:`nvflare_jobs.spec.RunSpec.simulate` of the command line's options."""
    given = given_options(args)
    for key in ("aspect", "augment"):  # the profile's site configs decide them; never drop one silently
        if given.get("profile") and given.get(key):
            print(f"cxr-hfl simulate: --{key} {given[key]}: with --profile each site config's {key}: key decides it; "
                  f"set it in {given['profile']}/<site>.yaml, or drop the option", file=sys.stderr)
            return 2
    try:
        spec = resolve(args.method, given)
        return spec.simulate(args.out, overwrite=args.overwrite, verbose=args.verbose, log_config=args.log_config,
                             gpu=getattr(args, "gpu", None), command=" ".join(sys.argv), warn=warn).rc
    except SimulateError as e:
        sys.exit(f"cxr-hfl: {cli_message(e)}")


def run_export(args) -> int:
    """``cxr-hfl export-job``: :meth:`nvflare_jobs.spec.RunSpec.export` of the command line's options."""
    from hfl_components.flare.privacy import what_leaves
    from hfl_components.flare.site_config import load_profile

    given = given_options(args)
    if not catalogue.deployable(args.method):
        print(f"cxr-hfl export-job: {not_a_job(args.method)}", file=sys.stderr)
        return 2
    if not given.get("profile"):
        print("cxr-hfl export-job: --profile DIR (the consortium's site names and model specs) is required",
              file=sys.stderr)
        return 2
    try:
        spec = resolve(args.method, given)
        job_dir = spec.export(args.out, given=set(given))
    except SimulateError as e:
        print(f"cxr-hfl export-job: {cli_message(e)}", file=sys.stderr)
        return 2
    profile = load_profile(spec.profile, check_files=False, require_data=False)
    print(f"[cxr-hfl] exported job {job_dir.name} to {job_dir} for sites {', '.join(profile)}")
    print(f"[cxr-hfl] each site sends: {what_leaves(spec.method)}")
    sends = getattr(catalogue.resolve(spec.entry.controller), "payload_summary", None)  # a method that says it (FENS)
    if sends is not None:
        print(f"[cxr-hfl] {sends(profile, spec.job_options(spec.options.get('probe')))}")
    print(f"submit with: cxr-hfl submit --job {job_dir} --startup-kit <your coordinator kit folder>")
    print(f"   (POC:     cxr-hfl poc submit --workspace <POC folder> --job {job_dir})")
    return 0
