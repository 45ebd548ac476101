"""Merge of K models of one architecture at once into a shared *universe* of hidden units (C2M3-style), the
``fusion_order="group"`` option of :func:`.aggregate.aggregate_models`.

Problem. K models of the same architecture (same layer table: kinds, stages, widths) with weights w_k > 0 compute
the same family of functions up to a permutation of every hidden layer's units. Pairwise fusion matches each model
to one running model in turn, so the matching of A to C is whatever the chain A -> B -> C made it. Crisostomi et
al. (C2M3, "Cycle-Consistent Multi-Model Merging", NeurIPS 2024, arXiv:2405.17897) instead map every model to one
universe: per model k and hidden layer l a permutation π_k^l (unit i of model k is universe unit π_k^l(i)); the
matching of A to B is then (π_B^l)⁻¹ ∘ π_A^l, so every composed matching A -> B -> C equals A -> C (cycle
consistency holds by construction). The merged model is the weighted average in the universe:

    θ̄ = Σ_k w_k · π_k(θ_k) / Σ_k w_k                                                   (the merge)

where π_k(θ_k) permutes the rows of layer l's weight and bias by π_k^l and its input axis by π_k^{l−1} (over the
adaptive pool's h·w positions at the conv -> fc boundary, channel-major as PyTorch flattens; the class layer's rows
and the image channels are not permuted).

Objective. With c^l_ab(i, j) >= 0 the pairwise ground cost between unit i of model a and unit j of model b in hidden
layer l (the same costs pairwise fusion uses, below), the permutations minimise the weighted cost of every pair of
models over the units they share in the universe:

    G(π) = Σ_{a<b} w_a w_b Σ_l Σ_u c^l_ab((π_a^l)⁻¹(u), (π_b^l)⁻¹(u))                                      (G)

C2M3 optimises the same kind of objective (the sum of all pairwise matching objectives, each pairwise matching
factored through the universe) by Frank-Wolfe over relaxed permutations. Here it is minimised by block-coordinate
descent, as the MergeMany iteration of Ainsworth, Hayase and Srinivasa does ("Git Re-Basin: Merging Models modulo
Permutation Symmetries", ICLR 2023, arXiv:2209.04836, appendix): one model's permutations at a time, the others
fixed, solved exactly: model k's unit i goes to universe unit u at cost Σ_{j≠k} w_j c^l_kj(i, (π_j^l)⁻¹(u)), one
exact assignment per layer (``ot.emd`` between uniform masses, as pairwise fusion solves it, with
``scipy.optimize.linear_sum_assignment`` as the fallback). Why this and not Frank-Wolfe, and why the others' costs
and not the distance to their weighted average (MergeMany's own step): (i) it is cycle-consistent by the same
construction (one universe); (ii) each step is the exact assignment that pairwise fusion already solves (OT between
equal widths with uniform masses has a permutation optimum) with the same costs, so with K = 2 it *is* pairwise
fusion's matching, and the option differs from pairwise fusion only in what each model is matched to; (iii) a new
permutation is taken only where it strictly lowers (G), so the sweeps terminate (aligning each model to the others'
average under a Euclidean cost has no such guarantee and can cycle); (iv) it is deterministic and needs no step size
and no rounding of a relaxed solution; (v) the catalogue's groups are small (at most 3 models of one architecture at
9 sites). It reaches a fixed point of coordinate descent, not necessarily
the minimum of (G). A layer whose problem has not changed since a model was last solved there is not solved again.

Steps (:func:`match_group`): the first model is the universe's initial reference (π_1 = identity); models 2..K are
placed one by one against those already placed; then sweeps over k = 1..K re-solve model k against the other K − 1
until a sweep changes nothing or ``max_sweeps`` is reached (recorded).

Costs (as in :mod:`.ot_fusion`): ``"acts"``: Euclidean distance between two units' pre-activations on the probe (all
samples x positions; :func:`.ot_fusion.acts_cost`); each layer is solved on its own (a unit's activations do not
depend on how other layers are labelled). ``"wts"``: Euclidean distance between the rows [W_i, b_i] of two models'
incoming weights with the input axes in universe order; the layers are solved in forward order, and a model's new
permutations are taken only when they lower (G) summed over its layers.

With K = 2 the placement is the pairwise problem and the sweep leaves it unchanged when its optimum is unique, so a
group of two gives pairwise fusion's result up to rounding (the test suite checks this); the option changes
anything only for groups of three or more. A group of one is returned unchanged.

Repair (as after a pairwise fusion, :mod:`.repair`): ``"channel"`` gives every universe unit the weighted mean of its
members' per-unit pre-activation mean and std (REPAIR, Jordan et al. 2023); ``"layer"`` one scale per hidden layer to
the weighted mean of the members' stds. Statistics are measured on the first model's probe.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from hfl_components.fusion._arch import check_compatible, layer_table, resolve
from hfl_components.fusion.ot_fusion import acts_cost

StateDict = dict[str, torch.Tensor]
FUSION_ORDERS = ("pairwise", "group")
GROUP_METRICS = ("acts", "wts")


def architecture_key(spec: dict) -> tuple:
    """What must be equal for two fusable specs to be merged unit by unit: every weight layer's (kind, stage, inputs,
    outputs), the adaptive pool side, input channels and classes. ValueError for a non-fusable spec."""
    r = resolve(spec)
    return (tuple((row.kind, row.stage, row.n_in, row.n_out) for row in layer_table(spec)), r["pool"],
            r["in_channels"], r["num_classes"])


def _input_index(inv_prev: np.ndarray, kind: str, prev_kind: str, pool2: int) -> torch.Tensor:
    """Indices into a layer's input axis that put it in universe order: ``inv_prev[u]`` (the model's unit at universe
    unit u), expanded over the pool's h·w positions where a conv stage feeds the first fc layer."""
    inv = torch.as_tensor(inv_prev, dtype=torch.long)
    if kind == "fc" and prev_kind == "conv" and pool2 > 1:
        return (inv[:, None] * pool2 + torch.arange(pool2)[None, :]).reshape(-1)
    return inv


