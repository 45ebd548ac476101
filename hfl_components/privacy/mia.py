"""Membership-inference attacks as measurement tools: how much does a model a site sends reveal about its images?

A site runs these on its own machine, on its own images and public images; nothing here sends anything. Members
are the site's training images, non-members images the model never trained on (the site's test split).

* :func:`loss_threshold_attack` -- the baseline of Yeom et al. ("Privacy Risk in Machine Learning", CSF 2018,
  arXiv:1709.01604) and the threshold form of Shokri et al.'s attack ("Membership Inference Attacks Against
  Machine Learning Models", S&P 2017, arXiv:1610.05820): the lower an image's loss, the likelier it was trained on.
* :func:`lira_offline` -- the calibrated likelihood-ratio attack LiRA (Carlini et al., "Membership Inference
  Attacks From First Principles", S&P 2022, arXiv:2112.03570), offline variant (Sec. IV-C): shadow models trained
  without the target images give each image its own "out" distribution of the logit-scaled confidence
  (:func:`logit_confidence`), a Gaussian; the image's score is the one-sided test statistic against it. Shadows are
  trained on random halves of a public image pool (:func:`train_shadow_models`), so a site needs no other site's
  data and no extra use of its own.
* :func:`one_run_audit` -- the one-run audit of Steinke, Nasr & Jagielski ("Privacy Auditing with One (1) Training
  Run", NeurIPS 2023, arXiv:2305.08846): m canaries, each included in training with probability 1/2
  (:func:`canary_inclusion`); the auditor guesses the k+ highest-scored IN and the k- lowest OUT; the number of
  correct guesses gives an empirical lower bound on epsilon at confidence 1 - beta (their Theorem 3.1 and the
  p-value of their Appendix D, :func:`audit_p_value`), to set beside the accountant's upper bound.
* :func:`attack_metrics` -- attack AUC and TPR at a fixed FPR (1 %: Carlini et al. argue the low-FPR regime is
  what matters), each with a stratified percentile bootstrap interval (members and non-members resampled apart).

Scores everywhere: higher = "more likely a member".
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import nn

#: The FPR at which the TPR is reported (Carlini et al. 2022 report TPR at 0.1 % and 1 % FPR; a site holds too few
#: non-member images for 0.1 %).
DEFAULT_FPR = 0.01


# ---------------------------------------------------------------------------------------------------- model outputs
@torch.no_grad()
def model_logits(model: nn.Module, images: torch.Tensor, batch_size: int = 64, device=None) -> torch.Tensor:
    """Logits (N, C) of ``model`` (eval mode, no augmentation) on images (N, C_in, S, S), in batches; float32 on
    the CPU. The model is left in eval mode."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    model.eval().to(dev)
    out = [model(images[i:i + batch_size].to(dev)).float().cpu() for i in range(0, images.shape[0], batch_size)]
    return torch.cat(out) if out else torch.zeros(0, 0)


def per_example_losses(logits: torch.Tensor, labels) -> np.ndarray:
    """Cross-entropy of every example, ``-log softmax(logits)_y``: float64 array (N,). logits (N, C), labels (N,)."""
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    return nn.functional.cross_entropy(logits.double(), y, reduction="none").numpy()


def logit_confidence(logits: torch.Tensor, labels) -> np.ndarray:
    """LiRA's logit-scaled confidence ``phi = log(p_y / (1 - p_y))`` computed stably as
    ``z_y - logsumexp_{j != y} z_j`` (Carlini et al. 2022, Sec. IV-B): float64 (N,). logits (N, C), labels (N,)."""
    z = logits.double()
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    zy = z.gather(1, y[:, None]).squeeze(1)
    others = z.scatter(1, y[:, None], float("-inf"))
    return (zy - torch.logsumexp(others, dim=1)).numpy()


