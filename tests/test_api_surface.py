"""Every name of kfac-jax's documented API exists in curvax with a compatible signature.

`data/kfac_jax_api.json` lists, for each documented top-level class or function,
its parameters (name, and the default where the documentation gives a literal
one) and its documented members (methods with their parameters, properties and
attributes). A call written against kfac-jax's documentation must bind the same
way here: documented parameters come first, in the documented order, with the
documented defaults; anything we add comes after them and has a default.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

import curvax

API: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "data" / "kfac_jax_api.json").read_text())
# The documented attributes of `Optimizer.State` are listed under `Optimizer`.
STATE_FIELDS = {"velocities", "estimator_state", "damping", "data_seen", "step_counter"}
# Documented attributes that only instances have (checked on instances in `test_instance_attributes`).
INSTANCE_ATTRIBUTES = {
    "CurvatureEstimator": ("default_estimation_mode", "params_index"),
    "BlockDiagonalCurvature": ("default_estimation_mode", "params_index"),
    "ProcessedJaxpr": ("in_tree", "layer_indices", "layer_tags", "params_index", "params_tree"),
}
VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _literal(text: str) -> Any:
    return math.inf if text == "inf" else ast.literal_eval(text)


def _check_parameters(where: str, func: Any, documented: list[list[Any]], drop_self: bool) -> None:
    params = list(inspect.signature(func).parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    named = [p for p in params if p.kind not in VARIADIC]
    doc_named = [d for d in documented if not d[0].startswith("*")]
    doc_variadic = [d[0] for d in documented if d[0].startswith("*")]
    names = [p.name for p in named[: len(doc_named)]]
    assert names == [d[0] for d in doc_named], f"{where}: parameters {names} != documented {[d[0] for d in doc_named]}"
    for p, d in zip(named, doc_named):
        if len(d) == 1:
            continue  # documented as required: callers always pass it, so a default of ours is harmless
        assert p.default is not inspect.Parameter.empty, f"{where}: `{p.name}` needs a default"
        if d[1] is not None:
            assert p.default == _literal(d[1]), f"{where}: `{p.name}` defaults to {p.default!r}, documented {d[1]}"
    for extra in named[len(doc_named):]:
        assert extra.default is not inspect.Parameter.empty, f"{where}: our extra `{extra.name}` needs a default"
    kinds = {p.kind for p in params}
    for v in doc_variadic:
        kind = inspect.Parameter.VAR_KEYWORD if v.startswith("**") else inspect.Parameter.VAR_POSITIONAL
        assert kind in kinds, f"{where}: documented {v} is not accepted"


@pytest.mark.parametrize("name", sorted(API))
def test_documented_name_and_signature(name: str):
    assert hasattr(curvax, name), f"curvax.{name} is missing"
    obj = getattr(curvax, name)
    entry = API[name]
    if entry["params"] is not None:
        _check_parameters(f"curvax.{name}", obj, entry["params"], drop_self=False)
    # Members documented under a class may belong to its nested `State` (a dataclass or NamedTuple).
    state = getattr(obj, "State", None)
    state_fields = set(getattr(state, "_fields", ())) | set(getattr(state, "__dataclass_fields__", {}))
    missing = []
    for member, documented in sorted(entry["members"].items()):
        if hasattr(obj, member):
            if documented is not None:
                _check_parameters(f"curvax.{name}.{member}", getattr(obj, member), documented, drop_self=True)
        elif member not in state_fields and member not in INSTANCE_ATTRIBUTES.get(name, ()):
            missing.append(member)
    assert not missing, f"curvax.{name} lacks documented members {missing}"


def test_instance_attributes():
    def loss(p, x):
        out = x @ p["w"]
        curvax.register_squared_error_loss(out, jnp.zeros_like(out))
        return jnp.mean(out**2)

    args = ({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)))
    instances = {
        "ProcessedJaxpr": curvax.ProcessedJaxpr.make_from_func(loss, args),
        "BlockDiagonalCurvature": curvax.BlockDiagonalCurvature(loss),
    }
    instances["CurvatureEstimator"] = instances["BlockDiagonalCurvature"]
    for name, attrs in INSTANCE_ATTRIBUTES.items():
        for attr in attrs:
            assert hasattr(instances[name], attr), f"curvax.{name} instances lack `{attr}`"
    assert instances["BlockDiagonalCurvature"].default_estimation_mode == "fisher_gradients"
    assert instances["ProcessedJaxpr"].params_index == 0 and instances["ProcessedJaxpr"].layer_indices == ((0,),)


def test_table_is_complete():
    # The documented API of kfac-jax has these many top-level names; a truncated table would pass vacuously.
    assert len(API) >= 44
    assert len(API["Optimizer"]["params"]) == 41 and "step" in API["Optimizer"]["members"]


def test_signature_check_catches_mismatches():
    def documented_order(a, b=1, c=None):
        return a

    _check_parameters("ok", documented_order, [["a"], ["b", "1"]], drop_self=False)
    for bad in ([["b"], ["a"]], [["a"], ["b", "2"]], [["a"], ["x", "1"]], [["a"], ["b", "1"], ["**kw"]]):
        with pytest.raises(AssertionError):
            _check_parameters("bad", documented_order, bad, drop_self=False)

    def extra_without_default(a, b=1, d=None, *, e):
        return a

    with pytest.raises(AssertionError, match="needs a default"):
        _check_parameters("extra", extra_without_default, [["a"], ["b", "1"]], drop_self=False)
