"""Heterogeneous backbone pool for the prototype methods (FedSAF, FedTopo).

Every model here is a :class:`HeteroNet`: a backbone, a projection to a feature space shared by all sites, and a
linear class layer::

    x (B, in_channels, H, W) -> backbone -> (B, c, h, w) -> adaptive avg pool -> (B, c)
                              -> proj: Linear(c, d) -> ReLU -> z (B, d)            = features(x)
    z (B, d) -> classifier: Linear(d, num_classes) -> logits (B, num_classes)      = head(z)

Design choice: ``features`` ends with a ReLU (``"feature_act": "relu"``, the default), so ``z`` is a post-activation
vector like :meth:`hfl_components.models.fusable.FusableNet.features`, and every family's head is one linear layer
on non-negative features. Set ``"feature_act": "none"`` in the spec for a linear (signed) embedding.

Families (all 2-D, any input size >= 32 px works; sized to train at 64-128 px on 2 CPU cores):

- ``hetero_cnn``: the fusable ``cnn`` (or ``vgg11``) trunk (convs + hidden fcs, same ``depth``/``width``/
  ``stages``/``hidden`` keys as :func:`~hfl_components.models.fusable.resolve_fusable_spec`) followed by the
  projection to ``feature_dim``. This is how the cnn family serves in the heterogeneous pool: cnn depths end in
  500 or 250 hidden units, the projection brings them all to ``d``. The fusable ``cnn`` family itself is unchanged.
- ``densenet``: narrow :class:`monai.networks.nets.DenseNet` (Huang et al., CVPR 2017) ``features`` + final ReLU.
- ``resnet``: narrow :class:`monai.networks.nets.ResNet` (He et al., CVPR 2016), basic blocks, ``feed_forward=False``.
- ``efficientnet``: small :class:`monai.networks.nets.EfficientNet` (Tan & Le, ICML 2019) from explicit MBConv block
  strings, randomly initialised (never downloads weights).

Spec keys common to all families: ``family``, ``in_channels`` (default 1), ``num_classes`` (default 2),
``feature_dim`` (default 64), ``feature_act`` (``"relu"`` | ``"none"``), ``input_size`` (int, informational; the
efficientnet "same" padding is computed for it, default 128); efficientnet also takes ``bn_momentum`` (PyTorch
convention; MONAI's default is 0.01). Family keys and defaults are in :data:`HETERO_DEFAULTS`.
Unknown keys raise ``ValueError`` so typos in a site config fail loudly.

State-dict keys: ``backbone.*``, ``proj.weight/bias``, ``classifier.weight/bias``.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from hfl_components.models.fusable import FAMILIES as FUSABLE_FAMILIES
from hfl_components.models.fusable import FusableNet, resolve_fusable_spec

COMMON_KEYS = {"family", "in_channels", "num_classes", "feature_dim", "feature_act", "input_size"}

# Family -> default constructor settings (every key may be overridden in the spec; lists, not tuples, so specs
# stay JSON round-trippable).
HETERO_DEFAULTS: dict[str, dict] = {
    "hetero_cnn": {"base_family": "cnn", "depth": "shallow", "width": 1.0},
    "densenet": {"init_features": 16, "growth_rate": 8, "block_config": [2, 4, 6, 4], "bn_size": 4},
    "resnet": {"layers": [1, 1, 1, 1], "block_inplanes": [16, 32, 64, 128], "conv1_kernel": 7, "conv1_stride": 2,
               "no_max_pool": False},
    "efficientnet": {
        "blocks": [
            "r1_k3_s11_e1_i32_o16_se0.25",
            "r1_k3_s22_e6_i16_o24_se0.25",
            "r2_k5_s22_e6_i24_o40_se0.25",
            "r2_k3_s22_e6_i40_o80_se0.25",
        ],
        "width_coefficient": 0.5,
        "depth_coefficient": 1.0,
    },
}
# Extra keys a family accepts beyond its defaults.
_EXTRA_KEYS = {"hetero_cnn": {"stages", "hidden", "pool"}, "efficientnet": {"bn_momentum"}}

DEFAULT_FEATURE_DIM = 64


def resolve_hetero_spec(spec: dict) -> dict:
    """Return a copy of a heterogeneous spec with every default filled in (what is actually built).

    Args:
        spec: ``{"family": one of HETERO_DEFAULTS, "in_channels": int, "num_classes": int, "feature_dim": int, ...}``.

    Returns:
        dict with all common keys and the family's keys (defaults from :data:`HETERO_DEFAULTS`).

    Raises:
        ValueError: unknown family, unknown keys, ``feature_dim < 1``, ``in_channels < 1``, ``num_classes < 2``,
            ``feature_act`` not ``"relu"``/``"none"``.
    """
    family = spec.get("family")
    if family not in HETERO_DEFAULTS:
        raise ValueError(f"unknown heterogeneous family {family!r}; known: {sorted(HETERO_DEFAULTS)}")
    allowed = COMMON_KEYS | set(HETERO_DEFAULTS[family]) | _EXTRA_KEYS.get(family, set())
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {family!r} model spec; allowed: {sorted(allowed)}")
    out = copy.deepcopy(HETERO_DEFAULTS[family])
    out.update(copy.deepcopy(spec))
    out.setdefault("in_channels", 1)
    out.setdefault("num_classes", 2)
    out.setdefault("feature_dim", DEFAULT_FEATURE_DIM)
    out.setdefault("feature_act", "relu")
    out.setdefault("input_size", 128)
    for key, low in (("in_channels", 1), ("num_classes", 2), ("feature_dim", 1), ("input_size", 8)):
        try:
            out[key] = int(out[key])
        except (TypeError, ValueError):
            raise ValueError(f"model spec {key} must be an integer, got {spec.get(key)!r}") from None
        if out[key] < low:
            raise ValueError(f"model spec {key} must be >= {low}, got {out[key]}")
    if out["feature_act"] not in ("relu", "none"):
        raise ValueError(f"model spec feature_act must be 'relu' or 'none', got {out['feature_act']!r}")
    return out


class HeteroNet(nn.Module):
    """Backbone + adaptive average pool + projection to ``feature_dim`` + linear class layer.

    Args:
        backbone: module mapping (B, in_channels, H, W) to a feature map (B, c, h, w) or a vector (B, c).
        backbone_dim: ``c``, the backbone's output channels / width.
        feature_dim: ``d``, the common feature dimension shared across sites.
        num_classes: number of classes ``C``.
        feature_act: ``"relu"`` (default) to end ``features`` with a ReLU, ``"none"`` for a linear embedding.
    """

    def __init__(self, backbone: nn.Module, backbone_dim: int, feature_dim: int, num_classes: int,
                 feature_act: str = "relu"):
        super().__init__()
        self.backbone = backbone
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Linear(backbone_dim, feature_dim)
        self.act = nn.ReLU() if feature_act == "relu" else nn.Identity()
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.backbone_dim = int(backbone_dim)
        self.feature_dim = int(feature_dim)
        self.num_classes = int(num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_channels, H, W) -> (B, feature_dim) projected features (post-ReLU unless feature_act='none')."""
        h = self.backbone(x)
        if h.dim() == 4:
            h = self.pool(h)
        return self.act(self.proj(torch.flatten(h, 1)))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """(B, feature_dim) -> (B, num_classes) logits."""
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _FusableTrunk(nn.Module):
    """A :class:`FusableNet` without its class layer: (B, C, H, W) -> (B, last hidden width)."""

    def __init__(self, net: FusableNet):
        super().__init__()
        self.convs, self.fcs, self.avgpool = net.convs, net.fcs, net.avgpool
        self.stages, self.out_dim = net.stages, net.feature_dim
        self.INPUT_MEAN, self.INPUT_STD, self.frame_mask = net.INPUT_MEAN, net.INPUT_STD, net.frame_mask
        self.frame_rescale = net.frame_rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FusableNet.features(self, x)  # same code path as the fusable family (uses convs/fcs/avgpool)


