"""The docstrings explain every argument and every statistic (issue 15, item 6).

By introspection: each parameter of the optimizer's constructor, ``init`` and ``step``, of
``kfac_preconditioner``, of the Laplace functions and of the estimators' public methods is named
in the corresponding docstring, as an ``Args:`` entry (``name:`` at the start of a line) or in
double backquotes. The optimizer's full reference lives in ``docs/reference/optimizer.md``: every
constructor argument has an entry there (and is named, in the same group, in the ``Optimizer``
docstring), and every key of the stats a real optimizer step returns is explained there.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import estimators, laplace

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "optimizer.md"


def _documented(doc: str, name: str) -> bool:
    """``name`` is an ``Args:`` entry (``name:`` opening a line) or appears as ````name````."""
    return bool(re.search(rf"^\s*{re.escape(name)}:", doc, re.M)) or f"``{name}``" in doc


def _undocumented(func, doc: str | None = None) -> list[str]:
    doc = inspect.getdoc(func) if doc is None else doc
    assert doc, f"{func.__qualname__} has no docstring"
    params = [p for p in inspect.signature(func).parameters if p not in ("self", "cls")]
    return [p for p in params if not _documented(doc, p)]


def _public_methods(cls) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(getattr(cls, n)))


def test_documented_matches_only_real_mentions():
    doc = "Args:\n  alpha: one.\n  beta_gamma: two.\n\nSee ``delta``; epsilon appears bare."
    assert _documented(doc, "alpha") and _documented(doc, "beta_gamma") and _documented(doc, "delta")
    assert not _documented(doc, "beta") and not _documented(doc, "epsilon") and not _documented(doc, "zeta")


def _reference_entries() -> dict[str, str]:
    """``{argument: explanation}`` of the reference page's ``- `name`: text`` entries (text unwrapped)."""
    text = REFERENCE.read_text()
    arguments = text.split("## Constructor arguments", 1)[1].split("\n## ", 1)[0]
    return {name: " ".join(body.split()) for name, body in re.findall(r"^- `(\w+)`: (.*(?:\n  .*)*)", arguments, re.M)}


