"""The readers of compiled HLO text in ``curvax.distributed``: which computations a module has,
which computations an instruction calls, which run inside a conditional's branch, and how many
custom calls (e.g. LAPACK decompositions) each branch holds.

On hand-written modules (a 3-branch conditional, nested calls, a computation called from two
places, text inside strings that looks like a call) and on programs compiled here: a
``lax.switch`` whose branches hold 1, 2 and 3 Cholesky factorizations, and one with a 3-branch
switch nested in a branch. The nested cases failed before the readers were shared: the old
call reader kept only the first entry of ``branch_computations={%a, %b, %c}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from curvax import distributed

# branch_0 holds one eigendecomposition; branch_1 calls %shared (two) and a fusion; branch_2 holds a
# nested 3-branch conditional whose last branch is the only one holding one. %shared is also
# called from the entry, outside any branch; %add is reached through to_apply.
MODULE = """HloModule m, entry_computation_layout={(s32[], f32[4,4]{1,0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%shared (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  %e = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi", metadata={op_name="x calls=%add"}
  %f = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi"
  %z = f32[] constant(0)
  ROOT %r = f32[4]{0} reduce(%p, %z), dimensions={0}, to_apply=%add
}

%fused (q: f32[4]) -> f32[4] {
  ROOT %q = f32[4]{0} parameter(0)
}

%branch_0 (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  %e = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi"
  ROOT %g = f32[4]{0} get-tuple-element(%e), index=1
}

%branch_1 (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  %c = f32[4]{0} call(%p), to_apply=%shared
  ROOT %u = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused
}

%inner_0 (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %q = f32[4]{0} custom-call(%p), custom_call_target="lapack_spotrf_ffi"
}

%inner_2 (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  %e = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi"
  ROOT %g = f32[4]{0} get-tuple-element(%e), index=1
}

%branch_2 (p: f32[4,4]) -> f32[4] {
  %p = f32[4,4]{1,0} parameter(0)
  %j = s32[] constant(1)
  ROOT %k = f32[4]{0} conditional(%j, %p, %p, %p), branch_computations={%inner_0, %branch_0, %inner_2}
}

ENTRY %main (i: s32[], x: f32[4,4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4,4]{1,0} parameter(1), metadata={op_name="jit(f)/conditional(%x), branch_computations={%add}"}
  %h = f32[4]{0} call(%x), to_apply=%shared
  %k = f32[4]{0} conditional(%i, %x, %x, %x), branch_computations={%branch_0, %branch_1, %branch_2}
  ROOT %o = f32[4]{0} add(%h, %k)
}
"""


def test_computations_are_split_by_header_and_closing_brace():
    comps = distributed.hlo_computations(MODULE)
    assert list(comps) == ["add", "shared", "fused", "branch_0", "branch_1", "inner_0", "inner_2", "branch_2", "main"]
    assert comps["add"] == ["%a = f32[] parameter(0)", "%b = f32[] parameter(1)", "ROOT %s = f32[] add(%a, %b)"]
    assert [len(v) for v in comps.values()] == [3, 5, 1, 3, 3, 2, 3, 3, 5]


@pytest.mark.parametrize("line, called", [
    ("%k = f32[4]{0} conditional(%i, %x, %x, %x), branch_computations={%a, %b.1, %c-2}", ["a", "b.1", "c-2"]),
    ("%k = f32[4]{0} conditional(%i, %x, %x, %x), branch_computations={%a,%b,%c}, metadata={op_name=\"c\"}", ["a", "b", "c"]),
    ("%u = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_computation.3, metadata={op_name=\"y\"}", ["fused_computation.3"]),
    ("%r = f32[] reduce(%p, %z), dimensions={0}, to_apply=%add", ["add"]),
    ("%w = (s32[], f32[4]) while(%t), condition=%cond.1, body=%body.2", ["cond.1", "body.2"]),
    ("%c = f32[4]{0} conditional(%p, %x, %y), true_computation=%t, false_computation=%f", ["t", "f"]),
    ("%s = f32[4]{0} select-and-scatter(%a, %b, %z), window={size=2}, select=%ge, scatter=%add", ["ge", "add"]),
    # names inside quoted strings are not calls
    ("%x = f32[4]{0} parameter(0), metadata={op_name=\"to_apply=%add calls={%a, %b}\"}", []),
    ("%e = (f32[4,4]{0,1}, s32[]) custom-call(%p), custom_call_target=\"lapack_spotrf_ffi\"", []),
])
def test_called_reads_every_form_of_call(line, called):
    assert distributed.hlo_called(line) == called


def test_conditionals_reachable_and_custom_call_targets():
    comps = distributed.hlo_computations(MODULE)
    assert distributed.hlo_conditionals(comps) == [["inner_0", "branch_0", "inner_2"], ["branch_0", "branch_1", "branch_2"]]
    assert distributed.hlo_custom_call_target(comps["inner_0"][1]) == "lapack_spotrf_ffi"
    assert distributed.hlo_custom_call_target(comps["main"][1]) is None
    assert distributed.hlo_custom_call_target('%z = f32[] constant(0), metadata={op_name="custom_call_target=\\"x\\""}') is None
    # %shared is called from the entry and from branch_1: it runs inside a branch; %main does not
    in_branch = distributed.hlo_reachable(comps, ["branch_0", "branch_1", "branch_2"])
    assert in_branch == {"branch_0", "branch_1", "branch_2", "shared", "add", "fused", "inner_0", "inner_2"}
    assert distributed.hlo_reachable(comps, ["main"]) == set(comps)
    assert distributed.hlo_reachable(comps, []) == set()


def test_branch_custom_calls_count_nested_calls_and_every_nested_branch():
    # outer branch_2 = inner_0 (0 syevd) + branch_0 (1) + inner_2 (1): the old reader, which kept
    # only the first entry of a braced list, gave 0 there
    assert distributed.hlo_branch_custom_calls(MODULE, "syevd") == [[0, 1, 1], [1, 2, 2]]
    assert distributed.hlo_branch_custom_calls(MODULE, "potrf") == [[1, 0, 0], [0, 0, 1]]
    assert distributed.hlo_branch_custom_calls(MODULE, "getrf") == [[0, 0, 0], [0, 0, 0]]


def test_bad_text_is_refused_with_the_argument_named():
    with pytest.raises(TypeError, match="hlo_text"):
        distributed.hlo_computations(jax.jit(jnp.sin).lower(1.0).compile())
    with pytest.raises(ValueError, match="hlo_text has no HLO computation"):
        distributed.hlo_computations("{ lambda ; a:f32[]. let b:f32[] = sin a in (b,) }")
    with pytest.raises(ValueError, match="'main' is not closed"):
        distributed.hlo_computations(MODULE[: MODULE.index("ROOT %o")])
    comps = distributed.hlo_computations(MODULE.replace("to_apply=%add\n", "to_apply=%missing\n"))
    with pytest.raises(ValueError, match="'missing' is called by"):
        distributed.hlo_reachable(comps, ["shared"])
    with pytest.raises(ValueError, match="roots: 'nowhere'"):
        distributed.hlo_reachable(comps, ["nowhere"])


def test_collectives_and_branch_counts():
    text = """HloModule m

%branch_a (p: f32[4,4]) -> f32[4] {
  %e = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi"
  %f = (f32[4,4]{0,1}, f32[4]{0}, s32[]) custom-call(%p), custom_call_target="lapack_ssyevd_ffi"
}

%branch_b (p: f32[4,4]) -> f32[4] {
  %c = f32[4]{0} call(%p), to_apply=%branch_a
}

ENTRY %main (x: f32[4,4], i: s32[]) -> f32[2,4] {
  %k = f32[4]{0} conditional(%i, %x, %x), branch_computations={%branch_a, %branch_b}
  %g = f32[2,4]{1,0} all-gather(%k), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %r = (f64[3]{0}, bf16[8]{0}) all-reduce-start(%k, %k), channel_id=2
  %d = (f64[3]{0}, bf16[8]{0}) all-reduce-done(%r)
}
"""
    assert distributed.hlo_branch_custom_calls(text, "syevd") == [[2, 2]]
    assert distributed.hlo_collectives(text) == [
        {"op": "all-gather", "shapes": ["f32[2,4]"], "bytes": 32},
        {"op": "all-reduce", "shapes": ["f64[3]", "bf16[8]"], "bytes": 40},
    ]


def _spd(x: jax.Array, k: int) -> jax.Array:
    return (k + 1.0) * (x @ x.T) + (4.0 + k) * jnp.eye(x.shape[0])


def test_compiled_switch_branches_hold_their_choleskys():
    """Branch k of a compiled 3-way ``lax.switch`` holds k + 1 Cholesky factorizations (LAPACK
    potrf custom calls), of different matrices so that XLA cannot merge them."""

    def f(i, x):
        branches = [lambda x, k=k: sum(jnp.linalg.cholesky(_spd(x, 3 * k + j)) for j in range(k + 1)) for k in range(3)]
        return lax.switch(i, branches, x)

    text = jax.jit(f).lower(1, jnp.ones((4, 4))).compile().as_text()
    comps = distributed.hlo_computations(text)
    (branches,) = distributed.hlo_conditionals(comps)
    assert len(branches) == 3
    assert distributed.hlo_branch_custom_calls(text, "potrf") == [[1, 2, 3]]
    in_branch = distributed.hlo_reachable(comps, branches)
    targets = [(name, distributed.hlo_custom_call_target(line)) for name, lines in comps.items() for line in lines]
    potrf = [name for name, t in targets if t is not None and "potrf" in t]
    assert len(potrf) == 6 and set(potrf) <= in_branch


def test_compiled_nested_switch_counts_every_inner_branch():
    """A 3-way switch inside the middle branch of another: the outer middle branch holds the
    choleskys of all the inner branches (1 + 0 + 2)."""
    chol = jnp.linalg.cholesky

    def f(i, j, x):
        inner = lambda x: lax.switch(j, [lambda y: chol(_spd(y, 1)), lambda y: 2.0 * y,
                                         lambda y: chol(_spd(y, 2)) + chol(_spd(y, 3))], x)
        return lax.switch(i, [lambda y: chol(_spd(y, 0)), inner, lambda y: 3.0 * y], x)

    text = jax.jit(f).lower(1, 0, jnp.ones((4, 4))).compile().as_text()
    counts = distributed.hlo_branch_custom_calls(text, "potrf")
    assert sorted(counts) == [[1, 0, 2], [1, 3, 0]]
