"""Part 2 of the near-duplicate study: the LSH index against the exact search, and the false-merge check at site size.

Signatures of images decoded as the scan decodes them (``read_image(path, target_size=SIGNATURE_MIN_SIDE)``).
Data: every distinct film of ``$CXR_DATA/chest_xray_original`` (850) and ``chest_xray_224`` (2,770): patient-disjoint
sets, same-patient pairs (Kermany name prefix) left out. Re-exports: Part 1's four (JPEG q30 / q10, half size q75,
PNG) of every 8th original. Scale: 100,000 signatures made from the real ones (each a random mix of two real films'
signatures plus noise, renormalised: chest-like, distinct). Index seed 0, mixing seed 0. Writes
``index_results.json`` beside this file.

    python -m studies.near_duplicates.index_check
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from chest_xray import patient_id_from_name, read_image
from chest_xray.dataset import SIGNATURE_MIN_SIDE
from chest_xray.grouping import NEAR_DUPLICATE_MIN_SIMILARITY, near_duplicate_pairs, near_duplicate_signature
from studies.near_duplicates.measure import OPS, _reexport

T = NEAR_DUPLICATE_MIN_SIMILARITY


def _signatures(files: list[Path]) -> np.ndarray:
    return np.stack([near_duplicate_signature(read_image(f, target_size=SIGNATURE_MIN_SIDE)[0]) for f in files])


def _distinct_tail(sig: np.ndarray, pid: list[str], n_site: int = 100_000) -> dict:
    """All-pairs similarity of distinct films (block by block): counts at or above 0.95 .. 0.99 and the
    log-linear extrapolation of the >= 0.99 count to a site of ``n_site`` images."""
    levels = (0.95, 0.97, 0.98, 0.99)
    counts = dict.fromkeys(levels, 0)
    n_pairs, top = 0, -1.0
    pid_arr = np.array(pid)
    for s in range(0, len(sig), 512):
        sim = sig[s: s + 512] @ sig.T
        rows = np.arange(s, min(s + 512, len(sig)))[:, None]
        keep = (np.arange(len(sig))[None, :] > rows) & (pid_arr[rows] != pid_arr[None, :])
        vals = sim[keep]
        n_pairs += vals.size
        top = max(top, float(vals.max()) if vals.size else top)
        for lv in levels:
            counts[lv] += int((vals >= lv).sum())
    frac = {lv: counts[lv] / n_pairs for lv in levels}
    # log-linear tail through the fractions at 0.97 and 0.98, extended to 0.99
    if frac[0.97] > 0 and frac[0.98] > 0:
        slope = (np.log(frac[0.98]) - np.log(frac[0.97])) / 0.01
        f99 = float(np.exp(np.log(frac[0.98]) + slope * 0.01))
    else:
        f99 = 0.0
    site_pairs = n_site * (n_site - 1) / 2
    return {"n_films": len(sig), "n_pairs": n_pairs, "max": top, "counts": {str(k): v for k, v in counts.items()},
            "fraction_at_or_above_0.99_extrapolated": f99,
            f"expected_pairs_at_or_above_0.99_in_{n_site}": f99 * site_pairs}


def main() -> int:
    root = Path(os.environ.get("CXR_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
    orig = sorted((root / "chest_xray_original" / "train").glob("*/*.jpeg"))
    small = sorted((root / "chest_xray_224" / "train").glob("*/*.jpeg"))
    if not orig or not small:
        print(f"no images under {root}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sig = _signatures(orig + small)
    pid = [f"o:{patient_id_from_name(f)}" for f in orig] + [f"s:{patient_id_from_name(f)}" for f in small]
    res = {"data": f"chest_xray_original ({len(orig)}) + chest_xray_224 ({len(small)})", "threshold": T,
           "signature_seconds": time.perf_counter() - t0, "distinct": _distinct_tail(sig, pid)}
    # recall: re-exports of every 8th original added to the set; the index against the exact search
    extra, twin = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(0, len(orig), 8):
            for op in OPS:
                img = read_image(_reexport(orig[i], op, Path(d)), target_size=SIGNATURE_MIN_SIDE)[0]
                extra.append(near_duplicate_signature(img))
                twin.append(i)
    allsig = np.vstack([sig, np.stack(extra)])
    exact = {(int(a), int(b)) for a, b in zip(*np.nonzero(np.triu(allsig @ allsig.T, 1) >= 0.97))}
    t1 = time.perf_counter()
    found97 = set(near_duplicate_pairs(list(allsig), 0.97))
    found = set(near_duplicate_pairs(list(allsig)))
    res["index"] = {"n": len(allsig), "seconds_two_searches": time.perf_counter() - t1,
                    "exact_pairs_at_or_above_0.97": len(exact), "found_at_0.97": len(found97 & exact),
                    "exact_pairs_at_or_above_0.99": sum(1 for a, b in exact if allsig[a] @ allsig[b] >= T),
                    "found_at_0.99": len(found), "reexport_pairs": len(twin),
                    "reexport_pairs_found": sum(1 for k, i in enumerate(twin) if (i, len(sig) + k) in found),
                    "reexport_pairs_exact": sum(1 for k, i in enumerate(twin) if allsig[i] @ allsig[len(sig) + k] >= T)}
    # scale: 100,000 chest-like distinct signatures
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, len(sig), (2, 100_000))
    mix = rng.uniform(0.2, 0.8, (100_000, 1))
    big = mix * sig[a] + (1 - mix) * sig[b] + 0.05 * rng.standard_normal((100_000, sig.shape[1]))
    big /= np.linalg.norm(big, axis=1, keepdims=True)
    t2 = time.perf_counter()
    pairs = near_duplicate_pairs(list(big))
    res["scale_100k"] = {"seconds": time.perf_counter() - t2, "pairs": len(pairs)}
    out = Path(__file__).with_name("index_results.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
