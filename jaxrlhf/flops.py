"""FLOPs of a JAX computation, counted from its jaxpr.

XLA's own count (`compiled.cost_analysis()["flops"]`) counts the body of a
loop once, however many times it runs: a step whose layers are scanned
(`model.scan_layers`), whose gradient is accumulated over micro-batches or
whose sampler decodes token by token appears several times cheaper than it
is. This count walks the jaxpr instead: every matrix multiplication
(`dot_general`: 2 x output elements x contracted size) times the trip
count of each `scan` around it, the costlier branch of a `cond`, and the
recomputation a rematerialised backward pass holds. Element-wise work is
left out (as in MFU's "model FLOPs"): on accelerators it is a few percent
of a transformer's.
"""

import math
from typing import Any

import jax
from jax.extend import core as jax_core


def _sub_jaxprs(params) -> list:
  found = []
  for value in params.values():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      if isinstance(v, jax_core.ClosedJaxpr):
        found.append(v.jaxpr)
      elif isinstance(v, jax_core.Jaxpr):
        found.append(v)
  return found


def jaxpr_flops(jaxpr) -> float:
  """Matmul FLOPs of a (closed) jaxpr, loops counted by their trip count.

  A `while` loop's trip count is not known before it runs: its body is
  counted once (the framework's own loops are all scans).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    elif name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += max(jaxpr_flops(b) for b in eqn.params["branches"])
    else:
      total += sum(jaxpr_flops(sub) for sub in _sub_jaxprs(eqn.params))
  return total


def function_flops(fn, *args: Any, **kwargs: Any) -> float:
  """Matmul FLOPs of one call of `fn` (a jitted function or a plain one) on
  arguments of these shapes (arrays or jax.ShapeDtypeStruct); nothing is
  computed."""
  if hasattr(fn, "trace"):
    return jaxpr_flops(fn.trace(*args, **kwargs).jaxpr)
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))
