"""FedSAF structural alignment and prototype utilities (pure PyTorch).

See :mod:`.losses` for the alignment losses (Eq. 6, 12–19) and :mod:`.prototypes` for prototype construction
(Eq. 3–5, 15), the effective-rank diagnostic (Fig. 1) and upload validation.
"""
from .losses import (
    KINDS,
    STRUCTURAL_KINDS,
    FedSAFAuxLoss,
    batch_prototypes,
    centred_gram,
    coordinate_decomposition,
    coordinate_loss,
    rdm,
    structural_loss,
)
from .prototypes import (
    aggregate_fedproto,
    effective_rank,
    fixed_hypersphere_prototypes,
    local_prototypes,
    nearest_prototype_probs,
    train_tgp_prototypes,
    validate_prototype_upload,
)

__all__ = [
    "KINDS", "STRUCTURAL_KINDS", "FedSAFAuxLoss", "batch_prototypes", "centred_gram", "coordinate_decomposition",
    "coordinate_loss", "rdm", "structural_loss", "aggregate_fedproto", "effective_rank",
    "fixed_hypersphere_prototypes", "local_prototypes", "nearest_prototype_probs", "train_tgp_prototypes",
    "validate_prototype_upload",
]
