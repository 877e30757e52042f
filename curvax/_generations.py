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

An override whose signature names no argument of either generation, such as
``(self, *args, **kwargs)`` forwarding to ``super()``, is a *forwarder*
(generation ``FORWARD``): a call made by the user reaches it with the caller's
own arguments unchanged (so ``super()`` reads them in the caller's generation);
a call from curvax's estimators reaches it as kfac-jax's estimator would call a
block of the generation it forwards to (the next implementation up the class's
MRO, past other forwarders): ``state`` and ``estimation_data`` positionally, in
that generation's format, and the rest by keyword (all positionally if it takes
no ``**kwargs``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

DOC = "documented"
V008 = "v0.0.8"
FORWARD = "forward"
"""The generation of an override that names no argument (``*args``/``**kwargs`` only): it takes
the generation of its caller, or of the implementation it forwards to."""

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


def _common_prefix(kind: str) -> tuple[str, ...]:
    """The leading parameters both generations of ``kind`` share, name and position."""
    doc, v008 = (list(_SIGS[kind][g].parameters) for g in (DOC, V008))
    n = 0
    while n < min(len(doc), len(v008)) and doc[n] == v008[n]:
        n += 1
    return tuple(doc[:n])


# How kfac-jax v0.0.8 calls the method: the number of leading arguments it passes
# positionally (the block's state and estimation data; the estimator's all by keyword).
_KFAC_POSITIONAL = {"block": 2, "estimator": 0}


def override_generation(fn: Callable[..., Any], method: str, kind: str = "block") -> tuple[str, inspect.Signature]:
    """The generation an override's signature names: ``identity_weight`` marks v0.0.8.

    ``FORWARD`` for a forwarder: ``*args`` and/or ``**kwargs`` with, besides ``self``, at most
    the leading parameters both generations share (``state, estimation_data, ema_old, ema_new``
    for a block), so that its signature says nothing about the generation.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    named = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = set(named)
    takes_var = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    if takes_var and tuple(named) == _common_prefix(kind)[: len(named)]:
        return FORWARD, sig
    if any(p.kind is p.VAR_POSITIONAL for p in params) and "estimation_data" not in names and "ema_old" not in names:
        raise TypeError(
            f"{method} of {getattr(fn, '__qualname__', fn)}: a signature that names some arguments and takes the "
            "rest as *args cannot say which kfac-jax generation it follows; name the parameters (with "
            "`identity_weight` for v0.0.8), or take only *args/**kwargs and forward them to super()."
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


def _resolved_generation(cls: type, wrapper: Callable[..., Any], attr: str) -> str:
    """The generation a forwarder defined by ``wrapper`` forwards to in ``cls``'s MRO: the next
    implementation above the class that holds ``wrapper``, past other forwarders; ``DOC`` when
    none names one (curvax's own blocks and estimators follow the documented generation)."""
    mro = cls.__mro__
    start = next((i for i, c in enumerate(mro) if c.__dict__.get(attr) is wrapper), None)
    if start is None:
        return DOC
    for c in mro[start + 1 :]:
        fn = c.__dict__.get(attr)
        if fn is None:
            continue
        gen = getattr(fn, "__curvax_generation__", DOC)
        if gen != FORWARD:
            return gen
    return DOC


def call_forwarder(
    fn: Callable[..., Any], sig: inspect.Signature, self_obj: Any, kind: str, gen: str, named: Mapping[str, Any]
) -> Any:
    """Calls a forwarder as kfac-jax v0.0.8 calls this method, with the arguments of ``gen``."""
    order = [n for n in _SIGS[kind][gen].parameters if n in named]
    params = list(sig.parameters.values())[1:]
    n_named = sum(1 for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if not any(p.kind is p.VAR_KEYWORD for p in params):  # (self, [state, ...,] *args): all positionally
        return fn(self_obj, *(named[n] for n in order))
    if not any(p.kind is p.VAR_POSITIONAL for p in params):  # (self, [state, ...,] **kwargs)
        n_pos = n_named
    else:
        n_pos = max(_KFAC_POSITIONAL[kind], n_named)
    return fn(self_obj, *(named[n] for n in order[:n_pos]), **{n: named[n] for n in order[n_pos:]})


def dispatching(kind: str, method: str, fn: Callable[..., Any], prepare: Callable[[str, dict], dict]) -> Callable[..., Any]:
    """Wraps an override so that calls in either generation reach it by keyword.

    ``prepare(generation_of_fn, named)`` converts the named arguments (e.g. the
    estimation data's format) for the override's generation. A call may pass
    ``_curvax_named=`` (already-named arguments, every generation's names) to
    skip parsing; curvax's estimators do, to hand ``identity_weight`` through.
    """
    gen, sig = override_generation(fn, method, kind)
    attr = method.rsplit(".", 1)[-1]

    @functools.wraps(fn)
    def wrapper(self, *args: Any, _curvax_named: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        if gen == FORWARD:
            if _curvax_named is None:  # the caller's own arguments: super() reads them as it would
                return fn(self, *args, **kwargs)
            if args or kwargs:
                raise TypeError(f"{method}: `_curvax_named` excludes other arguments.")
            target = _resolved_generation(type(self), wrapper, attr)
            return call_forwarder(fn, sig, self, kind, target, prepare(target, dict(_curvax_named)))
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
