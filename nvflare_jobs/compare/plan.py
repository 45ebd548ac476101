"""What ``cxr-hfl compare`` runs: methods and variants, equal epoch budgets, each run's simulate options."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from hfl_components.flare import catalogue

# the method catalogue's control (role "control": Local), the local+ft control (its budget plus the one-shot
# method's fine-tuning) after it, then the other methods; what compare does with each comes from its entry
CONTROL = catalogue.with_role("control")
METHODS = (CONTROL, "local+ft", *(m for m in catalogue.methods() if m != CONTROL))
PROTO = catalogue.prototype_methods()


@dataclass
class CompareOptions:
    """One comparison's options, held once: what ``cxr-hfl compare`` parses and what a library caller (a study, a
    benchmark) passes to :func:`nvflare_jobs.compare.compare`. Every default is stated here only; the command line's
    flags take theirs from :data:`COMPARE_DEFAULTS`. ``None`` means "the method's or simulate's own default".

    ``probe`` and ``proto_protocol`` are filled in by the comparison itself (the committed probe part; whether the
    prototype methods' protocol applies); ``argv`` is the command as typed, kept for ``compare.json``.
    """

    out: str
    methods: str = "local,fedavg,ohfl"
    data: str | None = None
    sites: int = 6
    scheme: str = "width"
    alpha: float = 0.5
    labels: str = "binary"
    seeds: list = dataclasses.field(default_factory=lambda: [0])
    rounds: int | None = None
    local_epochs: int | None = None
    finetune_epochs: int | None = None
    unequal_budgets: bool = False
    external: str | None = None
    part: str | None = None
    external_max_images: int | None = None
    n_boot: int = 1000
    late_wait: int | None = None
    probe: str | None = None
    max_train_images: int | None = None
    input_sizes: list | None = None
    batch_size: int | None = None
    max_images: int | None = None
    families: str | None = None
    aspect: str | None = None
    augment: str | None = None
    # share of each side masked in every fusable site model's input (model spec ``frame_mask``); None: no mask
    frame_mask: float | None = None
    # with frame_mask: the inner region min-max scaled by its own extremes in the model (model spec frame_rescale)
    frame_rescale: bool = False
    no_audit: bool = False
    dry_run: bool = False
    proto_protocol: bool = False
    argv: list | None = None

    @classmethod
    def from_mapping(cls, given: dict) -> "CompareOptions":
        """The options from a mapping (a parsed command line's ``vars(args)`` or a caller's dict): keys that are not
        comparison options are ignored when they come from the command line (``command``, ``func``), refused
        otherwise.

        Raises:
            ValueError: ``out`` missing, or (for a caller's dict) a key that is not an option, named.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        if "out" not in given or not given["out"]:
            raise ValueError("compare: 'out' (the comparison folder) is required")
        cli = "func" in given
        unknown = sorted(k for k in given if k not in names and k not in ("_argv",))
        if unknown and not cli:
            raise ValueError(f"compare: unknown option(s) {', '.join(map(repr, unknown))}; "
                             f"options: {', '.join(sorted(names - {'proto_protocol', 'argv'}))}")
        opts = {k: v for k, v in given.items() if k in names}
        if "_argv" in given:
            opts["argv"] = given["_argv"]
        return cls(**opts)


#: the default of every comparison option (the command line's flags read theirs here)
COMPARE_DEFAULTS = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(CompareOptions) if f.name != "out"}


def _option_key(name: str) -> str:
    """A variant's option name (``strategy``, ``probe-at``, ``lambda``) as the options key (``probe_at``, ``lam``)."""
    flag = "--" + name.strip().replace("_", "-")
    for key, users in catalogue.all_options().items():
        if any(o.cli_flag == flag for _, o in users):
            return key
    return name.strip().replace("-", "_")


def split_variant(method: str) -> tuple[str, dict]:
    """``"ohfl:strategy=cdd:weighting=half"`` -> ``("ohfl", {"strategy": "cdd", "weighting": "half"})``: a method
    variant adds ``simulate`` options (values as typed; a name without ``=`` is a switch set to True, e.g.
    ``ohfl:paper``; a repeated list option such as ``ablate`` collects its values). The run folder and table rows
    keep the full name."""
    name, *opts = method.split(":")
    lists = {k for k, users in catalogue.all_options().items() if users[0][1].type is list}
    extra: dict = {}
    for o in opts:
        k, eq, v = o.partition("=")
        key = _option_key(k)
        if key in lists:
            extra.setdefault(key, []).append(v.strip())
        else:
            extra[key] = v.strip() if eq else True
    return name, extra


def check_variant(method: str, args=None) -> str | None:
    """Why the method variant ``method`` (e.g. ``ohfl:repair=foo``) would be refused by ``simulate``, as one line
    naming the variant and the option, or None when its options pass :func:`nvflare_jobs.spec.resolve` (the
    checks ``simulate`` runs before anything starts), so a bad variant is refused before any run. With the compare
    ``args``, the options compare would give ``simulate`` are checked (epochs included, e.g. ``ohfl:paper``
    against the equal budget's fine-tuning epochs)."""
    from nvflare_jobs.spec import cli_message, resolve

    name, extra = split_variant(method)
    if not extra and args is None:
        return None
    for key, v in extra.items():
        if v is True and _option_type(key) not in (bool, None):  # e.g. ohfl:local_epochs, read as 1 epoch
            return f"variant {method}: option {key} needs a value ({key}=...); only an on/off option may be named alone"
    opts = extra
    if args is not None:
        try:
            opts = simulate_options(method, Path("DATA"), 0, args)
        except BudgetError:  # refused with its own message once the budgets are planned
            pass
    try:
        spec = resolve(base_method(method), opts)
    except ValueError as e:  # a variant's own option is named as typed (key=value); compare's flags as flags
        return f"variant {method}: {e}" if extra else f"{method}: {cli_message(e)}"
    ignored = [w for w in spec.warnings if any(w.startswith(f"option {k!r}") for k in extra)]
    if ignored:  # simulate would drop it: the row would carry an option that never ran
        return f"variant {method}: {ignored[0].removesuffix('; ignored')}; a variant takes options of its method"
    return None


def _option_type(key: str):
    """The type of the option ``key`` (a catalogue option's, or a run option's); None if unknown."""
    from nvflare_jobs.spec import option

    o = option(key)
    return None if o is None else o.type


def base_method(method: str) -> str:
    name = split_variant(method)[0]
    return CONTROL if name == "local+ft" else name


def entry_of(method: str) -> catalogue.MethodEntry:
    """The catalogue entry of a compare method, variant or the local+ft control."""
    return catalogue.entry(base_method(method))


def proto_protocol(methods: list[str]) -> bool:
    """True when the methods are prototype methods, with or without Local (the prototype-method protocol): sites from
    ``chest_xray_224``'s tuning + probe parts (unless --data), Local on the same heterogeneous backbones and
    training defaults at the same rounds x local epochs."""
    bases = {base_method(m) for m in methods}
    return bool(bases & set(PROTO)) and bases <= set(PROTO) | {CONTROL}


def families_ignored(methods: list[str]) -> list[str]:
    """The methods of a comparison that ignore ``--families``: every prototype method and, in a prototype-method
    comparison (:func:`proto_protocol`), Local beside them; their sites train the heterogeneous backbone pool. The
    other methods take one model family per site from it (``write_method_profile``)."""
    proto = proto_protocol(methods)
    return [m for m in methods if proto or base_method(m) in PROTO]


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

    FENS (schedule ``ensemble``): L local epochs, one upload, then R aggregator rounds of A aggregator epochs with
    R x A = F (R = ``args.rounds``, which must divide F; default A = the entry's ``epochs_per_round``), so its
    budget is L + R x A = E; unequal budgets: its own defaults.

    Returns:
        ``{"rounds", "local_epochs", "finetune_epochs", "total_epochs_per_site"}``, plus ``"aggregator_epochs"``
        (per round) under the ``ensemble`` schedule.

    Prototype-method comparisons (``args.proto_protocol``, :func:`proto_protocol`): every method, Local included,
    runs the prototype methods' default rounds x local epochs (``--rounds`` / ``--local-epochs`` override).

    A variant's own epochs (``ohfl:local_epochs=25:finetune_epochs=5``, ``fedavg:rounds=10``) replace the planned
    ones, so the budget lines and ``compare.json`` state what the run trains; a value that is not an integer is left
    to :func:`check_variant`, which refuses it.

    Raises:
        BudgetError: ``args.rounds`` does not divide E (equal budgets).
    """
    plan = _planned(method, args)
    extra = split_variant(method)[1]
    fields = {"rounds": "rounds", "local_epochs": "local_epochs", "finetune_epochs": "finetune_epochs",
              AGGREGATOR_EPOCHS: "aggregator_epochs"}
    changed = False
    for key, field in fields.items():
        if key in extra and field in plan and not (key == "rounds" and entry_of(method).schedule == "one_shot"):
            try:
                plan[field] = int(extra[key])
            except (TypeError, ValueError):
                continue
            changed = True
    if changed:
        plan["total_epochs_per_site"] = (plan["local_epochs"] + plan["rounds"] * plan["aggregator_epochs"]
                                         if "aggregator_epochs" in plan else
                                         plan["rounds"] * plan["local_epochs"] + plan["finetune_epochs"])
    return plan


def _planned(method: str, args) -> dict[str, int]:
    """The budget :func:`epoch_plan` describes, before a variant's own epochs."""
    base = base_method(method)
    schedule = entry_of(method).schedule
    method = split_variant(method)[0]
    from hfl_components.flare.catalogue import method_defaults

    if args.proto_protocol:  # every method at the prototype methods' rounds x epochs
        d = method_defaults(PROTO[0])
        plan = {"rounds": args.rounds or d["rounds"],
                "local_epochs": args.local_epochs if args.local_epochs is not None else d["local_epochs"],
                "finetune_epochs": 0}
        plan["total_epochs_per_site"] = plan["rounds"] * plan["local_epochs"]
        return plan

    anchor = method_defaults(catalogue.with_schedule("one_shot"))  # E = the one-shot method's L + F
    ft_given = args.finetune_epochs if args.finetune_epochs is not None else anchor["finetune_epochs"]
    if not args.unequal_budgets:
        L = args.local_epochs if args.local_epochs is not None else anchor["local_epochs"]
        E = L + ft_given
        if entry_of(method).plan:  # a schedule of the method's own: its entry plans the common budget
            plan = dict(catalogue.resolve(entry_of(method).plan)(E, entry_of(method)))
            plan.setdefault("finetune_epochs", 0)
            plan.setdefault("total_epochs_per_site", plan["rounds"] * plan["local_epochs"] + plan["finetune_epochs"])
            if plan["total_epochs_per_site"] != E:
                raise BudgetError(f"{method}: its plan trains {plan['total_epochs_per_site']} epochs per site, not "
                                  f"the common budget of {E}")
            return plan
        if schedule == "one_shot":
            rounds, local, ft = 1, L, ft_given
        elif schedule == "ensemble":
            return _ensemble_plan(method, L, ft_given, args.rounds)
        elif schedule == "single":
            rounds, local, ft = 1, E, 0
        else:
            if args.rounds:
                if E % args.rounds:
                    raise BudgetError(f"--rounds {args.rounds} does not divide the common budget of {E} epochs per "
                                      f"site (--local-epochs {L} + --finetune-epochs {ft_given}); choose rounds that "
                                      "divide it, or pass --unequal-budgets")
                rounds = args.rounds
            else:
                rounds = E // _divisor_at_most(E, entry_of(method).epochs_per_round)
            local, ft = E // rounds, 0
    else:
        d = method_defaults(base)
        if schedule == "ensemble":
            agg = catalogue.option_defaults(base)[AGGREGATOR_EPOCHS]
            local = args.local_epochs if args.local_epochs is not None else d["local_epochs"]
            return _ensemble_plan(method, local, (args.rounds or d["rounds"]) * agg, args.rounds or d["rounds"])
        rounds = 1 if schedule == "one_shot" else (args.rounds or d["rounds"])
        local = args.local_epochs if args.local_epochs is not None else d["local_epochs"]
        if schedule == "single" and args.rounds is None and args.local_epochs is None:
            # the control = each site's own model trained as in the one-shot method's local phase
            rounds, local = 1, anchor["local_epochs"]
        if method == "local+ft":  # the control's whole budget in one run plus the fine-tuning epochs (= OHFL's total)
            rounds, local = 1, rounds * local + ft_given
        ft = ft_given if schedule == "one_shot" else 0
    plan = {"rounds": rounds, "local_epochs": local, "finetune_epochs": ft}
    plan["total_epochs_per_site"] = plan["rounds"] * plan["local_epochs"] + plan["finetune_epochs"]
    return plan


AGGREGATOR_EPOCHS = "fens_epochs"  # the ensemble schedule's aggregator epochs per round (FENS's option)


def _ensemble_plan(method: str, local: int, agg_total: int, rounds: int | None) -> dict[str, int]:
    """FENS's plan: ``local`` epochs, then ``rounds`` rounds splitting ``agg_total`` aggregator epochs evenly (default
    rounds: of the entry's ``epochs_per_round`` epochs, or the largest divisor of ``agg_total`` below it). Raises
    BudgetError when ``rounds`` does not divide ``agg_total``."""
    if agg_total <= 0:
        rounds, agg = rounds or 1, 0
    elif rounds:
        if agg_total % rounds:
            raise BudgetError(f"{method}: --rounds {rounds} does not divide the {agg_total} aggregator epochs of the "
                              "common budget (--finetune-epochs); choose rounds that divide it, or pass "
                              "--unequal-budgets")
        agg = agg_total // rounds
    else:
        agg = _divisor_at_most(agg_total, entry_of(method).epochs_per_round)
        rounds = agg_total // agg
    return {"rounds": rounds, "local_epochs": local, "finetune_epochs": 0, "aggregator_epochs": agg,
            "total_epochs_per_site": local + rounds * agg}


def budget_lines(plans: dict[str, dict], unequal: bool) -> list[str]:
    """Human-readable budget: one line per method, and whether the budgets are equal."""
    totals = {p["total_epochs_per_site"] for p in plans.values()}
    head = (f"equal budgets: every method trains {totals.pop()} epochs per site" if len(totals) == 1 else
            "UNEQUAL budgets (--unequal-budgets): epochs per site differ between methods")
    if not unequal and len({p["total_epochs_per_site"] for p in plans.values()}) > 1:
        head = "budgets differ between methods"
    lines = [head]
    for m, p in plans.items():
        if "aggregator_epochs" in p:  # FENS: its budget is the local epochs plus the aggregator epochs
            lines.append(f"{m}: {p['local_epochs']} local epochs, one upload, then {p['rounds']} aggregator round(s) x "
                         f"{p['aggregator_epochs']} aggregator epochs = {p['total_epochs_per_site']} epochs per site "
                         "(an aggregator epoch passes over the frozen site models' cached outputs on the held-out "
                         "images, far cheaper than a model epoch)")
            continue
        lines.append(f"{m}: {p['rounds']} round(s) x {p['local_epochs']} local epochs"
                     + (f" + {p['finetune_epochs']} fine-tuning epochs" if p.get("finetune_epochs") else "")
                     + f" = {p['total_epochs_per_site']} epochs per site")
    return lines


def simulate_options(method: str, data: Path, seed: int, args) -> dict:
    """The options (:func:`nvflare_jobs.spec.resolve`) of one compare run: its epoch plan, the data, seed,
    label scheme and pass-through settings, the probe for a method that has one, then the variant's options."""
    plan = epoch_plan(method, args)
    e = entry_of(method)
    opts = {"data": str(data), "labels": args.labels, "seed": seed, "local_epochs": plan["local_epochs"]}
    if e.schedule != "one_shot":
        opts["rounds"] = plan["rounds"]
    else:
        opts["finetune_epochs"] = plan["finetune_epochs"]
    if "aggregator_epochs" in plan:
        opts[AGGREGATOR_EPOCHS] = plan["aggregator_epochs"]
    if args.max_train_images:
        opts["max_train_images"] = args.max_train_images
    if args.batch_size:
        opts["batch_size"] = args.batch_size
    if args.late_wait is not None:
        opts["late_wait"] = args.late_wait
    extra = split_variant(method)[1]
    probe = args.probe
    if e.option("probe") is not None and probe and "probe" not in extra:
        opts["probe"] = str(probe)
    return {**opts, **extra}


def command_for(method: str, profile: Path, options: dict, out: Path) -> str:
    """The ``cxr-hfl simulate`` command line equivalent to a :func:`simulate_options` run (printed and recorded)."""
    import shlex

    flags = {key: o.cli_flag for key, users in catalogue.all_options().items() for _, o in users}
    argv = ["simulate", "--method", base_method(method), "--profile", str(profile)]
    for k, v in options.items():
        flag = flags.get(k, "--" + k.replace("_", "-"))
        for item in (v if isinstance(v, list) else [v]):
            argv += [flag] if item is True else [flag, str(item)]
    argv += ["--out", str(out), "--overwrite"]
    return "cxr-hfl " + " ".join(shlex.quote(a) for a in argv)


