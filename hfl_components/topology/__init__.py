"""FedTopo relation-topology sharing: pure NumPy server/site maths in :mod:`.relations`
(Eq. 2–8, 25–26, noisy counts, validation, ablations) and the topology-guided loss in :mod:`.loss` (Eq. 9–13)."""
from .loss import TopologyLoss, is_warmup_round, topology_guidance, topology_guided_loss
from .relations import (
    TopologyAblation,
    aggregate_round,
    aggregate_topology,
    initial_topology,
    local_guidance,
    local_relation_topology,
    noisy_counts,
    observation_mask,
    reliability_weights,
    topology_inconsistency,
    validate_topology_upload,
)

__all__ = [
    "TopologyLoss", "is_warmup_round", "topology_guidance", "topology_guided_loss", "TopologyAblation",
    "aggregate_round", "aggregate_topology", "initial_topology", "local_guidance", "local_relation_topology",
    "noisy_counts", "observation_mask", "reliability_weights", "topology_inconsistency", "validate_topology_upload",
]
