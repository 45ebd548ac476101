"""Fusable CNN families for OHFL (depth- and width-varying, BatchNorm-free).

Architecture (OHFL paper, Sec. 4.3): Conv2d 3x3 (padding 1) + ReLU layers grouped in
stages, each stage closed by a 2x2 max-pool; an adaptive average pool; Linear + ReLU hidden layers; a class layer.
All depths of a family share the same stages, so an extra conv sits inside a stage and the identity-layer
balancing of OHFL Sec. 3.2 is exact.

Every hidden layer and the class layer is exposed through :meth:`FusableNet.layers` as an ordered list of
:class:`LayerInfo`, so fusion code walks a model without knowing its class. Pre-activations (the conv/linear
outputs before ReLU) are the outputs of the ``module`` of each entry, which is what OHFL's CKA compares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# Channel / unit counts at width 1.0.
FAMILIES: dict[str, dict] = {
    "cnn": {
        "pool": 4,
        "depths": {
            "shallow": {"stages": [[8], [16], [32]], "hidden": [1000, 500]},
            "medium": {"stages": [[8], [16], [32, 32]], "hidden": [1000, 500, 500]},
            "deep": {"stages": [[8], [16, 16], [32, 32]], "hidden": [1000, 500, 500, 250]},
        },
    },
    "vgg11": {
        "pool": 1,
        "depths": {
            "shallow": {"stages": [[64], [128], [256], [512], [512]], "hidden": [512]},
            "medium": {"stages": [[64], [128], [256, 256], [512, 512], [512, 512]], "hidden": [512, 512]},
            "deep": {"stages": [[64, 64], [128, 128], [256, 256], [512, 512], [512, 512]], "hidden": [512, 512, 512]},
        },
    },
}
DEPTH_ORDER = {"shallow": 0, "medium": 1, "deep": 2}
SPEC_KEYS = {"family", "depth", "width", "in_channels", "num_classes", "stages", "hidden", "pool", "frame_mask",
             "frame_rescale"}


@dataclass
class LayerInfo:
    """One weight layer of a fusable model.

    Attributes:
        name: state-dict prefix of the module (e.g. ``"convs.2"``, ``"fcs.0"``, ``"classifier"``).
        kind: ``"conv"`` or ``"fc"``.
        stage: conv stage index (0-based) for conv layers; ``-1`` for fc layers.
        module: the ``nn.Conv2d`` / ``nn.Linear`` whose output is the pre-activation.
        is_output: True only for the class layer (no ReLU after it; OT uses the identity plan there).
    """

    name: str
    kind: str
    stage: int
    module: nn.Module
    is_output: bool = False


def _scale(n: int, width: float) -> int:
    return max(1, int(round(n * width)))


def resolve_fusable_spec(spec: dict) -> dict:
    """Return the explicit architecture of a fusable spec.

    Args:
        spec: ``{"family": "cnn"|"vgg11", "depth": "shallow"|"medium"|"deep", "width": float,
            "in_channels": int, "num_classes": int}``; optionally explicit ``"stages"`` (list of lists of
            channel counts, already width-scaled) and ``"hidden"`` (list of unit counts), which override depth/width.

    Returns:
        dict with ``stages``, ``hidden``, ``pool``, ``in_channels``, ``num_classes``.

    Raises:
        ValueError: unknown family/depth, non-positive width or sizes.
    """
    family = spec.get("family")
    if family not in FAMILIES:
        raise ValueError(f"unknown fusable family {family!r}; known: {sorted(FAMILIES)}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:  # a typo such as 'depht' must not silently build the default depth
        raise ValueError(f"unknown key(s) {unknown} in {family!r} model spec; allowed: {sorted(SPEC_KEYS)}")
    fam = FAMILIES[family]
    width = float(spec.get("width", 1.0))
    if not (width > 0 and math.isfinite(width)):
        raise ValueError(f"model spec width must be > 0, got {spec.get('width')!r}")
    if "stages" in spec or "hidden" in spec:
        stages = [list(map(int, s)) for s in spec["stages"]]
        hidden = list(map(int, spec["hidden"]))
    else:
        depth = spec.get("depth", "shallow")
        if depth not in fam["depths"]:
            raise ValueError(f"unknown depth {depth!r} for family {family!r}; known: {sorted(fam['depths'])}")
        d = fam["depths"][depth]
        stages = [[_scale(c, width) for c in s] for s in d["stages"]]
        hidden = [_scale(h, width) for h in d["hidden"]]
    if not stages or any(len(s) == 0 for s in stages) or any(c <= 0 for s in stages for c in s):
        raise ValueError(f"invalid conv stages {stages!r}")
    if any(h <= 0 for h in hidden):
        raise ValueError(f"invalid hidden sizes {hidden!r}")
    in_ch = int(spec.get("in_channels", 1))
    n_cls = int(spec.get("num_classes", 2))
    if in_ch <= 0 or n_cls < 2:
        raise ValueError(f"in_channels must be >= 1 and num_classes >= 2, got {in_ch}, {n_cls}")
    out = {
        "stages": stages,
        "hidden": hidden,
        "pool": int(spec.get("pool", fam["pool"])),
        "in_channels": in_ch,
        "num_classes": n_cls,
    }
    mask = spec.get("frame_mask", 0.0)
    if isinstance(mask, bool) or not isinstance(mask, (int, float)) or not 0 <= float(mask) < 0.5:
        raise ValueError(f"model spec frame_mask must be a share of the side in [0, 0.5), got {mask!r}")
    if float(mask) > 0:  # absent (0) for every model without a mask, so their resolved specs are unchanged
        out["frame_mask"] = float(mask)
    rescale = spec.get("frame_rescale", False)
    if not isinstance(rescale, bool) or (rescale and not float(mask) > 0):
        raise ValueError(f"model spec frame_rescale must be true or false, and true only with a frame_mask > 0, got "
                         f"{rescale!r} with frame_mask {mask!r}")
    if rescale:
        out["frame_rescale"] = True
    return out


def frame_mask_width(side: int, fraction: float) -> int:
    """Pixels of a side of ``side`` px that a frame mask of ``fraction`` covers: ceil(fraction x side), so that a
    band of ``fraction`` of the side, rounded either way, lies inside the mask."""
    return int(math.ceil(float(fraction) * int(side) - 1e-9)) if fraction > 0 else 0


def apply_frame_mask(x: torch.Tensor, fraction: float, value: float, rescale: bool = False) -> torch.Tensor:
    """(..., H, W) -> the same with the outer :func:`frame_mask_width` rows and columns of each side set to the
    constant ``value``: whatever a file's frame holds there never reaches the network. With ``rescale`` the inner
    region is first min-max scaled to [0, 1] per image and channel by its own extremes (a constant inner region
    becomes 0), so a frame cannot reach the network through the whole-image intensity scaling either (a bright
    frame sets the image's maximum and darkens the film under a whole-image min-max). Not in place."""
    if fraction <= 0:
        return x
    h, w = x.shape[-2:]
    th, tw = frame_mask_width(h, fraction), frame_mask_width(w, fraction)
    inner = x[..., th:h - th, tw:w - tw]
    if rescale:
        lo = inner.amin(dim=(-2, -1), keepdim=True)
        span = inner.amax(dim=(-2, -1), keepdim=True) - lo
        inner = (inner - lo) / torch.where(span > 0, span, torch.ones_like(span))
    out = torch.full_like(x, float(value))
    out[..., th:h - th, tw:w - tw] = inner
    return out


class FusableNet(nn.Module):
    """Conv stages + adaptive pool + fc layers, BatchNorm-free (OHFL Sec. 4.3 CNN / VGG).

    Input (B, in_channels, H, W) with H, W >= 2**n_stages; output logits (B, num_classes).
    State-dict keys: ``convs.<i>.weight/bias`` (global conv index i), ``fcs.<j>.weight/bias``,
    ``classifier.weight/bias``.

    ``frame_mask`` (spec key, share of each side in [0, 0.5); default 0 = none): the outer
    :func:`frame_mask_width` pixels of every side of the input are set to :attr:`INPUT_MEAN` (0 after the input
    standardisation, as the convolutions' zero padding) before the first layer, in training and at inference
    alike, so a frame of up to that share of the side in the image cannot move the output. No weights; the state
    dict is the same as without it. ``frame_rescale`` (spec key, only with a mask): the inner region is min-max
    scaled by its own extremes first (:func:`apply_frame_mask`).
    """

    def __init__(self, stages, hidden, pool, in_channels, num_classes, frame_mask: float = 0.0,
                 frame_rescale: bool = False):
        super().__init__()
        self.frame_mask, self.frame_rescale = float(frame_mask), bool(frame_rescale)
        self.stages = [list(s) for s in stages]
        self.hidden = list(hidden)
        self.pool = int(pool)
        self.convs = nn.ModuleList()
        self.conv_stage: list[int] = []
        c_in = in_channels
        for si, stage in enumerate(self.stages):
            for c in stage:
                self.convs.append(nn.Conv2d(c_in, c, kernel_size=3, padding=1))
                self.conv_stage.append(si)
                c_in = c
        self.avgpool = nn.AdaptiveAvgPool2d(self.pool)
        self.fcs = nn.ModuleList()
        f_in = c_in * self.pool * self.pool
        for h in self.hidden:
            self.fcs.append(nn.Linear(f_in, h))
            f_in = h
        self.classifier = nn.Linear(f_in, num_classes)
        self.feature_dim = f_in
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He (Kaiming) normal initialisation for every hidden conv/linear weight, zero biases, zero class layer.

        Without BatchNorm, PyTorch's default uniform init leaves these ReLU stacks near-constant for the first
        SGD steps; He init (He et al. 2015, arXiv:1502.01852) keeps the activations' scale through the depth. A
        zero class layer starts every model at loss log(C) instead of large random logits. Fusion does not depend
        on the initialisation. The observations behind this default: docs/decisions.md ("Fusable models' init").
        """
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.classifier.weight)

    # Fixed input standardisation: images arrive in [0, 1] (chest_xray transforms); centring them helps these
    # BatchNorm-free stacks train. A constant, identical for every model, so fusion is unaffected.
    INPUT_MEAN = 0.5
    INPUT_STD = 0.25

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images in [0, 1] -> (B, d) post-ReLU activations of the last hidden fc layer."""
        x = apply_frame_mask(x, self.frame_mask, self.INPUT_MEAN, self.frame_rescale)
        x = (x - self.INPUT_MEAN) / self.INPUT_STD
        i = 0
        for stage in self.stages:
            for _ in stage:
                x = torch.relu(self.convs[i](x))
                i += 1
            x = nn.functional.max_pool2d(x, 2)
        x = torch.flatten(self.avgpool(x), 1)
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return x

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, num_classes) logits."""
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def layers(self) -> list[LayerInfo]:
        """Ordered weight layers: convs (with stage index), hidden fcs, then the class layer."""
        out = [LayerInfo(f"convs.{i}", "conv", s, m) for i, (m, s) in enumerate(zip(self.convs, self.conv_stage))]
        out += [LayerInfo(f"fcs.{j}", "fc", -1, m) for j, m in enumerate(self.fcs)]
        out.append(LayerInfo("classifier", "fc", -1, self.classifier, is_output=True))
        return out


def build_fusable(spec: dict) -> FusableNet:
    """Build a :class:`FusableNet` from a JSON-able spec (see :func:`resolve_fusable_spec`)."""
    r = resolve_fusable_spec(spec)
    return FusableNet(r["stages"], r["hidden"], r["pool"], r["in_channels"], r["num_classes"],
                      frame_mask=r.get("frame_mask", 0.0), frame_rescale=r.get("frame_rescale", False))


def explicit_spec(spec: dict, stages=None, hidden=None) -> dict:
    """Spec with explicit ``stages``/``hidden`` (e.g. after identity insertion changes the depth)."""
    r = resolve_fusable_spec(spec)
    out = {k: v for k, v in spec.items() if k not in ("depth", "width")}
    out.update({"family": spec["family"], "in_channels": r["in_channels"], "num_classes": r["num_classes"],
                "stages": stages if stages is not None else r["stages"],
                "hidden": hidden if hidden is not None else r["hidden"]})
    return out


def shared_init_state(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    """A site's starting weights under a *shared* initialisation (the server hands every site one seed).

    Every site builds the same reference model, its spec's family and depth at width ``max(1, width)``, from
    ``torch.manual_seed(seed)`` (He-normal hidden weights, zero biases, zero class layer, as
    :meth:`FusableNet.reset_parameters`), and takes the leading slice of every tensor for its own width ("nested"
    initialisation: a half-width site starts as the first half of the channels of the full-width one). A sliced
    hidden weight is multiplied by sqrt(fan_in_ref / fan_in_own) so its He standard deviation stays right. Two
    sites with the same spec therefore start from identical weights; sites of different widths start nested. Specs
    with explicit ``stages``/``hidden`` use themselves as the reference.

    Args:
        spec: fusable spec (see :func:`resolve_fusable_spec`).
        seed: the job's shared initialisation seed.

    Returns:
        a state dict for ``build_fusable(spec)`` (float32).
    """
    ref_spec = dict(spec)
    if "stages" not in spec and "hidden" not in spec:
        ref_spec["width"] = max(1.0, float(spec.get("width", 1.0)))
    g = torch.get_rng_state()
    try:
        torch.manual_seed(int(seed))
        ref = build_fusable(ref_spec).state_dict()
    finally:
        torch.set_rng_state(g)
    own = build_fusable(spec).state_dict()
    out = {}
    for k, v in own.items():
        r = ref[k]
        if r.dim() > 1:
            # slice (out, in[, kh, kw]); at the conv -> fc boundary the inputs are channel-major blocks of pool^2
            if k.startswith("fcs.0.") or (k.startswith("classifier.") and not any(x.startswith("fcs.") for x in ref)):
                pool2 = resolve_fusable_spec(spec)["pool"] ** 2
                c_ref, c_own = r.shape[1] // pool2, v.shape[1] // pool2
                r = r.reshape(r.shape[0], c_ref, pool2)[:, :c_own].reshape(r.shape[0], -1)
            else:
                r = r[:, :v.shape[1]]
            r = r[:v.shape[0]]
            fan_ref = ref[k][0].numel()
            fan_own = r[0].numel()
            r = r * (fan_ref / fan_own) ** 0.5
        else:
            r = r[:v.shape[0]]
        out[k] = r.clone().to(torch.float32)
    return out
