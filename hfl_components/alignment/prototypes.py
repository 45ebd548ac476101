"""Prototype construction for FedSAF / FedProto (pure PyTorch): local class means, server-side global prototypes
(Eq. 3, 4, 5 of the FedSAF paper, ../shared/papers/000_b46201db80f6d43c.txt, Sec. III-A), the effective-rank
diagnostic of Fig. 1, and upload validation.

Decisions (PITFALLS.md, "Prototypes"):

* Local prototypes are computed **after** local training, as class means of the site's training features
  (``training.extract_features`` then :func:`local_prototypes`), not accumulated during training (which mixes
  features of several model states). Classes absent on a site get a zero row and count 0.
* The FedProto server mean (Eq. 3) is **sample-weighted per class**: site ``k``'s class-``c`` prototype is weighted by
  its class-``c`` count ``n_k^c`` (the FedProto paper weights, its reference code does not). The paper's
  Eq. 3 writes one client weight ``omega_i`` for all classes; here the per-class counts are used.
* Global prototypes are float tensors ``(C, d)`` plus a bool mask ``(C,)`` of classes any site observed; missing
  classes have zero rows and must be excluded by the mask (``FedSAFAuxLoss(global_mask=...)``).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .losses import batch_prototypes


def local_prototypes(Z, y, C: int):
    """Class-mean prototypes of a site's features (Eq. 15 over the whole training set; FedProto's local step).

    Args:
        Z: ``(N, d)`` features (torch or NumPy), typically from ``extract_features`` after local training.
        y: ``(N,)`` integer labels in ``[0, C)``.
        C: number of classes.
    Returns:
        ``(P, counts)``: ``P`` float32 ``(C, d)`` detached class means (zero rows for absent classes), ``counts``
        int64 ``(C,)``.
    Raises:
        ValueError: shapes inconsistent or labels out of range.
    """
    Z = torch.as_tensor(Z).detach().to(torch.float64)
    y = torch.as_tensor(y).reshape(-1).to(torch.long)
    P, counts = batch_prototypes(Z, y, C)
    return P.to(torch.float32), counts.to(torch.int64)


def aggregate_fedproto(P_list: Sequence, counts_list: Sequence):
    """FedProto sample-weighted global prototypes (Eq. 3 with per-class weights ``omega_k^c = n_k^c``).

    ``P_g[c] = sum_k n_k^c P_k[c] / sum_k n_k^c`` for every class with ``sum_k n_k^c > 0``; other classes get a zero
    row and ``mask[c] = False``. Rows of a site with ``n_k^c = 0`` never contribute (whatever they contain).

    Args:
        P_list: K site prototype matrices, each ``(C, d)``.
        counts_list: K count vectors, each ``(C,)``, non-negative.
    Returns:
        ``(P_g, mask)``: float32 ``(C, d)`` and bool ``(C,)``.
    Raises:
        ValueError: empty input, mismatched shapes, or negative counts.
    """
    if len(P_list) == 0 or len(P_list) != len(counts_list):
        raise ValueError(f"need one counts vector per prototype matrix, got {len(P_list)} and {len(counts_list)}")
    P = torch.stack([torch.as_tensor(p, dtype=torch.float64) for p in P_list])  # (K, C, d)
    n = torch.stack([torch.as_tensor(c, dtype=torch.float64).reshape(-1) for c in counts_list])  # (K, C)
    if P.dim() != 3 or n.shape != P.shape[:2]:
        raise ValueError(f"prototypes (K, C, d) {tuple(P.shape)} and counts (K, C) {tuple(n.shape)} disagree")
    if (n < 0).any():
        raise ValueError("class counts must be non-negative")
    P = torch.where(n[..., None] > 0, P, torch.zeros_like(P))  # ignore rows of absent classes
    total = n.sum(dim=0)  # (C,)
    mask = total > 0
    P_g = (n[..., None] * P).sum(dim=0) / total.clamp_min(1e-300)[:, None]
    P_g[~mask] = 0.0
    return P_g.to(torch.float32), mask


def fixed_hypersphere_prototypes(C: int, d: int, seed: int = 0, steps: int = 500) -> torch.Tensor:
    """Fixed, well-spread unit prototypes ``P_g^c = a^c`` (Eq. 4, AlignFed-style).

    For ``C <= d`` the optimum is exact: a simplex equiangular tight frame (pairwise cosine ``-1/(C-1)``), placed in a
    random ``C``-dimensional subspace drawn from ``seed``. For ``C > d`` the maximal pairwise cosine is minimised
    numerically (``steps`` Adam steps on a log-sum-exp of pairwise cosines, re-projected onto the sphere).

    Args:
        C: number of classes (>= 1); d: feature dimension (>= 1); seed: RNG seed; steps: iterations when ``C > d``.
    Returns:
        float32 ``(C, d)`` with unit-norm rows; identical for identical ``(C, d, seed)``.
    Raises:
        ValueError: ``C < 1`` or ``d < 1``.
    """
    if C < 1 or d < 1:
        raise ValueError(f"need C >= 1 and d >= 1, got C={C}, d={d}")
    g = torch.Generator().manual_seed(int(seed))
    if C == 1:
        return F.normalize(torch.randn(1, d, generator=g, dtype=torch.float64), dim=1).float()
    if C <= d:
        U, _ = torch.linalg.qr(torch.randn(d, C, generator=g, dtype=torch.float64))  # (d, C) orthonormal columns
        M = math.sqrt(C / (C - 1)) * (torch.eye(C, dtype=torch.float64) - 1.0 / C)  # (C, C) simplex ETF
        return F.normalize(M @ U.T, dim=1).float()
    X = torch.randn(C, d, generator=g, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.Adam([X], lr=0.01)
    off = ~torch.eye(C, dtype=torch.bool)
    for _ in range(steps):
        Xn = F.normalize(X, dim=1)
        cos = (Xn @ Xn.T)[off]
        loss = torch.logsumexp(cos / 0.05, dim=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            X.copy_(F.normalize(X, dim=1))
    return F.normalize(X.detach(), dim=1).float()


def train_tgp_prototypes(uploads: Sequence, counts: Sequence, C: int, d: int, margin: float = 1.0,
                         steps: int = 100, seed: int = 0, init=None, lr: float = 0.01):
    """Trainable server prototypes (Eq. 5, FedTGP-style margin-enhanced contrastive fit).

    A server embedding ``E`` (``C x d``) is fitted to the uploaded prototypes ``P_k^c`` (only ``n_k^c > 0``) with::

        L = mean_{k,c} -log softmax_j( -(||P_k^c - E_j||_2 + delta * [j == c]) )[c]

    i.e. cross-entropy over negative Euclidean distances with a margin ``delta`` added to the own-class distance,
    which pushes each class's embedding closer to its uploads than any other class's by at least ``delta``
    (FedTGP, Zhang et al. AAAI 2024). Simplifications (documented): the embedding is a plain parameter matrix
    (FedTGP adds an MLP generator on top) and ``delta`` is a fixed argument (FedTGP adapts it per round as
    ``min(max inter-class distance, tau)``). Every upload has the same weight.

    Args:
        uploads: K site prototype matrices ``(C, d)``.
        counts: K count vectors ``(C,)``; rows with count 0 are ignored.
        C, d: shape of the embedding.
        margin: ``delta`` in feature units (>= 0).
        steps: Adam steps; lr: Adam learning rate.
        seed: seeds the initialisation of classes with no upload (and the whole embedding if no upload at all).
        init: optional ``(C, d)`` starting embedding (pass the previous round's result to keep training it across
            rounds, as FedTGP does). Default: the FedProto mean (Eq. 3) for observed classes, a seeded Gaussian
            with the uploads' scale for the others.
    Returns:
        ``(P_g, mask)``: float32 ``(C, d)`` trained embedding and bool ``(C,)`` classes with at least one upload.
    Raises:
        ValueError: shapes inconsistent or ``margin < 0``.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if len(uploads) != len(counts):
        raise ValueError("need one counts vector per upload")
    g = torch.Generator().manual_seed(int(seed))
    rows, labels = [], []
    for P, n in zip(uploads, counts):
        P = torch.as_tensor(P, dtype=torch.float64)
        n = torch.as_tensor(n).reshape(-1)
        if P.shape != (C, d) or n.shape != (C,):
            raise ValueError(f"upload shapes {tuple(P.shape)}, {tuple(n.shape)} != ({C}, {d}), ({C},)")
        for c in torch.nonzero(n > 0).reshape(-1).tolist():
            rows.append(P[c])
            labels.append(c)
    mask = torch.zeros(C, dtype=torch.bool)
    mask[labels] = True
    if init is not None:
        E0 = torch.as_tensor(init, dtype=torch.float64).clone()
        if E0.shape != (C, d):
            raise ValueError(f"init must be ({C}, {d}), got {tuple(E0.shape)}")
    else:
        scale = torch.stack(rows).norm(dim=1).mean() / math.sqrt(d) if rows else torch.tensor(1.0)
        E0 = torch.randn(C, d, generator=g, dtype=torch.float64) * scale
        if rows:
            P_mean, m = aggregate_fedproto(list(uploads), list(counts))
            E0[m] = P_mean[m].to(torch.float64)
    if not rows:
        return E0.float(), mask
    X = torch.stack(rows)
    t = torch.tensor(labels, dtype=torch.long)
    E = E0.clone().requires_grad_(True)
    opt = torch.optim.Adam([E], lr=lr)
    bump = F.one_hot(t, C).to(torch.float64) * float(margin)
    for _ in range(int(steps)):
        dist = torch.sqrt(((X[:, None, :] - E[None, :, :]) ** 2).sum(-1) + 1e-12)  # (M, C)
        loss = F.cross_entropy(-(dist + bump), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return E.detach().float(), mask


def effective_rank(P, eps: float = 1e-12) -> float:
    """Effective rank of a stacked prototype matrix (Fig. 1 diagnostic; Roy & Vetterli 2007).

    ``erank = exp(H(p))`` with ``p_i = sigma_i / sum_j sigma_j`` over the singular values of ``P`` (not centred) and
    ``H`` the Shannon entropy (natural log). Lies in ``[1, min(n, d)]``; 0 for an all-zero matrix. Higher values mean
    the sites' prototypes span more directions, i.e. their feature spaces disagree more.

    Args:
        P: ``(n, d)``, e.g. all sites' ``(C, d)`` prototypes stacked (rows of absent classes removed).
    Returns:
        float.
    """
    P = torch.as_tensor(P).detach().to(torch.float64)
    if P.dim() != 2 or P.numel() == 0:
        raise ValueError(f"P must be a non-empty (n, d) matrix, got {tuple(P.shape)}")
    s = torch.linalg.svdvals(P)
    total = s.sum()
    if total <= eps:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def validate_prototype_upload(P, counts, C: int, d: int) -> None:
    """Check one site's prototype upload; raise ``ValueError`` with the reason when it must be dropped.

    Requirements: ``P`` is ``(C, d)`` and finite; ``counts`` is ``(C,)``, finite, integer-valued and non-negative,
    with at least one present class; rows of absent classes (count 0) are all zero, as :func:`local_prototypes`
    produces them (anything else means the counts and the prototypes disagree).

    Args:
        P: ``(C, d)`` array/tensor; counts: ``(C,)``; C, d: expected shape.
    Raises:
        ValueError: the first violated requirement, e.g. ``"prototype shape (3, 64) != expected (3, 128)"``.
    """
    P = np.asarray(torch.as_tensor(P).detach().cpu().numpy() if torch.is_tensor(P) else P)
    n = np.asarray(torch.as_tensor(counts).detach().cpu().numpy() if torch.is_tensor(counts) else counts)
    if P.shape != (C, d):
        raise ValueError(f"prototype shape {P.shape} != expected {(C, d)}")
    if n.shape != (C,):
        raise ValueError(f"counts shape {n.shape} != expected {(C,)}")
    if not np.issubdtype(P.dtype, np.number) or not np.isfinite(P).all():
        raise ValueError("prototypes contain non-finite or non-numeric values")
    if not np.issubdtype(n.dtype, np.number) or not np.isfinite(n).all():
        raise ValueError("counts contain non-finite or non-numeric values")
    if (n < 0).any():
        raise ValueError(f"counts must be non-negative, got {n.tolist()}")
    if not np.all(np.equal(np.round(n), n)):
        raise ValueError(f"counts must be integers, got {n.tolist()}")
    if not (n > 0).any():
        raise ValueError("no class present (all counts are 0)")
    bad = [c for c in range(C) if n[c] == 0 and np.any(P[c] != 0)]
    if bad:
        raise ValueError(f"classes {bad} have count 0 but non-zero prototype rows (counts and prototypes disagree)")


def nearest_prototype_probs(Z: np.ndarray, P: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Class probabilities from the distances of features ``Z (N, d)`` to the site's own local prototypes
    ``P (C, d)``: ``softmax_c(-||z - p_c||^2)`` over the classes the site holds (count > 0); other classes get 0.
    The arg-max is the nearest local prototype; the soft scores make AUC defined (FedSAF/FedProto's
    ``--eval nearest-prototype``: FedProto's nearest-prototype inference, on the site's own prototypes).

    Returns:
        (N, C) float64 probabilities, rows summing to 1.

    Raises:
        ValueError: every class count is 0."""
    Z = np.asarray(Z, np.float64)
    P = np.asarray(P, np.float64)
    have = np.asarray(counts) > 0
    if not have.any():
        raise ValueError("no local prototype to evaluate against (all class counts are 0)")
    d2 = ((Z[:, None, :] - P[None, :, :]) ** 2).sum(-1)
    logits = np.where(have[None, :], -d2, -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)
