"""Training FENS's prediction aggregator at one site, on the frozen site models' cached outputs.

FENS (Allouah et al., "Revisiting Ensembling in One-Shot Federated Learning", NeurIPS 2024, arXiv:2411.07182),
phase 2: each site computes every frozen site model's output on its own aggregator-training images once, then, in
each federated round, trains the aggregator (:class:`hfl_components.models.ensemble.Aggregator`) from the server's
current weights for a few local epochs; the server averages the sites' aggregator weights (FedAvg,
:func:`hfl_components.aggregation.weighted_average`). The images never pass through the site models again, so an
aggregator epoch costs a pass over a small ``(N, M, C)`` tensor, not over the images.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def aggregator_class_weights(y, num_classes: int, mode: str | None) -> torch.Tensor | None:
    """``None`` for plain cross-entropy, or the inverse-frequency weights of ``y`` for ``mode="balanced"`` (the site
    config's ``class_weights``; :func:`hfl_components.training.balanced_class_weights`)."""
    if mode in (None, "none"):
        return None
    from hfl_components.training.loop import balanced_class_weights

    return balanced_class_weights(np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes))


def train_aggregator(aggregator: nn.Module, z, y, epochs: int, lr: float = 0.01, batch_size: int = 16,
                     seed: int = 0, class_weights=None, dp=None) -> list[dict]:
    """Train ``aggregator`` in place on cached member outputs with Adam and (weighted) cross-entropy.

    Args:
        aggregator: maps (B, M, C) log-probabilities to (B, C) logits.
        z: (N, M, C) float array/tensor, the frozen members' log-probabilities of N images (eval mode, no
            augmentation); y: (N,) int class labels.
        epochs: passes over the N rows (0: nothing is trained, ``[]`` returned).
        lr: Adam learning rate; a fresh optimiser each call (one FedAvg round).
        batch_size: rows per step, shuffled by a generator seeded with ``seed``.
        class_weights: None or a (C,) tensor of cross-entropy class weights.
        dp: None, or a :class:`hfl_components.privacy.DPSession` planned for these N rows (the site's hold-out)
            and batch size: DP-SGD with Opacus as in :func:`hfl_components.training.train_local` (Poisson batches,
            per-row clipping, noise; per-row loss ``w_y CE`` averaged over the batch).

    Returns:
        one ``{"epoch": 1-based, "loss": mean loss over the epoch's rows, "n": N}`` per epoch; under ``dp``
        ``{"epoch", "loss": None or the noised mean loss, "dp": True}`` (what may leave the site).

    Raises:
        ValueError: ``z`` not 3-D, ``y`` of another length, no rows with ``epochs > 0``, ``epochs < 0``.
        FloatingPointError: a non-finite loss.
    """
    z = torch.as_tensor(np.asarray(z), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(y), dtype=torch.long)
    if z.dim() != 3 or y.shape != (z.shape[0],):
        raise ValueError(f"aggregator training needs z (N, M, C) and y (N,), got {tuple(z.shape)} and "
                         f"{tuple(y.shape)}")
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if epochs and z.shape[0] == 0:
        raise ValueError("aggregator training needs at least one image")
    dev = next(aggregator.parameters()).device
    z, y = z.to(dev), y.to(dev)
    w = None if class_weights is None else torch.as_tensor(class_weights, dtype=torch.float32, device=dev)
    opt = torch.optim.Adam(aggregator.parameters(), lr=float(lr))
    if dp is not None:
        return _train_aggregator_private(aggregator, z, y, int(epochs), opt, int(batch_size), int(seed), w, dp)
    g = torch.Generator().manual_seed(int(seed))
    aggregator.train()
    history = []
    for ep in range(int(epochs)):
        total = 0.0
        for idx in torch.randperm(z.shape[0], generator=g).split(int(batch_size)):
            idx = idx.to(dev)
            loss = F.cross_entropy(aggregator(z[idx]), y[idx], weight=w)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"aggregator loss is {loss.item()} at epoch {ep + 1}")
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        history.append({"epoch": ep + 1, "loss": total / z.shape[0], "n": int(z.shape[0])})
    aggregator.eval()
    return history


def _train_aggregator_private(aggregator, z, y, epochs, opt, batch_size, seed, w, dp) -> list[dict]:
    """:func:`train_aggregator` under DP-SGD: the rows as a dataset, Opacus's Poisson batches through ``dp``."""
    if epochs == 0:
        return []
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(z, y), batch_size=batch_size, shuffle=True,
                                         generator=g)
    aggregator.train()
    history = []
    with dp.private(aggregator, opt, loader, epochs) as call:
        for ep in range(epochs):
            noisy = 0.0
            for zb, yb in call.loader:
                out = aggregator(zb)
                per = F.cross_entropy(out, yb, weight=w, reduction="none")
                loss = per.mean() if yb.shape[0] else out.sum() * 0.0  # an empty Poisson batch still steps
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"aggregator loss is {loss.item()} at epoch {ep + 1}")
                call.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                call.optimizer.step()
                s = call.noisy_loss_sum(per)
                noisy += s if s is not None else 0.0
            history.append({"epoch": ep + 1, "loss": noisy / dp.plan.n_images if dp.plan.losses == "noisy" else None,
                            "dp": True})
    aggregator.eval()
    return history