def permute_to_universe(spec: dict, state_dict: StateDict, perms: list[np.ndarray]) -> StateDict:
    """The model ``(spec, state_dict)`` with its hidden units relabelled into the universe: the same function.

    Args:
        spec: fusable spec.
        state_dict: its tensors (any float dtype; returned in that dtype).
        perms: one int array per hidden layer, length = the layer's width; ``perms[l][i]`` is the universe index of
            unit i (a permutation of 0..width−1).

    Returns:
        A new state dict with the spec's keys: layer l's rows (weight and bias) at universe positions, its input
        axis in the previous layer's universe order; the class layer's rows unchanged.

    Raises:
        ValueError: wrong number of permutations or a permutation of the wrong length / not a permutation.
    """
    rows = layer_table(spec)
    if len(perms) != len(rows) - 1:
        raise ValueError(f"{len(rows) - 1} hidden layers but {len(perms)} permutations")
    pool2 = resolve(spec)["pool"] ** 2
    out: StateDict = {}
    inv_prev, prev_kind = None, "conv"
    for idx, row in enumerate(rows):
        w = torch.as_tensor(state_dict[f"{row.name}.weight"])
        b = torch.as_tensor(state_dict[f"{row.name}.bias"])
        if inv_prev is not None:
            w = w.index_select(1, _input_index(inv_prev, row.kind, prev_kind, pool2))
        if not row.is_output:
            p = np.asarray(perms[idx])
            if p.shape != (row.n_out,) or not np.array_equal(np.sort(p), np.arange(row.n_out)):
                raise ValueError(f"{row.name}: permutation must reorder its {row.n_out} units, got shape {p.shape}")
            inv_prev = np.argsort(p)
            inv = torch.as_tensor(inv_prev, dtype=torch.long)
            w, b = w.index_select(0, inv), b.index_select(0, inv)
        out[f"{row.name}.weight"], out[f"{row.name}.bias"] = w.clone(), b.clone()
        prev_kind = row.kind
    return out


