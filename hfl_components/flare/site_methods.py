"""Site-side task handlers, one per (method, task); no NVFlare imports.

Each handler has the signature ``handler(rt, params, meta) -> (params_out, metrics_out, meta_out)`` where ``rt``
is the site's :class:`~hfl_components.flare.site_tasks.SiteRuntime`, ``params`` the arrays the server sent and
``meta["task_config"]`` the method settings. The maths lives in ``hfl_components.{training,fusion,alignment,
topology}``; these functions only wire a site's data and model to it.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from hfl_components.alignment.prototypes import nearest_prototype_probs
from hfl_components.flare.site_tasks import GLOBAL_PREFIX, SiteRuntime, from_numpy_state, to_numpy_state

log = logging.getLogger("cxr_hfl.site")


def _epochs(rt: SiteRuntime, tc: dict, key: str, cfg_key: str) -> int:
    """Epochs for a task: the job's ``task_config[key]``, else the site config's ``cfg_key``, else the running
    method's default (:mod:`hfl_components.flare.catalogue`). Raises ValueError naming the site when none applies."""
    v = tc.get(key)
    if v is None:
        v = rt.cfg.get(cfg_key)
    if v is None:
        if rt.method is None:
            raise ValueError(f"site {rt.site}: {key} is set neither by the job nor in the site config, and the task "
                             f"names no method to take the default from")
        from hfl_components.flare.catalogue import method_defaults

        v = method_defaults(rt.method)[key]
    return int(v)


def _val_acc(rt: SiteRuntime) -> float:
    return float(rt.evaluate("val")["accuracy"] or 0.0)


def _ok(rt, **meta):
    out = {"status": "ok", "n_train": rt.n_train(), "input_size": int(rt.cfg["input_size"]), "labels": rt.labels}
    out.update(meta)
    return out


# ---------------------------------------------------------------------------- Local / FedAvg
def local_train(rt, params, meta):
    tc = meta.get("task_config", {})
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)),
                    total_rounds=meta.get("total_rounds"))
    val = rt.evaluate("val")
    rt.deploy_round(val, int(meta.get("round", 0)))  # the site config's deploy rule: last | best_val
    return {}, {"loss": [h["loss"] for h in hist], "val": val}, _ok(rt, spec=rt.spec)


def fedavg_train(rt, params, meta):
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)))
    rt.save_state()
    n = rt.n_train()
    # NVFlare's FedAvg convention: NUM_STEPS_CURRENT_ROUND carries the aggregation weight (trap 10).
    return to_numpy_state(rt.model.state_dict()), {"loss": [h["loss"] for h in hist]}, _ok(
        rt, NUM_STEPS_CURRENT_ROUND=n, spec=rt.spec)


