"""Layer kinds beyond dense: one module per kind.

Each module defines the kind's layer tag and ``register_*`` function, its
detection matcher (registered with ``detection.register_layer_matcher``) and
its curvature blocks (registered with ``blocks.set_default_tag_to_block_ctor``).
Importing this package registers them all; a new layer kind is one new module
here plus one import line below.
"""

from curvax.layers import conv, embedding, scale_and_shift

__all__ = ["conv", "embedding", "scale_and_shift"]
