"""Benchmark of the OHFL fusion library (not a test).

Part 0 (``--server RUN``) — the OHFL server's fusion of the main job's six site models (``RUN/models/
site-*_local.pt`` of a ``simulate --method ohfl --sites 6 --scheme width`` run; He-random models of the same specs
when absent) with the job's defaults read from the method catalogue (today cid, emd, acts, channel repair, linear
CKA, probe of 64 ``chest_xray_224`` probe images at each model's own input size, 64/96/128 px): seconds per phase (cka, alignment, ot, averaging, repair), their share of the
job's wall time (``RUN/metrics.json``), how each phase grows with width (x1, x2, x4 of the main-job specs) and with
the number of sites (2, 6, 12, 24 via perturbed copies of the six), and the fitted growth exponent (least squares
slope of log seconds on log width / log sites). ``--baseline COMMIT`` times the same six-model fusion with the
fusion code of an older commit in a subprocess, side by side (``git archive``; nothing is installed), and prints
the largest per-tensor relative difference between the two fused models (with ``acts`` exactly tied OT plans can
make it large while the models compute the same function; see studies/speed/RESULTS.md).

Part 1 — server fusion time by phase (CKA, alignment incl. depth balancing, OT, averaging) for 2–12 cnn-family models
at width multipliers 0.25–2 and vgg11-family models at 0.125–0.5, printing how the time grows with width. Sites get
depths as in the paper (Sec. 4.3): the first third shallow, the second medium, the last deep. Weights are He-random
(fusion time depends on the shapes, not on training). The largest OT problem is the cnn fc-1000 layer at width 2
(2000 x 2000), under the ~4k x 4k budget.

Part 2 (``--accuracy``) — fused-model accuracy on a fixed real split of ../shared/data/chest_xray_224: three sites
(cnn shallow / medium / deep, same width) are trained briefly on disjoint patient-free slices, then compared on one
held-out test slice: each local model, the best single model, the OHFL CID global model (zero-shot, before any
fine-tuning) and naive averaging (same CID layer maps and identity insertion, then plain parameter averaging of
neuron i with neuron i, no OT; an inserted identity layer wider than its target layer is cropped).

    .venv/bin/python -m benchmarks.bench_fusion --server runs/demo [--baseline COMMIT]   # part 0
    .venv/bin/python -m benchmarks.bench_fusion                 # timing, default grid
    .venv/bin/python -m benchmarks.bench_fusion --quick         # small grid (~1 min)
    .venv/bin/python -m benchmarks.bench_fusion --accuracy --epochs 8

Caveat (accuracy part): at these CPU budgets (300 images per site, 32 px, a few epochs, no validation-based
early stopping) some local models stay near the majority class and the zero-shot fused models usually do too; the
numbers only become informative with properly trained sites and the paper's 50 fine-tuning epochs. The fused
models are reported with and without the activation-scale repair (hfl_components/fusion/repair.py): without it the
deep fused model's activations collapse and fine-tuning at lr 0.001 barely moves it. The real end-to-end numbers
(the NVFlare job on the 6 width sites) are in metrics.json of `make demo`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

from hfl_components.fusion import (PHASES, aggregate_models, align_layers, cka_cost_matrix,  # noqa: E402
                                   insert_identity_layers)
from hfl_components.fusion._arch import layer_table  # noqa: E402
from hfl_components.models.fusable import build_fusable  # noqa: E402

DEPTHS = ("shallow", "medium", "deep")
GRID = {"cnn": [0.25, 0.5, 1.0, 2.0], "vgg11": [0.125, 0.25, 0.5]}
QUICK = {"cnn": [0.25, 0.5], "vgg11": [0.125, 0.25]}


def data_root() -> Path:
    import os
    env = os.environ.get("CXR_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


def load_images(files, size: int) -> torch.Tensor:
    from PIL import Image
    arrs = [np.asarray(Image.open(f).convert("L").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
            for f in files]
    return torch.from_numpy(np.stack(arrs))[:, None]


def make_probe(n: int, size: int) -> tuple[torch.Tensor, str]:
    root = data_root() / "chest_xray_224" / "train"
    files = sorted(root.glob("*/*.jpeg"))
    if len(files) >= n:
        idx = np.random.default_rng(0).choice(len(files), n, replace=False)
        return load_images([files[i] for i in sorted(idx)], size), f"{n} real images from {root}"
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(0)), \
        f"{n} generated images (no real data at {root})"


def he_model(spec: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    m = build_fusable(spec)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                torch.nn.init.kaiming_normal_(p, nonlinearity="relu")
    return m.state_dict()


def max_ot_size(specs) -> int:
    return max(r.n_out for s in specs for r in layer_table(s)[:-1])


def bench_timing(args) -> None:
    grid = QUICK if args.quick else GRID
    print(f"# fusion seconds by phase (strategy {args.strategy}, OT {args.ot}, probe {args.probe_n}x{args.probe_size}"
          f"px, torch threads {torch.get_num_threads()})")
    probes = {}
    header = f"{'family':7s} {'width':>6s} {'n':>3s} {'max OT':>7s} " + " ".join(f"{p:>9s}" for p in PHASES) + \
        f" {'total':>8s} {'x prev width':>12s}"
    print(header)
    for family in args.families:
        size = max(args.probe_size, 32 if family == "vgg11" else 8)
        if size not in probes:
            probes[size], desc = make_probe(args.probe_n, size)
            print(f"# probe: {desc} at {size}px")
        for n in args.n_models:
            prev = None
            for width in grid[family]:
                models = []
                for k in range(n):
                    spec = {"family": family, "depth": DEPTHS[min(2, 3 * k // n)], "width": width,
                            "in_channels": 1, "num_classes": 2}
                    models.append({"name": f"site-{k + 1}", "spec": spec, "state_dict": he_model(spec, k),
                                   "n_samples": 100 + k, "val_acc": 0.5 + 0.01 * k})
                t0 = time.perf_counter()
                _, _, rec = aggregate_models(models, args.strategy, probe=probes[size], ot_solver=args.ot)
                total = time.perf_counter() - t0
                growth = "" if prev is None else f"{total / prev:12.2f}"
                ph = rec["phase_seconds"]
                print(f"{family:7s} {width:6.3f} {n:3d} {max_ot_size([m['spec'] for m in models]):7d} "
                      + " ".join(f"{ph[p]:9.3f}" for p in PHASES) + f" {total:8.2f} {growth}", flush=True)
                prev = total


# ---------------------------------------------------------------- server (part 0)

MAIN_JOB = [("shallow", 64), ("shallow", 64), ("medium", 96), ("medium", 96), ("deep", 128), ("deep", 128)]


def _server_defaults() -> dict:
    """The OHFL server's fusion defaults, read from the method catalogue (one source)."""
    from hfl_components.flare import catalogue

    d = {o.key: o.default for o in catalogue.entry("ohfl").options}
    return {"strategy": d["strategy"], "ot_solver": d["ot"], "ground_metric": d["ground_metric"],
            "repair": d["repair"], "cka": d["cka"]}


