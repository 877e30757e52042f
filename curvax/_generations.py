"""Calling both kfac-jax API generations of blocks and estimators, by keyword.

kfac-jax changed the signatures of two methods between its documented API and
its released v0.0.8 (compatibility-only machinery; curvax itself uses the
documented one):

* ``CurvatureBlock.update_curvature_matrix_estimate``
  documented ``(state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None)``
  with ``estimation_data`` a dict (``inputs``, ``outputs``, ``params``,
  ``outputs_tangent``, ``params_tangent``); v0.0.8
  ``(state, estimation_data, ema_old, ema_new, identity_weight, batch_size)`` with a
  ``LayerVjpData`` (``primals``/``tangents``, each a ``LayerData``).
* ``CurvatureEstimator.update_curvature_matrix_estimate``
  documented ``(state, ema_old, ema_new, batch_size, rng, func_args, pmap_axis_name=None,
  estimation_mode=None)``; v0.0.8 ``(state, ema_old, ema_new, identity_weight,
  batch_size, rng, func_args, estimation_mode=None, pmap_axis_name=None)``.

A positional call is read against both signatures (the values decide where the
positions differ, e.g. ``func_args`` is a tuple/list and a PRNG key is not); an
override is then called *by keyword* in the generation its own signature names
(``identity_weight`` marks v0.0.8), so a positional shift cannot happen. A call
or an override that fits neither or both raises a ``TypeError`` saying why.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

DOC = "documented"
V008 = "v0.0.8"

# --- the two signatures of each method ------------------------------------------------


def _block_doc(state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None):  # noqa: ANN001
    pass


def _block_v008(state, estimation_data, ema_old, ema_new, identity_weight, batch_size):  # noqa: ANN001
    pass


def _est_doc(state, ema_old, ema_new, batch_size, rng, func_args, pmap_axis_name=None, estimation_mode=None):  # noqa: ANN001
    pass


def _est_v008(state, ema_old, ema_new, identity_weight, batch_size, rng, func_args, estimation_mode=None, pmap_axis_name=None):  # noqa: ANN001
    pass


_SIGS = {
    "block": {DOC: inspect.signature(_block_doc), V008: inspect.signature(_block_v008)},
    "estimator": {DOC: inspect.signature(_est_doc), V008: inspect.signature(_est_v008)},
}


def _is_axis_name(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _plausible(kind: str, args: Mapping[str, Any]) -> bool:
    """Whether bound values have the types their names call for (where the generations differ)."""
    if not _is_axis_name(args.get("pmap_axis_name")) or not _is_axis_name(args.get("estimation_mode")):
        return False
    if "batch_size" in args and (args["batch_size"] is None or isinstance(args["batch_size"], (str, tuple, list))):
        return False
    if kind == "estimator":
        if not isinstance(args.get("func_args"), (tuple, list)):
            return False
        if isinstance(args.get("rng"), (tuple, list, str)) or args.get("rng") is None:
            return False
    return True


def parse_call(kind: str, method: str, args: tuple, kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(generation, arguments by name)`` for a call of ``method`` with ``args``/``kwargs``."""
    fits = {}
    errors = []
    for gen, sig in _SIGS[kind].items():
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            errors.append(f"{gen}: {e}")
            continue
        bound.apply_defaults()
        if _plausible(kind, bound.arguments):
            fits[gen] = dict(bound.arguments)
        else:
            errors.append(f"{gen}: argument types do not fit")
    if len(fits) == 1:
        (gen, named), = fits.items()
        return gen, named
    sigs = "; ".join(f"{g}{s}" for g, s in _SIGS[kind].items())
    if not fits:
        raise TypeError(f"{method}: the arguments fit neither kfac-jax signature ({sigs}): {'; '.join(errors)}.")
    raise TypeError(
        f"{method}: the arguments fit both kfac-jax signatures ({sigs}); pass them by keyword "
        "(`identity_weight=` for v0.0.8, `pmap_axis_name=` for the documented one)."
    )


def override_generation(fn: Callable[..., Any], method: str) -> tuple[str, inspect.Signature]:
    """The generation an override's signature names: ``identity_weight`` marks v0.0.8."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_POSITIONAL for p in params) and "estimation_data" not in names and "ema_old" not in names:
        raise TypeError(
            f"{method} of {getattr(fn, '__qualname__', fn)}: a signature with only *args cannot say which kfac-jax "
            "generation it follows; name the parameters (with `identity_weight` for v0.0.8)."
        )
    if "identity_weight" in names and "pmap_axis_name" in names:
        # Both generations' extra argument: take it as v0.0.8 (data as LayerVjpData) only if
        # it comes before batch_size, as in v0.0.8's order.
        order = [p.name for p in params]
        if "batch_size" in order and order.index("identity_weight") < order.index("batch_size"):
            return V008, sig
        return DOC, sig
    return (V008 if "identity_weight" in names else DOC), sig


def call_override(
    fn: Callable[..., Any], sig: inspect.Signature, self_obj: Any, named: Mapping[str, Any], method: str
) -> Any:
    """Calls ``fn(self_obj, ...)`` passing each argument it names by keyword."""
    params = list(sig.parameters.values())[1:]  # drop self
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    kw: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in named:
            kw[p.name] = named[p.name]
        elif p.default is p.empty:
            raise TypeError(
                f"{method} of {getattr(fn, '__qualname__', fn)} needs argument {p.name!r}, which a call in "
                f"either kfac-jax generation does not provide."
            )
    if has_var_kw:
        for k, v in named.items():
            kw.setdefault(k, v)
    return fn(self_obj, **kw)


def dispatching(kind: str, method: str, fn: Callable[..., Any], prepare: Callable[[str, dict], dict]) -> Callable[..., Any]:
    """Wraps an override so that calls in either generation reach it by keyword.

    ``prepare(generation_of_fn, named)`` converts the named arguments (e.g. the
    estimation data's format) for the override's generation. A call may pass
    ``_curvax_named=`` (already-named arguments, every generation's names) to
    skip parsing; curvax's estimators do, to hand ``identity_weight`` through.
    """
    gen, sig = override_generation(fn, method)

    @functools.wraps(fn)
    def wrapper(self, *args: Any, _curvax_named: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        if _curvax_named is not None:
            if args or kwargs:
                raise TypeError(f"{method}: `_curvax_named` excludes other arguments.")
            named = dict(_curvax_named)
        else:
            _, named = parse_call(kind, method, args, kwargs)
        return call_override(fn, sig, self, prepare(gen, named), method)

    wrapper.__curvax_generation__ = gen  # type: ignore[attr-defined]
    wrapper.__curvax_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper
