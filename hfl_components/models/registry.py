"""Spec -> nn.Module registry (models issue, Sec. 1)."""
from __future__ import annotations

import json
from typing import Callable

from torch import nn

from hfl_components.models.fusable import FAMILIES, build_fusable, resolve_fusable_spec

# family name -> builder(spec) -> nn.Module. Heterogeneous backbones register themselves in hetero.py.
BUILDERS: dict[str, Callable[[dict], nn.Module]] = {name: build_fusable for name in FAMILIES}


def _load_extra_builders() -> None:
    try:
        from hfl_components.models import hetero  # noqa: F401  (registers into BUILDERS)
    except ImportError:  # pragma: no cover - module not written yet
        pass


def is_fusable(spec: dict) -> bool:
    """True when the spec is an OHFL-fusable family (cnn / vgg11)."""
    return spec.get("family") in FAMILIES


def validate_spec(spec: dict) -> dict:
    """Check a spec is JSON-able and names a known family; return it. Raises ValueError."""
    if not isinstance(spec, dict):
        raise ValueError(f"model spec must be a dict, got {type(spec).__name__}")
    _load_extra_builders()
    fam = spec.get("family")
    if fam not in BUILDERS:
        raise ValueError(f"unknown model family {fam!r}; known: {sorted(BUILDERS)}")
    json.dumps(spec)  # raises TypeError on non-JSON-able content
    if fam in FAMILIES:  # full check of keys and sizes without building the network
        resolve_fusable_spec(spec)
    else:
        from hfl_components.models.hetero import resolve_hetero_spec

        resolve_hetero_spec(spec)
    return spec


def build_model(spec: dict) -> nn.Module:
    """Build an ``nn.Module`` from a spec dict. Raises ValueError on an unknown family or bad sizes."""
    validate_spec(spec)
    return BUILDERS[spec["family"]](spec)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def spec_to_json(spec: dict) -> str:
    return json.dumps(validate_spec(spec), sort_keys=True)


def spec_from_json(text: str) -> dict:
    return validate_spec(json.loads(text))