SERVER_DEFAULTS = _server_defaults()


def _probe_at() -> str:
    from hfl_components.flare import catalogue

    return {o.key: o.default for o in catalogue.entry("ohfl").options}["probe_at"]


PROBE_AT = _probe_at()  # "own": every model probed at its own input size (the server's default)


def main_job_models(run: Path | None, width: float = 1.0, seed_offset: int = 0) -> tuple[list[dict], str]:
    """The six site uploads of the main job: the run's local models if present (width 1), else He-random."""
    from hfl_components.models.files import load_model_file

    models = []
    if run is not None and width == 1.0 and all((run / "models" / f"site-{k}_local.pt").is_file()
                                                 for k in range(1, 7)):
        for k in range(1, 7):
            m, h = load_model_file(run / "models" / f"site-{k}_local.pt")
            models.append({"name": f"site-{k}", "spec": h["spec"], "state_dict": m.state_dict(),
                           "n_samples": 100, "input_size": int(h["input_size"])})
        return models, f"site models of {run}"
    for k, (depth, size) in enumerate(MAIN_JOB):
        spec = {"family": "cnn", "depth": depth, "width": width, "in_channels": 1, "num_classes": 2}
        models.append({"name": f"site-{k + 1}", "spec": spec, "state_dict": he_model(spec, k + seed_offset),
                       "n_samples": 100, "input_size": size})
    return models, f"He-random main-job specs at width x{width:g}"


