"""A learned teacher for ensemble distillation: a stacker over the site models' outputs, fitted on labelled public
images.

OHFL's server distils the weighted *average* of the uploads' probabilities (:func:`hfl_components.fusion.distill.
ensemble_probs`). FENS (Allouah et al., "Revisiting Ensembling in One-Shot Federated Learning", NeurIPS 2024,
arXiv:2411.07182) shows that a small *learned* aggregator of the same frozen models beats their average; there it
is trained federatedly on the sites' held-out images. Here the combination is learned on the server instead, on the
public probe images' public labels, by stacked generalisation (Wolpert, "Stacked Generalization", Neural Networks
1992): a multinomial logistic regression on every teacher's centred log-probabilities. Its targets for the probe
images are **cross-fitted** (each image labelled by a stacker fitted on the other folds), so no image's target is
a fit to its own label.

Pieces (pure PyTorch, no federation, no file access):

* :func:`stacking_features` -- (K, N, C) teacher logits -> (N, K*C) features.
* :func:`fit_stacker` -- L2-regularised multinomial logistic regression (L-BFGS, float64): weights and bias.
* :func:`stacker_logits` -- the fitted stacker's (N, C) logits.
* :func:`cross_fitted_logits` -- out-of-fold stacker logits of every image (stratified folds).
* :func:`stacked_targets` -- the soft targets the distillation matches: ``softmax(cross-fitted logits / T)``.
"""
from __future__ import annotations

import torch


def _check_logits(teacher_logits) -> torch.Tensor:
    z = torch.stack(list(teacher_logits)) if not isinstance(teacher_logits, torch.Tensor) else teacher_logits
    if z.ndim != 3 or z.shape[0] == 0 or z.shape[1] == 0 or z.shape[2] < 2:
        raise ValueError(f"teacher logits must be K x (N, C) with K >= 1, N >= 1, C >= 2, got shape {tuple(z.shape)}")
    if not torch.isfinite(z).all():
        raise ValueError("teacher logits hold NaN or inf")
    return z.detach().double()


def stacking_features(teacher_logits) -> torch.Tensor:
    """The stacker's inputs: every teacher's log-probabilities, centred over the classes.

    Args:
        teacher_logits: K tensors (N, C) (or one tensor (K, N, C)) of the teachers' logits on the same N images.

    Returns:
        float64 tensor (N, K*C): columns ``k*C .. k*C+C-1`` are teacher k's ``log_softmax(z_k) - mean_c``
        (invariant to a constant added to a teacher's logits; for C = 2 the two columns are +-half the log-odds).

    Raises:
        ValueError: bad shape (not K x (N, C), C >= 2) or non-finite logits.
    """
    z = _check_logits(teacher_logits)
    lp = torch.log_softmax(z, dim=-1)
    lp = lp - lp.mean(dim=-1, keepdim=True)
    return lp.permute(1, 0, 2).reshape(z.shape[1], -1)


def _check_labels(labels, n: int, num_classes: int) -> torch.Tensor:
    y = torch.as_tensor(labels).long().reshape(-1)
    if y.numel() != n:
        raise ValueError(f"{n} images need {n} labels, got {y.numel()}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {sorted(set(y.tolist()))}")
    return y


