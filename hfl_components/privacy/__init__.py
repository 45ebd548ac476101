"""Privacy at a site: differentially private training, what else leaves a site, and membership-inference audits.

* :mod:`.dp` -- DP-SGD with Opacus and its accountant: :class:`DPSpec`, :func:`check_budget` (refuses an
  impossible budget before training), :class:`DPSession` (passed to ``train_local(dp=...)``), the record a site
  keeps, :func:`epsilon_from_record`, :func:`make_compatible` for BatchNorm models.
* :mod:`.releases` -- the other values a site sends under dp (training losses, counts, summaries): dropped,
  released with their own noise, or declared, in one ledger per site; :func:`run_dp_line`, the plain line status,
  the report and the model card print (DP or not, and at which epsilon).
* :mod:`.mia` -- membership-inference attacks as measurement tools a site runs on its own data (loss threshold,
  offline LiRA with shadow models on public images, one-run canary audit); they send nothing.

Opacus is imported only when a function needs it.
"""
from hfl_components.privacy.dp import (
    ACCOUNTANTS, DELTA_FACTOR, LOSS_RELEASES, DPBudgetError, DPPlan, DPSession, DPSpec, PrivateCall, check_budget,
    compatibility_report, default_delta, epsilon_from_record, make_compatible, make_private, opacus_steps_per_epoch,
)
from hfl_components.privacy.mia import (
    DEFAULT_FPR, attack_metrics, audit_p_value, auc, canary_inclusion, default_guesses, epsilon_lower_bound,
    lira_offline, logit_confidence, loss_threshold_attack, model_logits, one_run_audit, per_example_losses,
    roc_points, tpr_at_fpr, train_shadow_models,
)
from hfl_components.privacy.releases import (
    PROTECTIONS, SAFE_HISTORY_KEYS, Release, ReleaseLedger, noisy_count, release_history, run_dp_line,
)

__all__ = [
    "ACCOUNTANTS", "DELTA_FACTOR", "DPBudgetError", "DPPlan", "DPSession", "DPSpec", "LOSS_RELEASES", "PrivateCall",
    "check_budget", "compatibility_report", "default_delta", "epsilon_from_record", "make_compatible",
    "make_private", "opacus_steps_per_epoch",
    "DEFAULT_FPR", "attack_metrics", "audit_p_value", "auc", "canary_inclusion", "default_guesses",
    "epsilon_lower_bound", "lira_offline", "logit_confidence", "loss_threshold_attack", "model_logits",
    "one_run_audit", "per_example_losses", "roc_points", "tpr_at_fpr", "train_shadow_models",
    "PROTECTIONS", "SAFE_HISTORY_KEYS", "Release", "ReleaseLedger", "noisy_count", "release_history", "run_dp_line",
]
