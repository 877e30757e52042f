"""Training with kfac_jax.Optimizer; prints one JSON line describing what ran."""

import json
import sys

import jax
import kfac_jax
import kfac_jax.tracer
import kfac_jax.optimizer
from kfac_jax.patches_second_moment import patches_moments

from kfac_client import curvature, networks


def main():
    params = networks.init(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 4))
    y = jax.random.randint(jax.random.PRNGKey(2), (32,), 0, 3)
    optimizer = kfac_jax.optimizer.Optimizer(
        value_and_grad_func=jax.value_and_grad(networks.loss), l2_reg=0.0, num_burnin_steps=0,
        layer_tag_to_block_ctor={"dense": curvature.DENSE_BLOCK},
    )
    key = jax.random.PRNGKey(3)
    state = optimizer.init(params, key, (x, y))
    losses = []
    for step in range(3):
        params, state, stats = optimizer.step(params, state, key, batch=(x, y), global_step_int=step,
                                              learning_rate=0.1, momentum=0.0, damping=0.1)
        losses.append(float(stats["loss"]))
    modules = {name: getattr(sys.modules[name], "__name__", None)
               for name in sorted(sys.modules) if name == "kfac_jax" or name.startswith("kfac_jax.")}
    print(json.dumps({
        "losses": losses,
        "modules": modules,
        "kfac_jax_file": kfac_jax.__file__,
        "optimizer_class": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "same_block": curvature.DENSE_BLOCK is kfac_jax.DenseTwoKroneckerFactored,
        "tracer": kfac_jax.tracer.__name__,
        "patches_moments": patches_moments.__module__,
        "layer_data": networks.LAYER_DATA.__name__,
        "inner_product": float(curvature.inner_product(params, params)),
        "jax_pmap_shmap_merge": jax.config.values.get("jax_pmap_shmap_merge"),
        "has_pmap_shmap_merge_option": "jax_pmap_shmap_merge" in jax.config.values,
        "version": __import__("kfac_client").VERSION,
    }))


if __name__ == "__main__":
    main()