def _backbone_hetero_cnn(r: dict) -> tuple[nn.Module, int]:
    base = r["base_family"]
    if base not in FUSABLE_FAMILIES:
        raise ValueError(f"hetero_cnn base_family must be one of {sorted(FUSABLE_FAMILIES)}, got {base!r}")
    fspec = {k: r[k] for k in ("depth", "width", "stages", "hidden", "pool", "in_channels", "num_classes") if k in r}
    fspec["family"] = base
    f = resolve_fusable_spec(fspec)
    trunk = _FusableTrunk(FusableNet(f["stages"], f["hidden"], f["pool"], f["in_channels"], f["num_classes"]))
    return trunk, trunk.out_dim


def _backbone_densenet(r: dict) -> tuple[nn.Module, int]:
    from monai.networks.nets import DenseNet

    net = DenseNet(spatial_dims=2, in_channels=r["in_channels"], out_channels=r["num_classes"],
                   init_features=int(r["init_features"]), growth_rate=int(r["growth_rate"]),
                   block_config=tuple(int(b) for b in r["block_config"]), bn_size=int(r["bn_size"]))
    # net.features ends with the final BatchNorm ("norm5"); MONAI applies ReLU before pooling in class_layers.
    return nn.Sequential(net.features, nn.ReLU()), net.class_layers.out.in_features


