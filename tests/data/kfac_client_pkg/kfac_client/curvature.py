"""Block choices, written the way kfac-jax users configure them."""

import kfac_jax.curvature_blocks
from kfac_jax import curvature_estimator
from kfac_jax import tag_graph_matcher as tgm
from kfac_jax import utils

DENSE_BLOCK = kfac_jax.curvature_blocks.DenseTwoKroneckerFactored
ESTIMATOR = curvature_estimator.BlockDiagonalCurvature
PATTERNS = tgm.DEFAULT_GRAPH_PATTERNS
inner_product = utils.inner_product
