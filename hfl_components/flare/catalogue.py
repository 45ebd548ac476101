"""Per-method defaults, one source (issue 14; the seed of the method catalogue).

The simulator (``cxr-hfl simulate``/``export-job``), ``cxr-hfl compare``'s epoch budgets and the sites themselves
(a hospital config that leaves ``local_epochs`` / ``finetune_epochs`` out) all read these values, so an exported job
trains exactly as long as the simulator does. Only plain data here: no NVFlare, torch or data imports.

Values (the simulator's, which the site configs used to contradict with 2 / 2 epochs for OHFL):

======== ======= ====== ============ ===============
method   labels  rounds local_epochs finetune_epochs
======== ======= ====== ============ ===============
local    binary  3      2            10 (unused)
fedavg   binary  3      2            10 (unused)
ohfl     binary  3 (*)  20           10
fedsaf   subtype 20     1            10 (unused)
fedproto subtype 20     1            10 (unused)
fedtopo  subtype 20     1            10 (unused)
======== ======= ====== ============ ===============

(*) OHFL is one-shot: the server runs one upload and one fine-tuning step whatever ``rounds`` says.

Prototype methods (issue 16): 20 rounds x 1 local epoch, chosen on the sites' validation splits with their other
training defaults (Adam 0.001, cosine lr over the rounds, class-balanced sampling, 64 px; ``nvflare_jobs.profiles.PROTO_TRAINING``; ``benchmarks/results/proto_tuning.md``).
"""
from __future__ import annotations

PROTOTYPE_METHODS: tuple[str, ...] = ("fedsaf", "fedproto", "fedtopo")

_BASE = {"labels": "binary", "rounds": 3, "local_epochs": 2, "finetune_epochs": 10}
_PROTO = {"labels": "subtype", "rounds": 20, "local_epochs": 1, "finetune_epochs": 10}
METHOD_DEFAULTS: dict[str, dict] = {
    "local": dict(_BASE),
    "fedavg": dict(_BASE),
    "ohfl": {**_BASE, "local_epochs": 20},
    **{m: dict(_PROTO) for m in PROTOTYPE_METHODS},
}
METHODS: tuple[str, ...] = tuple(METHOD_DEFAULTS)


def method_defaults(method: str) -> dict:
    """A copy of ``{"labels", "rounds", "local_epochs", "finetune_epochs"}`` for a method.

    Raises:
        ValueError: unknown method (the message lists the known ones).
    """
    if method not in METHOD_DEFAULTS:
        raise ValueError(f"unknown method {method!r}; known: {list(METHODS)}")
    return dict(METHOD_DEFAULTS[method])
