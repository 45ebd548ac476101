"""Linear CKA between layer pre-activations (OHFL Sec. 3.1, Eq. 1).

For two activation matrices X (n x p) and Y (n x q) computed on the *same* n probe inputs, with columns centred
(X̂ = H X, H = I - 11ᵀ/n), OHFL's Eq. 1 is

    CKA(X, Y) = ‖Ŷᵀ X̂‖_F² / (‖X̂ᵀ X̂‖_F · ‖Ŷᵀ Ŷ‖_F),        cost C_ij = 1 − CKA(layer i of A, layer j of B).

We evaluate it in the n x n Gram form (Kornblith et al., 2019): with K = X Xᵀ and L = Y Yᵀ, ‖Ŷᵀ X̂‖_F² = ⟨HKH, HLH⟩,
so CKA = HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L)) with the biased estimator HSIC(K, L) = ⟨HKH, HLH⟩ / (n − 1)²
(the (n − 1)² cancels). Activations stay float32; Gram matrices and sums are float64; centring is explicit; a layer
whose centred Gram is negligible relative to its raw Gram (constant across the probe) gets CKA 0 against everything
instead of 0/0 (a relative epsilon, so that small-scale but varying activations keep scale invariance).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

# the Gram primitives live in grams.py, shared with probe_stats (no import cycle)
from hfl_components.fusion.grams import CKA_KINDS, centre_gram, check_probe, raw_gram

_EPS = 1e-300  # absolute guard on sqrt(HSIC(K,K) HSIC(L,L)) (only exact zeros / underflow)


def _as_2d_tensor(X, name: str) -> torch.Tensor:
    t = torch.as_tensor(X)
    if t.dim() < 1:
        raise ValueError(f"{name} must have a sample dimension, got a scalar")
    t = t.reshape(t.shape[0], -1)
    if t.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 samples for CKA, got {t.shape[0]}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains non-finite values")
    return t


def centred_gram(X) -> np.ndarray:
    """Centred linear Gram matrix H (X Xᵀ) H of an activation matrix.

    Args:
        X: array-like (n, ...) of activations, any float dtype; trailing dims are flattened per sample.

    Returns:
        np.ndarray float64 (n, n), symmetric, rows and columns summing to 0; all zeros when the layer is constant
        across the samples (||HKH||_F <= 1e-10 ||K||_F, i.e. only rounding noise is left after centring).

    Raises:
        ValueError: fewer than 2 samples or non-finite values.
    """
    return centre_gram(raw_gram(_as_2d_tensor(X, "X")))


def cka_from_grams(Kc: np.ndarray, Lc: np.ndarray, eps: float = _EPS) -> float:
    """Linear CKA from two *centred* Gram matrices (n x n float64); 0.0 when either norm is below ``eps``."""
    if Kc.shape != Lc.shape:
        raise ValueError(f"Gram matrices differ in shape: {Kc.shape} vs {Lc.shape} (same probe needed)")
    n = Kc.shape[0]
    hsic_kl = float(np.sum(Kc * Lc)) / (n - 1) ** 2
    hsic_kk = float(np.sum(Kc * Kc)) / (n - 1) ** 2
    hsic_ll = float(np.sum(Lc * Lc)) / (n - 1) ** 2
    denom = np.sqrt(hsic_kk) * np.sqrt(hsic_ll)
    if not denom > eps:
        return 0.0
    return float(min(max(hsic_kl / denom, 0.0), 1.0))


def linear_cka(X, Y, eps: float = _EPS) -> float:
    """Linear CKA similarity of two activation matrices on the same inputs (OHFL Eq. 1, Gram form).

    Args:
        X: array-like (n, p...) — n samples, features flattened per sample (torch or NumPy, any float dtype).
        Y: array-like (n, q...) — the same n samples in the same order.
        eps: absolute guard: if sqrt(HSIC(K,K) HSIC(L,L)) <= eps the similarity is 0.0. Constant layers are
            caught scale-free before that (see :func:`centred_gram`), so tiny but varying activations keep
            their exact CKA.

    Returns:
        float in [0, 1]; 1.0 for X = Y (up to rounding); invariant to orthogonal transforms and isotropic
        scaling of either argument.

    Raises:
        ValueError: different sample counts, fewer than 2 samples, non-finite values.
    """
    X = _as_2d_tensor(X, "X")
    Y = _as_2d_tensor(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X and Y must have the same number of samples, got {X.shape[0]} and {Y.shape[0]}")
    return cka_from_grams(centred_gram(X), centred_gram(Y), eps)


@torch.no_grad()
def layer_activations(model: nn.Module, probe: torch.Tensor) -> list[torch.Tensor]:
    """Pre-activations (conv / linear outputs before ReLU) of every layer of a fusable model on a probe batch.

    Forward hooks on each ``LayerInfo.module`` of ``model.layers()``; the model is run once in eval mode without
    gradients (its training flag is restored afterwards), on the device of the model's parameters (the probe is
    moved there); the activations are returned on the CPU.

    Args:
        model: a :class:`~hfl_components.models.fusable.FusableNet` (anything with ``layers()``).
        probe: float tensor (n, in_channels, S, S), S >= 2**n_stages, n >= 2.

    Returns:
        list, one entry per ``model.layers()`` entry (class layer last): float32 tensor (n, features), conv
        outputs flattened per sample in (C, H, W) order.

    Raises:
        ValueError: malformed probe.
    """
    probe = check_probe(model, probe)
    layers = model.layers()
    outs: list[torch.Tensor | None] = [None] * len(layers)
    handles = []

    def hook(idx):
        def fn(_module, _inp, out):
            outs[idx] = out.detach().to("cpu", torch.float32).reshape(out.shape[0], -1).clone()
        return fn

    for k, info in enumerate(layers):
        handles.append(info.module.register_forward_hook(hook(k)))
    was_training = model.training
    try:
        model.eval()
        p = next(model.parameters(), None)
        model(probe if p is None else probe.to(p.device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return outs  # type: ignore[return-value]





def unbiased_hsic(K: np.ndarray, L: np.ndarray) -> float:
    """Unbiased HSIC estimator of two *raw* (uncentred) Gram matrices (Song et al., 2012, Eq. 5).

    With K̃, L̃ the Grams with zeroed diagonals and n >= 4 samples:
    HSIC_1 = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n−1)(n−2)) − 2/(n−2) · 1ᵀK̃L̃1] / (n(n−3)).
    Unlike the biased estimator behind linear CKA, its expectation is 0 for independent features, so CKA built
    from it ("debiased CKA", Kornblith et al., 2019, App.) does not saturate near 1 for unrelated layers on a
    small probe.

    Raises:
        ValueError: fewer than 4 samples or different shapes.
    """
    if K.shape != L.shape or K.ndim != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"Gram matrices must be square and equal in shape, got {K.shape} and {L.shape}")
    n = K.shape[0]
    if n < 4:
        raise ValueError(f"the unbiased HSIC needs at least 4 samples, got {n}")
    Kt = K - np.diag(np.diag(K))
    Lt = L - np.diag(np.diag(L))
    t1 = float(np.sum(Kt * Lt))
    t2 = float(Kt.sum()) * float(Lt.sum()) / ((n - 1) * (n - 2))
    t3 = 2.0 / (n - 2) * float(Kt.sum(0) @ Lt.sum(1))
    return (t1 + t2 - t3) / (n * (n - 3))


def debiased_cka_from_grams(K: np.ndarray, L: np.ndarray, eps: float = _EPS) -> float:
    """Debiased CKA = HSIC_1(K, L) / sqrt(HSIC_1(K, K) HSIC_1(L, L)) from raw Grams, clipped to [0, 1]."""
    kk, ll = unbiased_hsic(K, K), unbiased_hsic(L, L)
    if not (kk > 0 and ll > 0) or not np.sqrt(kk) * np.sqrt(ll) > eps:
        return 0.0
    return float(min(max(unbiased_hsic(K, L) / (np.sqrt(kk) * np.sqrt(ll)), 0.0), 1.0))


def _pooled(model: nn.Module, acts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Conv pre-activations (n, C*H*W) -> channel means over positions (n, C); fc layers unchanged."""
    out = []
    for a, info in zip(acts, model.layers()):
        c = info.module.out_channels if info.kind == "conv" else a.shape[1]
        out.append(a.reshape(a.shape[0], c, -1).mean(2) if info.kind == "conv" else a)
    return out


