"""Ensemble distillation on the server: the uploads' ensemble taught to one student model per architecture.

After OHFL's weight fusion the server holds every site's uploaded model (the *teachers*) and, per model family, a
*student* (the fused model of a fusable family, or a site's or a fresh model of any other family). The student is
trained to match the teachers' averaged class probabilities on unlabelled public images the server already holds
(the probe pool), which is ensemble distillation as in FedDF (Lin et al., "Ensemble Distillation for Robust Model
Fusion in Federated Learning", NeurIPS 2020, arXiv:2006.07242) with Hinton et al.'s temperature-softened targets
("Distilling the Knowledge in a Neural Network", 2015, arXiv:1503.02531). Fusion becomes the starting point and
distillation closes the rest of the gap to the ensemble; because the teachers are queried only through their
outputs, the student may be any architecture (cross-family).

Pieces (pure PyTorch, no federation):

* :func:`teacher_weights` -- each teacher's weight: by training-sample count, by reported validation score (e.g.
  AUC, above chance), or equal.
* :func:`ensemble_probs` -- the ensemble's soft targets: the weighted mean of the teachers' temperature-softened
  class probabilities (FedDF, Eq. in Sec. 3 / Algorithm 1, averages logits; averaged *probabilities* are what the
  site ensemble reference scores, so the student is taught exactly the reference it is held to).
* :func:`distillation_loss` -- ``T^2 * KL(p_teacher^T || p_student^T)`` (Hinton et al. 2015, Sec. 2).
* :func:`distill` -- the loop: a held-aside slice of the probe images decides when to stop (early stopping on the
  distillation loss, never on labels), the student's input sizes take turns on the same (augmented) images, and
  the teachers label each image once, at their own input sizes. Optionally (:class:`FeatureDistill`) a
  similarity-preserving loss on a hidden layer joins the logit loss
  (:mod:`hfl_components.fusion.feature_distill`, Tung & Mori 2019, arXiv:1907.09682).

The probe pool's labels are never an input here: every function takes images only. A learned teacher that does
read public labels (:mod:`hfl_components.fusion.stacking`) hands its targets to :func:`distill` as ``targets``.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTINGS = ("samples", "score", "equal")


def teacher_weights(n_samples=None, scores=None, mode: str = "samples", chance: float = 0.5) -> torch.Tensor:
    """Normalised teacher weights (sum 1).

    Args:
        n_samples: (K,) positive training-sample counts (``mode="samples"``).
        scores: (K,) validation scores in [0, 1] (``mode="score"``, e.g. each site's reported validation AUC);
            a teacher's weight is ``max(score - chance, 0)``, its margin over a guessing model, so a site model no
            better than chance teaches nothing. Missing scores (None / NaN) count as chance.
        mode: ``samples`` | ``score`` | ``equal``.
        chance: the score of a guessing model (0.5 for AUC).

    Returns:
        float64 tensor (K,), non-negative, summing to 1.

    Raises:
        ValueError: unknown mode, missing/empty input for the mode, a non-positive or non-finite count, or every
        score at or below chance (no teacher is better than guessing).

    Example:
        >>> teacher_weights([100, 300]).tolist()
        [0.25, 0.75]
    """
    if mode not in WEIGHTINGS:
        raise ValueError(f"teacher weighting must be one of {WEIGHTINGS}, got {mode!r}")
    if mode == "samples":
        if n_samples is None or len(n_samples) == 0:
            raise ValueError("teacher_weights(mode='samples') needs the teachers' sample counts")
        w = torch.as_tensor([float(n) for n in n_samples], dtype=torch.float64)
        if not torch.isfinite(w).all() or (w <= 0).any():
            raise ValueError(f"sample counts must be positive and finite, got {list(n_samples)}")
    elif mode == "score":
        if scores is None or len(scores) == 0:
            raise ValueError("teacher_weights(mode='score') needs the teachers' validation scores")
        s = torch.as_tensor([chance if v is None else float(v) for v in scores], dtype=torch.float64)
        s = torch.nan_to_num(s, nan=chance)
        w = (s - chance).clamp_min(0.0)
        if w.sum() <= 0:
            raise ValueError(f"no teacher scores above chance ({chance}): {list(scores)}")
    else:
        k = len(n_samples) if n_samples is not None else len(scores) if scores is not None else 0
        if k == 0:
            raise ValueError("teacher_weights(mode='equal') needs the number of teachers (counts or scores)")
        w = torch.ones(k, dtype=torch.float64)
    return w / w.sum()


def ensemble_probs(teacher_logits, weights=None, temperature: float = 1.0) -> torch.Tensor:
    """The ensemble's soft targets: ``sum_k w_k softmax(z_k / T)``.

    Args:
        teacher_logits: sequence of K tensors (B, C) (or one tensor (K, B, C)).
        weights: (K,) non-negative weights summing to 1 (None: equal).
        temperature: T > 0 (Hinton et al. 2015: T > 1 softens the targets).

    Returns:
        float32 tensor (B, C), rows summing to 1, no gradient.

    Raises:
        ValueError: no teachers, different shapes, wrong number of weights, T <= 0.
    """
    z = torch.stack(list(teacher_logits)) if not isinstance(teacher_logits, torch.Tensor) else teacher_logits
    if z.ndim != 3 or z.shape[0] == 0:
        raise ValueError(f"teacher logits must be K x (B, C) with K >= 1, got shape {tuple(z.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    k = z.shape[0]
    w = torch.full((k,), 1.0 / k, dtype=torch.float64) if weights is None else torch.as_tensor(weights,
                                                                                                dtype=torch.float64)
    if w.shape != (k,):
        raise ValueError(f"{k} teachers need {k} weights, got shape {tuple(w.shape)}")
    with torch.no_grad():
        p = torch.softmax(z.detach().double() / temperature, dim=-1)
        return torch.einsum("k,kbc->bc", w.to(p.device), p).float()


def distillation_loss(student_logits: torch.Tensor, target_probs: torch.Tensor, temperature: float = 1.0
                      ) -> torch.Tensor:
    """Hinton et al.'s soft-target loss ``T^2 * KL(q || softmax(z_s / T))``, averaged over the batch.

    The ``T^2`` factor keeps the gradient's scale independent of T (Hinton et al. 2015, Sec. 2). The loss is 0
    exactly when the student's softened probabilities equal the targets.

    Args:
        student_logits: (B, C) logits of the student.
        target_probs: (B, C) soft targets q (rows sum to 1), e.g. :func:`ensemble_probs` at the same T.
        temperature: T > 0.

    Returns:
        scalar tensor (nats x T^2).

    Raises:
        ValueError: shapes differ, T <= 0.
    """
    if student_logits.shape != target_probs.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and targets {tuple(target_probs.shape)} "
                         "must have the same shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logq_s = F.log_softmax(student_logits / temperature, dim=-1)
    q = target_probs.to(logq_s.dtype)
    kl = (q * (torch.log(q.clamp_min(1e-12)) - logq_s)).sum(-1)
    return kl.mean() * temperature ** 2


def split_probe(n: int, val_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the probe images used to train the student and the held-aside slice that decides when to stop.

    Args:
        n: number of probe images (>= 2 when ``val_fraction > 0``).
        val_fraction: share held aside, in [0, 1); at least one image when > 0, at least one left to train on.
        seed: which images are held aside.

    Returns:
        ``(train_idx, val_idx)`` long tensors, disjoint, covering 0..n-1 (``val_idx`` empty for fraction 0).

    Raises:
        ValueError: n < 1, fraction outside [0, 1), or too few images to hold one aside.
    """
    if n < 1:
        raise ValueError(f"need at least one probe image, got {n}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    n_val = 0 if val_fraction == 0 else max(1, int(round(val_fraction * n)))
    if n_val >= n:
        raise ValueError(f"{n} probe images cannot hold aside {n_val} for early stopping and train on the rest")
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def augment_all_sizes(images: dict[int, torch.Tensor], generator: torch.Generator | None = None
                      ) -> dict[int, torch.Tensor]:
    """The sites' training augmentation (``chest_xray.batch_augment``: horizontal flip p=0.5, affine p=0.8 with
    rotation +-10 degrees and shift +-6 % of the side), with *the same* random parameters for one image at every
    input size, so that teachers and students at different sizes see the same augmented picture.

    Args:
        images: {input size S: (B, C, S, S) tensor}, the same B images prepared at each size.
        generator: CPU generator of the parameters (None: torch's global one).

    Returns:
        {S: augmented (B, C, S, S) tensor} (new tensors, same devices).
    """
    from chest_xray.batch_augment import batch_augment, sample_augment_params

    sizes = sorted(images)
    b = images[sizes[0]].shape[0]
    ref = float(sizes[-1])
    p = sample_augment_params(b, int(ref), int(ref), generator=generator)
    out = {}
    for s in sizes:
        q = dict(p)
        q["shift"] = p["shift"] * (float(s) / ref)  # the same fraction of the side at every size
        out[s] = batch_augment(images[s], params=q)
    return out


@dataclass
class DistillConfig:
    """Options of :func:`distill` (recorded with every run).

    Attributes:
        steps: maximum optimiser steps (the budget; early stopping may end sooner), required: the main job's
            budget is the catalogue option ``distill_steps``, which the server passes. 0 = no distillation. Each
            step is one batch at one of the student's input sizes, the sizes taking turns.
        temperature: T of the soft targets and the loss (Hinton et al. 2015).
        lr: SGD learning rate (momentum ``momentum``; the sites' fine-tuning optimiser).
        momentum: SGD momentum.
        batch_size: probe images per step.
        val_fraction: share of the probe held aside to decide when to stop.
        eval_every: steps between two checks of the held-aside loss.
        patience: checks without improvement before stopping (0: never stop early).
        augment: apply the sites' augmentation (:func:`augment_all_sizes`) to the training images. Off by
            default: teachers trained with augmentation of some classes only read an augmented image as those
            classes, and the student would learn that cue.
        augment_copies: augmented views made of every training image (once, before the loop; the teachers label
            each view once), used beside the original images. Ignored without ``augment``.
        weight_decay: SGD weight decay.
        max_seconds: wall-clock cap of the loop (None: none); the loop stops after the step that crosses it.
        seed: batch order, held-aside slice and augmentation.
    """

    steps: int
    temperature: float = 2.0
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 32
    val_fraction: float = 0.2
    eval_every: int = 20
    patience: int = 3
    augment: bool = False
    augment_copies: int = 2
    weight_decay: float = 0.0
    max_seconds: float | None = None
    seed: int = 0

    def check(self) -> "DistillConfig":
        """Raise ValueError naming the first bad field; return self."""
        if int(self.steps) < 0:
            raise ValueError(f"distillation steps must be >= 0, got {self.steps}")
        if not float(self.temperature) > 0 or not math.isfinite(float(self.temperature)):
            raise ValueError(f"distillation temperature must be a finite number > 0, got {self.temperature}")
        if not float(self.lr) > 0 or not 0 <= float(self.momentum) < 1:
            raise ValueError(f"distillation lr must be > 0 and momentum in [0, 1), got {self.lr}, {self.momentum}")
        if int(self.batch_size) < 1 or int(self.eval_every) < 1 or int(self.patience) < 0:
            raise ValueError("distillation batch_size and eval_every must be >= 1, patience >= 0")
        if int(self.augment_copies) < 0:
            raise ValueError(f"distillation augment_copies must be >= 0, got {self.augment_copies}")
        if not 0.0 <= float(self.val_fraction) < 1.0:
            raise ValueError(f"distillation val_fraction must lie in [0, 1), got {self.val_fraction}")
        return self


@dataclass(frozen=True)
class FeatureDistill:
    """Feature distillation beside the logits (:mod:`hfl_components.fusion.feature_distill`): each step's loss is
    ``KD + weight * L_SP`` on the student's ``layer``. Passed to :func:`distill` as ``features``; None there (or
    ``weight`` 0) is the logit-only loop, unchanged.

    Attributes:
        weight: gamma >= 0, finite (Tung & Mori 2019's weight of L_SP); required: the catalogue option
            ``distill_feature_weight`` owns the main job's value.
        layer: one of :data:`~hfl_components.fusion.feature_distill.FEATURE_LAYERS`; required (the catalogue option
            ``distill_feature_layer``).
    """

    weight: float
    layer: str

    def check(self) -> "FeatureDistill":
        """Raise ValueError naming the bad field; return self."""
        from hfl_components.fusion.feature_distill import check_layer

        if not 0.0 <= float(self.weight) < math.inf:
            raise ValueError(f"feature distillation weight must be a finite number >= 0, got {self.weight}")
        check_layer(self.layer)
        return self

    @property
    def on(self) -> bool:
        return float(self.weight) > 0.0


@dataclass
class Teacher:
    """One teacher: a model in eval mode and the input size it was trained at.

    Attributes:
        name: e.g. the site name (records only).
        model: ``nn.Module`` mapping (B, C, S, S) -> (B, classes) logits.
        input_size: S; the teacher sees every image at this size.
    """

    name: str
    model: nn.Module
    input_size: int


@dataclass
class DistillResult:
    """What :func:`distill` returns besides the trained student.

    Attributes:
        steps_run: optimiser steps taken; ``best_step``: the step whose weights are returned (0 = the initial
        student); ``val_loss``: [(step, held-aside loss)] of every check; ``initial_val_loss`` / ``best_val_loss``;
        ``stopped``: ``budget`` | ``early`` | ``time`` | ``no_steps``; ``seconds``; ``config``: the options;
        ``feature`` (feature distillation only): ``weight``, ``layer``, ``plan`` ({student layer: [[teacher,
        teacher layer], ...]}), ``how`` ({teacher: how it was paired}), ``teacher_dims`` and ``train_loss``, [(step,
        L_SP of that step's batch)] at every check.
    """

    steps_run: int = 0
    best_step: int = 0
    val_loss: list = field(default_factory=list)
    initial_val_loss: float | None = None
    best_val_loss: float | None = None
    stopped: str = "no_steps"
    seconds: float = 0.0
    n_train: int = 0
    n_val: int = 0
    sizes: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    feature: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The record; ``feature`` only when feature distillation ran (a logit-only run's record is as before)."""
        d = asdict(self)
        if not d["feature"]:
            del d["feature"]
        return d


def _channels_last(x):
    """A model (in place) or a 4-D image batch in channels-last memory layout: the same values, a layout in which
    PyTorch's CPU convolutions and max pooling run faster (a module's non-4-D parameters are left as they are)."""
    return x.to(memory_format=torch.channels_last)


def _targets(teachers, weights, views: dict[int, torch.Tensor], temperature: float, batch: int = 64
             ) -> torch.Tensor:
    """Ensemble targets of every image of ``views`` ({size: (N, C, S, S)}), in batches of ``batch``: each teacher
    labels every image once (channels-last during the passes, its own layout restored after)."""
    n = next(iter(views.values())).shape[0]
    logits = []
    with torch.no_grad():
        for t in teachers:
            _channels_last(t.model)
            x = views[int(t.input_size)]
            logits.append(torch.cat([t.model(_channels_last(x[i:i + batch])).float() for i in range(0, n, batch)]))
            t.model.to(memory_format=torch.contiguous_format)
    return ensemble_probs(logits, weights, temperature)


def _check_inputs(student_sizes, teachers, images) -> tuple[list[int], set[int], int]:
    """(student sizes, every size needed, N); raises ValueError as :func:`distill` documents."""
    if not teachers:
        raise ValueError("distillation needs at least one teacher")
    sizes = sorted({int(s) for s in student_sizes})
    need = set(sizes) | {int(t.input_size) for t in teachers}
    missing = sorted(need - {int(s) for s in images})
    if missing:
        raise ValueError(f"no probe images at input sizes {missing} (have {sorted(images)})")
    counts = {int(images[s].shape[0]) for s in need}
    if len(counts) != 1:
        raise ValueError(f"the probe must hold the same images at every size, got counts {sorted(counts)}")
    return sizes, need, counts.pop()


def _labelled_pool(teachers, weights, images, need, sizes, train_idx, val_idx, cfg, g, dev, targets=None):
    """The training images (originals and, with ``augment``, their augmented views) at the student's sizes with
    the ensemble's targets (or the rows of the given ``targets``), and the held-aside images with theirs:
    ``(train, train_q, val, val_q)``; ``val`` and ``val_q`` are None when nothing is held aside."""
    if targets is not None:
        q = targets.to(dev, torch.float32)
        train = {s: _channels_last(images[s][train_idx].to(dev, torch.float32)) for s in sizes}
        if not val_idx.numel():
            return train, q[train_idx.to(dev)], None, None
        val = {s: _channels_last(images[s][val_idx].to(dev, torch.float32)) for s in sizes}
        return train, q[train_idx.to(dev)], val, q[val_idx.to(dev)]
    for t in teachers:
        t.model.to(dev).eval()
    T = float(cfg.temperature)
    train = {s: images[s][train_idx].to(dev, torch.float32) for s in need}
    if cfg.augment and int(cfg.augment_copies) > 0:
        views = [augment_all_sizes(train, g) for _ in range(int(cfg.augment_copies))]
        train = {s: torch.cat([train[s]] + [v[s] for v in views]) for s in need}
    train_q = _targets(teachers, weights, train, T)
    # the teachers' own sizes are not needed any more; the student reads channels-last batches
    train = {s: _channels_last(v) for s, v in train.items() if s in sizes}
    if not val_idx.numel():
        return train, train_q, None, None
    val = {s: images[s][val_idx].to(dev, torch.float32) for s in need}
    val_q = _targets(teachers, weights, val, T)
    return train, train_q, {s: _channels_last(val[s]) for s in sizes}, val_q


def _batches(n: int, batch_size: int, g: torch.Generator):
    """Index batches (long tensors) of a fresh permutation of ``range(n)`` each pass, forever."""
    while True:
        order = torch.randperm(n, generator=g)
        for i in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield order[i:i + batch_size]


class _BestKeeper:
    """Early stopping: the held-aside loss of the student at each check, the best weights so far (the initial
    ones included) and the number of checks since the last improvement; writes into the :class:`DistillResult`."""

    def __init__(self, student, val, val_q, sizes, temperature, res):
        self.student, self.val, self.val_q, self.sizes, self.T, self.res = student, val, val_q, sizes, temperature, res
        self.best = self.loss()
        res.initial_val_loss = res.best_val_loss = self.best
        if self.best is not None:
            res.val_loss.append((0, self.best))
        self.state = copy.deepcopy(student.state_dict())
        self.bad = 0

    def loss(self) -> float | None:
        if self.val_q is None:
            return None
        self.student.eval()
        with torch.no_grad():
            return float(sum(distillation_loss(self.student(self.val[s]), self.val_q, self.T)
                             for s in self.sizes) / len(self.sizes))

    def check(self, step: int) -> float | None:
        v = self.loss()
        if v is None:  # nothing held aside: keep the last weights
            self.state, self.res.best_step = copy.deepcopy(self.student.state_dict()), step
            return None
        self.res.val_loss.append((step, v))
        if v < self.best:
            self.best, self.bad, self.res.best_step, self.res.best_val_loss = v, 0, step, v
            self.state = copy.deepcopy(self.student.state_dict())
        else:
            self.bad += 1
        return v


def _step_loss(student, x, q, temperature: float, feat, targets, idx) -> tuple[torch.Tensor, float | None]:
    """One batch's loss, one student pass: ``KD`` alone when ``feat`` is None (L_SP's value None), else
    ``KD + feat.weight * L_SP`` (``targets`` a :class:`~hfl_components.fusion.feature_distill.FeatureTargets`) and
    L_SP's value."""
    if feat is None:
        return distillation_loss(student(x), q, temperature), None
    from hfl_components.fusion.feature_distill import model_layers

    weight = feat.weight
    layers, logits = model_layers(student, x, targets.student_keys)
    sp = targets.loss(layers, idx)
    return distillation_loss(logits, q, temperature) + float(weight) * sp, float(sp.detach())


def _check_extras(cfg: DistillConfig, n: int, targets, features) -> "FeatureDistill | None":
    """Check :func:`distill`'s optional inputs for ``n`` probe images; return the feature term when it is on, else
    None. Raises ValueError: given targets not (n, C) or with augment on; a bad ``features`` or one with augment."""
    augmented = bool(cfg.augment) and int(cfg.augment_copies) > 0
    if targets is not None and (targets.ndim != 2 or targets.shape[0] != n or augmented):
        raise ValueError(f"given distillation targets must be ({n}, C) for the {n} images and need augment off, got "
                         f"shape {tuple(targets.shape)} with augment {cfg.augment}")
    feat = None if features is None else features.check()
    feat = feat if feat is not None and feat.on else None
    if feat is not None and augmented:
        raise ValueError("feature distillation caches the teachers' layers of the original probe images; turn "
                         "augment off")
    return feat


def _feature_targets(student, teachers, feat: "FeatureDistill", images, sizes, train_idx, weights, dev,
                     res: DistillResult):
    """The teachers' cached layers for the feature term of :func:`distill` (each at its own input size, the
    training images only), with the plan recorded in ``res.feature``."""
    from hfl_components.fusion.feature_distill import FeatureTargets, layer_plan

    plan = layer_plan(student, teachers, feat.layer, images, student_size=sizes[-1], device=dev)
    f_targets = FeatureTargets(teachers, plan, {int(t.input_size): images[int(t.input_size)][train_idx]
                                                for t in teachers}, weights, dev)
    res.feature = {"weight": float(feat.weight), "layer": feat.layer,
                   "plan": {str(j): [[teachers[k].name, str(key)] for k, key in rows]
                            for j, rows in plan["student"].items()},
                   "how": {t.name: h for t, h in zip(teachers, plan["how"])},
                   "teacher_dims": f_targets.dims(), "train_loss": []}
    return f_targets


def distill(student: nn.Module, student_sizes, teachers, images: dict[int, torch.Tensor], weights=None,
            config: DistillConfig | None = None, device=None, log=None, targets: torch.Tensor | None = None,
            features: FeatureDistill | None = None) -> DistillResult:
    """Train ``student`` (in place) to match the teachers' ensemble on unlabelled images (FedDF, Lin et al. 2020,
    Algorithm 1, server part; soft targets of Hinton et al. 2015).

    The probe is split into training images and a held-aside slice (:func:`split_probe`). With ``augment`` every
    training image gets ``augment_copies`` augmented views (the sites' augmentation, the same parameters at every
    size, :func:`augment_all_sizes`) beside the original. The ensemble targets ``q = sum_k w_k softmax(f_k(x at
    S_k) / T)`` -- each teacher at its own input size S_k -- are computed once for every image and view (so a
    step costs one student pass, not K teacher passes). Step t takes one SGD step on ``T^2 KL(q || softmax(g(x at
    s_t) / T))`` over a batch, where s_t cycles through the student's sizes. Every ``eval_every`` steps the mean of
    the same loss over the held-aside images at every student size is checked; the best weights so far (the
    initial student included) are kept and the loop stops after ``patience`` checks without improvement. The
    returned student therefore never has a higher held-aside loss than the one it started from.

    With ``features`` on (weight > 0) each step's loss is ``KD + weight * L_SP``: L_SP (Tung & Mori 2019,
    :func:`~hfl_components.fusion.feature_distill.similarity_loss`) compares the student's row-normalised Gram of
    each planned layer on the batch with the teachers' weighted average of theirs (the logit ensemble's
    ``weights``; which layers: ``features.layer``, :func:`~hfl_components.fusion.feature_distill.layer_plan`,
    with ``aligned`` pairs found at the student's largest size). Each teacher's layers are computed once for every
    training image at its own input size (:class:`~hfl_components.fusion.feature_distill.FeatureTargets`); a step
    slices the batch's rows. The held-aside check, and so early stopping and the returned weights, still judge the
    logit loss alone.

    Args:
        student: the model trained in place (its weights at the end are the best checked ones).
        student_sizes: input sizes the student serves (its sites' sizes), each a key of ``images``.
        teachers: sequence of :class:`Teacher` (eval mode is set here); their sizes must be keys of ``images``.
        images: {S: float tensor (N, C, S, S)}, the same N unlabelled images at every size (no labels).
        weights: (K,) teacher weights (:func:`teacher_weights`); None = equal.
        config: :class:`DistillConfig` (required: its ``steps`` has no default here).
        device: where the passes run (``torch.device`` or name; None: CPU).
        log: optional callable for progress lines.
        targets: None (the teachers' weighted ensemble labels the images), or (N, C) soft targets of the N images
            at the config's temperature, given by the caller (e.g. a learned teacher,
            :func:`hfl_components.fusion.stacking.stacked_targets`); the teachers then label nothing, and
            ``augment`` is refused (augmented views have no given targets).
        features: None (or weight 0): logits only. :class:`FeatureDistill`: the feature term above; ``augment`` is
            refused with it (the teachers' layers are cached for the original images only).

    Returns:
        :class:`DistillResult` (the student is modified in place and left in eval mode on ``device``).

    Raises:
        ValueError: no config, no teachers, sizes without images, images of different counts, bad config, given
        targets whose shape is not (N, C) or together with ``augment``; a bad ``features`` (its check), features
        with ``augment``, or a student / teacher without ``features(x)`` and ``head(z)``.
    """
    if config is None:
        raise ValueError("distill needs a DistillConfig with its step budget (the main job's: the catalogue "
                         "option 'distill_steps')")
    cfg = config.check()
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    teachers = list(teachers)
    sizes, need, n = _check_inputs(student_sizes, teachers, images)
    feat = _check_extras(cfg, n, targets, features)
    train_idx, val_idx = split_probe(n, float(cfg.val_fraction), cfg.seed)
    res = DistillResult(n_train=int(train_idx.numel()), n_val=int(val_idx.numel()), sizes=sizes,
                        config=asdict(cfg))
    student.to(dev)
    if int(cfg.steps) == 0:  # fusion alone: nothing to label or train
        student.eval()
        res.seconds = time.perf_counter() - t0
        return res
    T = float(cfg.temperature)
    g = torch.Generator().manual_seed(int(cfg.seed) + 1)
    train, train_q, val, val_q = _labelled_pool(teachers, weights, images, need, sizes, train_idx, val_idx, cfg, g,
                                                dev, targets)

    f_targets = None if feat is None else _feature_targets(student, teachers, feat, images, sizes, train_idx,
                                                           weights, dev, res)
    _channels_last(student)  # the same function, faster CPU passes; the caller's layout is restored at the end
    keeper = _BestKeeper(student, val, val_q, sizes, T, res)
    opt = torch.optim.SGD(student.parameters(), lr=float(cfg.lr), momentum=float(cfg.momentum),
                          weight_decay=float(cfg.weight_decay))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(cfg.steps))
    batches = _batches(train_q.shape[0], int(cfg.batch_size), g)
    res.stopped = "budget"
    for step in range(1, int(cfg.steps) + 1):
        idx = next(batches).to(train_q.device)
        s = sizes[(step - 1) % len(sizes)]
        student.train()
        loss, f_loss = _step_loss(student, train[s][idx], train_q[idx], T, feat, f_targets, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        res.steps_run = step
        timed_out = cfg.max_seconds is not None and time.perf_counter() - t0 > float(cfg.max_seconds)
        if step % int(cfg.eval_every) == 0 or step == int(cfg.steps) or timed_out:
            v = keeper.check(step)
            if feat is not None:
                res.feature["train_loss"].append((step, f_loss))
            if log:
                log(f"distillation step {step}/{cfg.steps}: train loss {loss.item():.4f}" + (
                    "" if v is None else f", held-aside loss {v:.4f} (best {keeper.best:.4f} at step {res.best_step})"))
            if cfg.patience and keeper.bad >= int(cfg.patience):
                res.stopped = "early"
                break
        if timed_out:
            res.stopped = "time"
            break
    student.load_state_dict(keeper.state)
    student.to(memory_format=torch.contiguous_format)
    student.eval()
    res.seconds = time.perf_counter() - t0
    return res