# ---------------------------------------------------------------------------- OHFL
def ohfl_train(rt, params, meta):
    """OHFL step 1: train the site's own depth/width model and upload it once (with spec, count, val acc)."""
    tc = meta.get("task_config", {})
    rt.ensure_own_model(tc.get("init") or "site", tc.get("init_seed"))
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag="local")
    rt.save_state()
    rt.save_model(rt.state_dir / "local_model.pt", kind="local")
    val = rt.evaluate("val")
    local_test = rt.evaluate("test")
    metrics = {"loss": [h["loss"] for h in hist], "val": val, "local": local_test}
    return to_numpy_state(rt.model.state_dict()), metrics, _ok(
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
    unless the deployment gate (``task_config["gate"]``, on by default) finds that it does not beat the site's own
    local model on the site's validation split, in which case the site keeps (deploys) its local model and says
    so in its log and in ``metrics["gate"]``. With the gate on, the fine-tuned federated candidate is also saved as
    ``federated_model.pt`` (kind ``federated``) whatever the gate decides."""
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    zero = rt.evaluate("test")
    hist = rt.train(_epochs(rt, tc, "finetune_epochs", "finetune_epochs"), float(tc.get("finetune_lr") or rt.cfg["finetune_lr"]),
                    tag="finetune")
    fed_val = rt.evaluate("val")
    gate = None
    if tc.get("gate", True):
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
    return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": rt.evaluate("val"),
                "gate": gate}, _ok(rt)


# ---------------------------------------------------------------------------- FedSAF / FedProto
def _features(rt):
    from hfl_components.training import extract_features

    return extract_features(rt.model, rt.loader("train", train_mode=False))


EVAL_MODES = ("head", "nearest-prototype")
# the site's local prototypes (nearest-prototype evaluation): deployed together with the model they belong to
PROTOTYPE_FILES = ("local_prototypes.npy", "local_counts.npy")


# the prediction rule is pure (hfl_components.alignment.nearest_prototype_probs); the old private name stays
_nearest_prototype_probs = nearest_prototype_probs


def site_evaluate(rt, split: str, tc: dict, with_predictions: bool = False) -> dict:
    """Evaluate the site's model on ``split`` with the evaluation rule of ``tc["eval"]``.

    ``head`` (default): the site's own classifier head. ``nearest-prototype`` (FedSAF/FedProto option): the
    nearest of the site's *own* local prototypes (class means of its training features after its last local
    training, kept in its workspace). Nearest-*global*-prototype is deliberately not offered: under structural
    alignment the global prototypes live in another basis than the site's features.
    """
    mode = tc.get("eval") or "head"
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown evaluation rule {mode!r}; expected one of {EVAL_MODES}")
    if mode == "head":
        return rt.evaluate(split, with_predictions=with_predictions)
    from hfl_components.training import compute_metrics, extract_features

    p_path, n_path = rt.state_dir / "local_prototypes.npy", rt.state_dir / "local_counts.npy"
    if not (p_path.is_file() and n_path.is_file()):
        raise ValueError(f"site {rt.site}: no local prototypes in {rt.state_dir} for nearest-prototype evaluation")
    Z, y = extract_features(rt.model, rt.loader(split, train_mode=False))
    probs = _nearest_prototype_probs(Z, np.load(p_path), np.load(n_path))
    m = compute_metrics(y, probs, rt.num_classes)
    m["n"] = int(len(y))
    m["eval"] = mode
    if with_predictions:
        m["_probs"] = probs.astype(np.float32).tolist()
        m["_labels"] = np.asarray(y).astype(int).tolist()
    return m


def fedsaf_train(rt, params, meta):
    """FedSAF round (FedSAF paper, Sec. III): train with the structural (or coordinate) alignment loss against the
    global prototypes, then upload class-mean prototypes of the training features and class counts.

    Round 0 receives no global prototypes (the server sends none), so it is supervised-only (CE); from round 1 the
    loss is Eq. 19, CE + lambda L_proto + gamma L_inst, with the alignment function ``tc["alignment"]``. Prototypes
    are computed *after* local training (eval-mode features of the whole training split) and also kept in the
    site's workspace for the optional nearest-local-prototype evaluation.
    """
    import warnings

    from hfl_components.alignment import FedSAFAuxLoss, local_prototypes

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.ensure_own_model()
    gp = params.get("global_prototypes")
    gmask = params.get("global_mask")
    aux = None
    if gp is not None and np.asarray(gp).size:
        with warnings.catch_warnings(record=True) as caught:  # the C = 2 warning goes to the site log, once
            warnings.simplefilter("always")
            aux = FedSAFAuxLoss(torch.as_tensor(np.asarray(gp), dtype=torch.float32),
                                kind=tc.get("alignment", "gcsa"), lam=float(tc.get("lambda", 1.0)),
                                gamma=float(tc.get("gamma", 1.0)),
                                global_mask=None if gmask is None else torch.as_tensor(np.asarray(gmask)).bool())
        for w in caught:
            log.warning("site %s: %s", rt.site, w.message)
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    tag=f"round {rnd}", rnd=rnd, total_rounds=meta.get("total_rounds"))
    Z, y = _features(rt)
    P, counts = local_prototypes(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    np.save(rt.state_dir / "local_prototypes.npy", np.asarray(P))
    np.save(rt.state_dir / "local_counts.npy", np.asarray(counts))
    out = {"prototypes": np.asarray(P, dtype=np.float32), "counts": np.asarray(counts, dtype=np.float32)}
    val = site_evaluate(rt, "val", tc)
    rt.deploy_round(val, rnd, extra_files=PROTOTYPE_FILES)  # the site config's deploy rule: last | best_val
    metrics = {"loss": [h["loss"] for h in hist], "val": val,
               "alignment_active": aux is not None,
               "alignment_terms_last_batch": dict(aux.last) if aux is not None else None}
    return out, metrics, _ok(rt)


# ---------------------------------------------------------------------------- FedTopo
def fedtopo_train(rt, params, meta):
    """FedTopo round (FedTopo paper, Algorithm 1): train with the topology-guided loss from the broadcast (R^g, S^g),
    then upload only the local relation matrix R_k and class counts (optionally noisy).

    Warm-up: in rounds ``r < tc["warmup"]`` (0-based) the topology term is off (``TopologyLoss(warmup_active=True)``
    returns 0, so the loss is plain CE). Site-side ablations (``tc["ablate"]``): ``no_topq`` keeps every present
    negative (q = C - 1), ``no_missing_mask`` drops the presence mask of Eq. 10, ``local_topology`` guides with the
    site's own R_k of the previous round and S = 1 on its observed pairs (round 0 has no R_k yet: the broadcast
    initial state, which gives B_y = 0). D^r / D^rs (Eq. 25-26) compare this round's R_k with the broadcast
    (R^g, S^g); they are None when the site holds fewer than two classes.
    """
    import zlib

    from hfl_components.topology import (TopologyLoss, is_warmup_round, local_guidance, local_relation_topology,
                                         noisy_counts, topology_inconsistency)

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.ensure_own_model()
    counts_true = rt.class_counts()
    present = torch.as_tensor(counts_true > 0)
    ablate = set(tc.get("ablate") or [])
    Rg = torch.as_tensor(np.asarray(params["R_global"]), dtype=torch.float32)
    Sg = torch.as_tensor(np.asarray(params["S_global"]), dtype=torch.float32)
    R_guide, S_guide = Rg, Sg
    if "local_topology" in ablate:
        p = rt.state_dir / "local_topology.npy"
        if p.is_file():
            Rl, Sl = local_guidance(np.load(p), counts_true > 0)
            R_guide, S_guide = torch.as_tensor(Rl, dtype=torch.float32), torch.as_tensor(Sl, dtype=torch.float32)
    warm = is_warmup_round(rnd, int(tc.get("warmup", 3)))
    q = None if "no_topq" in ablate else int(tc.get("top_q", 3))
    aux = TopologyLoss(R_guide, S_guide, present, lam=float(tc.get("lambda", 1.0)), gamma=float(tc.get("gamma", 1.0)),
                       q=q, warmup_active=warm, use_mask="no_missing_mask" not in ablate)
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    tag=f"round {rnd}", rnd=rnd, total_rounds=meta.get("total_rounds"))
    val = site_evaluate(rt, "val", tc)
    rt.deploy_round(val, rnd)  # the site config's deploy rule: last | best_val
    Z, y = _features(rt)
    R, mask, counts = local_relation_topology(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    R = np.asarray(R, dtype=np.float32)
    np.save(rt.state_dir / "local_topology.npy", R)
    counts = np.asarray(counts, dtype=np.float32)
    if tc.get("noisy_counts"):
        seed = int(rt.cfg["seed"]) * 100003 + zlib.crc32(rt.site.encode()) % 100003 + 7919 * rnd
        counts = np.asarray(noisy_counts(counts, np.asarray(mask), float(tc["noisy_counts"]), seed=seed),
                            dtype=np.float32)
    d_r, d_rs = topology_inconsistency(R, np.asarray(mask), Rg, Sg)
    metrics = {"loss": [h["loss"] for h in hist], "val": val,
               "D_r": d_r, "D_rs": d_rs, "warmup": bool(warm), "q_effective": int(aux.q_effective),
               "topq_active": bool(aux.topq_active), "n_present": int(np.asarray(mask).sum())}
    return {"R": R, "counts": counts}, metrics, _ok(rt)


# ---------------------------------------------------------------------------- final evaluation (all methods)
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
    sel = rt.state_dir / "deploy_selection.json"  # which round was deployed, by which rule (RoundRuntime.deploy_round)
    if rt.cfg.get("deploy", "last") == "best_val" and sel.is_file():
        import json

        out["deploy"] = json.loads(sel.read_text())
    return {}, out, _ok(rt, spec=rt.spec)


from hfl_components.flare.site_crosseval import cross_eval  # noqa: E402 - registered below


def _with_method(handler):
    """Wrap a handler so the site runtime knows the method of the task it runs (``meta["method"]``, sent by the
    server; recorded in the provenance of the model files the site saves)."""
    @functools.wraps(handler)
    def run(rt, params, meta):
        rt.method = meta.get("method") or rt.method
        return handler(rt, params, meta)

    return run


_HANDLERS = {
    "local_train": local_train,
    "fedavg_train": fedavg_train,
    "ohfl_train": ohfl_train,
    "ohfl_finetune": ohfl_finetune,
    "fedsaf_train": fedsaf_train,
    "fedtopo_train": fedtopo_train,
    "evaluate": evaluate_deployed,
    "cross_eval": cross_eval,  # cross-site evaluation of model files (hfl_components.flare.site_crosseval)
}
HANDLERS = {task: _with_method(h) for task, h in _HANDLERS.items()}
