"""Coordinate and structural alignment losses of FedSAF (pure PyTorch).

Reference: "FedSAF" — ../shared/papers/000_b46201db80f6d43c.txt, Section III. Equation numbers below are the
paper's.

Notation. ``P`` and ``Q`` are ``(n, d_P)`` / ``(n, d_Q)`` float tensors whose rows are paired (row ``i`` of ``P``
describes the same class or sample as row ``i`` of ``Q``). Features are in the model's own (unitless) feature
units; every loss returned here is a 0-dim tensor.

Structural losses (Eq. 12, ``L_struct(P, Q) = D(S(P), S(Q))``):

* ``"gcsa"`` (Eq. 13): ``1 - <K_P, K_Q> / (||K_P||_F ||K_Q||_F)`` with the centred Gram ``K_P = P_c P_c^T``,
  ``P_c = P - 1 p_bar``. Invariant to ``Q = alpha P R + 1 b^T`` (Prop. 2). ``d_P`` and ``d_Q`` may differ.
* ``"rcsa"`` (Eq. 14): ``1 - cos(vec(RDM_P), vec(RDM_Q))`` over the strict upper triangle of the squared-distance
  RDM of the row-normalised matrices. Invariant to ``Q = P R`` (Prop. 3). ``d_P`` and ``d_Q`` may differ.
* ``"mse"`` / ``"cosine"`` (Eq. 6, coordinate baselines used inside the same two-level framework, the paper's
  "Ours-MSE"): row-wise ``||p_i - q_i||_2^2`` resp. ``1 - cos(p_i, q_i)``, averaged over rows. Need ``d_P == d_Q``.

Numerical safety. Norms in denominators are floored at ``eps``; when a structural descriptor is (numerically) zero
— e.g. every row of ``Q`` identical, so the centred Gram vanishes, or only two rows so the RDM has a single entry
whose cosine is trivially 1 — the cosine is undefined and the loss is defined as 0 (no gradient), never NaN. A level
with fewer than 2 rows contributes 0 for the structural kinds (and for the coordinate kinds when it has 0 rows).

Scale of lambda (decision). ``"mse"`` follows Eq. 6 literally: the squared L2 distance is *summed* over the
feature dimension and averaged over rows. FedProto's reference code uses ``nn.MSELoss`` (mean over elements), i.e.
our value divided by ``d``; a lambda tuned for that code corresponds to ``lambda / d`` here. The structural and
cosine losses lie in ``[0, 2]`` and need no rescaling.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

KINDS = ("gcsa", "rcsa", "mse", "cosine")
STRUCTURAL_KINDS = ("gcsa", "rcsa")
EPS = 1e-12


def _as_tensor(x, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    t = torch.as_tensor(x)
    if like is not None:
        t = t.to(device=like.device, dtype=like.dtype)
    return t


def _zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero that stays attached to the graph of ``tensors`` (so ``.backward()`` works on it)."""
    out = None
    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point():
            s = t.sum() * 0.0
            out = s if out is None else out + s
    return out if out is not None else torch.zeros(())


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown alignment kind {kind!r}; expected one of {KINDS}")


def centred_gram(P: torch.Tensor) -> torch.Tensor:
    """Centred Gram matrix ``K_P = P_c P_c^T`` with ``P_c = P - 1 p_bar`` (Eq. 13).

    Args:
        P: ``(n, d)`` rows to relate.
    Returns:
        ``(n, n)`` symmetric positive semi-definite matrix.
    """
    Pc = P - P.mean(dim=0, keepdim=True)
    return Pc @ Pc.T


