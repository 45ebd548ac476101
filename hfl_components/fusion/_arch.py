"""Architecture tables of fusable specs (internal helpers shared by the fusion modules).

A *layer table* lists the weight layers of a fusable spec (``hfl_components.models.fusable``) in forward order,
exactly as :meth:`FusableNet.layers` does, but without building the model: every entry is a :class:`LayerRow`.
The hidden layers are all rows except the last (the class layer). A *segment* is a maximal run of hidden layers
with the same ``(kind, stage)`` key: one segment per conv stage, then one fc segment (absent when ``hidden`` is
empty). OHFL's layer alignment (Sec. 3.1) only matches layers within the same segment.
"""
from __future__ import annotations

from dataclasses import dataclass

from hfl_components.models.fusable import resolve_fusable_spec
from hfl_components.models.registry import is_fusable


@dataclass(frozen=True)
class LayerRow:
    """One weight layer of a fusable spec.

    Attributes:
        name: state-dict prefix (``convs.<i>``, ``fcs.<j>``, ``classifier``).
        kind: ``"conv"`` or ``"fc"``.
        stage: conv stage (0-based) or -1 for fc layers.
        n_in: input channels (conv) / input features (fc).
        n_out: output channels / units.
        is_output: True for the class layer.
    """

    name: str
    kind: str
    stage: int
    n_in: int
    n_out: int
    is_output: bool = False


def resolve(spec: dict) -> dict:
    """``resolve_fusable_spec`` with a clear error for non-fusable specs."""
    if not isinstance(spec, dict) or not is_fusable(spec):
        fam = spec.get("family") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"spec is not an OHFL-fusable family (cnn / vgg11): family={fam!r}")
    return resolve_fusable_spec(spec)


def layer_table(spec: dict) -> list[LayerRow]:
    """Weight layers of a fusable spec in forward order (hidden layers, then the class layer)."""
    r = resolve(spec)
    rows: list[LayerRow] = []
    c_in = r["in_channels"]
    i = 0
    for s, stage in enumerate(r["stages"]):
        for c in stage:
            rows.append(LayerRow(f"convs.{i}", "conv", s, c_in, c))
            c_in = c
            i += 1
    f_in = c_in * r["pool"] * r["pool"]
    for j, h in enumerate(r["hidden"]):
        rows.append(LayerRow(f"fcs.{j}", "fc", -1, f_in, h))
        f_in = h
    rows.append(LayerRow("classifier", "fc", -1, f_in, r["num_classes"], is_output=True))
    return rows


def hidden_rows(spec: dict) -> list[LayerRow]:
    """The hidden layers (all weight layers except the class layer)."""
    return layer_table(spec)[:-1]


def segment_signature(kinds, stages) -> tuple:
    """Tuple of ``((kind, stage), count)`` runs over a sequence of hidden-layer kinds/stages."""
    sig: list[list] = []
    for k, s in zip(kinds, stages):
        key = (k, int(s))
        if sig and sig[-1][0] == key:
            sig[-1][1] += 1
        else:
            sig.append([key, 1])
    return tuple((key, n) for key, n in sig)


def spec_signature(spec: dict) -> tuple:
    """Segment signature of a spec's hidden layers (its depth layout, independent of width)."""
    rows = hidden_rows(spec)
    return segment_signature([r.kind for r in rows], [r.stage for r in rows])


def check_compatible(spec_a: dict, spec_b: dict) -> None:
    """Raise ValueError unless two fusable specs share input channels, classes, pool size and stage count."""
    ra, rb = resolve(spec_a), resolve(spec_b)
    for key in ("in_channels", "num_classes", "pool"):
        if ra[key] != rb[key]:
            raise ValueError(f"models cannot be fused: {key} differs ({ra[key]} vs {rb[key]})")
    if len(ra["stages"]) != len(rb["stages"]):
        raise ValueError(f"models cannot be fused: {len(ra['stages'])} vs {len(rb['stages'])} conv stages "
                         "(layers only match within the same stage)")
