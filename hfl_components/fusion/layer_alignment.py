"""Cross-layer alignment by dynamic programming (OHFL Sec. 3.1) and its random ablation (Table 5).

Given the cost matrix C (n_src x n_tgt, C_ij = 1 − CKA, see :mod:`.cka`) between the hidden layers of a source and a
target model, find a strictly increasing map a from the hidden layers of the *shallower* model (μ layers) into those
of the *deeper* one (ν layers, μ <= ν) with

    a(1) = 1,  a(μ) = ν  (first and last hidden layers pinned),     minimise  S = Σ_i C_{i, a(i)},

under the type constraint of the paper: a conv layer only matches a conv layer of the same stage (the same
resolution, between the same pooling layers), an fc layer only an fc layer. Solved exactly by DP in O(μ ν²):

    D[0, 0] = C[0, 0];   D[i, j] = C[i, j] + min_{j' < j} D[i − 1, j']   (allowed (i, j) only);   S* = D[μ−1, ν−1].

Ties are broken deterministically toward the earliest predecessor layer j'. The map is returned as matched index
pairs ``(i_src, j_tgt)`` in the source/target orientation of the cost matrix, whichever side is shallower.
"""
from __future__ import annotations

import random as _random
from typing import Sequence

import numpy as np

Pairs = list[tuple[int, int]]


def _allowed(kinds_a, stages_a, kinds_b, stages_b) -> np.ndarray:
    ka = np.array([f"{k}:{int(s) if k == 'conv' else -1}" for k, s in zip(kinds_a, stages_a)])
    kb = np.array([f"{k}:{int(s) if k == 'conv' else -1}" for k, s in zip(kinds_b, stages_b)])
    return ka[:, None] == kb[None, :]


def _check_inputs(kinds_src, stages_src, kinds_tgt, stages_tgt) -> None:
    if len(kinds_src) != len(stages_src) or len(kinds_tgt) != len(stages_tgt):
        raise ValueError("kinds and stages must have the same length for each model")
    if len(kinds_src) == 0 or len(kinds_tgt) == 0:
        raise ValueError("both models need at least one hidden layer to align")
    for k in list(kinds_src) + list(kinds_tgt):
        if k not in ("conv", "fc"):
            raise ValueError(f"layer kind must be 'conv' or 'fc', got {k!r}")


def _dp(cost: np.ndarray, allowed: np.ndarray) -> list[int]:
    """Exact DP over a (μ x ν) cost with μ <= ν; returns a (list of ν-indices, strictly increasing)."""
    mu, nu = cost.shape
    if mu == 1 and nu > 1:
        raise ValueError("no feasible layer map: a single hidden layer cannot be pinned to both the first and the "
                         f"last of {nu} hidden layers")
    INF = np.inf
    D = np.full((mu, nu), INF)
    back = np.full((mu, nu), -1, dtype=np.int64)
    if allowed[0, 0]:
        D[0, 0] = cost[0, 0]
    for i in range(1, mu):
        best, arg = INF, -1
        for j in range(nu):
            # prefix minimum over j' < j, earliest index wins ties
            if j >= 1 and D[i - 1, j - 1] < best:
                best, arg = D[i - 1, j - 1], j - 1
            if allowed[i, j] and arg >= 0 and np.isfinite(best):
                D[i, j] = cost[i, j] + best
                back[i, j] = arg
    if not np.isfinite(D[mu - 1, nu - 1]):
        raise ValueError("no feasible layer map: the shallower model must have at most as many layers as the deeper "
                         "one in every conv stage and in the fc block (conv matches conv of the same stage, fc "
                         "matches fc, first and last hidden layers pinned)")
    a = [nu - 1]
    for i in range(mu - 1, 0, -1):
        a.append(int(back[i, a[-1]]))
    return a[::-1]


