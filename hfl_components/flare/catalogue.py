"""The method catalogue: one declarative entry per federated method.

Everything that needs to know a method reads its :class:`MethodEntry` here: the CLI (``--method`` choices, the
method-specific flags and their help), job building and export (``nvflare_jobs.jobs.make_controller``), ``cxr-hfl
compare`` (method list, epoch budgets), the profile writer (heterogeneous backbones for prototype methods), the
sites (epochs a site config leaves out), the privacy summary, the benchmarks' in-process harness and the report's
method order. Only plain data here: no NVFlare, torch or data imports (controllers are named by class path and
imported when a job is built).

An entry holds: the name, the server controller (class path), its site task handlers (task -> function path,
resolved at the site by :func:`site_handler`; ``evaluate`` is common to every method), the model family
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
fedprox  binary  3      2            10 (unused)
ohfl     binary  3 (*)  20           10
fedsaf   subtype 20     1            10 (unused)
fedproto subtype 20     1            10 (unused)
fedtopo  subtype 20     1            10 (unused)
fens     binary  5 (**) 20           10 (unused)
central  binary  1      30           10 (unused)
======== ======= ====== ============ ===============

(*) OHFL is one-shot: the server runs one upload and one fine-tuning step whatever ``rounds`` says.
(**) FENS: one upload after the local epochs, then ``rounds`` FedAvg rounds of ``fens_epochs`` aggregator epochs.
``central`` is the pooled-data reference, not a federated method (role ``ceiling``): one model trained on the union
of the sites' training images for ``local_epochs`` (compare: the common budget E = 30 by default).

Prototype methods: 20 rounds x 1 local epoch, chosen on the sites' validation splits with their other
training defaults (Adam 0.001, cosine lr over the rounds, class-balanced sampling, 64 px;
``nvflare_jobs.profiles.PROTO_TRAINING``; ``studies/proto_tuning/RESULTS.md``).
FedProto's alignment weights default to lambda 0 / gamma 1/64 (:data:`FEDPROTO_LAM`, :data:`FEDPROTO_GAMMA`: the
paper's instance-level MSE at its reference code's scale); FedSAF and FedTopo to 1 / 1.

Adding a method: one :class:`MethodEntry` (here, or :func:`register` for a method defined elsewhere) naming its
controller; see docs/INTERFACES.md, "Adding a method".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hfl_components.flare.options import (
    Option,
    OptionError,
    in_unit_interval,
    non_negative,
    repair_name,
    resolve,
    validate,
)

@dataclass(frozen=True)
class RecordField:
    """A method-specific field of the run record: the controller writes ``record[key]``; ``results`` copies it into
    ``metrics.json``, and ``status`` and ``compare`` show it as ``label: <summary>``.

    Args:
        key: the record's (and ``metrics.json``'s) key.
        label: a few words for ``status`` and ``compare`` (e.g. ``gate``).
        summary: path ``module:function`` turning the value into one short line (default: the value itself,
            shortened); None values are not shown.
    """

    key: str
    label: str
    summary: str = ""


# the record fields every method may write (the run's failure, its task config, payload bytes and notes;
# peer_model_bytes: {site: bytes of its own model} where the server sends every site's model to every other site)
COMMON_RECORD_KEYS = ("failed", "global_spec", "task_config", "payload", "notes", "peer_model_bytes")


@dataclass(frozen=True)
class MethodEntry:
    """One federated method (see the module docstring).

    Args:
        name: ``--method`` value and the name in results.
        controller: class path of its ``hfl_components.flare.controllers.HFLController`` subclass; the class's
            ``from_options(method, profile, opts, common, task_config)`` builds it from validated options.
        site_handlers: task -> path ``module:function`` of the site handler that answers it
            (``handler(rt, params, meta) -> (params, metrics, meta)``, :mod:`hfl_components.flare.site_methods`);
            resolved at the site by :func:`site_handler`. The common ``evaluate`` task is not listed. The first task
            is the method's training task (``FedAvgController``'s ``task_name``).
        family: ``fusable`` (cnn/vgg11, one architecture family that OHFL can fuse) or ``prototype``
            (heterogeneous backbones with a common ``feature_dim``).
        labels, rounds, local_epochs, finetune_epochs: defaults (module docstring table).
        options: the method's own options (the common ones -- rounds, epochs, seed, min_sites... -- are
            :data:`COMMON_OPTIONS`).
        upload_checks: task -> path ``module:function`` of the pure check (``hfl_components.upload_checks``) its
            controller runs on each upload.
        uploads: one sentence: what a site uploads besides the common task metadata (docs/DEPLOYMENT.md, Privacy).
        summary: one line for ``--help``.
        schedule: how ``cxr-hfl compare`` spends an equal epoch budget E on it: ``rounds`` (R rounds of E / R local
            epochs), ``single`` (one run of E epochs: the control) or ``one_shot`` (L local epochs, one fusion, F
            fine-tuning epochs; the budget is defined by the one-shot method's L + F, and its sites keep their
            pre-fusion local models) or ``ensemble`` (FENS: L local epochs, one upload, then R rounds x A
            aggregator epochs with R x A = F; its sites keep their local models).
        epochs_per_round: under ``rounds``, compare's default local epochs per round (R = E / this, or the largest
            divisor of E below it).
        role: ``control`` (the comparison's local control: ``local+ft``), ``reference`` (the federated baseline
            every method is also paired against) or empty.
        input_sizes: default input sizes (px) of the simulated sites, assigned by image width.
        presets: name -> {option key: value} applied when a run switches the preset on (OHFL's ``paper``: the
            paper's pipeline); a run that gives a contradicting value is refused.
        checks: paths ``module:function`` of the cross-option rules of a resolved run (``nvflare_jobs.spec``):
            ``check(spec)`` raises ValueError for an error and returns a warning line or None.
        record_fields: the method's own fields of the run record (:class:`RecordField`), beyond
            :data:`COMMON_RECORD_KEYS`: what ``results`` copies into ``metrics.json`` and ``status`` / ``compare``
            show. A method declares its fields here; no consumer lists methods.
        plan: under ``compare``'s equal budgets, a path ``module:function`` ``plan(budget, entry) -> {"rounds",
            "local_epochs", "finetune_epochs", ...}`` for a method whose schedule is none of the built-in ones
            (``schedule`` is then its own name); empty for the built-in schedules.
    """

    name: str
    controller: str
    site_handlers: dict
    family: str = "fusable"
    labels: str = "binary"
    rounds: int = 3
    local_epochs: int = 2
    finetune_epochs: int = 10
    options: tuple[Option, ...] = ()
    upload_checks: dict = field(default_factory=dict)
    uploads: str = ""
    summary: str = ""
    schedule: str = "rounds"
    epochs_per_round: int = 2
    role: str = ""
    input_sizes: tuple[int, ...] = (64, 96, 128)
    presets: dict = field(default_factory=dict)
    checks: tuple[str, ...] = ("hfl_components.flare.catalogue:check_local_epochs",)
    record_fields: tuple[RecordField, ...] = ()
    plan: str = ""

    @property
    def site_tasks(self) -> tuple[str, ...]:
        """The tasks the server sends: the method's own, then the common ``evaluate``."""
        return (*self.site_handlers, *(t for t in COMMON_SITE_HANDLERS if t not in self.site_handlers))

    @property
    def training_task(self) -> str:
        """The method's first (training) task."""
        return next(iter(self.site_handlers))

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


