"""What a site logs through NVFlare's experiment tracking (``nvflare.client.tracking``): scalars only.

:func:`tracking_scalars` turns a task answer's metrics into ``(tag, value, step)`` triples that the site script
writes with ``SummaryWriter.add_scalar`` (NVFlare streams them to the server's ``TBAnalyticsReceiver`` /
``MLflowReceiver``):

* ``train/loss`` (and ``finetune/loss``) once per epoch, at a per-site epoch counter that runs on across rounds;
* ``val/<metric>`` once per round (``step`` = the round) for the numeric validation metrics (accuracy,
  balanced_accuracy, auc, ...); confusion matrices and anything that is not a finite number are left out.

No file name, path, identifier or text ever becomes a tag or a value: tags are fixed prefixes plus metric names
from a fixed set of characters, values are floats.
"""
from __future__ import annotations

import math
import re

LOSS_KEYS = {"loss": "train/loss", "finetune_loss": "finetune/loss"}
_NAME = re.compile(r"^[A-Za-z0-9_]{1,40}$")


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def tracking_scalars(metrics: dict, rnd: int, epoch_step: int = 0) -> tuple[list[tuple[str, float, int]], int]:
    """Scalars of one task answer.

    Args:
        metrics: the task's metrics (``{"loss": [per-epoch floats], "val": {name: number, ...}, ...}``).
        rnd: the round (step of the validation scalars), >= 0.
        epoch_step: the site's epoch counter before this task (step of the first loss value).
    Returns:
        (``[(tag, value, step), ...]``, the epoch counter after this task).
    """
    out = []
    step = int(epoch_step)
    for key, tag in LOSS_KEYS.items():
        losses = metrics.get(key)
        if isinstance(losses, (list, tuple)):
            for v in losses:
                x = _number(v)
                step += 1
                if x is not None:
                    out.append((tag, x, step))
    val = metrics.get("val")
    if isinstance(val, dict):
        for name, v in sorted(val.items()):
            x = _number(v)
            if x is not None and _NAME.match(str(name)):
                out.append((f"val/{name}", x, int(rnd)))
    return out, step
