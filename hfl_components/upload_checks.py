"""Checks on what a site uploads, one per method task (pure: NumPy/torch only, no NVFlare).

The method catalogue (``hfl_components.flare.catalogue``, ``MethodEntry.upload_checks``) names the check of each
task; the server's controller runs it on every answer and leaves a site whose upload fails out of that round with
the reason logged (``HFLController.broadcast``).

Every check has the signature ``check(params: dict, meta: dict, ctx: dict) -> None`` and raises ``ValueError``
with a one-line reason. ``params`` are the uploaded arrays, ``meta`` the answer's metadata, ``ctx`` what the
server expects (``HFLController.upload_context()``: ``num_classes``, ``feature_dim``, ``expected_shapes``).
"""
from __future__ import annotations

import numpy as np


def check_fedavg_upload(params: dict, meta: dict, ctx: dict) -> None:
    """FedAvg: the global architecture's parameter names and shapes (``ctx["expected_shapes"]``: {name: shape}),
    finite values and a positive sample count in ``meta["NUM_STEPS_CURRENT_ROUND"]``.

    Raises:
        ValueError: names differ, a shape differs, non-finite values, no positive sample count.
    """
    expected = ctx["expected_shapes"]
    params = params or {}
    if set(params) != set(expected):
        raise ValueError("parameter names differ from the global architecture")
    for k, v in params.items():
        if np.shape(v) != expected[k]:
            raise ValueError(f"{k} has shape {np.shape(v)}, expected {expected[k]}")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{k} has non-finite values")
    if not (meta or {}).get("NUM_STEPS_CURRENT_ROUND", 0) > 0:
        raise ValueError("no positive sample count in NUM_STEPS_CURRENT_ROUND")


def check_model_upload(params: dict, meta: dict, ctx: dict) -> None:
    """OHFL: the uploaded state fits the fusable spec in ``meta["spec"]`` with a positive ``meta["n_train"]``
    (``hfl_components.fusion.validate_upload``, OHFL Sec. 3).

    Raises:
        ValueError: from ``validate_upload`` (unknown spec, missing keys, shapes, non-finite values, count).
    """
    import torch

    from hfl_components.fusion import validate_upload

    meta = meta or {}
    state = {k: torch.as_tensor(np.asarray(v)) for k, v in (params or {}).items()}
    validate_upload(meta.get("spec"), state, meta.get("n_train", 0))


def check_prototype_upload(params: dict, meta: dict, ctx: dict) -> None:
    """FedSAF / FedProto: ``prototypes`` (C x d) and ``counts`` (C,) as
    ``hfl_components.alignment.validate_prototype_upload`` checks them (FedSAF paper, Sec. III), and counts that add
    up to the site's ``meta["n_train"]`` when it is given.

    Raises:
        ValueError: a bad shape, non-finite values, counts that are not non-negative integers or disagree with the
        zero rows or with ``n_train``.
    """
    from hfl_components.alignment import validate_prototype_upload

    p = params or {}
    validate_prototype_upload(p.get("prototypes"), p.get("counts"), ctx["num_classes"], ctx["feature_dim"])
    n_train = (meta or {}).get("n_train")
    total = float(np.sum(p["counts"]))
    if n_train is not None and total != float(n_train):
        raise ValueError(f"class counts add up to {total:g}, but the site reports n_train = {n_train}")


def check_topology_upload(params: dict, meta: dict, ctx: dict) -> None:
    """FedTopo: ``R`` (C x C) and ``counts`` (C,) as ``hfl_components.topology.validate_topology_upload`` checks
    them (FedTopo paper, Eq. 4), and a unit diagonal of R exactly at the classes with a positive count.

    Raises:
        ValueError: a bad shape or value, or a diagonal that disagrees with the counts.
    """
    from hfl_components.topology import validate_topology_upload

    p = params or {}
    validate_topology_upload(p.get("R"), p.get("counts"), ctx["num_classes"])
    diag = np.diag(np.asarray(p["R"], dtype=np.float64))
    present = np.asarray(p["counts"], dtype=np.float64) > 0
    if np.any(np.abs(diag - present) > 1e-6):
        raise ValueError(f"diagonal of R {np.round(diag, 4).tolist()} disagrees with the classes present in "
                         f"the counts {np.asarray(p['counts']).tolist()}")
