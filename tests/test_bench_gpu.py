"""benchmarks/bench_gpu.py on the CPU: the no-CUDA run (checks skipped, the CPU timed, the JSON written), its
comparisons on hand cases, and every check run with the CPU standing in for the GPU (same device, same seeds: the
float32 paths agree exactly, bfloat16 autocast within its tolerance)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import bench_gpu


def test_comparisons_on_hand_cases():
    assert bench_gpu.max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert bench_gpu.max_rel_diff([1.0, 2.002], [1.0, 2.0], atol=0.0) == pytest.approx(0.001)
    assert bench_gpu.max_rel_diff([0.0], [0.0], atol=0.0) == 0.0  # 0 / 0 counts as equal
    assert bench_gpu.close([1.0, 2.0009], [1.0, 2.0])  # 9e-4 <= 1e-4 + 1e-3 * 2
    assert not bench_gpu.close([1.0, 2.003], [1.0, 2.0])
    assert not bench_gpu.close([1.0, 2.0], [1.0, 2.0, 3.0])  # shapes differ
    a = {"w": torch.ones(3), "n": torch.tensor(5)}
    ok, worst = bench_gpu.state_close(a, {"w": torch.ones(3), "n": torch.tensor(7)})
    assert ok and worst == 0.0  # integer buffers (BatchNorm counters) are not compared
    ok, worst = bench_gpu.state_close(a, {"w": torch.tensor([1.0, 1.0, 1.01]), "n": torch.tensor(5)})
    assert not ok and worst == pytest.approx(0.01 / (1 + 1e-4), rel=1e-6)
    assert not bench_gpu.state_close(a, {"w": torch.ones(3)})[0]  # a missing key


def test_without_cuda_the_checks_are_skipped_and_the_cpu_is_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_gpu, "cuda_device", lambda: None)  # also on a machine with a GPU
    out = tmp_path / "r" / "gpu.json"
    before = torch.get_num_threads()
    try:
        assert bench_gpu.main(["--quick", "--threads", "1", "--steps", "2", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    res = json.loads(out.read_text())
    assert res["environment"]["cuda"] is False and res["environment"]["device"] == "cpu (no CUDA)"
    assert res["settings"]["out"] == "gpu.json" and str(tmp_path) not in out.read_text()  # no machine path
    assert res["all_checks_ok"] is None
    assert [c["name"] for c in res["checks"]] == ["train_local", "amp", "fusion", "batch_augment", "distillation",
                                                  "dp", "site_runtime"]
    assert all(c["ok"] is None and c["skipped"].startswith("no CUDA") for c in res["checks"])
    (row,) = res["timings"]["training"]
    assert row["cpu_s_per_step"] > 0 and row["gpu_s_per_step"] is None and row["cpu_over_gpu"] is None
    server = res["timings"]["server"]
    assert server["fusion_cpu_s"] > 0 and server["distillation_cpu_s"] > 0 and server["fusion_cpu_over_gpu"] is None
    for r in res["timings"]["dp"]:  # empty where Opacus is missing
        assert r["cpu_s_per_step"] > 0 and r["cpu_over_gpu"] is None


@pytest.mark.slow
def test_every_check_passes_with_the_cpu_standing_in_for_the_gpu():
    before = torch.get_num_threads()
    try:
        checks = {c["name"]: c for c in bench_gpu.run_checks("cpu", 1, quick=True)}
    finally:
        torch.set_num_threads(before)
    assert {n: c["ok"] for n, c in checks.items() if c["ok"] is not True} == (
        {} if bench_gpu.opacus_missing() is None else {"dp": None})
    # same device, same seeds: float32 results agree exactly
    assert checks["train_local"]["default"]["loss_max_rel_diff"] == 0.0
    assert checks["train_local"]["default"]["weights_max_rel_diff"] == 0.0
    assert "tf32_off" not in checks["train_local"]  # a GPU-only variant
    fused = checks["fusion"]["two_cnn_width_0.5"]
    assert list(fused) == ["default"]  # tf32_off is a GPU-only variant
    assert fused["default"]["weights_max_rel_diff"] == 0.0 and fused["default"]["outputs_max_rel_diff"] == 0.0
    assert fused["default"]["same_layer_maps"] and fused["default"]["first_difference"] is None
    assert checks["batch_augment"]["max_abs_diff"] == 0.0
    dist = checks["distillation"]["default"]
    assert dist["max_rel_diff"] == 0.0 and len(dist["val_losses"]) >= 2
    for aug in ("monai", "batch"):
        site = checks["site_runtime"][f"augment_{aug}"]
        assert site["device"]["losses"] == site["cpu"]["losses"] and site["device"]["saved_on_cpu"]
        assert site["device"]["test_n"] == 8  # 4 synthetic test images per class
    # autocast on the CPU is bfloat16: a rounding difference, within the 5 % tolerance
    amp = checks["amp"]
    assert amp["autocast_dtype"] == "bfloat16" and 0 < amp["loss_max_rel_diff"] < bench_gpu.AMP_RTOL
    assert np.all(np.isfinite(checks["site_runtime"]["amp"]["losses"]))
    if bench_gpu.opacus_missing() is None:
        assert checks["dp"]["steps"][0] == checks["dp"]["steps"][1] > 0
        assert checks["site_runtime"]["dp"]["dp"]["dp"] is True


@pytest.mark.parametrize("flag", ["--steps", "--batch", "--distill-steps", "--threads"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_count_below_one_is_refused_before_any_work(flag, value, capsys, monkeypatch):
    """--steps 0 divided by zero in the training timing (reported as a failed part, exit 0), --batch -1 failed
    inside torch, --threads 0 was silently ignored: each is refused by argparse (exit 2, one line naming it)."""
    monkeypatch.setattr(bench_gpu, "environment", lambda *a: pytest.fail("ran with a bad count"))
    with pytest.raises(SystemExit) as e:
        bench_gpu.main([flag, value, "--quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: must be an integer >= 1" in err or f"argument {flag}: expected an integer" in err, err
