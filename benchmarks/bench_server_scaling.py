"""Benchmark: how the one-shot methods' server work grows with the number of sites (not a test).

For each site count K (default 6, 12, 24, 48) a fresh subprocess builds K uploads of the main job's model family
(the catalogue's fusable ``cnn``; depths shallow / medium / deep at 64 / 96 / 128 px, cycling as the main job's six
sites do) with **He-random weights** (fusion's and distillation's work depends on the shapes, not on training), and
times, with the catalogue's OHFL and FENS defaults:

* OHFL's fusion (``aggregate_models`` as the server calls it: strategy, OT, ground metric, repair, CKA and probe at
  each model's own size), per phase: ``cka``, ``alignment``, ``ot``, ``averaging``, ``repair``;
* OHFL's distillation (``distil_groups``, the server's code: every upload a teacher labels the probe once, then the
  student's steps); a fixed ``--distill-steps`` (default 30, early stopping off) instead of the 300-step budget,
  because the cost of a step does not depend on K (only the labelling does): the per-step seconds are printed so the
  full budget can be read off;
* FENS's server aggregation: the bundle of every site model (sent once) and ``rounds`` FedAvg averagings of the K
  sites' aggregators (``hfl_components.aggregation.weighted_average``, the aggregator of the catalogue's size).

It prints per stage the CPU seconds (``time.process_time``: robust to other jobs on the machine; the seconds a
quiet one-core server would take), wall seconds, and the peak resident memory above the stage's start (sampled
every 5 ms), then the growth exponent of each stage: the least-squares slope of log CPU seconds on log K. The
probe: the committed probe part of ``chest_xray_224`` when ``../shared/data`` is present, else generated images.

    python -m benchmarks.bench_server_scaling [--sites 6,12,24,48] [--distill-steps 30] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from nvflare_jobs.commands.simulate import at_least

REPO = Path(__file__).resolve().parents[1]
SHAPES = [("shallow", 64), ("shallow", 64), ("medium", 96), ("medium", 96), ("deep", 128), ("deep", 128)]
FUSION_STAGES = ("cka", "alignment", "ot", "averaging", "repair")
STAGES = FUSION_STAGES + ("distillation", "fens_aggregation")


def _rss() -> int:
    """Resident bytes of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """CPU seconds, wall seconds and peak RSS above the start, per stage name (a stage may be entered many times:
    the seconds add up, the peak is the largest)."""

    def __init__(self):
        self.cpu, self.wall, self.peak = {}, {}, {}
        self.state, self._stop = (None, 0), False  # (stage, RSS at its start): one tuple, read atomically
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()

    def _sample(self):
        while not self._stop:
            cur, base = self.state
            if cur is not None:
                self.peak[cur] = max(self.peak.get(cur, 0), _rss() - base)
            time.sleep(0.005)

    @contextmanager
    def stage(self, name: str, seconds: dict | None = None, phase: str | None = None):
        outer = self.state
        self.state = (name, _rss())
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
            if seconds is not None:  # the fusion's own phase record, as the library keeps it
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.state = outer

    def close(self):
        self._stop = True
        self._t.join()


def _uploads(k: int) -> dict:
    """K He-random uploads of the main job's shapes (sample counts 100 + site index, so weights differ)."""
    import torch

    from hfl_components.models.fusable import build_fusable

    out = {}
    for i in range(k):
        depth, size = SHAPES[i % len(SHAPES)]
        spec = {"family": "cnn", "depth": depth, "width": 1.0, "in_channels": 1, "num_classes": 2}
        torch.manual_seed(1000 + i)
        m = build_fusable(spec)
        with torch.no_grad():
            m.classifier.weight.normal_(0, 0.05)  # a zero class layer would make every teacher output 50:50
        name = f"site-{i + 1:02d}"
        out[name] = {"name": name, "spec": spec, "state_dict": m.state_dict(), "n_samples": 100 + i,
                     "val_acc": 0.5, "val_auc": None, "input_size": size}
    return out