def _hidden_acts(spec: dict, sd: StateDict, probe: torch.Tensor, need: list, device) -> dict:
    """One hooked forward pass of the model on ``probe``: the statistics ``need`` of every hidden layer."""
    from hfl_components.fusion.probe_stats import hidden_layer_stats
    from hfl_components.models.fusable import build_fusable

    m = build_fusable(spec)
    m.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in sd.items()})
    return hidden_layer_stats(m.to(device or "cpu"), probe, need)


class _Universe:
    """The members' current permutations and the block-coordinate step of :func:`match_group`: one member's
    permutations that minimise its weighted cost to the others in the universe (module docstring, Eq. (G))."""

    def __init__(self, specs, sds, weights, acts, metric: str):
        self.specs, self.sds, self.w, self.acts, self.metric = specs, sds, weights, acts, metric
        self.rows = layer_table(specs[0])
        self.hidden = self.rows[:-1]
        self.pool2 = resolve(specs[0])["pool"] ** 2
        self.perms: list[list[np.ndarray] | None] = [None] * len(sds)
        self._dist: dict[tuple[int, int, int], np.ndarray] = {}
        self.version = [0] * len(self.hidden)  # per layer: bumped whenever a member's permutation there changes
        self._seen: dict[tuple[int, int], int] = {}  # (member, layer) -> the version its last solve saw

    def set(self, k: int, perms: list[np.ndarray]) -> bool:
        """Member k's permutations become ``perms``; True when any changed."""
        old = self.perms[k]
        changed = False
        for layer, p in enumerate(perms):
            if old is None or not np.array_equal(old[layer], p):
                self.version[layer] += 1
                changed = True
        self.perms[k] = perms
        for layer in range(len(perms)):
            self._seen[(k, layer)] = self.version[layer]
        return changed

    def _stale(self, k: int, layer: int) -> bool:
        """True when some other member's permutation of ``layer`` changed since member k was last solved there
        (the solve is deterministic, so an unchanged problem gives the unchanged answer)."""
        return self._seen.get((k, layer)) != self.version[layer]

    def _acts_dist(self, a: int, b: int, layer: int) -> np.ndarray:
        """c^l_ab: the ``acts`` cost between the units of models a and b (float64 (C, C), computed once)."""
        key = (min(a, b), max(a, b), layer)
        if key not in self._dist:
            self._dist[key] = acts_cost(self.acts[key[0]][layer], self.acts[key[1]][layer])
        d = self._dist[key]
        return d if a < b else d.T

    def _universe_rows(self, j: int, perms) -> list[torch.Tensor]:
        """Model j's hidden layers' rows [W_i, b_i] (float64), rows and inputs in universe order."""
        sd = permute_to_universe(self.specs[j], self.sds[j], perms)
        return [torch.cat([sd[f"{r.name}.weight"].to(torch.float64).reshape(r.n_out, -1),
                           sd[f"{r.name}.bias"].to(torch.float64)[:, None]], 1) for r in self.hidden]

    def align(self, k: int, others: list[int]) -> list[np.ndarray]:
        """Member k's permutations against ``others`` (fixed). With current permutations, the new ones are taken only
        where they strictly lower the objective (per layer for ``acts``, over the model for ``wts``), so ties never
        make the sweeps cycle."""
        cur = self.perms[k]
        if self.metric == "acts":
            perms = []
            for layer in range(len(self.hidden)):
                if cur is not None and not self._stale(k, layer):
                    perms.append(cur[layer])
                    continue
                cost = sum(self.w[j] * self._acts_dist(k, j, layer)[:, np.argsort(self.perms[j][layer])]
                           for j in others)
                p = _assign(cost)
                if cur is not None and not _lowers(cost, p, cur[layer]):
                    p = cur[layer]
                perms.append(p)
            return perms
        if cur is not None and not any(self._stale(k, layer) for layer in range(len(self.hidden))):
            return cur
        refs = {j: self._universe_rows(j, self.perms[j]) for j in others}
        sd = self.sds[k]
        perms, inv_prev, prev_kind = [], None, "conv"
        for layer, row in enumerate(self.hidden):  # forward: each layer's rows, inputs already in universe order
            w = torch.as_tensor(sd[f"{row.name}.weight"]).to(torch.float64)
            b = torch.as_tensor(sd[f"{row.name}.bias"]).to(torch.float64)
            if inv_prev is not None:
                w = w.index_select(1, _input_index(inv_prev, row.kind, prev_kind, self.pool2))
            xs = torch.cat([w.reshape(w.shape[0], -1), b[:, None]], 1)
            cost = sum(self.w[j] * torch.cdist(xs, refs[j][layer]).numpy() for j in others)
            p = _assign(cost)
            perms.append(p)
            inv_prev, prev_kind = np.argsort(p), row.kind
        if cur is not None:
            g_new, g_cur = self._wts_objective(k, perms, refs), self._wts_objective(k, cur, refs)
            if not g_new < g_cur - 1e-12 * max(1.0, abs(g_cur)):
                return cur
        return perms

    def _wts_objective(self, k: int, perms, refs: dict) -> float:
        """Σ_j w_j Σ_l Σ_u ‖row_k(u) − row_j(u)‖ over the hidden layers, model k under ``perms``."""
        mine = self._universe_rows(k, perms)
        return float(sum(self.w[j] * (x - y).norm(dim=1).sum() for j, rows in refs.items()
                         for x, y in zip(mine, rows)))


