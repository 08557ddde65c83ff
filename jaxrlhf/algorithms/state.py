"""The train state pytree and its sharded initialisation."""

from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import sharding


@flax.struct.dataclass
class TrainState:
  """Everything a run needs to continue.

  `params` holds the trained networks by name ({"policy": ..., "value": ...})
  and `opt_state` their optimizer states; `frozen` holds networks the step
  reads but never updates (a reference policy, a reward model);
  `algorithm_state` holds small values an algorithm carries from step to
  step ({"kl_coef": ...} of an adaptive KL controller, REINFORCE's running
  baseline; {} for most).
  """
  step: jax.Array
  params: Any
  opt_state: Any
  frozen: Any
  rng: jax.Array  # raw uint32[2] PRNG key
  algorithm_state: Any


def _dict_keys(path):
  return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def state_shardings(abstract_boxed, abstract_state, mesh, rules):
  """NamedShardings for a TrainState.

  Parameters follow their logical axis names. An optimizer-state leaf whose
  dict-key path ends with a parameter's path and that has the parameter's
  shape (Adam moments, unfactored Adafactor moments) shares its sharding,
  whatever optimizer wrappers sit above it; other leaves (factored Adafactor
  rows/columns, counts) are small and replicated, as are the step, the RNG
  and the algorithm's scalars.
  """
  boxed_params, boxed_frozen = abstract_boxed
  param_shardings = sharding.tree_shardings(boxed_params, mesh, rules)
  replicated = sharding.replicated(mesh)
  by_path = {
      _dict_keys(path): (leaf.shape, s)
      for (path, leaf), s in zip(
          jax.tree_util.tree_flatten_with_path(abstract_state.params)[0],
          jax.tree.leaves(param_shardings))}

  def opt_sharding(path, leaf):
    keys = _dict_keys(path)
    for start in range(len(keys)):
      match = by_path.get(keys[start:])
      if match is not None:
        return match[1] if match[0] == leaf.shape else replicated
    return replicated

  opt_shardings = jax.tree_util.tree_map_with_path(opt_sharding,
                                                   abstract_state.opt_state)
  return TrainState(
      step=replicated, params=param_shardings, opt_state=opt_shardings,
      frozen=sharding.tree_shardings(boxed_frozen, mesh, rules),
      rng=replicated,
      algorithm_state=jax.tree.map(lambda _: replicated,
                                   abstract_state.algorithm_state))


def _with_subtree(tree, keys, value):
  """`tree` (nested dicts) with the node at `keys` replaced by `value`."""
  if not keys:
    return value
  out = dict(tree)
  out[keys[0]] = _with_subtree(tree[keys[0]], keys[1:], value)
  return out


def make_sharded_init(init_params: Callable, tx, mesh, rules,
                      algorithm_state: Mapping[str, float] = None):
  """A jitted `(rng, loaded=None) -> TrainState` whose outputs are born
  sharded.

  Args:
    init_params: rng -> (trainable params, frozen params), possibly boxed
      with logical axis names.
    algorithm_state: {name: initial float32 scalar} the algorithm carries.
  Returns:
    (init_fn, shardings, abstract_state): parameters are created directly in
    their shardings on the devices; no full copy is ever made on one host.
    `loaded` maps targets ("params/policy", "frozen/reward",
    "params/value/encoder", ...) to trees already loaded from checkpoints
    (sharded as the state's): they take those places, their random
    initialisation is never computed (XLA removes it as dead code; the other
    networks' values do not change), their buffers are donated to the state,
    and the optimizer state is initialised from the final parameters.
  """
  initial = {k: np.float32(v) for k, v in (algorithm_state or {}).items()}

  def assemble(params, frozen, state_rng):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(params), frozen=frozen, rng=state_rng,
                      algorithm_state={k: jnp.asarray(v)
                                       for k, v in initial.items()})

  def init_state(rng, loaded=None):
    params_rng, state_rng = jax.random.split(rng)
    params, frozen = nn.unbox(init_params(params_rng))
    groups = {"params": params, "frozen": frozen}
    for target, tree in (loaded or {}).items():
      group, *keys = target.split("/")
      groups[group] = _with_subtree(groups[group], keys, tree)
    return assemble(groups["params"], groups["frozen"], state_rng)

  # Abstract: nothing runs (the mesh may be a topology without devices here).
  # The networks are traced once: the state's shapes follow from theirs.
  rng = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  abstract_boxed = jax.eval_shape(init_params, rng)
  abstract_state = jax.eval_shape(
      lambda boxed, rng: assemble(*nn.unbox(boxed), jax.random.split(rng)[1]),
      abstract_boxed, rng)
  shardings = state_shardings(abstract_boxed, abstract_state, mesh, rules)
  return (jax.jit(init_state, out_shardings=shardings,
                  donate_argnames="loaded"),
          shardings, abstract_state)


def subtree(tree, target: str):
  """The node of a TrainState-like tree at `target` ("params/policy",
  "frozen/reward", "params/value/encoder")."""
  group, *keys = target.split("/")
  node = getattr(tree, group)
  for key in keys:
    node = node[key]
  return node


def abstract_with_shardings(abstract_tree, shardings):
  """ShapeDtypeStructs carrying the given shardings (for restore)."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_tree, shardings)
