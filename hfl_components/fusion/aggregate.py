"""Multi-model aggregation strategies of OHFL (Sec. 3.5, Algorithm 1; alternatives of Sec. 4.3 / Table 4).

Every strategy is a sequence of pairwise fusions (:func:`~.pairwise.fuse_pair`, result = target architecture):

* ``cid`` (the paper's method, Algorithm 1): fuse same-depth models first, one representative per depth layout;
  sort the representatives by depth, ascending; the running model is the *source* fused into the next deeper
  representative (the *target*). Result: the deepest architecture.
* ``cdd``: the same from deep to shallow (the running model is merged into the next shallower one). Result: the
  shallowest architecture.
* ``cia``: no depth grouping; sites ordered by validation accuracy, low to high (ties by name); each step's target is
  the next model. Result: the architecture of the most accurate site.
* ``rand``: a random base model (seeded) is the target of every other model; the n − 1 fused models (all of the
  base's architecture) are averaged parameter-wise.

Same-depth grouping (cid/cdd): members sorted by name; the group's architecture is that of its widest member (most
parameters, ties by name), into which the others are fused one by one.

Weights. ``weighting="samples"`` (default): the running model carries the cumulative sample count of the models
fused into it, so each step is w_fused : w_new and every site ends with weight ∝ its sample count regardless of the
order (a fixed 0.5 over-weights the models fused last, see PITFALLS). ``weighting="half"``: every step 0.5 : 0.5.
For ``rand`` under ``samples`` the base enters each of its n − 1 pairs with n_base / (n − 1) (its samples split over
its pairs) and the n − 1 results are averaged with weights n_k + n_base / (n − 1), so every site, the base included,
ends with weight ∝ its sample count; under ``half`` every pair is 0.5 : 0.5 and the results are averaged equally
(the paper's plain parameter averaging, Sec. 4.3).

Fusion order. ``fusion_order="pairwise"`` (default): everything above. ``fusion_order="group"`` (cid / cdd only):
inside each same-depth group, the models of one exact architecture (same widths, :func:`.group_merge.architecture_key`)
are merged all at once into a cycle-consistent universe (:func:`.group_merge.merge_group`, C2M3-style; weights ∝
samples, or equal under ``half``), a group of one passes unchanged; the merged models of different widths are then
fused pairwise into the widest as above, and the same-depth representatives chained by depth as above. The group
merge's matchings are exact assignments whatever ``ot_solver`` says (``ot_solver`` applies to the pairwise steps).
With at most two models per architecture the group merge gives the pairwise result (:mod:`.group_merge`).
"""
from __future__ import annotations

import copy
import random as _random
import time
from dataclasses import dataclass, field

import torch

from hfl_components.fusion._arch import hidden_rows, layer_table, spec_signature
from hfl_components.fusion._timing import timed
from hfl_components.fusion.group_merge import FUSION_ORDERS, architecture_key, merge_group
from hfl_components.fusion.pairwise import PHASES, fuse_pair
from hfl_components.fusion.probe_stats import StatsCache

StateDict = dict[str, torch.Tensor]
STRATEGIES = ("cid", "cdd", "cia", "rand")


@dataclass
class SiteModel:
    """One uploaded site model.

    Attributes:
        name: site name (orders ties deterministically).
        spec: fusable spec (``hfl_components.models.fusable``).
        state_dict: parameter tensors (float).
        n_samples: positive training-sample count (fusion weight).
        val_acc: validation accuracy in [0, 1] (needed by ``cia``).
        input_size: the site's input side in pixels; selects its probe when probes are given per size.
    """

    name: str
    spec: dict
    state_dict: StateDict
    n_samples: float
    val_acc: float | None = None
    input_size: int | None = None


@dataclass
class _Running:
    label: str
    spec: dict
    state_dict: StateDict
    weight: float
    members: list[str] = field(default_factory=list)
    size: int | None = None