_CTL = "hfl_components.flare.controllers."
# the one task every method sends last: each site evaluates the model it deploys
COMMON_SITE_HANDLERS = {"evaluate": "hfl_components.flare.site_methods:evaluate_deployed"}
TOPOLOGY_ABLATIONS = ("no_reliability", "no_topq", "no_missing_mask", "no_ema", "local_topology")

# ---------------------------------------------------------------------------------------------------- options
COMMON_OPTIONS: tuple[Option, ...] = (
    Option("rounds", int, None, help="federated rounds (default: the method's; OHFL is one-shot; FENS: "
           "aggregator rounds after its one upload)"),
    Option("local_epochs", int, None, help="local epochs per round (OHFL, FENS: before the upload)"),
    Option("finetune_epochs", int, None, help="OHFL fine-tuning epochs at each site"),
    Option("finetune_lr", float, None),
    Option("seed", int, 0),
    Option("min_sites", int, None, help="fewest usable sites for a round to proceed (default N-1)"),
    Option("task_timeout", int, 0),
    Option("late_wait_s", int, None),
)

_OHFL = (
    Option("strategy", str, "cid", ("cid", "cdd", "cia", "rand"), "OHFL pairwise fusion order (OHFL paper, Sec. 3.3)"),
    Option("fusion_order", str, "pairwise", ("pairwise", "group"),
           "pairwise: every model fused pairwise (the paper); group: the models of one architecture merged at once "
           "(C2M3-style, cycle-consistent), then pairwise across architectures (strategy cid/cdd; off: "
           "studies/group_merge)", cli_default=None),
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
    Option("target_sensitivity", float, 0.95, None, "clinical operating point: the sensitivity the federated "
           "threshold on calibrated p(PNEUMONIA) must reach on the sites' pooled validation histograms",
           cli_default=None, check=lambda v: None if 0 < v <= 1 else f"target_sensitivity must be in (0, 1], got {v}"),
    Option("probe", str, None, None, "folder/CSV of public images for CKA and distillation, 'generated', or 'none' "
           "(no public images: needs --data-free) (default: the partition's probe.csv when it has one, else the "
           "committed probe part of the chest_xray_224 folder beside a chest_xray_original --data)",
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
    Option("distill_steps", int, 300, None, "after fusion, at most this many steps of ensemble distillation of every "
           "upload into each architecture's global model on the probe pool (FedDF); 0 = fusion alone "
           "(docs/decisions.md)", cli_default=None, check=non_negative("distill steps")),
    Option("distill_temperature", float, 2.0, None, "temperature of the distillation's soft targets (Hinton et al.)",
           check=lambda v: None if 0 < v < float("inf") else f"must be a finite number > 0, got {v}"),
    Option("distill_weights", str, "samples", ("samples", "score", "equal"),
           "teacher weights: training samples, validation AUC above chance, or equal"),
    Option("distill_augment", bool, False, None, "the sites' flip + affine on the distillation images (off: the "
           "main job's sites augment only their minority class, so their outputs on augmented images carry that "
           "label cue; studies/distillation/RESULTS.md)"),
    Option("distill_teacher", str, "average", ("average", "stacked"),
           "what the global model is distilled from: the uploads' weighted average, or a learned stacker of them "
           "fitted on the probe's public labels (cross-fitted; FENS-style; studies/levers/RESULTS.md)",
           cli_default=None),
    Option("distill_feature_weight", float, 0.0, None,
           "weight of a feature-distillation term beside the logits: the student's row-normalised Gram of a hidden "
           "layer on each probe batch taught by the teachers' average (similarity-preserving KD, Tung & Mori 2019); "
           "0 = logits only (off; studies/feature_distill/RESULTS.md)", cli_default=None,
           check=non_negative("distill feature weight")),
    Option("distill_feature_layer", str, "penultimate", ("penultimate", "aligned"),
           "the hidden layers of feature distillation: penultimate = the layer the class layer reads (every model "
           "family); aligned = every hidden layer of a fusable global model, taught by the upload layers OHFL's CKA "
           "+ DP layer alignment pairs with it (penultimate pairs where none exists)", cli_default=None),
    Option("distill_probe_size", int, 320, None, "probe images for distillation (a fifth held aside to stop early)",
           check=lambda v: None if v >= 10 else f"needs at least 10 images, got {v}"),
    Option("data_free", bool, False, None, "distil on generator images (DENSE) instead of the probe pool; required "
           "with --probe none", cli_default=None),
    Option("data_free_rounds", int, 20, None, "budget cap of the data-free distillation (generator/student rounds)",
           check=non_negative("data-free rounds")),
)
# Gradient-norm clip of local training with the alignment / topology loss: without it a FedProto-MSE run on
# chest_xray_224 (Dirichlet 0.1) blew one site's features up until every site's loss was inf in round 3.
GRAD_CLIP = Option("grad_clip", float, 10.0, None, "clip the global gradient norm of local training to this value "
                   "in rounds trained with the method's auxiliary loss (0 or none: no clip)", cli_default=None,
                   check=non_negative("grad-clip"))
# lambda / gamma: cli_default None so that each method fills in its own default (FedProto's differ, below)
_LAMBDA = Option("lam", float, 1.0, None, "FedSAF/FedProto: weight of the prototype-level term; FedTopo: weight of "
                 "the modulated CE", flag="--lambda", cli_default=None, check=non_negative("lambda"))
_GAMMA = Option("gamma", float, 1.0, None, "FedSAF/FedProto: weight of the instance-level term; FedTopo: modulation "
                "strength", cli_default=None, check=non_negative("gamma"))
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
        GRAD_CLIP,
    )


