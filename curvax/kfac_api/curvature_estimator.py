"""kfac-jax's ``curvature_estimator`` module: curvax's estimators under kfac-jax names.

Compatibility-only namespace; the implementations live in ``curvax.estimators``
and ``curvax.blocks``.
"""

from curvax.blocks import (  # noqa: F401
    get_default_tag_to_block_ctor,
    set_default_tag_to_block_ctor,
    set_multi_default_tag_to_block_ctor,
)
from curvax.preconditioner import OptaxPreconditioner, OptaxPreconditionState  # noqa: F401
from curvax.estimators import (  # noqa: F401
    BlockDiagonalCurvature,
    CurvatureEstimator,
    ExplicitExactCurvature,
    ImplicitExactCurvature,
    StateType,
)
