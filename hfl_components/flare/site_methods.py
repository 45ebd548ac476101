"""What every method's site handlers share, and the task -> handler lookup; no NVFlare imports.

A site handler has the signature ``handler(rt, params, meta) -> (params_out, metrics_out, meta_out)`` where ``rt``
is the site's :class:`~hfl_components.flare.site_tasks.SiteRuntime`, ``params`` the arrays the server sent and
``meta["task_config"]`` the method's options, complete and typed by its controller (:func:`option` reads one; a
handler has no fallback defaults of its own). Each method's handlers live beside its controller in its adapter
module (``hfl_components.flare.controllers.<method>``), named by its catalogue entry's ``site_handlers``;
:func:`handler` finds them by task name. The maths lives in ``hfl_components.{training,fusion,alignment,topology}``.
"""
from __future__ import annotations

import logging

import numpy as np

from hfl_components.alignment.prototypes import nearest_prototype_probs
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state

log = logging.getLogger("cxr_hfl.site")


def option(meta: dict, key: str):
    """The method option ``key`` as the server's controller sent it in ``meta["task_config"]`` (typed and complete:
    ``HFLController.use_checked_options``).

    Raises:
        ValueError: the task config lacks ``key`` (the message names the method and the key).
    """
    tc = meta.get("task_config") or {}
    if key not in tc:
        raise ValueError(f"the task config of method {meta.get('method')!r} lacks option {key!r} (the server's "
                         f"controller sends every option of its method; is the server running another cxr-hfl?)")
    return tc[key]


def task_epochs(rt, tc: dict, key: str, cfg_key: str) -> int:
    """Epochs for a task: the job's ``task_config[key]``, else the site config's ``cfg_key``, else the running
    method's default (``rt.method_defaults``: its catalogue entry's, set by :func:`hfl_components.flare.dispatch.handler`
    with the task's method). Raises ValueError naming the site when none applies."""
    v = tc.get(key)
    if v is None:
        v = rt.cfg.get(cfg_key)
    if v is None:
        defaults = getattr(rt, "method_defaults", None)
        if not defaults:
            raise ValueError(f"site {rt.site}: {key} is set neither by the job nor in the site config, and the task "
                             f"names no method to take the default from")
        v = defaults[key]
    return int(v)


def job_epochs(meta: dict, epochs: int) -> int:
    """The epochs a site trains over the whole job when each of the job's ``meta["total_rounds"]`` rounds (1 when
    the task gives none) trains ``epochs``: what a DP-SGD session is planned for on the first round."""
    return int(epochs) * max(1, int(meta.get("total_rounds") or 1))


def ok_meta(rt, **meta) -> dict:
    """The answer's ``meta`` of a task that worked: status, training count (under dp
    :meth:`~hfl_components.flare.site_tasks.SiteRuntime.released_count`), input size, label scheme, the site's dp
    record (:func:`sent_dp_record`), plus ``meta``."""
    out = {"status": "ok", "n_train": rt.released_count(rt.n_train()), "input_size": int(rt.cfg["input_size"]),
           "labels": rt.labels, "dp": sent_dp_record(rt)}
    out.update(meta)
    return out


# ---------------------------------------------------------------------------- what leaves a site under dp
#: Under the site config's ``dp``: each metrics key a site handler may send, with its stated protection
#: (docs/DEPLOYMENT.md, "what leaves a site"). :func:`protect_answer` drops every other key.
DP_METRICS = {
    "loss": "training losses: dropped (None) or noised inside the DP-SGD epsilon (dp.losses)",
    "finetune_loss": "fine-tuning losses: dropped (None) or noised inside the DP-SGD epsilon (dp.losses)",
    "val": "validation metrics of the DP-trained model: validation images, not training images (not covered)",
    "local": "test metrics of the DP-trained model: test images (not covered)",
    "global_zero_shot": "test metrics of the fused model (post-processing of DP uploads): test images (not covered)",
    "test": "test metrics: test images (not covered)",
    "gate": "acceptance outcome and bounds on validation images only under dp (not covered)",
    "acceptance": "acceptance outcome and bounds on validation images only under dp (not covered)",
    "operating_point": "temperature, ECE and a k-per-cell histogram of calibrated validation scores (k-anonymity)",
    "deploy": "the deployed round and its validation balanced accuracy (validation images, not covered)",
    "releases": "the site's release ledger (settings and accountant values)",
    "cross_site": "test metrics of received model files on this site's test images (not covered)",
}
#: Under dp, the ``meta`` keys of an answer that carry a training count: replaced by the released count.
DP_COUNT_KEYS = ("n_train", "NUM_STEPS_CURRENT_ROUND", "n_holdout")


