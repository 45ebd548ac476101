"""Who belongs with whom: a content-hash index of a site's images, the patient-id trust rule, and the findings.

A scan (:func:`chest_xray.scan_dataset`) and ``site check`` call these on their own records; everything stays at
the site. Only counts leave it (``partition.json`` carries counts, never a file name, hash or id).

**Exact duplicates** (same SHA-256 of the file's bytes): copies under one class are one patient (their patient
ids are merged, so a copy never lands in another split than its twin); copies under different classes
("contradictory labels") are all skipped and listed. Duplicates that sat in different split folders of the export
(``train/`` and ``test/``) are counted: the export's own split leaked.

**Near duplicates** (optional, ``near_duplicates=True``): the same radiograph re-exported (re-encoded, resized,
another format). Signature: the 255 lowest-frequency 2-D DCT coefficients (16 x 16 without the DC term) of the
image reduced to 32 x 32 and standardised, as a unit vector; two images are near duplicates when the cosine
similarity of their signatures is at least :data:`NEAR_DUPLICATE_MIN_SIMILARITY`. They are then grouped as one
patient like exact copies (a pair under two classes is reported, not skipped: similarity is no proof).

**The patient-id trust rule.** A patient id from a DICOM PatientID or a manifest's ``patient_id`` column is not
trusted for grouping when it is a placeholder (``ANONYMOUS``, ``UNKNOWN``, ``000000``: see
:func:`chest_xray.io.is_placeholder_id`), when more than :data:`MAX_IMAGES_PER_PATIENT` images share it, when it
holds at least :data:`MIN_IMAGES_FOR_SHARE` images and more than :data:`MAX_PATIENT_SHARE` of the scan's images, or
when it holds at least :data:`MIN_IMAGES_PER_LABEL` images of each of two classes ("both labels at scale").
An untrusted id makes each of its images its own group, unless a study id (DICOM Study Instance UID) or else an
accession number tells them apart: then images sharing that id are grouped, provided that id passes the same rule.
Ids taken from Kermany file names are never judged (their form is the data set's own).
"""
from __future__ import annotations

import hashlib
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

#: More images than this under one patient id: not trusted for grouping.
MAX_IMAGES_PER_PATIENT = 50
#: An id holding at least MIN_IMAGES_FOR_SHARE images and more than this fraction of all images: not trusted.
MAX_PATIENT_SHARE = 0.25
MIN_IMAGES_FOR_SHARE = 20
#: An id holding at least this many images of each of two classes: not trusted ("both labels at scale").
MIN_IMAGES_PER_LABEL = 5
#: Cosine similarity of near-duplicate signatures at or above which two images are the same radiograph.
NEAR_DUPLICATE_MIN_SIMILARITY = 0.99
#: Example file names a finding lists.
N_EXAMPLES = 3


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def near_duplicate_signature(image: np.ndarray) -> np.ndarray:
    """Unit vector (255,) of the lowest 2-D DCT frequencies of ``image`` (H, W) in [0, 1] reduced to 32 x 32
    (area average) and standardised; see the module docstring."""
    from PIL import Image

    a = np.asarray(image, dtype=np.float32)
    t = np.asarray(Image.fromarray(a, mode="F").resize((32, 32), Image.Resampling.BOX), dtype=np.float64)
    t = (t - t.mean()) / (t.std() + 1e-9)
    low = _DCT16 @ t @ _DCT16.T  # the 16 x 16 lowest frequencies of the orthonormal 2-D DCT-II of t
    c = low.ravel()[1:]
    return c / (np.sqrt(c @ c) + 1e-12)