def _lowers(cost: np.ndarray, new: np.ndarray, old: np.ndarray) -> bool:
    """True when the assignment ``new`` has a strictly smaller total cost than ``old`` (relative 1e-12)."""
    idx = np.arange(len(new))
    v_new, v_old = float(cost[idx, new].sum()), float(cost[idx, old].sum())
    return v_new < v_old - 1e-12 * max(1.0, abs(v_old))


def _assign(cost: np.ndarray) -> np.ndarray:
    """``p[i]`` = the column assigned to row i by a minimum-cost perfect matching of a square cost.

    Solved as exact OT between uniform masses (``ot.emd``, the network simplex pairwise fusion uses), whose optimum
    is a vertex of the Birkhoff polytope, i.e. a permutation (Birkhoff-von Neumann); should the plan not be one
    (numerical trouble), ``scipy.optimize.linear_sum_assignment`` decides."""
    import ot

    C = np.asarray(cost, dtype=np.float64)
    n = C.shape[0]
    scale = float(C.max()) if C.size else 0.0
    u = np.full(n, 1.0 / n)
    T = ot.emd(u, u, C / scale if scale > 0 else C, numItermax=10_000_000)
    p = T.argmax(1)
    if np.array_equal(np.sort(p), np.arange(n)) and np.allclose(T[np.arange(n), p], 1.0 / n, rtol=1e-6, atol=0):
        return p.astype(np.int64)
    rows, cols = linear_sum_assignment(C)
    p = np.empty(len(rows), dtype=np.int64)
    p[rows] = cols
    return p


def _check_members(members, weights, probes, ground_metric: str) -> None:
    if not members:
        raise ValueError("a group merge needs at least one model")
    if len(weights) != len(members):
        raise ValueError(f"{len(members)} models but {len(weights)} weights")
    if not all(np.isfinite(float(w)) and float(w) > 0 for w in weights):
        raise ValueError(f"group weights must be positive and finite, got {list(weights)}")
    if ground_metric not in GROUP_METRICS:
        raise ValueError(f"ground_metric must be one of {GROUP_METRICS}, got {ground_metric!r}")
    key = architecture_key(members[0][0])
    for i, (spec, _) in enumerate(members[1:], 1):
        check_compatible(members[0][0], spec)
        if architecture_key(spec) != key:
            raise ValueError(f"a group merge needs one architecture (same layers and widths); model {i} differs "
                             "from model 0")
    if probes is not None and len(probes) != len(members):
        raise ValueError(f"{len(members)} models but {len(probes)} probes")


