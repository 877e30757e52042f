"""kfac-jax's ``curvature_blocks`` module: curvax's blocks under kfac-jax names.

Compatibility-only namespace; the implementations live in ``curvax.blocks`` and
``curvax.layers``.
"""

from curvax.blocks import (  # noqa: F401
    CurvatureBlock,
    DenseDiagonal,
    DenseEigenvalueCorrected,
    DenseFull,
    DenseTNT,
    DenseTwoKroneckerFactored,
    DenseTwoKroneckerFactoredReduce,
    Diagonal,
    EigenvalueCorrectedKroneckerFactored,
    Full,
    KroneckerFactored,
    NaiveDiagonal,
    NaiveFull,
    NaiveTNT,
    RepeatedDenseKroneckerFactored,
    ScaledIdentity,
    TwoKroneckerFactored,
    get_default_eigen_decomposition_threshold,
    get_max_parallel_elements,
    set_default_eigen_decomposition_threshold,
    set_max_parallel_elements,
)
from curvax.layers.conv import (  # noqa: F401
    Conv2DDiagonal,
    Conv2DEigenvalueCorrected,
    Conv2DFull,
    Conv2DTNT,
    Conv2DTwoKroneckerFactored,
    ConvDiagonal,
    ConvEigenvalueCorrected,
    ConvFull,
    ConvTNT,
    ConvTwoKroneckerFactored,
)
from curvax.layers.scale_and_shift import ScaleAndShiftDiagonal, ScaleAndShiftFull  # noqa: F401