def _dct_matrix(n: int = 32) -> np.ndarray:
    """Rows 0..15 of the orthonormal DCT-II matrix of size n (``scipy.fft.dct(x, norm="ortho")`` = C @ x)."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c[:16]


_DCT16 = _dct_matrix()


#: The near-duplicate index (:func:`near_duplicate_pairs`): hash tables, hashes per table, and the bucket width as a
#: multiple of the largest distance of a pair at the threshold. See studies/near_duplicates/RESULTS.md.
LSH_TABLES = 24
LSH_HASHES = 8
LSH_WIDTH = 4.0


def near_duplicate_pairs(signatures: list[np.ndarray | None], threshold: float = NEAR_DUPLICATE_MIN_SIMILARITY,
                         *, tables: int = LSH_TABLES, hashes: int = LSH_HASHES, seed: int = 0
                         ) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, i < j, whose signatures (unit vectors) have cosine similarity >= ``threshold``
    (None skipped), found through a locality-sensitive hash index, not by comparing all pairs.

    Unit vectors with cosine >= t are at Euclidean distance <= d = sqrt(2 (1 - t)). Each of ``tables`` hash
    tables keys a signature by ``hashes`` p-stable projections ``floor((a . v + b) / w)``, w = LSH_WIDTH * d
    (Datar, Immorlica, Indyk & Mirrokni 2004, "Locality-sensitive hashing scheme based on p-stable
    distributions"); two signatures sharing a key in any table are candidates, and a candidate is a pair when its
    exact cosine reaches ``threshold``. Every pair returned is exact; a pair at the threshold is missed with a
    small probability (measured in studies/near_duplicates/RESULTS.md). Time and memory grow with the number
    of signatures and of candidates, not with the number of pairs. Deterministic for a given ``seed``.
    """
    idx = np.array([i for i, s in enumerate(signatures) if s is not None], dtype=np.int64)
    if len(idx) < 2:
        return []
    v = np.stack([np.asarray(signatures[i], dtype=np.float64) for i in idx])
    w = LSH_WIDTH * float(np.sqrt(max(2.0 * (1.0 - threshold), 1e-12)))
    rng = np.random.default_rng(seed)
    found: set[tuple[int, int]] = set()
    for _ in range(tables):
        # einsum, not BLAS: BLAS threads spinning on a busy machine made this 10 x slower
        proj = np.einsum("ij,jk->ik", v, rng.standard_normal((v.shape[1], hashes)))
        keys = np.floor((proj + rng.uniform(0, w, hashes)) / w)
        mult = rng.integers(1, 2**62, hashes, dtype=np.int64) | 1  # one 64-bit key per row (wrapping arithmetic)
        key = (keys.astype(np.int64) * mult).sum(axis=1)
        order = np.argsort(key, kind="stable")
        starts = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
        sizes = np.diff(np.r_[starts, len(order)])
        for st, n in zip(starts[sizes > 1], sizes[sizes > 1]):
            found.update(_close_pairs(v, order[st: st + n], threshold))
    return sorted((int(idx[a]), int(idx[b])) for a, b in found)


def _close_pairs(v: np.ndarray, members: np.ndarray, threshold: float, block: int = 2048):
    """Pairs (a, b), a < b, of rows ``members`` of ``v`` with ``v[a] . v[b] >= threshold`` (one bucket)."""
    for start in range(0, len(members), block):
        rows = members[start: start + block]
        sim = np.einsum("ik,jk->ij", v[rows], v[members])
        for x, y in zip(*np.nonzero(sim >= threshold)):
            a, b = int(rows[x]), int(members[y])
            if a < b:
                yield a, b


def untrusted_ids(ids: list[str | None], labels: list[int], judged: list[bool],
                  placeholder: list[bool] | None = None) -> dict[str, str]:
    """Ids the trust rule (module docstring) rejects: id -> reason (no id or file name in it).

    Args:
        ids: one id per image (None: no id).
        labels: the images' labels.
        judged: whether the image's id is judged (DICOM or manifest ids; not Kermany names).
        placeholder: whether the image's raw id was a placeholder value.
    """
    n_all = len(ids)
    count: Counter = Counter()
    per_label: dict[str, Counter] = defaultdict(Counter)
    out: dict[str, str] = {}
    for k, (pid, lab, j) in enumerate(zip(ids, labels, judged)):
        if pid is None or not j:
            continue
        count[pid] += 1
        per_label[pid][lab] += 1
        if placeholder and placeholder[k]:
            out[pid] = "a placeholder value"
    for pid, n in count.items():
        if pid in out:
            continue
        if n > MAX_IMAGES_PER_PATIENT:
            out[pid] = f"shared by more than {MAX_IMAGES_PER_PATIENT} images"
        elif n >= MIN_IMAGES_FOR_SHARE and n > MAX_PATIENT_SHARE * n_all:
            out[pid] = f"shared by more than {MAX_PATIENT_SHARE:.0%} of the images"
        elif sum(1 for c in per_label[pid].values() if c >= MIN_IMAGES_PER_LABEL) >= 2:
            out[pid] = f"holds at least {MIN_IMAGES_PER_LABEL} images of each of two classes"
    return out