def _as_site(m) -> SiteModel:
    if isinstance(m, SiteModel):
        return m
    if isinstance(m, dict):
        missing = [k for k in ("name", "spec", "state_dict", "n_samples") if k not in m]
        if missing:
            raise ValueError(f"model entry lacks {missing}")
        return SiteModel(m["name"], m["spec"], m["state_dict"], m["n_samples"], m.get("val_acc"), m.get("input_size"))
    raise ValueError(f"models must be SiteModel or dict entries, got {type(m).__name__}")


def _n_params(spec: dict) -> int:
    return sum(r.n_out * (r.n_in * (9 if r.kind == "conv" else 1) + 1) for r in layer_table(spec))


def aggregate_models(models, strategy: str = "cid", probe: torch.Tensor | None = None, weighting: str = "samples",
                     alignment: str = "cka", ot_solver: str = "emd", ground_metric: str = "wts", seed: int = 0,
                     sinkhorn_reg: float = 0.01, repair: bool | str = False,
                     cka: str = "linear", device=None, progress=None,
                     fusion_order: str = "pairwise") -> tuple[dict, StateDict, dict]:
    """Fuse n heterogeneous site models into one global model (OHFL Sec. 3.5, Algorithm 1, Sec. 4.3).

    Args:
        models: list of :class:`SiteModel` or dicts ``{name, spec, state_dict, n_samples, val_acc}``; names unique.
        strategy: ``"cid"``, ``"cdd"``, ``"cia"`` or ``"rand"`` (see the module docstring).
        probe: float tensor (n, in_channels, S, S), S >= 2**n_stages, for CKA (models of different depth), the
            ``"acts"`` metric and repair; or a dict {input_size: tensor} holding the *same images* prepared at every
            site's input size, so that each model is probed at its own size (a fused model inherits its target's
            size); then every model needs ``input_size``.
        weighting: ``"samples"`` (cumulative sample counts) or ``"half"`` (fixed 0.5 steps).
        alignment, ot_solver, ground_metric, sinkhorn_reg, repair, cka: passed to :func:`fuse_pair`.
        seed: seed of the ``rand`` base choice and of random alignments (step k uses ``seed + k``).
        device: where the probe forward passes run (``torch.device`` or name; default CPU), see :func:`fuse_pair`.
        progress: optional callable ``progress(done, total)`` after each pairwise fusion or group merge (``total`` =
            n - 1; a group merge of K models counts K - 1).
        fusion_order: ``"pairwise"`` (default) or ``"group"`` (cid / cdd: each architecture's models merged at once
            first, C2M3-style; see the module docstring).

    Returns:
        ``(spec, state_dict, record)``: the global model (spec of the final target, float32 tensors) and a JSON-able
        record with ``strategy``, ``weighting``, ``alignment``, ``ot_solver``, ``ground_metric``, ``order`` (site
        names in the order they join the fusion), ``groups`` (cid/cdd same-depth groups, in chain order), ``base`` (rand), ``pairs`` (every
        pairwise record of :func:`fuse_pair` plus ``step``, ``src``, ``tgt``, ``weight_src``, ``weight_tgt``),
        ``phase_seconds`` ({cka, alignment, ot, averaging, repair}, summed), ``probe_passes`` (forward passes
        of the probe statistics, repair passes excluded) and ``total_seconds``; ``fusion_order``; with
        ``"group"`` also ``group_merges`` (one :func:`.group_merge.merge_group` record per merged architecture, with
        ``members``), whose seconds are included in ``phase_seconds`` and whose probe passes in ``probe_passes``.

    Raises:
        ValueError: no models, duplicate names, non-positive sample counts, unknown strategy/weighting/fusion_order,
            ``fusion_order="group"`` with cia / rand, missing val_acc for ``cia``; errors of :func:`fuse_pair`
            (incompatible models, missing probe, ...).
    """
    t_start = time.perf_counter()
    sites = [_as_site(m) for m in models]
    _check(sites, strategy, weighting, probe, fusion_order)
    fz = _Fusion(sites, probe, strategy, weighting, seed, dict(alignment=alignment, ot_solver=ot_solver,
                 ground_metric=ground_metric, sinkhorn_reg=sinkhorn_reg, repair=repair, cka=cka, device=device))
    fz.progress = progress
    fz.fusion_order = fusion_order
    record: dict = {"strategy": strategy, "weighting": weighting, "alignment": alignment, "ot_solver": ot_solver,
                    "ground_metric": ground_metric, "repair": repair, "cka": cka,
                    "probe_sizes": sorted(probe) if isinstance(probe, dict) else "one", "fusion_order": fusion_order}
    if strategy in ("cid", "cdd"):
        final, order = _by_depth(fz, sites, strategy == "cdd", record)
    elif strategy == "cia":
        final, order = _by_accuracy(fz, sites)
    else:
        final, order = _random_base(fz, sites, seed, weighting, record)
    state_dict = {k: torch.as_tensor(v).to(torch.float32).clone() for k, v in final.state_dict.items()}
    if fusion_order == "group":
        record["group_merges"] = fz.merges
    record.update({"order": order, "pairs": fz.pairs, "phase_seconds": fz.phase,
                   "probe_passes": fz.cache.passes + sum(m["probe_passes"] for m in fz.merges),
                   "total_seconds": time.perf_counter() - t_start})
    return copy.deepcopy(final.spec), state_dict, record