def server_probe(n: int, size: int) -> tuple[torch.Tensor, str]:
    """The server's probe as the OHFL controller builds it (chest_xray_224's probe part), else generated."""
    from hfl_components.flare.probe import load_probe

    root = data_root() / "chest_xray_224"
    if root.is_dir():
        return load_probe(str(root), size, n), f"{n} images of {root} (probe part) at {size} px"
    return load_probe("generated", size, n), f"{n} generated images at {size} px (no {root})"


def _copies(models: list[dict], n: int) -> list[dict]:
    """n site models: the six (or the first and last for n = 2), then copies with 1e-3 relative noise."""
    base = [models[0], models[-1]] if n == 2 else models
    out = []
    g = torch.Generator().manual_seed(0)
    for k in range(n):
        m = base[k % len(base)]
        sd = m["state_dict"] if k < len(base) else {
            key: v * (1 + 1e-3 * torch.randn(v.shape, generator=g)) for key, v in m["state_dict"].items()}
        out.append({**m, "name": f"site-{k + 1:02d}", "state_dict": sd})
    return out


def _time_fusion(models, probe, repeat: int, out: dict | None = None) -> dict:
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        _, sd, rec = aggregate_models(models, probe=probe, **SERVER_DEFAULTS)
        total = time.perf_counter() - t0
        if best is None or total < best["total"]:
            best = {**rec["phase_seconds"], "total": total}
        if out is not None:
            out["state_dict"] = sd
    return _with_probe_sum(best)


def _weight_gap(a: dict, b: dict) -> tuple[float, str]:
    """Largest per-tensor relative difference max|a − b| / max|b| of two fused state dicts, and its tensor."""
    gaps = {k: float((a[k] - b[k]).abs().max()) / max(float(b[k].abs().max()), 1e-30) for k in b}
    k = max(gaps, key=gaps.get)
    return gaps[k], k


def _with_probe_sum(r: dict) -> dict:
    """'probe+avg' = cka + averaging + repair: the probe work (CKA Grams are now collected in the repair passes,
    and the old code counted repair in averaging), comparable across versions."""
    return {**r, "probe+avg": r.get("cka", 0.0) + r.get("averaging", 0.0) + r.get("repair", 0.0)}


def _exponent(xs, ys) -> float:
    """Least-squares slope of log(ys) on log(xs); NaN when fewer than two distinct xs (no growth to fit)."""
    xs, ys = np.log(np.asarray(xs, float)), np.log(np.maximum(np.asarray(ys, float), 1e-6))
    if len(np.unique(xs)) < 2:
        return float("nan")
    return float(np.polyfit(xs, ys, 1)[0])


def _baseline(commit: str, models: list[dict], probe: torch.Tensor, repeat: int,
              fused: dict | None = None) -> dict | None:
    """Time the same fusion with the fusion code of ``commit`` in a subprocess whose only copy of the package is
    that commit's (``git archive`` into a temporary folder; the models and probe travel in a torch file)."""
    import json
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="bench_fusion_base_"))
    arch = subprocess.run(["git", "-C", str(REPO), "archive", commit, "hfl_components", "chest_xray"],
                          capture_output=True)
    if arch.returncode != 0:
        print(f"# baseline {commit}: git archive failed: {arch.stderr.decode()[-300:]}")
        return None
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=arch.stdout, check=True)
    torch.save({"models": models, "probe": probe}, tmp / "inputs.pt")
    code = f"""
import json, time, torch
torch.set_num_threads({torch.get_num_threads()})
from hfl_components.fusion import aggregate_models
assert aggregate_models.__code__.co_filename.startswith({str(tmp)!r})
d = torch.load({str(tmp / "inputs.pt")!r}, weights_only=False)
best = None
for _ in range({repeat}):
    t0 = time.perf_counter()
    _, sd, rec = aggregate_models(d["models"], probe=d["probe"], **{SERVER_DEFAULTS!r})
    total = time.perf_counter() - t0
    if best is None or total < best["total"]:
        best = {{**rec["phase_seconds"], "total": total}}
torch.save(sd, {str(tmp / "fused.pt")!r})
print(json.dumps(best))
"""
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp)}  # that commit's copy first (the assert checks)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp), env=env)
    if r.returncode != 0:
        print(f"# baseline {commit} failed: {r.stderr[-500:]}")
        return None
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res.setdefault("repair", 0.0)  # older code counted the repair in 'averaging'
    if fused is not None:
        fused["state_dict"] = torch.load(tmp / "fused.pt", weights_only=True)
    return _with_probe_sum(res)


