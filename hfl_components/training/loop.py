"""Local training loop shared by every method.

OHFL's local settings are the defaults (SGD, lr 0.01, momentum 0.9; batch 16 is the loader's business). Methods
plug their auxiliary loss into :func:`train_local` through ``aux_loss(z, logits, y)``; the loop itself never
changes per method.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

AuxLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def unpack_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a loader batch into plain tensors ``(x (B, C, H, W) float, y (B,) long)``.

    Accepts MONAI-style dicts ``{"image": ..., "label": ...}`` and ``(x, y)`` tuples/lists. MONAI ``MetaTensor``
    images are converted to plain tensors (no metadata tracking in the training graph).

    Raises:
        ValueError: a batch of another shape.
    """
    if isinstance(batch, dict):
        if "image" not in batch or "label" not in batch:
            raise ValueError(f"dict batch needs 'image' and 'label' keys, got {sorted(batch)}")
        x, y = batch["image"], batch["label"]
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        x, y = batch[0], batch[1]
    else:
        raise ValueError(f"batch must be a dict with image/label or an (x, y) tuple, got {type(batch).__name__}")
    if hasattr(x, "as_tensor"):
        x = x.as_tensor()
    if hasattr(y, "as_tensor"):
        y = y.as_tensor()
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y).long().reshape(-1)
    return x, y