def match_group(members: list[tuple[dict, StateDict]], weights: list[float], probes: list | None = None,
                ground_metric: str = "acts", max_sweeps: int = 100, device=None,
                acts: list | None = None) -> tuple[list[list[np.ndarray]], dict]:
    """Cycle-consistent matching of K same-architecture models to one universe: block-coordinate descent on (G)
    (module docstring).

    Args:
        members: ``[(spec, state_dict), ...]``, one architecture (:func:`architecture_key`), K >= 1. The first is
            the universe's initial reference; where (G) has several fixed points the result can depend on the order
            (``aggregate_models`` passes the models in site-name order).
        weights: positive weights w_k (e.g. training-sample counts); only their ratios matter.
        probes: for ``"acts"``: one float tensor (n, in_channels, S_k, S_k) per model, the same n images (at each
            model's input size); conv maps of different sides are average-pooled to the smallest.
        ground_metric: ``"acts"`` or ``"wts"``.
        max_sweeps: cap on the full sweeps after the initial placement.
        device: where the probe passes run (default CPU).
        acts: the members' hidden pre-activations already computed (``"acts"`` of
            :func:`.probe_stats.hidden_layer_stats`), else one pass per model here.

    Returns:
        ``(perms, info)``: ``perms[k][l]`` int64 array, universe index of model k's unit i in hidden layer l
        (``perms[0]`` need not stay the identity after the sweeps); info ``{"sweeps", "converged", "changes"
        (models whose permutations changed, per sweep), "probe_passes"}``.

    Raises:
        ValueError: different architectures, bad weights or metric, missing probe for ``"acts"``.
    """
    _check_members(members, weights, probes, ground_metric)
    specs, sds = [m[0] for m in members], [m[1] for m in members]
    w = [float(x) for x in weights]
    passes = 0
    if ground_metric == "acts" and acts is None:
        if probes is None or any(p is None for p in probes):
            raise ValueError("ground_metric='acts' needs a probe batch for every model")
        acts = [_hidden_acts(s, sd, p, ["acts"], device)["acts"] for s, sd, p in zip(specs, sds, probes)]
        passes = len(members)
    uni = _Universe(specs, sds, w, acts, ground_metric)
    uni.set(0, [np.arange(r.n_out, dtype=np.int64) for r in uni.hidden])
    for k in range(1, len(members)):  # initial placement: each model against those already placed
        uni.set(k, uni.align(k, list(range(k))))
    changes: list[int] = []
    converged = len(members) == 1
    for _ in range(int(max_sweeps) if len(members) > 1 else 0):
        n_changed = 0
        for k in range(len(members)):
            if uni.set(k, uni.align(k, [j for j in range(len(members)) if j != k])):
                n_changed += 1
        changes.append(n_changed)
        if n_changed == 0:
            converged = True
            break
    return uni.perms, {"sweeps": len(changes), "converged": converged, "changes": changes, "probe_passes": passes}


