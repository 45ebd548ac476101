"""Every probe statistic the server's fusion needs from one model, in one forward pass.

OHFL's server probes models for three things: the Gram matrices of CKA (Sec. 3.1, Eq. 1; :mod:`.cka`), the
pre-activation standard deviation of each hidden layer (layer repair) and each neuron's pre-activation mean and std
(channel repair, REPAIR; :mod:`.repair`). Computing them layer by layer with a forward pass that stops at each layer
costs O(L²) layer evaluations per model; here one forward pass with a hook on every hidden layer computes all the
requested statistics of that layer from its output and then drops the activation, so only n x n Grams and
per-neuron vectors are kept (never the full activations of a wide conv layer at 128 px).

The statistics are bitwise the same as those of :func:`.cka.hidden_grams`, :func:`.repair.hidden_stds` and
:func:`.repair.hidden_channel_stats` run separately: a layer's output does not depend on which hooks are attached
or on whether the pass stops after it, and the same float operations are applied to the same CPU float32 tensor.

:class:`StatsCache` keeps each model's statistics keyed by the identity of its state dict and probe tensor, so a
model that takes part in several pairwise fusions (the ``rand`` strategy's base, or a probe-sized target) is probed
once.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from hfl_components.fusion.grams import CKA_KINDS, centre_gram, check_probe, raw_gram

STAT_KEYS = ("stds", "channel", "acts") + tuple(f"gram_{k}" for k in CKA_KINDS)


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the enclosed torch operations on one intra-op thread, restoring the previous count afterwards.

    The per-layer OT work (cost blocks, plan products, averaging) is hundreds of small operations; with PyTorch's
    default of one thread per core, each of them synchronises its OpenMP threads, and on a busy machine (the
    server shares its cores with the sites and other jobs) that made them several times slower than on one thread
    (timings: ``studies/speed/RESULTS.md``). The probe forward
    passes, whose convolutions do gain from threads, run outside this block; the per-layer statistics inside
    those passes (:func:`channel_stats`, the repair's per-neuron product), also many small block operations, run
    inside it for the same reason (``studies/speed/RESULTS.md``)."""
    old = torch.get_num_threads()
    if old == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


BLOCK_ROWS = 16384  # rows of the (positions, C) view per float64 block: no float64 copy of a whole 128 px map


def neuron_rows(y: torch.Tensor) -> torch.Tensor:
    """(n, C, H, W) or (n, C) -> (n·H·W, C) with one column per neuron: a view, no copy, for channels-last maps
    (the probe passes' memory format) and 2-D inputs; a contiguous copy otherwise."""
    if y.dim() == 4:
        return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])
    return y.reshape(y.shape[0], -1)


