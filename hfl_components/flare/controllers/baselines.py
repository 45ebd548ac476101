"""Baselines: Local (each site alone) and FedAvg on one architecture (OHFL Sec. 4.3): each method's NVFlare adapter,
its server controller and its site handler."""
from __future__ import annotations

import time

from hfl_components.flare.controllers.base import HFLController
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.options import resolve
from hfl_components.flare.site_methods import job_epochs, ok_meta, task_epochs

# ============================================================================ Local
class LocalController(HFLController):
    """Local baseline: each site trains its own model alone for ``num_rounds`` x local epochs; nothing is
    aggregated, only metrics travel."""

    method = "local"

    def run_method(self):
        for rnd in range(self.num_rounds):
            self.broadcast("local_train", rnd)
        self.final_evaluation(self.num_rounds)


def local_train(rt, params, meta):
    """Local round at a site: train the site's own model, evaluate on validation, deploy by the site config's rule."""
    tc = meta.get("task_config", {})
    epochs = task_epochs(rt, tc, "local_epochs", "local_epochs")
    hist = rt.train(epochs, float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)),
                    total_rounds=meta.get("total_rounds"), dp_epochs=job_epochs(meta, epochs))
    val = rt.evaluate("val")
    rt.deploy_round(val, int(meta.get("round", 0)))  # the site config's deploy rule: last | best_val
    return {}, {"loss": [h["loss"] for h in hist], "val": val}, ok_meta(rt, spec=rt.spec)


# ============================================================================ FedAvg
class FedAvgController(HFLController):
    """FedAvg (McMahan et al., 2017, arXiv:1602.05629) with every site forced onto one architecture, as OHFL's
    baseline (Sec. 4.3): the deepest spec in the profile. Like NVFlare's ``FedAvg(task_name=..., aggregator=...)``
    it sends ``task_name`` every round and combines the answers with ``aggregator``; by default the sample-weighted
    average by ``meta["NUM_STEPS_CURRENT_ROUND"]`` (the sites' training sample counts). Methods that change only
    the site's local objective (FedProx) reuse it with their own task name.

    Args:
        global_spec (dict): the architecture every site trains.
        task_name (str): the training task sent each round. Default ``fedavg_train``.
        aggregator (str): path ``module:function`` of ``aggregator(params_list, weights) -> params`` (lists of
            ``{name: ndarray}`` and of floats, one per usable site; returns the new global ``{name: ndarray}``).
            Default ``hfl_components.aggregation:weighted_average``.
        method_name (str | None): the name recorded in the results (default: the class's ``method``).
        (others as :class:`HFLController`)

    Raises:
        ValueError: ``task_name`` or ``aggregator`` not a non-empty string.
    """

    method = "fedavg"

    def __init__(self, global_spec: dict, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None,
                 task_name: str = "fedavg_train", aggregator: str = "hfl_components.aggregation:weighted_average",
                 method_name: str | None = None, entry_ref: str | None = None):
        if method_name:
            self.method = method_name
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s, entry_ref)
        for key, v in (("task_name", task_name), ("aggregator", aggregator)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{self.method}: {key} must be a non-empty string, got {v!r}")
        self.global_spec = dict(global_spec)
        self.task_name = task_name
        self.aggregator = aggregator
        self.method_name = method_name

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        """The deepest spec of the profile; the entry's training task; the method's options go to the sites."""
        from hfl_components.models import deepest_spec

        e = resolve(common["entry_ref"])(method)
        extra = {} if cls.method == method else {"method_name": method}
        return cls(global_spec=deepest_spec(profile), task_config={**task_config, **opts},
                   task_name=e.training_task, **extra, **common)

    def aggregate(self, results: dict) -> dict:
        """The new global weights from one round's usable answers ``{site: FLModel}`` (the ``aggregator`` hook,
        weighted by each answer's ``NUM_STEPS_CURRENT_ROUND``)."""
        return resolve(self.aggregator)([r.params for r in results.values()],
                                        [float(r.meta["NUM_STEPS_CURRENT_ROUND"]) for r in results.values()])

    def run_rounds(self, weights: dict, meta: dict, first: int = 0, first_params: dict | None = None) -> dict:
        """``num_rounds`` FedAvg rounds numbered from ``first``: send ``task_name`` with the global ``weights``
        (``{name: ndarray}``, sent under ``GLOBAL_PREFIX``; in the first round also ``first_params``, e.g. FENS's
        site models), average the answers (:meth:`aggregate`), add the averaging's seconds to
        ``server_seconds["aggregation"]``. Returns the final global weights."""
        for rnd in range(first, first + self.num_rounds):
            params = {GLOBAL_PREFIX + k: v for k, v in weights.items()}
            if rnd == first and first_params:
                params.update(first_params)
            res = self.broadcast(self.task_name, rnd, params, meta)
            self.set_phase("averaging", round=rnd)
            t0 = time.perf_counter()
            weights = self.aggregate(res)
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
        return weights

    def run_method(self):
        import torch

        from hfl_components.models import build_model

        self.info(f"{self.method}: every site trains the deepest architecture in the profile: {self.global_spec}")
        torch.manual_seed(self.seed)
        weights = to_numpy_state(build_model(self.global_spec).state_dict())
        self._expected = {k: v.shape for k, v in weights.items()}
        meta = {"global_spec": self.global_spec}
        weights = self.run_rounds(weights, meta)
        self.record["global_spec"] = self.global_spec
        self.final_evaluation(self.num_rounds, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        self.save_global_model(self.global_spec, weights)


def fedavg_train(rt, params, meta):
    """FedAvg round at a site: load the global model, train it locally, upload every weight and the sample count."""
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    epochs = task_epochs(rt, tc, "local_epochs", "local_epochs")
    hist = rt.train(epochs, float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)),
                    dp_epochs=job_epochs(meta, epochs))
    rt.save_state()
    n = rt.released_count(rt.n_train())  # under dp: noised (dp.count_epsilon) or declared public
    # NVFlare's FedAvg convention: NUM_STEPS_CURRENT_ROUND carries the aggregation weight (trap 10).
    return to_numpy_state(rt.model.state_dict()), {"loss": [h["loss"] for h in hist]}, ok_meta(
        rt, NUM_STEPS_CURRENT_ROUND=n, spec=rt.spec)
