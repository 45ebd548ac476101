"""Optimal-transport neuron alignment and weighted fusion of two depth-balanced models (OHFL Sec. 3.3–3.4).

Problem (Eq. 2–4). For one layer, the source's n neurons and the target's m neurons carry uniform masses
α_i = 1/n and β_j = 1/m; with a ground cost M (n x m) the transport plan is

    T* = argmin_{T >= 0, T 1_m = α, Tᵀ 1_n = β} ⟨T, M⟩_F                         (Eq. 4)
    (Sinkhorn: ⟨T, M⟩_F − ε H(T) with ε = 0.01, the paper's setting, solved in the log domain.)

Normalisation convention (the one under which a model with duplicated neurons fuses back exactly; see
../shared/docs/PITFALLS.md). With W_src^l (n_l x n_{l−1}[x 3 x 3]) and the previous layer's plan T^{l−1}:

    Ŵ^l  = W_src^l · (T^{l−1} / α^{l−1})      incoming weights, *row*-normalised previous plan (each source
                                               neuron passes its whole weight on to the target neurons it maps to)
    W̄^l  = (T^l / β^l)ᵀ · Ŵ^l,  b̄^l = (T^l / β^l)ᵀ · b^l
                                               *column*-normalised current plan (each target neuron receives a
                                               convex combination of the source neurons mapped to it)
    W_fused^l = (w_src · W̄^l + w_tgt · W_tgt^l) / (w_src + w_tgt),   biases likewise.

The paper writes Ŵ = W T^{l−1} and W̄ = (T^l)ᵀ Ŵ with the raw plan, whose entries are ~1/(n m) and would shrink the
weights; dividing by α (rows) and β (columns) is exactly what makes T/α and T/β a permutation matrix when the plan is
one, and makes duplicated neurons (outgoing weights halved) fuse back to the original function. (We divide by the
plan's achieved row / column sums, equal to α, β up to the asserted tolerance.)

Boundaries. The input layer's previous plan is the identity over image channels. At the conv -> fc boundary the
channel plan is expanded over the adaptive pool's h·w positions, P ⊗ I_{h·w}, matching PyTorch's channel-major
flatten. The class layer uses the identity plan (class k stays class k).

Ground metrics. ``"wts"`` (the paper's setting): Euclidean distance between the rows [Ŵ_i, b_i] of the
incoming-aligned source and [W_tgt_j, b_j] of the target. ``"acts"``: Euclidean distance between the neurons'
pre-activations on the probe batch (all samples x positions). Costs are divided by their maximum (float64) before
solving, which leaves the emd plan unchanged and keeps exp(−M/ε) representable for Sinkhorn.
"""
from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np
import ot
import torch

from hfl_components.fusion._arch import layer_table, resolve

StateDict = dict[str, torch.Tensor]


class OTMarginalError(RuntimeError):
    """Raised when a solved transport plan violates its marginals beyond the tolerance (solver failure)."""