_FEDTOPO = (
    _LAMBDA, _GAMMA, GRAD_CLIP,
    Option("eval", str, "head", ("head",), "FedTopo evaluates with the site's own head only", strict=True),
    Option("top_q", int, 3, None, "FedTopo: negatives modulated per sample (clipped to C-1)",
           check=non_negative("top-q")),
    Option("rho", float, 0.7, None, "FedTopo: EMA factor of the global topology", check=in_unit_interval),
    Option("warmup", int, 3, None, "FedTopo: rounds without the topology loss", check=non_negative("warmup")),
    Option("ablate", list, [], TOPOLOGY_ABLATIONS, "FedTopo ablation (repeatable): server no_reliability/no_ema, "
           "site no_topq/no_missing_mask/local_topology", what="ablation"),
    Option("noisy_counts", float, None, None,
           "FedTopo: Laplace scale b added to the uploaded counts of present classes (>= 1 kept)",
           check=non_negative("noisy-counts scale")),
)

_FENS = (
    Option("fens_aggregator", str, "mlp", ("mlp", "linear"), "FENS aggregator over the site models' class "
           "log-probabilities: mlp (FENS's shallow network, one hidden ReLU layer) or linear"),
    Option("fens_hidden", int, 32, None, "hidden units of the mlp aggregator", check=lambda v: None if v >= 1 else f"needs at least 1, got {v}"),
    Option("fens_residual", bool, False, None, "add the site models' averaged probabilities (log) to the aggregator's "
           "output, last layer started at zero, so training starts from the site ensemble (not in FENS; off: "
           "FENS's plain aggregator)"),
    Option("fens_holdout", float, 0.1, None, "fraction of each site's training split held out of its local training "
           "to train the aggregator on", check=lambda v: None if 0 < v < 1 else f"must be in (0, 1), got {v}"),
    Option("fens_epochs", int, 2, None, "aggregator epochs per round at each site", check=non_negative("epochs")),
    Option("fens_lr", float, 0.01, None, "Adam learning rate of the aggregator",
           check=lambda v: None if 0 < v < float("inf") else f"must be a finite number > 0, got {v}"),
    Option("fens_distill_epochs", int, 0, None, "after the aggregator rounds, epochs in which each site distils the "
           "FENS ensemble (soft targets at T=2 + labels' CE) into its own model on its own training images and "
           "deploys that one model, deleting the ensemble (every peer model) from its state (0: off, FENS deploys "
           "the ensemble); extra site epochs", check=non_negative("epochs")),
)
_PROTO_UPLOAD = ("every round: C x d class prototypes (mean training feature per class) and the C training class "
                 "counts; the alignment loss terms of the last batch")