def bench_server(args) -> None:
    import json
    import os

    run = Path(args.server) if args.server else None
    print(f"# server fusion: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, torch "
          f"threads {torch.get_num_threads()}, options {SERVER_DEFAULTS}, best of {args.repeat}")
    models, src = main_job_models(run)
    if PROBE_AT == "own":  # as the controller does: the same images at every site input size
        sizes = sorted({int(m["input_size"]) for m in models} | {size for _, size in MAIN_JOB})
        probe = {}
        for size in sizes:
            probe[size], desc = server_probe(args.probe_n, size)
        desc = desc.replace(f"at {sizes[-1]} px", f"at each model's own size {sizes} px")
    else:
        probe, desc = server_probe(args.probe_n, 128)
    print(f"# probe: {desc} (probe_at={PROBE_AT})")
    print(f"# models: {src}")
    cols = list(PHASES) + ["probe+avg", "total"]
    head = f"{'':28s}" + "".join(f"{c:>10s}" for c in cols)
    mine: dict = {}
    now = _time_fusion(models, probe, args.repeat, mine)
    print(head)
    print(f"{'six main-job models (s)':28s}" + "".join(f"{now[c]:10.2f}" for c in cols))
    out = {"load_avg": os.getloadavg()[0], "threads": torch.get_num_threads(), "models": src, "probe": desc,
           "main": now}
    if args.baseline:
        theirs: dict = {}
        base = _baseline(args.baseline, models, probe, args.repeat, theirs)
        if base:
            print(f"{'same, code of ' + args.baseline[:10] + ' (s)':28s}" + "".join(f"{base[c]:10.2f}" for c in cols))
            print(f"{'speed-up (old / new)':28s}" + "".join(f"{base[c] / max(now[c], 1e-9):10.1f}" for c in cols))
            gap, key = _weight_gap(mine["state_dict"], theirs["state_dict"])
            print(f"# fused weights, this code vs {args.baseline[:10]}: max |Δw| / max |w| = {gap:.2e} ({key})")
            out["baseline"] = {"commit": args.baseline, **base, "weight_gap": gap, "weight_gap_tensor": key}
    wall = None
    if args.wall:
        wall = float(args.wall)
    elif run is not None and (run / "metrics.json").is_file():
        met = json.loads((run / "metrics.json").read_text())
        wall = (met.get("timing") or {}).get("wall_s") or met.get("wall_time_s")
    if wall:
        print(f"{'share of a ' + f'{wall:.0f} s job (%)':28s}" + "".join(f"{100 * now[c] / wall:10.1f}" for c in cols))
        out["job_wall_s"] = wall
    growth = {}
    if args.widths:
        print(f"# growth with width (He-random main-job specs, 6 sites)")
        rows = []
        for w in args.widths:
            ms, _ = main_job_models(None, w)
            rows.append(_time_fusion(ms, probe, 1))
            print(f"{f'width x{w:g} (s)':28s}" + "".join(f"{rows[-1][c]:10.2f}" for c in cols), flush=True)
        ex = {c: _exponent(args.widths, [r[c] for r in rows]) for c in cols}
        print(f"{'exponent in width':28s}" + "".join(f"{ex[c]:10.2f}" for c in cols))
        growth["width"] = {"widths": args.widths, "seconds": rows, "exponent": ex}
    if args.sites:
        print(f"# growth with sites (the six models and perturbed copies)")
        rows = []
        for n in args.sites:
            rows.append(_time_fusion(_copies(models, n), probe, 1))
            print(f"{f'{n} sites (s)':28s}" + "".join(f"{rows[-1][c]:10.2f}" for c in cols), flush=True)
        ex = {c: _exponent(args.sites, [r[c] for r in rows]) for c in cols}
        print(f"{'exponent in sites':28s}" + "".join(f"{ex[c]:10.2f}" for c in cols))
        growth["sites"] = {"sites": args.sites, "seconds": rows, "exponent": ex}
    out["growth"] = growth
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------- accuracy (part 2)

