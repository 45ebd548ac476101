"""Feature distillation beside the logits: the student's similarity structure of a hidden layer taught by the teachers'.

The server's teachers (the uploaded site models) differ in depth and width, and so does the student (the fused
global model): a hidden layer of one has no counterpart of the same width in another, so no feature-matching loss
that compares activations coordinate by coordinate applies without a learned projection. The similarity-preserving
loss of Tung & Mori compares *which images a layer finds alike* instead: for a batch of B images and a layer's
activations Q (B x d, flattened per image; d may differ per model)

    G = Q Qᵀ (B x B),      G̃ = G with every row divided by its L2 norm

    L_SP(S, T) = (1 / B²) ‖G̃_S − G̃_T‖²_F

and the student minimises ``KD + gamma L_SP`` (Tung & Mori 2019, Sec. 3, with the logit distillation loss in
place of their cross-entropy). G̃ depends on Q only through Q Qᵀ up to a row scale, so it is unchanged by any
orthogonal map of the feature space (a rotation, a channel permutation) and by an isotropic scale: widths need not
match, and the loss is 0 exactly when the student's layer relates the images as the teacher's does. With several teachers the target
is their weighted average ``Σ_k w_k G̃_k`` (the same weights as the logit ensemble), as the logit target is.

Which layer (:data:`FEATURE_LAYERS`): ``penultimate`` -- every model's ``features(x)`` (the activations the class
layer reads: the last hidden fc layer of the fusable families, the projected embedding of the heterogeneous ones),
so a teacher and a student of any two families pair up; the student's logits are ``head(features(x))``, one pass.

Pieces (pure PyTorch, no federation; :func:`hfl_components.fusion.distill.distill` calls them):

* :func:`similarity_matrix` -- G̃ of one batch;
* :func:`similarity_loss` -- L_SP against a given target;
* :func:`target_similarity` -- the teachers' weighted average of G̃ on one batch;
* :func:`teacher_features` -- every teacher's layer on every probe image at its own input size, once (the loop then
  slices a batch's rows, so a step costs no teacher pass);
* :func:`student_features_and_logits` -- the student's layer and logits in one pass.

Medical one-shot federated work that distils intermediate layers beside the logits: FG-RF+DLKD (arXiv 2507.19045).

References:
    1. F. Tung, G. Mori, "Similarity-Preserving Knowledge Distillation", ICCV 2019, arXiv:1907.09682.
    2. G. Hinton, O. Vinyals, J. Dean, "Distilling the Knowledge in a Neural Network", 2015, arXiv:1503.02531.

Example:
    >>> q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> similarity_matrix(q).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURE_LAYERS = ("penultimate",)  # the hidden layer whose similarity structure is distilled (catalogue's choices)


def check_layer(layer: str) -> str:
    """``layer`` if it is one of :data:`FEATURE_LAYERS`; raises ValueError naming the choices otherwise."""
    if layer not in FEATURE_LAYERS:
        raise ValueError(f"feature distillation layer must be one of {FEATURE_LAYERS}, got {layer!r}")
    return layer


def similarity_matrix(features: torch.Tensor) -> torch.Tensor:
    """Row-normalised Gram matrix G̃ of one batch (Tung & Mori 2019, Sec. 3).

    Args:
        features: (B, ...) activations of B images (trailing dims flattened per image), B >= 1.

    Returns:
        (B, B) tensor in the input's dtype, every non-zero row of unit L2 norm (a row of an all-zero image stays 0);
        differentiable.

    Raises:
        ValueError: a scalar or a 1-D tensor (no feature dimension).
    """
    if features.ndim < 2:
        raise ValueError(f"features must be (B, d...) with a feature dimension, got shape {tuple(features.shape)}")
    q = features.reshape(features.shape[0], -1)
    return F.normalize(q @ q.t(), p=2, dim=1)


def similarity_loss(student_features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """L_SP = (1 / B²) ‖G̃_S − target‖²_F (Tung & Mori 2019, Sec. 3), G̃_S the student's :func:`similarity_matrix`.

    Args:
        student_features: (B, ...) the student's activations of the batch.
        target: (B, B) the teachers' G̃ (:func:`target_similarity`), no gradient needed.

    Returns:
        scalar tensor, >= 0; 0 exactly when the student's G̃ equals the target.

    Raises:
        ValueError: the target is not (B, B) for the student's B images.
    """
    b = student_features.shape[0]
    if target.shape != (b, b):
        raise ValueError(f"similarity target must be ({b}, {b}) for {b} images, got {tuple(target.shape)}")
    g = similarity_matrix(student_features)
    return ((g - target.to(g.dtype)) ** 2).sum() / float(b * b)


def target_similarity(teacher_features, weights=None) -> torch.Tensor:
    """The teachers' weighted average ``Σ_k w_k G̃_k`` on one batch.

    Args:
        teacher_features: sequence of K tensors (B, d_k) (widths may differ), the same B images in the same order.
        weights: (K,) non-negative weights summing to 1 (None: equal), e.g. the logit ensemble's.

    Returns:
        float32 (B, B), no gradient.

    Raises:
        ValueError: no teachers, different batch sizes, or a wrong number of weights.
    """
    feats = list(teacher_features)
    if not feats:
        raise ValueError("feature distillation needs at least one teacher")
    if len({int(f.shape[0]) for f in feats}) != 1:
        raise ValueError(f"teacher features must hold the same images, got batch sizes {[f.shape[0] for f in feats]}")
    k = len(feats)
    w = torch.full((k,), 1.0 / k, dtype=torch.float64) if weights is None else torch.as_tensor(
        weights, dtype=torch.float64).flatten()
    if w.shape != (k,):
        raise ValueError(f"{k} teachers need {k} weights, got shape {tuple(w.shape)}")
    with torch.no_grad():
        out = sum(float(wk) * similarity_matrix(f.detach().double()) for wk, f in zip(w, feats))
    return out.float()


def _layer(model: nn.Module, layer: str, x: torch.Tensor) -> torch.Tensor:
    check_layer(layer)
    if not callable(getattr(model, "features", None)) or not callable(getattr(model, "head", None)):
        raise ValueError(f"feature distillation ({layer}) needs models with features(x) and head(z); "
                         f"{type(model).__name__} has not")
    return model.features(x)


def teacher_features(teachers, images: dict[int, torch.Tensor], layer: str, device=None, batch: int = 64
                     ) -> list[torch.Tensor]:
    """Every teacher's ``layer`` on every image, each teacher at its own input size, without gradients.

    Args:
        teachers: sequence of :class:`~hfl_components.fusion.distill.Teacher` (``model``, ``input_size``).
        images: {S: (N, C, S, S)}, the same N images at every teacher's size S.
        layer: one of :data:`FEATURE_LAYERS`.
        device: where the passes run (None: CPU).
        batch: images per pass.

    Returns:
        list of K float32 tensors (N, d_k) on ``device``, in the teachers' order.

    Raises:
        ValueError: an unknown layer, a teacher without ``features``/``head``, or no images at a teacher's size.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    out = []
    with torch.no_grad():
        for t in teachers:
            s = int(t.input_size)
            if s not in images:
                raise ValueError(f"no probe images at teacher {t.name}'s input size {s} (have {sorted(images)})")
            m = t.model.to(dev).eval()
            x = images[s]
            out.append(torch.cat([_layer(m, layer, x[i:i + batch].to(dev, torch.float32)).float()
                                  .reshape(min(batch, x.shape[0] - i), -1) for i in range(0, x.shape[0], batch)]))
    return out


def student_features_and_logits(student: nn.Module, x: torch.Tensor, layer: str
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's ``layer`` (B, d) and its logits (B, C) from one forward pass (``head(features(x))``, which
    is the models' ``forward``). Raises ValueError as :func:`teacher_features`."""
    f = _layer(student, layer, x)
    return f, student.head(f)
