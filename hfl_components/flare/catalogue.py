"""The method catalogue: one declarative entry per federated method.

Everything that needs to know a method reads its :class:`MethodEntry` here: the CLI (``--method`` choices, the
method-specific flags and their help), job building and export (``nvflare_jobs.jobs.make_controller``), ``cxr-hfl
compare`` (method list, epoch budgets), the profile writer (heterogeneous backbones for prototype methods), the
sites (epochs a site config leaves out), the privacy summary, the benchmarks' in-process harness and the report's
method order. Only plain data here: no NVFlare, torch or data imports (controllers are named by class path and
imported when a job is built).

An entry holds: the name, the server controller (class path), the site task handlers it uses, the model family
(``fusable``: cnn/vgg11 that OHFL can fuse; ``prototype``: heterogeneous backbones with a common feature_dim), the
default label scheme, rounds and epochs, its options (type, allowed values, default, help; validated once by
:func:`validate_options` when the controller is built, and again when an exported job starts on the server), and
the checks on its uploads (task -> pure function path, run by the controller on every answer).

Default rounds and epochs (the simulator's, which the site configs used to contradict with 2 / 2 epochs for OHFL):

======== ======= ====== ============ ===============
method   labels  rounds local_epochs finetune_epochs
======== ======= ====== ============ ===============
local    binary  3      2            10 (unused)
fedavg   binary  3      2            10 (unused)
ohfl     binary  3 (*)  20           10
fedsaf   subtype 20     1            10 (unused)
fedproto subtype 20     1            10 (unused)
fedtopo  subtype 20     1            10 (unused)
======== ======= ====== ============ ===============

(*) OHFL is one-shot: the server runs one upload and one fine-tuning step whatever ``rounds`` says.

Prototype methods: 20 rounds x 1 local epoch, chosen on the sites' validation splits with their other
training defaults (Adam 0.001, cosine lr over the rounds, class-balanced sampling, 64 px;
``nvflare_jobs.profiles.PROTO_TRAINING``; ``studies/proto_tuning/RESULTS.md``).
FedProto's alignment weights default to lambda 0 / gamma 1/64 (:data:`FEDPROTO_LAM`, :data:`FEDPROTO_GAMMA`: the
paper's instance-level MSE at its reference code's scale); FedSAF and FedTopo to 1 / 1.

Adding a method: one :class:`MethodEntry` (here, or :func:`register` for a method defined elsewhere) naming its
controller; see docs/INTERFACES.md, "Adding a method".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

_UNSET = object()


@dataclass(frozen=True)
class Option:
    """One method option: ``opts[key]`` in a job, ``--flag`` on the command line.

    Args:
        key: the option's name in ``opts`` (and the argparse ``dest``).
        type: ``str``, ``int``, ``float``, ``bool`` or ``list`` (a repeatable flag; ``choices`` apply per item).
        default: the value used when the option is missing or None.
        choices: allowed values (None: any value of the type).
        help: one line for ``--help``.
        check: ``(value) -> error message or None`` for conditions beyond ``choices`` (ranges).
        flag: the command-line flag (default ``--key`` with ``_`` -> ``-``).
        cli_default: what argparse stores when the flag is absent (default: ``default``); None for options that
            are filled in later (so that ``--paper`` can tell "not given" from the default).
        required: a missing value is an error (the message is ``required``'s text).
        fixed: the method always uses this value whatever is given (``fedproto``'s alignment); the given value is
            still checked against ``choices``.
        what: the noun for one item in error messages (default: the key), e.g. ``ablation``.
        strict: the command line refuses the flag with a non-default value for a method that lacks the option
            (default: a warning that it is ignored).
    """

    key: str
    type: Any = str
    default: Any = None
    choices: tuple | None = None
    help: str = ""
    check: Callable[[Any], str | None] | None = None
    flag: str | None = None
    cli_default: Any = _UNSET
    required: str | None = None
    fixed: Any = _UNSET
    what: str | None = None
    strict: bool = False

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")

    @property
    def argparse_default(self):
        return self.default if self.cli_default is _UNSET else self.cli_default


@dataclass(frozen=True)
class MethodEntry:
    """One federated method (see the module docstring).

    Args:
        name: ``--method`` value and the name in results.
        controller: class path of its ``hfl_components.flare.controllers.HFLController`` subclass; the class's
            ``from_options(method, profile, opts, common, task_config)`` builds it from validated options.
        site_tasks: task names the server sends (answered by ``hfl_components.flare.site_methods.HANDLERS``).
        family: ``fusable`` (cnn/vgg11, one architecture family that OHFL can fuse) or ``prototype``
            (heterogeneous backbones with a common ``feature_dim``).
        labels, rounds, local_epochs, finetune_epochs: defaults (module docstring table).
        options: the method's own options (the common ones -- rounds, epochs, seed, min_sites... -- are
            :data:`COMMON_OPTIONS`).
        upload_checks: task -> path ``module:function`` of the pure check (``hfl_components.upload_checks``) its
            controller runs on each upload.
        uploads: one sentence: what a site uploads besides the common task metadata (docs/DEPLOYMENT.md, Privacy).
        summary: one line for ``--help``.
    """

    name: str
    controller: str
    site_tasks: tuple[str, ...]
    family: str = "fusable"
    labels: str = "binary"
    rounds: int = 3
    local_epochs: int = 2
    finetune_epochs: int = 10
    options: tuple[Option, ...] = ()
    upload_checks: dict = field(default_factory=dict)
    uploads: str = ""
    summary: str = ""

    @property
    def prototype(self) -> bool:
        """True for the prototype methods (heterogeneous backbones, prototype/topology exchange)."""
        return self.family == "prototype"

    def defaults(self) -> dict:
        """``{"labels", "rounds", "local_epochs", "finetune_epochs"}``."""
        return {"labels": self.labels, "rounds": self.rounds, "local_epochs": self.local_epochs,
                "finetune_epochs": self.finetune_epochs}

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.key == key), None)


def repair_name(v) -> str:
    """``repair`` as a name: True/False read as ``layer``/``none`` (``fusion.pairwise.repair_mode``)."""
    return {True: "layer", False: "none"}.get(v, v) if isinstance(v, bool) else str(v)


def _in_unit_interval(v) -> str | None:
    return None if 0.0 <= float(v) < 1.0 else f"rho must lie in [0, 1), got {v}"


def _non_negative(name: str) -> Callable[[Any], str | None]:
    """A check: ``v`` is None or a finite number >= 0 (a loss weight or noise scale; inf is refused too)."""
    def check(v):
        return None if v is None or 0 <= float(v) < math.inf else f"{name} must be a finite number >= 0, got {v}"
    return check


_CTL = "hfl_components.flare.controllers."
TOPOLOGY_ABLATIONS = ("no_reliability", "no_topq", "no_missing_mask", "no_ema", "local_topology")

# ---------------------------------------------------------------------------------------------------- options
COMMON_OPTIONS: tuple[Option, ...] = (
    Option("rounds", int, None, help="federated rounds (default: the method's; OHFL is one-shot)"),
    Option("local_epochs", int, None, help="local epochs per round (OHFL: before upload)"),
    Option("finetune_epochs", int, None, help="OHFL fine-tuning epochs at each site"),
    Option("finetune_lr", float, None),
    Option("seed", int, 0),
    Option("min_sites", int, None, help="fewest usable sites for a round to proceed (default N-1)"),
    Option("task_timeout", int, 0),
    Option("late_wait_s", int, None),
)

_OHFL = (
    Option("strategy", str, "cid", ("cid", "cdd", "cia", "rand"), "OHFL pairwise fusion order (OHFL paper, Sec. 3.3)"),
    Option("alignment", str, "cka", ("cka", "random"), "OHFL layer alignment: cka|random", cli_default=None),
    Option("ot", str, "emd", ("emd", "sinkhorn"), "OT solver (Sinkhorn uses the paper's eps = 0.01)",
           cli_default=None),
    Option("ground_metric", str, "acts", ("wts", "acts"), "OT ground metric: incoming weights or probe activations "
           "(evidence for the default: docs/decisions.md)",
           cli_default=None),
    Option("cka", str, "linear", ("linear", "debiased", "pooled"),
           "CKA for the layer alignment: linear (the paper's Eq. 1), debiased (unbiased HSIC), pooled (linear on "
           "conv channel means)", cli_default=None),
    Option("probe_at", str, "own", ("largest", "own"),
           "probe every model at the largest site input size, or each at its own size (same images); own is "
           "chosen together with repair=channel (docs/decisions.md)",
           cli_default=None),
    Option("init", str, "site", ("site", "shared"),
           "OHFL sites start from their own random initialisation, or from one shared (nested for different "
           "widths) initialisation drawn from --seed", cli_default=None),
    Option("gate", bool, True, None,
           "deployment gate: a site deploys the federated model only if it beats the site's own local model on its "
           "validation split, otherwise it keeps its local model and says so", cli_default=None),
    Option("probe", str, None, None, "folder/CSV of public images for CKA, or 'generated' (default: "
           "../shared/data/chest_xray_224 beside chest_xray_original)",
           required="OHFL needs a probe set of public images for CKA (--probe DIR or --probe generated)"),
    Option("probe_size", int, 64, None, "probe images for CKA and repair",
           check=lambda v: None if v >= 4 else f"needs at least 4 probe images (debiased CKA needs n > 3), got {v}"),
    Option("weighting", str, "samples", ("samples", "half"), "fusion weights: training samples or 1/2 each"),
    Option("repair", repair_name, "channel", ("none", "layer", "channel"),
           "after each pairwise fusion, match the fused model's activation statistics on the probe to its parents' "
           "(not in the paper): none, layer (one scale per layer) or channel (REPAIR: each neuron's mean and std "
           "through the OT plan; the default, with probe_at=own: docs/decisions.md)", cli_default=None),
    Option("server_device", str, "auto", None, "where the server runs OHFL's fusion probe passes (CKA, repair): "
           "auto|cpu|cuda|cuda:N (default auto = CUDA when present); sites choose theirs with the site-config key "
           "device"),
)
# lambda / gamma: cli_default None so that each method fills in its own default (FedProto's differ, below)
_LAMBDA = Option("lam", float, 1.0, None, "FedSAF/FedProto: weight of the prototype-level term; FedTopo: weight of "
                 "the modulated CE", flag="--lambda", cli_default=None, check=_non_negative("lambda"))
_GAMMA = Option("gamma", float, 1.0, None, "FedSAF/FedProto: weight of the instance-level term; FedTopo: modulation "
                "strength", cli_default=None, check=_non_negative("gamma"))
# FedProto's alignment weights. FedProto's loss (FedSAF paper Eq. 2, the FedProto baseline) is
# CE + lambda_FP * R(f(x), P_g^y) per sample: the instance level only, so the prototype level is off (lam 0). Its
# reference code takes R = nn.MSELoss (mean over the d feature elements) with lambda_FP = 1; our "mse" sums over d
# (losses.py, "Scale of lambda"), so lambda_FP = 1 is gamma = 1/d = 1/64 at the default feature_dim 64. Chosen on
# validation (studies/proto_tuning/RESULTS.md, "FedProto's alignment weights"): at lam = gamma = 1 the MSE term
# (~100x the paper's weight) pulls every site's features onto the averaged global prototypes, whose bacterial and
# viral rows end 0.08 apart, and the sites' heads collapse to one class.
FEDPROTO_LAM = 0.0
FEDPROTO_GAMMA = 1.0 / 64
_FEDPROTO_LAMBDA = Option("lam", float, FEDPROTO_LAM, None, _LAMBDA.help, flag="--lambda", cli_default=None,
                          check=_LAMBDA.check)
_FEDPROTO_GAMMA = Option("gamma", float, FEDPROTO_GAMMA, None, _GAMMA.help, cli_default=None, check=_GAMMA.check)
_SAF_ALIGNMENT = ("gcsa", "rcsa", "mse", "cosine")


def _fedsaf_options(fedproto: bool) -> tuple[Option, ...]:
    return (
        Option("alignment", str, "gcsa", _SAF_ALIGNMENT, "FedSAF alignment: gcsa|rcsa|mse|cosine",
               cli_default=None, **({"fixed": "mse"} if fedproto else {})),
        Option("prototypes", str, "fedproto", ("fedproto", "fixed", "tgp"),
               "FedSAF global prototypes: FedProto weighted mean (Eq. 3), fixed hypersphere (Eq. 4), trainable "
               "FedTGP-style (Eq. 5)", **({"fixed": "fedproto"} if fedproto else {})),
        Option("eval", str, "head", ("head", "nearest-prototype"),
               "FedSAF/FedProto evaluation: the site's own head (default) or the nearest of the site's own local "
               "prototypes (nearest-global is not offered)", strict=True),
        *((_FEDPROTO_LAMBDA, _FEDPROTO_GAMMA) if fedproto else (_LAMBDA, _GAMMA)),
    )


_FEDTOPO = (
    _LAMBDA, _GAMMA,
    Option("eval", str, "head", ("head",), "FedTopo evaluates with the site's own head only", strict=True),
    Option("top_q", int, 3, None, "FedTopo: negatives modulated per sample (clipped to C-1)",
           check=_non_negative("top-q")),
    Option("rho", float, 0.7, None, "FedTopo: EMA factor of the global topology", check=_in_unit_interval),
    Option("warmup", int, 3, None, "FedTopo: rounds without the topology loss", check=_non_negative("warmup")),
    Option("ablate", list, [], TOPOLOGY_ABLATIONS, "FedTopo ablation (repeatable): server no_reliability/no_ema, "
           "site no_topq/no_missing_mask/local_topology", what="ablation"),
    Option("noisy_counts", float, None, None,
           "FedTopo: Laplace scale b added to the uploaded counts of present classes (>= 1 kept)",
           check=_non_negative("noisy-counts scale")),
)

_PROTO_UPLOAD = ("every round: C x d class prototypes (mean training feature per class) and the C training class "
                 "counts; the alignment loss terms of the last batch")
_PROTO_DEFAULTS = {"family": "prototype", "labels": "subtype", "rounds": 20, "local_epochs": 1}

# ---------------------------------------------------------------------------------------------------- entries
_ENTRIES: list[MethodEntry] = [
    MethodEntry("local", _CTL + "LocalController", ("local_train", "evaluate"),
                uploads="nothing model-related", summary="each site trains alone (baseline)"),
    MethodEntry("fedavg", _CTL + "FedAvgController", ("fedavg_train", "evaluate"),
                upload_checks={"fedavg_train": "hfl_components.upload_checks:check_fedavg_upload"},
                uploads="the full model (every weight) and its training sample count, every round",
                summary="FedAvg on the profile's deepest fusable architecture"),
    MethodEntry("ohfl", _CTL + "OHFLController", ("ohfl_train", "ohfl_finetune", "evaluate"), local_epochs=20,
                options=_OHFL,
                upload_checks={"ohfl_train": "hfl_components.upload_checks:check_model_upload"},
                uploads=("one trained model (every weight), once, with its validation accuracy and its test metrics; "
                         "after fusion the global model's zero-shot test metrics and the fine-tuning losses"),
                summary="one-shot heterogeneous fusion (OHFL paper)"),
    MethodEntry("fedsaf", _CTL + "FedSAFController", ("fedsaf_train", "evaluate"), **_PROTO_DEFAULTS,
                options=_fedsaf_options(False),
                upload_checks={"fedsaf_train": "hfl_components.upload_checks:check_prototype_upload"},
                uploads=_PROTO_UPLOAD, summary="structure-aware prototype alignment (FedSAF paper)"),
    MethodEntry("fedproto", _CTL + "FedSAFController", ("fedsaf_train", "evaluate"), **_PROTO_DEFAULTS,
                options=_fedsaf_options(True),
                upload_checks={"fedsaf_train": "hfl_components.upload_checks:check_prototype_upload"},
                uploads=_PROTO_UPLOAD, summary="FedSAF's framework with MSE alignment and FedProto prototypes (instance level, gamma 1/64)"),
    MethodEntry("fedtopo", _CTL + "FedTopoController", ("fedtopo_train", "evaluate"), **_PROTO_DEFAULTS,
                options=_FEDTOPO,
                upload_checks={"fedtopo_train": "hfl_components.upload_checks:check_topology_upload"},
                uploads=("every round: a C x C class-relation matrix and the C training class counts "
                         "(Laplace-noised with --noisy-counts); the topology-inconsistency scores D_r/D_rs"),
                summary="class-relation topology exchange (FedTopo paper)"),
]
CATALOGUE: dict[str, MethodEntry] = {e.name: e for e in _ENTRIES}


def register(entry: MethodEntry) -> MethodEntry:
    """Add (or replace) a method entry at run time (a method defined outside this file, e.g. in a test or a
    plug-in module imported before the job is built). Returns the entry.

    Note: a method registered this way exists only in the process that registered it; an exported job that runs
    it needs the registering module imported on the server (add the entry here for a permanent method)."""
    CATALOGUE[entry.name] = entry
    return entry


def entry(method: str) -> MethodEntry:
    """The catalogue entry of ``method``.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    if method not in CATALOGUE:
        raise ValueError(f"unknown method {method!r}; known: {list(CATALOGUE)}")
    return CATALOGUE[method]


def methods() -> tuple[str, ...]:
    """Every method's name, in catalogue order."""
    return tuple(CATALOGUE)


def prototype_methods() -> tuple[str, ...]:
    """The prototype methods (family ``prototype``), in catalogue order."""
    return tuple(m for m, e in CATALOGUE.items() if e.prototype)


def is_prototype(method: str) -> bool:
    """True when ``method`` is a prototype method (unknown names: False)."""
    e = CATALOGUE.get(method)
    return bool(e and e.prototype)


# kept names (other modules and branches import them)
METHODS: tuple[str, ...] = methods()
PROTOTYPE_METHODS: tuple[str, ...] = prototype_methods()
METHOD_DEFAULTS: dict[str, dict] = {m: e.defaults() for m, e in CATALOGUE.items()}


def method_defaults(method: str) -> dict:
    """A copy of ``{"labels", "rounds", "local_epochs", "finetune_epochs"}`` for a method.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    return entry(method).defaults()


def option_defaults(method: str) -> dict:
    """``{key: default}`` of the method's own options."""
    return {o.key: (list(o.default) if isinstance(o.default, list) else o.default) for o in entry(method).options}


def all_options() -> dict[str, list[tuple[str, Option]]]:
    """``{key: [(method, Option), ...]}`` over every method's own options, in catalogue order (the CLI builds
    one flag per key from it)."""
    out: dict[str, list[tuple[str, Option]]] = {}
    for m, e in CATALOGUE.items():
        for o in e.options:
            out.setdefault(o.key, []).append((m, o))
    return out


class OptionError(ValueError):
    """A method option with a value the method does not accept; the message names the method and the option."""


def _check_one(method: str, o: Option, v) -> Any:
    """The checked, typed value of option ``o`` (``v`` not None)."""
    where = f"{method}: option {o.key!r} ({o.cli_flag})"
    if o.type is list:
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        bad = [x for x in items if o.choices is not None and x not in o.choices]
        if bad:
            raise OptionError(f"{where}: unknown {o.what or o.key} {bad}; allowed: {list(o.choices)}")
        return sorted(set(items))
    try:
        if o.type is bool:
            if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
                v = v.lower() in ("true", "1", "yes")
            elif not isinstance(v, (bool, int)):
                raise TypeError
            val = bool(v)
        elif o.type is int:
            if isinstance(v, float) and not v.is_integer():
                raise TypeError
            val = int(v)
        elif o.type is float:
            val = float(v)
            if math.isnan(val):
                raise TypeError
        else:
            val = o.type(v)
    except (TypeError, ValueError):
        raise OptionError(f"{where}: expected {o.type.__name__}, got {v!r}") from None
    if o.choices is not None and val not in o.choices:
        raise OptionError(f"{where} must be one of {list(o.choices)}, got {val!r} ({o.help})")
    if o.check is not None:
        msg = o.check(val)
        if msg:
            raise OptionError(f"{where}: {msg}")
    return val


def validate_options(method: str, opts: dict, *, require: bool = True) -> dict:
    """Check ``opts`` against the catalogue entry of ``method``, once, where the controller is built
    (``nvflare_jobs.jobs.make_controller``) and again when an exported job starts on the server
    (``HFLController.start_controller``, before any site trains).

    Returns:
        ``{key: value}`` of the method's own options (``require=False``: a missing required option is not an error
        yet, e.g. OHFL's probe before the command line resolves its default): the given value typed and checked, the default when missing
        or None, the ``fixed`` value where the method fixes one. Keys of other methods are ignored (one
        command line serves every method).

    Raises:
        ValueError: unknown method; ``OptionError`` (a ValueError) naming the method, the option and the allowed
        values for a bad value or a missing required one.
    """
    e = entry(method)
    out = {}
    for o in e.options:
        v = opts.get(o.key)
        if v is None:
            if o.required and o.fixed is _UNSET and require:
                raise OptionError(o.required)
            v = list(o.default) if isinstance(o.default, list) else o.default
            val = v
        else:
            val = _check_one(method, o, v)
        out[o.key] = o.fixed if o.fixed is not _UNSET else val
    return out


def resolve(path: str):
    """The object at ``"package.module:name"`` or ``"package.module.Name"`` (imported on use)."""
    import importlib

    mod, sep, name = path.partition(":")
    if not sep:
        mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def what_leaves(method: str) -> str:
    """What a site running ``method`` uploads on top of the common task metadata (the entry's ``uploads``).

    Raises:
        KeyError: unknown method.
    """
    if method not in CATALOGUE:
        raise KeyError(method)
    return CATALOGUE[method].uploads
