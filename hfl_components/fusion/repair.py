"""Activation repair of a fused model (an addition to OHFL, not in the paper; ``repair="none"`` gives the paper's
pipeline exactly). Two modes:

* ``"layer"`` (:func:`repair_scales`): one scalar per hidden layer matches the layer's pre-activation std;
* ``"channel"`` (:func:`repair_channels`, REPAIR proper): every hidden neuron's pre-activation mean and std on the
  probe are set to the fusion-weighted mean of its parents' statistics, the source's carried onto the target's
  neurons through the OT plan (column-normalised, T / β).

Averaging two networks whose neurons only partly correspond shrinks the spread of every hidden layer's
pre-activations, and in a deep BatchNorm-free stack the shrinkage compounds until the fused model's output can be
constant and barely move under fine-tuning (the evidence behind the default: docs/decisions.md, "OHFL repair =
channel"). This is the "variance collapse" that REPAIR (Jordan et al., 2023, "REPAIR:
REnormalizing Permuted Activations for Interpolation Repair", ICLR) corrects with per-neuron statistics.

Here, layer by layer in forward order on the server's probe batch, each hidden layer's weights and bias are
multiplied by one scalar so that the fused layer's pre-activation standard deviation equals the weighted mean of
its parents' (the balanced source's and the target's, with the pairwise fusion weights). Because ReLU is
positively homogeneous, scaling a layer scales everything downstream until the next layer is rescaled, so the
layers are processed sequentially. The class layer is left as fused. A model fused with a permuted or duplicated
copy of itself already has its parents' statistics, so the scale is 1 and the exact recoveries are unchanged.
"""
from __future__ import annotations

import torch

from hfl_components.fusion.probe_stats import channel_stats as _channel_stats
from hfl_components.fusion.probe_stats import BLOCK_ROWS, neuron_rows, one_intra_op_thread
from hfl_components.fusion.probe_stats import STAT_KEYS, hidden_layer_stats, hooked_pass, layer_stats, layer_std
from hfl_components.models import build_model


def hidden_stds(model: torch.nn.Module, probe: torch.Tensor) -> list[float]:
    """Standard deviation of each hidden layer's pre-activations over the probe (class layer excluded), float64
    arithmetic; one forward pass (:func:`.probe_stats.hidden_layer_stats`)."""
    return hidden_layer_stats(model, probe, ["stds"])["stds"]


def hidden_channel_stats(model: torch.nn.Module, probe: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per hidden layer, the per-neuron (mean, std) of its pre-activations over the probe (float64 (C,) each);
    one forward pass."""
    return hidden_layer_stats(model, probe, ["channel"])["channel"]


@torch.no_grad()
def _sequential_repair_pass(model: torch.nn.Module, probe: torch.Tensor, per_layer, collect=(),
                            stats_out: dict | None = None) -> None:
    """One forward pass that repairs the hidden layers in forward order.

    ``per_layer(k, y)`` gets hidden layer k's pre-activations y (computed from the already repaired layers before
    it) and returns the repaired pre-activations, which the hook passes on downstream. Scaling a layer's weight and
    bias by s_k and adding a shift c_k turns its output y into s_k y + c_k for the same input, so this single pass
    sees exactly what the layer-by-layer procedure (one truncated pass per layer after repairing the earlier ones)
    sees, up to float rounding; the caller then writes s_k and c_k into the weights.

    ``collect`` (keys of :data:`.probe_stats.STAT_KEYS`): statistics of the *repaired* pre-activations, i.e. of
    the repaired model on this probe up to float rounding, written to ``stats_out`` (key -> per-layer list) so a
    later fusion step needs no extra pass over the result.
    """
    layers = model.layers()[:-1]
    collect = tuple(collect)
    bad = [k for k in collect if k not in STAT_KEYS]
    if bad:
        raise ValueError(f"unknown probe statistics {bad}; known: {STAT_KEYS}")
    if stats_out is not None:
        stats_out.update({k: [None] * len(layers) for k in collect})

    def hook(k, info, y):
        z = per_layer(k, y.detach())
        if collect and stats_out is not None:
            for key, v in layer_stats(z, collect, info).items():
                stats_out[key][k] = v
        return z

    hooked_pass(model, probe, layers, hook)


def _affine_per_neuron(y: torch.Tensor, s: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """y·s + shift per neuron (s, shift float64 (C,)), computed in float64 and rounded to y's dtype: the values of
    ``(y.double() * s + shift).to(y.dtype)``, block by block over the (positions, C) view
    (:func:`.probe_stats.neuron_rows`) so that no float64 copy of a whole activation map is made; the result
    keeps y's shape and memory format."""
    out = torch.empty_like(y)
    src, dst = neuron_rows(y), neuron_rows(out)
    if dst.data_ptr() != out.data_ptr() or not dst.is_contiguous():  # not a view: plain float64 product
        view = (1, -1) + (1,) * (y.dim() - 2)
        return (y.double() * s.reshape(view) + shift.reshape(view)).to(y.dtype)
    with one_intra_op_thread():  # many small block operations: see probe_stats.one_intra_op_thread
        for i in range(0, src.shape[0], BLOCK_ROWS):
            dst[i:i + BLOCK_ROWS] = torch.addcmul(shift, src[i:i + BLOCK_ROWS].double(), s)
    return out


