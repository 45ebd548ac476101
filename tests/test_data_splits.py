"""The committed probe / tuning / evaluation parts of chest_xray_224 (chest_xray/splits.py)."""
from __future__ import annotations

import csv

import pytest

from chest_xray import splits


def _pids(part):
    return {r["patient_id"] for r in splits.split_rows(part)}


def test_parts_are_patient_disjoint_and_stratified():
    rows = {p: splits.split_rows(p) for p in splits.PARTS}
    assert len(rows["probe"]) == splits.PROBE_SIZE
    for a in splits.PARTS:
        for b in splits.PARTS:
            if a < b:
                assert not (_pids(a) & _pids(b)), f"{a} and {b} share patients"
                names_a = {r["path"] for r in rows[a]}
                assert not names_a & {r["path"] for r in rows[b]}
    # every part holds every subtype, in proportions within 5 points of the pool's
    total = sum(len(v) for v in rows.values())
    for sub in ("NORMAL", "BACTERIA", "VIRUS"):
        pool_frac = sum(r["subtype"] == sub for v in rows.values() for r in v) / total
        for p, v in rows.items():
            assert abs(sum(r["subtype"] == sub for r in v) / len(v) - pool_frac) < 0.05, (p, sub)


def test_parts_cover_the_shared_pool_exactly(data_root):
    root = data_root / "chest_xray_224"
    if not (root / "MANIFEST.csv").is_file():
        pytest.skip(f"{root} missing")
    with open(root / "MANIFEST.csv", newline="") as f:
        manifest = {r["relative_path"] for r in csv.DictReader(f)}
    committed = [r["path"] for p in splits.PARTS for r in splits.split_rows(p)]
    assert sorted(committed) == sorted(manifest)
    files = splits.split_files("probe", root)
    assert all(f.is_file() for f in files)
    # the maker reproduces the committed lists (same seed, same manifest)
    remade = splits.make_splits(root / "MANIFEST.csv")
    for p in splits.PARTS:
        assert [r["path"] for r in remade[p]] == [r["path"] for r in splits.split_rows(p)]
    assert splits.part_of(files[0]) == "probe"


def test_unknown_part_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown split part"):
        splits.split_csv("test")
