"""Benchmark: do the CUDA paths give the CPU's numbers, and how much faster are they here (not a test).

A hospital's engineer runs it on the machine that is to train with ``device: cuda`` in its site config, before the
site joins a job. Nothing is read from disk: the models are the catalogue's, the images random tensors, and the
site runtime reads synthetic JPEGs it writes under a temporary folder (Kaggle layout ``train|val|test/NORMAL|
PNEUMONIA``).

Part 1, checks (each on the GPU against the CPU; same seeds; float32 unless said; tolerances as
``tests/test_site_ops.py::test_cuda_site_training_and_fusion_match_cpu``):

* ``train_local``: losses per epoch and final weights of a small cnn (with the GPU's default TF32 settings, and
  with TF32 off);
* ``amp``: float16 autocast with a gradient scaler on the GPU gives finite losses within 5 % of float32;
* ``fusion``: ``aggregate_models(..., device="cuda")`` (CKA probe passes and activation repair on the GPU) gives
  the CPU's fused state dict, as CPU tensors;
* ``batch_augment``: the batch flip + affine on the GPU equals the CPU's for the same drawn parameters;
* ``distillation``: the server's distillation loop on the GPU gives the CPU's held-aside losses;
* ``dp``: an Opacus DP-SGD epoch (``train_local(..., dp=DPSession)``) runs on the GPU with finite weights and the
  CPU's step count and epsilon (the noise comes from the device's own generator, so the weights are not compared);
  skipped when Opacus is not installed;
* ``site_runtime``: a ``SiteRuntime`` with ``device: cuda`` trains (augment ``monai`` and ``batch``) with the
  CPU's losses, evaluates, saves CPU tensors; with ``amp: true`` its losses are finite; with ``dp`` it trains
  under DP-SGD on the GPU (when Opacus is installed).

Part 2, timings (seconds, after warm-up steps; on the GPU every step ends with ``loss.item()``, a synchronisation):
seconds per ``train_local`` step for the catalogue's site models at their input sizes (``bench_dp.specs_at_sizes``:
the main job's cnn depths and the prototype pool's backbones) on the CPU (float32), the GPU (float32) and the GPU
(amp); OHFL's fusion of six He-random uploads of the main job's shapes with the catalogue's defaults; distillation
steps; DP-SGD steps. Each is printed with its CPU / GPU ratio.

Without a CUDA GPU the checks are reported as skipped (``no CUDA``) and only the CPU is timed. ``--out`` writes
everything as JSON. ``--quick`` shrinks every size (a smoke run, used by the tests).

    python -m benchmarks.bench_gpu [--out gpu.json] [--steps 20] [--threads N] [--quick]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from nvflare_jobs.commands.simulate import at_least

RTOL, ATOL = 1e-3, 1e-4  # float32 CPU vs GPU (the GPU test's tolerances)
AMP_RTOL = 0.05  # float16 autocast vs float32
SITE_SHAPES = [("shallow", 64), ("shallow", 64), ("medium", 96), ("medium", 96), ("deep", 128), ("deep", 128)]


# ----------------------------------------------------------------------------------------------- helpers
def cuda_device() -> str | None:
    """``"cuda"`` when PyTorch sees a GPU, else None."""
    return "cuda" if torch.cuda.is_available() else None


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def as_float64(x) -> np.ndarray:
    """A tensor (any device) or a list / array of numbers as a float64 NumPy array (Python floats keep their
    precision)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def max_rel_diff(a, b, atol: float = ATOL) -> float:
    """``max |a - b| / (atol + |b|)`` over all elements (0 for equal arrays): the smallest ``rtol`` at which
    ``allclose(a, b, rtol, atol)`` holds is at most this value."""
    a, b = as_float64(a), as_float64(b)
    if not a.size:
        return 0.0
    d = np.abs(a - b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(d == 0, 0.0, d / (atol + np.abs(b)))))


