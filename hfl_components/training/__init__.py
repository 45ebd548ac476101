"""Local training and evaluation shared by every method.

``train_local`` runs a site's local epochs with an optional auxiliary loss; ``evaluate`` / ``compute_metrics`` give
JSON-safe scikit-learn metrics (undefined -> None); ``pooled_metrics_with_ci`` adds bootstrap 95% CIs;
``extract_features`` / ``predict_proba`` collect model outputs over a loader.

The names are loaded on first use (PEP 562 module ``__getattr__``): ``import hfl_components.training.device`` (what
the CLI needs to check a ``--device`` name) imports neither torch nor scikit-learn, while ``from
hfl_components.training import train_local`` works as before.
"""
from __future__ import annotations

import importlib

#: public name -> submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("DEVICE_CHOICES", "check_device_name", "describe_device", "resolve_device"), "device"),
    **dict.fromkeys(("balanced_class_weights", "loader_labels", "seed_everything", "train_local", "unpack_batch"),
                    "loop"),
    **dict.fromkeys(("SCALAR_METRICS", "choose_threshold", "compute_metrics", "evaluate", "extract_features",
                     "pooled_metrics_with_ci", "predict_labels", "predict_proba"), "metrics"),
}

__all__ = sorted(_EXPORTS)

#: submodules reachable as attributes (``hfl_components.training.metrics``), as when this package imported them
_SUBMODULES = ("device", "loop", "metrics")


def __getattr__(name: str):
    """Import the submodule defining ``name`` (or the submodule ``name``) on first access (PEP 562) and cache the
    value in this module."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import system sets it as our attribute
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