def check_fusion_order(strategy: str, fusion_order: str) -> None:
    """ValueError, naming both options, unless ``fusion_order`` is known and fits ``strategy`` (``group`` needs the
    same-depth groups of cid / cdd)."""
    if fusion_order not in FUSION_ORDERS:
        raise ValueError(f"fusion_order must be one of {FUSION_ORDERS}, got {fusion_order!r}")
    if fusion_order == "group" and strategy not in ("cid", "cdd"):
        raise ValueError(f"fusion_order='group' merges the same-architecture models of cid / cdd's depth groups; "
                         f"strategy {strategy!r} has no such groups")


def _check(sites: list[SiteModel], strategy: str, weighting: str, probe, fusion_order: str = "pairwise") -> None:
    """The inputs of :func:`aggregate_models`; ValueError naming the first problem."""
    if not sites:
        raise ValueError("aggregate_models needs at least one model")
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}")
    for s in sites:
        if not (float(s.n_samples) > 0):
            raise ValueError(f"{s.name}: n_samples must be positive, got {s.n_samples!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if weighting not in ("samples", "half"):
        raise ValueError(f"weighting must be 'samples' or 'half', got {weighting!r}")
    check_fusion_order(strategy, fusion_order)
    if isinstance(probe, dict):
        lacking = [s.name for s in sites if s.input_size is None or int(s.input_size) not in probe]
        if lacking:
            raise ValueError(f"probes given per input size {sorted(probe)}, but no probe fits {lacking}")


class _Fusion:
    """The pairwise fusions of one aggregation: their records, summed phase seconds and the shared statistics cache."""

    def __init__(self, sites, probe, strategy: str, weighting: str, seed, fuse_kw: dict):
        self.n_sites, self.probe, self.strategy, self.weighting, self.seed = len(sites), probe, strategy, weighting, seed
        self.fuse_kw = fuse_kw
        self.phase = dict.fromkeys(PHASES, 0.0)
        self.pairs: list[dict] = []
        self.cache = StatsCache()  # each model's probe statistics, computed once across the pairwise fusions
        self.progress = None  # progress(done, total) after each pairwise fusion
        self.fusion_order = "pairwise"
        self.n_pairs = self.n_sites - 1  # pairwise fusions in all (fewer after group merges)
        self.done = 0  # pairwise fusions plus K - 1 per group merge of K models
        self.merges: list[dict] = []  # group merges' records (fusion_order="group")

    def probe_for(self, size):
        return self.probe[int(size)] if isinstance(self.probe, dict) else self.probe

    @staticmethod
    def start(s: SiteModel) -> _Running:
        return _Running(s.name, s.spec, s.state_dict, float(s.n_samples), [s.name],
                        None if s.input_size is None else int(s.input_size))

    def fuse(self, src: _Running, tgt: _Running, running_is_src: bool = True) -> _Running:
        """Fuse ``src`` into ``tgt`` (:func:`fuse_pair`, step k seeded ``seed + k``) with the strategy's weights."""
        k = len(self.pairs)
        w_s, w_t = (src.weight, tgt.weight) if self.weighting == "samples" else (0.5, 0.5)
        spec, sd, rec = fuse_pair((src.spec, src.state_dict), (tgt.spec, tgt.state_dict), self.probe_for(src.size),
                                  w_s, w_t, seed=None if self.seed is None else self.seed + k,
                                  probe_tgt=self.probe_for(tgt.size), stats_cache=self.cache,
                                  reuse=self.strategy != "rand" and k < self.n_pairs - 1, **self.fuse_kw)
        self.cache.drop(src.state_dict)  # its pre-activations ('acts' metric) are not needed again
        if self.strategy != "rand":  # rand's base is the target of every pair
            self.cache.drop(tgt.state_dict)
        for p in PHASES:
            self.phase[p] += rec["seconds"][p]
        self.pairs.append({"step": k, "src": src.label, "tgt": tgt.label, "weight_src": w_s, "weight_tgt": w_t,
                           **rec})
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, max(self.done, self.n_sites - 1))
        members = src.members + tgt.members if running_is_src else tgt.members + src.members
        return _Running(f"({src.label}+{tgt.label})", spec, sd, src.weight + tgt.weight, members, tgt.size)

    def merge(self, members: list[SiteModel]) -> _Running:
        """Same-architecture models merged at once (:func:`.group_merge.merge_group`, the first in name order is the
        initial reference); one model passes unchanged."""
        if len(members) == 1:
            return self.start(members[0])
        ws = [float(s.n_samples) if self.weighting == "samples" else 1.0 for s in members]
        needs_probe = self.fuse_kw["ground_metric"] == "acts" or self.fuse_kw["repair"] not in (False, None, "none")
        probes = ([self.probe_for(s.input_size) for s in members] if needs_probe and self.probe is not None
                  else None)
        spec, sd, rec = merge_group([(s.spec, s.state_dict) for s in members], ws, probes,
                                    ground_metric=self.fuse_kw["ground_metric"], repair=self.fuse_kw["repair"],
                                    device=self.fuse_kw["device"])
        for p, v in rec["seconds"].items():
            self.phase[p] += v
        names = [s.name for s in members]
        self.merges.append({"members": names, **rec})
        self.done += len(members) - 1
        if self.progress is not None:
            self.progress(self.done, max(self.done, self.n_sites - 1))
        size = members[0].input_size
        return _Running(f"merge[{'+'.join(names)}]", spec, sd, float(sum(s.n_samples for s in members)), names,
                        None if size is None else int(size))

    def chain(self, items: list[_Running]) -> _Running:
        cur = items[0]
        for nxt in items[1:]:
            cur = self.fuse(cur, nxt)
        return cur


