"""Bad input to the OHFL options ``fusion_order`` and ``distill_feature_weight``: refused in one line naming the
options by the run check that ``simulate``, ``export-job`` and ``compare`` share, before anything is scanned or
trained (not inside a running job, not silently accepted)."""
import pytest


@pytest.mark.parametrize("strategy", ["cia", "rand"])
def test_group_fusion_order_with_a_strategy_without_depth_groups_is_refused_before_any_run(strategy):
    from nvflare_jobs.compare import check_variant
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    with pytest.raises(SimulateError) as e:
        resolve("ohfl", {"fusion_order": "group", "strategy": strategy})
    msg = str(e.value)
    assert "fusion_order" in msg and repr(strategy) in msg and "\n" not in msg
    # compare checks every variant before its first run: refused there, not after the other methods trained
    why = check_variant(f"ohfl:fusion_order=group:strategy={strategy}")
    assert why is not None and "fusion_order" in why and "\n" not in why
    for ok in ("cid", "cdd"):
        assert resolve("ohfl", {"fusion_order": "group", "strategy": ok}).options["fusion_order"] == "group"


def test_the_paper_preset_refuses_group_fusion():
    from nvflare_jobs.compare import check_variant
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    with pytest.raises(SimulateError, match="'paper'.*'fusion_order'"):
        resolve("ohfl", {"paper": True, "fusion_order": "group"})
    assert resolve("ohfl", {"paper": True}).options["fusion_order"] == "pairwise"
    assert resolve("ohfl", {"paper": True, "fusion_order": "pairwise"}).options["fusion_order"] == "pairwise"
    assert check_variant("ohfl:paper:fusion_order=group") is not None


@pytest.mark.parametrize("given", [{"distill_steps": 0, "distill_feature_weight": 3000},
                                   {"paper": True, "distill_feature_weight": 3000}])
def test_a_feature_weight_without_distillation_is_refused_not_ignored(given):
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    with pytest.raises(SimulateError) as e:
        resolve("ohfl", given)
    msg = str(e.value)
    assert "'distill_feature_weight'" in msg and "'distill_steps'" in msg and "\n" not in msg
    # weight 0 (the default) with no distillation, and a weight with distillation, still pass
    resolve("ohfl", {**given, "distill_feature_weight": 0})
    assert resolve("ohfl", {"distill_feature_weight": 3000}).options["distill_feature_weight"] == 3000.0


def test_the_controller_refuses_a_feature_weight_without_distillation():
    from tests.fusion_helpers import ohfl_controller

    with pytest.raises(ValueError, match="'distill_feature_weight'.*'distill_steps'"):
        ohfl_controller(distill_steps=0, distill_feature_weight=1.0, probe="generated").check_options()
    ohfl_controller(distill_steps=0, distill_feature_weight=0.0, probe="generated").check_options()
