"""The phases of a K-FAC step, as small functions over explicit state.

``curvax.Optimizer``, the Optax transformations of ``curvax.preconditioner`` and the
``kfac_ferminet_alpha`` optimizer are compositions of these phases (the way Optax composes
gradient transformations); none of them carries its own copy:

- ``config``: checking the constructor arguments once, into a frozen ``StepConfig``;
  the step's ``learning_rate``/``momentum``/``damping`` arguments.
- ``value_function``: the user's ``value_and_grad_func`` contract (argument tuple, outputs).
- ``forward``: the gradient and curvature pass (one linearized forward pass), the
  curvature's view of the batch (the same pass or a sub-batch's).
- ``statistics``: folding a batch into the curvature statistics, averaged over pmap devices
  and guarded against non-finite values.
- ``refresh``: the inverse refresh (periodic, staggered or every step); the one place that
  calls the estimator's ``update_cache``.
- ``precondition``: the damped (inverse) curvature products; the one place that calls the
  estimator's ``multiply_matpower`` (and ``multiply``); the norm constraint.
- ``coefficients``: learning rate and momentum, fixed, scheduled or minimising the quadratic
  model (exact or approximate), and the model's predicted change.
- ``damping``: the step's damping, the preconditioner's, and the Levenberg-Marquardt
  adaptation.
- ``guard``: the non-finite guard, its counters, the divergence check and the host-side
  report of both.
- ``stats``: the ``stats`` dict a step returns.
- ``state``: ``OptimizerState``, the optimizer's persistent state (checkpoint layout).
- ``program``: ``StepProgram``, init, burn-in and step composed of the phases above.

Each function is pure (jit-compatible) unless its docstring says otherwise; the state it reads
and writes is passed in and returned, never kept.
"""

from curvax.step import (  # noqa: F401
    coefficients,
    config,
    damping,
    forward,
    guard,
    precondition,
    program,
    refresh,
    state,
    statistics,
    stats,
    value_function,
)
