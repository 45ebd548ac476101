"""Differentially private local training at a site: DP-SGD with Opacus and its accountant.

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, arXiv:1607.00133): every step samples a
Poisson batch (each training image independently with probability ``q``), clips each image's gradient to L2 norm
``C`` (``max_grad_norm``), sums the clipped gradients, adds Gaussian noise ``N(0, (sigma C)^2 I)`` and divides by the
expected batch size. The privacy loss of all steps together is tracked by Opacus's accountant (PRV: Gopi et al.
2021, arXiv:2106.02848, Opacus's default; or RDP: Mironov 2017, arXiv:1702.07476), never by hand. The guarantee
is image-level (example-level) (epsilon, delta)-DP under add/remove adjacency for everything computed from the
noised gradients: the uploaded weights, and any function of them (post-processing).

The pieces, in the order a site uses them:

* :class:`DPSpec` -- a site's ``dp: {epsilon, delta, max_grad_norm, ...}``, checked on construction
  (:meth:`DPSpec.from_config` adds the site and config file to each message).
* :func:`default_delta` -- ``delta = 1 / (DELTA_FACTOR * n)``, an order of magnitude below ``1/n``.
* :func:`check_budget` -- before any training: refuses an impossible budget in one line naming the site
  (:class:`DPBudgetError`) and returns the :class:`DPPlan` (noise multiplier from Opacus's
  ``get_noise_multiplier`` for the exact number of steps, sample rate, steps).
* :class:`DPSession` -- holds one Opacus ``PrivacyEngine`` (and so one accountant) across every training call of
  a job at a site (FedAvg trains once per round; the budget covers all rounds together).
  :meth:`DPSession.private` makes a model / optimizer / data loader private for one call (Opacus ``make_private``
  with Poisson sampling, hooks attached to the model itself so ``features`` / ``head`` and the state-dict keys stay
  as they are) and removes the hooks afterwards. :meth:`DPSession.record` is what the site records. With a
  ``ledger`` file the session writes its plan and the accountant's history after every step and a session built on
  the same file continues from them (a site process restarted mid-job does not count epsilon from zero).
* :func:`make_private` -- the one-call form: plan + session + private objects.
* :func:`epsilon_from_record` -- epsilon recomputed from a record with Opacus's accountant (a reader's check).
* :func:`make_compatible` / :func:`compatibility_report` -- BatchNorm models: Opacus's ``ModuleValidator.fix``
  (BatchNorm -> GroupNorm) and the line ``cxr-hfl site check`` prints.

Why ``make_private`` with a noise multiplier from ``get_noise_multiplier(steps=...)`` rather than Opacus's
``make_private_with_epsilon(epochs=...)``: the latter counts ``int(epochs / sample_rate)`` steps, which floating
point makes one short for some loader lengths (e.g. 3 epochs of 75 batches give 224 steps), so the accountant
would end a hair above the target. Opacus's ``DPDataLoader`` also runs ``int(1 / (1 / L))`` batches per epoch
(92 for L = 93); :func:`check_budget` uses the same expression, so the plan's steps are the steps taken.

Everything under ``dp`` is image-level DP of the *training* data only. What else leaves a site (training losses,
counts, validation summaries) is handled in :mod:`hfl_components.privacy.releases`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

#: Opacus accountants this project allows (``PrivacyEngine(accountant=...)``): ``prv`` (Opacus's default, tighter)
#: and ``rdp`` (faster, a little looser).
ACCOUNTANTS = ("prv", "rdp")
#: What is sent of the per-epoch training losses under dp: ``drop`` (nothing; the default) or ``noisy`` (each
#: step's sum of clipped per-image losses with Gaussian noise, accounted together with the gradients).
LOSS_RELEASES = ("drop", "noisy")
#: default delta = 1 / (DELTA_FACTOR * n) for n training images: strictly below 1/n, the delta at which releasing
#: one random image in the clear would already be "private".
DELTA_FACTOR = 10
#: Default per-image gradient clip C (Opacus's tutorials' value).
DEFAULT_MAX_GRAD_NORM = 1.0
#: Default clip of a per-image training loss (nats) when losses are released with noise.
DEFAULT_LOSS_CLIP = 5.0
#: A session restored from a ledger after k steps seeds its noise with ``seed + LEDGER_SEED_STRIDE * k``.
LEDGER_SEED_STRIDE = 1_000_003
#: ``get_noise_multiplier`` gives up above this noise multiplier (its ``MAX_SIGMA``): the budget is unreachable.
_SIGMA_CAP = 1e6
#: Relative fall of the accountant's epsilon over one doubling of the noise below which it has reached its floor.
_FLOOR_RTOL = 0.01


class DPBudgetError(ValueError):
    """A dp budget that cannot be met (one line naming the site); raised before any training."""


@dataclass(frozen=True)
class DPSpec:
    """A site's differential-privacy settings (the site config's ``dp`` mapping), checked on construction.

    Attributes:
        epsilon: target epsilon of the whole job's training at this site (> 0, finite; no dp = no ``DPSpec``).
        delta: target delta in (0, 1); None = :func:`default_delta` of the site's training-image count.
        max_grad_norm: per-image gradient clip C (L2 norm, > 0).
        accountant: one of :data:`ACCOUNTANTS` (Opacus's accountant; default ``prv``).
        losses: one of :data:`LOSS_RELEASES`: what leaves of the training losses (default ``drop``).
        loss_clip: per-image loss clip (nats, > 0) used when ``losses="noisy"``.
        count_epsilon: epsilon of the discrete-Laplace noise on the released training-set size
            (:func:`hfl_components.privacy.releases.noisy_count`); None = the size is sent exactly and declared
            public to the consortium.

    Raises:
        ValueError: any value out of range (the message names the key).
        TypeError: a value that is not a number / string.
    """

    epsilon: float
    delta: float | None = None
    max_grad_norm: float = DEFAULT_MAX_GRAD_NORM
    accountant: str = "prv"
    losses: str = "drop"
    loss_clip: float = DEFAULT_LOSS_CLIP
    count_epsilon: float | None = None

    def __post_init__(self):
        _positive("epsilon", self.epsilon, hint="leave dp out for no differential privacy")
        if self.delta is not None:
            d = _number("delta", self.delta)
            if not 0.0 < d < 1.0:
                raise ValueError(f"dp.delta must be in (0, 1), got {self.delta!r}")
        _positive("max_grad_norm", self.max_grad_norm)
        _positive("loss_clip", self.loss_clip)
        if self.count_epsilon is not None:
            _positive("count_epsilon", self.count_epsilon)
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"dp.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if self.losses not in LOSS_RELEASES:
            raise ValueError(f"dp.losses must be one of {', '.join(LOSS_RELEASES)}, got {self.losses!r}")

    @classmethod
    def from_config(cls, raw: Mapping, site: str, path: str = "<memory>") -> "DPSpec":
        """Build from a site config's ``dp`` mapping; every error is one line naming the site, file and key.

        Raises:
            ValueError: not a mapping, an unknown key, a missing ``epsilon`` or a bad value.
        """
        where = f"site {site}: config {path} key dp"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: must be a mapping like {{epsilon: 8}}, got {type(raw).__name__}")
        known = {f.name for f in cls.__dataclass_fields__.values()}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} (known: {', '.join(sorted(known))})")
        if "epsilon" not in raw:
            raise ValueError(f"{where}: needs epsilon (e.g. dp: {{epsilon: 8}})")
        try:
            return cls(**dict(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """JSON-able settings (the record of what was asked)."""
        return asdict(self)


def _number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"dp.{name} must be a number, got {v!r}")
    return float(v)


def _positive(name: str, v, hint: str = "") -> float:
    f = _number(name, v)
    if not (f > 0 and math.isfinite(f)):
        raise ValueError(f"dp.{name} must be a finite number > 0, got {v!r}" + (f" ({hint})" if hint else ""))
    return f


def default_delta(n_images: int) -> float:
    """The default delta for ``n_images`` training images: ``1 / (DELTA_FACTOR * n)`` (= 1/(10 n)).

    A mechanism that publishes one randomly chosen image in the clear is (0, 1/n)-DP, so a meaningful delta must be
    well below ``1/n`` (Dwork & Roth 2014, Sec. 2.3; Ponomareva et al. 2023, "How to DP-fy ML", JAIR,
    arXiv:2303.00654, Sec. 5.2). Epsilon grows only like ``sqrt(log(1/delta))``, so an order of magnitude costs
    little.

    Raises:
        ValueError: ``n_images < 1``.
    """
    n = int(n_images)
    if n < 1:
        raise ValueError(f"dp needs at least one training image, got {n_images}")
    return 1.0 / (DELTA_FACTOR * n)


def opacus_steps_per_epoch(n_images: int, batch_size: int) -> int:
    """Batches per epoch of Opacus's Poisson loader made from a ``DataLoader(batch_size=B)`` over ``n`` images:
    ``L = ceil(n / B)`` batches, and ``DPDataLoader`` runs ``int(1 / (1 / L))`` of them (floating point: L - 1 for
    some L, e.g. 93)."""
    length = math.ceil(int(n_images) / int(batch_size))
    return int(1 / (1 / length))


@dataclass(frozen=True)
class DPPlan:
    """The budget of one site's training under dp, fixed before any step (what :func:`check_budget` returns).

    Attributes:
        site: site name.
        n_images: training images (the Poisson-sampled set).
        batch_size: the loader's batch size B; the expected Poisson batch is ``n_images * sample_rate``.
        epochs: planned epochs over the whole job (all training calls of the session together).
        steps_per_epoch: Opacus's batches per epoch (:func:`opacus_steps_per_epoch`).
        steps: ``epochs * steps_per_epoch``, the optimiser steps the budget allows.
        sample_rate: Poisson rate q = 1 / steps_per_epoch (what Opacus's accountant is given).
        noise_multiplier: sigma: the std of the noise on the summed clipped gradients is ``sigma * max_grad_norm``
            (and ``sigma * loss_clip`` on the summed clipped losses when losses are released).
        accounted_noise_multiplier: the multiplier the accountant sees per step: sigma, or ``sigma / sqrt(2)``
            when each step also releases a noised loss sum (one Gaussian mechanism on the joint vector of
            sensitivity sqrt(2) in units of the clips).
        target_epsilon, delta, max_grad_norm, accountant, losses, loss_clip: the spec, delta resolved.
        noise_per_mean_gradient: ``sigma / (n q)``: the noise std on the averaged gradient in units of C (a value
            above 1 means each step's noise is larger than any single clipped gradient).
    """

    site: str
    n_images: int
    batch_size: int
    epochs: int
    steps_per_epoch: int
    steps: int
    sample_rate: float
    noise_multiplier: float
    accounted_noise_multiplier: float
    target_epsilon: float
    delta: float
    max_grad_norm: float
    accountant: str
    losses: str
    loss_clip: float
    noise_per_mean_gradient: float

    def to_dict(self) -> dict:
        return asdict(self)


def _noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # RDP's "optimal order is the largest alpha" is a looseness note, not an error
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=float(epsilon), target_delta=float(delta),
                                          sample_rate=float(sample_rate), steps=int(steps), accountant=accountant))


def _epsilon_floor(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float | None:
    """None when some noise multiplier reaches ``epsilon``; else the smallest epsilon the accountant gives.

    Doubles the noise multiplier from 20 as ``get_noise_multiplier`` does (so a reachable target costs the calls
    that search makes anyway), and stops as soon as the accountant's epsilon falls by less than
    :data:`_FLOOR_RTOL` over a doubling: the accountants' epsilon has a floor above 0 for a fixed delta (RDP's
    conversion over a finite set of orders, PRV's discretisation), and a target below it would otherwise take
    the search's every doubling up to :data:`_SIGMA_CAP` (minutes) before it is refused."""
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    sigma, prev = 10.0, math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while sigma <= _SIGMA_CAP:
            sigma *= 2
            acc.history = [(sigma, float(sample_rate), int(steps))]
            eps = float(acc.get_epsilon(delta=float(delta)))
            if eps <= epsilon:
                return None
            if eps > prev * (1.0 - _FLOOR_RTOL):
                return eps
            prev = eps
    return prev


def check_budget(n_images: int, batch_size: int, epochs: int, spec: DPSpec, site: str) -> DPPlan:
    """Check a dp budget before training and fix the noise; refuse an impossible one in one line naming the site.

    The noise multiplier is Opacus's ``get_noise_multiplier`` (binary search with the spec's accountant) for exactly
    ``steps = epochs * steps_per_epoch`` Poisson-sampled steps at rate ``q = 1 / steps_per_epoch``, so the
    accountant's epsilon after those steps is at most ``spec.epsilon`` (Opacus's search keeps the epsilon below the
    target, within its tolerance 0.01).

    Args:
        n_images: the site's training images (after any hold-out).
        batch_size: the training loader's batch size B.
        epochs: every epoch this session will train over the job (rounds x local epochs for FedAvg / FedProx).
        spec: the site's :class:`DPSpec`.
        site: site name (every message names it).

    Returns:
        :class:`DPPlan`.

    Raises:
        DPBudgetError: no training images, a batch larger than the training set, ``delta >= 1/n``, epsilon not
            reachable (below the accountant's floor for this delta, or a noise multiplier above 1e6), ``epochs`` or
            ``batch_size`` below 1.
        TypeError: ``spec`` is not a :class:`DPSpec`.
    """
    if not isinstance(spec, DPSpec):
        raise TypeError(f"site {site}: dp spec must be a DPSpec, got {type(spec).__name__}")
    n, b, e = int(n_images), int(batch_size), int(epochs)
    if n < 1:
        raise DPBudgetError(f"site {site}: dp needs training images, the training split has {n}")
    if b < 1 or e < 1:
        raise DPBudgetError(f"site {site}: dp needs batch_size >= 1 and epochs >= 1, got batch_size {b}, epochs {e}")
    if b > n:
        raise DPBudgetError(f"site {site}: dp: batch size {b} exceeds the {n} training images (Poisson sampling "
                            f"draws at most the whole set per step); lower batch_size to {n} or less")
    delta = float(spec.delta) if spec.delta is not None else default_delta(n)
    if delta >= 1.0 / n:
        raise DPBudgetError(f"site {site}: dp.delta {delta:.3g} must be below 1/n = {1.0 / n:.3g} for its {n} "
                            f"training images (leave delta out for the default 1/({DELTA_FACTOR} n) = "
                            f"{default_delta(n):.3g})")
    spe = opacus_steps_per_epoch(n, b)
    q = 1.0 / spe
    steps = e * spe
    floor = _epsilon_floor(spec.epsilon, delta, q, steps, spec.accountant)
    if floor is not None:
        raise DPBudgetError(f"site {site}: dp epsilon {spec.epsilon:g} cannot be reached with delta {delta:.3g}: the "
                            f"{spec.accountant} accountant's epsilon stops falling at about {floor:.3g} however much "
                            f"noise is added; raise epsilon above it")
    try:
        sigma_acc = _noise_multiplier(spec.epsilon, delta, q, steps, spec.accountant)
    except ValueError:
        raise DPBudgetError(f"site {site}: dp epsilon {spec.epsilon:g} cannot be reached with delta {delta:.3g} over "
                            f"{steps} steps ({e} epochs of {spe}) at sample rate {q:.3g}: the noise multiplier would "
                            f"exceed {_SIGMA_CAP:.0e}; raise epsilon or train fewer epochs") from None
    components = 2 if spec.losses == "noisy" else 1
    sigma = sigma_acc * math.sqrt(components)
    return DPPlan(site=str(site), n_images=n, batch_size=b, epochs=e, steps_per_epoch=spe, steps=steps,
                  sample_rate=q, noise_multiplier=sigma, accounted_noise_multiplier=sigma_acc,
                  target_epsilon=float(spec.epsilon), delta=delta, max_grad_norm=float(spec.max_grad_norm),
                  accountant=spec.accountant, losses=spec.losses, loss_clip=float(spec.loss_clip),
                  noise_per_mean_gradient=sigma / (n * q))


@dataclass
class PrivateCall:
    """What :meth:`DPSession.private` hands the training loop for one call.

    Attributes:
        optimizer: Opacus's ``DPOptimizer`` around the caller's optimiser (clips per image, adds noise, steps).
        loader: Opacus's Poisson ``DPDataLoader`` over the same dataset (variable batch sizes, possibly empty).
        session: the :class:`DPSession` (its plan, noise generator and accountant).
        after_noise: callables run after the noise is added and before the update (e.g. a data-independent
            gradient such as FedProx's proximal term, or a clip of the noised gradient): post-processing.
    """

    optimizer: object
    loader: object
    session: "DPSession"
    after_noise: list[Callable[[], None]] = field(default_factory=list)

    def noisy_loss_sum(self, per_image_loss: torch.Tensor) -> float | None:
        """``sum_i min(max(l_i, 0), loss_clip) + N(0, (sigma loss_clip)^2)`` for this step's batch (None when
        losses are dropped). Accounted with the step's gradients (see :class:`DPPlan`)."""
        plan = self.session.plan
        if plan.losses != "noisy":
            return None
        clip = float(plan.loss_clip)
        s = float(per_image_loss.detach().float().clamp(0.0, clip).sum())
        noise = torch.randn((), generator=self.session.noise_generator("cpu")) * plan.noise_multiplier * clip
        return s + float(noise)


class DPSession:
    """One site's DP-SGD across every training call of a job: one Opacus ``PrivacyEngine``, one accountant.

    Build it once per job and site, right after the budget is checked, and pass it to every
    :func:`hfl_components.training.train_local` call (``dp=session``) that trains on the same training images.
    The session refuses a call that would take more steps than the plan allows.

    Args:
        plan: from :func:`check_budget`.
        seed: seeds the noise generator (each call continues the same stream); None = torch's global generator.
            A session restored from a ledger with k steps spent seeds it with ``seed + LEDGER_SEED_STRIDE * k``, so
            it does not replay the noise of the steps already taken.
        ledger: a JSON file (the site's workspace) holding the plan, the steps spent and the accountant's history,
            rewritten after every step. When it exists the session continues from it: the plan must equal the
            ledger's (else :class:`DPBudgetError`), the steps and the history are restored, so the budget check and
            epsilon count every step since the job began. None: nothing kept.

    Attributes:
        plan: the :class:`DPPlan`.
        steps_done: optimiser steps taken so far (every one accounted; restored ones included).
        restored_steps: the steps a ledger held when the session was built (0 for a new session).

    Raises:
        TypeError: ``plan`` is not a :class:`DPPlan`.
        DPBudgetError: the ledger was planned for another budget. ValueError: an unreadable or inconsistent ledger
            (both name the site and the file).
    """

    def __init__(self, plan: DPPlan, seed: int | None = None, ledger: str | os.PathLike | None = None):
        if not isinstance(plan, DPPlan):
            raise TypeError(f"DPSession needs a DPPlan (from check_budget), got {type(plan).__name__}")
        self.plan = plan
        self.seed = seed
        self.steps_done = 0
        self.calls = 0
        self._engine = None
        self._generators: dict = {}
        self.ledger = Path(ledger) if ledger is not None else None
        self.restored_steps = 0
        self._noise_seed = seed
        if self.ledger is not None and self.ledger.is_file():
            self._restore()

    def _restore(self) -> None:
        """Continue from the ledger file: same plan, its steps and the accountant's history."""
        site, path = self.plan.site, self.ledger
        try:
            doc = json.loads(path.read_text())
            hist = [(float(s), float(q), int(k)) for s, q, k in doc["history"]]
            steps, calls, planned = int(doc["steps_done"]), int(doc["calls"]), doc["plan"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"site {site}: dp ledger {path} is unreadable ({type(e).__name__}: {e}); the spent "
                             "budget is unknown, so training is refused (restore the file or start a new job)") from None
        if planned != self.plan.to_dict():
            diff = sorted(k for k in set(planned) | set(self.plan.to_dict())
                          if planned.get(k) != self.plan.to_dict().get(k))
            raise DPBudgetError(f"site {site}: dp ledger {path} was planned for another budget (differs in "
                                f"{', '.join(diff)}); a site restarted mid-job keeps the job's dp plan: restore its "
                                "site config or start a new job")
        if sum(k for _, _, k in hist) != steps:
            raise ValueError(f"site {site}: dp ledger {path} is inconsistent ({steps} steps spent, its history "
                             f"holds {sum(k for _, _, k in hist)}); training is refused")
        self.steps_done, self.calls, self.restored_steps = steps, calls, steps
        self._engine_once().accountant.history = hist
        if self.seed is not None and steps:
            self._noise_seed = int(self.seed) + LEDGER_SEED_STRIDE * steps

    def _write_ledger(self) -> None:
        """Rewrite the ledger (atomically: a temporary file renamed over it)."""
        if self.ledger is None:
            return
        hist = [[float(s), float(q), int(k)] for s, q, k in (self.accountant.history if self.accountant else [])]
        doc = {"site": self.plan.site, "plan": self.plan.to_dict(), "steps_done": int(self.steps_done),
               "calls": int(self.calls), "history": hist, "epsilon": self.epsilon()}
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ledger.with_name(self.ledger.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.ledger)

    @property
    def accountant(self):
        """Opacus's accountant of this session (None before the first call)."""
        return self._engine.accountant if self._engine is not None else None

    def noise_generator(self, device) -> torch.Generator | None:
        """The seeded generator of the noise on ``device`` (None without a seed: torch's global generator)."""
        if self._noise_seed is None:
            return None
        dev = torch.device(device)
        key = str(dev)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=dev).manual_seed(int(self._noise_seed))
        return self._generators[key]

    def _engine_once(self):
        if self._engine is None:
            from opacus import PrivacyEngine

            with warnings.catch_warnings():  # "Secure RNG turned off": recorded as secure_rng False instead
                warnings.simplefilter("ignore")
                self._engine = PrivacyEngine(accountant=self.plan.accountant)
        return self._engine

    def _check_call(self, model: nn.Module, loader, epochs: int) -> None:
        from opacus.validators import ModuleValidator

        plan, site = self.plan, self.plan.site
        n = len(getattr(loader, "dataset", ()) or ())
        if n != plan.n_images:
            raise ValueError(f"site {site}: dp was planned for {plan.n_images} training images but the loader holds {n}")
        if getattr(loader, "batch_size", None) != plan.batch_size:
            raise ValueError(f"site {site}: dp was planned for batch size {plan.batch_size} but the loader's is "
                             f"{getattr(loader, 'batch_size', None)}")
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and not isinstance(sampler, (torch.utils.data.RandomSampler,
                                                            torch.utils.data.SequentialSampler)):
            raise ValueError(f"site {site}: dp samples Poisson batches; the loader's {type(sampler).__name__} "
                             "(e.g. balanced_sampling) cannot be combined with dp")
        want = self.steps_done + int(epochs) * plan.steps_per_epoch
        if want > plan.steps:
            raise DPBudgetError(f"site {site}: dp budget was planned for {plan.steps} steps ({plan.epochs} epochs); "
                                f"{self.steps_done} are spent and {int(epochs)} more epochs would take {want}, "
                                f"above epsilon {plan.target_epsilon:g}")
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise ValueError(f"site {site}: dp cannot train this model as it is ({len(errors)} module(s) Opacus "
                             f"refuses, e.g. {str(errors[0]).splitlines()[0][:120]}); make it compatible first "
                             "(hfl_components.privacy.make_compatible)")

    @contextlib.contextmanager
    def private(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader,
                epochs: int) -> Iterator[PrivateCall]:
        """Make ``model`` / ``optimizer`` / ``loader`` private for one training call of ``epochs`` epochs.

        Opacus ``PrivacyEngine.make_private`` with ``poisson_sampling=True``, ``wrap_model=False`` (per-sample
        gradient hooks on the model itself), ``loss_reduction="mean"`` (the loss must be the mean of per-image
        losses over the batch), the plan's noise multiplier and clip. The accountant steps with the plan's
        accounted multiplier and sample rate after every noised step. On exit the hooks and per-sample gradients
        are removed and the gradients cleared; the model keeps its trained weights.

        Raises:
            ValueError: the loader is not the planned one (size, batch size, a custom sampler), the model has
                modules Opacus refuses (BatchNorm: :func:`make_compatible`).
            DPBudgetError: more steps than planned.
            RuntimeError: Opacus computed another sample rate than the plan (a changed Opacus version).
        """
        self._check_call(model, loader, epochs)
        engine = self._engine_once()
        plan = self.plan
        dev = next(model.parameters()).device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a new dataset object per call (FENS's aggregator) is the same images
            hooks, dp_opt, dp_loader = engine.make_private(
                module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=plan.noise_multiplier,
                max_grad_norm=plan.max_grad_norm, poisson_sampling=True, wrap_model=False, loss_reduction="mean",
                noise_generator=self.noise_generator(dev))
        try:
            rate = 1.0 / len(dp_loader)
            if abs(rate - plan.sample_rate) > 1e-12:
                raise RuntimeError(f"site {plan.site}: Opacus samples at rate {rate} but the plan says "
                                   f"{plan.sample_rate}")
            _empty_first_batch_fix(dp_loader, loader)
            call = PrivateCall(optimizer=dp_opt, loader=dp_loader, session=self)
            accountant = engine.accountant

            def step_hook(_opt):
                accountant.step(noise_multiplier=plan.accounted_noise_multiplier, sample_rate=plan.sample_rate)
                self.steps_done += 1
                self._write_ledger()
                for fn in call.after_noise:
                    fn()

            dp_opt.attach_step_hook(step_hook)  # replaces Opacus's own accounting hook (it would see sigma, not
            self.calls += 1                       # the accounted multiplier, when losses are released too)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                yield call
        finally:
            hooks.cleanup()
            for p in model.parameters():
                for attr in ("grad_sample", "_forward_counter", "_current_grad_sample", "summed_grad"):
                    if hasattr(p, attr):
                        delattr(p, attr)
                p.grad = None

    def epsilon(self) -> float:
        """Epsilon spent so far at the plan's delta (Opacus's accountant; 0.0 before any step)."""
        if self.accountant is None or not self.accountant.history:
            return 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(self.accountant.get_epsilon(delta=self.plan.delta))

    def record(self) -> dict:
        """What a site records (model-file provenance, ``metrics.json``, report, model card), JSON-able:

        ``{"dp": True, "noise_multiplier", "accounted_noise_multiplier", "sample_rate", "steps" (taken),
        "planned_steps", "epsilon" (the accountant's, at ``delta``), "target_epsilon", "delta", "max_grad_norm",
        "accountant", "history" ([[accounted multiplier, sample rate, steps], ...] as the accountant holds it),
        "n_images", "batch_size", "epochs" (planned), "losses", "loss_clip", "secure_rng": False, "library"}``.
        """
        import opacus

        p = self.plan
        hist = [[float(s), float(q), int(k)] for s, q, k in (self.accountant.history if self.accountant else [])]
        return {"dp": True, "noise_multiplier": p.noise_multiplier,
                "accounted_noise_multiplier": p.accounted_noise_multiplier, "sample_rate": p.sample_rate,
                "steps": int(self.steps_done), "planned_steps": p.steps, "epsilon": self.epsilon(),
                "target_epsilon": p.target_epsilon, "delta": p.delta, "max_grad_norm": p.max_grad_norm,
                "accountant": p.accountant, "history": hist, "n_images": p.n_images, "batch_size": p.batch_size,
                "epochs": p.epochs, "losses": p.losses, "loss_clip": p.loss_clip,
                "noise_per_mean_gradient": p.noise_per_mean_gradient, "secure_rng": False,
                "library": f"opacus {opacus.__version__}"}


def _empty_first_batch_fix(dp_loader, loader) -> None:
    """Opacus stands in for an empty *first* Poisson batch with zero tensors shaped after ``dataset[0]``'s items,
    which fails for dict items (``{"image", "label"}``). Give its empty-batch wrapper the structure of a real
    one-item batch instead, built only when that empty first batch happens."""
    wrapper = dp_loader.collate_fn
    if not hasattr(wrapper, "first_batch"):
        return
    from torch.utils.data import default_collate

    one = loader.collate_fn or default_collate

    def collate(batch):
        if not batch and wrapper.first_batch is None:
            wrapper.first_batch = one([loader.dataset[0]])
        return wrapper(batch)

    dp_loader.collate_fn = collate


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader, spec: DPSpec, epochs: int, *,
                 site: str, seed: int | None = None):
    """One-call form: check the budget for ``epochs`` epochs over ``loader``'s images, open a session and make the
    three objects private (a context manager yielding :class:`PrivateCall`; ``call.session.record()`` afterwards).

    Example::

        with make_private(model, opt, loader, DPSpec(epsilon=8), epochs=5, site="site-1") as call:
            for x, y in call.loader: ...; call.optimizer.step()
        record = call.session.record()

    Raises:
        DPBudgetError, ValueError, RuntimeError: as :func:`check_budget` and :meth:`DPSession.private`.
    """
    plan = check_budget(len(loader.dataset), loader.batch_size, epochs, spec, site)
    return DPSession(plan, seed=seed).private(model, optimizer, loader, epochs)


def epsilon_from_record(record: Mapping) -> float:
    """Epsilon recomputed from a dp record with Opacus's accountant (``record["accountant"]``) at
    ``record["delta"]``: from its ``history`` when present, else from ``(accounted_noise_multiplier or
    noise_multiplier, sample_rate, steps)``.

    Raises:
        ValueError: a record without the needed keys or with an unknown accountant.
    """
    from opacus.accountants import create_accountant

    try:
        acc = create_accountant(mechanism=str(record["accountant"]))
        if record.get("history"):
            acc.history = [(float(s), float(q), int(k)) for s, q, k in record["history"]]
        else:
            sigma = record.get("accounted_noise_multiplier", record["noise_multiplier"])
            acc.history = [(float(sigma), float(record["sample_rate"]), int(record["steps"]))]
        delta = float(record["delta"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"dp record lacks {e} (needs accountant, delta, noise_multiplier, sample_rate, steps)") from None
    if not acc.history or sum(k for _, _, k in acc.history) == 0:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(acc.get_epsilon(delta=delta))


def make_compatible(model: nn.Module, input_size: int | None = None) -> tuple[nn.Module, dict]:
    """A DP-SGD-compatible copy of ``model`` (Opacus ``ModuleValidator.fix``: BatchNorm -> GroupNorm, ...) and a
    report ``{"changed": bool, "replaced": {module class: count}, "remaining": [error lines], "inplace_off": int,
    "text": one line}``. In-place activations are turned off in either case (:func:`_inplace_off`; outputs
    unchanged).

    With ``input_size`` a trial step also runs Opacus's per-sample-gradient hooks through one forward and backward
    pass on two random (in_channels, S, S) images: an in-place operation in the model's own forward (MONAI ResNet's
    residual ``out += residual``) fails there and is listed in ``remaining``. Without it only Opacus's module
    validator speaks.

    A model without BatchNorm is returned as is (not copied). The copy has other modules and state-dict keys (GroupNorm
    holds no running statistics), so every party that rebuilds the model from its spec must apply the same fix.
    """
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    fixed, replaced = model, {}
    if errors:
        before = _norm_counts(model)
        fixed = ModuleValidator.fix(model)
        after = _norm_counts(fixed)
        replaced = {k: before[k] - after.get(k, 0) for k in before if before[k] > after.get(k, 0)}
    inplace = _inplace_off(fixed)
    remaining = [str(e).splitlines()[0] for e in ModuleValidator.validate(fixed, strict=False)]
    if not remaining and input_size is not None:
        remaining = _trial_step(fixed, int(input_size))
    return fixed, {"changed": bool(errors), "replaced": replaced, "remaining": remaining, "inplace_off": inplace,
                   "text": _report_text(fixed, replaced, remaining)}


def _trial_step(model: nn.Module, size: int) -> list[str]:
    """One forward/backward pass with Opacus's hooks on two random images; ``[]`` or the one-line error."""
    from opacus.grad_sample.utils import prepare_module

    first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))), None)
    channels = first.in_channels if isinstance(first, nn.Conv2d) else 1
    was_training = model.training
    hooks = prepare_module(model, grad_sample_mode="hooks", wrap_model=False)
    try:
        model.train()
        x = torch.rand(2, channels, size, size, device=next(model.parameters()).device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.head(model.features(x)) if hasattr(model, "features") else model(x)
            out.float().sum().backward()
        return []
    except RuntimeError as e:
        return [f"a trial step fails: {str(e).splitlines()[0][:150]}"]
    finally:
        hooks.cleanup()
        model.train(was_training)
        for p in model.parameters():
            p.grad = None
            if hasattr(p, "grad_sample"):
                delattr(p, "grad_sample")


def _inplace_off(model: nn.Module) -> int:
    """Turn off ``inplace`` activations (e.g. MONAI DenseNet's ``ReLU(inplace=True)``), which Opacus's backward
    hooks cannot follow (autograd forbids an in-place change of a hooked view); same outputs, same weights.
    Returns how many were turned off."""
    n = 0
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
            n += 1
    return n


def _norm_counts(model: nn.Module) -> dict:
    out: dict = {}
    for m in model.modules():
        name = type(m).__name__
        if "Norm" in name:
            out[name] = out.get(name, 0) + 1
    return out


def _report_text(model: nn.Module, replaced: dict, remaining: list) -> str:
    if remaining:
        return f"dp: NOT trainable with DP-SGD (Opacus): {remaining[0][:160]}"
    if replaced:
        what = ", ".join(f"{n} {k}" for k, n in sorted(replaced.items()))
        return (f"dp: made compatible by Opacus ModuleValidator.fix ({what} replaced by GroupNorm); the model "
                "differs from the non-dp one")
    return "dp: compatible as is (no BatchNorm)"


def compatibility_report(model: nn.Module, input_size: int | None = None) -> str:
    """One line for ``cxr-hfl site check``: whether the site's model trains under dp as it is, after Opacus's
    ``ModuleValidator.fix`` (and what it replaces), or not at all (with ``input_size``: after a trial step, see
    :func:`make_compatible`)."""
    return make_compatible(model, input_size)[1]["text"]
