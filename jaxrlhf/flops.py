"""FLOPs of a JAX computation, counted from its jaxpr.

XLA's own count (`compiled.cost_analysis()["flops"]`) counts the body of a
loop once, however many times it runs: a step whose layers are scanned
(`model.scan_layers`), whose gradient is accumulated over micro-batches or
whose sampler decodes token by token appears several times cheaper than it
is. This count walks the jaxpr instead: every matrix multiplication
(`dot_general`: 2 x output elements x contracted size) times the trip
count of each `scan` around it (and the points of a Pallas kernel's
grid), the costlier branch of a `cond`, and the recomputation a
rematerialised backward pass holds. A `while` loop is
counted at its trip count's upper bound when its condition states one (see
`while_trip_bound`: a counter from a constant, below a constant, stepped by
a constant, as the sampler's stop-when-done loop is), so a plan counts the
most a step can cost; otherwise its body once. A grouped product
(`ragged_dot`, a mixture of experts' expert matmuls) counts each row once,
by the one group it falls in (see `ragged_dot_flops`). The body of a
`shard_map` runs on each of its devices, at their shard's shapes: it counts
once per device. Element-wise work is
left out (as in MFU's "model FLOPs"): on accelerators it is a few percent
of a transformer's.
"""

import math
from typing import Any, Optional

import jax
from jax.extend import core as jax_core
import numpy as np


def sub_jaxprs(params) -> list:
  """The jaxprs among an equation's parameters (a loop's body, a call's
  callee, a cond's branches)."""
  found = []
  for value in params.values():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      if isinstance(v, jax_core.ClosedJaxpr):
        found.append(v.jaxpr)
      elif isinstance(v, jax_core.Jaxpr):
        found.append(v)
  return found


def _literal(var):
  """The Python number a jaxpr variable is bound to, or None if not a
  scalar literal."""
  if isinstance(var, jax_core.Literal) and np.ndim(var.val) == 0:
    return var.val.item() if hasattr(var.val, "item") else var.val
  return None


def _conjuncts(jaxpr, var) -> list:
  """The equations whose boolean results are and-ed into `var`."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  found, todo = [], [var]
  while todo:
    var = todo.pop()
    eqn = (None if isinstance(var, jax_core.Literal) else producer.get(var))
    if eqn is None:
      continue
    if eqn.primitive.name == "and" and not eqn.outvars[0].aval.shape:
      todo.extend(v for v in eqn.invars
                  if not isinstance(v, jax_core.Literal))
    else:
      found.append(eqn)
  return found


def while_trip_bound(eqn) -> Optional[int]:
  """An upper bound on the iterations of a `while` equation, or None.

  Recognised: the condition is `i < n` (possibly and-ed with anything else,
  e.g. "some row is still running"), where the loop variable i starts at a
  literal i0 and the body returns i + s for a literal s > 0, and n is a
  literal: at most ceil((n - i0) / s) iterations. The bound is what a step
  costs when no early exit happens (the sampler with `stop_when_done`).
  """
  params = eqn.params
  cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
  cond_carry = cond.invars[params["cond_nconsts"]:]
  body_carry = body.invars[params["body_nconsts"]:]
  init = eqn.invars[params["cond_nconsts"] + params["body_nconsts"]:]
  body_producer = {v: e for e in body.eqns for v in e.outvars}
  bounds = []
  for test in _conjuncts(cond, cond.outvars[0]):
    carried = [j for j, v in enumerate(cond_carry) if v is test.invars[0]]
    if test.primitive.name != "lt" or not carried:
      continue
    i = carried[0]
    limit, start = _literal(test.invars[1]), _literal(init[i])
    update = (None if isinstance(body.outvars[i], jax_core.Literal)
              else body_producer.get(body.outvars[i]))
    if limit is None or start is None or update is None or (
        update.primitive.name != "add"):
      continue
    a, b = update.invars
    stride = (_literal(b) if a is body_carry[i] else
              _literal(a) if b is body_carry[i] else None)
    if stride and stride > 0:
      bounds.append(max(0, math.ceil((limit - start) / stride)))
  return min(bounds) if bounds else None


def ragged_dot_flops(eqn, group_ways: int = 1) -> float:
  """FLOPs of a `ragged_dot_general` equation (`jax.lax.ragged_dot` and
  its gradients): 2 x output elements x contracted size, each row of the
  ragged dimension multiplied by the one group it falls in. When that
  dimension is contracted (a weight gradient, whose output holds a slice
  per group) each row counts in one slice, not in all.

  Exact when every row falls in a group (a mixture of experts whose
  experts are all held). group_ways > 1: the equation holds 1/group_ways
  of the groups (experts split over that many devices, the rows being all
  theirs' tokens' copies), and its rows are counted at that share: those
  that fall in its groups when the routing is balanced over all groups.
  """
  dims = eqn.params["ragged_dot_dimension_numbers"]
  (contracting, _), _ = dims.dot_dimension_numbers
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  total = 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
  if dims.lhs_ragged_dimensions[0] in contracting:
    total /= eqn.invars[2].aval.shape[-1]   # the output's group slices
  return total / group_ways


def _spec_ways(spec, dim: int, mesh_shape) -> int:
  """Devices a PartitionSpec splits dimension `dim` over."""
  axes = spec[dim] if spec is not None and dim < len(spec) else None
  if axes is None:
    return 1
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return math.prod(mesh_shape[a] for a in axes)


def _shard_map_group_ways(eqn) -> dict:
  """{id of each ragged_dot_general equation of a shard_map's body: its
  group_ways}: the devices its groups are split over, by the in_spec of the
  body input that its grouped operand is (through dtype casts); a weight
  gradient's, by the equation whose group sizes it shares; else 1."""
  params = eqn.params
  body = params["jaxpr"]
  mesh_shape = dict(params["mesh"].shape)
  producer = {v: e for e in body.eqns for v in e.outvars}
  split = dict(zip(body.invars, params["in_specs"]))

  def source(var):
    while var in producer and producer[var].primitive.name in (
        "convert_element_type", "copy"):
      var = producer[var].invars[0]
    return var

  ragged = [e for e in body.eqns if e.primitive.name == "ragged_dot_general"]
  ways, by_sizes = {}, {}
  for e in ragged:
    groups = e.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    rhs = source(e.invars[1])
    if groups and rhs in split:
      ways[id(e)] = _spec_ways(split[rhs], groups[0], mesh_shape)
      by_sizes[e.invars[2]] = ways[id(e)]
  for e in ragged:
    if id(e) not in ways:
      ways[id(e)] = by_sizes.get(e.invars[2], 1)
  return ways