def _model_for_repair(spec: dict, state_dict: dict, device, n_targets: int, what: str):
    """The fused model in eval mode on ``device`` and its hidden layers; ValueError unless there is one target per
    hidden layer."""
    model = build_model(spec)
    model.load_state_dict(state_dict)
    model.to(device or "cpu")
    model.eval()
    layers = model.layers()[:-1]
    if n_targets != len(layers):
        raise ValueError(f"repair: {n_targets} {what} for {len(layers)} hidden layers")
    return model, layers


def repair_channels(spec: dict, state_dict: dict, goals: list[tuple[torch.Tensor, torch.Tensor]],
                    probe: torch.Tensor, eps: float = 1e-8, max_scale: float = 100.0,
                    device=None, collect=(), stats_out: dict | None = None) -> tuple[dict, list[float]]:
    """REPAIR (Jordan et al., 2023, Sec. 3.2): give every hidden neuron of the fused model a target mean and std.

    Layer by layer in forward order (each layer measured after the earlier ones are repaired; all in one forward
    pass, see :func:`_sequential_repair_pass`), neuron k's
    pre-activation z_k = w_k·x + b_k becomes (z_k − μ_k) σ*_k / σ_k + μ*_k, i.e. w_k ← s_k w_k and
    b_k ← s_k (b_k − μ_k) + μ*_k with s_k = σ*_k / σ_k (clipped to [1/max_scale, max_scale]). A neuron whose
    fused std or goal std is below ``eps`` (dead on the probe) is left as is. The class layer is unchanged.

    Args:
        spec, state_dict: the fused model (fusable family).
        goals: per hidden layer ``(mean*, std*)``, float tensors of the layer's width.
        probe: float tensor (n, in_channels, S, S) at the fused model's input size.
        device: where the probe forward pass runs (default CPU); the returned tensors are on the CPU.
        collect, stats_out: statistics of the repaired model to record (see :func:`_sequential_repair_pass`).

    Returns:
        (new state dict, per-layer mean |log s_k|, a summary of how much each layer was rescaled).

    Raises:
        ValueError: wrong number of goals or goal shapes.
    """
    model, layers = _model_for_repair(spec, state_dict, device, len(goals), "goals")
    for info, (mu_g, sd_g) in zip(layers, goals):
        n_out = info.module.weight.shape[0]
        if tuple(mu_g.shape) != (n_out,) or tuple(sd_g.shape) != (n_out,):
            raise ValueError(f"repair: {info.name} has {n_out} neurons, goal shapes {tuple(mu_g.shape)}")
    found: list = [None] * len(layers)

    def per_layer(k, y):
        mu_g, sd_g = (g.double().to(y.device) for g in goals[k])
        mu, sd = _channel_stats(y)
        live = (sd > eps) & (sd_g > eps)
        s = torch.where(live, (sd_g / sd.clamp_min(eps)).clamp(1 / max_scale, max_scale), torch.ones_like(sd))
        shift = torch.where(live, mu_g - s * mu, torch.zeros_like(mu))
        found[k] = (s, shift)
        return _affine_per_neuron(y, s, shift)

    _sequential_repair_pass(model, probe, per_layer, collect, stats_out)
    summary = []
    with torch.no_grad():
        for info, (s, shift) in zip(layers, found):
            w, b = info.module.weight, info.module.bias
            w.mul_(s.to(w.dtype).reshape(-1, *([1] * (w.dim() - 1))))
            b.copy_((s * b.double() + shift).to(b.dtype))
            summary.append(float(s.log().abs().mean()))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, summary


def repair_scales(spec: dict, state_dict: dict, target_stds: list[float], probe: torch.Tensor,
                  eps: float = 1e-12, max_scale: float = 100.0, device=None, collect=(),
                  stats_out: dict | None = None) -> tuple[dict, list[float]]:
    """Rescale hidden layers of ``(spec, state_dict)`` so their pre-activation stds match ``target_stds``.

    Layer k (forward order) is multiplied by s_k = target_k / std_k, where std_k is measured after layers < k are
    rescaled; one forward pass computes all of them (:func:`_sequential_repair_pass`).

    Args:
        spec, state_dict: the fused model (fusable family).
        target_stds: one target standard deviation per hidden layer (length = layers() - 1).
        probe: float tensor (n, in_channels, S, S), the same probe used for fusion.
        eps: below this the layer is treated as dead and left unscaled.
        max_scale: scales are clipped to [1/max_scale, max_scale].
        device: where the probe forward pass runs (default CPU); the returned tensors are on the CPU.
        collect, stats_out: statistics of the repaired model to record (see :func:`_sequential_repair_pass`).

    Returns:
        (new state dict, list of applied scales).

    Raises:
        ValueError: wrong number of target stds.
    """
    model, layers = _model_for_repair(spec, state_dict, device, len(target_stds), "target stds")
    scales: list[float] = []

    def per_layer(k, y):
        cur = layer_std(y)
        s = 1.0 if cur < eps or target_stds[k] < eps else min(max(target_stds[k] / cur, 1 / max_scale), max_scale)
        scales.append(s)
        return y * s

    _sequential_repair_pass(model, probe, per_layer, collect, stats_out)
    with torch.no_grad():
        for info, s in zip(layers, scales):
            info.module.weight.mul_(s)
            info.module.bias.mul_(s)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, scales
