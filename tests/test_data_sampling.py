"""One class-stratified subset helper (chest_xray.sampling) used by site caps, evaluate and compare."""
from __future__ import annotations

from collections import Counter

from chest_xray.sampling import stratified_subset


def _rows():
    # grouped by class, as manifests are written: 6 NORMAL then 2 PNEUMONIA
    return [{"path": f"n{i}.png", "label": 0} for i in range(6)] + [{"path": f"p{i}.png", "label": 1} for i in range(2)]


def test_shares_by_hand_and_original_order():
    """Keys (k + 0.5) / n_c: class 0 -> 1/12, 3/12, 5/12, ...; class 1 -> 3/12, 9/12. The 4 smallest are
    1/12 (c0), 3/12 (c0), 3/12 (c1), 5/12 (c0): 3 NORMAL + 1 PNEUMONIA, whatever the seed."""
    rows = _rows()
    for seed in range(5):
        sub = stratified_subset(rows, 4, seed)
        assert Counter(r["label"] for r in sub) == {0: 3, 1: 1}
        pos = [rows.index(r) for r in sub]
        assert pos == sorted(pos)  # a sub-sequence, in the manifest's order
    assert stratified_subset(rows, 4, 0) == stratified_subset(rows, 4, 0)
    assert len({tuple(r["path"] for r in stratified_subset(rows, 4, s)) for s in range(10)}) > 1  # seeded choice


def test_rare_class_kept_from_half_a_share_and_no_cap_returns_all():
    rows = _rows()
    # n = 3: PNEUMONIA's share is 3 * 2 / 8 = 0.75 rows -> kept (keys 1/12, 3/12 of NORMAL and 3/12 of PNEUMONIA)
    assert Counter(r["label"] for r in stratified_subset(rows, 3, 3)) == {0: 2, 1: 1}
    for n in (None, 0, 8, 100):
        out = stratified_subset(rows, n, 0)
        assert out == rows and out is not rows


def test_old_import_paths_are_the_same_helpers():
    from hfl_components.flare.site_tasks import _stratified_cap

    rows = _rows()
    assert _stratified_cap(rows, 4, 1) == stratified_subset(rows, 4, 1)
