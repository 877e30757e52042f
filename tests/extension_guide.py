"""kfac-jax's "Extending KFAC-JAX" guide example with ``kfac_jax`` replaced by ``curvax``: a new
dense tag, its graph patterns and its Kronecker block. Shared by ``test_patterns.py`` (the whole
example in an optimizer) and ``test_blocks.py`` (the block against the built-in dense block).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import curvax
from curvax import patterns, utils

dense = curvax.LayerTag(name="dense_tag", num_inputs=1, num_outputs=1)


def register_dense(y, x, w, b=None, **kwargs):
    """Registers a dense layer: ``y = matmul(x, w) + b``."""
    if b is None:
        return dense.bind(y, x, w, **kwargs)
    return dense.bind(y, x, w, b, **kwargs)


def dense_function(x, params):
    """Example of a dense layer function."""
    w, *opt_b = params
    y = jnp.matmul(x, w)
    return y if not opt_b else y + opt_b[0]


def _dense_parameter_extractor(eqns) -> Mapping[str, Any]:
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            return dict(**eqn.params)
    assert False


dense_with_bias_pattern = patterns.GraphPattern(
    name="dense_with_bias",
    tag_primitive=dense,
    precedence=0,
    compute_func=dense_function,
    parameters_extractor_func=_dense_parameter_extractor,
    example_args=[np.zeros([11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
)
my_dense_no_bias_pattern = patterns.GraphPattern(
    name="my_dense_no_bias",
    tag_primitive=dense,
    compute_func=dense_function,
    parameters_extractor_func=_dense_parameter_extractor,
    example_args=[np.zeros([11, 13]), [np.zeros([13, 7])]],
)


class DenseTwoKroneckerFactored(curvax.TwoKroneckerFactored):
    """A :class:`~TwoKroneckerFactored` block specifically for dense layers."""

    def input_size(self) -> int:
        if self.has_bias:
            return self.parameters_shapes[0][0] + 1
        return self.parameters_shapes[0][0]

    def output_size(self) -> int:
        return self.parameters_shapes[0][1]

    def update_curvature_matrix_estimate(
        self,
        state: curvax.TwoKroneckerFactored.State,
        estimation_data: Mapping[str, Sequence[jax.Array]],
        ema_old: Any,
        ema_new: Any,
        batch_size: int,
        pmap_axis_name: Optional[str],
    ) -> curvax.TwoKroneckerFactored.State:
        del pmap_axis_name
        (x,) = estimation_data["inputs"]
        (dy,) = estimation_data["outputs_tangent"]
        assert utils.first_dim_is_size(batch_size, x, dy)
        if self.has_bias:
            x_one = jnp.ones_like(x[:, :1])
            x = jnp.concatenate([x, x_one], axis=1)
        input_stats = jnp.matmul(x.T, x) / batch_size
        output_stats = jnp.matmul(dy.T, dy) / batch_size
        state.inputs_factor.update(input_stats, ema_old, ema_new)
        state.outputs_factor.update(output_stats, ema_old, ema_new)
        return state
