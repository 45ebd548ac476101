"""Near-duplicate threshold: how similar are distinct radiographs, and how similar is a radiograph to its re-export?

Data: ``$CXR_DATA/chest_xray_original`` (850 Kermany JPEGs, 774 patients; no part of chest_xray_224 is read).
Signature: :func:`chest_xray.grouping.near_duplicate_signature` of the image as the scan decodes it
(``read_image(path, target_size=1)``). Re-exports: every 8th image re-encoded four ways (JPEG quality 30 and 10,
half size at quality 75, lossless PNG). Deterministic (no randomness). Writes ``results.json`` beside this file.

    python -m studies.near_duplicates.measure
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from chest_xray import patient_id_from_name, read_image
from chest_xray.grouping import NEAR_DUPLICATE_MIN_SIMILARITY, near_duplicate_signature

OPS = ("jpeg_q30", "jpeg_q10", "half_size_q75", "png")


def _reexport(src: Path, op: str, tmp: Path) -> Path:
    with Image.open(src) as im:
        g = im.convert("L")
    buf = io.BytesIO()
    if op == "png":
        g.save(buf, "PNG")
    elif op == "half_size_q75":
        g.resize((g.width // 2, g.height // 2), Image.Resampling.LANCZOS).save(buf, "JPEG", quality=75)
    else:
        g.save(buf, "JPEG", quality=int(op.split("q")[1]))
    out = tmp / ("x.png" if op == "png" else "x.jpeg")
    out.write_bytes(buf.getvalue())
    return out


def main() -> int:
    root = Path(os.environ.get("CXR_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
    files = sorted((root / "chest_xray_original" / "train").glob("*/*.jpeg"))
    if not files:
        print(f"no images under {root / 'chest_xray_original'}", file=sys.stderr)
        return 2
    sig = np.stack([near_duplicate_signature(read_image(f, target_size=1)[0]) for f in files])
    pid = [patient_id_from_name(f) for f in files]
    sim = sig @ sig.T
    iu = np.triu_indices(len(files), 1)
    same = np.array([pid[i] == pid[j] for i, j in zip(*iu)])
    distinct = sim[iu][~same]
    reexport = {op: [] for op in OPS}
    with tempfile.TemporaryDirectory() as d:
        for i in range(0, len(files), 8):
            for op in OPS:
                s = near_duplicate_signature(read_image(_reexport(files[i], op, Path(d)), target_size=1)[0])
                reexport[op].append(float(s @ sig[i]))
    res = {
        "data": "chest_xray_original (850 images, 774 patients)",
        "threshold": NEAR_DUPLICATE_MIN_SIMILARITY,
        "distinct_patient_pairs": {"n": int(distinct.size), "max": float(distinct.max()),
                                   "p99.99": float(np.percentile(distinct, 99.99)),
                                   "n_at_or_above_threshold": int((distinct >= NEAR_DUPLICATE_MIN_SIMILARITY).sum())},
        "same_patient_pairs": {"n": int(same.sum()), "max": float(sim[iu][same].max())},
        "reexports": {op: {"n": len(v), "min": float(min(v)), "n_below_threshold":
                           int(sum(x < NEAR_DUPLICATE_MIN_SIMILARITY for x in v))} for op, v in reexport.items()},
    }
    out = Path(__file__).with_name("results.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
