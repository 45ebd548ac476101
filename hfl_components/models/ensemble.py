"""The FENS-style deployed model: frozen site models and a small aggregator over their outputs, one ``nn.Module``.

FENS (Allouah et al., "Revisiting Ensembling in One-Shot Federated Learning", NeurIPS 2024, arXiv:2411.07182):
every site trains its own model and uploads it once; every site then receives every site's model and the sites
train a lightweight *prediction aggregator* over the frozen models' outputs by federated averaging. The model a site
deploys is the frozen models plus the aggregator; this module builds it from a plain spec (family ``fens``), so it
is saved, loaded, evaluated and served like any other model file (``hfl_components.models.files``).

Spec::

    {"family": "fens", "num_classes": C, "in_channels": 1,
     "members": [<member spec>, ...],        # M >= 1 specs of any other registry family, each with C classes
     "member_sizes": [S_1, ..., S_M] | null, # input side each member was trained at (null: take any size)
     "aggregator": "mlp" | "linear",          # FENS's shallow network (one hidden ReLU layer) or a linear map
     "hidden": H,                              # hidden units of the mlp aggregator (default 32)
     "residual": true | false}                 # add the members' averaged probabilities' log (see below)

Aggregator input: each member's class log-probabilities ``log softmax(member(x))``, stacked ``(B, M, C)`` and
flattened to ``(B, M*C)`` (the concatenated outputs FENS feeds its aggregator). ``residual`` (not in FENS) adds
``log mean_m softmax(member_m(x))`` -- the site ensemble's averaged-probability prediction -- to the aggregator's
output, whose last layer starts at zero, so an untrained aggregator *is* the averaged ensemble and training moves
it from there. A member sees every image at its own ``member_sizes`` entry (bilinear resize with antialiasing of the
input), as the site ensemble reference scores each upload at its own input size; the ensemble's ``input_size`` is
its largest member's, the size a site feeds it (``SiteRuntime.input_size``) and its model file records.

Members are frozen: their parameters do not require gradients and ``train()`` keeps them in eval mode.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

AGGREGATORS = ("mlp", "linear")
DEFAULT_HIDDEN = 32
_KEYS = {"family", "num_classes", "in_channels", "members", "member_sizes", "aggregator", "hidden", "residual"}


def resolve_ensemble_spec(spec: dict, resolve_member: Callable[[dict], dict]) -> dict:
    """A copy of a ``fens`` spec with every default filled in.

    Args:
        spec: see the module docstring.
        resolve_member: the registry's ``resolve_spec`` (fills in and checks a member's spec).

    Returns:
        the spec with ``num_classes`` (default: the members'), ``in_channels`` 1, ``member_sizes`` None,
        ``aggregator`` ``mlp``, ``hidden`` :data:`DEFAULT_HIDDEN` and ``residual`` True filled in; members as
        given (their own defaults are not written in, so the spec stays what the site sent).

    Raises:
        ValueError: unknown keys; no members; a member of family ``fens``; a bad member spec; members whose class
        counts differ from each other or from ``num_classes``; ``member_sizes`` not one positive int per member;
        an unknown aggregator; ``hidden < 1``.
    """
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in 'fens' model spec; allowed: {sorted(_KEYS)}")
    members = spec.get("members")
    if not isinstance(members, list) or not members:
        raise ValueError("a 'fens' model spec needs a non-empty list 'members' of site model specs")
    classes = set()
    for i, m in enumerate(members):
        if not isinstance(m, dict) or m.get("family") == "fens":
            raise ValueError(f"'fens' member {i}: must be the spec of a site model (not another ensemble)")
        classes.add(int(resolve_member(m)["num_classes"]))
    out = copy.deepcopy(spec)
    out.setdefault("num_classes", min(classes))
    if classes != {int(out["num_classes"])}:
        raise ValueError(f"'fens' members have {sorted(classes)} classes; every member needs num_classes "
                         f"{out['num_classes']}")
    out.setdefault("in_channels", 1)
    sizes = out.setdefault("member_sizes", None)
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(members)
                              or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)):
        raise ValueError(f"'fens' member_sizes must be null or one positive integer per member "
                         f"({len(members)}), got {sizes!r}")
    if out.setdefault("aggregator", "mlp") not in AGGREGATORS:
        raise ValueError(f"'fens' aggregator must be one of {AGGREGATORS}, got {out['aggregator']!r}")
    out.setdefault("hidden", DEFAULT_HIDDEN)
    if isinstance(out["hidden"], bool) or not isinstance(out["hidden"], int) or out["hidden"] < 1:
        raise ValueError(f"'fens' hidden must be a positive integer, got {out['hidden']!r}")
    out["residual"] = bool(out.setdefault("residual", True))
    return out


class Aggregator(nn.Module):
    """FENS's prediction aggregator over M members' class log-probabilities.

    Args:
        n_members: M; num_classes: C.
        kind: ``mlp`` (Linear(M*C, H) -> ReLU -> Linear(H, C), FENS's shallow network) or ``linear``
            (Linear(M*C, C)).
        hidden: H (``mlp`` only).
        residual: add ``log mean_m exp(z_m)`` (the averaged-probability ensemble) to the output; the last layer is
            then initialised to zero, so the untrained aggregator equals that ensemble.

    Shapes: ``forward(z)``: z (B, M, C) log-probabilities -> (B, C) logits.
    """

    def __init__(self, n_members: int, num_classes: int, kind: str = "mlp", hidden: int = DEFAULT_HIDDEN,
                 residual: bool = True):
        super().__init__()
        if kind not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {kind!r}")
        self.n_members, self.num_classes, self.residual = int(n_members), int(num_classes), bool(residual)
        d = self.n_members * self.num_classes
        layers = [nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)] if kind == "mlp" else \
            [nn.Linear(d, num_classes)]
        self.net = nn.Sequential(*layers)
        if self.residual:
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() != 3 or z.shape[1:] != (self.n_members, self.num_classes):
            raise ValueError(f"aggregator input must be (B, {self.n_members}, {self.num_classes}) log-probabilities,"
                             f" got {tuple(z.shape)}")
        out = self.net(z.reshape(z.shape[0], -1))
        if self.residual:
            out = out + torch.logsumexp(z, dim=1) - math.log(self.n_members)
        return out


class EnsembleNet(nn.Module):
    """Frozen members + :class:`Aggregator` (the module docstring).

    Shapes: ``member_outputs(x)`` = ``features(x)``: x (B, in_channels, S, S) -> (B, M, C) log-probabilities;
    ``head(z)``: (B, M, C) -> (B, C) logits; ``forward(x) = head(features(x))``.
    """

    def __init__(self, members: list[nn.Module], member_sizes: list[int] | None, aggregator: Aggregator):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.member_sizes = None if member_sizes is None else [int(s) for s in member_sizes]
        self.aggregator = aggregator
        for p in self.members.parameters():
            p.requires_grad_(False)
        self.members.eval()

    @property
    def input_size(self) -> int | None:
        """The side to feed the ensemble: its largest member's size (smaller members get a downsampled image, with
        antialiasing, none an upsampled one); None without ``member_sizes``."""
        return max(self.member_sizes) if self.member_sizes else None

    def train(self, mode: bool = True):
        super().train(mode)
        self.members.eval()  # frozen: BatchNorm statistics and dropout stay as the sites trained them
        return self

    def member_outputs(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, m in enumerate(self.members):
            s = None if self.member_sizes is None else self.member_sizes[i]
            xi = x if s is None or tuple(x.shape[-2:]) == (s, s) else F.interpolate(
                x, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
            outs.append(F.log_softmax(m(xi).float(), dim=1))
        return torch.stack(outs, dim=1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, M, C) members' log-probabilities (the registry's ``features``/``head`` split, which
        ``hfl_components.training.predict_proba`` / ``extract_features`` use)."""
        return self.member_outputs(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """(B, M, C) -> (B, C) logits: the aggregator."""
        return self.aggregator(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.aggregator(self.member_outputs(x))


def build_ensemble(spec: dict, build_member: Callable[[dict], nn.Module],
                   resolve_member: Callable[[dict], dict]) -> EnsembleNet:
    """Build a ``fens`` spec (members freshly initialised; load a state dict for trained weights).

    State-dict names: ``members.<i>.<member key>`` and ``aggregator.net.<layer>.<weight|bias>``.

    Raises:
        ValueError: as :func:`resolve_ensemble_spec`.
    """
    s = resolve_ensemble_spec(spec, resolve_member)
    agg = Aggregator(len(s["members"]), s["num_classes"], s["aggregator"], s["hidden"], s["residual"])
    return EnsembleNet([build_member(m) for m in s["members"]], s["member_sizes"], agg)


def ensemble_spec(member_specs: list[dict], member_sizes: list[int] | None, num_classes: int,
                  aggregator: str = "mlp", hidden: int = DEFAULT_HIDDEN, residual: bool = True,
                  in_channels: int = 1) -> dict:
    """The ``fens`` spec of M members (copies), in the order given."""
    return {"family": "fens", "num_classes": int(num_classes), "in_channels": int(in_channels),
            "members": [dict(m) for m in member_specs],
            "member_sizes": None if member_sizes is None else [int(s) for s in member_sizes],
            "aggregator": aggregator, "hidden": int(hidden), "residual": bool(residual)}