def _random_map(allowed: np.ndarray, seed) -> list[int]:
    """Uniformly random feasible strictly increasing map (pins and type constraints as in the DP)."""
    mu, nu = allowed.shape
    if mu == 1 and nu > 1:
        raise ValueError("no feasible layer map: a single hidden layer cannot be pinned to both ends")
    # cnt[i][j]: number of feasible completions for layers i..μ-1 given a(i) = j (exact Python ints)
    cnt = [[0] * nu for _ in range(mu)]
    if allowed[mu - 1, nu - 1]:
        cnt[mu - 1][nu - 1] = 1
    for i in range(mu - 2, -1, -1):
        suffix = 0
        for j in range(nu - 1, -1, -1):
            cnt[i][j] = suffix if allowed[i, j] else 0
            suffix += cnt[i + 1][j]
    if cnt[0][0] == 0:
        raise ValueError("no feasible layer map under the type/stage constraints and pinned first/last layers")
    rng = _random.Random(seed)
    a = [0]
    for i in range(1, mu):
        choices = [(j, cnt[i][j]) for j in range(a[-1] + 1, nu) if cnt[i][j] > 0]
        r = rng.randrange(sum(c for _, c in choices))
        for j, c in choices:
            if r < c:
                a.append(j)
                break
            r -= c
    return a


def align_layers(cost, kinds_src: Sequence[str], stages_src: Sequence[int], kinds_tgt: Sequence[str],
                 stages_tgt: Sequence[int], method: str = "cka", seed=None) -> Pairs:
    """Strictly increasing map between the hidden layers of two models (OHFL Sec. 3.1; ``random``: Table 5).

    Args:
        cost: array-like (n_src, n_tgt) float, C_ij = cost of matching source hidden layer i with target hidden
            layer j (e.g. 1 − CKA from :func:`cka_cost_matrix`). May be ``None`` for ``method="random"``.
        kinds_src, kinds_tgt: per hidden layer ``"conv"`` or ``"fc"`` (``LayerInfo.kind``), forward order.
        stages_src, stages_tgt: per hidden layer conv stage index (ignored for fc; ``LayerInfo.stage``).
        method: ``"cka"`` — exact DP minimising Σ C over feasible maps, ties to the earliest predecessor;
            ``"random"`` — a map drawn uniformly from the same feasible set (same pins and type constraints).
        seed: int seed for ``"random"`` (None: nondeterministic).

    Returns:
        list of ``(i_src, j_tgt)`` pairs, strictly increasing in both indices. Every hidden layer of the shallower
        side (fewer hidden layers; the source when equal) appears exactly once; the first pair is (0, 0) and the
        last (n_src − 1, n_tgt − 1). Equal layouts give the identity map.

    Raises:
        ValueError: bad shapes/kinds, non-finite cost, unknown method, or no feasible map (e.g. the shallower model
            has more layers than the deeper one in some stage, or different stage layouts).
    """
    _check_inputs(kinds_src, stages_src, kinds_tgt, stages_tgt)
    n_src, n_tgt = len(kinds_src), len(kinds_tgt)
    if method not in ("cka", "random"):
        raise ValueError(f"alignment method must be 'cka' or 'random', got {method!r}")
    if method == "cka" or cost is not None:
        C = np.asarray(cost, dtype=np.float64)
        if C.shape != (n_src, n_tgt):
            raise ValueError(f"cost has shape {C.shape}, expected ({n_src}, {n_tgt}) from the layer lists")
        if not np.isfinite(C).all():
            raise ValueError("cost matrix contains non-finite values")
    else:
        C = np.zeros((n_src, n_tgt))
    allowed = _allowed(kinds_src, stages_src, kinds_tgt, stages_tgt)
    src_is_shallow = n_src <= n_tgt
    if not src_is_shallow:
        C, allowed = C.T, allowed.T
    a = _dp(C, allowed) if method == "cka" else _random_map(allowed, seed)
    pairs = [(i, j) for i, j in enumerate(a)]
    if not src_is_shallow:
        pairs = [(j, i) for i, j in pairs]
    return pairs


def map_cost(cost, pairs: Pairs) -> float:
    """Summed cost Σ C[i, j] over matched pairs (the DP objective S)."""
    C = np.asarray(cost, dtype=np.float64)
    return float(sum(C[i, j] for i, j in pairs))
