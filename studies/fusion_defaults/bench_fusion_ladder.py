"""Fusion ladder: where does OHFL's one-shot fusion lose what the sites learned? (not a test)

Each rung fuses parents that differ in one more way and scores the fused model *zero-shot* (no fine-tuning) against
its parents on the committed ``tuning`` part of ``../shared/data/chest_xray_224`` (735 images, patient-disjoint
from the training images; ``chest_xray/splits.py``). Nothing here touches the ``evaluation`` part.

Rungs (parents trained once and cached in ``runs/ladder_cache_<aspect>/``):

* **0** — a model fused with a permuted copy of itself through the whole server path: ``tests/test_fusion_rung0.py``
  (exact; not repeated here);
* **a** — two cnn/shallow models at 64 px from the *same* initialisation, trained on disjoint patient halves of
  ``chest_xray_original``;
* **b** — the same from different initialisations;
* **c** — different widths (1.0 and 0.5);
* **d** — different depths (shallow and deep);
* **e** — different input sizes (64 and 128 px);
* **f** — all 6 width sites of the main job (``chest_xray_original``, width scheme, seed 0: shallow@64 x2,
  medium@96 x2, deep@128 x2), fused in CID order.

A fused model is scored at every parent's input size and the AUCs averaged (no size is picked on the scoring set);
the gap is that mean minus the mean of the parents' AUCs (each parent at its own size). 95% CIs: paired bootstrap
over the scoring images (the fused and parent scores are resampled together).

Reference points: plain weight averaging (same architecture only), the parents' ensemble (averaged probabilities,
each parent at its own size: the upper reference) and probe distillation (the ensemble's soft labels on the
server's probe images, distilled into the target architecture from the fused weights; a cheap server-side
alternative).

Levers, varied one at a time from the baseline (the defaults before this study): ground metric wts/acts; emd/Sinkhorn;
repair none/layer/channel; per-site vs shared (nested) initialisation; probe at the largest size vs at each
model's own size; linear vs debiased vs pooled CKA.

    .venv/bin/python -m studies.fusion_defaults.bench_fusion_ladder                    # one seed, all levers
    .venv/bin/python -m studies.fusion_defaults.bench_fusion_ladder --seeds 0,1,2 --configs baseline,winner --rungs f
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
import zlib
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

from hfl_components.fusion import aggregate_models  # noqa: E402
from hfl_components.models.fusable import build_fusable, shared_init_state  # noqa: E402

# decoded images and trained parents depend on how images are made square (chest_xray.DEFAULT_ASPECT, "stretch"
# since the data-layer fix); the folder names it so letterboxed parents are never reused
from chest_xray import DEFAULT_ASPECT  # noqa: E402

CACHE = REPO / "runs" / f"ladder_cache_{DEFAULT_ASPECT}"
OUT = REPO / "runs" / "studies" / "fusion_ladder.md"  # raw tables; the condensed ones: RESULTS.md
SIZES = (64, 96, 128)
EPOCHS = 20
PROBE_N = 64
N_BOOT = 300

BASELINE = {"ot_solver": "emd", "ground_metric": "wts", "repair": "layer", "cka": "linear", "probe": "largest",
            "init": "site"}
LEVERS = {
    "baseline": {},
    "sinkhorn": {"ot_solver": "sinkhorn"},
    "acts": {"ground_metric": "acts"},
    "repair=none": {"repair": "none"},
    "repair=channel": {"repair": "channel"},
    "init=shared": {"init": "shared"},
    "probe=own": {"probe": "own"},
    "cka=debiased": {"cka": "debiased"},
    "cka=pooled": {"cka": "pooled"},
    "paper": {"ot_solver": "sinkhorn", "repair": "none"},
    "acts+channel": {"ground_metric": "acts", "repair": "channel"},  # finalist combinations, not single levers
    "acts+probe=own": {"ground_metric": "acts", "probe": "own"},
    "acts+channel+own": {"ground_metric": "acts", "repair": "channel", "probe": "own"},  # today's defaults
}


def shallow(width=1.0, depth="shallow"):
    return {"family": "cnn", "depth": depth, "width": width, "in_channels": 1, "num_classes": 2}


# ------------------------------------------------------------------------------------------------ data
def data_root() -> Path:
    import os
    env = os.environ.get("CXR_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


def build_cache() -> None:
    """Decode the images once with the sites' eval transforms (chest_xray.build_transforms) at 64/96/128 px."""
    from chest_xray import CLASS_NAMES, build_transforms, partition_records, scan_dataset
    from chest_xray.splits import split_files, split_rows

    CACHE.mkdir(parents=True, exist_ok=True)
    root = data_root()
    recs, _ = scan_dataset(root / "chest_xray_original", labels="binary", verify=False)
    res = partition_records(recs, 6, "width", seed=0, class_names=CLASS_NAMES["binary"])
    rows = [(s, r["split"], str(r["path"]), int(r["label"]), str(r["patient_id"]))
            for s, rs in res.sites.items() for r in rs]

    def enc(items, size):
        tf = build_transforms(size, "eval")
        return torch.stack([torch.as_tensor(tf({"image": p, "label": lab})["image"]).float() for p, lab in items])

    for size in SIZES:
        if not (CACHE / f"original_{size}.pt").is_file():
            torch.save({"x": enc([(r[2], r[3]) for r in rows], size), "y": torch.tensor([r[3] for r in rows]),
                        "site": [r[0] for r in rows], "split": [r[1] for r in rows], "patient": [r[4] for r in rows],
                        "path": [r[2] for r in rows]}, CACHE / f"original_{size}.pt")
    for part in ("tuning", "probe"):
        files = split_files(part, root / "chest_xray_224")
        labs = [0 if r["label"].upper() == "NORMAL" else 1 for r in split_rows(part)]
        for size in SIZES:
            if not (CACHE / f"{part}_{size}.pt").is_file():
                torch.save({"x": enc(list(zip(map(str, files), labs)), size), "y": torch.tensor(labs)},
                           CACHE / f"{part}_{size}.pt")


