"""curvax: second-order optimization and curvature approximations in JAX.

The public API mirrors kfac-jax's documented one, so ``import curvax as
kfac_jax`` runs kfac-jax code. Modules, in layers: each imports only modules of
its own line or of the lines before it (``docs/guides/architecture.md``):

* ``_compat``, ``linalg``, ``utils`` -- JAX internals, PSD linear algebra, small helpers;
* ``tags``, ``losses``       -- marking layers and losses in a computation;
* ``tracing``                -- reading a traced function;
* ``detection``, ``transforms``, ``patterns`` -- finding layers, Jacobian products;
* ``blocks``, ``stacked``, ``layers`` -- curvature blocks (Kronecker, diagonal, full ...);
* ``estimators``             -- block-diagonal and exact curvature estimators;
* ``optimizer``, ``parallel``, ``preconditioner``, ``operators``, ``laplace`` -- the
  K-FAC optimizer, K-FAC as an Optax transformation, curvature operators, Laplace;
* ``kfac_api``, ``kfac_ferminet_alpha`` -- kfac-jax's module names (``curvax.tracer``,
  ``curvax.loss_functions`` ...): thin namespaces over the modules above. Only this
  file imports them.
"""

from curvax import laplace, layers, patterns, utils  # importing `layers` registers every layer kind
from curvax import operators  # curvature as operator objects
from curvax.blocks import (
    CurvatureBlock,
    DenseDiagonal,
    DenseEigenvalueCorrected,
    DenseFull,
    DenseTNT,
    DenseTwoKroneckerFactored,
    DenseTwoKroneckerFactoredReduce,
    EigenvalueCorrectedKroneckerFactored,
    NaiveTNT,
    Diagonal,
    Full,
    KroneckerFactored,
    NaiveDiagonal,
    NaiveFull,
    RepeatedDenseKroneckerFactored,
    ScaledIdentity,
    TwoKroneckerFactored,
    WeightedMovingAverage,
    get_default_eigen_decomposition_threshold,
    get_default_tag_to_block_ctor,
    get_max_parallel_elements,
    set_default_eigen_decomposition_threshold,
    set_default_tag_to_block_ctor,
    set_max_parallel_elements,
)
from curvax.estimators import (
    BlockDiagonalCurvature,
    CurvatureEstimator,
    ExplicitExactCurvature,
    ImplicitExactCurvature,
)
from curvax.losses import (
    CategoricalLogitsNegativeLogProbLoss,
    DistributionNegativeLogProbLoss,
    LossFunction,
    MultiBernoulliNegativeLogProbLoss,
    NegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss,
    NormalMeanVarianceNegativeLogProbLoss,
    OneHotCategoricalLogitsNegativeLogProbLoss,
    register_categorical_predictive_distribution,
    register_multi_bernoulli_predictive_distribution,
    register_normal_predictive_distribution,
    register_sigmoid_cross_entropy_loss,
    register_softmax_cross_entropy_loss,
    register_squared_error_loss,
)
from curvax.optimizer import HAIKU_BIASES, HAIKU_BIASES_AND_NORMS, Optimizer
from curvax.preconditioner import KFACPreconditionerState, kfac_preconditioner
from curvax.stacked import StackedBlock
from curvax.patterns import GraphPattern
from curvax.layers.conv import (
    Conv2DDiagonal,
    Conv2DEigenvalueCorrected,
    Conv2DFull,
    Conv2DTNT,
    Conv2DTwoKroneckerFactored,
    ConvDiagonal,
    ConvEigenvalueCorrected,
    ConvFull,
    ConvGroupedTwoKroneckerFactored,
    ConvTNT,
    ConvTwoKroneckerFactored,
    ConvTwoKroneckerFactoredReduce,
    patches_moments,
    patches_moments_explicit,
    register_conv1d,
    register_conv2d,
    register_conv3d,
)
from curvax.layers.embedding import EmbeddingKroneckerFactored, register_embedding
from curvax.partitioned import DEFAULT_FACTOR_BUDGET, DensePartitionedKroneckerFactored
from curvax.layers.scale_and_shift import ScaleAndShiftDiagonal, ScaleAndShiftFull, register_scale_and_shift
from curvax.tags import LayerTag, LayerTagEqn, LossTag, register_dense, register_generic
from curvax.transforms import (
    ProcessedJaxpr,
    auto_register_tags,
    layer_tags_vjp,
    loss_tags_hvp,
    loss_tags_jvp,
    loss_tags_vjp,
)

__version__ = "0.1.0"

def install_as_kfac_jax() -> None: "Makes every ``import kfac_jax...`` (submodules too) resolve to curvax: ``curvax.kfac_api.switch``."; __import__("curvax.kfac_api.switch").kfac_api.switch.install_as_kfac_jax()  # noqa: E302,E501,E702,E704

tag_graph_matcher = patterns  # kfac-jax's module name for the pattern API

