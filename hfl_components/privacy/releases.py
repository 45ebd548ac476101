"""Every value a site sends under dp, accounted for: dropped, released with its own noise, or declared.

DP-SGD (:mod:`hfl_components.privacy.dp`) covers the model weights and everything computed from them alone
(post-processing: fusion, distillation on public images, the server's aggregation). It does not cover what else a
site sends with an answer, computed from its images directly: per-epoch training losses, the training-set size,
validation summaries. This module gives those values a stated protection, as pure functions the site tasks call
on what they are about to send:

* :func:`release_history` -- the per-epoch training records under dp: only what the DP loop produced (the epoch,
  and the noised loss when the site's ``dp.losses`` is ``noisy``, already inside the DP-SGD accountant).
* :func:`noisy_count` -- a count (the training-set size) with two-sided geometric noise, the discrete Laplace
  mechanism (Ghosh, Roughgarden & Sundararajan, "Universally Utility-Maximizing Privacy Mechanisms", STOC 2009):
  pure ``epsilon``-DP for a count of sensitivity 1 (one image added or removed).
* :class:`ReleaseLedger` -- one site's list of releases, each with its protection (:data:`PROTECTIONS`), and the
  total epsilon of those protected by DP (basic composition, Dwork & Roth 2014, Theorem 3.16:
  ``(sum eps_i, sum delta_i)``; a safe upper bound).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

import numpy as np

#: Protections a release can state. ``dp``: differential privacy with its epsilon/delta (image level, training
#: images); ``dropped``: not sent; ``k-anonymity``: sent only where at least k images stand behind each value;
#: ``public``: declared public to the consortium by the site (e.g. the training-set size); ``not covered``: sent
#: without formal protection (said so plainly).
PROTECTIONS = ("dp", "dropped", "k-anonymity", "public", "not covered")
#: Keys of a DP loop's epoch record that may leave a site.
SAFE_HISTORY_KEYS = ("epoch", "loss", "dp")


def release_history(history: Iterable[Mapping], dp: bool) -> list[dict]:
    """The per-epoch training records a site may send.

    Without dp the records are returned unchanged (as plain dicts). Under dp every record must come from
    :func:`hfl_components.training.train_local` with ``dp=`` (it carries ``"dp": True``, and its ``loss`` is None or
    already noised); only :data:`SAFE_HISTORY_KEYS` are kept (timings and counts are dropped).

    Args:
        history: the list ``train_local`` returned.
        dp: whether the site trains under dp.

    Returns:
        list of dicts.

    Raises:
        ValueError: under dp, a record that did not come from the DP loop (it would carry the raw loss).
    """
    out = []
    for i, rec in enumerate(history):
        if not dp:
            out.append(dict(rec))
            continue
        if rec.get("dp") is not True:
            raise ValueError(f"under dp the training record {i + 1} did not come from train_local(dp=...): its "
                             "loss is the raw training loss and may not leave the site")
        out.append({k: rec[k] for k in SAFE_HISTORY_KEYS if k in rec})
    return out


def noisy_count(n: int, epsilon: float, seed: int | None = None, minimum: int = 1) -> int:
    """``max(minimum, n + Z)`` with ``Z`` two-sided geometric: ``P(Z = k) proportional to exp(-epsilon |k|)``.

    The discrete Laplace mechanism (Ghosh et al. 2009) is ``epsilon``-DP for a count that one image changes by at
    most 1; the clamp is post-processing. ``Z`` is the difference of two i.i.d. geometric variables with success
    probability ``1 - exp(-epsilon)`` (Inusah & Kozubowski 2006), so ``E[Z] = 0`` and
    ``Var[Z] = 2 a / (1 - a)^2`` with ``a = exp(-epsilon)``.

    Args:
        n: the true count (>= 0).
        epsilon: > 0.
        seed: NumPy generator seed (None: fresh entropy, what a deployment should use).
        minimum: the smallest value released (FedAvg's weights need a positive count).

    Raises:
        ValueError: ``n < 0`` or ``epsilon`` not a positive finite number.
    """
    if int(n) < 0:
        raise ValueError(f"a count must be >= 0, got {n}")
    if not (float(epsilon) > 0 and math.isfinite(float(epsilon))):
        raise ValueError(f"count epsilon must be a finite number > 0, got {epsilon!r}")
    rng = np.random.default_rng(seed)
    p = -math.expm1(-float(epsilon))  # 1 - exp(-eps), precise for small eps
    z = int(rng.geometric(p)) - int(rng.geometric(p))
    return max(int(minimum), int(n) + z)


def run_dp_line(sites: Mapping) -> str:
    """One plain line saying whether a run was differentially private and at which epsilon, from ``metrics.json``'s
    ``sites`` (each site's ``dp`` record, :meth:`hfl_components.flare.site_tasks.SiteRuntime.dp_record`):
    ``"not DP (no site trained with dp)"``, ``"DP-SGD at every site: epsilon <= E (target T), delta <= D; per site
    s1 e1, ..."`` or ``"DP-SGD at k of N sites ... ; NOT DP: s, ..."`` (a run is DP only where every site is)."""
    recs = {s: (b or {}).get("dp") for s, b in sorted(sites.items())}
    dp = {s: r for s, r in recs.items() if isinstance(r, Mapping) and r.get("dp")}
    if not dp:
        return "not DP (no site trained with dp)"
    eps = max(float(r.get("epsilon") or 0.0) for r in dp.values())
    target = max(float(r.get("target_epsilon") or 0.0) for r in dp.values())
    delta = max(float(r.get("delta") or 0.0) for r in dp.values())
    per = ", ".join(f"{s} {float(r.get('epsilon') or 0.0):.2f}" for s, r in dp.items())
    who = "every site" if len(dp) == len(recs) else f"{len(dp)} of {len(recs)} sites"
    line = f"DP-SGD at {who}: epsilon <= {eps:.2f} (target {target:g}), delta <= {delta:.2g}; per site {per}"
    off = [s for s in recs if s not in dp]
    return line + (f"; NOT DP: {', '.join(off)}" if off else "")


@dataclass
class Release:
    """One kind of value a site sends.

    Attributes:
        name: what is sent (e.g. ``model weights``, ``training losses``, ``training-set size``).
        protection: one of :data:`PROTECTIONS`.
        epsilon, delta: for ``dp`` only (delta 0 for pure DP).
        k: for ``k-anonymity`` only.
        mechanism: how (e.g. ``DP-SGD (Opacus, prv accountant)``, ``discrete Laplace``).
        note: one short sentence (what is covered and what is not).
    """

    name: str
    protection: str
    epsilon: float | None = None
    delta: float | None = None
    k: int | None = None
    mechanism: str = ""
    note: str = ""

    def __post_init__(self):
        if self.protection not in PROTECTIONS:
            raise ValueError(f"release {self.name!r}: protection must be one of {', '.join(PROTECTIONS)}, got "
                             f"{self.protection!r}")
        if self.protection == "dp":
            if self.epsilon is None or not float(self.epsilon) >= 0 or self.delta is None or not 0 <= self.delta < 1:
                raise ValueError(f"release {self.name!r}: dp needs epsilon >= 0 and delta in [0, 1), got "
                                 f"{self.epsilon!r}, {self.delta!r}")
        if self.protection == "k-anonymity" and (self.k is None or int(self.k) < 2):
            raise ValueError(f"release {self.name!r}: k-anonymity needs k >= 2, got {self.k!r}")


@dataclass
class ReleaseLedger:
    """A site's releases under one job, each with its protection, and the total of those under DP.

    Attributes:
        site: site name.
        releases: the :class:`Release` entries, in the order added.
    """

    site: str
    releases: list[Release] = field(default_factory=list)

    def add(self, name: str, protection: str, **kw) -> Release:
        """Add one release (arguments as :class:`Release`); returns it. Raises ValueError as :class:`Release`."""
        r = Release(name, protection, **kw)
        self.releases.append(r)
        return r

    def add_training(self, record: Mapping | None, uploads: str = "model weights") -> None:
        """The uploads DP-SGD covers and the training losses, from a :meth:`~hfl_components.privacy.DPSession.record`
        (None: no dp, both ``not covered``). The losses are ``dropped``, or part of the same DP-SGD epsilon when
        the record's ``losses`` is ``noisy``."""
        if record is None:
            self.add(uploads, "not covered", note="trained without dp")
            self.add("training losses", "not covered", note="trained without dp")
            return
        mech = f"DP-SGD (Opacus, {record['accountant']} accountant)"
        self.add(uploads, "dp", epsilon=float(record["epsilon"]), delta=float(record["delta"]), mechanism=mech,
                 note=f"noise multiplier {record['noise_multiplier']:.3g}, sample rate {record['sample_rate']:.3g}, "
                      f"{record['steps']} steps")
        if record.get("losses") == "noisy":
            self.add("training losses", "dp", epsilon=0.0, delta=0.0, mechanism=mech,
                     note="noised per step with the gradients; inside the DP-SGD epsilon above")
        else:
            self.add("training losses", "dropped")

    def dp_total(self) -> dict:
        """``{"epsilon", "delta"}``: basic composition of every ``dp`` release (sum of epsilons and deltas), an
        upper bound for all of them together on the same training images; ``{"epsilon": 0, "delta": 0}`` when
        none is under dp."""
        eps = sum(float(r.epsilon) for r in self.releases if r.protection == "dp")
        delta = sum(float(r.delta) for r in self.releases if r.protection == "dp")
        return {"epsilon": eps, "delta": delta}

    def uncovered(self) -> list[str]:
        """Names of the releases sent without formal protection (``not covered``)."""
        return [r.name for r in self.releases if r.protection == "not covered"]

    def to_dict(self) -> dict:
        """JSON-able: ``{"site", "releases": [...], "dp_total": {...}, "not_covered": [...]}``."""
        return {"site": self.site, "releases": [asdict(r) for r in self.releases], "dp_total": self.dp_total(),
                "not_covered": self.uncovered()}
