"""Filling in a run's options namespace (``cxr-hfl simulate``, ``export-job``,
:func:`nvflare_jobs.simulation.simulate`) before anything is written: OHFL's fusion defaults or, with ``--paper``,
the OHFL paper's pipeline; every method's own options from the catalogue, checked with
``catalogue.validate_options``; the method's labels, rounds, input sizes and epochs. A bad option exits with one line
naming it (``sys.exit("cxr-hfl: ...")``). :mod:`nvflare_jobs.simulation` re-exports these names.
"""
from __future__ import annotations

import sys

from hfl_components.flare import catalogue

# OHFL fusion defaults, chosen on the fusion ladder (studies/fusion_defaults/RESULTS.md, tuning part only): the
# catalogue's OHFL options that the command line leaves unset until --paper has been applied.
OHFL_DEFAULTS = {o.key: o.default for o in catalogue.entry("ohfl").options
                 if o.cli_default is None and o.key != "alignment"}
# The OHFL paper's pipeline (OHFL paper, Sec. 4.2): Sinkhorn eps 0.01, "wts", 20 local / 50 fine-tuning epochs.
PAPER = {"ot": "sinkhorn", "ground_metric": "wts", "repair": "none", "cka": "linear", "probe_at": "largest",
         "init": "site", "gate": False, "strategy": "cid", "alignment": "cka", "local_epochs": 20,
         "finetune_epochs": 50, "distill_steps": 0}


def _ohfl_defaults(args) -> None:
    """Fill the OHFL fusion options left unset: from PAPER with --paper (an explicit conflicting option is an
    error), else from OHFL_DEFAULTS."""
    names = {"ot": "--ot", "ground_metric": "--ground-metric", "cka": "--cka", "probe_at": "--probe-at",
             "init": "--init", "gate": "--gate", "repair": "--repair", "strategy": "--strategy",
             "alignment": "--alignment", "distill_steps": "--distill-steps"}
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
        checked = catalogue.validate_options(args.method, {o.key: getattr(args, o.key, None) for o in e.options},
                                             require=False)
    except ValueError as err:
        sys.exit(f"cxr-hfl: {err}")
    for o in e.options:  # options given as text (a compare variant, a library caller) are kept typed, as argparse does
        if isinstance(getattr(args, o.key, None), str) and o.type is not str and o.fixed is catalogue._UNSET:
            setattr(args, o.key, checked[o.key])


def _check_local_epochs(args) -> None:
    """Exit with one line naming ``--local-epochs`` when it is below 1: every catalogue method trains its sites only
    in their local epochs (per round; OHFL and FENS: before their one upload), so 0 would fuse, average or upload
    untrained models."""
    v = getattr(args, "local_epochs", None)
    if v is not None and v < 1:
        when = ("before their one upload" if catalogue.entry(args.method).schedule in ("one_shot", "ensemble")
                else "per round")
        sys.exit(f"cxr-hfl: --local-epochs {v}: {args.method}'s sites must train at least 1 local epoch {when}; "
                 "give 1 or more")


def _defaults(args) -> None:
    _check_local_epochs(args)  # before anything is scanned or written
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
    if catalogue.entry(args.method).option("data_free") is not None:  # before anything is scanned or written
        from hfl_components.flare.distill_stage import check_probe_or_data_free

        try:
            check_probe_or_data_free(getattr(args, "probe", None), args.data_free, args.distill_steps)
        except ValueError as err:
            sys.exit(f"cxr-hfl: {err}")
    if catalogue.entry(args.method).option("prototypes") is not None and args.labels == "binary":
        print("WARNING: with 2 classes the prototype-level structural loss is constant (centred 2x2 Gram, a single "
              "RDM entry); only the instance-level term acts. Use --labels subtype for 3 classes.", file=sys.stderr)
    # Epochs given on the command line apply to every site (job-level task_config); otherwise each site's own config
    # decides (a config without them: the method default, hfl_components.flare.catalogue), and partition-generated
    # profiles get these defaults written into every site config.
    args.default_local_epochs = d["local_epochs"]
    args.default_finetune_epochs = d["finetune_epochs"]