def rdm(P: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Squared-distance representational dissimilarity matrix of the row-normalised ``P`` (Eq. 14).

    ``RDM[i, j] = ||p~_i - p~_j||^2`` with ``p~_i = p_i / max(||p_i||, eps)``; values in ``[0, 4]``.

    Args:
        P: ``(n, d)``.
    Returns:
        ``(n, n)`` symmetric, zero diagonal.
    """
    Pn = F.normalize(P, dim=1, eps=eps)
    sq = (Pn * Pn).sum(dim=1)
    G = Pn @ Pn.T
    D = sq[:, None] + sq[None, :] - 2.0 * G
    return D.clamp_min(0.0)


def _tol(t: torch.Tensor, eps: float) -> float:
    """Relative degeneracy tolerance: sqrt of the dtype's machine epsilon (floored at ``eps``)."""
    return max(eps, torch.finfo(t.dtype).eps ** 0.5)


def _safe_cosine_loss(a: torch.Tensor, b: torch.Tensor, ok: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 - cos(vec a, vec b)``; 0 (no gradient) where ``ok`` is False (a degenerate descriptor)."""
    a = a.reshape(-1)
    b = b.reshape(-1)
    denom = (torch.sqrt((a * a).sum()) * torch.sqrt((b * b).sum())).clamp_min(eps)
    loss = 1.0 - (a * b).sum() / denom
    return torch.where(ok, loss, _zero(a, b))


def coordinate_loss(z: torch.Tensor, target: torch.Tensor, kind: str = "mse", eps: float = EPS) -> torch.Tensor:
    """Coordinate alignment (Eq. 6) between paired rows, averaged over rows.

    Args:
        z: ``(n, d)`` features.
        target: ``(n, d)`` prototypes ``P_g^{y_i}`` (same ``d``).
        kind: ``"mse"`` -> ``mean_i ||z_i - t_i||_2^2`` (summed over ``d``, see module note on lambda);
            ``"cosine"`` -> ``mean_i (1 - cos(z_i, t_i))``.
    Returns:
        0-dim tensor; 0 when ``n == 0``.
    Raises:
        ValueError: unknown kind or shape mismatch.
    """
    if kind not in ("mse", "cosine"):
        raise ValueError(f"coordinate kind must be 'mse' or 'cosine', got {kind!r}")
    if z.shape != target.shape:
        raise ValueError(f"coordinate loss needs equal shapes, got {tuple(z.shape)} and {tuple(target.shape)}")
    if z.shape[0] == 0:
        return _zero(z, target)
    if kind == "mse":
        return ((z - target) ** 2).sum(dim=1).mean()
    return (1.0 - F.cosine_similarity(z, target, dim=1, eps=eps)).mean()


def structural_loss(P: torch.Tensor, Q: torch.Tensor, kind: str = "gcsa", eps: float = EPS) -> torch.Tensor:
    """Alignment discrepancy ``L_struct(P, Q) = D(S(P), S(Q))`` (Eq. 12).

    Args:
        P: ``(n, d_P)``; Q: ``(n, d_Q)`` with paired rows. ``d_P != d_Q`` is allowed for ``gcsa``/``rcsa``.
        kind: ``"gcsa"`` (Eq. 13), ``"rcsa"`` (Eq. 14), ``"mse"`` or ``"cosine"`` (Eq. 6, row-paired).
        eps: floor for norms in denominators.
    Returns:
        0-dim differentiable tensor. Structural kinds: in ``[0, 2]``; 0 when ``n < 2`` or a descriptor is
        degenerate (see module docstring). Coordinate kinds: 0 when ``n == 0``.
    Raises:
        ValueError: unknown kind, row counts differ, or feature dims differ for a coordinate kind.
    """
    _check_kind(kind)
    P = torch.as_tensor(P)
    Q = _as_tensor(Q, like=P)
    if P.dim() != 2 or Q.dim() != 2 or P.shape[0] != Q.shape[0]:
        raise ValueError(f"P and Q must be (n, d) with the same n, got {tuple(P.shape)} and {tuple(Q.shape)}")
    if kind in ("mse", "cosine"):
        return coordinate_loss(P, Q, kind, eps=eps)
    n = P.shape[0]
    if n < 2:
        return _zero(P, Q)
    tol = _tol(P, eps)
    if kind == "gcsa":
        # Degenerate when the centred rows vanish relative to the raw rows (all rows equal up to rounding).
        def spread(X):
            X = X.detach()
            return torch.linalg.norm(X - X.mean(dim=0, keepdim=True)) > tol * torch.linalg.norm(X) + eps
        ok = spread(P) & spread(Q)
        return _safe_cosine_loss(centred_gram(P), centred_gram(Q), ok, eps)
    iu = torch.triu_indices(n, n, offset=1, device=P.device)
    dp = rdm(P, eps)[iu[0], iu[1]]
    dq = rdm(Q, eps)[iu[0], iu[1]]
    # RDM entries lie in [0, 4]; rounding noise is ~dtype eps per entry.
    floor = tol * (dp.numel() ** 0.5)
    ok = (torch.linalg.norm(dp.detach()) > floor) & (torch.linalg.norm(dq.detach()) > floor)
    return _safe_cosine_loss(dp, dq, ok, eps)


def coordinate_decomposition(Z: torch.Tensor, P: torch.Tensor, eps: float = EPS):
    """Implicit decomposition of coordinate alignment (Prop. 1, Eq. 7–9), a diagnostic.

    With row-normalised ``Z^`` and ``P^`` (``(n, d)`` each)::

        L_coord = ||Z^ - P^||_F^2                                   (Eq. 7)
        R*      = argmax_{R in O(d)} <Z^, P^ R> = U V^T,  P^^T Z^ = U Sigma V^T   (Eq. 8, orthogonal Procrustes)
        L_shape = ||Z^ - P^ R*||_F^2
        L_rigid = 2 (<Z^, P^ R*> - <Z^, P^>) >= 0                    (Eq. 9)

    and ``L_coord = L_shape + L_rigid`` exactly (up to float rounding).

    Args:
        Z: ``(n, d)`` features; P: ``(n, d)`` matching prototypes (same ``d``). Computed in float64.
    Returns:
        ``(L_coord, L_shape, L_rigid)`` as 0-dim float64 tensors (sums over rows, not means, as in Eq. 7).
    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    Z = torch.as_tensor(Z).detach().to(torch.float64)
    P = torch.as_tensor(P).detach().to(torch.float64)
    if Z.dim() != 2 or Z.shape != P.shape:
        raise ValueError(f"Z and P must be (n, d) with equal shapes, got {tuple(Z.shape)} and {tuple(P.shape)}")
    Zh = F.normalize(Z, dim=1, eps=eps)
    Ph = F.normalize(P, dim=1, eps=eps)
    U, _, Vh = torch.linalg.svd(Ph.T @ Zh)
    R = U @ Vh
    l_coord = ((Zh - Ph) ** 2).sum()
    l_shape = ((Zh - Ph @ R) ** 2).sum()
    l_rigid = 2.0 * ((Zh * (Ph @ R)).sum() - (Zh * Ph).sum())
    return l_coord, l_shape, l_rigid


def batch_prototypes(z: torch.Tensor, y: torch.Tensor, C: int):
    """Differentiable per-class means of a batch (Eq. 15).

    Args:
        z: ``(B, d)`` features; y: ``(B,)`` long labels in ``[0, C)``; C: number of classes.
    Returns:
        ``(P, counts)``: ``P`` ``(C, d)`` class means (zero rows for classes absent from the batch), ``counts``
        ``(C,)`` long.
    Raises:
        ValueError: label out of range or shapes inconsistent.
    """
    if z.dim() != 2 or y.dim() != 1 or y.shape[0] != z.shape[0]:
        raise ValueError(f"expected z (B, d) and y (B,), got {tuple(z.shape)} and {tuple(y.shape)}")
    y = y.to(device=z.device, dtype=torch.long)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= C):
        raise ValueError(f"labels must lie in [0, {C}), got range [{int(y.min())}, {int(y.max())}]")
    counts = torch.bincount(y, minlength=C)[:C]
    sums = z.new_zeros((C, z.shape[1])).index_add(0, y, z)
    P = sums / counts.clamp_min(1).to(z.dtype)[:, None]
    return P, counts


class FedSAFAuxLoss:
    """FedSAF two-level alignment as an auxiliary loss ``aux_loss(z, logits, y)`` (Eq. 15–19).

    Returns ``lam * L_proto + gamma * L_inst`` so that training's ``CE + aux_loss`` is Eq. 19:

    * ``L_proto`` (Eq. 16–17): ``structural_loss(P_b[C_b], P_g[C_b], kind)`` where ``P_b`` are the batch prototypes
      (Eq. 15) and ``C_b`` the classes present in the batch *and* available in the global set.
    * ``L_inst`` (Eq. 18): ``structural_loss(z[J], z~[J], kind)`` with the prototype-substituted matrix
      ``z~_j = P_g^{y_j}`` over the samples ``J`` whose class is available in the global set.

    ``kind`` selects the discrepancy at both levels (``gcsa``/``rcsa``, or the coordinate baselines ``mse``/``cosine``
    as in the paper's "Ours-MSE"), so only the alignment function differs between runs. Difference from the
    paper: its plain coordinate baseline (Eq. 2/6, FedProto) is instance-level only; here ``mse``/``cosine`` run
    through both levels, so ``FedSAFAuxLoss(P_g, "mse", lam=0, gamma=lam_fedproto)`` recovers FedProto's Eq. 2
    exactly (instance level: ``mean_j ||z_j - P_g^{y_j}||^2``). Round 0 (``global_prototypes
    is None``): returns 0, supervised loss only.

    Args:
        global_prototypes: ``(C, d_g)`` broadcast prototypes, or ``None``. Stored detached (a constant target).
            For ``mse``/``cosine`` ``d_g`` must equal the feature dim ``d``; structural kinds allow ``d_g != d``.
        kind: one of ``"gcsa"``, ``"rcsa"``, ``"mse"``, ``"cosine"``.
        lam: weight of the prototype level (lambda, default 1.0).
        gamma: weight of the instance level (gamma, default 1.0).
        global_mask: ``(C,)`` bool, classes present in the global set (from :func:`aggregate_fedproto`). Default:
            rows of ``global_prototypes`` with non-zero norm (an all-zero row carries no information).

    Edge cases: a level with fewer than 2 rows (structural kinds) or 0 rows (coordinate kinds) contributes 0;
    a single-class batch therefore gives 0 for structural kinds (the target structure is degenerate). With ``C ==
    2`` the prototype-level structural term is identically 0 (PITFALLS) and a warning is emitted.

    The last computed terms are kept (as floats) in ``self.last = {"proto": ..., "inst": ...}`` for logging.
    """

    def __init__(self, global_prototypes, kind: str = "gcsa", lam: float = 1.0, gamma: float = 1.0,
                 global_mask=None):
        _check_kind(kind)
        self.kind = kind
        self.lam = float(lam)
        self.gamma = float(gamma)
        self.last = {"proto": 0.0, "inst": 0.0}
        if global_prototypes is None:
            self.P_g = None
            self.mask = None
            return
        P_g = torch.as_tensor(global_prototypes).detach()
        if P_g.dim() != 2 or not P_g.is_floating_point():
            raise ValueError(f"global_prototypes must be a float (C, d) matrix, got {tuple(P_g.shape)}")
        if not torch.isfinite(P_g).all():
            raise ValueError("global_prototypes contain non-finite values")
        C = P_g.shape[0]
        if global_mask is None:
            mask = P_g.norm(dim=1) > 0
        else:
            mask = torch.as_tensor(global_mask, dtype=torch.bool).reshape(-1)
            if mask.shape[0] != C:
                raise ValueError(f"global_mask must have shape ({C},), got {tuple(mask.shape)}")
        self.P_g = P_g
        self.mask = mask
        if C == 2 and kind in STRUCTURAL_KINDS:
            warnings.warn("FedSAF with 2 classes: the prototype-level structural term is constant (0); only the "
                          "instance-level term acts (see PITFALLS.md)", stacklevel=2)

    def __call__(self, z: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Args: z ``(B, d)`` features, logits ``(B, C)`` (unused), y ``(B,)`` long. Returns a 0-dim tensor."""
        if self.P_g is None:
            self.last = {"proto": 0.0, "inst": 0.0}
            return _zero(z)
        P_g = self.P_g.to(device=z.device, dtype=z.dtype)
        mask = self.mask.to(z.device)
        C = P_g.shape[0]
        y = y.to(device=z.device, dtype=torch.long)
        P_b, counts = batch_prototypes(z, y, C)
        classes = torch.nonzero((counts > 0) & mask).reshape(-1)
        l_proto = structural_loss(P_b[classes], P_g[classes], self.kind)
        keep = mask[y]
        l_inst = structural_loss(z[keep], P_g[y[keep]], self.kind)
        self.last = {"proto": float(l_proto.detach()), "inst": float(l_inst.detach())}
        return self.lam * l_proto + self.gamma * l_inst
