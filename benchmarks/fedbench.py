"""Shared driver for the federated benchmarks (``bench_alignment.py``, ``bench_topology.py``); not a test.

Each benchmark run is one federation executed **in process**: the method's real server workflow
(``nvflare_jobs.jobs.make_controller`` -> ``hfl_components.flare.controllers``) and the real site handlers
(``hfl_components.flare.inprocess.InProcessTransport``: the catalogue's site handlers on a ``SiteRuntime`` per site) with NVFlare's transport replaced by
a direct call (``send_model_and_wait`` runs each site's handler in turn and copies its arrays, as the NUMPY exchange
does). Maths, validation, payload accounting and evaluation are therefore those of ``cxr-hfl simulate``, without
the simulator's ~15 s start-up per run and its one process per site, which matters on 2 shared cores. Sites run one
after another, each with ``threads`` torch threads (default 2). Client seconds per round are measured around each
site's handler call (training, prototype/topology extraction, validation evaluation).

Data: a fixed, seeded partition (seed 0) of ../shared/data/chest_xray_224 (or ``$CXR_DATA/chest_xray_224``) with the
3-class ``subtype`` labels; resized images are cached on disk under ``benchmarks/results/cache`` so later runs skip
JPEG decoding. Results are appended to a JSON file after every run, so an interrupted benchmark resumes where it
stopped (a run is identified by its key; the file also records the settings and refuses to mix different ones).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def data_224() -> Path:
    env = os.environ.get("CXR_DATA")
    root = (Path(env) if env else REPO.parent / "shared" / "data") / "chest_xray_224"
    if not root.is_dir():
        sys.exit(f"benchmark data not found: {root} (set $CXR_DATA to the folder holding chest_xray_224)")
    return root


def make_partition(name: str, n_sites: int, scheme: str, alpha: float = 0.5, classes_per_site: int | None = None,
                   seed: int = 0) -> Path:
    """A fixed partition of chest_xray_224 (subtype labels) under ``benchmarks/results/partitions/<name>``."""
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition

    out = RESULTS / "partitions" / name
    if (out / "partition.json").is_file():
        return out
    records, _ = scan_dataset(data_224(), labels="subtype", verify=False)
    kw = {"classes_per_site": classes_per_site} if classes_per_site else {}
    res = partition_records(records, n_sites, scheme, alpha=alpha, seed=seed, class_names=CLASS_NAMES["subtype"],
                            **kw)
    write_partition(res, out)
    return out


def make_profile(partition: Path, out: Path, method: str, input_size: int, settings: dict) -> dict:
    """Site configs for ``method`` (heterogeneous backbones cycle hetero_cnn/densenet/resnet/efficientnet)."""
    from nvflare_jobs.profiles import write_profile
    from hfl_components.flare.site_config import load_profile

    from hfl_components.flare.catalogue import is_prototype, prototype_methods

    prof_method = method if is_prototype(method) else prototype_methods()[0]  # Local uses the same backbones
    write_profile(partition, out, prof_method, "subtype", [input_size], dict(settings))
    return load_profile(out)


def run_federation(method: str, profile: dict, opts: dict, workdir: Path, log=None) -> dict:
    """Run one federation in process (:class:`hfl_components.flare.inprocess.InProcessTransport` with the real site
    handlers); returns a summary with the server record and client seconds per round."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    ctl = make_controller(method, profile, opts)
    runtimes = {s: SiteRuntime(cfg, workdir / s) for s, cfg in profile.items()}
    transport = InProcessTransport(runtimes, runtime_answer(runtimes))
    calls = transport.calls
    msgs = []
    transport.attach(ctl, workdir / "server", info=lambda m: msgs.append(("info", m)),
                     warning=lambda m: (msgs.append(("warning", m)), log and log(f"    WARNING {m}")))
    t0 = time.perf_counter()
    ctl.run()
    wall = time.perf_counter() - t0
    rec = json.loads((workdir / "server" / "cxr_hfl_results" / "server_results.json").read_text())
    train = [c for c in calls if c["task"] != "evaluate"]
    per_round = [float(np.mean(list(c["site_seconds"].values()))) for c in train]
    accs = {s: (v.get("test") or {}).get("accuracy") for s, v in rec["sites"].items()}
    bal = {s: (v.get("test") or {}).get("balanced_accuracy") for s, v in rec["sites"].items()}
    rounds = [r for r in rec["rounds"] if r["task"] != "evaluate"]
    up = [float(np.mean(list(r["bytes_up_per_site"].values()))) if r.get("bytes_up_per_site") else 0.0
          for r in rounds]
    down = [float(r.get("bytes_down_per_site", 0)) for r in rounds]
    vals = [a for a in accs.values() if a is not None]
    return {"mean_site_accuracy": float(np.mean(vals)) if vals else None, "site_accuracy": accs,
            "site_balanced_accuracy": bal, "client_seconds_per_round": float(np.mean(per_round)) if per_round else 0,
            "client_seconds_by_round": per_round, "bytes_up_per_site_by_round": up,
            "bytes_down_per_site_by_round": down, "excluded": rec.get("excluded", {}), "notes": rec.get("notes", []),
            "effective_rank": rec.get("effective_rank"), "wall_s": wall,
            "models": {s: cfg["model"]["family"] for s, cfg in profile.items()}}


class ResultStore:
    """Resumable results: ``{"settings": {...}, "runs": {key: result}}`` rewritten atomically after every run."""

    def __init__(self, path: Path, settings: dict, fresh: bool = False):
        self.path = path
        self.settings = settings
        self.data = {"settings": settings, "runs": {}}
        if path.is_file() and not fresh:
            old = json.loads(path.read_text())
            if old.get("settings") != settings:
                sys.exit(f"{path} holds results for other settings:\n  {old.get('settings')}\nvs now\n  {settings}\n"
                         f"pass --results OTHER.json, or --fresh to discard them")
            self.data = old

    def done(self, key: str) -> bool:
        return key in self.data["runs"]

    def get(self, key: str):
        return self.data["runs"].get(key)

    def put(self, key: str, result: dict) -> None:
        self.data["runs"][key] = result
        tmp = self.path.with_suffix(".partial.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def estimate_seconds(n_runs: int, sites: int, rounds: int, epochs: int, images: int, s_per_image: float) -> float:
    """Rough budget. Per site and round: ``epochs`` training passes over ``images`` plus one feature pass
    (~1/3 of a training pass each) and a validation pass over ~10 % of the site's share of chest_xray_224; at the end
    a test and a validation pass. ``s_per_image`` = seconds per training image."""
    try:
        total = sum(1 for _ in (data_224() / "MANIFEST.csv").open()) - 1
    except OSError:
        total = 5856
    split = 0.1 * total / max(sites, 1)
    per_round = epochs * images + (images + split) / 3.0
    return n_runs * sites * (rounds * per_round + 2 * split / 3.0) * s_per_image


def fmt_s(s: float) -> str:
    return f"{s / 3600:.1f} h" if s > 5400 else f"{s / 60:.0f} min" if s > 90 else f"{s:.0f} s"


def mean_std(vals):
    v = [x for x in vals if x is not None]
    if not v:
        return None, None
    return float(np.mean(v)), (float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