# kfac-jax v0.0.8 module names (``kfac_jax.tracer``, ``kfac_jax.loss_functions`` ...):
# thin namespaces in ``curvax.kfac_api``, also importable as ``curvax.<name>``. Nothing
# below this file imports ``curvax.kfac_api``: the compatibility layer sits on top.
from curvax.kfac_api import (  # noqa: E402
    curvature_blocks,
    curvature_estimator,
    layers_and_loss_tags,
    loss_functions,
    patches_second_moment,
    tracer,
)
from curvax.kfac_api import utils_names as _utils_names  # noqa: E402


def _alias_kfac_modules() -> None:
    """Registers ``curvax.<name>`` for each kfac-jax module name, so ``import curvax.tracer`` works."""
    import sys

    from curvax.kfac_api import MODULE_NAMES

    for name in (*MODULE_NAMES, "tag_graph_matcher"):
        sys.modules.setdefault(f"{__name__}.{name}", globals()[name])


_alias_kfac_modules()


def _add_kfac_utils_names() -> None:
    """Adds kfac-jax's other ``utils`` names to ``curvax.utils`` (``kfac_jax.utils`` is ``curvax.utils``).

    The core modules import ``curvax.utils`` for its own helpers only; the
    compatibility-only names (``curvax.kfac_api.utils_names``) join it here, on top.
    """
    for name in _utils_names.__all__:
        if not hasattr(utils, name):
            setattr(utils, name, getattr(_utils_names, name))


_add_kfac_utils_names()

# kfac-jax v0.0.8 top-level names for its tracer's data classes.
from curvax.tracing import LayerData, LayerVjpData  # noqa: E402

LayerMetaData = layers_and_loss_tags.LayerMetaData

# kfac-jax v0.0.8's Optax interface (``curvax.preconditioner``; compatibility-only).
OptaxPreconditioner = curvature_estimator.OptaxPreconditioner
OptaxPreconditionState = curvature_estimator.OptaxPreconditionState

__all__ = [
    "kfac_ferminet_alpha",
    "HAIKU_BIASES",
    "HAIKU_BIASES_AND_NORMS",
    "laplace",
    "operators",
    "layers",
    "GraphPattern",
    "Conv2DDiagonal",
    "Conv2DEigenvalueCorrected",
    "Conv2DFull",
    "Conv2DTNT",
    "Conv2DTwoKroneckerFactored",
    "ConvDiagonal",
    "ConvEigenvalueCorrected",
    "ConvFull",
    "ConvGroupedTwoKroneckerFactored",
    "ConvTNT",
    "ConvTwoKroneckerFactored",
    "ConvTwoKroneckerFactoredReduce",
    "patches_moments",
    "patches_moments_explicit",
    "register_conv1d",
    "register_conv2d",
    "register_conv3d",
    "EmbeddingKroneckerFactored",
    "DensePartitionedKroneckerFactored",
    "DEFAULT_FACTOR_BUDGET",
    "register_embedding",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "register_scale_and_shift",
    "patterns",
    "tag_graph_matcher",
    "BlockDiagonalCurvature",
    "CategoricalLogitsNegativeLogProbLoss",
    "CurvatureBlock",
    "CurvatureEstimator",
    "DenseDiagonal",
    "DenseEigenvalueCorrected",
    "DenseTNT",
    "EigenvalueCorrectedKroneckerFactored",
    "NaiveTNT",
    "DenseFull",
    "DenseTwoKroneckerFactored",
    "DenseTwoKroneckerFactoredReduce",
    "Diagonal",
    "DistributionNegativeLogProbLoss",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "Full",
    "KroneckerFactored",
    "LayerTag",
    "LayerTagEqn",
    "LossFunction",
    "LossTag",
    "MultiBernoulliNegativeLogProbLoss",
    "NaiveDiagonal",
    "NaiveFull",
    "NegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss",
    "NormalMeanVarianceNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "Optimizer",
    "KFACPreconditionerState",
    "kfac_preconditioner",
    "ProcessedJaxpr",
    "RepeatedDenseKroneckerFactored",
    "ScaledIdentity",
    "StackedBlock",
    "TwoKroneckerFactored",
    "WeightedMovingAverage",
    "auto_register_tags",
    "get_default_eigen_decomposition_threshold",
    "get_default_tag_to_block_ctor",
    "get_max_parallel_elements",
    "layer_tags_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
    "register_categorical_predictive_distribution",
    "register_dense",
    "register_generic",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
    "set_default_eigen_decomposition_threshold",
    "set_default_tag_to_block_ctor",
    "set_max_parallel_elements",
    "utils",
    # kfac-jax v0.0.8 module names and data classes
    "curvature_blocks",
    "curvature_estimator",
    "layers_and_loss_tags",
    "loss_functions",
    "patches_second_moment",
    "tracer",
    "LayerData",
    "LayerMetaData",
    "LayerVjpData",
    "OptaxPreconditioner",
    "OptaxPreconditionState",
]

from curvax import kfac_ferminet_alpha  # noqa: E402  (builds on Optimizer)