def _by_depth(fz: _Fusion, sites: list[SiteModel], deep_first: bool, record: dict) -> tuple[_Running, list]:
    """``cid`` / ``cdd``: each same-depth group fused into its widest member, then the groups' representatives
    chained by depth (shallow to deep, or deep to shallow)."""
    groups: dict[tuple, list[SiteModel]] = {}
    for s in sorted(sites, key=lambda s: s.name):
        groups.setdefault(spec_signature(s.spec), []).append(s)
    if fz.fusion_order == "group":
        return _by_depth_grouped(fz, groups, deep_first, record)
    reps = []
    for sig, members in groups.items():
        base = min(members, key=lambda s: (-_n_params(s.spec), s.name))
        cur = fz.start(base)
        for other in members:
            if other is not base:
                cur = fz.fuse(fz.start(other), cur, running_is_src=False)
        reps.append((len(hidden_rows(members[0].spec)), sig, cur))
    reps.sort(key=lambda t: (t[0], t[1]), reverse=deep_first)
    record["groups"] = [sorted(r[2].members) for r in reps]
    final = fz.chain([r[2] for r in reps])
    return final, final.members


def _by_depth_grouped(fz: _Fusion, groups: dict, deep_first: bool, record: dict) -> tuple[_Running, list]:
    """``cid`` / ``cdd`` with ``fusion_order="group"``: in each same-depth group the models of one architecture are
    merged at once (:meth:`_Fusion.merge`), the merged models of different widths fused pairwise into the widest (most
    parameters, ties by first member name), then the representatives chained by depth as in :func:`_by_depth`."""
    units_by_depth = []
    for sig, members in groups.items():
        arch: dict[tuple, list[SiteModel]] = {}
        for s in members:  # already in name order
            arch.setdefault(architecture_key(s.spec), []).append(s)
        units_by_depth.append((sig, members, list(arch.values())))
    fz.n_pairs = sum(len(a) for _, _, a in units_by_depth) - 1
    reps = []
    for sig, members, archs in units_by_depth:
        units = [fz.merge(ms) for ms in archs]
        base = min(units, key=lambda u: (-_n_params(u.spec), u.members[0]))
        cur = base
        for other in units:
            if other is not base:
                cur = fz.fuse(other, cur, running_is_src=False)
        reps.append((len(hidden_rows(members[0].spec)), sig, cur))
    reps.sort(key=lambda t: (t[0], t[1]), reverse=deep_first)
    record["groups"] = [sorted(r[2].members) for r in reps]
    final = fz.chain([r[2] for r in reps])
    return final, final.members