def _reference_groups() -> dict[str, list[str]]:
    """The reference page's argument groups: ``{### title: [argument, ...]}``."""
    arguments = REFERENCE.read_text().split("## Constructor arguments", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### (.+)$", arguments, flags=re.M)[1:]
    return {title: re.findall(r"^- `(\w+)`:", body, re.M) for title, body in zip(sections[::2], sections[1::2])}


def test_every_optimizer_argument_has_an_entry_in_the_reference_page():
    params = [p for p in inspect.signature(curvax.Optimizer.__init__).parameters if p != "self"]
    entries = _reference_entries()
    assert sorted(entries) == sorted(params), set(entries) ^ set(params)
    short = [name for name, text in entries.items() if len(text) < 20]
    assert not short, f"reference entries without an explanation: {short}"


def test_optimizer_docstring_names_every_argument_in_the_reference_page_groups():
    doc = " ".join(inspect.getdoc(curvax.Optimizer).split())
    assert "docs/reference/optimizer.md" in doc
    missing = _undocumented(curvax.Optimizer.__init__, doc)
    assert not missing, f"Optimizer arguments missing from help(curvax.Optimizer): {missing}"
    for title, names in _reference_groups().items():
        # The docstring's "- Title: ``a``, ``b``." lists exactly the page's section of that title.
        found = re.search(rf"- {re.escape(title)}: ((?:``\w+``(?:, )?)+)\.", doc)
        assert found, title
        assert re.findall(r"``(\w+)``", found.group(1)) == names, title


def test_optimizer_docstring_explains_the_value_and_grad_func_contract():
    doc = " ".join(inspect.getdoc(curvax.Optimizer).split())
    page = " ".join(REFERENCE.read_text().split())
    # The four shapes of the value, the gradient actually used and where the loss is registered.
    for text in ("the scalar ``loss``", "``(loss, aux)``", "``(loss, new_func_state)``", "``(loss, (new_func_state, aux))``",
                 "This gradient is the one the step uses", "register_*_loss"):
        assert text in doc, text
        assert text.replace("``", "`") in page, text


def test_kfac_jax_008_arguments_curvax_does_not_implement_say_so():
    entries = _reference_entries()
    not_implemented = _reference_groups()["kfac-jax 0.0.8 arguments curvax does not implement"]
    assert sorted(not_implemented) == sorted(n for n, text in entries.items() if "not implemented: only" in text)
    for name in ("regularized_parameters_path_exclusions", "use_initial_damping_calibration",
                 "use_step_rejection", "reject_damping_increase_factor", "custom_estimator_ctor",
                 "include_registered_loss_in_stats", "num_estimator_samples",
                 "should_vmap_estimator_samples",
                 "precon_power", "exact_quad_model_matrix_type"):
        assert "not implemented" in entries[name], name
        default = inspect.signature(curvax.Optimizer.__init__).parameters[name].default
        with pytest.raises(NotImplementedError, match=name):
            curvax.Optimizer(jax.value_and_grad(lambda p, b: jnp.sum(p)), l2_reg=0.0,
                             **{name: "x" if default in ("", None) else 0.5})


def test_optimizer_methods_explain_every_argument():
    methods = _public_methods(curvax.Optimizer)
    assert {"init", "step", "burnin"} <= set(methods)
    missing = {m: _undocumented(getattr(curvax.Optimizer, m)) for m in methods}
    missing = {m: v for m, v in missing.items() if v}
    assert not missing, f"Optimizer methods: {missing}"


def test_kfac_preconditioner_explains_every_argument():
    assert not _undocumented(curvax.kfac_preconditioner)


def test_optax_preconditioner_explains_every_argument():
    from curvax.preconditioner import OptaxPreconditioner

    assert not _undocumented(OptaxPreconditioner.__init__, inspect.getdoc(OptaxPreconditioner))
    missing = {m: _undocumented(getattr(OptaxPreconditioner, m)) for m in _public_methods(OptaxPreconditioner)}
    missing = {m: v for m, v in missing.items() if v}
    assert not missing, f"OptaxPreconditioner: {missing}"


@pytest.mark.parametrize("name", ["log_determinant", "marginal_variances", "sample", "log_marginal_likelihood"])
def test_laplace_functions_explain_every_argument(name):
    assert not _undocumented(getattr(laplace, name))


@pytest.mark.parametrize(
    "cls", [estimators.BlockDiagonalCurvature, estimators.ExplicitExactCurvature, estimators.ImplicitExactCurvature]
)
def test_estimator_constructor_arguments_are_explained(cls):
    missing = _undocumented(cls.__init__, inspect.getdoc(cls))
    assert not missing, f"{cls.__name__}: {missing}"


@pytest.mark.parametrize("cls", [estimators.BlockDiagonalCurvature, estimators.ExplicitExactCurvature])
def test_estimator_public_methods_explain_every_argument(cls):
    methods = _public_methods(cls)
    for required in ("init", "update_curvature_matrix_estimate", "update_cache", "multiply", "multiply_inverse",
                     "multiply_matpower", "to_dense_matrix", "eigenvalues"):
        assert required in methods
    missing = {m: _undocumented(getattr(cls, m)) for m in methods}
    missing = {m: v for m, v in missing.items() if v}
    assert not missing, f"{cls.__name__}: {missing}"


def test_implicit_exact_curvature_methods_explain_every_argument():
    cls = estimators.ImplicitExactCurvature
    methods = _public_methods(cls)
    assert {"multiply_fisher", "multiply_ggn", "multiply_hessian", "multiply_jacobian_transpose"} <= set(methods)
    missing = {m: _undocumented(getattr(cls, m)) for m in methods}
    missing = {m: v for m, v in missing.items() if v}
    assert not missing, f"{cls.__name__}: {missing}"


# --- statistics -------------------------------------------------------------------------------


def _loss(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    loss = jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


def _stats_keys(**kwargs) -> set[str]:
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (4, 5)) / 2, "b1": jnp.zeros(5), "w2": jax.random.normal(k[1], (5, 3)) / 2}
    batch = (jax.random.normal(k[2], (8, 4)), jax.random.randint(k[3], (8,), 0, 3))
    opt = curvax.Optimizer(jax.value_and_grad(_loss, has_aux=True), l2_reg=1e-3, value_func_has_aux=True,
                           num_burnin_steps=0, **kwargs)
    state = opt.init(params, k[0], batch)
    step_kwargs = {} if kwargs.get("use_adaptive_damping") else {"damping": 1e-2}
    if not kwargs.get("use_adaptive_learning_rate"):
        step_kwargs["learning_rate"] = 0.1
    if not kwargs.get("use_adaptive_momentum"):
        step_kwargs["momentum"] = 0.9
    out = opt.step(params, state, k[1], batch=batch, **step_kwargs)
    stats = out[-1]
    assert np.isfinite(float(stats["loss"]))
    return set(stats)


@pytest.mark.parametrize(
    "kwargs",
    [
        # Every key a default step returns is returned here too, with the optional ones.
        {"include_norms_in_stats": True, "include_per_param_norms_in_stats": True, "norm_constraint": 1e-3},
        {"use_adaptive_learning_rate": True, "use_adaptive_momentum": True, "use_adaptive_damping": True,
         "initial_damping": 1.0, "damping_adaptation_interval": 1},
    ],
    ids=["norms", "adaptive"],
)
def test_every_stats_key_is_documented(kwargs):
    page = REFERENCE.read_text().split("## Statistics", 1)[1]
    keys = _stats_keys(**kwargs)
    assert {"loss", "aux", "update_skipped"} <= keys
    if kwargs.get("include_per_param_norms_in_stats"):
        assert "update_norm(w1)" in keys and "scaled_grad_norm_sq" in keys
    missing = []
    for key in sorted(keys):
        per_param = re.fullmatch(r"(\w+)\((.+)\)", key)
        name = f"{per_param.group(1)}(<path>)" if per_param else key
        if f"`{name}`" not in page:
            missing.append(key)
    assert not missing, f"stats keys not documented in docs/reference/optimizer.md: {missing}"
