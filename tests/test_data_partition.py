"""partition_records / write_partition / the partition and inspect CLI."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from chest_xray import (
    CLASS_NAMES,
    load_partition,
    partition_records,
    read_site_manifest,
    scan_dataset,
    write_partition,
)


def synthetic_records(n_patients=300, seed=0, n_classes=2):
    """Patients with 1-3 images each, one label per patient, widths 400-3000 px."""
    rng = np.random.default_rng(seed)
    recs = []
    for p in range(n_patients):
        label = int(rng.integers(n_classes)) if p >= n_classes else p
        base = int(rng.integers(400, 3000))
        for j in range(int(rng.integers(1, 4))):
            recs.append({"path": f"/data/c{label}/p{p:04d}_{j}.jpeg", "label": label, "patient_id": f"p{p:04d}",
                         "width": base + int(rng.integers(-50, 50)), "height": int(base * 0.8)})
    return recs


@pytest.fixture(scope="module")
def real_records(data_root):
    root = data_root / "chest_xray_original"
    if not root.is_dir():
        pytest.skip(f"{root} missing")
    return scan_dataset(root, verify=False)[0]


def _all_rows(res):
    return [(site, r) for site, rows in res.sites.items() for r in rows]


def check_invariants(records, res, n_sites):
    """No image in two sites (or lost), a patient in one site and one split."""
    assert list(res.sites) == [f"site-{k}" for k in range(1, n_sites + 1)]
    paths = [r["path"] for _, r in _all_rows(res)] + [r["path"] for r in res.probe]
    assert len(paths) == len(set(paths)) == len(records)
    site_of, split_of = defaultdict(set), defaultdict(set)
    for site, r in _all_rows(res):
        site_of[r["patient_id"]].add(site)
        split_of[r["patient_id"]].add(r["split"])
        assert r["split"] in ("train", "val", "test")
    assert all(len(s) == 1 for s in site_of.values())
    assert all(len(s) == 1 for s in split_of.values())
    assert not {r["patient_id"] for r in res.probe} & set(site_of)


def _median_widths(rows, label):
    by = defaultdict(list)
    for r in rows:
        if r["label"] == label:
            by[r["patient_id"]].append(r["width"])
    return [float(np.median(v)) for v in by.values()]


def test_width_scheme_ordering_and_ratios(real_records):
    n = 6
    res = partition_records(real_records, n, "width", class_names=CLASS_NAMES["binary"])
    check_invariants(real_records, res, n)
    sites = list(res.sites.values())
    for label in (0, 1):
        for a, b in zip(sites, sites[1:]):  # contiguous width groups per class: max(site k) <= min(site k+1)
            assert max(_median_widths(a, label)) <= min(_median_widths(b, label))
    medians = [np.median([r["width"] for r in rows]) for rows in sites]
    assert all(x < y for x, y in zip(medians, medians[1:])), medians
    sizes = [len(rows) for rows in sites]
    assert max(sizes) - min(sizes) <= 6
    ratios = [sum(r["label"] == 1 for r in rows) / len(rows) for rows in sites]
    overall = sum(r["label"] == 1 for r in real_records) / len(real_records)
    assert max(abs(x - overall) for x in ratios) < 0.02, ratios


def test_splits_are_80_10_10_stratified_and_patient_disjoint(real_records):
    res = partition_records(real_records, 6, "width")
    for rows in res.sites.values():
        n = len(rows)
        c = Counter(r["split"] for r in rows)
        assert abs(c["train"] / n - 0.8) < 0.05 and abs(c["val"] / n - 0.1) < 0.05 and abs(c["test"] / n - 0.1) < 0.05
        for label in (0, 1):
            per = Counter(r["split"] for r in rows if r["label"] == label)
            assert per["val"] > 0 and per["test"] > 0 and per["train"] > per["val"]
        pats = {s: {r["patient_id"] for r in rows if r["split"] == s} for s in ("train", "val", "test")}
        assert not pats["train"] & pats["val"]
        assert not pats["train"] & pats["test"]
        assert not pats["val"] & pats["test"]


def test_same_seed_byte_identical_files(real_records, tmp_path):
    kw = dict(class_names=CLASS_NAMES["binary"], probe_fraction=0.1, seed=3)
    a = write_partition(partition_records(real_records, 4, "dirichlet", alpha=0.5, **kw), tmp_path / "a").parent
    b = write_partition(partition_records(list(reversed(real_records)), 4, "dirichlet", alpha=0.5, **kw),
                        tmp_path / "b").parent
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {"partition.json", "probe.csv", "sites/site-1.csv", "sites/site-4.csv"}
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    c = write_partition(partition_records(real_records, 4, "dirichlet", alpha=0.5,
                                          **{**kw, "seed": 4}), tmp_path / "c").parent
    assert (a / "sites/site-1.csv").read_bytes() != (c / "sites/site-1.csv").read_bytes()


def test_dirichlet_skew_and_minimum():
    recs = synthetic_records(400, n_classes=3)
    strong = partition_records(recs, 5, "dirichlet", alpha=0.1, seed=1, min_per_site=20)
    mild = partition_records(recs, 5, "dirichlet", alpha=100.0, seed=1, min_per_site=20)
    check_invariants(recs, strong, 5)

    def skew(res):  # mean total-variation distance of site label distributions from the global one
        glob = np.bincount([r["label"] for r in recs], minlength=3) / len(recs)
        return np.mean([0.5 * np.abs(np.bincount([r["label"] for r in rows], minlength=3) / len(rows) - glob).sum()
                        for rows in res.sites.values()])

    assert all(len(rows) >= 20 for rows in strong.sites.values())
    assert skew(strong) > skew(mild) + 0.1
    with pytest.raises(ValueError, match="Dirichlet"):
        partition_records(recs, 5, "dirichlet", alpha=0.01, min_per_site=10_000, max_tries=5)


def test_pathological_classes_per_site():
    recs = synthetic_records(300, n_classes=3)
    res = partition_records(recs, 3, "pathological", classes_per_site=2, seed=0)
    check_invariants(recs, res, 3)
    for rows in res.sites.values():
        assert len({r["label"] for r in rows}) == 2
    res1 = partition_records(recs, 3, "pathological", classes_per_site=1, seed=0)
    assert sorted(len({r["label"] for r in rows}) for rows in res1.sites.values()) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot cover"):
        partition_records(recs, 2, "pathological", classes_per_site=1)


def test_probe_pool_is_stratified_and_patient_disjoint():
    recs = synthetic_records(400)
    res = partition_records(recs, 3, "width", probe_fraction=0.2, seed=2)
    check_invariants(recs, res, 3)
    assert abs(len(res.probe) / len(recs) - 0.2) < 0.03
    share = [sum(r["label"] == k for r in res.probe) / sum(r["label"] == k for r in recs) for k in (0, 1)]
    assert all(abs(s - 0.2) < 0.03 for s in share)
    assert {r["split"] for r in res.probe} == {"probe"}


def test_bad_arguments():
    recs = synthetic_records(20)
    for kwargs, msg in [(dict(n_sites=2, scheme="random"), "unknown partition scheme"),
                        (dict(n_sites=0, scheme="width"), "n_sites"),
                        (dict(n_sites=2, scheme="width", probe_fraction=1.0), "probe_fraction"),
                        (dict(n_sites=100, scheme="width"), "cannot fill")]:
        with pytest.raises(ValueError, match=msg):
            partition_records(recs, **kwargs)


def test_write_and_read_back(tmp_path):
    recs = synthetic_records(60)
    res = partition_records(recs, 3, "width", class_names=["NORMAL", "PNEUMONIA"])
    write_partition(res, tmp_path, extra={"labels": "binary"})
    rows = read_site_manifest(tmp_path / "sites" / "site-2.csv")
    assert rows == res.sites["site-2"]
    assert (tmp_path / "sites" / "site-2.csv").read_text().splitlines()[0] == "path,label,split,patient_id,width,height"
    info, sites = load_partition(tmp_path)
    assert list(sites) == ["site-1", "site-2", "site-3"] and info["scheme"] == "width" and info["labels"] == "binary"
    assert info["sites"]["site-1"]["width"]["max"] <= info["sites"]["site-3"]["width"]["max"]
    # rewriting with fewer sites removes stale manifests
    write_partition(partition_records(recs, 2, "width"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "sites").iterdir()) == ["site-1.csv", "site-2.csv"]


def test_cli_partition_and_inspect(data_root, tmp_path, capsys):
    from nvflare_jobs.cli import main

    root = data_root / "chest_xray_original"
    if not root.is_dir():
        pytest.skip(f"{root} missing")
    out = tmp_path / "p6"
    assert main(["partition", "--data", str(root), "--sites", "6", "--scheme", "width", "--no-verify",
                 "--out", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    lines = [ln.split() for ln in text.splitlines() if ln.startswith("site-")]
    assert [ln[0] for ln in lines] == [f"site-{k}" for k in range(1, 7)]
    medians = [float(ln[5]) for ln in lines]  # site NORMAL PNEUMONIA total w_min w_median ...
    assert medians == sorted(medians) and medians[0] < medians[-1]
    png = out / "inspect.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


# ------------------------------------------------------------------ small sites: every split non-empty, warnings
def _copy_small_set(data_root, dest, n_per_class=15):
    """~15 real chest_xray_224 images per class (class-folder layout) copied into ``dest`` (tmp_path only)."""
    import shutil

    src = data_root / "chest_xray_224" / "train"
    if not src.is_dir():
        pytest.skip(f"{src} missing")
    for cls in ("NORMAL", "PNEUMONIA"):
        (dest / cls).mkdir(parents=True)
        for f in sorted((src / cls).glob("*.jpeg"))[:n_per_class]:
            shutil.copy(f, dest / cls / f.name)
    return dest


def test_small_sites_get_val_and_test_patients(data_root, tmp_path, capsys):
    """15 images per class into 3 sites: the midpoint cut alone gave site-1 train/val/test = 8/0/1."""
    from nvflare_jobs.cli import main

    root = _copy_small_set(data_root, tmp_path / "small")
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    assert main(["partition", "--data", str(root), "--sites", "3", "--out", str(out_a)]) == 0
    err = capsys.readouterr().err
    # chest_xray_224 is all 224 px wide: the width scheme is told to be meaningless
    assert "WARNING" in err and "same width" in err and "meaningless" in err
    assert "has no val" not in err and "has no test" not in err
    info, sites = load_partition(out_a)
    assert sum(len(rows) for rows in sites.values()) == 30
    for name, rows in sites.items():
        splits = Counter(r["split"] for r in rows)
        assert splits["val"] >= 1 and splits["test"] >= 1 and splits["train"] >= 1, (name, splits)
        assert splits["train"] > splits["val"] and splits["train"] > splits["test"], (name, splits)
        pats = {s: {r["patient_id"] for r in rows if r["split"] == s} for s in ("train", "val", "test")}
        assert not (pats["train"] & pats["val"] or pats["train"] & pats["test"] or pats["val"] & pats["test"])
    # determinism: the same seed gives byte-identical files
    assert main(["partition", "--data", str(root), "--sites", "3", "--out", str(out_b)]) == 0
    for f in ("partition.json", "sites/site-1.csv", "sites/site-2.csv", "sites/site-3.csv"):
        assert (out_a / f).read_bytes() == (out_b / f).read_bytes(), f


def test_fill_takes_one_train_patient_per_empty_split():
    """5 single-image patients, one class, one site: image midpoints 0.1, 0.3, 0.5, 0.7, 0.9 put 4 in train (< 0.8)
    and the last (0.9, on the val/test edge) in val or test, leaving the other split empty; the fill moves one
    train patient there -> 3/1/1."""
    recs = [{"path": f"/d/p{i}.png", "label": 0, "patient_id": f"p{i}", "width": 500, "height": 500}
            for i in range(5)]
    res = partition_records(recs, 1, "width", seed=0)
    assert Counter(r["split"] for r in res.sites["site-1"]) == {"train": 3, "val": 1, "test": 1}
    # a 10-image patient is never the one moved when single-image train patients exist
    recs += [{"path": f"/d/big{j}.png", "label": 0, "patient_id": "big", "width": 500, "height": 500}
             for j in range(10)]
    for seed in range(5):
        rows = partition_records(recs, 1, "width", seed=seed).sites["site-1"]
        for sp in ("val", "test"):
            assert 1 <= sum(r["split"] == sp for r in rows) <= 2, (seed, sp)


def test_warnings_name_site_and_empty_split():
    from chest_xray.partition import partition_warnings

    def row(p, split, w=500):
        return {"path": f"/d/{p}.png", "label": 0, "split": split, "patient_id": p, "width": w, "height": w}

    sites = {"site-1": [row("a", "train"), row("b", "val"), row("c", "test")],
             "site-2": [row("d", "train"), row("e", "test")]}
    w = partition_warnings(sites, "dirichlet")
    assert len(w) == 2 and all(x.startswith("WARNING") for x in w)
    assert "site-2" in w[0] and "2 patient" in w[0]
    assert "site-2" in w[1] and "no val" in w[1]
    assert partition_warnings({"site-1": sites["site-1"]}, "width")[0].count("same width") == 1
    spread = {"site-1": [row("a", "train", 400), row("b", "val", 1500), row("c", "test", 3000)]}
    assert partition_warnings(spread, "width") == []


def test_partition_of_too_few_patients_warns(tmp_path, capsys):
    """2 patients per class into 2 sites: each site has 2 patients -> a warning naming the site and its empty
    split, printed by both partition and inspect."""
    from nvflare_jobs.cli import main
    from PIL import Image

    for cls in ("NORMAL", "PNEUMONIA"):
        (tmp_path / "d" / cls).mkdir(parents=True)
        for i, w in enumerate((300, 900)):
            Image.new("L", (w, 256), 128 if cls == "NORMAL" else 96).save(tmp_path / "d" / cls / f"{cls}{i}.png")
    out = tmp_path / "p"
    assert main(["partition", "--data", str(tmp_path / "d"), "--sites", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    for site in ("site-1", "site-2"):
        assert f"WARNING: {site} has only 2 patient(s)" in err
        assert f"WARNING: {site} has no val images" in err or f"WARNING: {site} has no test images" in err
    assert "same width" not in err
    assert main(["inspect", str(out)]) == 0
    assert "WARNING: site-1 has only 2 patient(s)" in capsys.readouterr().err


def test_inspect_rejects_a_file_and_a_bad_folder(tmp_path, capsys):
    from nvflare_jobs.cli import main

    f = tmp_path / "manifest.csv"
    f.write_text("path,label\n")
    assert main(["inspect", str(f)]) == 2
    assert "not a partition folder" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "partition.json").write_text("[1, 2]")
    assert main(["inspect", str(tmp_path / "bad")]) == 2
    (tmp_path / "bad" / "partition.json").write_text("{not json")
    assert main(["inspect", str(tmp_path / "bad")]) == 2
    assert main(["partition", "--data", str(f), "--sites", "2", "--out", str(f)]) == 2


def test_min_eval_per_class_gives_each_class_two_val_and_test_images_where_the_site_has_enough():
    """One site, single-image patients: class 0 has 40 images, class 1 exactly 8 (= 4 m), class 2 has 7 (< 4 m).
    The 80/10/10 cut gives class 1 6/1/1 (midpoints 1/16 .. 15/16 against the 0.8 / 0.9 edges); with m = 2 one
    train patient moves to val and one to test -> 4/2/2, train keeping exactly half. Class 2 (too few) and class 0
    (already 32/4/4) keep the plain cut; patients stay whole."""
    recs = []
    for k, n in ((0, 40), (1, 8), (2, 7)):
        recs += [{"path": f"/x/c{k}_p{i:02d}.png", "label": k, "patient_id": f"c{k}p{i:02d}", "width": 100,
                  "height": 100} for i in range(n)]
    plain = partition_records(recs, 1, "dirichlet", seed=0, min_per_site=1)
    res = partition_records(recs, 1, "dirichlet", seed=0, min_per_site=1, min_eval_per_class=2)
    a, b = Counter((r["label"], r["split"]) for r in plain.sites["site-1"]), \
        Counter((r["label"], r["split"]) for r in res.sites["site-1"])
    assert [a[(1, s)] for s in ("train", "val", "test")] == [6, 1, 1]
    assert [b[(1, s)] for s in ("train", "val", "test")] == [4, 2, 2]
    for k in (0, 2):
        assert [b[(k, s)] for s in ("train", "val", "test")] == [a[(k, s)] for s in ("train", "val", "test")]
    assert [a[(0, s)] for s in ("train", "val", "test")] == [32, 4, 4]
    moves = res.params["eval_moves"]["site-1"]
    assert [(m["class"], m["split"]) for m in moves] == [(1, "val"), (1, "test")]
    assert res.params["min_eval_per_class"] == 2 and "eval_moves" not in plain.params
    # the moved patients were train patients of the plain cut; every other patient keeps its split
    split_a = {r["patient_id"]: r["split"] for r in plain.sites["site-1"]}
    split_b = {r["patient_id"]: r["split"] for r in res.sites["site-1"]}
    changed = {p for p in split_a if split_a[p] != split_b[p]}
    assert changed == {m["patient"] for m in moves} and all(split_a[p] == "train" for p in changed)
    with pytest.raises(ValueError, match="min_eval_per_class"):
        partition_records(recs, 1, "dirichlet", seed=0, min_per_site=1, min_eval_per_class=-1)


def test_min_eval_per_class_moves_whole_patients_and_keeps_half_of_the_class_in_train():
    """Class 1: one 3-image patient and five 1-image patients (8 images); m = 2. The single-image patients move
    first (fewest images); a move that would leave train under 4 images of class 1 is not made."""
    recs = [{"path": f"/x/c0_{i:02d}.png", "label": 0, "patient_id": f"a{i:02d}", "width": 1, "height": 1}
            for i in range(40)]
    recs += [{"path": f"/x/c1_big_{j}.png", "label": 1, "patient_id": "big", "width": 1, "height": 1}
             for j in range(3)]
    recs += [{"path": f"/x/c1_{i}.png", "label": 1, "patient_id": f"b{i}", "width": 1, "height": 1}
             for i in range(5)]
    res = partition_records(recs, 1, "dirichlet", seed=0, min_per_site=1, min_eval_per_class=2)
    rows = res.sites["site-1"]
    by_patient = defaultdict(set)
    for r in rows:
        by_patient[r["patient_id"]].add(r["split"])
    assert all(len(s) == 1 for s in by_patient.values())
    # plain cut: b2 -> val, b4 -> test, the rest train; m = 2 moves b0 (1 image, first id) to val and b1 to test;
    # train keeps big (3) + b3 (1) = 4 = half of class 1, so no further move would be allowed
    assert {p: next(iter(s)) for p, s in by_patient.items() if not p.startswith("a")} == {
        "b0": "val", "b1": "test", "b2": "val", "b3": "train", "b4": "test", "big": "train"}
    assert [(m["patient"], m["split"], m["images"]) for m in res.params["eval_moves"]["site-1"]] == [
        ("b0", "val", 1), ("b1", "test", 1)]


def test_cli_partition_min_eval_per_class(data_root, tmp_path, capsys):
    """`cxr-hfl partition --min-eval-per-class 2`: every class a site holds >= 8 images of has >= 2 images in val and
    in test (the plain cut of the same seed misses this somewhere), recorded in partition.json; bad values exit 2."""
    import json
    from collections import Counter

    from chest_xray import read_site_manifest
    from nvflare_jobs.cli import main

    root = data_root / "chest_xray_original"
    if not root.is_dir():
        pytest.skip(f"{root} missing")

    def counts(out):
        per = {}
        for f in sorted((out / "sites").glob("*.csv")):
            per[f.stem] = Counter((r["split"], int(r["label"])) for r in read_site_manifest(f))
        return per

    def short(per):  # (site, class) cells with >= 8 images but < 2 in val or in test
        return [(s, c) for s, cnt in per.items() for c in {k[1] for k in cnt}
                if sum(v for (sp, cc), v in cnt.items() if cc == c) >= 8 and min(cnt[("val", c)], cnt[("test", c)]) < 2]

    args = ["partition", "--data", str(root), "--sites", "6", "--scheme", "dirichlet", "--alpha", "0.5",
            "--labels", "subtype", "--seed", "1", "--no-verify"]
    assert main(args + ["--out", str(tmp_path / "plain")]) == 0
    assert main(args + ["--min-eval-per-class", "2", "--out", str(tmp_path / "m2")]) == 0
    plain, m2 = counts(tmp_path / "plain"), counts(tmp_path / "m2")
    assert short(plain), "the plain cut of this seed should leave some class short of 2 val/test images"
    assert short(m2) == []
    assert sum(sum(c.values()) for c in plain.values()) == sum(sum(c.values()) for c in m2.values())  # no image lost
    info = json.loads((tmp_path / "m2" / "partition.json").read_text())
    assert info["params"]["min_eval_per_class"] == 2
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit) as e:
            main(args + ["--min-eval-per-class", bad, "--out", str(tmp_path / "bad")])
        assert e.value.code == 2
        assert "--min-eval-per-class" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
