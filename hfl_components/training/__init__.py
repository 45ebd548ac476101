"""Local training and evaluation shared by every method (training issue, Sec. 2).

``train_local`` runs a site's local epochs with an optional auxiliary loss; ``evaluate`` / ``compute_metrics`` give
JSON-safe scikit-learn metrics (undefined -> None); ``pooled_metrics_with_ci`` adds bootstrap 95% CIs;
``extract_features`` / ``predict_proba`` collect model outputs over a loader.
"""
from hfl_components.training.device import (  # noqa: F401
    DEVICE_CHOICES,
    check_device_name,
    describe_device,
    resolve_device,
)
from hfl_components.training.loop import (  # noqa: F401
    balanced_class_weights,
    loader_labels,
    seed_everything,
    train_local,
    unpack_batch,
)
from hfl_components.training.metrics import (  # noqa: F401
    SCALAR_METRICS,
    choose_threshold,
    compute_metrics,
    evaluate,
    extract_features,
    pooled_metrics_with_ci,
    predict_labels,
    predict_proba,
)