_PROTO_DEFAULTS = {"family": "prototype", "labels": "subtype", "rounds": 20, "local_epochs": 1, "epochs_per_round": 3,
                   "input_sizes": (64,)}
# The OHFL paper's pipeline (OHFL paper, Sec. 4.2): Sinkhorn eps 0.01, "wts", 20 local / 50 fine-tuning epochs.
PAPER = {"ot": "sinkhorn", "ground_metric": "wts", "repair": "none", "cka": "linear", "probe_at": "largest",
         "init": "site", "gate": False, "strategy": "cid", "fusion_order": "pairwise", "alignment": "cka",
         "local_epochs": 20, "finetune_epochs": 50, "distill_steps": 0}


def check_local_epochs(spec) -> None:
    """Every method trains its sites only in their local epochs (per round; OHFL and FENS: before their one upload),
    so fewer than 1 would fuse, average or upload untrained models. Raises OptionError naming the option."""
    v = spec.local_epochs
    if v is not None and v < 1:
        when = "before their one upload" if entry(spec.method).schedule in ("one_shot", "ensemble") else "per round"
        raise OptionError(f"option 'local_epochs' {v}: {spec.method}'s sites must train at least 1 local epoch "
                          f"{when}; give 1 or more")


def warn_binary_prototypes(spec) -> str | None:
    """A warning for a structural prototype loss on 2 classes, where it is constant (PITFALLS: prototypes)."""
    if spec.labels == "binary":
        return ("WARNING: with 2 classes the prototype-level structural loss is constant (centred 2x2 Gram, a "
                "single RDM entry); only the instance-level term acts. Use option 'labels' subtype for 3 classes.")
    return None