def solve_ot(cost, solver: str = "emd", reg: float = 0.01, num_itermax: int | None = None,
             marginal_rtol: float | None = None, _record_warnings: bool = True) -> tuple[np.ndarray, dict]:
    """Transport plan between uniform measures for a ground cost (OHFL Eq. 2–4).

    Args:
        cost: array-like (n, m), finite, non-negative ground cost (any scale; divided by its max internally).
        solver: ``"emd"`` (exact: ``ot.emd``'s network simplex, also for square problems: on the ``acts`` costs
            of the main job's 1000 x 1000 fc layer SciPy's assignment solver was not faster; timings in
            ``studies/speed/RESULTS.md``) or
            ``"sinkhorn"`` (entropic, ``ot.sinkhorn`` with
            ``method="sinkhorn_log"``, regularisation ``reg`` relative to the max-normalised cost; ε-scaling warm
            starts when the plain iteration stalls, see :func:`_sinkhorn_log`).
        reg: entropic regularisation ε for Sinkhorn (paper: 0.01).
        num_itermax: solver iteration cap (default 10_000_000 for emd, 20_000 per Sinkhorn stage).
        marginal_rtol: allowed max |T 1 − α| / α and |Tᵀ 1 − β| / β (default 1e-6 emd, 1e-3 Sinkhorn).

    Returns:
        ``(T, info)``: T float64 (n, m) with T 1 = 1/n, Tᵀ 1 = 1/m; info dict with ``solver``, ``cost_scale``
        (the max used to normalise), ``transport_cost`` (⟨T, M/scale⟩), ``marginal_rel_err``, ``warnings`` (POT's
        warnings, e.g. an iteration cap reached while the marginals still met the tolerance).

    Raises:
        ValueError: bad cost (shape, non-finite, negative) or unknown solver.
        OTMarginalError: the plan violates its marginals beyond ``marginal_rtol`` (e.g. Sinkhorn not converged).
    """
    M = np.array(cost, dtype=np.float64)
    if M.ndim != 2 or M.shape[0] == 0 or M.shape[1] == 0:
        raise ValueError(f"cost must be a non-empty 2-D array, got shape {M.shape}")
    if not np.isfinite(M).all():
        raise ValueError("OT cost contains non-finite values")
    if (M < 0).any():
        raise ValueError("OT cost must be non-negative")
    n, m = M.shape
    scale = float(M.max())
    if scale > 0:
        M /= scale
    a, b = np.full(n, 1.0 / n), np.full(m, 1.0 / m)
    # warnings.catch_warnings is not thread-safe: _solve_acts_layers' threads record in one outer block instead
    with (warnings.catch_warnings(record=True) if _record_warnings else contextlib.nullcontext([])) as caught:
        if _record_warnings:
            warnings.simplefilter("always")
        if solver == "emd":
            T = ot.emd(a, b, M, numItermax=int(num_itermax or 10_000_000))
            rtol = 1e-6 if marginal_rtol is None else marginal_rtol
        elif solver == "sinkhorn":
            T = _sinkhorn_log(a, b, M, reg, int(num_itermax or 20_000))
            rtol = 1e-3 if marginal_rtol is None else marginal_rtol
        else:
            raise ValueError(f"ot_solver must be 'emd' or 'sinkhorn', got {solver!r}")
    T = np.asarray(T, dtype=np.float64)
    msgs = [str(w.message) for w in caught]
    err = max(float(np.max(np.abs(T.sum(1) - a))) * n, float(np.max(np.abs(T.sum(0) - b))) * m)
    if not np.isfinite(T).all() or not err <= rtol:
        raise OTMarginalError(f"{solver} plan ({n}x{m}) violates its marginals: max relative error {err:.3g} > "
                              f"{rtol:g}; solver warnings: {msgs or 'none'}")
    # solver warnings (e.g. iteration cap reached) with marginals inside the tolerance are kept in info only
    return T, {"solver": solver, "cost_scale": scale, "transport_cost": float(np.sum(T * M)),
               "marginal_rel_err": err, "warnings": msgs}


def _sinkhorn_log(a: np.ndarray, b: np.ndarray, M: np.ndarray, reg: float, num_itermax: int) -> np.ndarray:
    """Log-domain Sinkhorn (``ot.sinkhorn(method="sinkhorn_log")``) with an ε-scaling fallback.

    The plain iteration stops when the marginal error is ~1e-6 of a marginal entry. With ε = 0.01 on a [0, 1] cost it
    can stall for hundreds of thousands of iterations when the plan is nearly a permutation (entries of ~1e-5 have
    to grow from ~1e-7). If it has not converged after ``min(2000, num_itermax)`` iterations we re-solve the *same*
    problem by warm-started ε-scaling: ε·(100, 30, 10, 3, 1), each stage started from the previous dual potentials
    (f = ε·log u carried over). The entropic optimum is unique, so this only changes the path, not the plan.
    """
    stop = 1e-6 / max(len(a), len(b))
    T, log = ot.sinkhorn(a, b, M, reg, method="sinkhorn_log", numItermax=min(2000, num_itermax), stopThr=stop,
                         log=True, warn=False)
    if log["err"] and log["err"][-1] < stop:
        return T
    warm, prev = None, None
    for f in (100.0, 30.0, 10.0, 3.0, 1.0):
        r = reg * f
        if warm is not None:
            warm = (warm[0] * prev / r, warm[1] * prev / r)
        T, log = ot.sinkhorn(a, b, M, r, method="sinkhorn_log", numItermax=num_itermax, stopThr=stop, log=True,
                             warmstart=warm, warn=(f == 1.0))
        warm, prev = (log["log_u"], log["log_v"]), r
    return T


