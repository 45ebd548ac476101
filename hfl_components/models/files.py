"""The saved-model file: one writer (:func:`save_model_file`) and one reader (:func:`load_model_file`).

A model file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file: the weights as named tensors, and in
the safetensors metadata one JSON header under the key ``"cxr_hfl_model"``::

    {"format_version": 1,
     "spec": {...},                       # the model spec (hfl_components.models.registry), rebuilt on load
     "input_size": 64 | null,             # side in pixels the model was trained at (null: global model, no own size)
     "aspect": "stretch" | "letterbox" | "crop" | null,  # how its site made images square (null: not recorded)
     "labels": "binary" | "subtype" | null, "class_names": [...] | null,   # owner: chest_xray.labels
     "site": "site-1" | null, "kind": "deployed" | "local" | "state" | "global" | null,
     "weights_sha256": "...",             # over (name, dtype, shape, bytes) of every tensor, names sorted
     "provenance": {"method": ..., "seed": ..., "code_version": ..., "manifest_sha256": ..., "dp": ...},
     "operating_point": {"temperature": ..., "threshold": ..., "target": ...},  # only when set (deployed OHFL)
     "population": {...}}                 # only when set: hfl_components.shift.build_reference

Reading never unpickles anything (no ``torch.load``): a file written by ``torch.save`` (the format before this one)
is refused with a message saying so. A file whose weights do not match its hash, its spec, or whose label scheme
does not match the model's class count is refused with a one-line ``ValueError`` naming the file.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

HEADER_KEY = "cxr_hfl_model"
FORMAT_VERSION = 1
_PROVENANCE_KEYS = ("method", "seed", "code_version", "manifest_sha256", "dp")
_EXAMPLE = "e.g. RUN/models/site-1_deployed.pt"


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file's bytes (used for the site manifest in a model file's provenance)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``"cxr-hfl <version>"``, plus ``"+g<commit>"`` (and ``".dirty"``) when the code runs from a git checkout."""
    try:
        from importlib.metadata import version

        out = f"cxr-hfl {version('cxr-hfl')}"
    except Exception:  # noqa: BLE001 - not installed (PYTHONPATH checkout)
        out = "cxr-hfl (not installed)"
    repo = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if sha.returncode == 0 and sha.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                                   timeout=10).returncode != 0
            out += f"+g{sha.stdout.strip()}" + (".dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """State dict of tensors or numpy arrays -> contiguous CPU tensors that share no memory (safetensors needs it)."""
    return {str(k): torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).detach().cpu()
            .contiguous().clone() for k, v in state_dict.items()}


def weights_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over ``(name, dtype, shape, raw bytes)`` of every tensor, in sorted name order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_model_file(path: str | os.PathLike, spec: dict, state_dict: Mapping[str, Any], *,
                    input_size: int | None = None, labels: str | None = None, site: str | None = None,
                    kind: str | None = None, provenance: Mapping[str, Any] | None = None,
                    aspect: str | None = None, operating_point: Mapping[str, Any] | None = None,
                    population: Mapping[str, Any] | None = None) -> Path:
    """Write a model file (safetensors weights + JSON header, see the module docstring); atomic (temp + rename).

    Args:
        path: file to write (its folder must exist).
        spec: JSON-able model spec, checked with :func:`~hfl_components.models.registry.validate_spec`.
        state_dict: ``{name: torch.Tensor | np.ndarray}`` of the model built from ``spec``.
        input_size: the side in pixels the model expects (``None`` for the fused global model).
        labels: label scheme (``chest_xray.labels``); its class names are stored too.
        site, kind: who wrote it and what it is (``deployed`` / ``local`` / ``state`` / ``global``).
        aspect: how the site made non-square images square (``chest_xray.ASPECTS``; the site-config key
            ``aspect``), so that ``evaluate`` / ``predict`` feed it images the same way; None: not recorded
            (readers use ``chest_xray.DEFAULT_ASPECT``).
        operating_point: a deployed model's ``{"temperature", "threshold", "target", ...}``
            (:mod:`hfl_components.operating_point`); stored in the header only when given.
        population: the training population's summary (:func:`hfl_components.shift.build_reference`), which
            ``predict`` compares each batch with; stored in the header only when given.
        provenance: any of ``method``, ``seed``, ``code_version`` (default :func:`code_version`),
            ``manifest_sha256`` (the site's manifest, :func:`file_sha256`), ``dp`` (the site's DP-SGD record,
            ``hfl_components.flare.site_tasks.SiteRuntime.dp_record``: ``{"dp": False}`` or the accountant's epsilon,
            delta, noise multiplier, sample rate and steps).

    Returns:
        The path written.

    Raises:
        ValueError: bad spec, unknown label scheme, labels whose class count differs from ``spec["num_classes"]``,
            unknown provenance keys, unknown aspect.
    """
    from hfl_components.models.registry import resolve_spec

    n_out = resolve_spec(spec)["num_classes"]
    class_names = None
    if labels is not None:
        from chest_xray.labels import class_names as scheme_names

        class_names = scheme_names(labels)
        if n_out != len(class_names):
            raise ValueError(f"{path}: label scheme {labels!r} has {len(class_names)} classes, the model {n_out}")
    if aspect is not None:
        from chest_xray import ASPECTS

        if aspect not in ASPECTS:
            raise ValueError(f"{path}: aspect must be one of {', '.join(ASPECTS)}, got {aspect!r}")
    prov = dict(provenance or {})
    unknown = sorted(set(prov) - set(_PROVENANCE_KEYS))
    if unknown:
        raise ValueError(f"unknown provenance key(s) {unknown}; known: {list(_PROVENANCE_KEYS)}")
    prov.setdefault("code_version", code_version())
    tensors = _tensors(state_dict)
    header = {"format_version": FORMAT_VERSION, "spec": spec,
              "input_size": None if input_size is None else int(input_size), "aspect": aspect, "labels": labels,
              "class_names": class_names, "site": site, "kind": kind, "weights_sha256": weights_sha256(tensors),
              "provenance": {k: prov.get(k) for k in _PROVENANCE_KEYS}}
    if operating_point is not None:
        header["operating_point"] = dict(operating_point)
    if population is not None:
        header["population"] = dict(population)
    from safetensors.torch import save_file

    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    save_file(tensors, str(tmp), metadata={HEADER_KEY: json.dumps(header, sort_keys=True)})
    os.replace(tmp, p)
    return p


def _refuse_legacy(p: Path) -> None:
    with open(p, "rb") as f:
        head = f.read(9)
    # a safetensors file: 8-byte little-endian header length, then the JSON header; its first byte is that length's
    # low byte, which is 0x80 for 1 header length in 256 -- not a pickle
    n = int.from_bytes(head[:8], "little")
    if head[8:9] == b"{" and 8 + n <= p.stat().st_size:
        return
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save zip archive / raw pickle
        raise ValueError(f"{p}: a model file in the old torch.save (pickle) format, which this version no longer "
                         f"reads (it never unpickles); run the job again to write it in the current format")


def read_model_header(path: str | os.PathLike) -> dict:
    """The JSON header of a model file without loading the weights.

    Raises:
        FileNotFoundError: no such file. ValueError (naming the file): a folder, an old ``torch.save`` file, not a
            safetensors file, no cxr-hfl header, a format version this code does not read, or an
            ``operating_point`` without a temperature > 0 or with a threshold outside [0, 1] (an edited header).
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p}: is a folder, not a model file ({_EXAMPLE})")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such model file")
    _refuse_legacy(p)
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - any parse error of a file that is not a (complete) model file
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"{p}: not a cxr-hfl model file (cannot read it as safetensors: {first}); expected a file "
                         f"written by cxr-hfl, {_EXAMPLE}") from None
    if HEADER_KEY not in meta:
        raise ValueError(f"{p}: not a cxr-hfl model file (a safetensors file without the {HEADER_KEY!r} header)")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: corrupt model file header ({e})") from None
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        got = header.get("format_version") if isinstance(header, dict) else None
        raise ValueError(f"{p}: model file format version {got!r}, this code reads version {FORMAT_VERSION}")
    if (why := _operating_point_problem(header.get("operating_point"))) is not None:
        raise ValueError(f"{p}: corrupt model file header: its operating_point {why}")
    return header


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _operating_point_problem(op) -> str | None:
    """What is wrong with a header's ``operating_point`` (None: absent or well formed): an object whose
    ``temperature`` is a finite number > 0 and whose ``threshold`` is null or a number in [0, 1]."""
    if op is None:
        return None
    if not isinstance(op, dict):
        return f"is a {type(op).__name__}, not an object"
    t, thr = op.get("temperature"), op.get("threshold")
    if not _number(t) or not t > 0:
        return f"has temperature {t!r}, not a number > 0"
    if thr is not None and not (_number(thr) and 0 <= thr <= 1):
        return f"has threshold {thr!r}, not null or a number in [0, 1]"
    return None