def balanced_class_weights(counts: Sequence[int]) -> torch.Tensor:
    """scikit-learn's ``class_weight="balanced"`` heuristic from per-class counts.

    ``w_c = N / (K * n_c)`` with ``N = sum(n_c)`` and ``K`` the number of classes with ``n_c > 0`` (King & Zeng,
    2001; equals ``sklearn.utils.class_weight.compute_class_weight("balanced", ...)`` on the present classes).
    Classes with no samples get weight 0 (they never occur as a target, so the weight is inert).

    Args:
        counts: length-C sequence of non-negative sample counts.

    Returns:
        float32 tensor (C,).

    Raises:
        ValueError: negative counts or all counts zero.
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    if c.size == 0 or (c < 0).any() or c.sum() <= 0:
        raise ValueError(f"class counts must be non-negative with a positive sum, got {list(c)}")
    present = c > 0
    w = np.zeros_like(c)
    w[present] = c.sum() / (present.sum() * c[present])
    return torch.as_tensor(w, dtype=torch.float32)


def loader_labels(loader: Iterable) -> np.ndarray:
    """All labels of a loader as an int64 array (N,).

    Fast path: ``loader.dataset.data`` (MONAI ``Dataset``) as a list of dicts with ``"label"``, or
    ``loader.dataset.labels``; otherwise iterates the loader once (loads every image).
    """
    ds = getattr(loader, "dataset", None)
    data = getattr(ds, "data", None)
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, dict) and "label" in r for r in data):
        return np.asarray([int(r["label"]) for r in data], dtype=np.int64)
    labels = getattr(ds, "labels", None)
    if labels is not None:
        return np.asarray(labels, dtype=np.int64).reshape(-1)
    return np.concatenate([unpack_batch(b)[1].numpy() for b in loader]).astype(np.int64)


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _resolve_class_weights(class_weights, class_counts, loader, num_classes: int) -> torch.Tensor | None:
    if class_weights is None:
        return None
    if isinstance(class_weights, str):
        if class_weights != "balanced":
            raise ValueError(f"class_weights must be None, 'balanced' or a tensor, got {class_weights!r}")
        if class_counts is None:
            class_counts = np.bincount(loader_labels(loader), minlength=num_classes)
        w = balanced_class_weights(class_counts)
    else:
        w = torch.as_tensor(class_weights, dtype=torch.float32).reshape(-1)
    if w.numel() != num_classes:
        raise ValueError(f"class weights have {w.numel()} entries but the model has {num_classes} classes")
    return w


def train_local(
    model: nn.Module,
    loader: Iterable,
    epochs: int,
    lr: float = 0.01,
    momentum: float = 0.9,
    class_weights=None,
    aux_loss: AuxLoss | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    seed: int | None = None,
    *,
    class_counts: Sequence[int] | None = None,
    weight_decay: float = 0.0,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    grad_clip: float | None = None,
    amp: bool = False,
    on_step: Callable[[], None] | None = None,
    dp=None,
) -> list[dict]:
    """Train ``model`` in place on one site's loader for ``epochs`` epochs.

    Each step: ``z = model.features(x)`` (B, d); ``logits = model.head(z)`` (B, C);
    ``loss = CE_w(logits, y) + aux_loss(z, logits, y)`` (aux term only when given); SGD step.
    ``CE_w`` is PyTorch's ``cross_entropy(weight=w, reduction="mean")``, i.e. ``sum_i w_{y_i} l_i / sum_i w_{y_i}``.

    Args:
        model: any registry model (has ``features`` and ``head``).
        loader: iterable of batches, dicts ``{"image": (B, 1, S, S) float, "label": (B,) long}`` or ``(x, y)`` tuples.
        epochs: number of passes over ``loader`` (>= 1).
        lr, momentum: SGD settings (OHFL defaults 0.01, 0.9). Ignored when ``optimizer`` is given.
        class_weights: ``None`` (plain CE), ``"balanced"`` (:func:`balanced_class_weights` of ``class_counts``, or of
            the loader's labels when ``class_counts`` is None) or a length-C tensor/list/array of weights.
        aux_loss: optional ``aux_loss(z, logits, y) -> scalar tensor`` added to the CE (the method's structural /
            topology term); it must be differentiable w.r.t. ``z``/``logits`` if it is to train anything.
        on_epoch: optional callback receiving each epoch's record (see Returns) as soon as the epoch ends.
        seed: when given, seeds ``random``/NumPy/torch before training (so loader shuffling and dropout repeat), and
            the loader dataset's MONAI transform (``set_random_state``) when it has one. Model initialisation is the
            caller's: seed before :func:`~hfl_components.models.build_model`. Pass a different seed per round.
        class_counts: per-class training counts for ``class_weights="balanced"`` (saves a pass over the data).
        weight_decay: SGD weight decay (default 0, as OHFL).
        optimizer: an existing optimiser over ``model.parameters()`` to continue (keeps its momentum buffers across
            rounds); when None a fresh SGD is made.
        device: where to train; default the device of the model's first parameter.
        grad_clip: if given, clip the global gradient norm to this value before each step (the prototype methods
            use it: an alignment term pulling features towards far-away prototypes can otherwise blow them up).
        amp: mixed precision (``torch.autocast``) for the model's forward pass: float16 with a ``GradScaler`` on
            CUDA, bfloat16 on the CPU. The losses (CE and ``aux_loss``) are computed in float32 from the
            autocast outputs. Default False (plain float32).
        on_step: optional callback called after every optimiser step (e.g. a weight EMA update).
        dp: None (no differential privacy: the plain loop, as without the argument) or a
            :class:`hfl_components.privacy.DPSession` (DP-SGD, see :func:`_train_private`): Poisson batches,
            per-image clipping and Gaussian noise by Opacus, every step accounted by the session.

    Returns:
        one dict per epoch: ``{"epoch": 1-based int, "loss": mean total loss, "ce": mean CE, "aux": mean aux loss
        (0.0 without aux_loss), "n": samples seen, "seconds": wall time, "images_per_s": float}``. Means are over
        samples (batch means weighted by batch size). Under ``dp`` each record holds only what may leave the site:
        ``{"epoch", "loss": None (losses dropped) or the noised mean loss, "dp": True, "seconds"}``.

    Raises:
        ValueError: ``epochs < 1``, an empty loader, bad class weights or batches; under ``dp`` also ``amp``, a
            batch-dependent ``aux_loss`` and the session's refusals (another loader, a BatchNorm model).
        FloatingPointError: the loss became NaN/inf (reports epoch and step).
        hfl_components.privacy.DPBudgetError: under ``dp``, more epochs than the session's plan allows.
    """
    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if dp is not None:
        return _train_private(model, loader, int(epochs), dp, lr=lr, momentum=momentum, weight_decay=weight_decay,
                              optimizer=optimizer, class_weights=class_weights, class_counts=class_counts,
                              aux_loss=aux_loss, on_epoch=on_epoch, seed=seed, device=device, grad_clip=grad_clip,
                              amp=amp, on_step=on_step)
    device = _prepare(model, loader, seed, device)
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    step_fn = _Step(model, opt, device, bool(amp), class_weights, class_counts, loader, aux_loss, grad_clip, on_step)
    history: list[dict] = []
    model.train()
    for epoch in range(1, int(epochs) + 1):
        t0 = time.perf_counter()
        tot = ce_tot = aux_tot = 0.0
        n = 0
        for step, batch in enumerate(loader):
            b, loss, ce, aux = step_fn(batch, epoch, step)
            n += b
            tot += loss * b
            ce_tot += ce * b
            aux_tot += aux * b
        if n == 0:
            raise ValueError("loader yielded no batches")
        secs = time.perf_counter() - t0
        rec = {"epoch": epoch, "loss": tot / n, "ce": ce_tot / n, "aux": aux_tot / n, "n": n,
               "seconds": secs, "images_per_s": n / secs if secs > 0 else None}
        history.append(rec)
        if on_epoch is not None:
            on_epoch(rec)
    return history


def _prepare(model: nn.Module, loader, seed, device):
    """Seed (``random``/NumPy/torch and the loader's MONAI transform), move the model; returns the device."""
    if seed is not None:
        seed_everything(int(seed))
        transform = getattr(getattr(loader, "dataset", None), "transform", None)
        if hasattr(transform, "set_random_state"):
            transform.set_random_state(seed=int(seed) % (2**32))
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    model.to(device)
    return device


class _Step:
    """One optimiser step of :func:`train_local` on a batch: forward (autocast when ``amp``), CE (class weights
    resolved on the first batch) + aux loss, backward through the grad scaler, optional clip, step, ``on_step``.
    Returns ``(batch size, loss, ce, aux)`` as floats."""

    def __init__(self, model, opt, device, amp: bool, class_weights, class_counts, loader, aux_loss, grad_clip,
                 on_step):
        self.model, self.opt, self.device, self.amp = model, opt, device, amp
        self.class_weights, self.class_counts, self.loader = class_weights, class_counts, loader
        self.aux_loss, self.grad_clip, self.on_step = aux_loss, grad_clip, on_step
        self.dev_type = torch.device(device).type
        self.amp_dtype = torch.float16 if self.dev_type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(self.dev_type, enabled=amp and self.dev_type == "cuda")
        self.weights = None
        self.resolved = False

    def __call__(self, batch, epoch: int, step: int) -> tuple[int, float, float, float]:
        x, y = unpack_batch(batch)
        x, y = x.to(self.device), y.to(self.device)
        with torch.autocast(device_type=self.dev_type, dtype=self.amp_dtype, enabled=self.amp):
            z = self.model.features(x)
            logits = self.model.head(z)
        if self.amp:
            z, logits = z.float(), logits.float()
        if not self.resolved:
            w = _resolve_class_weights(self.class_weights, self.class_counts, self.loader, logits.shape[1])
            self.weights = w.to(self.device) if w is not None else None
            self.resolved = True
        ce = nn.functional.cross_entropy(logits, y, weight=self.weights)
        aux = self.aux_loss(z, logits, y) if self.aux_loss is not None else None
        loss = ce + aux if aux is not None else ce
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} at epoch {epoch}, step {step}")
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.grad_clip is not None:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.grad_clip))
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.on_step is not None:
            self.on_step()
        return y.shape[0], loss.item(), ce.item(), (aux.item() if aux is not None else 0.0)


