"""kfac-jax v0.0.8 module names, for ``import curvax as kfac_jax`` compatibility.

kfac-jax exposes its API through modules named ``loss_functions``,
``layers_and_loss_tags``, ``curvature_blocks``, ``curvature_estimator``,
``tracer``, ``patches_second_moment`` and ``tag_graph_matcher``. Each module
here is a thin namespace: it re-exports curvax's own objects under kfac-jax's
names and adds only small adapters where kfac-jax's calling convention differs.
No curvature logic lives here. ``curvax/__init__.py`` makes each of them
available as ``curvax.<name>`` (attribute and importable module).
``utils_names`` holds kfac-jax's ``utils`` names that curvax's own code does
not use; ``curvax.utils`` re-exports them (``kfac_jax.utils`` is ``curvax.utils``).
"""

MODULE_NAMES = (
    "loss_functions",
    "layers_and_loss_tags",
    "curvature_blocks",
    "curvature_estimator",
    "tracer",
    "patches_second_moment",
)