_PROTO_CHECKS = ("hfl_components.flare.catalogue:check_local_epochs",
                 "hfl_components.flare.catalogue:warn_binary_prototypes")

# ---------------------------------------------------------------------------------------------------- entries
_ENTRIES: list[MethodEntry] = [
    MethodEntry("local", _CTL + "baselines.LocalController",
                {"local_train": _CTL + "baselines:local_train"},
                uploads="nothing model-related", summary="each site trains alone (baseline)", schedule="single",
                role="control"),
    MethodEntry("fedavg", _CTL + "baselines.FedAvgController",
                {"fedavg_train": _CTL + "baselines:fedavg_train"},
                upload_checks={"fedavg_train": "hfl_components.upload_checks:check_fedavg_upload"},
                uploads="the full model (every weight) and its training sample count, every round",
                summary="FedAvg on the profile's deepest fusable architecture", role="reference"),
    MethodEntry("fedprox", _CTL + "baselines.FedAvgController", {"fedprox_train": _CTL + "fedprox:fedprox_train"},
                options=(Option("mu", float, 0.01, None, "FedProx proximal weight mu: each site minimises its loss + "
                                "mu/2 ||w - w_global||^2 (0 = FedAvg)", check=non_negative("mu")),),
                upload_checks={"fedprox_train": "hfl_components.upload_checks:check_fedavg_upload"},
                uploads="the full model (every weight) and its training sample count, every round",
                summary="FedProx (Li et al., 2020): FedAvg with a proximal term at each site"),
    MethodEntry("ohfl", _CTL + "ohfl.OHFLController",
                {"ohfl_train": _CTL + "ohfl_site:ohfl_train", "ohfl_finetune": _CTL + "ohfl_site:ohfl_finetune"},
                local_epochs=20, options=_OHFL, presets={"paper": PAPER},
                record_fields=(RecordField("gate", "gate", "hfl_components.flare.catalogue:summarise_gate"),
                               RecordField("operating_point", "operating point",
                                           "hfl_components.flare.catalogue:summarise_operating_point"),
                               RecordField("acceptance", "acceptance",
                                           "hfl_components.flare.catalogue:summarise_acceptance"),
                               RecordField("probe", "probe", "hfl_components.flare.catalogue:summarise_probe"),
                               RecordField("server_fusion_s", "fusion seconds",
                                           "hfl_components.flare.catalogue:summarise_seconds"),
                               RecordField("distillation", "distillation"), RecordField("groups", "groups"),
                               RecordField("global_specs", "global models"), RecordField("references", "references")),
                checks=("hfl_components.flare.catalogue:check_local_epochs",
                        "hfl_components.flare.distill_stage:check_run"),
                upload_checks={"ohfl_train": "hfl_components.upload_checks:check_model_upload"},
                uploads=("one trained model (every weight), once, with its validation accuracy and its test metrics; "
                         "after fusion the global model's zero-shot test metrics and the fine-tuning losses; for the "
                         "operating point the deployed model's temperature, its validation ECE before/after it and a "
                         "coarse per-class histogram of calibrated validation scores on a shared grid (every non-empty "
                         "cell >= 5 images of its class; a smaller class as its count only), then its own validation "
                         "and test sensitivity/specificity at the federated threshold"),
                summary="one-shot heterogeneous fusion (OHFL paper)", schedule="one_shot"),
    MethodEntry("fedsaf", _CTL + "fedsaf.FedSAFController", {"fedsaf_train": _CTL + "fedsaf:fedsaf_train"},
                **_PROTO_DEFAULTS, options=_fedsaf_options(False), checks=_PROTO_CHECKS,
                upload_checks={"fedsaf_train": "hfl_components.upload_checks:check_prototype_upload"},
                record_fields=(RecordField("effective_rank", "prototype effective rank"),),
                uploads=_PROTO_UPLOAD, summary="structure-aware prototype alignment (FedSAF paper)"),
    MethodEntry("fedproto", _CTL + "fedsaf.FedSAFController", {"fedsaf_train": _CTL + "fedsaf:fedsaf_train"},
                **_PROTO_DEFAULTS, options=_fedsaf_options(True), checks=_PROTO_CHECKS,
                upload_checks={"fedsaf_train": "hfl_components.upload_checks:check_prototype_upload"},
                record_fields=(RecordField("effective_rank", "prototype effective rank"),),
                uploads=_PROTO_UPLOAD, summary="FedSAF's framework with MSE alignment and FedProto prototypes (instance level, gamma 1/64)"),
    MethodEntry("fedtopo", _CTL + "fedtopo.FedTopoController", {"fedtopo_train": _CTL + "fedtopo:fedtopo_train"},
                **_PROTO_DEFAULTS, options=_FEDTOPO,
                upload_checks={"fedtopo_train": "hfl_components.upload_checks:check_topology_upload"},
                record_fields=(RecordField("R_global", "global topology"), RecordField("S_global", "reliability"),
                               RecordField("topology_history", "topology rounds")),
                uploads=("every round: a C x C class-relation matrix and the C training class counts "
                         "(Laplace-noised with --noisy-counts); the topology-inconsistency scores D_r/D_rs"),
                summary="class-relation topology exchange (FedTopo paper)"),
    MethodEntry("fens", _CTL + "fens.FENSController",
                {"fens_local": _CTL + "fens:fens_local", "fens_aggregate": _CTL + "fens:fens_aggregate"},
                rounds=5, local_epochs=20, options=_FENS, schedule="ensemble", epochs_per_round=2,
                record_fields=(RecordField("fens", "aggregator", "hfl_components.flare.catalogue:summarise_fens"),
                               RecordField("references", "references")),
                upload_checks={"fens_local": "hfl_components.upload_checks:check_model_upload",
                               "fens_aggregate": "hfl_components.upload_checks:check_fedavg_upload"},
                uploads=("one trained model (every weight), once; then every round the aggregator's weights and the "
                         "count of held-out training images it trained on (the server sends every site's model to "
                         "every site)"),
                summary="FENS (Allouah et al., 2024): one-shot upload, then a FedAvg-trained aggregator over every "
                        "site's frozen model"),
    # not a federated method: the pooled-data ceiling every method's gap is read against (compare, role ceiling);
    # one run of E epochs under compare's equal budgets (schedule single), 30 = the default E (OHFL's 20 + 10)
    MethodEntry("central", _CTL + "central.CentralController",
                {"central_train": _CTL + "central:central_train", "central_share": _CTL + "central:central_share",
                 "central_install": _CTL + "central:central_install"},
                rounds=1, local_epochs=30, schedule="single", role="ceiling",
                options=(Option("central_input_size", int, 128, None, "central: input size (px) of the one pooled "
                                "model, trained and scored at every site at this size",
                                check=lambda v: None if 16 <= v <= 1024 else f"must be 16 to 1024 px, got {v}"),),
                record_fields=(RecordField("central", "pooled data", "hfl_components.central:summarise"),),
                uploads=("pooled data, not a federated deployment: every training image (in the simulator its path, "
                         "the file's bytes counted), once; the site that trains the pooled model uploads it once"),
                summary="pooled-data reference (not federated): one model of the deepest site architecture trained "
                        "on the union of the sites' training images"),
]
CATALOGUE: dict[str, MethodEntry] = {e.name: e for e in _ENTRIES}


