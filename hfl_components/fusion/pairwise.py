"""Fusion of one source model into one target model (OHFL Sec. 3.1–3.4): CKA -> DP layer map -> depth balancing ->
OT neuron alignment -> weighted average. The result always has the target's architecture."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hfl_components.fusion._arch import check_compatible, hidden_rows, spec_signature
from hfl_components.fusion._timing import timed
from hfl_components.fusion.balancing import insert_identity_layers, merge_layers
from hfl_components.fusion.cka import cka_cost_from_grams
from hfl_components.fusion.grams import CKA_KINDS
from hfl_components.fusion.layer_alignment import align_layers, map_cost
from hfl_components.fusion.ot_fusion import ot_fuse_balanced
from hfl_components.fusion.probe_stats import StatsCache
from hfl_components.models.fusable import build_fusable

StateDict = dict[str, torch.Tensor]
PHASES = ("cka", "alignment", "ot", "averaging", "repair")
REPAIR_MODES = ("none", "layer", "channel")


def repair_mode(repair) -> str:
    """Normalise a repair option: False/None -> ``"none"``, True -> ``"layer"``, or one of :data:`REPAIR_MODES`."""
    if repair is None or repair is False:
        return "none"
    if repair is True:
        return "layer"
    if repair not in REPAIR_MODES:
        raise ValueError(f"repair must be one of {REPAIR_MODES}, got {repair!r}")
    return repair


def _load(spec: dict, sd: StateDict, device=None) -> torch.nn.Module:
    m = build_fusable(spec)
    m.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in sd.items()})
    return m.to(device or "cpu")


def fuse_pair(src: tuple[dict, StateDict], tgt: tuple[dict, StateDict], probe: torch.Tensor | None = None,
              weight_src: float = 0.5, weight_tgt: float = 0.5, alignment: str = "cka", ot_solver: str = "emd",
              ground_metric: str = "wts", seed: int | None = 0, sinkhorn_reg: float = 0.01,
              repair: bool | str = False, probe_tgt: torch.Tensor | None = None,
              cka: str = "linear", device=None, stats_cache=None,
              reuse: bool = True) -> tuple[dict, StateDict, dict]:
    """Fuse a source model into a target model; the result has the target's architecture (OHFL Sec. 3.1–3.4).

    Steps: (1) if the two hidden-layer layouts differ, the CKA cost matrix C_ij = 1 − CKA (Eq. 1) on ``probe``;
    (2) the strictly increasing layer map by DP (Sec. 3.1; ``alignment="random"`` draws a random feasible map);
    (3) depth balancing of the source (Sec. 3.2): identity insertion when it is shallower, layer merging when it is
    deeper; (4) layer-wise OT alignment of the source's neurons onto the target's and the weighted average (Sec.
    3.3–3.4, Eq. 4; normalisation convention in :mod:`.ot_fusion`). Same layouts skip (1)–(3) (identity map).

    Args:
        src, tgt: ``(spec, state_dict)`` of fusable models (same family/stage count, in_channels, classes).
        probe: float tensor (n, in_channels, S, S), S >= 2**n_stages; needed for CKA when layouts differ, for
            ``ground_metric="acts"`` and for repair. It is the source's probe, and the target's too unless
            ``probe_tgt`` (the same images at the target's input size) is given.
        weight_src, weight_tgt: positive averaging weights (e.g. cumulative sample counts), normalised internally.
        alignment: ``"cka"`` or ``"random"``.  ot_solver: ``"emd"`` or ``"sinkhorn"`` (ε = ``sinkhorn_reg``).
        ground_metric: ``"wts"`` or ``"acts"``.  seed: seed of the random alignment.
        repair: ``"none"``/False (the paper), ``"layer"``/True (one scale per hidden layer matches the weighted mean
            of the parents' pre-activation std) or ``"channel"`` (REPAIR: every neuron's mean and std matched to
            its parents', carried through the OT plan); see :mod:`.repair`. All three models (balanced source,
            target, fused) are measured on the target's probe, so the statistics compare like with like.
        cka: ``"linear"`` (Eq. 1), ``"debiased"`` or ``"pooled"`` (:func:`.cka.cka_cost_matrix`).
        device: where the probe forward passes (CKA, repair) run, e.g. ``"cuda"``; default the CPU. OT and
            averaging stay on the CPU (NumPy / POT); results are CPU tensors either way.
        stats_cache: a :class:`.probe_stats.StatsCache` shared across the pairwise fusions of one aggregation (a
            model's probe statistics are computed once); default a fresh one. Each model is probed in one forward
            pass that collects everything this pair needs from it (CKA Grams and repair statistics together).
        reuse: with repair, also record the fused model's statistics (CKA Grams of ``cka``, the repair
            statistics and, for ``"acts"``, the pre-activations) in ``stats_cache`` from the repair pass itself,
            for a later fusion step that uses the result (only with a given ``stats_cache``); False when the
            result is final. The cache's pre-activations of a balanced source made for this pair are dropped
            after the OT; the caller drops those of models that take part in no further fusion
            (:meth:`.probe_stats.StatsCache.drop`).

    Returns:
        ``(spec, state_dict, record)``: a copy of the target's spec; float32 tensors with the target's keys/shapes;
        record (JSON-able) with ``src_layers``/``tgt_layers`` (hidden-layer names), ``cost`` (n_src x n_tgt list of
        lists of 1 − CKA, or None when not computed), ``layer_map`` ([[i_src, j_tgt], ...]), ``map_cost``,
        ``balancing`` (``"none"``, ``"insert_identity"``, ``"merge"``), ``balanced_src_spec``, ``alignment``,
        ``ot_solver``, ``ground_metric``, ``weights`` ({src, tgt} normalised), ``layers`` (per-layer OT records),
        ``seconds`` ({cka, alignment, ot, averaging, repair}; alignment includes the balancing; cka the
        probe passes of source and target not already in the cache; ot, for ``"acts"``, the passes for the
        pre-activations not already in the cache (each model's repair statistics come from the same pass);
        repair the statistics of the balanced source not yet held and the repair pass, which with ``reuse`` also
        computes the fused model's Grams (and ``"acts"`` pre-activations) for the next step).

    Raises:
        ValueError: incompatible models, no feasible layer map, missing probe, bad options.
        OTMarginalError: an OT plan violates its marginals.
    """
    spec_s, sd_s = src
    spec_t, sd_t = tgt
    repair = repair_mode(repair)
    check_compatible(spec_s, spec_t)
    if alignment not in ("cka", "random"):
        raise ValueError(f"alignment must be 'cka' or 'random', got {alignment!r}")
    secs = dict.fromkeys(PHASES, 0.0)
    ctx = _Pair(spec_s, sd_s, spec_t, sd_t, probe, probe if probe_tgt is None else probe_tgt,
                StatsCache() if stats_cache is None else stats_cache, device, cka, repair, ground_metric)
    keep = ((ctx.rep_need + ctx.acts + ([f"gram_{cka}"] if alignment == "cka" and cka in CKA_KINDS else []))
            if reuse and stats_cache is not None and repair != "none" else [])
    cost, pairs, bal_spec, bal_sd, balancing = _balance(ctx, alignment, seed, secs)
    plans: list = []
    sd, layer_recs = _ot_average(ctx, bal_spec, bal_sd, weight_src, weight_tgt, ot_solver, sinkhorn_reg, plans, secs)
    w_sum = float(weight_src) + float(weight_tgt)
    ws, wt = float(weight_src) / w_sum, float(weight_tgt) / w_sum
    if repair != "none" and probe is None:
        raise ValueError(f"repair={repair!r} needs a probe batch")
    sd, scales = _repair(ctx, bal_spec, bal_sd, sd, plans, ws, wt, keep, secs)
    record = {"src_layers": [r.name for r in hidden_rows(spec_s)], "tgt_layers": [r.name for r in hidden_rows(spec_t)],
              "cost": None if cost is None else cost.tolist(), "layer_map": [[int(i), int(j)] for i, j in pairs],
              "map_cost": None if cost is None else map_cost(cost, pairs), "balancing": balancing,
              "balanced_src_spec": copy.deepcopy(bal_spec), "alignment": alignment, "ot_solver": ot_solver,
              "ground_metric": ground_metric, "cka": cka, "repair": repair, "weights": {"src": ws, "tgt": wt},
              "layers": layer_recs, "repair_scales": scales, "seconds": secs}
    return copy.deepcopy(spec_t), sd, record


@dataclass
class _Pair:
    """The two models of one pairwise fusion, their probes, the statistics cache and what each stage asks of it."""

    spec_s: dict
    sd_s: StateDict
    spec_t: dict
    sd_t: StateDict
    probe: torch.Tensor | None
    probe_t: torch.Tensor | None
    cache: StatsCache
    device: object
    cka: str
    repair: str
    ground_metric: str

    def __post_init__(self):
        self.rep_need = {"none": [], "layer": ["stds"], "channel": ["channel"]}[self.repair]
        self.acts = ["acts"] if self.ground_metric == "acts" else []
        self.tgt_need = self.rep_need + self.acts  # everything the target gives on probe_t: one pass

    def stats(self, spec: dict, sd: StateDict, probe, need: list) -> dict:
        """The cached probe statistics ``need`` of the model ``(spec, sd)`` on ``probe``."""
        return self.cache.get(sd, probe, lambda: _load(spec, sd, self.device), need)


def _balance(ctx: _Pair, alignment: str, seed, secs: dict) -> tuple:
    """Stages 1-3: the CKA cost (layouts differ, ``alignment="cka"``), the layer map and the balanced source.
    Returns ``(cost or None, pairs, balanced spec, balanced state dict, balancing)``."""
    rows_s, rows_t = hidden_rows(ctx.spec_s), hidden_rows(ctx.spec_t)
    if spec_signature(ctx.spec_s) == spec_signature(ctx.spec_t):
        return None, [(i, i) for i in range(len(rows_s))], ctx.spec_s, ctx.sd_s, "none"
    cost = None
    if alignment == "cka":
        if ctx.probe is None:
            raise ValueError("CKA alignment of models of different depth needs a probe batch")
        with timed(secs, "cka"):
            if ctx.probe_t.shape[0] != ctx.probe.shape[0]:
                raise ValueError("the two probes must hold the same images, got "
                                 f"{ctx.probe.shape[0]} and {ctx.probe_t.shape[0]}")
            g = f"gram_{ctx.cka}"
            if ctx.cka not in CKA_KINDS:
                raise ValueError(f"cka must be one of {CKA_KINDS}, got {ctx.cka!r}")
            g_s = ctx.stats(ctx.spec_s, ctx.sd_s, ctx.probe, [g])[g]
            g_t = ctx.stats(ctx.spec_t, ctx.sd_t, ctx.probe_t, [g] + ctx.tgt_need)[g]
            cost = cka_cost_from_grams(g_s, g_t, ctx.cka)
    with timed(secs, "alignment"):
        pairs = align_layers(cost, [r.kind for r in rows_s], [r.stage for r in rows_s],
                             [r.kind for r in rows_t], [r.stage for r in rows_t], method=alignment, seed=seed)
        if len(rows_s) < len(rows_t):
            bal_spec, bal_sd = insert_identity_layers(ctx.spec_s, ctx.sd_s, pairs, ctx.spec_t)
            balancing = "insert_identity"
        else:
            bal_spec, bal_sd = merge_layers(ctx.spec_s, ctx.sd_s, pairs, ctx.spec_t)
            balancing = "merge"
    return cost, pairs, bal_spec, bal_sd, balancing


def _ot_average(ctx: _Pair, bal_spec, bal_sd, weight_src, weight_tgt, ot_solver, reg, plans: list,
                secs: dict) -> tuple[StateDict, list]:
    """Stage 4: layer-wise OT alignment and the weighted average (:func:`.ot_fusion.ot_fuse_balanced`); the
    ``acts`` metric's pre-activations first (with the repair statistics of the same model, in one pass)."""
    acts_s = acts_t = None
    with timed(secs, "ot"):
        if ctx.acts:
            if ctx.probe is None:
                raise ValueError("ground_metric='acts' needs a probe batch")
            acts_s = ctx.stats(bal_spec, bal_sd, ctx.probe,
                               ctx.acts + (ctx.rep_need if ctx.probe_t is ctx.probe else []))["acts"]
            acts_t = ctx.stats(ctx.spec_t, ctx.sd_t, ctx.probe_t, ctx.tgt_need)["acts"]
    sd, layer_recs, ot_secs = ot_fuse_balanced(bal_spec, bal_sd, ctx.spec_t, ctx.sd_t, weight_src, weight_tgt,
                                               solver=ot_solver, ground_metric=ctx.ground_metric, probe=ctx.probe,
                                               reg=reg, probe_tgt=ctx.probe_t, plans=plans,
                                               acts_src=acts_s, acts_tgt=acts_t)
    del acts_s, acts_t
    if bal_sd is not ctx.sd_s:  # the balanced source exists for this pair only
        ctx.cache.drop(bal_sd)
    secs["ot"] += ot_secs["ot"]
    secs["averaging"] = ot_secs["averaging"]
    return sd, layer_recs


def _repair(ctx: _Pair, bal_spec, bal_sd, sd: StateDict, plans: list, ws: float, wt: float, keep: list,
            secs: dict) -> tuple[StateDict, list | None]:
    """Stage 5 (not in the paper; :mod:`.repair`): match the fused model's activation statistics on the target's
    probe to its parents' weighted mean, per layer (``layer``) or per neuron through the OT plans (``channel``).
    Returns ``(state dict, scales or None)``."""
    if ctx.repair == "none":
        return sd, None
    from hfl_components.fusion.repair import repair_channels, repair_scales

    with timed(secs, "repair"):
        found: dict = {}
        if ctx.repair == "layer":
            a = ctx.stats(bal_spec, bal_sd, ctx.probe_t, ["stds"])["stds"]
            b = ctx.stats(ctx.spec_t, ctx.sd_t, ctx.probe_t, ["stds"])["stds"]
            goal = [ws * x + wt * y for x, y in zip(a, b)]
            sd, scales = repair_scales(ctx.spec_t, sd, goal, ctx.probe_t, device=ctx.device, collect=keep,
                                       stats_out=found)
        else:
            st_s = ctx.stats(bal_spec, bal_sd, ctx.probe_t, ["channel"])["channel"]
            st_t = ctx.stats(ctx.spec_t, ctx.sd_t, ctx.probe_t, ["channel"])["channel"]
            goals = [(ws * (Tb.T @ ms) + wt * mt, ws * (Tb.T @ ss) + wt * stt)
                     for Tb, (ms, ss), (mt, stt) in zip(plans, st_s, st_t)]
            sd, scales = repair_channels(ctx.spec_t, sd, goals, ctx.probe_t, device=ctx.device, collect=keep,
                                         stats_out=found)
        if keep:
            ctx.cache.put(sd, ctx.probe_t, found)
    return sd, scales