def channel_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C[, H, W]) -> per-channel mean and std (unbiased) over samples and positions, float64 (C,) each.

    Two passes in float64 (mean, then the sum of squared deviations) over blocks of :data:`BLOCK_ROWS` rows of the
    (n·H·W, C) view, each block converted to float64 on its own: the same float64 arithmetic as ``y.double()``'s
    ``mean`` / ``std`` up to the order of summation (relative difference ~1e-14), without the float64 copy and the
    transposed copy of a whole 128 px activation map (faster; ``studies/speed/RESULTS.md``).
    """
    flat = neuron_rows(y)
    n = flat.shape[0]
    with one_intra_op_thread():
        s1 = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)
        for i in range(0, n, BLOCK_ROWS):
            s1 += flat[i:i + BLOCK_ROWS].sum(0, dtype=torch.float64)
        mu = s1 / n
        s2 = torch.zeros_like(s1)
        for i in range(0, n, BLOCK_ROWS):
            s2 += (flat[i:i + BLOCK_ROWS].double() - mu).square_().sum(0)
    return mu, (s2 / (n - 1)).sqrt_() if n > 1 else torch.full_like(s1, float("nan"))


def layer_std(y: torch.Tensor) -> float:
    """Std (unbiased) of all entries of one layer's pre-activations.

    Computed by PyTorch's float32 reduction (Welford-type, relative error ~1e-7 against float64 on the 8 M entries
    of a 128 px conv layer), faster than a float64 copy; the repair scales it feeds are ratios of such stds.
    """
    return float(y.std())


def _gram(a: torch.Tensor, kind: str, is_conv: bool, n_out: int) -> object:
    """One hidden layer's Gram for CKA of ``kind`` from its CPU float32 (n, features) activations (the values of
    :func:`.cka.hidden_grams`). Non-finite activations are detected on the Gram's diagonal (the float64 sums of
    squares of float32 values are finite iff every value is), which spares a pass over the activations."""
    if kind == "pooled" and is_conv:
        a = a.reshape(a.shape[0], n_out, -1).mean(2)
    if a.shape[0] < 2:
        raise ValueError(f"activations needs at least 2 samples for CKA, got {a.shape[0]}")
    K = raw_gram(a)
    if not np.isfinite(np.diag(K)).all():
        raise ValueError("activations contains non-finite values")
    return K if kind == "debiased" else centre_gram(K)


def layer_stats(y: torch.Tensor, need, info) -> dict:
    """Statistics ``need`` (keys of :data:`STAT_KEYS`) of one hidden layer's output ``y`` ((n, C, H, W) or
    (n, C), any device, any memory format); ``info`` is the layer's ``LayerInfo`` (kind, module).

    A Gram sums over features and a std over all entries, so both are taken in the tensor's memory order (a view,
    no copy, for channels-last maps); only the order of summation differs from the (C, H, W) flattening.
    """
    a = y.detach().to("cpu", torch.float32)
    n = a.shape[0]
    if a.dim() == 4 and not a.is_contiguous() and a.is_contiguous(memory_format=torch.channels_last):
        flat = a.permute(0, 2, 3, 1).reshape(n, -1)  # a view: (n, H*W*C) in memory order
    else:
        flat = a.reshape(n, -1)
    is_conv = info.kind == "conv"
    res = {}
    for k in need:
        if k == "stds":
            res[k] = layer_std(flat)
        elif k == "channel":
            res[k] = channel_stats(a)
        elif k == "acts":
            res[k] = a  # the pre-activations themselves (CPU float32, as computed; the ``acts`` ground metric)
        elif k == "gram_pooled" and is_conv:
            res[k] = _gram(a.reshape(n, a.shape[1], -1).mean(2) if a.dim() != 4 else a.mean((2, 3)), "pooled",
                           False, None)
        else:
            res[k] = _gram(flat, k[5:], is_conv, info.module.out_channels if is_conv else None)
    return res


def fast_layout(model: nn.Module, probe: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Put a CPU conv model and its probe in channels-last memory format (PyTorch's oneDNN convolutions and max
    pooling are faster on it for these thin CNNs); returns the probe to feed and whether the model was
    converted (undo with ``model.to(memory_format=torch.contiguous_format)``). Values are unchanged; outputs
    differ from the default layout by float rounding only."""
    p = next(model.parameters(), None)
    if probe.dim() != 4 or p is None or p.device.type != "cpu":
        return probe, False
    model.to(memory_format=torch.channels_last)
    return probe.contiguous(memory_format=torch.channels_last), True


@torch.no_grad()
def hooked_pass(model: nn.Module, probe: torch.Tensor, layers, fn) -> None:
    """One eval-mode forward pass of ``probe`` (fast memory layout, on the model's device) with a forward hook on each
    ``LayerInfo`` of ``layers``: ``fn(k, info, y)`` sees layer k's output y and may return a replacement output (or
    None to keep y). Hooks, train/eval mode and memory layout are restored afterwards, also on error."""
    handles = [info.module.register_forward_hook(lambda _m, _i, y, k=k, info=info: fn(k, info, y))
               for k, info in enumerate(layers)]
    was_training = model.training
    converted = False
    try:
        model.eval()
        p = next(model.parameters(), None)
        x, converted = fast_layout(model, probe if p is None else probe.to(p.device))
        model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        if converted:
            model.to(memory_format=torch.contiguous_format)


