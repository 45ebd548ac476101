"""Where a site trains and evaluates, and where the server fuses: ``auto | cpu | cuda | cuda:N``.

``auto`` is the first CUDA device when one is present, else the CPU. The names are PyTorch's own device strings
(``torch.device``); nothing else is accepted, so a typo in a site config fails when the config is read rather than
half-way through a job.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported inside the functions that need it: checking a name needs no torch
    import torch

DEVICE_CHOICES = "auto | cpu | cuda | cuda:N"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(name) -> str:
    """Check the syntax of a device setting without touching any GPU.

    Returns:
        the name, stripped and lower-cased (``auto``, ``cpu``, ``cuda`` or ``cuda:N``).

    Raises:
        ValueError: anything else (the message lists the accepted values).
    """
    s = str(name).strip().lower() if isinstance(name, str) else None
    if not s or not _DEVICE_RE.match(s):
        raise ValueError(f"must be one of {DEVICE_CHOICES}, got {name!r}")
    return s


def resolve_device(name: str | None = "auto") -> torch.device:
    """The ``torch.device`` for a device setting (None = ``auto``).

    ``auto`` -> ``cuda`` (device 0) when ``torch.cuda.is_available()``, else ``cpu``. ``cuda`` / ``cuda:N`` must
    name a GPU that this process can see.

    Raises:
        ValueError: a malformed name, CUDA requested where PyTorch sees no GPU (e.g. the CPU build of torch is
            installed), or ``cuda:N`` with N >= the number of visible GPUs.
    """
    import torch

    s = check_device_name("auto" if name is None else name)
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if s == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = torch.__version__
        raise ValueError(f"device {s}: PyTorch {build} sees no CUDA GPU here (CPU build of torch, no driver, or "
                         "CUDA_VISIBLE_DEVICES empty); install the CUDA build of torch or use device: auto/cpu")
    dev = torch.device(s)
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise ValueError(f"device {s}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")
    return dev


def describe_device(dev: torch.device) -> str:
    """One line naming a device, e.g. ``cuda:0 (NVIDIA H200, 139.8 GiB)`` or ``cpu``."""
    import torch

    dev = torch.device(dev)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        return f"cuda:{idx} ({p.name}, {p.total_memory / 2**30:.1f} GiB)"
    return "cpu"