def close(a, b, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """``numpy.allclose`` on two tensors / arrays / lists (moved to the CPU)."""
    a, b = as_float64(a), as_float64(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


def state_close(sa: dict, sb: dict, rtol: float = RTOL, atol: float = ATOL) -> tuple[bool, float]:
    """Whether two state dicts are close key by key, and the largest :func:`max_rel_diff` (float entries only)."""
    worst, ok = 0.0, set(sa) == set(sb)
    for k in sa:
        if k not in sb or not torch.is_floating_point(torch.as_tensor(sa[k])):
            continue
        ok = ok and close(sb[k], sa[k], rtol, atol)
        worst = max(worst, max_rel_diff(sb[k], sa[k], atol))
    return ok, worst


def toy_batches(n: int, size: int, batch: int = 8, seed: int = 0) -> list:
    """``n`` random (1, size, size) images in batches, labels alternating, class 1 brighter by 0.5."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, size, size, generator=g)
    y = torch.tensor([i % 2 for i in range(n)])
    x[y == 1] += 0.5
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def small_cnn(seed: int = 0, depth: str = "shallow", width: float = 0.5):
    from hfl_components.models import build_model

    torch.manual_seed(seed)
    return build_model({"family": "cnn", "depth": depth, "width": width, "in_channels": 1, "num_classes": 2})


@contextmanager
def tf32(enabled: bool | None):
    """Inside the block, TF32 for CUDA matrix products and cuDNN convolutions is ``enabled`` (None: as it is;
    PyTorch's default is on for cuDNN, off for matrix products)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if enabled is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def tf32_variants(dev: str) -> list[tuple[str, bool | None]]:
    """``[("default", None)]``, plus ``("tf32_off", False)`` on a GPU (the strict comparison comes last)."""
    return [("default", None)] + ([("tf32_off", False)] if torch.device(dev).type == "cuda" else [])


def skipped(name: str, why: str) -> dict:
    return {"name": name, "ok": None, "skipped": why}


# ----------------------------------------------------------------------------------------------- part 1: checks
def check_train_local(dev: str, size: int = 32, epochs: int = 2) -> dict:
    """float32 ``train_local`` on ``dev`` against the CPU: per-epoch losses and final weights."""
    from hfl_components.training import train_local

    data = toy_batches(24, size)
    ref_m = small_cnn()
    ref = [h["loss"] for h in train_local(ref_m, data, epochs, lr=0.01, seed=0, device="cpu")]
    out = {"name": "train_local", "cpu_losses": ref}
    ok = True
    for label, on in tf32_variants(dev):
        m = small_cnn()
        with tf32(on):
            got = [h["loss"] for h in train_local(m, data, epochs, lr=0.01, seed=0, device=dev)]
        w_ok, w_diff = state_close(ref_m.state_dict(), m.state_dict())
        l_ok = close(got, ref)
        out[label] = {"losses": got, "losses_close": l_ok, "loss_max_rel_diff": max_rel_diff(got, ref),
                      "weights_close": w_ok, "weights_max_rel_diff": w_diff,
                      "params_on": str(next(m.parameters()).device)}
        ok = ok and l_ok and (label != "default" or str(next(m.parameters()).device).startswith(dev))
    out["ok"] = ok
    return out


def check_amp(dev: str, size: int = 32, epochs: int = 2) -> dict:
    """Mixed precision on ``dev`` (float16 + GradScaler on CUDA, bfloat16 on the CPU) against float32 on the CPU."""
    from hfl_components.training import train_local

    data = toy_batches(24, size)
    ref = [h["loss"] for h in train_local(small_cnn(), data, epochs, lr=0.01, seed=0, device="cpu")]
    m = small_cnn()
    got = [h["loss"] for h in train_local(m, data, epochs, lr=0.01, seed=0, device=dev, amp=True)]
    finite = bool(np.all(np.isfinite(got)))
    ok = finite and close(got, ref, rtol=AMP_RTOL, atol=0.0) and all(p.dtype == torch.float32 for p in m.parameters())
    return {"name": "amp", "ok": ok, "cpu_float32_losses": ref, "amp_losses": got, "finite": finite,
            "loss_max_rel_diff": max_rel_diff(got, ref, atol=0.0), "rtol": AMP_RTOL,
            "autocast_dtype": "float16" if torch.device(dev).type == "cuda" else "bfloat16"}


def he_uploads(k: int, width: float = 1.0, shapes=None) -> list[dict]:
    """``k`` He-random uploads of the main job's cnn shapes (depth, input size) cycling, sample counts 100 + i."""
    from hfl_components.models.fusable import build_fusable

    shapes = shapes or SITE_SHAPES
    out = []
    for i in range(k):
        depth, size = shapes[i % len(shapes)]
        spec = {"family": "cnn", "depth": depth, "width": width, "in_channels": 1, "num_classes": 2}
        torch.manual_seed(1000 + i)
        m = build_fusable(spec)
        with torch.no_grad():
            m.classifier.weight.normal_(0, 0.05)  # a zero class layer would make every teacher output 50:50
        out.append({"name": f"site-{i + 1}", "spec": spec, "state_dict": m.state_dict(), "n_samples": 100 + i,
                    "val_acc": 0.5, "val_auc": None, "input_size": size})
    return out


def probe_at(sizes, n: int, seed: int = 0) -> dict:
    """The same ``n`` random images at every size (generated, as ``load_probe("generated", ...)``)."""
    from hfl_components.flare.probe import load_probe

    return {s: load_probe("generated", s, n, seed=seed) for s in sorted(set(sizes))}


def fuse(uploads: list[dict], probe: dict, dev: str):
    """OHFL's fusion with the catalogue's defaults, the probe passes on ``dev``: ``(spec, state_dict, record,
    seconds)``."""
    from hfl_components.flare import catalogue
    from hfl_components.fusion import aggregate_models

    o = catalogue.option_defaults("ohfl")
    t0 = time.perf_counter()
    spec, sd, rec = aggregate_models(uploads, strategy=o["strategy"], probe=probe, alignment=o["alignment"],
                                     ot_solver=o["ot"], ground_metric=o["ground_metric"], weighting=o["weighting"],
                                     seed=0, repair=o["repair"], cka=o["cka"], device=dev)
    _sync(dev)
    return spec, sd, rec, time.perf_counter() - t0


def fused_outputs(spec: dict, sd: dict, probe: dict) -> dict:
    """The fused model's logits on the CPU for the probe at every size ({size: (n, classes)}): equal functions give
    equal outputs even where two fusions ordered their neurons differently."""
    from hfl_components.models import build_model

    m = build_model(spec)
    m.load_state_dict(sd)
    m.eval()
    with torch.no_grad():
        return {s: m(x) for s, x in probe.items()}


def pair_differences(ra: dict, rb: dict) -> dict:
    """Where two fusion records part: the same join order, the same layer maps and balancing per pair, the largest
    relative difference of a layer's transport cost, and the first differing field (None: none)."""
    first, worst = None, 0.0
    if ra["order"] != rb["order"]:
        first = "order"
    for pa, pb in zip(ra["pairs"], rb["pairs"]):
        for key in ("layer_map", "balancing"):
            if first is None and pa[key] != pb[key]:
                first = f"pair {pa['step']} {key}: {pa[key]} vs {pb[key]}"
        for la, lb in zip(pa["layers"], pb["layers"]):
            if first is None and la.get("plan") != lb.get("plan"):
                first = f"pair {pa['step']} layer {la['layer']} plan: {la.get('plan')} vs {lb.get('plan')}"
            if la.get("transport_cost") is not None and lb.get("transport_cost") is not None:
                worst = max(worst, max_rel_diff([lb["transport_cost"]], [la["transport_cost"]], atol=1e-12))
    return {"same_layer_maps": all(pa["layer_map"] == pb["layer_map"] for pa, pb in zip(ra["pairs"], rb["pairs"])),
            "transport_cost_max_rel_diff": worst, "first_difference": first}


def fusion_case(ups: list[dict], probe: dict, dev: str) -> dict:
    """One fusion case, CPU vs ``dev`` (each TF32 variant): weights, the fused function's outputs, the records."""
    spec_c, sd_c, rec_c, _ = fuse(ups, probe, "cpu")
    outs_c = fused_outputs(spec_c, sd_c, probe)
    case = {}
    for label, on in tf32_variants(dev):
        with tf32(on):
            spec_d, sd_d, rec_d, _ = fuse(ups, probe, dev)
        w_ok, w_diff = state_close(sd_c, sd_d) if spec_d == spec_c else (False, float("inf"))
        outs_d = fused_outputs(spec_d, sd_d, probe)
        case[label] = {"weights_close": w_ok, "weights_max_rel_diff": w_diff,
                       "outputs_close": all(close(outs_d[s], outs_c[s]) for s in outs_c),
                       "outputs_max_rel_diff": max(max_rel_diff(outs_d[s], outs_c[s]) for s in outs_c),
                       "returned_on_cpu": all(not torch.as_tensor(v).is_cuda for v in sd_d.values()),
                       **pair_differences(rec_c, rec_d)}
    return case


def check_fusion(dev: str, quick: bool = False) -> dict:
    """The fused model of two small cnns (the GPU test's case) and of the main job's six shapes, CPU vs ``dev``.
    ``ok``: the weights equal the CPU's with TF32 off (on the GPU) and come back as CPU tensors; the GPU's default
    TF32 result is reported beside it."""
    out = {"name": "fusion"}
    ok = True
    cases = [("two_cnn_width_0.5", he_uploads(2, 0.5, [("shallow", 32), ("medium", 32)]), 16)]
    if not quick:
        cases.append(("six_main_job_shapes", he_uploads(6), 64))
    for label, ups, n in cases:
        out[label] = case = fusion_case(ups, probe_at([u["input_size"] for u in ups], n), dev)
        strict = case[tf32_variants(dev)[-1][0]]
        ok = ok and strict["weights_close"] and all(v["returned_on_cpu"] for v in case.values())
    out["ok"] = ok
    return out


def check_batch_augment(dev: str, n: int = 64, size: int = 64) -> dict:
    """``batch_augment`` on ``dev`` against the CPU for the same drawn parameters (float32; float16 keeps its
    dtype)."""
    from chest_xray.batch_augment import batch_augment, sample_augment_params

    x = torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(3))
    p = sample_augment_params(n, size, size, generator=torch.Generator().manual_seed(4))
    ref = batch_augment(x, params=p)
    got = batch_augment(x.to(dev), params=p)
    half = batch_augment(x.to(dev).half(), params=p)
    ok = close(got, ref, rtol=0.0, atol=1e-5) and got.device.type == torch.device(dev).type
    ok = ok and half.dtype == torch.float16
    return {"name": "batch_augment", "ok": ok, "max_abs_diff": float((got.cpu() - ref).abs().max()),
            "atol": 1e-5, "float16_kept": half.dtype == torch.float16}


def distil(uploads: list[dict], probe: dict, dev: str, steps: int):
    """The server's distillation (``distill_stage.distil_groups``) of ``uploads`` into one cnn student on ``dev``:
    ``(record, seconds)``. Early stopping off, so exactly ``steps`` steps run."""
    from hfl_components.flare import catalogue
    from hfl_components.flare import distill_stage as ds
    from hfl_components.fusion.distill import DistillConfig, distill

    o = catalogue.option_defaults("ohfl")
    teachers = ds.teachers_of({u["name"]: u for u in uploads})
    weights = ds.weights_of({u["name"]: u for u in uploads}, o["distill_weights"])
    student = small_cnn(seed=7, depth=uploads[0]["spec"]["depth"], width=uploads[0]["spec"]["width"])
    sizes = sorted({u["input_size"] for u in uploads})
    cfg = DistillConfig(steps=steps, temperature=float(o["distill_temperature"]), patience=0,
                        eval_every=max(1, steps // 2), seed=0)
    t0 = time.perf_counter()
    rec = distill(student, sizes, teachers, probe, weights, cfg, device=dev).as_dict()
    _sync(dev)
    return rec, time.perf_counter() - t0


def check_distillation(dev: str, steps: int = 10) -> dict:
    """Held-aside losses of a short distillation (two small teachers, 32 px), CPU vs ``dev`` (each TF32 variant).
    ``ok``: equal to the CPU's with TF32 off (on the GPU); the GPU's default TF32 result is reported beside it."""
    ups = he_uploads(2, 0.5, [("shallow", 32), ("medium", 32)])
    probe = probe_at([32], 64)
    cpu, _ = distil(ups, probe, "cpu", steps)
    a = [cpu["initial_val_loss"]] + [v for _, v in cpu["val_loss"]]
    out = {"name": "distillation", "cpu_val_losses": a, "steps": steps}
    for label, on in tf32_variants(dev):
        with tf32(on):
            got, _ = distil(ups, probe, dev, steps)
        b = [got["initial_val_loss"]] + [v for _, v in got["val_loss"]]
        out[label] = {"val_losses": b, "close": close(b, a) and got["steps_run"] == cpu["steps_run"] == steps,
                      "max_rel_diff": max_rel_diff(b, a), "initial_rel_diff": max_rel_diff(b[:1], a[:1])}
    out["ok"] = out[tf32_variants(dev)[-1][0]]["close"]
    return out


def opacus_missing() -> str | None:
    """Why DP-SGD cannot run here (Opacus not importable), or None."""
    try:
        import opacus  # noqa: F401
    except ImportError as e:
        return f"opacus not importable ({e})"
    return None


def dp_epoch(dev: str, size: int, n: int, batch: int = 16, spec: dict | None = None):
    """One DP-SGD epoch of ``train_local`` on ``dev`` (Opacus, epsilon 8, RDP accountant, seeded noise) over ``n``
    random images: ``(model, session, seconds per step)``."""
    from torch.utils.data import DataLoader, TensorDataset

    from hfl_components.models import build_model
    from hfl_components.privacy import DPSession, DPSpec, check_budget, make_compatible
    from hfl_components.training import train_local

    torch.manual_seed(0)
    spec = spec or {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    model, _ = make_compatible(build_model(spec), size)
    x, y = torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(1)), torch.arange(n) % 2
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    session = DPSession(check_budget(n, batch, 1, DPSpec(epsilon=8.0, accountant="rdp"), "bench"), seed=0)
    t0 = time.perf_counter()
    train_local(model, loader, 1, dp=session, device=dev)
    _sync(dev)
    return model, session, (time.perf_counter() - t0) / max(1, session.steps_done)


def check_dp(dev: str, size: int = 32, n: int = 64) -> dict:
    """An Opacus DP-SGD epoch on ``dev``: finite weights on ``dev``, the CPU's step count and epsilon."""
    why = opacus_missing()
    if why:
        return skipped("dp", why)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    m_cpu, s_cpu, _ = dp_epoch("cpu", size, n)
    m_dev, s_dev, _ = dp_epoch(dev, size, n)
    finite = all(bool(torch.isfinite(p).all()) for p in m_dev.parameters())
    on_dev = next(m_dev.parameters()).device.type == torch.device(dev).type
    eps = (s_cpu.epsilon(), s_dev.epsilon())
    ok = finite and on_dev and s_cpu.steps_done == s_dev.steps_done and math.isclose(*eps, rel_tol=1e-9)
    return {"name": "dp", "ok": ok, "finite": finite, "params_on": str(next(m_dev.parameters()).device),
            "steps": [s_cpu.steps_done, s_dev.steps_done], "epsilon": list(eps)}


def synthetic_site(root: Path, side: int = 64, per_class: dict | None = None, seed: int = 0) -> Path:
    """Synthetic grey JPEGs in a Kaggle layout ``root/<split>/<NORMAL|PNEUMONIA>/`` (PNEUMONIA brighter) and a
    site manifest ``root/site.csv`` (path, label, split, patient_id); returns the manifest."""
    from PIL import Image

    per_class = per_class or {"train": 8, "val": 2, "test": 4}
    rng = np.random.default_rng(seed)
    rows = []
    for split, n in per_class.items():
        for label, cls in enumerate(("NORMAL", "PNEUMONIA")):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                a = rng.random((side, side + side // 4)) * 120 + 40 + 60 * label
                f = d / f"{cls.lower()}-{split}-{k}.jpeg"
                Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(f, quality=90)
                rows.append([str(f), label, split, f"patient-{split}-{cls}-{k}"])
    man = root / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        w.writerows(rows)
    return man


def site_run(manifest: Path, workdir: Path, device: str, epochs: int, input_size: int, threads: int,
             **keys) -> dict:
    """A ``SiteRuntime`` (the site's own model) on ``manifest``: train ``epochs`` epochs, evaluate the test split,
    save the deployed model and read it back (``saved_on_cpu``: it loads on the CPU with the weights the runtime
    holds); what came out (losses, metrics, devices)."""
    from hfl_components.flare.site_config import validate_site_config
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import load_model_file

    raw = {"data": {"manifest": str(manifest), "labels": "binary"},
           "model": {"family": "cnn", "depth": "shallow", "width": 0.5}, "input_size": input_size,
           "batch_size": 4, "threads": threads, "seed": 0, "device": device, **keys}
    rt = SiteRuntime(validate_site_config(raw, "hospital-a"), workdir)
    hist = rt.train(epochs, 0.01)
    params_on = str(next(rt.model.parameters()).device)
    ev = rt.evaluate("test")
    rt.save_state(deployed=True)
    saved, _ = load_model_file(rt.state_dir / "deployed_model.pt")  # safetensors: read as CPU tensors
    same, _ = state_close({k: v.cpu() for k, v in rt.eval_model.state_dict().items()}, saved.state_dict(), 0.0, 0.0)
    return {"losses": [h["loss"] for h in hist], "params_on": params_on, "runtime_device": str(rt.device),
            "test_n": ev["n"], "test_auc": ev["auc"], "test_balanced_accuracy": ev["balanced_accuracy"],
            "saved_on_cpu": same and all(not v.is_cuda for v in saved.state_dict().values()),
            "dp": rt.dp_record() if keys.get("dp") else None}


def check_site_runtime(dev: str, threads: int, quick: bool = False) -> dict:
    """``SiteRuntime`` with ``device: <dev>`` against ``device: cpu`` on synthetic JPEGs (augment monai and batch,
    float32: the same losses); with ``amp: true`` (finite losses) and with ``dp`` (when Opacus is installed)."""
    size, epochs = (32, 1) if quick else (64, 2)
    out: dict = {"name": "site_runtime", "input_size": size, "epochs": epochs}
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench_gpu_site_") as tmp:
        man = synthetic_site(Path(tmp) / "kaggle", side=size + 16)
        for aug in ("monai", "batch"):
            cpu = site_run(man, Path(tmp) / f"cpu-{aug}", "cpu", epochs, size, threads, augment=aug)
            got = site_run(man, Path(tmp) / f"dev-{aug}", dev, epochs, size, threads, augment=aug)
            same = close(got["losses"], cpu["losses"]) and got["params_on"].startswith(dev) and got["saved_on_cpu"]
            out[f"augment_{aug}"] = {"cpu": cpu, "device": got, "losses_close": same,
                                     "loss_max_rel_diff": max_rel_diff(got["losses"], cpu["losses"])}
            ok = ok and same
        amp = site_run(man, Path(tmp) / "dev-amp", dev, epochs, size, threads, amp=True)
        out["amp"] = dict(amp, finite=bool(np.all(np.isfinite(amp["losses"]))))
        ok = ok and out["amp"]["finite"] and amp["params_on"].startswith(dev) and amp["saved_on_cpu"]
        if opacus_missing() is None:
            dp = site_run(man, Path(tmp) / "dev-dp", dev, epochs, size, threads, dp={"epsilon": 8.0})
            out["dp"] = dp
            ok = ok and dp["params_on"].startswith(dev) and dp["saved_on_cpu"] and dp["dp"]["dp"] is True
        else:
            out["dp"] = {"skipped": opacus_missing()}
    torch.set_num_threads(threads)  # the runtime sets the config's threads
    out["ok"] = ok
    return out


def run_checks(dev: str | None, threads: int, quick: bool) -> list[dict]:
    """Every check of part 1 on ``dev`` (skipped, all of them, when ``dev`` is None)."""
    names = ["train_local", "amp", "fusion", "batch_augment", "distillation", "dp", "site_runtime"]
    if dev is None:
        return [skipped(n, "no CUDA: PyTorch sees no GPU here") for n in names]
    calls = {"train_local": lambda: check_train_local(dev), "amp": lambda: check_amp(dev),
             "fusion": lambda: check_fusion(dev, quick), "batch_augment": lambda: check_batch_augment(dev),
             "distillation": lambda: check_distillation(dev), "dp": lambda: check_dp(dev),
             "site_runtime": lambda: check_site_runtime(dev, threads, quick)}
    out = []
    for n in names:
        t0 = time.perf_counter()
        try:
            rec = calls[n]()
        except Exception as e:  # a failing path is a result here, reported with the others
            rec = {"name": n, "ok": False, "error": f"{type(e).__name__}: {e}"}
        rec["seconds"] = time.perf_counter() - t0
        print(f"check {n:<14} {'skipped: ' + rec['skipped'] if rec.get('skipped') else ('OK' if rec['ok'] else 'FAILED')}"
              + (f"  ({rec['error']})" if rec.get("error") else ""), flush=True)
        out.append(rec)
    return out


# ----------------------------------------------------------------------------------------------- part 2: timings
def seconds_per_step(spec: dict, size: int, dev: str, steps: int, batch: int, amp: bool = False,
                     warmup: int = 3) -> float:
    """Seconds per ``train_local`` step of ``spec`` on random (batch, 1, size, size) images, after ``warmup``
    steps (each step ends with ``loss.item()``: the GPU is synchronised)."""
    from hfl_components.models import build_model
    from hfl_components.training import train_local

    torch.manual_seed(0)
    model = build_model(spec).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(batch, 1, size, size, generator=g), torch.arange(batch) % int(spec["num_classes"])
    train_local(model, [(x, y)] * warmup, 1, device=dev, amp=amp)
    _sync(dev)
    t0 = time.perf_counter()
    train_local(model, [(x, y)] * steps, 1, device=dev, amp=amp)
    _sync(dev)
    return (time.perf_counter() - t0) / steps


def _ratio(cpu: float | None, gpu: float | None) -> float | None:
    return cpu / gpu if cpu and gpu else None


def training_models(quick: bool) -> list[tuple[dict, int]]:
    """The site models timed: ``bench_dp.specs_at_sizes`` (one small cnn at 32 px with ``quick``)."""
    if quick:
        return [({"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}, 32)]
    from benchmarks.bench_dp import specs_at_sizes

    return specs_at_sizes()


def time_training(dev: str | None, steps: int, batch: int, quick: bool) -> list[dict]:
    """Seconds per training step per site model: CPU float32, GPU float32, GPU amp, and CPU / GPU ratios."""
    rows = []
    print(f"{'model':<14}{'size':>5}{'cpu s/step':>12}{'gpu s/step':>12}{'gpu amp':>10}{'cpu/gpu':>9}{'cpu/amp':>9}")
    for spec, size in training_models(quick):
        name = spec["family"] + (f"/{spec['depth']}" if "depth" in spec else "")
        cpu = seconds_per_step(spec, size, "cpu", steps, batch)
        gpu = seconds_per_step(spec, size, dev, steps, batch) if dev else None
        amp = seconds_per_step(spec, size, dev, steps, batch, amp=True) if dev else None
        row = {"model": name, "spec": spec, "input_size": size, "batch": batch, "steps": steps,
               "cpu_s_per_step": cpu, "gpu_s_per_step": gpu, "gpu_amp_s_per_step": amp,
               "cpu_over_gpu": _ratio(cpu, gpu), "cpu_over_gpu_amp": _ratio(cpu, amp)}
        rows.append(row)
        f = (lambda v, w=12, p=4: f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}")
        print(f"{name:<14}{size:>5}{f(cpu)}{f(gpu)}{f(amp, 10)}{f(row['cpu_over_gpu'], 9, 1)}"
              f"{f(row['cpu_over_gpu_amp'], 9, 1)}", flush=True)
    return rows


def time_server(dev: str | None, quick: bool, distill_steps: int) -> dict:
    """OHFL's fusion (six He-random main-job uploads, catalogue defaults, probe of the catalogue's size) and
    ``distill_steps`` distillation steps (the teachers' labelling of the probe included), CPU vs GPU seconds; the
    GPU's are timed after one warm-up call each."""
    from hfl_components.flare import catalogue

    o = catalogue.option_defaults("ohfl")
    ups = he_uploads(2, 0.5, [("shallow", 32), ("medium", 32)]) if quick else he_uploads(6)
    n_fuse = 16 if quick else int(o["probe_size"])
    n_dist = 32 if quick else int(o["distill_probe_size"])
    probe = probe_at([u["input_size"] for u in ups], n_dist)
    small = {s: v[:n_fuse] for s, v in probe.items()}
    out = {"uploads": [[u["spec"]["depth"], u["input_size"]] for u in ups], "probe_fusion": n_fuse,
           "probe_distillation": n_dist, "distill_steps": distill_steps}
    for where in ["cpu"] + ([dev] if dev else []):
        if where != "cpu":  # the GPU's first call loads kernels; the CPU's first call is what a server sees
            fuse(ups, small, where)
            distil(ups, probe, where, 2)
        out[f"fusion_{where}_s"] = fuse(ups, small, where)[3]
        out[f"distillation_{where}_s"] = distil(ups, probe, where, distill_steps)[1]
    out["fusion_cpu_over_gpu"] = _ratio(out["fusion_cpu_s"], out.get(f"fusion_{dev}_s"))
    out["distillation_cpu_over_gpu"] = _ratio(out["distillation_cpu_s"], out.get(f"distillation_{dev}_s"))
    print(f"fusion ({len(ups)} uploads) cpu {out['fusion_cpu_s']:.2f} s" + (
        f", gpu {out[f'fusion_{dev}_s']:.2f} s, ratio {out['fusion_cpu_over_gpu']:.1f}" if dev else ""), flush=True)
    print(f"distillation ({distill_steps} steps) cpu {out['distillation_cpu_s']:.2f} s" + (
        f", gpu {out[f'distillation_{dev}_s']:.2f} s, ratio {out['distillation_cpu_over_gpu']:.1f}" if dev else ""),
        flush=True)
    return out


def time_dp(dev: str | None, quick: bool) -> list[dict]:
    """Seconds per DP-SGD step (Opacus, expected batch 16) of the main job's cnn depths at their sizes, CPU vs
    GPU (one warm-up epoch each, none with ``quick``); empty without Opacus."""
    if opacus_missing():
        return []
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    todo = [("shallow", 32)] if quick else [("shallow", 64), ("medium", 96), ("deep", 128)]
    n = 16 if quick else 160
    rows = []
    for depth, size in todo:
        spec = {"family": "cnn", "depth": depth, "width": 0.5 if quick else 1.0, "in_channels": 1, "num_classes": 2}
        row = {"model": f"cnn/{depth}", "input_size": size, "images": n}
        for where in ["cpu"] + ([dev] if dev else []):
            if not quick:
                dp_epoch(where, size, 32, spec=spec)  # warm-up epoch
            row[f"{'cpu' if where == 'cpu' else 'gpu'}_s_per_step"] = dp_epoch(where, size, n, spec=spec)[2]
        row["cpu_over_gpu"] = _ratio(row["cpu_s_per_step"], row.get("gpu_s_per_step"))
        print(f"dp {row['model']:<12}{size:>5} cpu {row['cpu_s_per_step']:.4f} s/step" + (
            f", gpu {row['gpu_s_per_step']:.4f}, ratio {row['cpu_over_gpu']:.1f}" if dev else ""), flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- main
def environment(dev: str | None, threads: int) -> dict:
    """torch / CUDA / machine facts recorded with the results."""
    from hfl_components.training.device import describe_device

    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": dev is not None,
           "packages": {n: ver(n) for n in ("numpy", "scipy", "monai", "POT", "opacus")},
           "torch_cuda": torch.version.cuda, "cpu_threads": threads, "machine": platform.machine(),
           "device": describe_device(torch.device(dev)) if dev else "cpu (no CUDA)"}
    if dev:
        p = torch.cuda.get_device_properties(0)
        env.update({"gpu": p.name, "capability": f"{p.major}.{p.minor}", "cudnn": torch.backends.cudnn.version(),
                    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32})
    return env


def save(res: dict, out: str | None) -> None:
    """Write ``res`` as JSON to ``out`` (folders made; nothing when ``out`` is None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1, default=str) + "\n")



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON to this file")
    ap.add_argument("--steps", type=at_least(1), default=20,
                    help="timed training steps per model and device (default 20)")
    ap.add_argument("--batch", type=at_least(1), default=16, help="images per training step (default 16, the sites')")
    ap.add_argument("--distill-steps", type=at_least(1), default=30, help="timed distillation steps (default 30)")
    ap.add_argument("--threads", type=at_least(1), default=None, help="CPU threads of torch (default: torch's own)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every path")
    ap.add_argument("--skip-timings", action="store_true", help="run the checks only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dev = cuda_device()
    t0 = time.perf_counter()
    env = environment(dev, threads)
    print(f"bench_gpu: {env['device']}, torch {env['torch']}, {threads} CPU thread(s)"
          + ("" if dev else "; no CUDA: the checks are skipped and only the CPU is timed"), flush=True)
    res = {"environment": env, "settings": {**vars(args), "out": Path(args.out).name if args.out else None}}  # no machine path
    res["checks"] = run_checks(dev, threads, args.quick)
    save(res, args.out)  # what is done so far survives a run stopped later
    if not args.skip_timings:
        res["timings"] = {}
        parts = {"training": lambda: time_training(dev, args.steps, args.batch, args.quick),
                 "server": lambda: time_server(dev, args.quick, 5 if args.quick else args.distill_steps),
                 "dp": lambda: time_dp(dev, args.quick)}
        for name, part in parts.items():
            try:
                res["timings"][name] = part()
            except Exception as e:  # the other parts still run; the error is in the results
                res["timings"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"timing {name} failed: {type(e).__name__}: {e}", flush=True)
            save(res, args.out)
    res["total_seconds"] = time.perf_counter() - t0
    failed = [c["name"] for c in res["checks"] if c["ok"] is False]
    res["all_checks_ok"] = None if dev is None else not failed
    print("checks: " + ("skipped (no CUDA)" if dev is None else ("all OK" if not failed else "FAILED " + ", ".join(failed))))
    save(res, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
