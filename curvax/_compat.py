"""The one place where curvax touches JAX internals.

Custom primitives need differentiation, batching and lowering rules, which JAX
only exposes through ``jax.interpreters``; evaluating one jaxpr equation needs
the jaxpr constructors of ``jax.extend.core``. Everything version-sensitive lives
here so that a JAX upgrade breaks this file and its tests, not the library.
"""

from __future__ import annotations

import contextlib
import dataclasses

from typing import Any, Callable, Iterator, Sequence

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

try:  # the axis-environment context of `jax.make_jaxpr(axis_env=...)`; see `bound_axes`
    from jax._src import core as _jax_core
except ImportError:  # pragma: no cover
    _jax_core = None

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
Primitive = jex_core.Primitive
# jax.extend.core gained DropVar and DebugInfo after 0.9; recognise/build them by other means there.
DebugInfo = getattr(jex_core, "DebugInfo", None)

# Names under which JAX has spelled "call a closed sub-jaxpr" over its versions.
CALL_PRIMITIVE_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "remat2"})
CUSTOM_DERIVATIVE_NAMES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def define_identity_rules(
    primitive: Primitive,
    impl: Callable[..., Any],
    abstract_eval: Callable[..., Any],
    jvp: Callable[..., Any],
    batch: Callable[..., Any],
) -> None:
    """Registers evaluation, abstract evaluation, JVP, batching and lowering rules."""
    primitive.def_impl(impl)
    primitive.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[primitive] = jvp
    batching.primitive_batchers[primitive] = batch
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=primitive.multiple_results))


def is_literal(v: Any) -> bool:
    return isinstance(v, Literal)


def is_dropvar(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def sub_closed_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The called jaxpr of a call-like equation (``jit``, ``closed_call``, ``remat``), else None."""
    name = eqn.primitive.name
    if name in CALL_PRIMITIVE_NAMES:
        j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    elif name == "custom_jvp_call":
        j = eqn.params.get("call_jaxpr")
    elif name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        j = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    else:
        return None
    if j is None:
        return None
    if isinstance(j, Jaxpr):
        return ClosedJaxpr(j, [])
    if isinstance(j, ClosedJaxpr):
        return j
    return None


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """How a ``scan`` equation splits its operands, and how it iterates."""

    body: ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_layout(eqn: JaxprEqn) -> ScanLayout | None:
    """The body and operand layout of a ``lax.scan`` equation, else None.

    Body operands are ``consts + carry + xs``; outputs are ``carry + ys``.
    """
    if eqn.primitive.name != "scan":
        return None
    p = eqn.params
    body = p.get("jaxpr")
    if not isinstance(body, ClosedJaxpr) or "num_consts" not in p or "num_carry" not in p or "length" not in p:
        return None
    return ScanLayout(body, int(p["num_consts"]), int(p["num_carry"]), int(p["length"]), bool(p.get("reverse", False)), p.get("unroll", 1))


def has_sub_jaxprs(eqn: JaxprEqn) -> bool:
    for v in eqn.params.values():
        vals = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in vals):
            return True
    return False


def eval_equation(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluates one equation on (possibly traced) values; returns one value per outvar.

    First-order primitives are bound directly. Equations carrying sub-jaxprs are
    wrapped into a one-equation closed jaxpr and evaluated by JAX's own
    ``jaxpr_as_fun``, so that JAX converts their parameters as it needs to.
    """
    if not has_sub_jaxprs(eqn):
        out = eqn.primitive.bind(*invals, **eqn.params)
        return list(out) if eqn.primitive.multiple_results else [out]
    in_vars: list[Var] = []
    in_vals: list[Any] = []
    for v, x in zip(eqn.invars, invals):
        if isinstance(v, Literal) or v in in_vars:
            continue
        in_vars.append(v)
        in_vals.append(x)
    out_vars = [v for v in eqn.outvars if not is_dropvar(v)]
    names = lambda p, n: tuple(f"{p}{i}" for i in range(n))
    if DebugInfo is not None:
        info = DebugInfo("curvax", eqn.primitive.name, names("x", len(in_vars)), names("y", len(out_vars)))
    else:  # JAX 0.9: take the (NamedTuple) debug info of a traced jaxpr as a template.
        info = _DEBUG_TEMPLATE._replace(arg_names=names("x", len(in_vars)), result_paths=names("y", len(out_vars)))
    jaxpr = Jaxpr([], in_vars, out_vars, [eqn], eqn.effects, debug_info=info)
    outs = jex_core.jaxpr_as_fun(ClosedJaxpr(jaxpr, []))(*in_vals)
    it = iter(outs)
    return [None if is_dropvar(v) else next(it) for v in eqn.outvars]


_DEBUG_TEMPLATE = None if DebugInfo is not None else jax.make_jaxpr(lambda: ())().jaxpr.debug_info


_BOUND_AXES: list[tuple[Any, int]] = []  # axes bound by `bound_axes` where JAX's own context is missing


def make_jaxpr(fun: Callable[..., Any], *args: Any, return_shape: bool = False) -> Any:
    return jax.make_jaxpr(fun, axis_env=list(_BOUND_AXES) or None, return_shape=return_shape)(*args)


def first_outputs(closed: ClosedJaxpr, count: int) -> ClosedJaxpr:
    """``closed`` with only its first ``count`` outputs (the equations stay; evaluation skips
    those no output needs): the trace of ``lambda *a: f(*a)[:count]`` from the trace of ``f``."""
    jaxpr = closed.jaxpr
    info = getattr(jaxpr, "debug_info", None)
    paths = getattr(info, "result_paths", None)
    if isinstance(paths, (tuple, list)) and hasattr(info, "_replace"):
        info = info._replace(result_paths=tuple(paths)[:count])
    return ClosedJaxpr(jaxpr.replace(outvars=list(jaxpr.outvars[:count]), debug_info=info), closed.consts)


@contextlib.contextmanager
def bound_axes(axes: Sequence[tuple[Any, int]]) -> Iterator[None]:
    """Traces inside see the named axes ``axes`` (``(name, size)`` pairs) as bound, as inside a ``pmap``.

    For tracing a user function that calls collectives (``lax.pmean(x, name)``) outside the
    ``pmap`` that will run it: ``jax.make_jaxpr(f, axis_env=axes)`` does this for one trace; this
    context does it for every trace in its body (``jax.eval_shape`` included), using the context
    manager ``jax.make_jaxpr`` itself uses.
    """
    extend = getattr(_jax_core, "extend_axis_env_nd", None)
    if extend is None:  # fall back to the public `axis_env` of curvax's own traces
        _BOUND_AXES.extend(axes)
        try:
            yield
        finally:
            del _BOUND_AXES[len(_BOUND_AXES) - len(axes):]
        return
    with extend(list(axes)):
        yield