def named_across_classes(recs: list[dict[str, Any]], info: list[dict[str, Any]]) -> dict[str, str]:
    """Ids taken from file names (``info[k]["from_name"]``) that NORMAL images (label 0) and pneumonia images (any
    other label) share: id -> reason.

    A data set's own naming (Kermany's ``personN``, ``IM-NNNN``) never puts one patient's number under NORMAL and
    PNEUMONIA (it does put a patient's bacterial and viral films under one ``personN``); an export whose names
    repeat in every patient (a counter ``IM-0001``) does, and would make unrelated patients of both classes one
    patient. Such an id is not trusted (one group per image).
    """
    labels: dict[str, set[bool]] = defaultdict(set)
    for r, i in zip(recs, info):
        if i.get("from_name"):
            labels[r["patient_id"]].add(int(r["label"]) > 0)
    return {pid: "a file-name id under NORMAL and PNEUMONIA" for pid, ls in labels.items() if len(ls) > 1}


class _Union:
    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)  # the smaller id names the group: deterministic


def _name(path: str) -> str:
    return Path(path).name


def _examples(paths) -> list[str]:
    return sorted({_name(p) for p in paths})[:N_EXAMPLES]


def _finding(kind: str, count: int, unit: str, paths, detail: str = "") -> dict[str, Any]:
    ex = _examples(paths)
    text = f"{kind}: {count} {unit}{detail}" + (f" (e.g. {', '.join(ex)})" if ex else "")
    return {"kind": kind, "count": int(count), "examples": ex, "text": text}