def load_model_file(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """Read a model file written by :func:`save_model_file` and rebuild the model.

    Returns:
        ``(model in eval mode, header)``; the header has ``spec``, ``input_size``, ``labels``, ``class_names``,
        ``site``, ``kind``, ``weights_sha256`` and ``provenance`` (see the module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError (one line naming the file): anything :func:`read_model_header` refuses; weights whose hash
            differs from the header (a corrupt file); weights that do not fit the spec; a label scheme whose class
            count differs from the model's.
    """
    from safetensors.torch import load_file

    from hfl_components.models.registry import build_model, resolve_spec

    p = Path(path)
    header = read_model_header(p)
    try:
        tensors = load_file(str(p), device="cpu")
    except Exception as e:  # noqa: BLE001 - truncated / damaged tensor data
        raise ValueError(f"{p}: corrupt model file (cannot read the weights: {type(e).__name__})") from None
    if weights_sha256(tensors) != header.get("weights_sha256"):
        raise ValueError(f"{p}: corrupt model file (the weights do not match the hash in its header)")
    spec = header.get("spec")
    try:
        model = build_model(spec)
        model.load_state_dict(tensors)
    except Exception as e:  # noqa: BLE001 -- a spec / weights mismatch is a bad file, not a crash
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"{p}: model file does not match its own spec ({type(e).__name__}: {first})") from None
    names = header.get("class_names")
    n_out = resolve_spec(spec)["num_classes"]
    if names is not None and len(names) != n_out:
        raise ValueError(f"{p}: label scheme {header.get('labels')!r} has {len(names)} classes, the model {n_out}")
    model.eval()
    return model, header