def _task_table(entries) -> dict[str, str]:
    """``{task: handler path}`` over ``entries`` and the common tasks; ValueError when two entries answer one task
    with different handlers (task names are global: a site resolves a task by its name)."""
    table = dict(COMMON_SITE_HANDLERS)
    for e in entries:
        for task, path in e.site_handlers.items():
            if table.setdefault(task, path) != path:
                raise ValueError(f"method {e.name!r}: task {task!r} is already answered by {table[task]}, not {path}")
    return table


_task_table(_ENTRIES)


def register(entry: MethodEntry) -> MethodEntry:
    """Add (or replace) a method entry at run time (a method defined outside this file, e.g. in a test or a
    plug-in module imported before the job is built). Returns the entry.

    Note: a method registered this way exists only in the process that registered it; an exported job that runs
    it needs the registering module imported on the server, and its sites can answer only tasks that some entry
    they know names (add the entry here for a permanent method).

    Raises:
        ValueError: the entry answers a task another entry answers with a different handler."""
    _task_table([*(e for m, e in CATALOGUE.items() if m != entry.name), entry])
    CATALOGUE[entry.name] = entry
    return entry


def site_handler(task: str):
    """The site handler of ``task`` (resolved from the catalogue entries' ``site_handlers``; ``evaluate`` is
    common), imported on use.

    Raises:
        ValueError: no entry answers ``task`` (the message lists the known tasks).
    """
    table = _task_table(CATALOGUE.values())
    if task not in table:
        raise ValueError(f"unknown task {task!r} (known: {sorted(table)})")
    return resolve(table[task])