def _probe(n: int) -> tuple[dict, str]:
    from hfl_components.flare.probe import load_probe

    root = Path(os.environ.get("CXR_DATA") or REPO.parent / "shared" / "data") / "chest_xray_224"
    src = str(root) if root.is_dir() else "generated"
    what = "the probe part of chest_xray_224" if root.is_dir() else "generated images"
    return {s: load_probe(src, s, n, seed=0) for s in (64, 96, 128)}, f"{n} {what}"


def _fens(meter: Meter, uploads: dict, fens_opts: dict, rounds: int) -> None:
    """FENS's server work: the bundle of every site model, then ``rounds`` averagings of K aggregators."""
    import torch

    from hfl_components.aggregation import weighted_average
    from hfl_components.flare.messages import to_numpy_state
    from hfl_components.models.ensemble import Aggregator

    params = {s: to_numpy_state(u["state_dict"]) for s, u in uploads.items()}  # what the sites uploaded
    k = len(uploads)
    states = []
    for i in range(k):
        torch.manual_seed(i)
        states.append(to_numpy_state(Aggregator(k, 2, fens_opts["fens_aggregator"], int(fens_opts["fens_hidden"]),
                                                bool(fens_opts["fens_residual"])).state_dict()))
    with meter.stage("fens_aggregation"):
        bundle = {f"member.{i}.{key}": v for i, p in enumerate(params.values()) for key, v in p.items()}
        for _ in range(rounds):
            weighted_average(states, [u["n_samples"] for u in uploads.values()])
    assert len(bundle) == sum(len(p) for p in params.values())


def one(k: int, distill_steps: int) -> dict:
    """Time every stage for K sites in this process (one thread); returns the per-stage record."""
    import torch

    torch.set_num_threads(1)
    from hfl_components.flare import catalogue
    from hfl_components.flare import distill_stage as ds
    from hfl_components.fusion import aggregate_models, pairwise

    opts = catalogue.option_defaults("ohfl")
    fens_opts = catalogue.option_defaults("fens")
    probe, probe_src = _probe(max(int(opts["probe_size"]), int(opts["distill_probe_size"])))
    uploads = _uploads(k)
    meter = Meter()
    real_timed = pairwise.timed

    def timed(seconds, phase):  # the fusion's phases, measured by this meter too
        return meter.stage(phase, seconds, phase)

    pairwise.timed = timed
    try:
        n = int(opts["probe_size"])
        spec, state, rec = aggregate_models(
            list(uploads.values()), strategy=opts["strategy"], probe={s: v[:n] for s, v in probe.items()},
            alignment=opts["alignment"], ot_solver=opts["ot"], ground_metric=opts["ground_metric"],
            weighting=opts["weighting"], seed=0, repair=opts["repair"], cka=opts["cka"])
    finally:
        pairwise.timed = real_timed
    groups = ds.architecture_groups({s: u["spec"] for s, u in uploads.items()})
    students = ds.initial_students(groups, {s: u["spec"] for s, u in uploads.items()}, uploads,
                                   {"cnn": (spec, state)})
    with meter.stage("distillation"):
        recs = ds.distil_groups(students, uploads, probe, torch.device("cpu"), steps=distill_steps,
                                temperature=float(opts["distill_temperature"]), weighting=opts["distill_weights"],
                                augment=False, data_free=False, data_free_rounds=0, in_channels=1, seed=0,
                                max_seconds=None, teacher=opts["distill_teacher"],
                                feature_weight=opts["distill_feature_weight"],
                                feature_layer=opts["distill_feature_layer"])
    _fens(meter, uploads, fens_opts, int(catalogue.entry("fens").rounds))
    meter.close()
    return {"sites": k, "probe": probe_src, "pairs": len(rec["pairs"]), "steps_run": recs["cnn"]["steps_run"],
            "cpu_s": meter.cpu, "wall_s": meter.wall, "peak_mib": {s: v / 2 ** 20 for s, v in meter.peak.items()},
            "load_average_1min": os.getloadavg()[0]}