def sent_dp_record(rt) -> dict:
    """The site's dp record as it leaves the site (``meta["dp"]`` of every answer): ``{"dp": False}`` without dp;
    else :meth:`~hfl_components.flare.site_tasks.SiteRuntime.dp_record` with each session's training-image count
    removed when the count is noised (``dp.count_epsilon``). The sample rate ``1 / ceil(n / B)`` discloses the
    number of batches either way."""
    rec = rt.dp_record()
    if not rec.get("dp") or rt.dp_spec.count_epsilon is None:
        return rec
    return {**rec, "sessions": {k: {kk: vv for kk, vv in s.items() if kk != "n_images"}
                                for k, s in rec["sessions"].items()}}


def protect_answer(rt, task: str, answer: tuple) -> tuple:
    """A site handler's ``(params, metrics, meta)`` as it may leave the site: unchanged without dp; under dp every
    metrics key not in :data:`DP_METRICS` is dropped (logged), every training loss must be None or DP-noised (a
    record of the DP loop), and the counts of :data:`DP_COUNT_KEYS` are the released count.

    Raises:
        ValueError: under dp, a training loss that the DP loop did not produce (a number while losses are dropped).
    """
    params, metrics, meta = answer
    spec = rt.dp_spec
    if spec is None:
        return answer
    metrics = dict(metrics or {})
    for k in sorted(set(metrics) - set(DP_METRICS)):
        log.warning("site %s: dp: %s of task %s is not sent (no stated protection)", rt.site, k, task)
        metrics.pop(k)
    for k in ("loss", "finetune_loss"):
        if spec.losses == "drop" and any(v is not None for v in metrics.get(k) or []):
            raise ValueError(f"site {rt.site}: dp: task {task} would send raw training losses ({k}); refused")
    meta = dict(meta or {})
    for k in DP_COUNT_KEYS:
        if k in meta and meta[k] is not None:
            meta[k] = rt.released_count(int(meta[k]))
    return params, metrics, meta


def release_ledger(rt, method: str | None) -> dict:
    """The site's :class:`hfl_components.privacy.ReleaseLedger` for ``method`` under its dp record (JSON-able):
    the weights DP-SGD covers, the training losses, the training-set size, FENS's aggregator, OHFL's
    operating-point histogram, validation and test summaries."""
    from hfl_components.privacy import ReleaseLedger

    rec, spec = rt.dp_record(), rt.dp_spec
    led = ReleaseLedger(rt.site)
    sessions = rec.get("sessions") or {}
    led.add_training(sessions.get("train"), "model weights" if method != "local" else "nothing (Local: table only)")
    if "holdout" in sessions:
        led.add_training(sessions["holdout"], "FENS aggregator weights (held-out images)")
    if spec is not None and spec.count_epsilon is not None:
        led.add("training-set size", "dp", epsilon=float(spec.count_epsilon), delta=0.0,
                mechanism="discrete Laplace", note="noised once, the same value in every answer")
    else:
        led.add("training-set size", "public", note="declared to the consortium")
    if method == "ohfl":
        led.add("operating-point histogram", "k-anonymity", k=5, mechanism="coarse shared grid",
                note="validation images; every non-empty cell >= 5 images of its class")
    led.add("validation metrics and acceptance summaries", "not covered",
            note="validation images (not training images); computed from the DP-trained model")
    led.add("test metrics", "not covered", note="test images; share_predictions adds per-image scores")
    return led.to_dict()


# ---------------------------------------------------------------------------- evaluation rules
def features(rt):
    """(Z, y): eval-mode features of the site's whole training split."""
    from hfl_components.training import extract_features

    return extract_features(rt.model, rt.loader("train", train_mode=False))


EVAL_MODES = ("head", "nearest-prototype")
# the site's local prototypes (nearest-prototype evaluation): deployed together with the model they belong to
PROTOTYPE_FILES = ("local_prototypes.npy", "local_counts.npy")