def entry(method: str) -> MethodEntry:
    """The catalogue entry of ``method``.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    if method not in CATALOGUE:
        raise ValueError(f"unknown method {method!r}; known: {list(CATALOGUE)}")
    return CATALOGUE[method]


def with_role(role: str) -> str | None:
    """The first method whose entry has ``role`` (``control``, ``reference``), or None."""
    return next((m for m, e in CATALOGUE.items() if e.role == role), None)


def deployable(method: str) -> bool:
    """Whether ``method`` may run as an exported NVFlare job: False for the pooled-data reference (role
    ``ceiling``), whose sites would send their training images; it runs only in the simulator, beside the
    federated methods it is the ceiling of.

    Raises:
        ValueError: unknown method.
    """
    return entry(method).role != "ceiling"


def with_schedule(schedule: str) -> str | None:
    """The first method whose entry has ``schedule`` (``single``, ``rounds``, ``one_shot``), or None."""
    return next((m for m, e in CATALOGUE.items() if e.schedule == schedule), None)


def methods() -> tuple[str, ...]:
    """Every method's name, in catalogue order."""
    return tuple(CATALOGUE)


def builtin_methods() -> tuple[str, ...]:
    """The methods defined in this file (not those :func:`register` added at run time), in catalogue order."""
    return tuple(e.name for e in _ENTRIES)


