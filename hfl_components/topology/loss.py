"""FedTopo topology-guided local loss (Eq. 9–13), pure PyTorch.

Reference: ../shared/papers/002_fb7c67fce2254bf3.txt, Sec. IV-D. For a sample with label ``y`` and logits ``o``::

    A_y      = R(y, :) * S(y, :)                                   (Eq. 9)
    A~_y(c)  = A_y(c) * 1_k(c) * 1[c != y]                          (Eq. 10; 1_k = class present on the site)
    B_y      = Top_q(A~_y)   (q largest entries kept, others 0)     (Eq. 11)
    o'       = o + gamma * B_y                                      (Eq. 12)
    L        = CE(o, y) + lambda * CE(o', y)                        (Eq. 13)

Training adds ``aux_loss(z, logits, y)`` to ``CE(o, y)``, so :class:`TopologyLoss` returns only
``lambda * CE(o', y)``; :func:`topology_guided_loss` returns the whole of Eq. 13. Inference uses ``o`` only.
``R``, ``S`` and the presence mask are constants (no gradient); the gradient flows through ``o``.

Top-q details: ``q`` is clipped to ``C - 1``; ``q = None`` keeps every candidate (the "no top-q" ablation). Only
candidates (present, ``c != y``) can be selected; when fewer than ``q`` exist, only they are modulated.
Consequence noted in PITFALLS: with ``S = 0`` (round 1, ``S_0 = 0``) ``B_y = 0`` and ``L = (1 + lambda) CE``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _t(x, dtype=torch.float32) -> torch.Tensor:
    return torch.as_tensor(x).detach().clone().to(dtype)


def topology_guidance(y: torch.Tensor, R, S, present_mask=None, q: Optional[int] = 3,
                      use_mask: bool = True) -> torch.Tensor:
    """Top-q guidance ``B_y`` (Eq. 9–11) for a batch of labels.

    Args:
        y: ``(B,)`` long labels in ``[0, C)``.
        R, S: ``(C, C)`` global topology and reliability (or the local ones for the ablation), values in [0, 1].
        present_mask: ``(C,)`` bool classes present on the site (``n_k,c > 0``); required when ``use_mask``.
        q: number of negatives kept (clipped to ``C - 1``); ``None`` keeps all candidates.
        use_mask: False drops the presence mask of Eq. 10 (ablation "no missing mask"); ``c != y`` always applies.
    Returns:
        ``(B, C)`` float32 tensor, non-negative, zero at ``y`` and (when masked) at absent classes, at most ``q``
        non-zero entries per row.
    Raises:
        ValueError: bad shapes, ``q < 0``, or ``present_mask`` missing while ``use_mask``.
    """
    R = _t(R).to(y.device)
    S = _t(S).to(y.device)
    C = R.shape[0]
    if R.shape != (C, C) or S.shape != (C, C):
        raise ValueError(f"R and S must be square and equal-shaped, got {tuple(R.shape)} and {tuple(S.shape)}")
    y = y.to(torch.long)
    A = R[y] * S[y]  # (B, C), Eq. 9
    cand = torch.ones_like(A, dtype=torch.bool)
    cand.scatter_(1, y[:, None], False)
    if use_mask:
        if present_mask is None:
            raise ValueError("present_mask is required when use_mask=True")
        pm = torch.as_tensor(present_mask, dtype=torch.bool).reshape(-1).to(y.device)
        if pm.shape[0] != C:
            raise ValueError(f"present_mask must have shape ({C},), got {tuple(pm.shape)}")
        cand &= pm[None, :]
    q_eff = C - 1 if q is None else min(int(q), C - 1)
    if q_eff < 0:
        raise ValueError(f"q must be >= 0, got {q}")
    B = torch.zeros_like(A)
    if q_eff == 0 or A.shape[0] == 0:
        return B
    scores = A.masked_fill(~cand, float("-inf"))
    vals, idx = scores.topk(q_eff, dim=1)
    vals = torch.where(torch.isfinite(vals), vals, torch.zeros_like(vals))
    return B.scatter(1, idx, vals)


def topology_guided_loss(logits: torch.Tensor, y: torch.Tensor, R, S, present_mask=None, lam: float = 1.0,
                         gamma: float = 1.0, q: Optional[int] = 3, use_mask: bool = True) -> torch.Tensor:
    """Full FedTopo objective of Eq. 13: ``CE(o, y) + lam * CE(o + gamma * B_y, y)`` (mean over the batch).

    Args: as :func:`topology_guidance`; logits ``(B, C)``. Returns a 0-dim tensor.
    """
    B = topology_guidance(y, R, S, present_mask, q, use_mask).to(logits.dtype)
    return F.cross_entropy(logits, y) + lam * F.cross_entropy(logits + gamma * B, y)


class TopologyLoss:
    """FedTopo auxiliary loss ``aux_loss(z, logits, y) -> lam * CE(o + gamma * B_y, y)`` (Eq. 9–13).

    Added to training's ``CE(o, y)`` this gives Eq. 13. During warm-up (``warmup_active=True``; the paper uses no
    topology loss in the first 3 rounds, see :func:`is_warmup_round`) it returns 0, so the total is plain CE.

    Args:
        R: ``(C, C)`` broadcast global topology ``R^g`` (or ``R_k`` for the local-topology ablation).
        S: ``(C, C)`` reliability ``S^g``.
        present_mask: ``(C,)`` bool, classes present on this site.
        lam: lambda, weight of the modulated term (default 1).
        gamma: modulation strength (default 1).
        q: top-q negatives (default 3, clipped to ``C - 1``; ``None`` = all, the "no top-q" ablation).
        warmup_active: True -> the loss is 0 (warm-up round). **Default True, as specified by the team contract:
            pass ``warmup_active=is_warmup_round(r)`` explicitly.**
        use_mask: False -> "no missing mask" ablation.
    Attributes:
        q_effective: the q actually used; ``topq_active``: False when every candidate is kept anyway
            (``q >= C - 1``), which a run must report for the "no top-q" ablation.
    """

    def __init__(self, R, S, present_mask, lam: float = 1.0, gamma: float = 1.0, q: Optional[int] = 3,
                 warmup_active: bool = True, use_mask: bool = True):
        self.R = _t(R)
        self.S = _t(S)
        C = self.R.shape[0]
        if self.R.shape != (C, C) or self.S.shape != (C, C):
            raise ValueError(f"R and S must be (C, C), got {tuple(self.R.shape)} and {tuple(self.S.shape)}")
        self.present = None if present_mask is None else torch.as_tensor(present_mask, dtype=torch.bool).reshape(-1)
        if use_mask and (self.present is None or self.present.shape[0] != C):
            raise ValueError(f"present_mask of shape ({C},) required when use_mask=True")
        if q is not None and q < 0:
            raise ValueError(f"q must be >= 0, got {q}")
        self.lam = float(lam)
        self.gamma = float(gamma)
        self.q = q
        self.warmup_active = bool(warmup_active)
        self.use_mask = bool(use_mask)
        self.q_effective = C - 1 if q is None else min(int(q), C - 1)
        self.topq_active = self.q_effective < C - 1

    def __call__(self, z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Args: z ``(B, d)`` (unused), logits ``(B, C)``, y ``(B,)`` long. Returns a 0-dim tensor."""
        if self.warmup_active:
            return logits.sum() * 0.0
        y = y.to(device=logits.device, dtype=torch.long)
        B = topology_guidance(y, self.R.to(logits.device), self.S.to(logits.device),
                              None if self.present is None else self.present.to(logits.device), self.q,
                              self.use_mask).to(logits.dtype)
        return self.lam * F.cross_entropy(logits + self.gamma * B, y)


def is_warmup_round(round_idx: int, warmup: int = 3) -> bool:
    """True for the first ``warmup`` rounds (``round_idx`` 0-based): no topology loss then (paper Sec. VI-A4)."""
    return round_idx < warmup