def _split(n_sites: int, n_per_site: int, n_test: int, size: int):
    import csv
    root = data_root() / "chest_xray_224"
    manifest = root / "MANIFEST.csv"
    if not manifest.is_file():
        raise SystemExit(f"accuracy benchmark needs {manifest}")
    rows = list(csv.DictReader(open(manifest)))
    by_patient: dict[str, list] = {}
    for r in rows:
        by_patient.setdefault(r["patient_id"], []).append(r)
    patients = sorted(by_patient)
    np.random.default_rng(0).shuffle(patients)
    chunks, cur, need = [], [], [n_per_site] * n_sites + [n_test]
    for p in patients:  # whole patients per slice: no patient in two slices
        cur += by_patient[p]
        if len(cur) >= need[len(chunks)]:
            chunks.append(cur)
            cur = []
            if len(chunks) == len(need):
                break
    out = []
    for rs in chunks:
        x = load_images([root / r["relative_path"] for r in rs], size)
        y = torch.tensor([0 if r["label"] == "NORMAL" else 1 for r in rs])
        out.append((x, y))
    return out[:-1], out[-1]


def _train(spec, x, y, epochs, seed, init=None, lr=0.01):
    torch.manual_seed(seed)
    m = build_fusable(spec)
    if init is not None:
        m.load_state_dict(init)
    else:  # He init: the deeper sites otherwise barely train in a few CPU epochs
        m.load_state_dict(he_model(spec, seed))
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    w = torch.bincount(y, minlength=2).float()
    loss_fn = torch.nn.CrossEntropyLoss(weight=w.sum() / (2 * w.clamp(min=1)))
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 16):
            b = perm[i:i + 16]
            opt.zero_grad()
            loss_fn(m(x[b]), y[b]).backward()
            opt.step()
    return m.state_dict()


def _acc(spec, sd, x, y) -> float:
    m = build_fusable(spec)
    m.load_state_dict(sd)
    m.eval()
    with torch.no_grad():
        return float((m(x).argmax(1) == y).float().mean())


def _fit(t: torch.Tensor, shape) -> torch.Tensor:
    """Neuron i <-> neuron i: crop / zero-pad a tensor to ``shape`` (an inserted identity layer can be wider)."""
    out = torch.zeros(shape, dtype=t.dtype)
    sl = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, shape))
    out[sl] = t[sl]
    return out


def _naive_cid(models, probe):
    """CID order and layer maps, identity insertion, then plain sample-weighted averaging of neuron i with neuron i
    (no OT; tensors cropped / zero-padded where an inserted identity layer is wider than the target layer)."""
    models = sorted(models, key=lambda m: len(layer_table(m["spec"])))
    spec, sd, w = models[0]["spec"], models[0]["state_dict"], models[0]["n_samples"]
    for nxt in models[1:]:
        a, b = build_fusable(spec), build_fusable(nxt["spec"])
        a.load_state_dict(sd)
        b.load_state_dict(nxt["state_dict"])
        ha, hb = a.layers()[:-1], b.layers()[:-1]
        pairs = align_layers(cka_cost_matrix(a, b, probe), [h.kind for h in ha], [h.stage for h in ha],
                             [h.kind for h in hb], [h.stage for h in hb])
        _, bal = insert_identity_layers(spec, sd, pairs, nxt["spec"])
        wn = nxt["n_samples"]
        sd = {k: (w * _fit(bal[k], v.shape) + wn * v) / (w + wn) for k, v in nxt["state_dict"].items()}
        spec, w = nxt["spec"], w + wn
    return spec, sd


