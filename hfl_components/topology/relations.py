"""FedTopo relation topology: site-side construction, server-side reliability-aware aggregation, diagnostics,
privacy-noised counts and upload validation (pure NumPy, float64).

Reference: "FedTopo" — ../shared/papers/002_fb7c67fce2254bf3.txt, Section IV and Algorithm 1 (equation numbers
below are the paper's). Payloads are NumPy arrays: ``R`` is ``(C, C)`` float64 in ``[0, 1]``, ``counts`` is ``(C,)``
(integer-valued, float or int dtype); ``S`` (reliability) is ``(C, C)`` float64 in ``[0, 1]``.

Decisions and differences from the paper (these win):

* Eq. 7's normaliser is the best-supported **off-diagonal** pair: the paper's ``max_{a,b}`` includes the
  diagonal, whose weight ``n_c / 2`` always dominates. Diagonal entries of ``S`` are clipped to 1 (never used by the
  loss), so ``S`` stays in ``[0, 1]``. If no off-diagonal pair is observed in a round, observed off-diagonal support
  is 0 and observed diagonal entries are 1.
* Eq. 6's ``+ eps`` in the denominator is applied only where needed: pairs with support are divided exactly, pairs no
  participating site observed are set to 0 (as the paper states) via the observation mask.
* Eq. 8 retains ``R_{t-1}`` for pairs unobserved in round ``t``. The paper is silent on ``S`` for such pairs (Eq. 7
  literally gives 0, which would silence the retained relation in the loss ``A = R * S``); by default
  (``retain_reliability=True``) ``S_{t-1}`` is retained for them too, so a pair missing for one round (a dropped
  upload, partial participation) is not erased. ``retain_reliability=False`` gives Eq. 7 literally.
* Initial state (Algorithm 1): ``R_0 = I_C``, ``S_0 = 0`` (:func:`initial_topology`).
* A zero-norm prototype has no direction: its cosine is taken as 0, i.e. relation 0.5.

Ablations (paper Table II), see :class:`TopologyAblation`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

EPS = 1e-8


def _np(x, dtype=np.float64) -> np.ndarray:
    try:
        import torch

        if torch.is_tensor(x):
            x = x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    return np.asarray(x, dtype=dtype)


def initial_topology(C: int):
    """Initial global state of Algorithm 1: ``R_0 = I_C`` (self-relation prior) and ``S_0 = 0``.

    Returns:
        ``(R0, S0)``, float64 ``(C, C)`` each.
    """
    if C < 1:
        raise ValueError(f"C must be >= 1, got {C}")
    return np.eye(C), np.zeros((C, C))


def local_relation_topology(Z, y, C: int):
    """Site-side local relation topology (Eq. 2–3). The class prototypes are computed and discarded here.

    ``p_c = mean{z_i : y_i = c}`` (Eq. 2), and for classes ``c, c'`` both present::

        R(c, c') = (1 + cos(p_c, p_c')) / 2       in [0, 1],  R(c, c) = 1,

    while every entry involving an absent class is 0 and flagged by ``present`` (masked, Eq. 3 remark).
    Invariant to rotating and positively scaling the feature space (the paper's Proposition 1).

    Args:
        Z: ``(N, d)`` features after local training (torch or NumPy); y: ``(N,)`` labels in ``[0, C)``; C: classes.
    Returns:
        ``(R, present, counts)``: float64 ``(C, C)`` symmetric; bool ``(C,)`` (``counts > 0``); int64 ``(C,)``.
    Raises:
        ValueError: shapes inconsistent or labels out of range.
    """
    Z = _np(Z)
    y = _np(y, dtype=np.int64).reshape(-1)
    if Z.ndim != 2 or Z.shape[0] != y.shape[0]:
        raise ValueError(f"expected Z (N, d) and y (N,), got {Z.shape} and {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= C):
        raise ValueError(f"labels must lie in [0, {C})")
    counts = np.bincount(y, minlength=C)[:C].astype(np.int64)
    present = counts > 0
    sums = np.zeros((C, Z.shape[1]))
    np.add.at(sums, y, Z)
    protos = sums / np.maximum(counts, 1)[:, None]
    norms = np.linalg.norm(protos, axis=1)
    unit = protos / np.where(norms > 0, norms, 1.0)[:, None]
    G = unit @ unit.T
    G = (G + G.T) / 2.0
    R = np.clip((1.0 + G) / 2.0, 0.0, 1.0)
    pair = np.outer(present, present)
    R = np.where(pair, R, 0.0)
    R[np.diag_indices(C)] = present.astype(np.float64)
    return R, present, counts


def observation_mask(counts) -> np.ndarray:
    """Class-pair observation mask ``M(c, c') = 1[n_c > 0] 1[n_c' > 0]`` (Eq. 4); bool ``(C, C)``."""
    n = _np(counts).reshape(-1)
    return np.outer(n > 0, n > 0)


def reliability_weights(counts, reliability: bool = True, eps: float = EPS) -> np.ndarray:
    """Pair-wise harmonic reliability weights (Eq. 5): ``w(c, c') = M(c, c') n_c n_c' / (n_c + n_c' + eps)``.

    Half the harmonic mean of the two counts; the diagonal is ``n_c^2 / (2 n_c + eps) ~= n_c / 2``.
    With ``reliability=False`` (ablation "no reliability") ``w = M``, i.e. a plain average over observing sites.

    Args:
        counts: ``(C,)`` non-negative class counts of one site (samples).
    Returns:
        float64 ``(C, C)``, in samples.
    """
    n = _np(counts).reshape(-1)
    M = observation_mask(n)
    if not reliability:
        return M.astype(np.float64)
    w = np.outer(n, n) / (n[:, None] + n[None, :] + eps)
    return np.where(M, w, 0.0)


def aggregate_round(R_list: Sequence, counts_list: Sequence, reliability: bool = True):
    """One round's reliability-weighted relation average (Eq. 4–6) and total support.

    ``R~(c, c') = sum_k w_k R_k / sum_k w_k`` over the sites observing the pair; 0 where no site observed it.

    Args:
        R_list: K local topologies ``(C, C)``; counts_list: K count vectors ``(C,)``.
        reliability: False -> plain average over observing sites (ablation).
    Returns:
        ``(R_tilde, W, observed)``: float64 ``(C, C)``, float64 ``(C, C)`` support ``sum_k w_k``, bool ``(C, C)``.
    Raises:
        ValueError: no uploads, or inconsistent shapes.
    """
    if len(R_list) == 0 or len(R_list) != len(counts_list):
        raise ValueError(f"need one counts vector per topology, got {len(R_list)} and {len(counts_list)}")
    Rs = np.stack([_np(R) for R in R_list])
    ns = np.stack([_np(n).reshape(-1) for n in counts_list])
    K, C = ns.shape
    if Rs.shape != (K, C, C):
        raise ValueError(f"topologies {Rs.shape} do not match counts {ns.shape}")
    Ws = np.stack([reliability_weights(n, reliability) for n in ns])
    Ms = np.stack([observation_mask(n) for n in ns])
    observed = Ms.any(axis=0)
    W = Ws.sum(axis=0)
    num = (Ws * np.where(Ms, Rs, 0.0)).sum(axis=0)
    R_tilde = np.where(observed, num / np.where(W > 0, W, 1.0), 0.0)
    return R_tilde, W, observed


def aggregate_topology(R_list: Sequence, counts_list: Sequence, R_prev, S_prev, rho: float = 0.7,
                       reliability: bool = True, retain_reliability: bool = True, eps: float = EPS):
    """Server update of Algorithm 1 (lines 8–10): Eq. 4–8.

    1. ``M_k``, ``w_k`` (Eq. 4–5); ``R~`` (Eq. 6) via :func:`aggregate_round`.
    2. Reliability (Eq. 7, off-diagonal normaliser, see module docstring)::

           S(c, c') = min(1, sum_k w_k(c, c') / (max_{a != b} sum_k w_k(a, b) + eps))

       With ``reliability=False``: ``S = 1`` on observed pairs, 0 elsewhere.
    3. EMA (Eq. 8) on observed pairs, retention elsewhere::

           R_t = rho R_{t-1} + (1 - rho) R~   where observed,   R_t = R_{t-1}  where unobserved.

       ``rho = 0`` is the "no EMA" ablation. ``S_t`` keeps ``S_{t-1}`` on unobserved pairs when
       ``retain_reliability`` (default), else it is 0 there (Eq. 7 literally).

    Args:
        R_list: K site topologies ``(C, C)``; counts_list: K site counts ``(C,)`` (possibly noisy, see
            :func:`noisy_counts`).
        R_prev, S_prev: previous global state ``(C, C)`` (:func:`initial_topology` in round 1).
        rho: EMA coefficient in ``[0, 1)`` (default 0.7, paper Sec. VI-A4).
        reliability: harmonic weights and Eq. 7 (default) or the "no reliability" ablation.
    Returns:
        ``(R_g, S_g)``: float64 ``(C, C)`` each, symmetric, in ``[0, 1]``.
    Raises:
        ValueError: ``rho`` outside ``[0, 1)`` or inconsistent shapes.
    """
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"rho must lie in [0, 1), got {rho}")
    R_tilde, W, observed = aggregate_round(R_list, counts_list, reliability)
    C = R_tilde.shape[0]
    R_prev = _np(R_prev)
    S_prev = _np(S_prev)
    if R_prev.shape != (C, C) or S_prev.shape != (C, C):
        raise ValueError(f"previous state must be ({C}, {C}), got {R_prev.shape} and {S_prev.shape}")
    if reliability:
        off = ~np.eye(C, dtype=bool)
        top = W[off & observed].max() if (off & observed).any() else 0.0
        if top > 0:
            S_round = np.minimum(W / (top + eps), 1.0)
        else:
            S_round = np.eye(C) * observed
        S_round = np.where(observed, S_round, 0.0)
    else:
        S_round = observed.astype(np.float64)
    R_g = np.where(observed, rho * R_prev + (1.0 - rho) * R_tilde, R_prev)
    S_g = np.where(observed, S_round, S_prev if retain_reliability else 0.0)
    return R_g, S_g


def noisy_counts(counts, present, scale: float, seed: Optional[int] = None) -> np.ndarray:
    """Privacy-noised class counts for upload (paper Sec. IV-C mentions "noisy counts").

    Mechanism: Laplace noise ``Lap(0, scale)`` is added to the count of every *present* class, the result rounded to
    the nearest integer and clamped to ``>= 1``; absent classes stay exactly 0. The presence mask itself is sent as
    is, so the server's observation masks (Eq. 4) and upload validation are unaffected. Under add/remove-one-sample
    neighbouring datasets the count histogram has L1 sensitivity 1, so one release is ``epsilon = 1 / scale``
    differentially private *for the counts only* (the presence mask and ``R_k`` are not protected, and repeated
    rounds compose). ``scale = 0`` returns the counts unchanged.

    Args:
        counts: ``(C,)`` non-negative true counts (samples); present: ``(C,)`` bool; scale: Laplace scale b >= 0
            (samples); seed: RNG seed (``None``: fresh entropy).
    Returns:
        float64 ``(C,)``, integer-valued.
    Raises:
        ValueError: negative scale, shape mismatch, or a present class with count 0 / absent class with count > 0.
    """
    n = _np(counts).reshape(-1)
    p = np.asarray(_np(present, dtype=bool)).reshape(-1)
    if scale < 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    if n.shape != p.shape:
        raise ValueError(f"counts {n.shape} and present {p.shape} differ")
    if np.any(p != (n > 0)):
        raise ValueError("present mask disagrees with counts > 0")
    if scale == 0:
        return n.copy()
    noise = np.random.default_rng(seed).laplace(0.0, scale, size=n.shape)
    return np.where(p, np.maximum(np.round(n + noise), 1.0), 0.0)


def topology_inconsistency(R_k, mask_k, R_g, S_g):
    """Per-site topology inconsistency diagnostics (Eq. 25–26), computed on the site.

    Over ``Omega_k = {(c, c') : c < c', both present on site k}``::

        D_r  = mean_{Omega_k} |R_k - R_g|            (Eq. 25)
        D_rs = mean_{Omega_k} |R_k - R_g| * S_g      (Eq. 26)

    Args:
        R_k: ``(C, C)`` local topology; mask_k: ``(C,)`` bool class presence on the site; R_g, S_g: ``(C, C)``.
    Returns:
        ``(D_r, D_rs)`` as floats in ``[0, 1]``, or ``(None, None)`` when ``Omega_k`` is empty (fewer than 2 present
        classes; undefined, JSON-safe).
    """
    R_k, R_g, S_g = _np(R_k), _np(R_g), _np(S_g)
    m = np.asarray(_np(mask_k, dtype=bool)).reshape(-1)
    C = m.shape[0]
    iu = np.triu_indices(C, k=1)
    sel = (m[:, None] & m[None, :])[iu]
    if not sel.any():
        return None, None
    diff = np.abs(R_k - R_g)[iu][sel]
    return float(diff.mean()), float((diff * S_g[iu][sel]).mean())


def validate_topology_upload(R, counts, C: int, atol: float = 1e-6) -> None:
    """Check one site's ``(R_k, n_k)`` upload; raise ``ValueError`` with the reason when it must be dropped.

    Requirements: ``R`` is ``(C, C)``, finite, within ``[0, 1]`` (tolerance ``atol``), symmetric within
    ``atol``; ``counts`` is ``(C,)``, finite and non-negative.

    Raises:
        ValueError: the first violated requirement, e.g. ``"topology is not symmetric (max |R - R^T| = 0.3)"``.
    """
    try:
        R = _np(R)
        n = _np(counts)
    except (TypeError, ValueError) as e:
        raise ValueError(f"upload is not numeric: {e}") from None
    if R.shape != (C, C):
        raise ValueError(f"topology shape {R.shape} != expected {(C, C)}")
    if n.shape != (C,):
        raise ValueError(f"counts shape {n.shape} != expected {(C,)}")
    if not np.isfinite(R).all():
        raise ValueError("topology contains non-finite values")
    if R.min() < -atol or R.max() > 1.0 + atol:
        raise ValueError(f"topology values outside [0, 1] (min {R.min():.4g}, max {R.max():.4g})")
    asym = float(np.abs(R - R.T).max())
    if asym > atol:
        raise ValueError(f"topology is not symmetric (max |R - R^T| = {asym:.4g})")
    if not np.isfinite(n).all():
        raise ValueError("counts contain non-finite values")
    if (n < 0).any():
        raise ValueError(f"counts must be non-negative, got {n.tolist()}")


@dataclass(frozen=True)
class TopologyAblation:
    """Ablation switches of the paper's Table II (this module's definitions). All False = full FedTopo.

    Attributes:
        no_reliability: server uses ``w = M`` (plain average over the sites observing a pair) and ``S = 1`` on
            observed pairs (``aggregate_topology(reliability=False)``).
        no_topq: all present negatives are modulated (``q = C - 1``); identical to the default when
            ``q >= C - 1`` — check :meth:`topq_is_noop` and report it.
        no_missing_mask: the site-side presence mask of Eq. 10 is dropped (``TopologyLoss(use_mask=False)``), so
            locally absent classes can be chosen as negatives.
        no_ema: ``rho = 0`` (this round's aggregate replaces observed pairs; unobserved pairs are still retained).
        local_topology: each site is guided by its own ``R_k`` and ``S = 1`` on its observed pairs
            (:func:`local_guidance`) instead of the broadcast ``(R^g, S^g)``.
    """

    no_reliability: bool = False
    no_topq: bool = False
    no_missing_mask: bool = False
    no_ema: bool = False
    local_topology: bool = False

    NAMES = ("no_reliability", "no_topq", "no_missing_mask", "no_ema", "local_topology")

    @classmethod
    def from_names(cls, names: Sequence[str]) -> "TopologyAblation":
        """Build from a list such as ``["no_ema", "no_topq"]``; raises ``ValueError`` on unknown names."""
        unknown = [n for n in names if n not in cls.NAMES]
        if unknown:
            raise ValueError(f"unknown ablation(s) {unknown}; expected a subset of {cls.NAMES}")
        return cls(**{n: True for n in names})

    def rho(self, rho: float) -> float:
        """EMA coefficient to use."""
        return 0.0 if self.no_ema else rho

    def q(self, q: int, C: int) -> int:
        """Top-q to use (``C - 1`` under ``no_topq``)."""
        return max(C - 1, 0) if self.no_topq else q

    @staticmethod
    def topq_is_noop(q: int, C: int) -> bool:
        """True when top-q selection keeps every negative anyway (``q >= C - 1``): "no top-q" changes nothing."""
        return q >= C - 1


def local_guidance(R_k, present):
    """Guidance for the "local topology" ablation: ``(R_k, S_k)`` with ``S_k = 1`` on the site's observed pairs.

    Returns:
        float64 ``(C, C)`` each.
    """
    p = np.asarray(_np(present, dtype=bool)).reshape(-1)
    return _np(R_k).copy(), np.outer(p, p).astype(np.float64)