@torch.no_grad()
def hidden_grams(model: nn.Module, probe: torch.Tensor, kind: str = "linear") -> list[np.ndarray]:
    """Per hidden layer, the Gram matrix (n x n float64) used by CKA of ``kind`` (class layer excluded).

    ``linear``: centred Gram of the flattened pre-activations (:func:`centred_gram`). ``pooled``: the same after
    averaging each conv channel over positions (one feature per channel, so the image-wide intensity pattern that all
    positions share no longer dominates). ``debiased``: the *raw* Gram of the flattened pre-activations, for
    :func:`debiased_cka_from_grams`.
    """
    if kind not in CKA_KINDS:
        raise ValueError(f"cka must be one of {CKA_KINDS}, got {kind!r}")
    from hfl_components.fusion.probe_stats import hidden_layer_stats  # one pass; Grams computed layer by layer

    return hidden_layer_stats(model, probe, [f"gram_{kind}"])[f"gram_{kind}"]


@torch.no_grad()
def hidden_centred_grams(model: nn.Module, probe: torch.Tensor) -> list[np.ndarray]:
    """Centred Gram matrices (n x n float64) of each *hidden* layer's pre-activations (class layer excluded)."""
    return hidden_grams(model, probe, "linear")


def cka_cost_matrix(model_a: nn.Module, model_b: nn.Module, probe: torch.Tensor, probe_b: torch.Tensor | None = None,
                    kind: str = "linear") -> np.ndarray:
    """OHFL cost matrix C_ij = 1 − CKA(hidden layer i of A, hidden layer j of B) (Sec. 3.1, Eq. 1).

    Args:
        model_a, model_b: fusable models with the same input channels.
        probe: float tensor (n, in_channels, S, S) fed to A (and to B unless ``probe_b`` is given), eval, no grad.
        probe_b: the *same n images* prepared at B's own input size (n, in_channels, S_b, S_b); CKA compares
            n x n Gram matrices, so the two models may see different resolutions (and have any feature counts).
        kind: ``"linear"`` (the paper's Eq. 1), ``"debiased"`` (unbiased-HSIC CKA) or ``"pooled"`` (linear CKA on
            channel means of conv layers); see :func:`hidden_grams`.

    Returns:
        np.ndarray float64 (n_hidden_a, n_hidden_b) with entries in [0, 1]; hidden layers in ``layers()`` order
        (the class layer is not part of the alignment).

    Raises:
        ValueError: malformed probe, different probe image counts, unknown kind, < 4 images for ``debiased``.
    """
    probe_b = probe if probe_b is None else probe_b
    if probe_b.shape[0] != probe.shape[0]:
        raise ValueError(f"the two probes must hold the same images, got {probe.shape[0]} and {probe_b.shape[0]}")
    return cka_cost_from_grams(hidden_grams(model_a, probe, kind), hidden_grams(model_b, probe_b, kind), kind)


def cka_cost_from_grams(Ga: list[np.ndarray], Gb: list[np.ndarray], kind: str = "linear") -> np.ndarray:
    """C_ij = 1 − CKA from the per-layer Grams of :func:`hidden_grams` (centred for ``linear`` / ``pooled``, raw
    for ``debiased``) of two models on the same probe images; float64 (len(Ga), len(Gb)).

    The loop over layer pairs costs O(L_a L_b n²) on n x n Grams (milliseconds at n = 64); the forward passes and
    Grams dominate, so the pairs are not batched (which would change the summation order of the tie-prone DP
    input).
    """
    if kind not in CKA_KINDS:
        raise ValueError(f"cka must be one of {CKA_KINDS}, got {kind!r}")
    sim = debiased_cka_from_grams if kind == "debiased" else cka_from_grams
    C = np.empty((len(Ga), len(Gb)), dtype=np.float64)
    for i, K in enumerate(Ga):
        for j, L in enumerate(Gb):
            C[i, j] = 1.0 - sim(K, L)
    return C
