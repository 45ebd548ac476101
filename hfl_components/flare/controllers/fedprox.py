"""FedProx (Li et al., 2020, arXiv:1812.06127): FedAvg's server with a proximal term in every site's local
objective; the method's NVFlare adapter.

The server is :class:`~hfl_components.flare.controllers.baselines.FedAvgController` with
``task_name="fedprox_train"`` (its catalogue row): it sends the global model, averages the answers weighted by the
sites' training counts. The site handler below trains the received global model ``w^t`` on
``CE + mu/2 ||w - w^t||^2`` (:class:`hfl_components.training.proximal.ProximalTerm`, option ``mu``) with FedAvg's
round budget (no gradient clipping), and uploads every weight as FedAvg does.
"""
from __future__ import annotations

from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.site_methods import job_epochs, ok_meta, option, task_epochs


def fedprox_train(rt, params, meta):
    """FedProx round at a site: load the global model, train it with the proximal term, upload every weight and the
    training sample count (``NUM_STEPS_CURRENT_ROUND``, the aggregation weight)."""
    from hfl_components.training.proximal import ProximalTerm

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    prox = ProximalTerm(rt.model, float(option(meta, "mu")))
    epochs = task_epochs(rt, tc, "local_epochs", "local_epochs")
    hist = rt.train(epochs, float(rt.cfg["lr"]), aux_loss=prox, tag=f"round {rnd}", rnd=rnd,
                    dp_epochs=job_epochs(meta, epochs))
    rt.save_state()
    metrics = {"loss": [h["loss"] for h in hist]}
    if rt.dp_spec is None:  # the last batch's proximal term is a training-derived value: not sent under dp
        metrics["proximal_last_batch"] = prox.last.get("proximal")
    return to_numpy_state(rt.model.state_dict()), metrics, ok_meta(
        rt, NUM_STEPS_CURRENT_ROUND=rt.released_count(rt.n_train()), spec=rt.spec)
