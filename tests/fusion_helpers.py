"""Shared builders for the fusion tests: He-initialised fusable models and a no-grad forward pass."""
from __future__ import annotations

import torch

from hfl_components.models.fusable import build_fusable


def he_model(spec: dict, seed: int, bias_range: float | None = None) -> torch.nn.Module:
    """A fusable model of ``spec`` with He-normal weights (seeded), so that its outputs depend on the input through the
    whole depth; biases uniform in [-bias_range, bias_range] when given (non-zero biases), else the default init."""
    torch.manual_seed(seed)
    m = build_fusable(spec)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                torch.nn.init.kaiming_normal_(p, nonlinearity="relu")
            elif bias_range is not None:
                p.uniform_(-bias_range, bias_range)
    return m


def forward(spec: dict, state_dict: dict, x: torch.Tensor) -> torch.Tensor:
    """Logits (B, num_classes) of a fresh ``spec`` model loaded with ``state_dict``, eval mode, no grad."""
    m = build_fusable(spec)
    m.load_state_dict(state_dict)
    m.eval()
    with torch.no_grad():
        return m(x)


def ohfl_controller(**kw):
    """An ``OHFLController`` with the catalogue's defaults for every argument not in ``kw`` (constructor names:
    ``ot_solver``, ``fusion_device``, ``min_sites``, ...), as a job built from a resolved spec would hold them."""
    from hfl_components.flare.catalogue import validate_options
    from hfl_components.flare.controllers import OHFLController

    names = {v: k for k, v in OHFLController.OPTION_ATTRS.items()}
    opts = validate_options("ohfl", {names.get(k, k): v for k, v in kw.items()}, require=False)
    args = {OHFLController.OPTION_ATTRS.get(k, k): v for k, v in opts.items()}
    tc = {"init": args.pop("init"), "init_seed": kw.get("seed", 0), "gate": bool(args.pop("gate")),
          "target_sensitivity": float(args.pop("target_sensitivity"))}
    common = {"num_rounds": 1, "min_sites": 1, "task_timeout": 0, "seed": 0, "late_wait_s": None,
              "task_config": tc, "site_specs": {}, "entry_ref": "hfl_components.flare.catalogue:entry"}
    return OHFLController(**{**common, **args, **{k: v for k, v in kw.items() if k in common or k in args}})