# ---------------------------------------------------------------------------------------------------- metrics
def tpr_at_fpr(member_scores, nonmember_scores, fpr: float = DEFAULT_FPR) -> float:
    """The largest TPR of a threshold whose FPR is at most ``fpr``: with ``k = floor(fpr * n_out)`` false positives
    allowed, the threshold is the (k+1)-th highest non-member score and a member counts only when strictly above
    it (ties go against the attack). Raises ValueError on an empty set or ``fpr`` outside [0, 1)."""
    a, b = np.asarray(member_scores, float), np.sort(np.asarray(nonmember_scores, float))[::-1]
    if a.size == 0 or b.size == 0:
        raise ValueError("TPR at FPR needs members and non-members")
    if not 0 <= fpr < 1:
        raise ValueError(f"fpr must be in [0, 1), got {fpr}")
    k = int(math.floor(fpr * b.size + 1e-12))
    return float(np.mean(a > b[k]))


def auc(member_scores, nonmember_scores) -> float:
    """Attack AUC = P(member score > non-member score) + 0.5 P(tie) (Mann-Whitney U / (n_in n_out))."""
    from scipy.stats import rankdata

    a, b = np.asarray(member_scores, float), np.asarray(nonmember_scores, float)
    if a.size == 0 or b.size == 0:
        raise ValueError("AUC needs members and non-members")
    r = rankdata(np.concatenate([a, b]))
    return float((r[:a.size].sum() - a.size * (a.size + 1) / 2) / (a.size * b.size))