def site_evaluate(rt, split: str, tc: dict, with_predictions: bool = False) -> dict:
    """Evaluate the site's model on ``split`` with the evaluation rule of ``tc["eval"]``.

    ``head`` (default): the site's own classifier head. ``nearest-prototype`` (FedSAF/FedProto option): the
    nearest of the site's *own* local prototypes (class means of its training features after its last local
    training, kept in its workspace). Nearest-*global*-prototype is deliberately not offered: under structural
    alignment the global prototypes live in another basis than the site's features.
    """
    mode = tc.get("eval") or "head"  # the platform's rule for methods without an ``eval`` option
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown evaluation rule {mode!r}; expected one of {EVAL_MODES}")
    if mode == "head":
        return rt.evaluate(split, with_predictions=with_predictions)
    from hfl_components.training import compute_metrics, extract_features

    p_path, n_path = rt.state_dir / "local_prototypes.npy", rt.state_dir / "local_counts.npy"
    if not (p_path.is_file() and n_path.is_file()):
        raise ValueError(f"site {rt.site}: no local prototypes in {rt.state_dir} for nearest-prototype evaluation")
    Z, y = extract_features(rt.model, rt.loader(split, train_mode=False))
    probs = nearest_prototype_probs(Z, np.load(p_path), np.load(n_path))
    m = compute_metrics(y, probs, rt.num_classes)
    m["n"] = int(len(y))
    m["eval"] = mode
    if with_predictions:
        m["_probs"] = probs.astype(np.float32).tolist()
        m["_labels"] = np.asarray(y).astype(int).tolist()
    return m


# ---------------------------------------------------------------------------- final evaluation (all methods)
OPERATING_POINT_FILE = "pending_operating_point.json"  # the deployed model's temperature until the threshold comes


def _apply_operating_point(rt, meta: dict, tc: dict) -> dict | None:
    """The server's federated threshold (``meta["operating_point"]``, OHFL): stored with the temperature the site
    fitted (:data:`OPERATING_POINT_FILE`) in the deployed model's file header -- or, when the federation could set
    none, the temperature with ``threshold`` None and the server's reason (``unresolved``); returns the site's own
    validation and test sensitivity/specificity at it (on calibrated scores), which the server reports beside the
    pooled one (:func:`hfl_components.operating_point.site_rates_at`)."""
    import json

    from hfl_components.operating_point import apply_temperature, site_rates_at

    fed, f = meta.get("operating_point"), rt.state_dir / OPERATING_POINT_FILE
    if not fed or not f.is_file():
        return None
    T = float(json.loads(f.read_text())["temperature"])
    thr = None if fed.get("threshold") is None else float(fed["threshold"])
    rt.operating_point = {"temperature": T, "threshold": thr, "target": fed.get("target"),
                          "rule": "federated: pooled coarse validation histograms",
                          **({"unresolved": fed.get("unresolved")} if thr is None else {})}
    rt.save_model(rt.state_dir / "deployed_model.pt", kind="deployed")
    if thr is None:
        return {"temperature": T, "threshold": None}

    def calibrated(split):
        ev = site_evaluate(rt, split, tc, with_predictions=True)
        p = np.asarray(ev.get("_probs") or np.zeros((0, 2)), np.float64).reshape(-1, 2)
        return apply_temperature(np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1), T)[:, 1], \
            np.asarray(ev.get("_labels") or [], int) > 0

    return {"temperature": T, **site_rates_at(rt.operating_point, calibrated("val"), calibrated("test"))}


def evaluate_deployed(rt, params, meta):
    """Evaluate the model this site deploys on its own test split (FedAvg: the final global model)."""
    if any(k.startswith(GLOBAL_PREFIX) for k in params):
        rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
        rt.save_state(deployed=True)
    elif rt.model is None or not (rt.state_dir / "deployed_model.pt").is_file():
        # an earlier task failed here (e.g. an unreadable image): never report an untrained model's metrics
        raise ValueError(f"site {rt.site}: no trained model to evaluate (an earlier task failed at this site)")
    elif not rt.load_deployed(extra_files=PROTOTYPE_FILES):  # deploy: best_val -> the selected round's model
        rt.save_state(deployed=True)
    tc = meta.get("task_config", {})  # tc["eval"]: "head" (default) or "nearest-prototype" (FedSAF/FedProto)
    # per-image test probabilities + labels go to the server for pooled metrics unless the site opts out
    test = site_evaluate(rt, "test", tc, with_predictions=bool(rt.cfg.get("share_predictions", True)))
    out = {"test": test, "val": site_evaluate(rt, "val", tc)}
    if meta.get("operating_point"):  # OHFL: the federated threshold for the deployed, calibrated model
        out["operating_point"] = _apply_operating_point(rt, meta, tc)
    sel = rt.state_dir / "deploy_selection.json"  # which round was deployed, by which rule (RoundRuntime.deploy_round)
    if rt.cfg.get("deploy", "last") == "best_val" and sel.is_file():
        import json

        out["deploy"] = json.loads(sel.read_text())
    out["releases"] = release_ledger(rt, rt.method)  # what this site sent, each with its protection
    return {}, out, ok_meta(rt, spec=rt.spec)


