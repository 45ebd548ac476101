"""Activation-scale repair of a fused model (an addition to OHFL, not in the paper; on by default, ``repair=False``
gives the paper's pipeline exactly).

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
