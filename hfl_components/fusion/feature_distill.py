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
match, and the loss is 0 exactly when the student's layer relates the images as the teacher's does (equal G̃).
With several teachers the target is their weighted average ``Σ_k w_k G̃_k`` (the same weights as the logit
ensemble), as the logit target is.

Which layers (:data:`FEATURE_LAYERS`, :func:`layer_plan`):

* ``penultimate`` -- every model's ``features(x)`` (the activations the class layer reads: the last hidden fc layer
  of the fusable families after its ReLU, the projected embedding of the heterogeneous ones), so a teacher and a
  student of any two families pair up; the student's logits are ``head(features(x))``, one pass.
* ``aligned`` -- every hidden layer of a fusable student (``layers()``: conv and fc pre-activations, a conv layer as
  its channel means over positions, so a teacher's layer caches as N x C) is taught by the teachers' layers that
  OHFL's own layer alignment pairs with it: C_ij = 1 - linear CKA (:func:`~hfl_components.fusion.cka.cka_cost_matrix`)
  on the first :data:`ALIGN_IMAGES` probe images, each model at its own input size, and the exact DP of
  :func:`~hfl_components.fusion.layer_alignment.align_layers` (OHFL Sec. 3.1: conv to conv of the same stage, fc to
  fc, first and last hidden layers pinned). A student layer's target is the weighted average over the teachers
  paired with it (their weights renormalised), and the feature loss is the mean over the student's paired layers.
  Where no alignment exists -- a teacher of a non-fusable family, or a stage layout the DP cannot map -- the
  teacher's ``features(x)`` (its last hidden layer, for a fusable teacher) is paired with the student's last hidden
  layer, as the DP's pin would; a non-fusable student falls back to ``penultimate``. The pairs are computed here,
  between the student and each upload, once before the loop (the fusion's pairwise maps relate each upload to the
  running fused model of its step, not to the final student).

Pieces (pure PyTorch, no federation; :func:`hfl_components.fusion.distill.distill` calls them):

* :func:`similarity_matrix` -- G̃ of one batch;
* :func:`similarity_loss` -- L_SP against a given target;
* :func:`target_similarity` -- the teachers' weighted average of G̃ on one batch;
* :func:`layer_plan` -- which teacher layers teach which student layer;
* :func:`model_layers` -- a model's planned layers (and logits) in one pass;
* :class:`FeatureTargets` -- every teacher's planned layers on every probe image at its own input size, computed
  once (a step slices the batch's rows, so it costs no teacher pass), and the step's feature loss.

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

FEATURE_LAYERS = ("penultimate", "aligned")  # the hidden layers whose similarity structure is distilled
ALIGN_IMAGES = 64  # probe images of the aligned plan's CKA (the fusion's default probe_size)
FEATURES = "features"  # a layer key: the model's features(x); an int k is hidden layer k of layers()


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


def has_layers(model: nn.Module) -> bool:
    """True for a model exposing ``layers()`` (the fusable families: hidden layers the alignment can pair)."""
    return callable(getattr(model, "layers", None))


def _check_features(model: nn.Module) -> None:
    if not callable(getattr(model, "features", None)) or not callable(getattr(model, "head", None)):
        raise ValueError(f"feature distillation needs models with features(x) and head(z); {type(model).__name__} "
                         "has not")


def model_layers(model: nn.Module, x: torch.Tensor, keys) -> tuple[dict, torch.Tensor]:
    """The planned layers of ``model`` on ``x`` and its logits, from one forward pass (gradients as the caller's
    mode).

    Args:
        model: a model with ``features(x)`` / ``head(z)`` (every catalogue family); ``layers()`` for int keys.
        x: (B, C, S, S) images at the model's input size.
        keys: layer keys: :data:`FEATURES` (``features(x)``, then ``head``) or ints k (the output of hidden layer k
            of ``layers()``, a pre-activation; conv outputs averaged over positions to (B, C)). Not both kinds.

    Returns:
        ``({key: (B, d) tensor}, logits (B, classes))``.

    Raises:
        ValueError: a model without ``features``/``head`` (or ``layers`` for int keys), both kinds of key, or a
        hidden-layer index out of range.
    """
    keys = sorted(set(keys), key=str)
    _check_features(model)
    if keys == [FEATURES]:
        f = model.features(x)
        return {FEATURES: f.reshape(f.shape[0], -1)}, model.head(f)
    if FEATURES in keys or not has_layers(model):
        raise ValueError(f"feature distillation: layer keys {keys} need a model with layers() and int keys only")
    hidden = model.layers()[:-1]
    if any(not 0 <= int(k) < len(hidden) for k in keys):
        raise ValueError(f"hidden layer keys {keys} out of range for {len(hidden)} hidden layers")
    outs: dict = {}

    def hook(k, kind):
        def fn(_m, _inp, out):
            outs[k] = out.mean(dim=(2, 3)) if kind == "conv" else out.reshape(out.shape[0], -1)
        return fn

    handles = [hidden[int(k)].module.register_forward_hook(hook(int(k), hidden[int(k)].kind)) for k in keys]
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return outs, logits


def layer_plan(student: nn.Module, teachers, layer: str, images: dict[int, torch.Tensor] | None = None,
               student_size: int | None = None, device=None) -> dict:
    """Which teacher layers teach which student layer (see the module docstring).

    Args:
        student: the student model.
        teachers: sequence of :class:`~hfl_components.fusion.distill.Teacher`.
        layer: one of :data:`FEATURE_LAYERS`.
        images: {S: (N, C, S, S)} the same images at every size (``aligned``: the first :data:`ALIGN_IMAGES` are
            the CKA probe); unused for ``penultimate``.
        student_size: the input size the student is probed at for the alignment (``aligned``).
        device: where the CKA passes run (None: CPU).

    Returns:
        ``{"layer", "student": {student key: [(teacher index, teacher key), ...]}, "how": [per teacher
        "features" | "aligned" | "last layers (no alignment: <why>)"]}``; every teacher appears at least once.

    Raises:
        ValueError: an unknown layer, or (``aligned``) no images at the student's or a fusable teacher's size.
    """
    check_layer(layer)
    k_all = range(len(list(teachers)))
    if layer == "penultimate" or not has_layers(student):
        how = "features" if layer == "penultimate" else "features (the student has no layers())"
        return {"layer": layer, "student": {FEATURES: [(k, FEATURES) for k in k_all]}, "how": [how for _ in k_all]}
    from hfl_components.fusion.cka import cka_cost_matrix
    from hfl_components.fusion.layer_alignment import align_layers

    dev = torch.device(device) if device is not None else torch.device("cpu")
    rows_s = student.layers()[:-1]
    last_s = len(rows_s) - 1
    plan: dict = {}
    how = []
    was = student.training
    try:
        for k, t in enumerate(teachers):
            pairs = None
            why = "the teacher has no layers()"
            if has_layers(t.model):
                rows_t = t.model.layers()[:-1]
                try:
                    xs = images[int(student_size)][:ALIGN_IMAGES].to(dev, torch.float32)
                    xt = images[int(t.input_size)][:ALIGN_IMAGES].to(dev, torch.float32)
                    cost = cka_cost_matrix(t.model.to(dev), student.to(dev), xt, xs)
                    pairs = align_layers(cost, [r.kind for r in rows_t], [r.stage for r in rows_t],
                                         [r.kind for r in rows_s], [r.stage for r in rows_s], method="cka")
                except KeyError:
                    raise ValueError(f"no probe images at the student's size {student_size} or teacher {t.name}'s "
                                     f"size {t.input_size} (have {sorted(images or {})})") from None
                except ValueError as e:  # e.g. different stage layouts: the DP has no feasible map
                    why = str(e).split(":")[0]
                    pairs = None
                if pairs is None:
                    plan.setdefault(last_s, []).append((k, len(rows_t) - 1))
                    how.append(f"last layers (no alignment: {why})")
                    continue
                for i_t, j_s in pairs:
                    plan.setdefault(int(j_s), []).append((k, int(i_t)))
                how.append("aligned")
            else:
                plan.setdefault(last_s, []).append((k, FEATURES))
                how.append(f"last layers (no alignment: {why})")
    finally:
        student.train(was)
    return {"layer": layer, "student": dict(sorted(plan.items())), "how": how}


class FeatureTargets:
    """The teachers' side of the feature loss, computed once: every teacher's planned layers on the N training
    images at its own input size (float32 (N, d) each, no gradient), the plan and the teacher weights.

    Args:
        teachers: sequence of :class:`~hfl_components.fusion.distill.Teacher`.
        plan: :func:`layer_plan`'s result.
        images: {S: (N, C, S, S)} the training images at every teacher's size (the same N images, the loop's order).
        weights: (K,) teacher weights (None: equal), renormalised over the teachers paired with each student layer.
        device: where the passes run and the cache lives (None: CPU).
        batch: images per teacher pass.

    Raises:
        ValueError: no images at a teacher's size, or a teacher without the planned layers.
    """

    def __init__(self, teachers, plan: dict, images: dict[int, torch.Tensor], weights=None, device=None,
                 batch: int = 64):
        teachers = list(teachers)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.plan = plan
        k = len(teachers)
        self.weights = torch.full((k,), 1.0 / k, dtype=torch.float64) if weights is None else torch.as_tensor(
            weights, dtype=torch.float64).flatten().cpu()
        need: dict[int, set] = {}
        for rows in plan["student"].values():
            for kk, key in rows:
                need.setdefault(kk, set()).add(key)
        self.cache: dict[tuple, torch.Tensor] = {}
        with torch.no_grad():
            for kk, keys in sorted(need.items()):
                t = teachers[kk]
                s = int(t.input_size)
                if s not in images:
                    raise ValueError(f"no probe images at teacher {t.name}'s input size {s} (have {sorted(images)})")
                m = t.model.to(dev).eval()
                x = images[s]
                parts = [model_layers(m, x[i:i + batch].to(dev, torch.float32), keys)[0]
                         for i in range(0, x.shape[0], batch)]
                for key in keys:
                    self.cache[(kk, key)] = torch.cat([p[key].float() for p in parts])

    @property
    def student_keys(self) -> list:
        return list(self.plan["student"])

    def dims(self) -> dict:
        """{"teacher index:key": width} of the cached layers (records)."""
        return {f"{k}:{key}": int(v.shape[1]) for (k, key), v in sorted(self.cache.items(), key=str)}

    def loss(self, student_layers: dict, idx: torch.Tensor) -> torch.Tensor:
        """The step's feature loss: the mean over the planned student layers j of
        ``similarity_loss(student_layers[j], Σ_k w_k G̃_k / Σ_k w_k)`` over the teachers paired with j, on the
        training images ``idx`` (rows of the cache, the batch's order)."""
        terms = []
        for j, rows in self.plan["student"].items():
            w = torch.stack([self.weights[k] for k, _ in rows])
            f = student_layers[j]
            tgt = target_similarity([self.cache[(k, key)][idx.to(self.cache[(k, key)].device)] for k, key in rows],
                                    w / w.sum())
            terms.append(similarity_loss(f, tgt.to(f.device)))
        return torch.stack(terms).mean()
