"""Parameters prepared once for a loop that calls the model many times with
the same parameters (a sampler's decode loop): each weight cast to the
dtype its reads cast it to (`recording_param_reads`, `cast_read_params`),
and sibling projections joined (`recording_param_fusions`,
`fuse_projections`, `Fusion`). The layers declare what they read and what
they could read joined (`param_read_dtypes`, `param_fusions`).
"""

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


# Parameters cast once: a loop that calls the model many times with the same
# float32 parameters (a decode loop) would otherwise cast every weight to the
# compute dtype at every call, reading 4 bytes and writing 2 per parameter on
# each step where the step itself needs only the 2-byte read. XLA cannot hoist
# those casts out of the loop when the layers are scanned (each reads its
# layer's slice inside the scan). Measured on an H100: 38% of a bfloat16
# Llama 3.2 1B-shaped decode step (experiments/results/gpu/sampling.txt).

def _recording(declaration: str, record: Callable[[Tuple[str, ...], Any],
                                                  None]):
  """Intercepts the model calls made inside it: for each call of a module
  that has the method `declaration`, record(the module's path in the
  parameter tree, declaration(the called method's name))."""
  def interceptor(next_fun, args, kwargs, context):
    declared = getattr(context.module, declaration, None)
    # (Flax intercepts the declaring method's own call too.)
    if declared is not None and context.method_name != declaration:
      record(tuple(context.module.path), declared(context.method_name))
    return next_fun(*args, **kwargs)
  return nn.intercept_methods(interceptor)


@contextlib.contextmanager
def recording_param_reads():
  """Records, for the model calls made inside it, the dtype each parameter
  is cast to where it is read: yields {path: set of dtypes}, the path being
  the parameter's keys in the "params" tree (a scanned stack's path names
  its stacked parameter once).

  Only modules that declare their reads (`param_read_dtypes(method)`:
  `DenseGeneral`, `OutputDense`, `Embed`) are recorded; every other
  parameter (norm scales read in float32, T5's relative-position table, ...)
  is absent, and `cast_read_params` leaves it as it is.
  """
  reads = {}

  def record(path, dtypes):
    for name, dtype in dtypes.items():
      reads.setdefault(path + (name,), set()).add(jnp.dtype(dtype))

  with _recording("param_read_dtypes", record):
    yield reads


def cast_read_params(params, reads):
  """`params` with each floating leaf that every recorded read casts to one
  narrower dtype cast to it now; the model computes exactly the same values
  from the result (the reads' casts then do nothing), and a loop over it
  reads the narrow copy. `reads`: from `recording_param_reads`.
  """
  def cast(path, leaf):
    dtypes = reads.get(tuple(getattr(k, "key", k) for k in path))
    if (dtypes is None or len(dtypes) != 1 or not hasattr(leaf, "dtype")
        or not jnp.issubdtype(leaf.dtype, jnp.floating)):
      return leaf
    (dtype,) = dtypes
    return leaf.astype(dtype) if dtype.itemsize < leaf.dtype.itemsize else leaf

  return jax.tree_util.tree_map_with_path(cast, params)


# ----------------------------------------------------------------------------
# Projections joined for a decode loop: a decode step multiplies one row per
# sequence by each weight matrix, so its products are bound by reading the
# weights, and the small ones (a layer's query, key and value) reach a lower
# share of the memory bandwidth than one product over their joined weights
# (experiments/results/gpu/decode_matmul.txt). Joined once per rollout, like
# the casts above, they are read joined at every step.

@dataclasses.dataclass(frozen=True)
class Fusion:
  """Sibling projections of one input that `fuse_projections` may join.

  members: the `DenseGeneral` submodules, in the order of their outputs in
    the joined one, `name`. Their parameters are concatenated along `axis`
    (the heads of the attention projections: -2 of a kernel [embed, heads,
    head_dim] and of a bias [heads, head_dim]; -1 of t5x's joined kernels
    [embed, heads * head_dim]) or, with `stack`, stacked along a new axis
    there (the gated MLP's equal projections: [embed, n, mlp]).
  unsplit: logical axes of the members that must not be split over the
    current mesh for the join to cost nothing: a plan may split the query
    heads and not the key/value heads, and a stacked MLP input split over
    a tensor-parallel axis took 30 MiB more per chip in the PPO T5-XL plan
    (v5e 4x8, model axis 8) than its cast parts. Tensor-parallel meshes
    keep their projections apart.
  """
  name: str
  members: Tuple[str, ...]
  axis: int = -2
  stack: bool = False
  unsplit: Tuple[str, ...] = ()