_DATA: dict = {}


def data(name: str, size: int) -> dict:
    key = (name, size)
    if key not in _DATA:
        _DATA[key] = torch.load(CACHE / f"{name}_{size}.pt", weights_only=False)
    return _DATA[key]


def halves(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint, patient-grouped, label-stratified halves of chest_xray_original (IID sites for rungs a-e)."""
    d = data("original", 64)
    pats: dict[str, int] = {}
    for p, y in zip(d["patient"], d["y"].tolist()):
        pats.setdefault(p, y)
    rng = np.random.default_rng(1000 + seed)
    side = {}
    for lab in (0, 1):
        ps = sorted(p for p, y in pats.items() if y == lab)
        rng.shuffle(ps)
        for i, p in enumerate(ps):
            side[p] = i % 2
    s = np.array([side[p] for p in d["patient"]])
    return np.flatnonzero(s == 0), np.flatnonzero(s == 1)


def site_idx(site: str) -> np.ndarray:
    d = data("original", 64)
    return np.array([i for i, (s, sp) in enumerate(zip(d["site"], d["split"])) if s == site and sp == "train"])


# ------------------------------------------------------------------------------------------------ parents
def init_state(spec: dict, init: str, seed: int) -> dict:
    if init == "shared":
        return shared_init_state(spec, seed)
    torch.manual_seed(seed)
    return build_fusable(spec).state_dict()


def train_parent(spec: dict, size: int, idx: np.ndarray, init: str, init_seed: int, seed: int,
                 epochs: int = EPOCHS) -> dict:
    """Train (or load from the cache) one parent: SGD lr 0.01, momentum 0.9, batch 16, horizontal flips."""
    key = hashlib.sha1(json.dumps([spec, size, idx.tolist(), init, init_seed, seed, epochs]).encode()).hexdigest()[:16]
    p = CACHE / "parents" / f"{key}.pt"
    if p.is_file():
        return torch.load(p, weights_only=True)
    t0 = time.perf_counter()
    m = build_fusable(spec)
    m.load_state_dict(init_state(spec, init, init_seed))
    d = data("original", size)
    x, y = d["x"][idx], d["y"][idx]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    m.train()
    for _ in range(epochs):
        perm = torch.randperm(len(idx), generator=g)
        for s in range(0, len(idx), 16):
            b = perm[s:s + 16]
            xb = x[b]
            flip = torch.rand(len(b), generator=g) < 0.5
            xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
            loss = torch.nn.functional.cross_entropy(m(xb), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    sd = m.state_dict()
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save(sd, p)
    print(f"  trained {spec.get('depth')} w{spec.get('width')} @{size}px on {len(idx)} images ({init} init "
          f"{init_seed}) in {time.perf_counter() - t0:.0f} s", flush=True)
    return sd


def rung_parents(rung: str, init: str, seed: int) -> list[dict]:
    """The parents of a rung: [{name, spec, sd, size, n}]. ``init``: 'site' (own seeds) or 'shared' (one seed)."""
    A, B = halves(seed)
    s_a, s_b = 100 * seed + 1, 100 * seed + 2  # per-site init seeds
    if init == "shared" or rung == "a":
        s_a = s_b = 100 * seed
        init = "shared"
    plan = {"a": [(shallow(), 64), (shallow(), 64)], "b": [(shallow(), 64), (shallow(), 64)],
            "c": [(shallow(), 64), (shallow(0.5), 64)], "d": [(shallow(), 64), (shallow(1.0, "deep"), 64)],
            "e": [(shallow(), 64), (shallow(), 128)]}
    if rung in plan:
        out = []
        for name, (spec, size), idx, s in zip(("A", "B"), plan[rung], (A, B), (s_a, s_b)):
            sd = train_parent(spec, size, idx, init, s, seed)
            out.append({"name": name, "spec": spec, "sd": sd, "size": size, "n": len(idx)})
        return out
    assert rung == "f"
    out = []
    for k, (depth, size) in enumerate([("shallow", 64), ("shallow", 64), ("medium", 96), ("medium", 96),
                                       ("deep", 128), ("deep", 128)]):
        site = f"site-{k + 1}"
        idx = site_idx(site)
        spec = shallow(1.0, depth)
        s = 100 * seed if init == "shared" else seed + zlib.crc32(site.encode()) % 1000
        sd = train_parent(spec, size, idx, init, s, seed)
        out.append({"name": site, "spec": spec, "sd": sd, "size": size, "n": len(idx)})
    return out


# ------------------------------------------------------------------------------------------------ scoring
@torch.no_grad()
def predict(spec: dict, sd: dict, size: int, part: str = "tuning") -> np.ndarray:
    m = build_fusable(spec)
    m.load_state_dict(sd)
    m.eval()
    x = data(part, size)["x"]
    return torch.cat([torch.softmax(m(x[i:i + 256]), 1)[:, 1] for i in range(0, len(x), 256)]).numpy()


def auc(y: np.ndarray, p: np.ndarray) -> float:
    from scipy.stats import rankdata
    r = rankdata(p)
    n1 = int(y.sum())
    n0 = len(y) - n1
    return float((r[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def bacc(y: np.ndarray, p: np.ndarray) -> float:
    pred = p >= 0.5
    return float(0.5 * ((pred[y == 1]).mean() + (~pred[y == 0]).mean()))


def scores(y, fused_probs: list[np.ndarray], parent_probs: list[np.ndarray], rng) -> dict:
    """Fused AUC (mean over sizes), parents' mean AUC, gap with a paired bootstrap 95% CI; balanced accuracies."""
    def stat(ix):
        f = np.mean([auc(y[ix], p[ix]) for p in fused_probs])
        q = np.mean([auc(y[ix], p[ix]) for p in parent_probs])
        return f, q
    f, q = stat(np.arange(len(y)))
    boots = []
    for _ in range(N_BOOT):
        ix = rng.integers(0, len(y), len(y))
        a, b = stat(ix)
        boots.append((a, a - b))
    boots = np.array(boots)
    lo, hi = np.percentile(boots, [2.5, 97.5], axis=0)
    return {"auc": f, "auc_ci": [lo[0], hi[0]], "parents_auc": q, "gap": f - q, "gap_ci": [lo[1], hi[1]],
            "bacc": float(np.mean([bacc(y, p) for p in fused_probs])),
            "parents_bacc": float(np.mean([bacc(y, p) for p in parent_probs]))}


def probes(parents: list[dict], mode: str, seed: int):
    """The server's probe: PROBE_N images of the committed probe part, at the largest size or at each size."""
    idx = np.random.default_rng(seed).choice(len(data("probe", 64)["x"]), PROBE_N, replace=False)
    sizes = sorted({p["size"] for p in parents})
    if mode == "largest":
        return data("probe", max(sizes))["x"][idx]
    return {s: data("probe", s)["x"][idx] for s in sizes}


def fuse(parents: list[dict], cfg: dict, seed: int) -> tuple[dict, dict, float]:
    models = [{"name": p["name"], "spec": p["spec"], "state_dict": p["sd"], "n_samples": p["n"],
               "input_size": p["size"]} for p in parents]
    t0 = time.perf_counter()
    spec, sd, _ = aggregate_models(models, strategy="cid", probe=probes(parents, cfg["probe"], seed),
                                   ot_solver=cfg["ot_solver"], ground_metric=cfg["ground_metric"],
                                   repair=cfg["repair"], cka=cfg["cka"], seed=seed)
    return spec, sd, time.perf_counter() - t0


def distil(spec: dict, sd: dict, parents: list[dict], probe_seed: int, epochs: int = 30) -> dict:
    """Probe distillation: train the fused model on the probe part's images (unlabelled) towards the parents'
    ensemble probabilities (KL), starting from the fused weights; at the largest parent size."""
    size = max(p["size"] for p in parents)
    x = data("probe", size)["x"]
    with torch.no_grad():
        t = np.mean([predict(p["spec"], p["sd"], p["size"], "probe") for p in parents], 0)
    t = torch.tensor(np.stack([1 - t, t], 1), dtype=torch.float32)
    m = build_fusable(spec)
    m.load_state_dict(sd)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(probe_seed)
    m.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for s in range(0, len(x), 16):
            b = perm[s:s + 16]
            loss = torch.nn.functional.kl_div(torch.log_softmax(m(x[b]), 1), t[b], reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    return m.state_dict()


# ------------------------------------------------------------------------------------------------ main
def run(rungs, configs, seeds, with_refs=True) -> list[dict]:
    rows = []
    y = data("tuning", 64)["y"].numpy()
    for seed in seeds:
        for rung in rungs:
            base_parents = None
            for cname in configs:
                cfg = {**BASELINE, **LEVERS[cname]}
                if cname == "init=shared" and rung in ("a", "b"):
                    continue  # rung a is the shared-init version of rung b
                parents = rung_parents(rung, cfg["init"], seed)
                par_probs = [predict(p["spec"], p["sd"], p["size"]) for p in parents]
                spec, sd, secs = fuse(parents, cfg, seed)
                sizes = sorted({p["size"] for p in parents})
                fused = [predict(spec, sd, s) for s in sizes]
                rng = np.random.default_rng(seed)
                row = {"seed": seed, "rung": rung, "config": cname, "fusion_s": secs,
                       "parent_aucs": [auc(y, p) for p in par_probs], **scores(y, fused, par_probs, rng)}
                rows.append(row)
                print(_fmt(row), flush=True)
                if with_refs and cname == "baseline":
                    base_parents = (parents, par_probs, spec, sd, sizes)
            if with_refs and base_parents is not None:
                parents, par_probs, spec, sd, sizes = base_parents
                refs = {"ensemble": [np.mean(par_probs, 0)]}
                if all(p["spec"] == parents[0]["spec"] for p in parents):
                    tot = sum(p["n"] for p in parents)
                    avg = {k: sum(p["n"] * p["sd"][k] for p in parents) / tot for k in parents[0]["sd"]}
                    refs["weight average"] = [predict(parents[0]["spec"], avg, s) for s in sizes]
                dsd = distil(spec, sd, parents, seed)
                refs["probe distillation"] = [predict(spec, dsd, s) for s in sizes]
                for name, probs in refs.items():
                    row = {"seed": seed, "rung": rung, "config": f"ref: {name}", "fusion_s": None,
                           **scores(y, probs, par_probs, np.random.default_rng(seed))}
                    rows.append(row)
                    print(_fmt(row), flush=True)
    return rows


def _fmt(r: dict) -> str:
    return (f"rung {r['rung']} seed {r['seed']} {r['config']:<24} AUC {r['auc']:.3f} "
            f"[{r['auc_ci'][0]:.3f}, {r['auc_ci'][1]:.3f}]  parents {r['parents_auc']:.3f}  gap {r['gap']:+.3f} "
            f"[{r['gap_ci'][0]:+.3f}, {r['gap_ci'][1]:+.3f}]  bacc {r['bacc']:.3f} (parents {r['parents_bacc']:.3f})"
            + (f"  {r['fusion_s']:.2f} s" if r.get("fusion_s") is not None else ""))


BUDGET = """Budget: parents trained once (cached) for {epochs} epochs (SGD lr 0.01, momentum 0.9, batch 16, horizontal
flips) on `chest_xray_original` images prepared by the sites' eval transforms (square resize: {aspect}): rungs a-e on two disjoint,
patient-grouped, label-stratified halves (425 images each), rung f on the train splits of the 6 width sites of the
main job (seed 0). Scored zero-shot on the committed `tuning` part of `chest_xray_224` (735 images, 1 = pneumonia;
never the `evaluation` part). Probe: {probe_n} images of the committed `probe` part. Seeds: {seeds}. 95% CIs: paired
bootstrap over the 735 scoring images ({n_boot} resamples); they do not include the variation between training
seeds. Fused models are scored at every parent's input size and averaged; gap = fused AUC − mean parent AUC.
CPU, 1 thread."""


def write_md(rows: list[dict], seeds, path: Path = OUT) -> None:
    lines = ["# Fusion ladder: zero-shot fused model vs its parents", "",
             BUDGET.format(epochs=EPOCHS, probe_n=PROBE_N, seeds=",".join(map(str, seeds)), n_boot=N_BOOT,
                           aspect=DEFAULT_ASPECT), "",
             "Baseline = the earlier fusion defaults: " + ", ".join(f"{k}={v}" for k, v in BASELINE.items())
             + ". Each other row changes one lever. Rung 0 (permuted copy through the whole server path) is exact: "
               "`tests/test_fusion_rung0.py`.", "",
             "| rung | seed | config | fused AUC [95% CI] | parents' mean AUC | gap [95% CI] | fused bal. acc | "
             "parents' bal. acc | fusion s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rung']} | {r['seed']} | {r['config']} | {r['auc']:.3f} [{r['auc_ci'][0]:.3f}, "
                     f"{r['auc_ci'][1]:.3f}] | {r['parents_auc']:.3f} | {r['gap']:+.3f} [{r['gap_ci'][0]:+.3f}, "
                     f"{r['gap_ci'][1]:+.3f}] | {r['bacc']:.3f} | {r['parents_bacc']:.3f} | "
                     + ("" if r.get("fusion_s") is None else f"{r['fusion_s']:.2f}") + " |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", default="a,b,c,d,e,f")
    ap.add_argument("--configs", default=",".join(LEVERS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--no-refs", action="store_true", help="skip the reference points")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--json", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in a.seeds.split(",")]
    print(BUDGET.format(epochs=EPOCHS, probe_n=PROBE_N, seeds=a.seeds, n_boot=N_BOOT, aspect=DEFAULT_ASPECT),
          flush=True)
    build_cache()
    rows = run(a.rungs.split(","), a.configs.split(","), seeds, with_refs=not a.no_refs)
    write_md(rows, seeds, Path(a.out))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
