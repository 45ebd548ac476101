"""OHFL's site handlers (named by the method catalogue's ``site_handlers`` through
:mod:`hfl_components.flare.controllers.ohfl`, which re-exports them): step 1 trains and uploads the site's own model
once; step 2 fine-tunes the fused global model, applies the deployment gate and fits the operating point's
temperature. The handlers get the site runtime ``rt`` as an argument (no NVFlare here)."""
from __future__ import annotations

import logging

import numpy as np

from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.site_methods import ok_meta, option, task_epochs

log = logging.getLogger("cxr_hfl.site")


def ohfl_train(rt, params, meta):
    """OHFL step 1: train the site's own depth/width model and upload it once (with spec, count, val acc)."""
    tc = meta.get("task_config", {})
    rt.ensure_own_model(option(meta, "init"), option(meta, "init_seed"))
    hist = rt.train(task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag="local")
    rt.save_state()
    rt.save_model(rt.state_dir / "local_model.pt", kind="local")
    val = rt.evaluate("val")
    local_test = rt.evaluate("test")
    metrics = {"loss": [h["loss"] for h in hist], "val": val, "local": local_test}
    return to_numpy_state(rt.model.state_dict()), metrics, ok_meta(
        rt, spec=rt.spec, val_acc=float(val["accuracy"] or 0.0))


def _val_key(m: dict) -> tuple:
    """Ranking of a model on the site's validation split: AUC, then balanced accuracy, then lower log-loss."""
    def v(x, default=-1.0):
        return default if x is None else float(x)
    return (v(m.get("auc")), v(m.get("balanced_accuracy")), -v(m.get("log_loss"), 1e9))


def deployment_gate(fed_val: dict, local_val: dict) -> dict:
    """The deployment gate: adopt the federated model only if it beats the site's local model on validation.

    "Beats" means a strictly better (AUC, balanced accuracy, −log-loss) tuple, compared in that order, on the
    site's own validation split; a tie keeps the local model (a hospital should not switch models for nothing).

    Args:
        fed_val, local_val: :func:`hfl_components.training.compute_metrics` dicts of the two models on the split.

    Returns:
        ``{"adopted": bool, "federated_val": {auc, balanced_accuracy, log_loss}, "local_val": {...}, "reason": str}``.
    """
    keys = ("auc", "balanced_accuracy", "log_loss")
    fk, lk = _val_key(fed_val), _val_key(local_val)
    adopted = fk > lk
    def show(m):
        return ", ".join(f"{k} {m.get(k):.3f}" if m.get(k) is not None else f"{k} -" for k in keys)
    reason = (f"federated model beats the local model on validation ({show(fed_val)} vs {show(local_val)})" if adopted
              else f"federated model does not beat the local model on validation ({show(fed_val)} vs "
                   f"{show(local_val)}): keeping the local model")
    return {"adopted": bool(adopted), "federated_val": {k: fed_val.get(k) for k in keys},
            "local_val": {k: local_val.get(k) for k in keys}, "reason": reason}


def ohfl_finetune(rt, params, meta):
    """OHFL step 2: evaluate the global model zero-shot, fine-tune it at the site's input size, and deploy it --
    unless the deployment gate (option ``gate``, on by default) finds that it does not beat the site's own
    local model on the site's validation split, in which case the site keeps (deploys) its local model and says
    so in its log and in ``metrics["gate"]``. With the gate on, the fine-tuned federated candidate is also saved as
    ``federated_model.pt`` (kind ``federated``) whatever the gate decides. Then the site fits the deployed model's
    temperature and sends the coarse histogram of its calibrated validation scores (:func:`_operating_point_report`)."""
    tc = meta.get("task_config", {})
    if meta.get("site_groups"):  # a job of several architecture groups: this site's group's global model
        group = meta["site_groups"].get(rt.site)
        if group is None or group not in meta.get("global_specs", {}):
            raise ValueError(f"site {rt.site}: the server sent no global model for this site's architecture "
                             f"({rt.cfg['model'].get('family')!r})")
        rt.set_model(meta["global_specs"][group], from_numpy_state(params, f"{GLOBAL_PREFIX}{group}/"))
    else:
        rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    zero = rt.evaluate("test")
    hist = rt.train(task_epochs(rt, tc, "finetune_epochs", "finetune_epochs"), float(tc.get("finetune_lr") or rt.cfg["finetune_lr"]),
                    tag="finetune")
    fed_val = rt.evaluate("val")
    gate = None
    if option(meta, "gate"):
        from hfl_components.models import load_model_file

        local_model, local_header = load_model_file(rt.state_dir / "local_model.pt")
        # the fine-tuned federated candidate is kept whatever the gate decides (RUN/models/<site>_federated.pt),
        # so the gate's choice can be checked offline against both candidates
        rt.save_model(rt.state_dir / "federated_model.pt", kind="federated")
        fed_spec, fed_sd = rt.spec, {k: v.detach().cpu().clone() for k, v in rt.model.state_dict().items()}
        rt.set_model(local_header["spec"], local_model.state_dict())
        gate = deployment_gate(fed_val, rt.evaluate("val"))
        if gate["adopted"]:
            rt.set_model(fed_spec, fed_sd)
        log.warning("site %s: deployment gate: %s", rt.site, gate["reason"])
    rt.save_state(deployed=True)
    val = rt.evaluate("val", with_predictions=True)
    return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": val,
                "gate": gate, "operating_point": _operating_point_report(rt, val)}, ok_meta(rt)


def _operating_point_report(rt, val: dict) -> dict | None:
    """Clinical operating point, site side (:mod:`hfl_components.operating_point`): fit the deployed model's
    temperature on the validation split, keep it in the state folder
    (:data:`hfl_components.flare.site_methods.OPERATING_POINT_FILE`, until the server's threshold arrives with the
    final evaluation), and return what leaves the site (the temperature, ECE before/after, the coarse histogram of
    calibrated validation scores with its minimum count per bin); the per-image scores (``val["_probs"]``) are
    removed from ``val`` here and never sent. None for a validation split without both classes."""
    import json

    from hfl_components.flare.site_methods import OPERATING_POINT_FILE
    from hfl_components.operating_point import site_report

    probs, y = val.pop("_probs", None), val.pop("_labels", None)
    (rt.state_dir / OPERATING_POINT_FILE).unlink(missing_ok=True)
    if not probs or len({int(v > 0) for v in y}) < 2:
        return None
    rep = site_report(np.asarray(probs), np.asarray(y))
    (rt.state_dir / OPERATING_POINT_FILE).write_text(json.dumps({"temperature": rep["temperature"]}))
    return rep