def _train_private(model: nn.Module, loader, epochs: int, dp, *, lr, momentum, weight_decay, optimizer,
                   class_weights, class_counts, aux_loss, on_epoch, seed, device, grad_clip, amp, on_step
                   ) -> list[dict]:
    """:func:`train_local` under DP-SGD (Abadi et al. 2016, arXiv:1607.00133) with the session ``dp``.

    Each step: Opacus's Poisson batch (possibly empty); ``l_i = w_{y_i} CE(logits_i, y_i)`` per image and the data
    loss ``mean_i l_i`` (Opacus's ``loss_reduction="mean"``: each image's gradient is then ``grad l_i`` alone, so its
    clip bounds one image's influence; the non-dp loop's weighted mean ``sum w l / sum w`` would tie images
    together); per-image clip at ``max_grad_norm``, Gaussian noise, division by the expected batch size. A
    data-independent ``aux_loss`` (FedProx's proximal term: no gradient through ``z`` or ``logits``) is added to
    the noised gradient before the update, and ``grad_clip`` clips the noised gradient: both post-processing. An
    ``aux_loss`` that depends on the batch is refused (its per-image gradients are not separable).
    """
    if amp:
        raise ValueError("dp cannot be combined with amp (mixed precision): Opacus computes per-image gradients "
                         "in float32")
    device = _prepare(model, loader, seed, device)
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    history: list[dict] = []
    model.train()
    with dp.private(model, opt, loader, epochs) as call:
        step_fn = _PrivateStep(model, call, device, class_weights, class_counts, loader, aux_loss, grad_clip, on_step)
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            noisy = 0.0
            for step, batch in enumerate(call.loader):
                s = step_fn(batch, epoch, step)
                noisy += s if s is not None else 0.0
            secs = time.perf_counter() - t0
            released = noisy / dp.plan.n_images if dp.plan.losses == "noisy" else None
            rec = {"epoch": epoch, "loss": released, "dp": True, "seconds": secs}
            history.append(rec)
            if on_epoch is not None:
                on_epoch(rec)
    return history