def prototype_methods() -> tuple[str, ...]:
    """The prototype methods (family ``prototype``), in catalogue order."""
    return tuple(m for m, e in CATALOGUE.items() if e.prototype)


def is_prototype(method: str) -> bool:
    """True when ``method`` is a prototype method (unknown names: False)."""
    e = CATALOGUE.get(method)
    return bool(e and e.prototype)




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
    return validate(entry(method), opts, require=require)


def what_leaves(method: str) -> str:
    """What a site running ``method`` uploads on top of the common task metadata (the entry's ``uploads``).

    Raises:
        KeyError: unknown method.
    """
    if method not in CATALOGUE:
        raise KeyError(method)
    return CATALOGUE[method].uploads


# ------------------------------------------------------------------------------------------- record summaries
def record_summary(method: str, record: dict) -> list[tuple[str, str]]:
    """``[(label, one-line summary)]`` of the method's declared record fields present in ``record`` (a run record
    or ``metrics.json``), in declaration order: what ``status`` and ``compare`` show. Unknown methods: []."""
    e = CATALOGUE.get(method)
    out = []
    for f in (e.record_fields if e else ()):
        v = record.get(f.key)
        if v is None:
            continue
        text = resolve(f.summary)(v) if f.summary else _short(v)
        if text:
            out.append((f.label, text))
    return out


def _short(v, width: int = 80) -> str:
    import json

    t = v if isinstance(v, str) else json.dumps(v, default=str)
    return t if len(t) <= width else t[:width - 3] + "..."


def summarise_gate(v: dict) -> str:
    """OHFL's gate: how many sites adopted the federated model, and which kept their own."""
    if not isinstance(v, dict) or "adopted" not in v:
        return _short(v)
    kept = v.get("kept_local") or []
    return f"{v['adopted']} of {v.get('sites', '?')} sites adopted the federated model" + (
        f"; kept their local model: {', '.join(kept)}" if kept else "")


def summarise_operating_point(v: dict) -> str:
    """OHFL's federated operating point: the threshold and its target (or why there is none)."""
    if not isinstance(v, dict):
        return _short(v)
    if v.get("skipped"):
        return f"none: {v['skipped']}"
    if v.get("rule") == "per-model":
        return "per model: each site's own threshold on its acceptance data"
    thr, tgt = v.get("threshold"), v.get("target_sensitivity")
    return (f"threshold {thr:.3f}" if isinstance(thr, (int, float)) else "no threshold") + \
        (f" at target sensitivity {tgt}" if tgt is not None else "")


def summarise_acceptance(v: dict) -> str:
    """OHFL's site acceptance check: accepted sites, refusals and what they deployed, the refusal rate."""
    if not isinstance(v, dict) or "line" not in v:
        return _short(v)
    return str(v["line"]).removeprefix("site acceptance: ")


def summarise_probe(v: dict) -> str:
    """OHFL's probe pool: its image count and sizes."""
    if not isinstance(v, dict):
        return _short(v)
    return f"{v.get('n', '?')} images" + (f" at {v['sizes']} px" if v.get("sizes") else "")


def summarise_seconds(v: dict) -> str:
    """Seconds per phase, the largest first."""
    if not isinstance(v, dict):
        return _short(v)
    items = sorted(((k, x) for k, x in v.items() if isinstance(x, (int, float))), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {x:.1f} s" for k, x in items[:4])


def summarise_fens(v: dict) -> str:
    """FENS: the aggregator and its rounds."""
    if not isinstance(v, dict):
        return _short(v)
    return ", ".join(f"{k} {x}" for k, x in v.items() if not isinstance(x, (dict, list)))[:120]
