"""DP-SGD's extra cost per training step, as a ratio to plain training (not a test).

For every model family a job trains at a site, at the input size the default profiles give it (the fusable main
job's cnn shallow / medium / deep at 64 / 96 / 128 px, and the prototype pool's backbones at their size), the
benchmark times a few steps of :func:`hfl_components.training.train_local` without dp (batches of 16 random images)
and with dp (:class:`hfl_components.privacy.DPSession`: Poisson batches of expected size 16, per-image gradients
by Opacus's hooks, clipping, noise, accounting). BatchNorm backbones are trained under dp after Opacus's
``ModuleValidator.fix`` (BatchNorm -> GroupNorm), so their ratio includes that change too; a model Opacus cannot
train (its trial step fails, :func:`hfl_components.privacy.make_compatible`) gets no dp time and says why. One warm-up epoch of each
kind runs first. The ratio is what ``compare``'s equal-epoch budgets cost in wall time under dp.

Usage::

    .venv/bin/python -m benchmarks.bench_dp [--steps 5] [--threads 1] [--families cnn,densenet] [--out dp.json]
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from hfl_components.models import build_model, count_parameters
from hfl_components.privacy import DPSession, DPSpec, check_budget, make_compatible
from hfl_components.training import train_local
from nvflare_jobs.profiles import PROTO_TRAINING, assign_models

BATCH = 16


def specs_at_sizes(num_classes: int = 2) -> list[tuple[dict, int]]:
    """``[(spec, input size)]``: the main job's fusable models (6 sites at 64 / 96 / 128 px) and the prototype
    pool's backbones at the prototype methods' input size, each once."""
    sites = [f"site-{i}" for i in range(1, 7)]
    fusable = assign_models(sites, "ohfl", [64, 96, 128], num_classes)
    proto = assign_models(sites, "fedsaf", [int(PROTO_TRAINING["input_size"])], num_classes)
    out, seen = [], set()
    for entry in list(fusable.values()) + list(proto.values()):
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((entry["model"], entry["input_size"]))
    return out


def _name(spec: dict) -> str:
    return spec["family"] + (f"/{spec['depth']}" if "depth" in spec else "")


def _data(n: int, size: int, num_classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, size, size, generator=g), torch.randint(0, num_classes, (n,), generator=g)


def plain_seconds_per_step(spec: dict, size: int, steps: int) -> float:
    """Seconds per plain SGD step on batches of 16 (after one warm-up epoch of 2 steps)."""
    torch.manual_seed(0)
    model = build_model(spec).train()
    x, y = _data(BATCH, size, spec["num_classes"])
    train_local(model, [(x, y)] * 2, 1)
    t0 = time.perf_counter()
    train_local(model, [(x, y)] * steps, 1)
    return (time.perf_counter() - t0) / steps


def dp_seconds_per_step(spec: dict, size: int, steps: int) -> tuple[float, str]:
    """Seconds per DP-SGD step (expected batch 16: ``steps * 16`` images, sample rate ``1 / steps``) and the
    compatibility line of the model."""
    torch.manual_seed(0)
    model, report = make_compatible(build_model(spec), size)
    if report["remaining"]:
        return float("nan"), report["text"]
    model.train()
    spec_dp = DPSpec(epsilon=8.0, accountant="rdp")
    times = []
    for n_steps in (2, steps):  # warm-up epoch, then the timed one
        x, y = _data(BATCH * n_steps, size, spec["num_classes"], seed=n_steps)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        session = DPSession(check_budget(len(y), BATCH, 1, spec_dp, "bench"), seed=0)
        t0 = time.perf_counter()
        train_local(model, loader, 1, dp=session)
        times.append((time.perf_counter() - t0) / session.steps_done)
    return times[-1], report["text"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model and kind (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--families", default="", help="comma-separated families to keep (default: all)")
    ap.add_argument("--out", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    keep = {f for f in args.families.split(",") if f}
    todo = [(s, n) for s, n in specs_at_sizes() if not keep or s["family"] in keep]
    print(f"bench_dp: {len(todo)} models x ({args.steps} plain + {args.steps} dp steps, each after a warm-up), "
          f"batch {BATCH}, {args.threads} thread(s)", flush=True)
    print(f"{'model':<18}{'size':>5}{'params':>10}{'plain s/step':>14}{'dp s/step':>11}{'ratio':>7}  dp compatibility")
    rows = []
    for spec, size in todo:
        plain = plain_seconds_per_step(spec, size, args.steps)
        dp, compat = dp_seconds_per_step(spec, size, args.steps)
        row = {"model": _name(spec), "input_size": size, "params": count_parameters(build_model(spec)),
               "plain_s_per_step": plain, "dp_s_per_step": dp, "ratio": dp / plain, "compatibility": compat,
               "steps": args.steps, "batch": BATCH, "threads": args.threads}
        rows.append(row)
        print(f"{row['model']:<18}{size:>5}{row['params']:>10}{plain:>14.4f}{dp:>11.4f}{row['ratio']:>7.2f}  {compat}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