def bench_accuracy(args) -> None:
    size, width = args.acc_size, args.acc_width
    sites, (xt, yt) = _split(3, args.acc_per_site, args.acc_test, size)
    probe, desc = make_probe(args.probe_n, size)
    print(f"# accuracy: 3 sites x ~{args.acc_per_site} images, test {len(yt)}, {size}px, cnn width {width}, "
          f"{args.epochs} local epochs; probe: {desc}")
    models = []
    for k, ((x, y), depth) in enumerate(zip(sites, DEPTHS)):
        spec = {"family": "cnn", "depth": depth, "width": width, "in_channels": 1, "num_classes": 2}
        sd = _train(spec, x, y, args.epochs, seed=k)
        acc = _acc(spec, sd, xt, yt)
        models.append({"name": f"site-{k + 1}", "spec": spec, "state_dict": sd, "n_samples": len(y), "val_acc": acc})
        print(f"local site-{k + 1} ({depth:7s}) test acc {acc:.3f}")
    print(f"best single model      test acc {max(m['val_acc'] for m in models):.3f}")
    def finetuned(spec, sd) -> str:
        if args.finetune_epochs <= 0:
            return ""
        accs = [_acc(spec, _train(spec, x, y, args.finetune_epochs, seed=10 + k, init=sd, lr=0.001), xt, yt)
                for k, (x, y) in enumerate(sites)]
        return f"; after {args.finetune_epochs} fine-tuning epochs per site: mean {np.mean(accs):.3f}"

    for solver, repair in (("emd", False), ("emd", True), ("sinkhorn", True)):
        t0 = time.perf_counter()
        spec, sd, rec = aggregate_models(models, "cid", probe=probe, ot_solver=solver, repair=repair)
        tag = f"{solver}{'+repair' if repair else ''}"
        print(f"OHFL CID ({tag:15s}) test acc {_acc(spec, sd, xt, yt):.3f} zero-shot "
              f"({time.perf_counter() - t0:.2f}s){finetuned(spec, sd)}")
    spec, sd = _naive_cid(models, probe)
    print(f"naive averaging (CID)  test acc {_acc(spec, sd, xt, yt):.3f} zero-shot{finetuned(spec, sd)}")
    # 'val_acc' of the sites is their test accuracy here (used by nothing but the report: the strategy is cid).


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, metavar="RUN",
                    help="part 0: time the server fusion of the main job's six models (RUN/models/*_local.pt)")
    ap.add_argument("--baseline", default=None, metavar="COMMIT", help="part 0: also time the code of COMMIT")
    ap.add_argument("--wall", default=None, help="part 0: the job's wall seconds (default RUN/metrics.json)")
    ap.add_argument("--widths", nargs="*", type=float, default=[1, 2, 4], help="part 0: width multipliers")
    ap.add_argument("--sites", nargs="*", type=int, default=[2, 6, 12, 24], help="part 0: site counts")
    ap.add_argument("--repeat", type=int, default=1, help="part 0: best of this many runs")
    ap.add_argument("--out", default=None, help="part 0: write the results as JSON")
    ap.add_argument("--families", nargs="+", default=["cnn", "vgg11"], choices=sorted(GRID))
    ap.add_argument("--n-models", nargs="+", type=int, default=[2, 6, 12])
    ap.add_argument("--strategy", default="cid", choices=["cid", "cdd", "cia", "rand"])
    ap.add_argument("--ot", default="emd", choices=["emd", "sinkhorn"])
    ap.add_argument("--probe-n", type=int, default=64)
    ap.add_argument("--probe-size", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="widths 0.25–0.5 (cnn) / 0.125–0.25 (vgg11)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--accuracy", action="store_true", help="run the accuracy comparison instead of the timing")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--finetune-epochs", type=int, default=2, help="per-site fine-tuning of the global models")
    ap.add_argument("--acc-size", type=int, default=32)
    ap.add_argument("--acc-width", type=float, default=0.25)
    ap.add_argument("--acc-per-site", type=int, default=300)
    ap.add_argument("--acc-test", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.server:
        bench_server(args)
    elif args.accuracy:
        bench_accuracy(args)
    else:
        bench_timing(args)


if __name__ == "__main__":
    main()