@torch.no_grad()
def hidden_layer_stats(model: nn.Module, probe: torch.Tensor, need) -> dict[str, list]:
    """Requested statistics of every hidden layer (class layer excluded) from one forward pass of ``model``.

    Args:
        model: a fusable model (anything with ``layers()``); run in eval mode without gradients on the device of
            its parameters, its training flag restored afterwards.
        probe: float tensor (n, in_channels, S, S), n >= 2.
        need: iterable of keys from :data:`STAT_KEYS`: ``"stds"`` (float, std of all the layer's pre-activations,
            float64), ``"channel"`` ((mean, std) float64 (C,) per neuron), ``"gram_linear"`` / ``"gram_pooled"``
            (centred n x n float64 Gram, :func:`.cka.centred_gram`), ``"gram_debiased"`` (raw Gram), ``"acts"``
            (the layer's pre-activations themselves, CPU float32 (n, C, H, W) or (n, C), in the memory format the
            pass produced; for the ``acts`` OT ground metric, :func:`.ot_fusion.acts_cost`).

    Returns:
        dict key -> list with one entry per hidden layer, in ``layers()`` order. Grams and channel statistics
        are float64 and equal to those of :func:`.cka.hidden_grams` / :func:`.repair.hidden_channel_stats`; stds
        see :func:`layer_std`.

    Raises:
        ValueError: malformed probe, unknown key, non-finite activations (for Grams).
    """
    need = tuple(dict.fromkeys(need))
    bad = [k for k in need if k not in STAT_KEYS]
    if bad:
        raise ValueError(f"unknown probe statistics {bad}; known: {STAT_KEYS}")
    probe = check_probe(model, probe)
    layers = model.layers()[:-1]
    out: dict[str, list] = {k: [None] * len(layers) for k in need}

    def fn(idx, info, y):
        for k, v in layer_stats(y, need, info).items():
            out[k][idx] = v
        return None

    hooked_pass(model, probe, layers, fn)
    return out


class StatsCache:
    """Probe statistics per (state dict, probe) pair, computed by :func:`hidden_layer_stats` on first request.

    Entries are keyed by ``id(state_dict)`` and ``id(probe)``; the cache holds references to both so the ids stay
    valid for its lifetime. A request for statistics not yet held runs one more pass for the missing keys only.
    """

    def __init__(self):
        self._entries: dict[tuple[int, int], tuple[object, object, dict]] = {}
        self.passes = 0

    def put(self, state_dict, probe: torch.Tensor, stats: dict[str, list]) -> None:
        """Record statistics of a model computed elsewhere (e.g. in the repair pass of a fused model)."""
        key = (id(state_dict), id(probe))
        entry = self._entries.get(key)
        if entry is None or entry[0] is not state_dict or entry[1] is not probe:
            entry = (state_dict, probe, {})
            self._entries[key] = entry
        entry[2].update(stats)

    def drop(self, state_dict, keys=("acts",)) -> None:
        """Forget ``keys`` of every entry of ``state_dict`` (any probe), e.g. the large ``"acts"`` of a model that
        takes part in no further fusion; a later request recomputes them."""
        for entry in self._entries.values():
            if entry[0] is state_dict:
                for k in keys:
                    entry[2].pop(k, None)

    def get(self, state_dict, probe: torch.Tensor, build, need) -> dict[str, list]:
        """Statistics ``need`` of the model ``build()`` (a callable returning the loaded model) on ``probe``."""
        key = (id(state_dict), id(probe))
        entry = self._entries.get(key)
        if entry is None or entry[0] is not state_dict or entry[1] is not probe:
            entry = (state_dict, probe, {})
            self._entries[key] = entry
        have = entry[2]
        missing = [k for k in dict.fromkeys(need) if k not in have]
        if missing:
            have.update(hidden_layer_stats(build(), probe, missing))
            self.passes += 1
        return {k: have[k] for k in need}
