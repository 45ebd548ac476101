"""Model registry: fusable and heterogeneous families build from JSON specs, run at several sizes, and count params."""
import json

import pytest
import torch

from hfl_components.models import build_model, count_parameters, spec_from_json, spec_to_json
from hfl_components.models.hetero import HETERO_DEFAULTS, HeteroNet, hetero_pool_specs, resolve_hetero_spec

torch.set_num_threads(1)

FUSABLE_SPECS = [{"family": "cnn", "depth": d, "width": 1.0, "in_channels": 1, "num_classes": 2}
                 for d in ("shallow", "medium", "deep")]
HETERO_SPECS = hetero_pool_specs(num_classes=3, in_channels=1, feature_dim=64)
ALL_SPECS = FUSABLE_SPECS + HETERO_SPECS


def _id(spec):
    return f"{spec['family']}-{spec.get('depth', 'default')}"


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {_id(s): build_model(s) for s in ALL_SPECS}


@pytest.mark.parametrize("spec", ALL_SPECS, ids=_id)
@pytest.mark.parametrize("size", [64, 96, 128, 224])
def test_forward_shapes_at_input_sizes(models, spec, size):
    model = models[_id(spec)].eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, size, size))
    assert out.shape == (2, spec["num_classes"])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("spec", ALL_SPECS, ids=_id)
def test_features_and_head_shapes(models, spec):
    model = models[_id(spec)].eval()
    with torch.no_grad():
        z = model.features(torch.randn(3, 1, 64, 64))
        logits = model.head(z)
    assert z.dim() == 2 and z.shape[0] == 3
    assert logits.shape == (3, spec["num_classes"])
    if spec in HETERO_SPECS:
        assert z.shape[1] == 64 == model.feature_dim
        assert (z >= 0).all()  # default feature_act="relu"


@pytest.mark.parametrize("spec", ALL_SPECS, ids=_id)
def test_spec_json_round_trip_rebuilds_same_state(models, spec):
    again = spec_from_json(spec_to_json(spec))
    assert again == json.loads(json.dumps(spec))
    model = models[_id(spec)]
    rebuilt = build_model(again)
    rebuilt.load_state_dict(model.state_dict())  # same architecture: keys and shapes match
    x = torch.randn(2, 1, 64, 64)
    model.eval(), rebuilt.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), rebuilt(x))


def test_resolved_spec_is_json_and_builds_same_model():
    for spec in HETERO_SPECS:
        full = resolve_hetero_spec(spec)
        assert json.loads(json.dumps(full)) == full
        a, b = build_model(spec), build_model(full)
        assert [(k, v.shape) for k, v in a.state_dict().items()] == [(k, v.shape) for k, v in b.state_dict().items()]


def test_parameter_counts_reported(models, capsys):
    counts = {name: count_parameters(m) for name, m in models.items()}
    with capsys.disabled():
        print("\nparameter counts: " + ", ".join(f"{k}={v:,}" for k, v in counts.items()))
    assert all(c > 0 for c in counts.values())
    assert len({type(m.backbone[0] if isinstance(m.backbone, torch.nn.Sequential) else m.backbone).__name__
                for m in models.values() if isinstance(m, HeteroNet)}) >= 4  # four distinct backbones
    assert all(c < 2_000_000 for c in counts.values())  # sized for 2 CPU cores


def test_every_hetero_family_and_common_feature_dim():
    assert set(HETERO_DEFAULTS) >= {"hetero_cnn", "densenet", "resnet", "efficientnet"}
    for fam in HETERO_DEFAULTS:
        m = build_model({"family": fam, "num_classes": 2, "feature_dim": 32, "feature_act": "none"})
        z = m.features(torch.randn(2, 1, 64, 64))
        assert z.shape == (2, 32)
        assert sorted({k.split(".")[0] for k in m.state_dict()}) == ["backbone", "classifier", "proj"]


def test_hetero_cnn_wraps_each_cnn_depth_to_the_same_dim():
    dims = set()
    for depth in ("shallow", "medium", "deep"):
        m = build_model({"family": "hetero_cnn", "depth": depth, "num_classes": 2, "feature_dim": 48})
        assert any(k.startswith("backbone.convs.") for k in m.state_dict())
        assert any(k.startswith("backbone.fcs.") for k in m.state_dict())
        dims.add(m.features(torch.randn(1, 1, 64, 64)).shape[1])
    assert dims == {48}


def test_fusable_layout_unchanged():
    m = build_model(FUSABLE_SPECS[1])
    prefixes = {k.split(".")[0] for k in m.state_dict()}
    assert prefixes == {"convs", "fcs", "classifier"}
    assert m.features(torch.randn(1, 1, 64, 64)).shape == (1, 500)


@pytest.mark.parametrize("bad", [
    {"family": "nope"},
    {"family": "densenet", "depth": "deep"},  # key of another family
    {"family": "resnet", "feature_dim": 0},
    {"family": "efficientnet", "num_classes": 1},
    {"family": "densenet", "feature_act": "tanh"},
    {"family": "resnet", "layers": [1, 1]},
    {"family": "hetero_cnn", "depth": "huge"},
    {"family": "hetero_cnn", "base_family": "densenet"},
])
def test_bad_specs_raise_value_error(bad):
    with pytest.raises(ValueError):
        build_model(bad)


def test_unknown_family_message_lists_known():
    with pytest.raises(ValueError, match="unknown model family 'nope'.*densenet"):
        build_model({"family": "nope"})


def test_family_table_is_one_owner_without_import_cycle():
    """Every family has one (build, resolve) entry, resolve_spec fills the family defaults, and the family modules
    import nothing from the registry (the old registry <-> hetero cycle)."""
    import ast
    import pathlib

    from hfl_components.models import FAMILY_TABLE, resolve_spec
    from hfl_components.models.fusable import FAMILIES, build_fusable, resolve_fusable_spec
    from hfl_components.models.hetero import build_hetero

    assert set(FAMILY_TABLE) == set(FAMILIES) | set(HETERO_DEFAULTS)
    assert FAMILY_TABLE["cnn"] == (build_fusable, resolve_fusable_spec)
    assert FAMILY_TABLE["densenet"] == (build_hetero, resolve_hetero_spec)
    assert resolve_spec({"family": "densenet"})["growth_rate"] == HETERO_DEFAULTS["densenet"]["growth_rate"]
    assert resolve_spec({"family": "cnn", "depth": "shallow"}) == resolve_fusable_spec({"family": "cnn",
                                                                                         "depth": "shallow"})
    pkg = pathlib.Path(__file__).resolve().parents[1] / "hfl_components" / "models"
    for name in ("fusable.py", "hetero.py"):
        tree = ast.parse((pkg / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "hfl_components.models.registry" not in imported, name