def fit_stacker(features: torch.Tensor, labels, num_classes: int, l2: float = 1e-2, max_iter: int = 200
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression: minimise ``mean CE(x W + b, y) + l2/2 * ||W||^2`` (bias not penalised),
    by L-BFGS in float64 from zero. The problem is strictly convex for ``l2 > 0``, so the result does not depend on
    a seed.

    Args:
        features: (N, F) float tensor (:func:`stacking_features`).
        labels: (N,) int class labels in 0..C-1; at least two classes present.
        num_classes: C >= 2.
        l2: ridge penalty on the weights (>= 0; 0 only when the classes are not separable).
        max_iter: L-BFGS iterations.

    Returns:
        ``(W, b)``: float64 tensors (F, C) and (C,).

    Raises:
        ValueError: shapes disagree, labels out of range, fewer than two classes among the labels, l2 < 0.
    """
    x = torch.as_tensor(features).double()
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"features must be (N, F) with N >= 1, got shape {tuple(x.shape)}")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not float(l2) >= 0:
        raise ValueError(f"l2 must be >= 0, got {l2}")
    y = _check_labels(labels, x.shape[0], int(num_classes))
    if len(set(y.tolist())) < 2:
        raise ValueError(f"the stacker needs labels of at least two classes, got only {sorted(set(y.tolist()))}")
    w = torch.zeros(x.shape[1], int(num_classes), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(int(num_classes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=int(max_iter), tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + 0.5 * float(l2) * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def stacker_logits(features: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``features @ weights + bias``: (N, F) x (F, C) + (C,) -> float64 (N, C) logits."""
    x = torch.as_tensor(features).double()
    if x.ndim != 2 or weights.shape[0] != x.shape[1] or bias.shape != (weights.shape[1],):
        raise ValueError(f"features {tuple(x.shape)}, weights {tuple(weights.shape)} and bias {tuple(bias.shape)} "
                         "do not fit together")
    return x @ weights.double() + bias.double()


def stratified_folds(labels, folds: int, seed: int = 0) -> torch.Tensor:
    """(N,) fold index of every image: within each class the images are shuffled (``seed``) and dealt to the folds
    in turn, so every fold holds about 1/``folds`` of each class.

    Raises:
        ValueError: folds < 2 or more folds than images.
    """
    y = torch.as_tensor(labels).long().reshape(-1)
    if int(folds) < 2 or int(folds) > y.numel():
        raise ValueError(f"need 2 <= folds <= {y.numel()} images, got {folds}")
    g = torch.Generator().manual_seed(int(seed))
    fold = torch.empty_like(y)
    start = 0
    for c in sorted(set(y.tolist())):
        idx = (y == c).nonzero().reshape(-1)
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        fold[idx] = (torch.arange(idx.numel()) + start) % int(folds)
        start += idx.numel()
    return fold


def cross_fitted_logits(teacher_logits, labels, folds=5, l2: float = 1e-2, seed: int = 0) -> torch.Tensor:
    """Out-of-fold stacker logits: image i's logits come from a stacker (:func:`fit_stacker`) fitted on the images
    of the other folds, never on image i.

    Args:
        teacher_logits: K x (N, C) teacher logits on the N labelled images.
        labels: (N,) int labels.
        folds: the number of folds (>= 2; :func:`stratified_folds` with ``seed``) or an (N,) int tensor of given
            fold indices.
        l2: the stacker's ridge. seed: the folds (when a number is given).

    Returns:
        float64 tensor (N, C).

    Raises:
        ValueError: as :func:`stacking_features` / :func:`fit_stacker`, or a fold whose complement holds one class.
    """
    z = _check_logits(teacher_logits)
    x = stacking_features(z)
    y = _check_labels(labels, x.shape[0], z.shape[2])
    fold = (torch.as_tensor(folds).long().reshape(-1) if isinstance(folds, torch.Tensor)
            else stratified_folds(y, folds, seed))
    if fold.numel() != y.numel():
        raise ValueError(f"{y.numel()} images need {y.numel()} fold indices, got {fold.numel()}")
    out = torch.zeros(x.shape[0], z.shape[2], dtype=torch.float64)
    for f in sorted(set(fold.tolist())):
        test = fold == f
        if not test.any():
            continue
        w, b = fit_stacker(x[~test], y[~test], z.shape[2], l2=l2)
        out[test] = stacker_logits(x[test], w, b)
    return out


def stacked_targets(teacher_logits, labels, temperature: float = 1.0, folds: int = 5, l2: float = 1e-2,
                    seed: int = 0) -> torch.Tensor:
    """The learned teacher's soft targets for distillation: ``softmax(cross_fitted_logits / T)``.

    Args:
        teacher_logits: K x (N, C). labels: (N,) public labels of the same images. temperature: T > 0 (Hinton et
            al. 2015, arXiv:1503.02531). folds, l2, seed: :func:`cross_fitted_logits`.

    Returns:
        float32 tensor (N, C), rows summing to 1, no gradient.

    Raises:
        ValueError: T <= 0, or as :func:`cross_fitted_logits`.
    """
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with torch.no_grad():
        return torch.softmax(cross_fitted_logits(teacher_logits, labels, folds, l2, seed) / float(temperature),
                             dim=-1).float()