FUSED_QKV = Fusion("fused_qkv", ("query", "key", "value"),
                   unsplit=("heads", "kv_heads"))
FUSED_T5_QKV = Fusion("fused_qkv", ("query", "key", "value"), axis=-1,
                      unsplit=("joined_kv",))
# A gated MLP's joined input projections (their number is its activations').
FUSED_WI = "fused_wi"
# The parameters of a projection that can be joined: a member with any
# other (LoRA's factors) keeps its group separate.
_JOINABLE = frozenset({"kernel", "bias"})


@contextlib.contextmanager
def recording_param_fusions():
  """Records, for the model calls made inside it, the projections each
  module could have read joined: yields {module path: (Fusion, ...)} for
  the modules that declare them (`param_fusions(method)`: `Attention`,
  a gated `Mlp`), to give to `fuse_projections`."""
  fusions = {}

  def record(path, declared):
    if declared:
      fusions[path] = tuple(declared)

  with _recording("param_fusions", record):
    yield fusions


def _unsplit(axes: Sequence[str]) -> bool:
  """Whether the logical `axes` are each on mesh axes of size 1 (or no mesh)
  under the current mesh and logical-axis rules."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not axes:
    return True
  for spec in nn.logical_to_mesh_axes(tuple(axes)):
    spec = spec if isinstance(spec, tuple) else (spec,)
    if int(np.prod([mesh.shape[a] for a in spec if a is not None])) > 1:
      return False
  return True


def fuse_projections(params, fusions, cast_from=None):
  """`params` with each group of sibling projections recorded by
  `recording_param_fusions` joined into one (`Fusion`): the modules then
  compute each output from the joined weights with the same inputs and the
  same sums (rounded in another order, the products being others), and a
  loop over the result reads one weight per group. A group stays separate
  where a member is absent, holds more than a kernel and a bias (LoRA's
  factors), differs from the others in its parameters' dtypes or names, or
  where the current mesh splits an `unsplit` axis.

  cast_from: the parameters `params` were cast from (`cast_read_params`);
    then a group joins only where all its members' parameters were cast,
    so that the joined copy takes the place of the cast ones and a loop
    over the result holds no more memory than over `params` (parameters
    read in the dtype they are held in have no copy to replace).
  """
  def fuse(node, fusion, before):
    parts = [node.get(m) for m in fusion.members]
    if fusion.name in node or not all(hasattr(p, "keys") for p in parts):
      return node
    names = set(parts[0].keys())
    if not names <= _JOINABLE or any(set(p.keys()) != names for p in parts):
      return node
    # One array dtype per parameter name (a boxed leaf has none).
    dtypes = [{getattr(p[n], "dtype", None) for p in parts} for n in names]
    if any(len(d) != 1 or None in d for d in dtypes) or not _unsplit(
        fusion.unsplit):
      return node
    if cast_from is not None and (before is None or any(
        before[m][n].dtype == node[m][n].dtype for m in fusion.members
        for n in names)):
      return node
    def join(xs):
      if fusion.stack:
        xs = [jnp.expand_dims(x, fusion.axis) for x in xs]
      return jnp.concatenate(xs, axis=fusion.axis)
    joined = {n: join([p[n] for p in parts]) for n in sorted(names)}
    node = {k: v for k, v in node.items() if k not in fusion.members}
    node[fusion.name] = joined
    return node

  def at(tree, path):
    for key in path:
      if tree is None or not hasattr(tree, "keys") or key not in tree:
        return None
      tree = tree[key]
    return tree

  def replace_at(tree, path, fn):
    if not path:
      return fn(tree)
    if not hasattr(tree, "keys") or path[0] not in tree:
      return tree
    out = dict(tree)
    out[path[0]] = replace_at(tree[path[0]], path[1:], fn)
    return out

  for path, declared in fusions.items():
    before = at(cast_from, path) if cast_from is not None else None
    for fusion in declared:
      params = replace_at(params, path, functools.partial(
          fuse, fusion=fusion, before=before))
  return params
