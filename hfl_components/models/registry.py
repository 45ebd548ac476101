"""Spec -> nn.Module registry.

One table, :data:`FAMILY_TABLE`, maps every model family to its ``(build, resolve)`` pair: ``build(spec)`` returns
the ``nn.Module``; ``resolve(spec)`` returns the spec with every default filled in and raises ``ValueError`` on bad
keys or sizes without building the network. :data:`COMPOSITE_TABLE` does the same for models made of site
models (``fens``: FENS's frozen site models + aggregator), which a site never trains as its own. Family modules
(:mod:`~hfl_components.models.fusable`, :mod:`~hfl_components.models.hetero`,
:mod:`~hfl_components.models.ensemble`) import nothing from here, so imports only run downward.
"""
from __future__ import annotations

import json
from typing import Callable, NamedTuple

from torch import nn

from hfl_components.models.ensemble import build_ensemble, resolve_ensemble_spec
from hfl_components.models.fusable import FAMILIES, build_fusable, resolve_fusable_spec
from hfl_components.models.hetero import HETERO_DEFAULTS, build_hetero, resolve_hetero_spec


class Family(NamedTuple):
    """A model family's two entry points: ``build(spec) -> nn.Module`` and ``resolve(spec) -> full spec dict``."""

    build: Callable[[dict], nn.Module]
    resolve: Callable[[dict], dict]


# family name -> (build, resolve). Fusable (OHFL) families first, then the heterogeneous pool.
FAMILY_TABLE: dict[str, Family] = {
    **{name: Family(build_fusable, resolve_fusable_spec) for name in FAMILIES},
    **{name: Family(build_hetero, resolve_hetero_spec) for name in HETERO_DEFAULTS},
}
# Old name: family -> builder (read-only view kept for callers that only build).
BUILDERS: dict[str, Callable[[dict], nn.Module]] = {name: fam.build for name, fam in FAMILY_TABLE.items()}
# Models made of site models, which no site trains as its own (FENS's deployed ensemble,
# :mod:`~hfl_components.models.ensemble`): built, saved and loaded like any spec, never a site config's model.
COMPOSITE_TABLE: dict[str, Family] = {
    "fens": Family(lambda s: build_ensemble(s, build_model, resolve_spec),
                   lambda s: resolve_ensemble_spec(s, resolve_spec)),
}
_ALL = {**FAMILY_TABLE, **COMPOSITE_TABLE}


def is_fusable(spec: dict) -> bool:
    """True when the spec is an OHFL-fusable family (cnn / vgg11)."""
    return spec.get("family") in FAMILIES


#: model spec ``norm``: ``batch`` (as the family builds it; the default) or ``group`` (BatchNorm -> GroupNorm by
#: Opacus's ``ModuleValidator.fix``, for DP-SGD)
NORMS = ("batch", "group")


def validate_spec(spec: dict) -> dict:
    """Check a spec is JSON-able, names a known family and resolves (keys and sizes); return it unchanged.

    Raises:
        ValueError: not a dict, unknown family, or bad keys/sizes (from the family's resolve function).
        TypeError: the spec holds non-JSON-able values.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"model spec must be a dict, got {type(spec).__name__}")
    fam = spec.get("family")
    if fam not in _ALL:
        raise ValueError(f"unknown model family {fam!r}; known: {sorted(FAMILY_TABLE)}")
    json.dumps(spec)  # raises TypeError on non-JSON-able content
    if spec.get("norm", "batch") not in NORMS:
        raise ValueError(f"model spec key 'norm' must be one of {', '.join(NORMS)}, got {spec.get('norm')!r}")
    _ALL[fam].resolve({k: v for k, v in spec.items() if k != "norm"})  # keys and sizes, without building
    return spec


def resolve_spec(spec: dict) -> dict:
    """Return the spec with every family default filled in (what :func:`build_model` builds). Raises ValueError."""
    validate_spec(spec)
    out = _ALL[spec["family"]].resolve({k: v for k, v in spec.items() if k != "norm"})
    return {**out, "norm": spec["norm"]} if "norm" in spec else out


def build_model(spec: dict) -> nn.Module:
    """Build an ``nn.Module`` from a spec dict. Raises ValueError on an unknown family or bad sizes.

    ``spec["norm"] == "group"`` (a site training under differential privacy, ``hfl_components.privacy``): the
    family's network with every BatchNorm replaced by GroupNorm by Opacus's ``ModuleValidator.fix`` (DP-SGD needs
    per-image gradients, which BatchNorm's batch statistics mix), so every party that rebuilds the model from its
    spec builds the same modules; a model without BatchNorm is unchanged."""
    validate_spec(spec)
    model = _ALL[spec["family"]].build({k: v for k, v in spec.items() if k != "norm"})
    if spec.get("norm", "batch") == "group":
        from opacus.validators import ModuleValidator

        if ModuleValidator.validate(model, strict=False):
            model = ModuleValidator.fix(model)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def spec_to_json(spec: dict) -> str:
    """Validated spec -> canonical JSON text (sorted keys). Raises ValueError/TypeError as :func:`validate_spec`."""
    return json.dumps(validate_spec(spec), sort_keys=True)


def spec_from_json(text: str) -> dict:
    """JSON text -> validated spec dict. Raises ValueError on bad JSON or a bad spec."""
    return validate_spec(json.loads(text))


def deepest_spec(profile: dict[str, dict]) -> dict:
    """The deepest (then widest) fusable model spec of a profile ({site: {"model": spec, ...}}): FedAvg's one
    architecture (OHFL Sec. 4.3).

    Raises:
        ValueError: no fusable (cnn/vgg11) spec in the profile.
    """
    from hfl_components.models.fusable import DEPTH_ORDER

    specs = [cfg["model"] for cfg in profile.values() if is_fusable(cfg["model"])]
    if not specs:
        raise ValueError("FedAvg needs at least one fusable (cnn/vgg11) model spec in the profile")
    return dict(max(specs, key=lambda s: (DEPTH_ORDER.get(s.get("depth", "shallow"), 0),
                                          float(s.get("width", 1.0)))))
