"""OHFL's site handlers (named by the method catalogue's ``site_handlers`` through
:mod:`hfl_components.flare.controllers.ohfl`, which re-exports them): step 1 trains and uploads the site's own model
once; step 2 fine-tunes the fused global model and applies the deployment gate, the site acceptance check at each
candidate's own operating point. The handlers get the site runtime ``rt`` as an argument (no NVFlare here)."""
from __future__ import annotations

import logging
import zlib

import numpy as np

from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.site_methods import ok_meta, option, task_epochs

log = logging.getLogger("cxr_hfl.site")


def ohfl_train(rt, params, meta):
    """OHFL step 1: train the site's own depth/width model and upload it once (with spec, count, val acc)."""
    tc = meta.get("task_config", {})
    rt.ensure_own_model(option(meta, "init"), option(meta, "init_seed"))
    epochs = task_epochs(rt, tc, "local_epochs", "local_epochs")
    # under dp one session covers both stages: the uploaded model and the fine-tuned one whose summaries leave
    hist = rt.train(epochs, float(rt.cfg["lr"]), tag="local",
                    dp_epochs=epochs + task_epochs(rt, tc, "finetune_epochs", "finetune_epochs"))
    rt.save_state()
    rt.save_model(rt.state_dir / "local_model.pt", kind="local")
    val = rt.evaluate("val")
    local_test = rt.evaluate("test")
    metrics = {"loss": [h["loss"] for h in hist], "val": val, "local": local_test}
    return to_numpy_state(rt.model.state_dict()), metrics, ok_meta(
        rt, spec=rt.spec, val_acc=float(val["accuracy"] or 0.0))


def ohfl_finetune(rt, params, meta):
    """OHFL step 2: evaluate the global model zero-shot, fine-tune it at the site's input size, and deploy it.

    With the option ``gate`` (on by default) the fine-tuned federated candidate (also saved as
    ``federated_model.pt``, kind ``federated``, whatever is decided) must pass the site acceptance check at its own
    operating point on the site's acceptance data (:func:`acceptance_candidate`: out-of-fold scores of the training
    split, which repeat the fine-tuning k times, plus validation); a refused site keeps its local model if that
    passes the same check on the same images, and deploys nothing otherwise (:func:`acceptance_gate`). The
    deployed model file carries the operating point and the outcome (:func:`deployed_header`); ``metrics["gate"]`` /
    ``metrics["acceptance"]`` carry counts, bounds and the out-of-fold cost only. Without the gate the site fits
    the deployed model's temperature and sends the coarse histogram of its calibrated validation scores
    (:func:`_operating_point_report`, the federated pooled threshold)."""
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
    if rt.dp_spec is not None and rt.dp_record()["sessions"].get("train") is None and rt.dp_ledger("train").is_file():
        # a site restarted between the two steps: the session continues from the workspace's ledger (same plan)
        rt.dp_session("train", rt.n_train(), task_epochs(rt, tc, "local_epochs", "local_epochs")
                      + task_epochs(rt, tc, "finetune_epochs", "finetune_epochs"))
    if rt.dp_spec is not None and rt.dp_record()["sessions"].get("train") is None:
        raise ValueError(f"site {rt.site}: dp: the accountant of this site's local training is neither in this "
                         "process nor in its workspace's ledger; fine-tuning would spend an unaccounted budget, so it "
                         "is refused")
    start = {k: v.detach().cpu().clone() for k, v in rt.model.state_dict().items()}  # the fine-tuning stage's start
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
        ft_epochs = task_epochs(rt, tc, "finetune_epochs", "finetune_epochs")
        ft_lr = float(tc.get("finetune_lr") or rt.cfg["finetune_lr"])
        fed = acceptance_candidate(rt, fed_spec, start, ft_epochs, ft_lr)
        local = None
        if not fed["op"]["acceptance"]["accepted"]:  # the refused site's fallback: its local model, same check
            init = _initial_state(rt, local_header["spec"], meta)
            local = acceptance_candidate(rt, local_header["spec"], init,
                                         task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]),
                                         final_state=local_model.state_dict())
        gate = acceptance_gate(fed, local)
        rt.set_model(*((fed_spec, fed_sd) if gate["deployed"] != "local" else
                       (local_header["spec"], local_model.state_dict())))
        op = (fed if gate["deployed"] != "local" else local)["op"]
        rt.operating_point = deployed_header(op, gate)
        rt.population_reference = population_reference(rt)
        log.warning("site %s: acceptance: %s", rt.site, gate["reason"])
        from hfl_components.operating_point import site_line

        log.warning("%s", site_line(rt.site, op))
    rt.save_state(deployed=True)
    val = rt.evaluate("val", with_predictions=True)
    if gate is not None:  # the per-model operating point replaces the pooled histogram threshold
        val.pop("_probs", None), val.pop("_labels", None)
        gate["acceptance"]["test"] = test_rates(rt, rt.operating_point)
        (rt.state_dir / _pending_file()).unlink(missing_ok=True)
        return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": val,
                    "gate": gate, "acceptance": gate["acceptance"], "operating_point": None}, ok_meta(rt)
    return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": val,
                "gate": gate, "operating_point": _operating_point_report(rt, val)}, ok_meta(rt)


def acceptance_gate(fed: dict, local: dict | None) -> dict:
    """The deployment gate as the site acceptance check: the fine-tuned federated candidate is deployed when it
    passes the check (:func:`hfl_components.operating_point.acceptance_check`: lower confidence bounds of
    sensitivity and specificity at its own operating point against the consortium's floors, never a model that calls
    (almost) every image one class) on the site's acceptance data (out-of-fold training scores + validation); a
    refused site keeps its local model when that passes the same check on the same images, and deploys nothing
    otherwise.

    Args:
        fed, local: :func:`acceptance_candidate` results (``local`` None when it was not needed).

    Returns:
        ``{"deployed": "federated" | "local" | None, "adopted": bool (the federated model deployed), "accepted":
        bool, "reason": one line, "acceptance": {"outcome", "deployed", "federated", "local"}}``; the candidates'
        entries are :func:`hfl_components.operating_point.summary_for_server` (counts and bounds only) plus the
        out-of-fold training cost in seconds.
    """
    from hfl_components.operating_point import summary_for_server

    def summary(c):
        return None if c is None else {**summary_for_server(c["op"]), "oof_seconds": c["oof_seconds"],
                                       "n_acceptance": c["n_acceptance"], "reliability": c.get("reliability")}
    fed_ok = bool(fed["op"]["acceptance"]["accepted"])
    local_ok = bool(local is not None and local["op"]["acceptance"]["accepted"])
    deployed = "federated" if fed_ok else "local" if local_ok else None
    outcome = ("accepted" if fed_ok else "refused: kept the local model" if local_ok else
               "refused: nothing deployed")
    fed_why = fed["op"]["acceptance"]["reason"]
    reason = (f"federated model {fed_why}" if fed_ok else
              f"federated model {fed_why}; local model " + (local["op"]["acceptance"]["reason"] if local else "-")
              + ("" if local_ok else "; no model is deployed for clinical decisions"))
    return {"deployed": deployed, "adopted": deployed == "federated", "accepted": fed_ok, "reason": reason,
            "acceptance": {"outcome": outcome, "deployed": deployed, "federated": summary(fed),
                           "local": summary(local)}}


def deployed_header(op: dict, gate: dict) -> dict:
    """The deployed model file's ``operating_point`` (:func:`hfl_components.operating_point.header_record`) with the
    site's acceptance outcome; when nothing is deployed the threshold is None and ``unresolved`` says why, so
    ``predict`` warns instead of deciding."""
    from hfl_components.operating_point import header_record

    h = {**header_record(op), "acceptance": gate["acceptance"]["outcome"], "deployed": gate["deployed"]}
    if gate["deployed"] is None:
        h.update(threshold=None, accepted=False,
                 unresolved=f"refused by the site acceptance check ({gate['reason']})")
    return h


def test_rates(rt, header: dict) -> dict | None:
    """The deployed model's sensitivity and specificity (:func:`hfl_components.operating_point.rate` dicts: counts,
    interval) on the site's own test split at its operating point (``header``: :func:`deployed_header`), reported
    beside AUC; None when no threshold is deployed."""
    from hfl_components.operating_point import calibrate, rates_at

    if header.get("threshold") is None:
        return None
    ev = rt.evaluate("test", with_predictions=True)
    p = np.asarray(ev.get("_probs") or [], np.float64).reshape(-1, 2)
    y = (np.asarray(ev.get("_labels") or [], int) > 0).astype(int)
    if not y.size:
        return None
    r = rates_at(calibrate(p, header)[:, 1], y, float(header["threshold"]))
    return {k: r[k] for k in ("sensitivity", "specificity")}


def _pending_file() -> str:
    from hfl_components.flare.site_methods import OPERATING_POINT_FILE

    return OPERATING_POINT_FILE


def _initial_state(rt, spec: dict, meta: dict) -> dict:
    """The state the local model's training started from: the site's own initialisation (option ``init``) rebuilt
    with the same seed, so the out-of-fold repetitions repeat the local stage."""
    import torch

    from hfl_components.models import build_model

    if option(meta, "init") == "shared":
        from hfl_components.models.fusable import shared_init_state

        seed = (meta.get("task_config") or {}).get("init_seed")
        return shared_init_state(spec, int(rt.cfg["seed"] if seed is None else seed))
    torch.manual_seed(int(rt.cfg["seed"]) + zlib.crc32(rt.site.encode()) % 1000)  # as SiteRuntime.ensure_own_model
    return {k: v.detach().cpu().clone() for k, v in build_model(spec).state_dict().items()}