def _regroup_untrusted(recs: list[dict[str, Any]], info: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply the trust rule in place (``patient_id`` of images under an untrusted id); returns the counts."""
    bad = untrusted_ids([r["patient_id"] for r in recs], [int(r["label"]) for r in recs],
                        [i.get("judged", False) for i in info], [i.get("placeholder", False) for i in info])
    bad.update(named_across_classes(recs, info))
    hit = [k for k, r in enumerate(recs) if r["patient_id"] in bad]
    summary = {"untrusted_ids": len(bad), "images": len(hit), "by_study": 0, "by_accession": 0, "per_image": 0,
               "reasons": dict(Counter(bad.values())), "paths": [recs[k]["path"] for k in hit]}
    left = hit
    for key in ("study", "accession"):
        cand = [k for k in left if info[k].get(key)]
        worse = untrusted_ids([info[k][key] for k in cand], [int(recs[k]["label"]) for k in cand], [True] * len(cand))
        good = [k for k in cand if info[k][key] not in worse]
        for k in good:
            recs[k]["patient_id"] = info[k][key]
        summary["by_" + key] = len(good)
        taken = set(good)
        left = [k for k in left if k not in taken]
    for k in left:
        recs[k]["patient_id"] = "img-" + hashlib.sha256(recs[k]["path"].encode("utf-8", "surrogateescape")
                                                        ).hexdigest()[:16]
    summary["per_image"] = len(left)
    return summary


def group_records(records: list[dict[str, Any]], info: list[dict[str, Any]], *, near_duplicates: bool = False
                  ) -> tuple[list[dict[str, Any]], list[dict[str, str]], dict[str, Any]]:
    """Regroup scan records by the trust rule and the content-hash index (module docstring).

    Args:
        records: scan records (``path``, ``label``, ``patient_id``, ...); their ``patient_id`` is rewritten.
        info: per record: ``sha256`` (str or None), ``signature`` (near-duplicate signature or None), ``split``
            (the export's split folder or None), ``judged``, ``placeholder``, ``study``, ``accession``.
        near_duplicates: group near duplicates as one patient (their pairs are counted either way when
            signatures are given).

    Returns:
        ``(kept records, skipped entries, summary)``: contradictory exact duplicates are skipped (kind
        ``"contradictory labels"``); ``summary`` holds ``patient_ids`` and ``duplicates`` (counts, and the paths
        for the site's own findings).
    """
    recs = [dict(r) for r in records]
    ids = _regroup_untrusted(recs, info)
    by_hash: dict[str, list[int]] = defaultdict(list)
    for k, i in enumerate(info):
        if i.get("sha256"):
            by_hash[i["sha256"]].append(k)
    groups = [g for g in by_hash.values() if len(g) > 1]
    contra = [g for g in groups if len({int(recs[k]["label"]) for k in g}) > 1]
    same = [g for g in groups if len({int(recs[k]["label"]) for k in g}) == 1]
    drop = {k for g in contra for k in g}
    u = _Union()
    for g in same:
        for k in g[1:]:
            u.join(recs[g[0]]["patient_id"], recs[k]["patient_id"])
    sigs = [i.get("signature") for i in info]
    pairs = [(a, b) for a, b in near_duplicate_pairs(sigs) if info[a].get("sha256") != info[b].get("sha256")]
    near_contra = [(a, b) for a, b in pairs if recs[a]["label"] != recs[b]["label"]]
    if near_duplicates:
        for a, b in pairs:
            if a not in drop and b not in drop and recs[a]["label"] == recs[b]["label"]:
                u.join(recs[a]["patient_id"], recs[b]["patient_id"])
    for r in recs:
        r["patient_id"] = u.find(r["patient_id"])
    across = [g for g in groups if len({info[k].get("split") for k in g} - {None}) > 1]
    skipped = [{"path": recs[k]["path"], "reason": "the same bytes are under more than one class ("
                + ", ".join(_name(recs[j]["path"]) + f" label {recs[j]['label']}" for j in g if j != k)[:200]
                + "): contradictory labels, none is used", "kind": "contradictory labels"}
               for g in contra for k in g]
    dup = {"exact_groups": len(same), "exact_images": sum(len(g) for g in same),
           "contradictory_groups": len(contra), "contradictory_images": len(drop), "across_splits": len(across),
           "near_pairs": len(pairs) if any(s is not None for s in sigs) else None,
           "near_contradictory_pairs": len(near_contra), "near_grouped": bool(near_duplicates),
           "near_threshold": NEAR_DUPLICATE_MIN_SIMILARITY,
           "paths": {"exact": [recs[k]["path"] for g in same for k in g], "contradictory": [recs[k]["path"]
                     for k in sorted(drop)], "across": [recs[k]["path"] for g in across for k in g]}}
    _near_summary(dup, recs, info, pairs)
    kept = [r for k, r in enumerate(recs) if k not in drop]
    return kept, skipped, {"patient_ids": ids, "duplicates": dup}


def _near_summary(dup: dict[str, Any], recs: list[dict[str, Any]], info: list[dict[str, Any]],
                  pairs: list[tuple[int, int]]) -> None:
    """Add the near pairs to ``dup``: ``near_across_splits`` (pairs whose images sit in different splits) and, under
    ``paths``, their paths and the pairs themselves (``near_pairs``: ``[path, path, similarity]``, site-local)."""
    sig = [i.get("signature") for i in info]
    across = [(a, b) for a, b in pairs if None not in (info[a].get("split"), info[b].get("split"))
              and info[a]["split"] != info[b]["split"]]
    dup["near_across_splits"] = len(across)
    dup["paths"]["near"] = [recs[k]["path"] for p in pairs for k in p]
    dup["paths"]["near_across"] = [recs[k]["path"] for p in across for k in p]
    dup["paths"]["near_pairs"] = [[recs[a]["path"], recs[b]["path"], round(float(np.dot(sig[a], sig[b])), 5)]
                                  for a, b in pairs]


def content_findings(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One finding per unusual grouping fact of :func:`group_records`'s summary (none when all is plain)."""
    out = []
    ids, dup = summary.get("patient_ids") or {}, summary.get("duplicates") or {}
    paths = dup.get("paths", {})
    if dup.get("exact_groups"):
        out.append(_finding("exact duplicates", dup["exact_groups"], "group(s)", paths.get("exact", []),
                            f" of {dup['exact_images']} images, each group kept as one patient"))
    if dup.get("contradictory_groups"):
        out.append(_finding("contradictory labels", dup["contradictory_groups"], "group(s)",
                            paths.get("contradictory", []),
                            f" of identical images under different classes ({dup['contradictory_images']} images; "
                            "a scan skips them)"))
    if dup.get("across_splits"):
        out.append(_finding("duplicates across splits", dup["across_splits"], "group(s)", paths.get("across", []),
                            " in more than one split (train / val / test): test results would be optimistic"))
    if dup.get("near_pairs"):
        how = "grouped as one patient" if dup.get("near_grouped") else "reported only (--near-duplicates groups them)"
        out.append(_finding("near duplicates", dup["near_pairs"], "pair(s)", paths.get("near", []),
                            f" with similarity >= {dup['near_threshold']}, {how}; "
                            f"{dup.get('near_contradictory_pairs', 0)} under different classes"))
    if dup.get("near_across_splits"):
        out.append(_finding("near duplicates across splits", dup["near_across_splits"], "pair(s)",
                            paths.get("near_across", []), " in more than one split (train / val / test): the same "
                            "radiograph re-exported, test results would be optimistic"))
    folders = summary.get("patient_folders") or {}
    if folders.get("folders"):
        out.append(_finding("patient folders", folders["folders"], "folder(s)", folders.get("paths", []),
                            f" of one counter series (IM-0001-000N, as Horos / OsiriX export them) on "
                            f"{folders['images']} images: each folder is one patient"))
    if ids.get("untrusted_ids"):
        reasons = "; ".join(f"{r}: {n}" for r, n in sorted(ids["reasons"].items()))
        out.append(_finding("untrusted patient id", ids["untrusted_ids"], "id(s)", ids.get("paths", []),
                            f" ({reasons}) on {ids['images']} images, not used for grouping: {ids['by_study']} "
                            f"grouped by study, {ids['by_accession']} by accession, {ids['per_image']} one group "
                            "per image"))
    return out


def note_findings(notes: list[dict[str, str]]) -> list[dict[str, Any]]:
    """One finding per note kind (grey-scale rules, VOI fallbacks, decoder warnings, name normalisation)."""
    by: dict[str, list[str]] = defaultdict(list)
    for n in notes:
        by[n.get("kind") or "note"].append(n["path"])
    return [_finding(kind, len(paths), "image(s)" if kind != "name normalisation" else "manifest row(s)", paths)
            for kind, paths in sorted(by.items())]


def skip_findings(skipped: list[dict[str, str]], ignore: tuple[str, ...] = ("junk",)) -> list[dict[str, Any]]:
    """One finding per skip kind (files a scan did not use), ``junk`` left out."""
    by: dict[str, list[str]] = defaultdict(list)
    for s in skipped:
        if s.get("kind") not in ignore:
            by[s.get("kind") or "unreadable"].append(s["path"])
    return [_finding(f"skipped: {kind}", len(paths), "file(s)", paths) for kind, paths in sorted(by.items())]


def public_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` without paths: the counts that may leave the site."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "paths"} for k, v in summary.items()}


def meta_notes(path: str | os.PathLike, meta: dict[str, Any]) -> list[dict[str, str]]:
    """Report notes for what :func:`chest_xray.read_image` did to a file's pixels beyond the plain pipeline: an
    invalid VOI transform ignored, a grey-scale rule applied, a harmless decoder warning."""
    out = []
    if meta.get("voi_fallback"):
        out.append({"path": str(path), "note": "VOI window ignored, modality-LUT output scaled to its own range: "
                    f"{meta['voi_fallback']}", "kind": "voi fallback"})
    if meta.get("decoder_warnings"):
        out.append({"path": str(path), "note": "decoded, with a decoder warning about harmless extra bytes: "
                    f"{meta['decoder_warnings']}", "kind": "decoder warning"})
    out += [{"path": str(path), "note": n["note"], "kind": n["kind"]} for n in meta.get("grayscale_notes") or ()]
    return out


def site_findings(rows: list[dict[str, Any]], metas: list[dict[str, Any] | None],
                  scan_report: dict[str, Any] | None = None, salt: str | None = None) -> list[dict[str, Any]]:
    """The findings of a site's manifest, as a scan states them (``site check``'s one line each).

    Args:
        rows: manifest rows (``path``, ``label``, ``split``, ``patient_id``).
        metas: per row, the :func:`chest_xray.read_image` metadata (None for an unreadable file); a
            ``"signature"`` key (:func:`near_duplicate_signature`) adds near duplicates.
        scan_report: the scan report of the partition the manifest came from, if at hand: its findings about
            files the manifest no longer lists (skipped at the scan) are added, marked "at scan".
        salt: site salt for the DICOM ids the trust rule judges.
    """
    from .io import ImageReadError, PatientSaltError, dicom_grouping_ids, is_placeholder_id

    recs, info, notes = [], [], []
    for r, m in zip(rows, metas):
        if m is None:
            continue
        i = {"sha256": file_sha256(r["path"]), "signature": m.get("signature"), "split": r["split"],
             "judged": True, "placeholder": is_placeholder_id(str(r.get("patient_id") or "x"))}
        pid = str(r.get("patient_id") or "") or None
        if m.get("format") == "DICOM":
            try:
                ids = dicom_grouping_ids(r["path"], salt)
                pid, i = ids.get("patient") or pid, {**i, **ids}
            except (ImageReadError, PatientSaltError):  # no usable salt or header: the manifest's id is judged
                pass
        recs.append({"path": r["path"], "label": int(r["label"]), "patient_id": pid or r["path"]})
        info.append(i)
        notes += meta_notes(r["path"], m)
    _, _, summary = group_records(recs, info)
    out = content_findings(summary) + note_findings(notes)
    for f in (scan_report or {}).get("findings", []):
        if f.get("kind", "").startswith("skipped: ") or f.get("kind") == "contradictory labels":
            out.append({**f, "text": "at scan: " + f["text"]})
    return out