def _by_accuracy(fz: _Fusion, sites: list[SiteModel]) -> tuple[_Running, list]:
    """``cia``: sites chained by validation accuracy, low to high (ties by name)."""
    missing = [s.name for s in sites if s.val_acc is None]
    if missing:
        raise ValueError(f"strategy 'cia' needs val_acc for every model; missing for {missing}")
    ordered = sorted(sites, key=lambda s: (float(s.val_acc), s.name))
    return fz.chain([fz.start(s) for s in ordered]), [s.name for s in ordered]


def _random_base(fz: _Fusion, sites: list[SiteModel], seed, weighting: str, record: dict) -> tuple[_Running, list]:
    """``rand``: every other model fused into one seeded random base; the results averaged parameter-wise."""
    ordered = sorted(sites, key=lambda s: s.name)
    base = _random.Random(seed).choice(ordered)
    record["base"] = base.name
    b_run = fz.start(base)
    if weighting == "samples" and len(ordered) > 1:  # the base's samples are split over its n - 1 pairs
        b_run.weight = b_run.weight / (len(ordered) - 1)
    results = [fz.fuse(fz.start(s), b_run) for s in ordered if s is not base]
    order = [base.name] + [s.name for s in ordered if s is not base]
    if not results:
        return fz.start(base), order
    with timed(fz.phase, "averaging"):
        ws = [r.weight if weighting == "samples" else 1.0 for r in results]
        tot = sum(ws)
        sd = {k: (sum(w * r.state_dict[k].to(torch.float64) for w, r in zip(ws, results)) / tot)
              .to(torch.float32) for k in results[0].state_dict}
    return _Running(f"mean{[r.label for r in results]}", copy.deepcopy(base.spec), sd,
                    sum(s.n_samples for s in sites), order), order