def out_of_fold_train_scores(rt, spec: dict, start: dict, epochs: int, lr: float, k: int | None = None) -> tuple:
    """Out-of-fold p(classes) over the site's training split (:func:`hfl_components.operating_point.
    out_of_fold_scores`): for each of k patient-grouped, stratified folds, a copy of the model ``spec`` from the
    state ``start`` (the stage's starting weights) trains ``epochs`` epochs at ``lr`` on the other folds with the
    site's training loader settings, then scores the held fold in eval mode. Returns (probs (N, C), labels (N,),
    seconds). Cost: k repetitions of the stage on (k - 1) / k of the split, reported by the caller."""
    import time

    import torch

    from hfl_components.models import build_model
    from hfl_components.operating_point import OUT_OF_FOLD_K, out_of_fold_scores
    from hfl_components.training import predict_proba, train_local

    t0 = time.perf_counter()
    rows = rt.rows("train")
    y = np.asarray([int(r["label"]) for r in rows])
    groups = [r.get("patient_id") or r["path"] for r in rows]
    train_ds = rt.loader("train").dataset
    eval_ds = rt.loader("train", train_mode=False).dataset
    collate = rt.loader("train").collate_fn
    bs = int(rt.cfg["batch_size"])

    def fit_predict(tr, held):
        model = build_model(spec)
        model.load_state_dict(start)
        model.to(rt.device)
        g = torch.Generator().manual_seed(int(rt.cfg["seed"]))
        dl = torch.utils.data.DataLoader(torch.utils.data.Subset(train_ds, tr.tolist()), batch_size=bs, shuffle=True,
                                         generator=g, collate_fn=collate, num_workers=0)
        if int(epochs) > 0:
            train_local(model, dl, int(epochs), lr=lr, momentum=float(rt.cfg["momentum"]),
                        class_weights=rt.cfg["class_weights"], weight_decay=float(rt.cfg.get("weight_decay", 0.0)),
                        seed=int(rt.cfg["seed"]) * 1000, device=rt.device)
        hd = torch.utils.data.DataLoader(torch.utils.data.Subset(eval_ds, held.tolist()), batch_size=bs,
                                         num_workers=0)
        return predict_proba(model, hd, device=rt.device)[0]

    probs = out_of_fold_scores(y, fit_predict, groups=groups, k=k or OUT_OF_FOLD_K, seed=int(rt.cfg["seed"]))
    return probs, y, time.perf_counter() - t0


def acceptance_candidate(rt, spec: dict, start: dict, epochs: int, lr: float, final_state: dict | None = None) -> dict:
    """One candidate's operating point and acceptance check on the site's acceptance data: the out-of-fold scores
    of the training split (:func:`out_of_fold_train_scores`, from ``start``) plus the candidate's own scores of the
    validation split (the current model when ``final_state`` is None). Returns ``{"op"
    (:func:`hfl_components.operating_point.site_operating_point`), "oof_seconds", "n_acceptance"}``; the caller's
    model is restored."""
    from hfl_components.operating_point import site_operating_point

    keep_spec = rt.spec
    keep_state = {k: v.detach().cpu().clone() for k, v in rt.model.state_dict().items()}
    if rt.dp_spec is None:
        p_oof, y_oof, secs = out_of_fold_train_scores(rt, spec, start, epochs, lr)
    else:  # under dp the out-of-fold refits (non-private training) are skipped: validation images only
        p_oof, y_oof, secs = np.zeros((0, rt.num_classes)), np.zeros(0, int), 0.0
    if final_state is not None:
        rt.set_model(spec, final_state)
    val = rt.evaluate("val", with_predictions=True)
    rt.set_model(keep_spec, keep_state)
    p = np.concatenate([np.asarray(p_oof, np.float64).reshape(len(y_oof), rt.num_classes),
                        np.asarray(val.get("_probs") or np.zeros((0, p_oof.shape[1])), np.float64)])
    y = np.concatenate([y_oof, np.asarray(val.get("_labels") or [], int)])
    op = site_operating_point(p, y, seed=int(rt.cfg["seed"]))
    from hfl_components.operating_point import calibrate, positive_probability, reliability_bins

    pp = positive_probability(p)
    rel = reliability_bins(calibrate(np.stack([1 - pp, pp], 1), op)[:, 1], y)  # bins and counts only
    return {"op": op, "oof_seconds": float(secs), "n_acceptance": int(y.size), "reliability": rel}


def population_reference(rt) -> dict | None:
    """The deployed model's training population (:func:`hfl_components.shift.build_reference`): image statistics,
    file facts (size, format, DICOM age / manufacturer / view) and the model's features of the training split, the
    validation split's features as held-out reference; stored in the deployed model file so that ``predict`` warns
    when a batch differs. None (logged) when it cannot be built, e.g. under 5 training images."""
    import torch

    from chest_xray.population import population_facts
    from hfl_components.shift import build_reference, features_and_statistics

    try:
        def images(split):
            return torch.cat([b["image"] if isinstance(b, dict) else b[0]
                              for b in rt.loader(split, train_mode=False)]).to(rt.device)
        stats, feats = features_and_statistics(rt.eval_model, images("train"))
        held = features_and_statistics(rt.eval_model, images("val"))[1] if rt.rows("val") else None
        facts = [population_facts(r["path"]) for r in rt.rows("train")]
        return build_reference(stats, facts, feats, held_out_features=held, population=rt.cfg.get("population"),
                               seed=int(rt.cfg["seed"]))
    except (ValueError, OSError) as e:
        log.warning("site %s: no population reference in the deployed model file: %s", rt.site, e)
        return None


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