def _backbone_resnet(r: dict) -> tuple[nn.Module, int]:
    from monai.networks.nets import ResNet

    layers, planes = [int(v) for v in r["layers"]], [int(v) for v in r["block_inplanes"]]
    if len(layers) != 4 or len(planes) != 4:
        raise ValueError(f"resnet layers and block_inplanes need 4 entries, got {layers}, {planes}")
    net = ResNet(block="basic", layers=layers, block_inplanes=planes, spatial_dims=2,
                 n_input_channels=r["in_channels"], conv1_t_size=int(r["conv1_kernel"]),
                 conv1_t_stride=int(r["conv1_stride"]), no_max_pool=bool(r["no_max_pool"]),
                 num_classes=r["num_classes"], feed_forward=False)
    return net, planes[-1]  # basic block expansion 1; forward returns the pooled, flattened (B, planes[-1])


class _EfficientNetTrunk(nn.Module):
    """MONAI EfficientNet up to the swish after the 1x1 head conv: (B, C, H, W) -> (B, c, h, w)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        net._fc = nn.Identity()  # unused: drop the 1000-way weights so parameter counts are honest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        x = n._swish(n._bn0(n._conv_stem(n._conv_stem_padding(x))))
        x = n._blocks(x)
        return n._swish(n._bn1(n._conv_head(n._conv_head_padding(x))))


def _backbone_efficientnet(r: dict) -> tuple[nn.Module, int]:
    from monai.networks.nets import EfficientNet

    # bn_momentum (optional): MONAI's default BatchNorm momentum is 0.01 (TF's 0.99), so the
    # running statistics lag far behind a model trained for a few hundred steps and eval-mode predictions collapse
    # to one class; the prototype methods' backbones set 0.1, PyTorch's default
    extra = {}
    if r.get("bn_momentum") is not None:
        mom = float(r["bn_momentum"])
        if not 0 < mom <= 1:
            raise ValueError(f"efficientnet bn_momentum must be in (0, 1], got {mom}")
        extra["norm"] = ("batch", {"eps": 1e-3, "momentum": mom})
    net = EfficientNet(blocks_args_str=list(r["blocks"]), spatial_dims=2, in_channels=r["in_channels"],
                       num_classes=r["num_classes"], width_coefficient=float(r["width_coefficient"]),
                       depth_coefficient=float(r["depth_coefficient"]), dropout_rate=0.0,
                       image_size=r["input_size"], drop_connect_rate=0.0, **extra)
    return _EfficientNetTrunk(net), net._conv_head.out_channels


_BACKBONES = {
    "hetero_cnn": _backbone_hetero_cnn,
    "densenet": _backbone_densenet,
    "resnet": _backbone_resnet,
    "efficientnet": _backbone_efficientnet,
}


def build_hetero(spec: dict) -> HeteroNet:
    """Build a :class:`HeteroNet` from a JSON-able spec (see :func:`resolve_hetero_spec` and the module docstring).

    Example: ``build_hetero({"family": "densenet", "in_channels": 1, "num_classes": 3, "feature_dim": 64})``.

    Raises:
        ValueError: unknown family / keys, bad sizes (including MONAI's own argument errors, re-raised).
    """
    r = resolve_hetero_spec(spec)
    try:
        backbone, dim = _BACKBONES[r["family"]](r)
    except (TypeError, KeyError, AssertionError) as e:
        raise ValueError(f"cannot build {r['family']!r} model from spec {spec!r}: {e}") from e
    return HeteroNet(backbone, dim, r["feature_dim"], r["num_classes"], r["feature_act"])


def hetero_pool_specs(num_classes: int = 2, in_channels: int = 1, feature_dim: int = DEFAULT_FEATURE_DIM) -> list[dict]:
    """The default heterogeneous pool: one spec per backbone, in a fixed order (assign to sites round-robin).

    Returns:
        ``[hetero_cnn/shallow, hetero_cnn/deep, densenet, resnet, efficientnet]`` specs, each with the given
        ``num_classes``, ``in_channels`` and common ``feature_dim``.
    """
    common = {"in_channels": in_channels, "num_classes": num_classes, "feature_dim": feature_dim}
    return [
        {"family": "hetero_cnn", "depth": "shallow", **common},
        {"family": "hetero_cnn", "depth": "deep", **common},
        {"family": "densenet", **common},
        {"family": "resnet", **common},
        {"family": "efficientnet", **common},
    ]
