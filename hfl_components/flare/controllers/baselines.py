"""Baselines: Local (each site alone) and FedAvg on one architecture (OHFL Sec. 4.3)."""
from __future__ import annotations

import time

from hfl_components.flare.controllers.base import GLOBAL_PREFIX, HFLController

# ============================================================================ Local
class LocalController(HFLController):
    """Local baseline: each site trains its own model alone for ``num_rounds`` x local epochs; nothing is
    aggregated, only metrics travel."""

    method = "local"

    def run_method(self):
        for rnd in range(self.num_rounds):
            self.broadcast("local_train", rnd)
        self.final_evaluation(self.num_rounds)


# ============================================================================ FedAvg
class FedAvgController(HFLController):
    """FedAvg (McMahan et al., 2017) with every site forced onto one architecture, as OHFL's baseline (Sec. 4.3):
    the deepest spec in the profile. Sample-weighted averaging by ``meta["NUM_STEPS_CURRENT_ROUND"]`` (the
    sites' training sample counts).

    Args:
        global_spec (dict): the architecture every site trains.
        (others as :class:`HFLController`)
    """

    method = "fedavg"

    def __init__(self, global_spec: dict, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        self.global_spec = dict(global_spec)

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.models import deepest_spec

        return cls(global_spec=deepest_spec(profile), task_config=task_config, **common)

    def run_method(self):
        import torch

        from hfl_components.aggregation import weighted_average
        from hfl_components.flare.messages import to_numpy_state
        from hfl_components.models import build_model

        self.info(f"FedAvg: every site trains the deepest architecture in the profile: {self.global_spec}")
        torch.manual_seed(self.seed)
        weights = to_numpy_state(build_model(self.global_spec).state_dict())
        self._expected = {k: v.shape for k, v in weights.items()}
        meta = {"global_spec": self.global_spec}
        for rnd in range(self.num_rounds):
            res = self.broadcast("fedavg_train", rnd, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
            self.set_phase("averaging", round=rnd)
            t0 = time.perf_counter()
            weights = weighted_average([r.params for r in res.values()],
                                       [float(r.meta["NUM_STEPS_CURRENT_ROUND"]) for r in res.values()])
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
        self.record["global_spec"] = self.global_spec
        self.final_evaluation(self.num_rounds, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        self.save_global_model(self.global_spec, weights)