def merge_group(members: list[tuple[dict, StateDict]], weights: list[float], probes: list | None = None,
                ground_metric: str = "acts", repair: str | bool = "none", device=None,
                max_sweeps: int = 100) -> tuple[dict, StateDict, dict]:
    """Merge K same-architecture models at once: :func:`match_group`, then the weighted average in the universe
    (module docstring), then the optional repair.

    Args:
        members, weights, probes, ground_metric, max_sweeps, device: as :func:`match_group`.
        repair: ``"none"``/False, ``"layer"``/True or ``"channel"`` (:func:`.pairwise.repair_mode`); needs the
            first model's probe.

    Returns:
        ``(spec, state_dict, record)``: a copy of the first model's spec; float32 tensors with its keys; record
        (JSON-able) with ``n_models``, ``weights`` (normalised), ``ground_metric``, ``sweeps``, ``converged``,
        ``changes``, ``repair``, ``repair_scales``, ``probe_passes`` and ``seconds`` ({ot: the matching and its probe
        passes, averaging, repair}). A group of one returns its model's tensors unchanged (float32 copies).

    Raises:
        ValueError: as :func:`match_group`; repair without a probe.
    """
    from hfl_components.fusion.pairwise import repair_mode

    repair = repair_mode(repair)
    _check_members(members, weights, probes, ground_metric)
    secs = {"ot": 0.0, "averaging": 0.0, "repair": 0.0}
    tot = float(sum(float(x) for x in weights))
    wn = [float(x) / tot for x in weights]
    spec0 = copy.deepcopy(members[0][0])
    rec = {"n_models": len(members), "weights": wn, "ground_metric": ground_metric, "repair": repair,
           "repair_scales": None, "sweeps": 0, "converged": True, "changes": [], "probe_passes": 0}
    if len(members) == 1:
        sd = {k: torch.as_tensor(v).to(torch.float32).clone() for k, v in members[0][1].items()}
        return spec0, sd, {**rec, "seconds": secs}
    if repair != "none" and (probes is None or probes[0] is None):
        raise ValueError(f"repair={repair!r} needs a probe batch")
    need = (["acts"] if ground_metric == "acts" else []) + {"none": [], "layer": ["stds"],
                                                            "channel": ["channel"]}[repair]
    t0 = time.perf_counter()
    stats = None
    if need:
        if probes is None or any(p is None for p in probes):
            raise ValueError(f"ground_metric={ground_metric!r} / repair={repair!r} need a probe for every model")
        stats = [_hidden_acts(s, sd, p, need, device) for (s, sd), p in zip(members, probes)]
        rec["probe_passes"] = len(members)
    perms, info = match_group(members, weights, probes, ground_metric, max_sweeps, device,
                              acts=[s["acts"] for s in stats] if ground_metric == "acts" else None)
    rec.update({k: info[k] for k in ("sweeps", "converged", "changes")})
    t1 = time.perf_counter()
    secs["ot"] = t1 - t0
    merged: StateDict = {}
    for (spec, sd), p, w in zip(members, perms, wn):
        for k, v in permute_to_universe(spec, sd, p).items():
            term = v.to(torch.float64) * w
            merged[k] = term if k not in merged else merged[k] + term
    sd_out = {k: v.to(torch.float32) for k, v in merged.items()}
    t2 = time.perf_counter()
    secs["averaging"] = t2 - t1
    if repair != "none":
        sd_out, rec["repair_scales"] = _repair(spec0, sd_out, stats, perms, wn, repair, probes[0], device)
        secs["repair"] = time.perf_counter() - t2
    rec["seconds"] = secs
    return spec0, sd_out, rec


def _repair(spec, sd, stats, perms, wn, repair, probe, device):
    """The merged model's statistics set to the weighted mean of its members' (per universe unit or per layer)."""
    from hfl_components.fusion.repair import repair_channels, repair_scales

    n_hidden = len(perms[0])
    if repair == "layer":
        goal = [sum(w * s["stds"][layer] for w, s in zip(wn, stats)) for layer in range(n_hidden)]
        return repair_scales(spec, sd, goal, probe, device=device)
    goals = []
    for layer in range(n_hidden):
        mu = sd_ = None
        for w, s, p in zip(wn, stats, perms):
            inv = torch.as_tensor(np.argsort(p[layer]), dtype=torch.long)
            m, d = s["channel"][layer]
            m, d = w * m.index_select(0, inv), w * d.index_select(0, inv)
            mu, sd_ = (m, d) if mu is None else (mu + m, sd_ + d)
        goals.append((mu, sd_))
    return repair_channels(spec, sd, goals, probe, device=device)
