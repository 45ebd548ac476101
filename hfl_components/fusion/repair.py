"""Activation repair of a fused model (an addition to OHFL, not in the paper; ``repair="none"`` gives the paper's
pipeline exactly). Two modes:

* ``"layer"`` (:func:`repair_scales`): one scalar per hidden layer matches the layer's pre-activation std;
* ``"channel"`` (:func:`repair_channels`, REPAIR proper): every hidden neuron's pre-activation mean and std on the
  probe are set to the fusion-weighted mean of its parents' statistics, the source's carried onto the target's
  neurons through the OT plan (column-normalised, T / β).

Averaging two networks whose neurons only partly correspond shrinks the spread of every hidden layer's
pre-activations, and in a deep BatchNorm-free stack the shrinkage compounds: fusing two trained ``cnn/deep`` chest
X-ray models gave per-layer pre-activation standard deviations falling from ~0.15-1.0 in both parents to ~0.02 in
the fused model, whose output was then constant (zero-shot accuracy = the minority-class rate) and barely moved
under fine-tuning at lr 0.001. This is the "variance collapse" that REPAIR (Jordan et al., 2023, "REPAIR:
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

from hfl_components.fusion.cka import layer_activations
from hfl_components.models import build_model


def hidden_stds(model: torch.nn.Module, probe: torch.Tensor) -> list[float]:
    """Standard deviation of each hidden layer's pre-activations over the probe (class layer excluded)."""
    return [float(a.double().std()) for a in layer_activations(model, probe)[:-1]]


class _Reached(Exception):
    pass


def _layer_std(model: torch.nn.Module, module: torch.nn.Module, probe: torch.Tensor) -> float:
    """Std of one layer's pre-activations on the probe; the forward pass stops at that layer."""
    out = {}

    def hook(_m, _inp, y):
        out["y"] = y
        raise _Reached

    h = module.register_forward_hook(hook)
    p = next(model.parameters(), None)
    try:
        with torch.no_grad():
            model(probe if p is None else probe.to(p.device))
    except _Reached:
        pass
    finally:
        h.remove()
    return float(out["y"].double().std())


def _preact(model: torch.nn.Module, module: torch.nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """One layer's pre-activations on the probe, (n, C, H, W) or (n, C); the forward pass stops at that layer."""
    out = {}

    def hook(_m, _inp, y):
        out["y"] = y
        raise _Reached

    h = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(probe)
    except _Reached:
        pass
    finally:
        h.remove()
    return out["y"].detach()


def _channel_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C[, H, W]) -> per-channel mean and std over samples (and positions), float64 (C,)."""
    y = y.double()
    y = y.transpose(0, 1).reshape(y.shape[1], -1)
    return y.mean(1), y.std(1)


def hidden_channel_stats(model: torch.nn.Module, probe: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per hidden layer, the per-neuron (mean, std) of its pre-activations over the probe (float64 (C,) each)."""
    model.eval()
    return [_channel_stats(_preact(model, info.module, probe)) for info in model.layers()[:-1]]


def repair_channels(spec: dict, state_dict: dict, goals: list[tuple[torch.Tensor, torch.Tensor]],
                    probe: torch.Tensor, eps: float = 1e-8, max_scale: float = 100.0) -> tuple[dict, list[float]]:
    """REPAIR (Jordan et al., 2023, Sec. 3.2): give every hidden neuron of the fused model a target mean and std.

    Layer by layer in forward order (each layer measured after the earlier ones are repaired), neuron k's
    pre-activation z_k = w_k·x + b_k becomes (z_k − μ_k) σ*_k / σ_k + μ*_k, i.e. w_k ← s_k w_k and
    b_k ← s_k (b_k − μ_k) + μ*_k with s_k = σ*_k / σ_k (clipped to [1/max_scale, max_scale]). A neuron whose
    fused std or goal std is below ``eps`` (dead on the probe) is left as is. The class layer is unchanged.

    Args:
        spec, state_dict: the fused model (fusable family).
        goals: per hidden layer ``(mean*, std*)``, float tensors of the layer's width.
        probe: float tensor (n, in_channels, S, S) at the fused model's input size.

    Returns:
        (new state dict, per-layer mean |log s_k|, a summary of how much each layer was rescaled).

    Raises:
        ValueError: wrong number of goals or goal shapes.
    """
    model = build_model(spec)
    model.load_state_dict(state_dict)
    model.eval()
    layers = model.layers()[:-1]
    if len(goals) != len(layers):
        raise ValueError(f"repair: {len(goals)} goals for {len(layers)} hidden layers")
    summary = []
    for info, (mu_g, sd_g) in zip(layers, goals):
        w, b = info.module.weight, info.module.bias
        if tuple(mu_g.shape) != (w.shape[0],) or tuple(sd_g.shape) != (w.shape[0],):
            raise ValueError(f"repair: {info.name} has {w.shape[0]} neurons, goal shapes {tuple(mu_g.shape)}")
        mu, sd = _channel_stats(_preact(model, info.module, probe))
        live = (sd > eps) & (sd_g.double() > eps)
        s = torch.where(live, (sd_g.double() / sd.clamp_min(eps)).clamp(1 / max_scale, max_scale),
                        torch.ones_like(sd))
        shift = torch.where(live, mu_g.double() - s * mu, torch.zeros_like(mu))
        with torch.no_grad():
            w.mul_(s.to(w.dtype).reshape(-1, *([1] * (w.dim() - 1))))
            b.copy_((s * b.double() + shift).to(b.dtype))
        summary.append(float(s.log().abs().mean()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, summary


def repair_scales(spec: dict, state_dict: dict, target_stds: list[float], probe: torch.Tensor,
                  eps: float = 1e-12, max_scale: float = 100.0, device=None) -> tuple[dict, list[float]]:
    """Rescale hidden layers of ``(spec, state_dict)`` so their pre-activation stds match ``target_stds``.

    Args:
        spec, state_dict: the fused model (fusable family).
        target_stds: one target standard deviation per hidden layer (length = layers() - 1).
        probe: float tensor (n, in_channels, S, S), the same probe used for fusion.
        eps: below this the layer is treated as dead and left unscaled.
        max_scale: scales are clipped to [1/max_scale, max_scale].
        device: where the probe forward passes run (default CPU); the returned tensors are on the CPU.

    Returns:
        (new state dict, list of applied scales).

    Raises:
        ValueError: wrong number of target stds.
    """
    model = build_model(spec)
    model.load_state_dict(state_dict)
    model.to(device or "cpu")
    model.eval()
    layers = model.layers()[:-1]
    if len(target_stds) != len(layers):
        raise ValueError(f"repair: {len(target_stds)} target stds for {len(layers)} hidden layers")
    scales = []
    for i, info in enumerate(layers):
        cur = _layer_std(model, info.module, probe)
        s = 1.0 if cur < eps or target_stds[i] < eps else min(max(target_stds[i] / cur, 1 / max_scale), max_scale)
        with torch.no_grad():
            info.module.weight.mul_(s)
            info.module.bias.mul_(s)
        scales.append(s)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, scales
