"""Model registry: every party rebuilds models from a plain JSON-able spec plus a state dict, never from pickles.

``build_model(spec)`` dispatches on ``spec["family"]``. Fusable families (OHFL): ``cnn``, ``vgg11``
(see :mod:`hfl_components.models.fusable`). Heterogeneous backbones for the prototype methods are in
:mod:`hfl_components.models.hetero`; :data:`~hfl_components.models.registry.FAMILY_TABLE` maps every family to its
``(build, resolve)`` pair.
"""
from hfl_components.models.fusable import (  # noqa: F401
    DEPTH_ORDER,
    FAMILIES,
    FusableNet,
    LayerInfo,
    build_fusable,
    explicit_spec,
    resolve_fusable_spec,
)
from hfl_components.models.files import load_model_file, read_model_header, save_model_file  # noqa: F401
from hfl_components.models.registry import (  # noqa: F401
    FAMILY_TABLE,
    build_model,
    count_parameters,
    deepest_spec,
    is_fusable,
    resolve_spec,
    spec_from_json,
    spec_to_json,
    validate_spec,
)