def jaxpr_flops(jaxpr, group_ways=None) -> float:
  """Matmul FLOPs of a (closed) jaxpr, loops counted by their trip count.

  A `while` loop's trip count is not known before it runs: it is counted at
  `while_trip_bound`'s upper bound when there is one, else once.
  group_ways: {id of a ragged_dot_general equation: its `ragged_dot_flops`
  group_ways} (a shard_map's body; 1 for those not in it).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "ragged_dot_general":
      total += ragged_dot_flops(eqn, (group_ways or {}).get(id(eqn), 1))
    elif name == "shard_map":
      mesh_shape = dict(eqn.params["mesh"].shape)
      devices = math.prod(mesh_shape[a]
                          for a in eqn.params["newly_manual_axes"])
      total += devices * jaxpr_flops(eqn.params["jaxpr"],
                                     _shard_map_group_ways(eqn))
    elif name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    elif name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
    elif name == "cond":
      total += max(jaxpr_flops(b) for b in eqn.params["branches"])
    elif name == "pallas_call":
      # A kernel's body runs once per point of its grid (Pallas attention:
      # per head and block of queries and keys; blocks a mask skips are
      # counted, as the dense computation would count them).
      grid = eqn.params["grid_mapping"].grid
      runs = math.prod(grid) if all(isinstance(g, int) for g in grid) else 1
      total += runs * jaxpr_flops(eqn.params["jaxpr"])
    elif name == "while":
      trips = while_trip_bound(eqn)
      body = jaxpr_flops(eqn.params["body_jaxpr"])
      test = jaxpr_flops(eqn.params["cond_jaxpr"])
      if trips is None:
        total += body + test
      else:  # the condition is evaluated once more than the body runs
        total += trips * body + (trips + 1) * test
    else:
      total += sum(jaxpr_flops(sub) for sub in sub_jaxprs(eqn.params))
  return total


def function_flops(fn, *args: Any, **kwargs: Any) -> float:
  """Matmul FLOPs of one call of `fn` (a jitted function or a plain one) on
  arguments of these shapes (arrays or jax.ShapeDtypeStruct); nothing is
  computed."""
  if hasattr(fn, "trace"):
    return jaxpr_flops(fn.trace(*args, **kwargs).jaxpr)
  return jaxpr_flops(jax.make_jaxpr(fn)(*args, **kwargs))