def attack_metrics(member_scores, nonmember_scores, fpr: float = DEFAULT_FPR, n_boot: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> dict:
    """AUC and TPR at ``fpr`` with stratified percentile bootstrap intervals.

    Each replicate resamples the members and the non-members with replacement, apart (their counts fixed), and
    recomputes both metrics; the interval is the (alpha/2, 1 - alpha/2) percentile range (Efron & Tibshirani 1993).

    Returns:
        ``{"auc", "auc_low", "auc_high", "tpr_at_fpr", "tpr_low", "tpr_high", "fpr", "n_members",
        "n_nonmembers", "fpr_resolution" (1 / n_nonmembers: the smallest FPR step), "n_boot", "alpha"}``.

    Raises:
        ValueError: an empty set, ``n_boot < 1``.
    """
    a, b = np.asarray(member_scores, float), np.asarray(nonmember_scores, float)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"attack metrics need members and non-members, got {a.size} and {b.size}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    aucs, tprs = np.empty(int(n_boot)), np.empty(int(n_boot))
    for i in range(int(n_boot)):
        ra, rb = a[rng.integers(0, a.size, a.size)], b[rng.integers(0, b.size, b.size)]
        aucs[i], tprs[i] = auc(ra, rb), tpr_at_fpr(ra, rb, fpr)
    lo, hi = 100 * alpha / 2, 100 * (1 - alpha / 2)
    return {"auc": auc(a, b), "auc_low": float(np.percentile(aucs, lo)), "auc_high": float(np.percentile(aucs, hi)),
            "tpr_at_fpr": tpr_at_fpr(a, b, fpr), "tpr_low": float(np.percentile(tprs, lo)),
            "tpr_high": float(np.percentile(tprs, hi)), "fpr": float(fpr), "n_members": int(a.size),
            "n_nonmembers": int(b.size), "fpr_resolution": 1.0 / b.size, "n_boot": int(n_boot), "alpha": alpha}


def roc_points(member_scores, nonmember_scores) -> dict:
    """The ROC curve ``{"fpr": [...], "tpr": [...]}`` (scikit-learn's ``roc_curve``, members = positives)."""
    from sklearn.metrics import roc_curve

    a, b = np.asarray(member_scores, float), np.asarray(nonmember_scores, float)
    fpr, tpr, _ = roc_curve(np.r_[np.ones(a.size), np.zeros(b.size)], np.r_[a, b])
    return {"fpr": fpr.tolist(), "tpr": tpr.tolist()}


# ---------------------------------------------------------------------------------------------------- attacks
def loss_threshold_attack(member_losses, nonmember_losses, **metric_kw) -> dict:
    """The loss-threshold attack (Yeom et al. 2018): score = -loss. Returns :func:`attack_metrics` (keyword
    arguments passed on) plus ``"attack": "loss_threshold"`` and ``"roc"`` (:func:`roc_points`)."""
    a, b = -np.asarray(member_losses, float), -np.asarray(nonmember_losses, float)
    return {"attack": "loss_threshold", **attack_metrics(a, b, **metric_kw), "roc": roc_points(a, b)}


def lira_offline(target_phi, shadow_phi, global_variance: bool = True, min_std: float = 1e-3) -> np.ndarray:
    """Offline LiRA scores (Carlini et al. 2022, Sec. IV-C; higher = member).

    Each image i gets the out-distribution ``N(mu_i, sigma_i^2)`` of its logit-scaled confidence over shadow models
    that never trained on it; the score is ``(phi_i - mu_i) / sigma_i``, a monotone transform of the paper's
    one-sided statistic ``Lambda_i = Phi((phi_i - mu_i) / sigma_i)`` (the same ranking, without the saturation of
    ``Phi`` near 1).

    Args:
        target_phi: (N,) :func:`logit_confidence` of the attacked model.
        shadow_phi: (S, N) the same for S >= 2 shadow models.
        global_variance: one sigma pooled over all images (the paper's "fixed variance", better with few shadows)
            instead of a per-image sigma.
        min_std: floor of sigma.

    Raises:
        ValueError: shapes that do not match, or too few shadows.
    """
    t = np.asarray(target_phi, float).reshape(-1)
    s = np.asarray(shadow_phi, float)
    if s.ndim != 2 or s.shape[1] != t.size:
        raise ValueError(f"shadow_phi must be (S, {t.size}), got {s.shape}")
    if s.shape[0] < 2:
        raise ValueError(f"LiRA needs at least 2 shadow models, got {s.shape[0]}")
    mu = s.mean(axis=0)
    if global_variance:  # pooled within-image variance, S - 1 degrees of freedom per image
        sd = np.full(t.size, max(float(np.sqrt(((s - mu) ** 2).sum() / (s.size - t.size))), min_std))
    else:
        sd = np.maximum(s.std(axis=0, ddof=1), min_std)
    return (t - mu) / sd


def train_shadow_models(build: Callable[[], nn.Module], images: torch.Tensor, labels, n_shadow: int, epochs: int,
                        *, batch_size: int = 16, lr: float = 0.01, seed: int = 0, device=None,
                        train_kw: dict | None = None) -> list[nn.Module]:
    """Train ``n_shadow`` shadow models, each on its own random half of a *public* labelled pool, with
    :func:`hfl_components.training.train_local` (the sites' recipe; ``train_kw`` adds e.g. class weights).

    Args:
        build: returns a fresh model of the attacked model's architecture (seeded by the caller's
            ``torch.manual_seed`` here: shadow j is built after ``torch.manual_seed(seed + j)``).
        images: (P, C, S, S) public images; labels: (P,) ints.
        n_shadow: number of shadows (>= 1); epochs: training epochs each.

    Returns:
        the trained models, in eval mode.

    Raises:
        ValueError: fewer than 2 images, mismatched labels, ``n_shadow`` or ``epochs`` below 1.
    """
    from hfl_components.training import train_local

    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if images.shape[0] < 2 or y.shape[0] != images.shape[0]:
        raise ValueError(f"shadow training needs >= 2 labelled public images, got {images.shape[0]} images and "
                         f"{y.shape[0]} labels")
    if int(n_shadow) < 1 or int(epochs) < 1:
        raise ValueError(f"n_shadow and epochs must be >= 1, got {n_shadow}, {epochs}")
    out = []
    for j in range(int(n_shadow)):
        g = torch.Generator().manual_seed(int(seed) + j)
        idx = torch.randperm(images.shape[0], generator=g)[: images.shape[0] // 2]
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images[idx], y[idx]),
                                             batch_size=int(batch_size), shuffle=True, generator=g)
        torch.manual_seed(int(seed) + j)
        model = build()
        if device is not None:
            model.to(device)
        train_local(model, loader, int(epochs), lr=lr, seed=int(seed) + j, **(train_kw or {}))
        out.append(model.eval())
    return out