def exponent(xs, ys) -> float:
    """Least-squares slope of log y on log x (nan when a y is not positive)."""
    if any(y <= 0 for y in ys):
        return float("nan")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def report(rows: list[dict]) -> dict:
    """Print the table and the exponents; return {stage: exponent}."""
    ks = [r["sites"] for r in rows]
    print(f"{'stage':<18}" + "".join(f"{'K=' + str(k):>22}" for k in ks) + f"{'exponent':>10}")
    print(f"{'':<18}" + "".join(f"{'cpu s / wall s / MiB':>22}" for _ in ks))
    exps = {}
    for s in STAGES:
        cpu = [r["cpu_s"].get(s, 0.0) for r in rows]
        exps[s] = exponent(ks, cpu)
        cells = "".join(f"{r['cpu_s'].get(s, 0.0):>8.2f}{r['wall_s'].get(s, 0.0):>8.2f}"
                        f"{r['peak_mib'].get(s, 0.0):>6.0f}" for r in rows)
        print(f"{s:<18}{cells}{exps[s]:>10.2f}")
    tot = [sum(r["cpu_s"].get(s, 0.0) for s in STAGES) for r in rows]
    exps["ohfl_total"] = exponent(ks, [sum(r["cpu_s"].get(s, 0.0) for s in STAGES[:-1]) for r in rows])
    print(f"{'all stages (cpu)':<18}" + "".join(f"{t:>22.2f}" for t in tot))
    worst = max((s for s in STAGES), key=lambda s: exps[s] if not math.isnan(exps[s]) else -1)
    print(f"fastest-growing stage: {worst}, exponent {exps[worst]:.2f} "
          f"({'at most linear' if exps[worst] <= 1.1 else 'FASTER THAN LINEAR'}, tolerance 0.1 for timing noise)")
    return exps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="6,12,24,48", help="site counts (comma-separated, default 6,12,24,48)")
    ap.add_argument("--distill-steps", type=at_least(0), default=30, help="distillation steps per run (default 30)")
    ap.add_argument("--out", help="JSON file for the rows and exponents")
    ap.add_argument("--parallel", action="store_true", help="run the site counts at once, one process each (CPU "
                    "seconds are unaffected; wall seconds and the load then include the other counts)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one site count, JSON on stdout
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.distill_steps)))
        return 0
    try:
        ks = sorted({int(k) for k in args.sites.split(",")})
    except ValueError:
        print(f"bench_server_scaling: --sites {args.sites!r}: comma-separated integers", file=sys.stderr)
        return 2
    if len(ks) < 2 or ks[0] < 2:
        print("bench_server_scaling: --sites needs at least two counts, each >= 2", file=sys.stderr)
        return 2
    print(f"# server stages for K = {ks} He-random cnn uploads, 1 torch thread, distillation {args.distill_steps} "
          f"steps; a fresh process per K{' (all at once)' if args.parallel else ''}", flush=True)
    rows = []
    cmd = [sys.executable, "-m", "benchmarks.bench_server_scaling", "--distill-steps", str(args.distill_steps), "--one"]
    batches = [ks] if args.parallel else [[k] for k in ks]
    for batch in batches:
        procs = {k: subprocess.Popen(cmd + [str(k)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for k in batch}
        for k, p in procs.items():
            out, err = p.communicate()
            if p.returncode:
                print(f"bench_server_scaling: K={k} failed: {err.strip().splitlines()[-1:]}", file=sys.stderr)
                return 1
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"K={k}: done ({sum(rows[-1]['wall_s'].values()):.0f} s wall, load "
                  f"{rows[-1]['load_average_1min']:.1f})", flush=True)
    exps = report(rows)
    if args.out:
        exps = {k: None if math.isnan(v) else v for k, v in exps.items()}  # a stage that took no time: none
        Path(args.out).write_text(json.dumps({"rows": rows, "exponents": exps, "distill_steps": args.distill_steps,
                                              "parallel": bool(args.parallel),
                                              "weights": "He-random (main-job cnn shapes)"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