class _PrivateStep:
    """One DP-SGD step of :func:`_train_private` (see there). Returns the step's noised loss sum (None when the
    session drops losses)."""

    def __init__(self, model, call, device, class_weights, class_counts, loader, aux_loss, grad_clip, on_step):
        self.model, self.call, self.device = model, call, device
        self.class_weights, self.class_counts, self.loader = class_weights, class_counts, loader
        self.aux_loss, self.grad_clip, self.on_step = aux_loss, grad_clip, on_step
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.weights = None
        self.resolved = False
        self.pending: tuple | None = None
        call.after_noise.append(self._after_noise)

    def _after_noise(self) -> None:
        if self.pending is not None:
            for p, g in zip(self.params, self.pending):
                if g is not None and p.grad is not None:
                    p.grad.add_(g.to(p.grad.dtype))
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, float(self.grad_clip))

    def _aux_grads(self, aux: torch.Tensor, z: torch.Tensor, logits: torch.Tensor):
        if not aux.requires_grad:
            return None
        through_batch = torch.autograd.grad(aux, [z, logits], retain_graph=True, allow_unused=True)
        if any(g is not None for g in through_batch):
            raise ValueError("dp: the method's auxiliary loss depends on the batch (features or logits); DP-SGD "
                             "needs per-image gradients, so only a data-independent term (e.g. FedProx's "
                             "proximal term) can be combined with dp")
        return torch.autograd.grad(aux, self.params, allow_unused=True)

    def __call__(self, batch, epoch: int, step: int) -> float | None:
        x, y = unpack_batch(batch)
        x, y = x.to(self.device), y.to(self.device)
        z = self.model.features(x)
        logits = self.model.head(z)
        if not self.resolved:
            w = _resolve_class_weights(self.class_weights, self.class_counts, self.loader, logits.shape[1])
            self.weights = w.to(self.device) if w is not None else None
            self.resolved = True
        per = nn.functional.cross_entropy(logits, y, weight=self.weights, reduction="none")
        data_loss = per.mean() if y.shape[0] else logits.sum() * 0.0  # an empty Poisson batch still steps (noise)
        if not torch.isfinite(data_loss):
            raise FloatingPointError(f"non-finite loss {data_loss.item()} at epoch {epoch}, step {step}")
        self.pending = self._aux_grads(self.aux_loss(z, logits, y), z, logits) if self.aux_loss is not None else None
        self.call.optimizer.zero_grad(set_to_none=True)
        data_loss.backward()
        self.call.optimizer.step()
        self.pending = None
        if self.on_step is not None:
            self.on_step()
        return self.call.noisy_loss_sum(per)