# ---------------------------------------------------------------------------------------------------- one-run audit
def canary_inclusion(m: int, seed: int) -> np.ndarray:
    """Which of ``m`` canaries are trained on: each independently with probability 1/2 (bool (m,))."""
    if int(m) < 1:
        raise ValueError(f"the audit needs at least one canary, got {m}")
    return np.random.default_rng(seed).random(int(m)) < 0.5


def audit_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``v`` correct guesses out of ``r`` under (epsilon, delta)-DP, m canaries each included
    with probability 1/2 (Steinke, Nasr & Jagielski 2023, Theorem 3.1 and Appendix D):
    ``P[Bin(r, q) >= v] + 2 m delta max_{1<=i<=v} P[v - i <= Bin(r, q) < v] / i`` with
    ``q = e^eps / (1 + e^eps)``, capped at 1.

    Raises:
        ValueError: not ``0 <= v <= r <= m``, epsilon < 0 or delta outside [0, 1].
    """
    from scipy.stats import binom

    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-float(epsilon)))
    tail = float(binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    below = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))  # P[v - i <= Bin < v], i = 1..v
    spread = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * float(delta) * spread, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest epsilon the audit rejects at level ``beta``: ``sup {eps : audit_p_value(m, r, v, eps, delta) <
    beta}`` (0.0 when even epsilon = 0 is not rejected), by bisection (the p-value increases with epsilon)."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if audit_p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while audit_p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return float("inf")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if audit_p_value(m, r, v, mid, delta) < beta else (lo, mid)
    return lo


def one_run_audit(scores, included, k_pos: int, k_neg: int, delta: float, beta: float = 0.05) -> dict:
    """The one-run audit's guesses and bound (Steinke et al. 2023, Algorithm 1, input-space canaries).

    The ``k_pos`` canaries with the highest scores are guessed IN, the ``k_neg`` lowest OUT, the rest abstained
    (ties broken by index, fixed before looking at ``included``). Fix ``k_pos``, ``k_neg`` before the run: choosing
    them after seeing the result needs a correction (e.g. Bonferroni on beta).

    Args:
        scores: (m,) canary scores (e.g. minus the loss), higher = IN.
        included: (m,) bool, from :func:`canary_inclusion`.
        k_pos, k_neg: guesses of each kind (``k_pos + k_neg <= m``).
        delta: the delta of the DP claim being audited.
        beta: 1 - confidence.

    Returns:
        ``{"epsilon_lower_bound", "correct", "guesses", "canaries", "k_pos", "k_neg", "delta", "beta"}``.
    """
    s, inc = np.asarray(scores, float).reshape(-1), np.asarray(included, bool).reshape(-1)
    m = s.size
    if inc.size != m:
        raise ValueError(f"scores ({m}) and included ({inc.size}) differ in length")
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m or k_pos + k_neg == 0:
        raise ValueError(f"need 0 < k_pos + k_neg <= m = {m}, got {k_pos} + {k_neg}")
    order = np.lexsort((np.arange(m), -s))  # highest score first, ties by index
    guess_in, guess_out = order[:k_pos], order[m - k_neg:] if k_neg else order[:0]
    v = int(inc[guess_in].sum() + (~inc[guess_out]).sum())
    r = int(k_pos + k_neg)
    return {"epsilon_lower_bound": epsilon_lower_bound(m, r, v, delta, beta), "correct": v, "guesses": r,
            "canaries": m, "k_pos": int(k_pos), "k_neg": int(k_neg), "delta": float(delta), "beta": float(beta)}


def default_guesses(m: int) -> tuple[int, int]:
    """``(k_pos, k_neg)`` fixed in advance: a tenth of the canaries each way (at least 1): the paper's audits guess
    on a small fraction of the canaries, where the attack is most confident."""
    k = max(1, int(m) // 10)
    return k, k