def plan_t_matmul(T: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Tᵀ X for a transport plan T (n, m) float64 and X (n, ...): (m, ...), float64.

    An exact-OT plan is a vertex of the transportation polytope with at most n + m − 1 non-zeros (a permutation
    when n = m), so when T has few non-zeros the product is a scatter-add of the non-zero entries
    (``index_add_``, O(nnz · k) instead of O(n m k)); it sums the same non-zero terms as the dense product (the
    dense one adds exact zeros), so the results agree up to the order of summation. Dense plans (Sinkhorn) use
    the dense product.
    """
    n, m = T.shape
    rest = tuple(X.shape[1:])
    Xf = X.reshape(n, -1)
    nz = T.nonzero(as_tuple=True)
    if nz[0].numel() > 4 * (n + m):
        return (T.T @ Xf).reshape((m,) + rest)
    i, j = nz
    out = torch.zeros((m, Xf.shape[1]), dtype=torch.float64)
    out.index_add_(0, j, Xf[i] * T[i, j][:, None])
    return out.reshape((m,) + rest)


def _neuron_matrix(a: torch.Tensor, side: int | None) -> torch.Tensor:
    """One layer's pre-activations (n, C, H, W) or (n, C) -> (D, C) in the input's dtype: column c is neuron c's
    activation vector over all samples (and positions, conv maps average-pooled to ``side`` x ``side`` first
    when they are larger). The entries come in the tensor's memory order (a view, no copy, for a channels-last
    map); a distance between columns does not depend on that order."""
    if a.dim() == 4:
        if side is not None and a.shape[-1] != side:
            a = torch.nn.functional.adaptive_avg_pool2d(a, side)
        a = a.permute(0, 2, 3, 1)  # (n, H, W, C)
    return a.reshape(-1, a.shape[-1])


_CHUNK = 16384  # rows per float64 block: small enough to stay in cache, large enough for few Python steps


def acts_cost(acts_src: torch.Tensor, acts_tgt: torch.Tensor) -> np.ndarray:
    """Ground cost of the ``acts`` metric for one hidden layer: M_ij = ‖x_i − y_j‖₂ between source neuron i's and
    target neuron j's pre-activation vectors on the probe (all samples x positions).

    Args:
        acts_src, acts_tgt: float pre-activations of the layer, (n, C_src, H, W) and (n, C_tgt, H', W') for a conv
            layer (any memory format; square maps) or (n, C_src) and (n, C_tgt) for a fully connected one; the
            same n probe images. Conv maps of different sides (models probed at their own input sizes) are
            average-pooled to the smaller side, so each entry is the mean pre-activation over the same image
            region.

    Returns:
        float64 (C_src, C_tgt) array of distances sqrt(max(0, ‖x‖² + ‖y‖² − 2 x·y)). The norms and the cross
        products are accumulated in float64 over blocks of ``_CHUNK`` rows, each block converted to float64 on
        its own (float32 products are exact in float64; no full float64 copy of a 128 px activation map), so
        this equals ``torch.cdist`` on the (C, n·h·w) float64 vectors up to rounding (~1e-16 relative in the
        squared distance of vectors of comparable norm; cdist itself uses this expansion above 25 rows).

    Raises:
        ValueError: different sample counts or layer kinds.
    """
    if acts_src.dim() != acts_tgt.dim() or acts_src.shape[0] != acts_tgt.shape[0]:
        raise ValueError(f"acts cost needs the same probe images and layer kind, got {tuple(acts_src.shape)} "
                         f"and {tuple(acts_tgt.shape)}")
    side = min(acts_src.shape[-1], acts_tgt.shape[-1]) if acts_src.dim() == 4 else None
    xs, xt = _neuron_matrix(acts_src, side), _neuron_matrix(acts_tgt, side)
    cross = torch.zeros((xs.shape[1], xt.shape[1]), dtype=torch.float64)
    ns = torch.zeros(xs.shape[1], dtype=torch.float64)
    nt = torch.zeros(xt.shape[1], dtype=torch.float64)
    for i in range(0, xs.shape[0], _CHUNK):
        zs, zt = xs[i:i + _CHUNK].to(torch.float64), xt[i:i + _CHUNK].to(torch.float64)
        cross.addmm_(zs.T, zt)
        ns += zs.square().sum(0)
        nt += zt.square().sum(0)
    d2 = ns[:, None] + nt[None, :] - 2.0 * cross
    return d2.clamp_min_(0.0).sqrt_().numpy()


from hfl_components.fusion.probe_stats import one_intra_op_thread as _one_intra_op_thread  # noqa: E402


OT_WORKERS = 2  # threads solving the 'acts' layers' OT problems side by side (POT's network simplex and the
# cost's matrix products release the GIL: 1.85x on two 1000 x 1000 problems here)


def _solve_acts_layers(rows, acts_s, acts_t, solver: str, reg: float) -> dict[int, tuple[np.ndarray, dict]]:
    """{layer index: (plan, info)} for every hidden layer with the ``acts`` metric.

    With ``acts`` a layer's cost depends only on the two models' pre-activations, not on the plan of the layer
    before (unlike ``wts``), so the layers' problems are independent: their costs and plans are computed in up to
    :data:`OT_WORKERS` threads, each exactly as the sequential loop computes it (same cost, same deterministic
    solver), and a failure is raised in layer order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(idx, record=True):
        return solve_ot(acts_cost(acts_s[idx], acts_t[idx]), solver=solver, reg=reg, _record_warnings=record)

    todo = [idx for idx, r in enumerate(rows) if not r.is_output]
    workers = max(1, min(OT_WORKERS, len(todo)))
    if workers == 1:
        return {idx: one(idx) for idx in todo}
    # the largest problems first, so the two threads finish together
    order = sorted(todo, key=lambda i: -acts_s[i].shape[1] * acts_t[i].shape[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ot") as ex:
            futs = {idx: ex.submit(one, idx, False) for idx in order}
            for idx in todo:
                futs[idx].exception()  # wait for all before leaving the warnings block
    if caught:  # rare (e.g. an iteration cap): solve again one by one so each layer's info names its own warnings
        return {idx: one(idx) for idx in todo}
    return {idx: futs[idx].result() for idx in todo}


def ot_fuse_balanced(src_spec: dict, src_sd: StateDict, tgt_spec: dict, tgt_sd: StateDict, weight_src: float,
                     weight_tgt: float, solver: str = "emd", ground_metric: str = "wts", probe=None,
                     reg: float = 0.01, probe_tgt=None, plans: list | None = None, acts_src: list | None = None,
                     acts_tgt: list | None = None) -> tuple[StateDict, list[dict], dict]:
    """Align the source's neurons to the target's layer by layer with OT and average (OHFL Sec. 3.4).

    Args:
        src_spec, src_sd: the depth-balanced source (same hidden-layer layout as the target, any widths).
        tgt_spec, tgt_sd: the target; the result has its architecture and state-dict keys.
        weight_src, weight_tgt: positive averaging weights (normalised to sum to 1).
        solver: ``"emd"`` or ``"sinkhorn"`` (see :func:`solve_ot`); reg: Sinkhorn ε.
        ground_metric: ``"wts"`` (incoming weights + bias) or ``"acts"`` (pre-activations on ``probe``).
        probe: float tensor (n, in_channels, S, S); required for ``"acts"`` (fed to the source, and to the target
            unless ``probe_tgt`` is given).
        probe_tgt: the same images at the target's own input size; conv activations of both models are then
            average-pooled to the smaller of the two maps before the distances are taken.
        plans: if a list, the column-normalised plan T / β (float64 (n_src, n_tgt)) of every hidden layer is
            appended to it, in layer order (used by the per-channel repair, :mod:`.repair`).
        acts_src, acts_tgt: for ``"acts"``, the hidden layers' pre-activations of source (on ``probe``) and target
            (on ``probe_tgt``) already computed (``"acts"`` of :func:`.probe_stats.hidden_layer_stats`, e.g. from a
            :class:`.probe_stats.StatsCache`); computed here by one hooked pass per model when None.

    Returns:
        ``(state_dict, layer_records, seconds)``: fused float32 tensors with the target's keys and shapes; one
        record per weight layer (``layer``, ``n_src``, ``n_tgt``, ``plan`` = ``"ot"``/``"identity"`` and, for OT
        layers, ``transport_cost``, ``cost_scale``, ``marginal_rel_err``); seconds ``{"ot": s, "averaging": s}``.

    Raises:
        ValueError: different layer layouts, bad weights/metric, missing probe for ``"acts"``.
        OTMarginalError: from :func:`solve_ot`.
    """
    rows_s, rows_t = layer_table(src_spec), layer_table(tgt_spec)
    ws, wt = _check_fusion_inputs(rows_s, rows_t, weight_src, weight_tgt, ground_metric)
    secs = {"ot": 0.0, "averaging": 0.0}
    t0 = time.perf_counter()
    acts_s, acts_t = acts_src, acts_tgt
    if ground_metric == "acts":
        acts_s, acts_t = _activations(src_spec, src_sd, tgt_spec, tgt_sd, probe, probe_tgt, acts_s, acts_t,
                                      len(rows_s) - 1)
    pool2 = resolve(tgt_spec)["pool"] ** 2
    P = torch.eye(resolve(src_spec)["in_channels"], dtype=torch.float64)  # row-normalised previous plan
    prev_kind = "conv"
    out: StateDict = {}
    records: list[dict] = []
    with _one_intra_op_thread():
        solved = _solve_acts_layers(rows_s, acts_s, acts_t, solver, reg) if ground_metric == "acts" else {}
        for idx, (rs, rt) in enumerate(zip(rows_s, rows_t)):
            t1 = time.perf_counter()
            W = torch.as_tensor(src_sd[f"{rs.name}.weight"]).to(torch.float64)
            b = torch.as_tensor(src_sd[f"{rs.name}.bias"]).to(torch.float64)
            Wt = torch.as_tensor(tgt_sd[f"{rt.name}.weight"])
            bt = torch.as_tensor(tgt_sd[f"{rt.name}.bias"])
            if rs.kind == "fc" and prev_kind == "conv" and pool2 > 1:
                P = torch.kron(P, torch.eye(pool2, dtype=torch.float64))  # channel plan ⊗ I_{h·w}
            if W.shape[1] != P.shape[0]:
                raise ValueError(f"{rs.name}: {W.shape[1]} inputs but the carried plan has {P.shape[0]} rows")
            # W · (T_prev / α_prev): contract the input axis of W with the plan (sparse for exact OT)
            W_hat = plan_t_matmul(P, W.transpose(0, 1)).transpose(0, 1)
            if tuple(W_hat.shape[1:]) != tuple(Wt.shape[1:]) or (rs.is_output and W.shape[0] != Wt.shape[0]):
                raise ValueError(f"{rs.name}: aligned source shape {tuple(W_hat.shape)} does not fit target "
                                 f"{rt.name} {tuple(Wt.shape)}")
            rec = {"layer": rt.name, "src_layer": rs.name, "n_src": int(W.shape[0]), "n_tgt": int(Wt.shape[0])}
            if rs.is_output:
                W_bar, b_bar = W_hat, b  # identity plan: class k -> class k
                rec["plan"] = "identity"
            else:
                T, info = (_wts_plan(W_hat, b, Wt, bt, solver, reg) if ground_metric == "wts" else solved[idx])
                W_bar, b_bar, P, Tb = _transport(T, W_hat, b)
                if plans is not None:
                    plans.append(Tb)
                rec.update({"plan": "ot", **{k: info[k] for k in ("transport_cost", "cost_scale", "marginal_rel_err",
                                                                  "warnings")}})
            t2 = time.perf_counter()
            out[f"{rt.name}.weight"] = (ws * W_bar + wt * Wt.to(torch.float64)).to(torch.float32)
            out[f"{rt.name}.bias"] = (ws * b_bar + wt * bt.to(torch.float64)).to(torch.float32)
            t3 = time.perf_counter()
            secs["ot"] += t2 - t1
            secs["averaging"] += t3 - t2
            records.append(rec)
            prev_kind = rs.kind
    # everything not spent averaging (including the 'acts' forward passes) counts as OT time
    secs["ot"] = (time.perf_counter() - t0) - secs["averaging"]
    return out, records, secs


def _check_fusion_inputs(rows_s, rows_t, weight_src, weight_tgt, ground_metric) -> tuple[float, float]:
    """The normalised weights ``(ws, wt)``; ValueError for different layouts, bad weights or metric."""
    if [(r.kind, r.stage) for r in rows_s] != [(r.kind, r.stage) for r in rows_t]:
        raise ValueError("OT fusion needs depth-balanced models (same hidden-layer layout); balance them first")
    ws, wt = float(weight_src), float(weight_tgt)
    if not (np.isfinite(ws) and np.isfinite(wt) and ws > 0 and wt > 0):
        raise ValueError(f"fusion weights must be positive and finite, got {weight_src!r}, {weight_tgt!r}")
    if ground_metric not in ("wts", "acts"):
        raise ValueError(f"ground_metric must be 'wts' or 'acts', got {ground_metric!r}")
    return ws / (ws + wt), wt / (ws + wt)


def _activations(src_spec, src_sd, tgt_spec, tgt_sd, probe, probe_tgt, acts_s, acts_t, n_hidden: int):
    """The hidden layers' pre-activations of source (on ``probe``) and target (on ``probe_tgt`` or ``probe``), those
    not given computed by one hooked pass; ValueError without a probe or for the wrong number of layers."""
    from hfl_components.fusion.probe_stats import hidden_layer_stats
    from hfl_components.models.fusable import build_fusable

    def _acts(spec, sd, x):
        if x is None:
            raise ValueError("ground_metric='acts' needs a probe batch")
        m = build_fusable(spec)
        m.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in sd.items()})
        return hidden_layer_stats(m, x, ["acts"])["acts"]

    if acts_s is None:
        acts_s = _acts(src_spec, src_sd, probe)
    if acts_t is None:
        acts_t = _acts(tgt_spec, tgt_sd, probe if probe_tgt is None else probe_tgt)
    if len(acts_s) != n_hidden or len(acts_t) != n_hidden:
        raise ValueError(f"'acts' needs the pre-activations of {n_hidden} hidden layers, got {len(acts_s)} "
                         f"and {len(acts_t)}")
    return acts_s, acts_t


def _wts_plan(W_hat, b, Wt, bt, solver: str, reg: float):
    """The ``wts`` ground metric's plan: OT between the rows (incoming weights + bias) of source and target."""
    xs = torch.cat([W_hat.reshape(W_hat.shape[0], -1), b[:, None]], 1)
    xt = torch.cat([Wt.to(torch.float64).reshape(Wt.shape[0], -1), bt.to(torch.float64)[:, None]], 1)
    return solve_ot(torch.cdist(xs, xt).numpy(), solver=solver, reg=reg)


def _transport(T, W_hat, b):
    """Apply the plan ``T`` (n_src, n_tgt): ``(W_bar, b_bar, T / α carried to the next layer, T / β)``."""
    Tt = torch.from_numpy(T)
    Tb = Tt / Tt.sum(0, keepdim=True)  # column-normalised: T / β
    return plan_t_matmul(Tb, W_hat), Tb.T @ b, Tt / Tt.sum(1, keepdim=True), Tb
