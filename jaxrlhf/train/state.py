"""The train state pytree and its sharded initialisation."""

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import optax

from jaxrlhf import sharding


@flax.struct.dataclass
class TrainState:
  """Everything a step changes. `params` and `opt_state` may hold several
  networks (e.g. {"policy": ..., "value": ...})."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array  # raw uint32[2] PRNG key


def state_shardings(abstract_boxed_params, abstract_state, tx, mesh, rules):
  """NamedShardings for a TrainState.

  Parameters follow their logical axis names. Optimizer-state leaves shaped
  like their parameter (Adam moments, unfactored Adafactor moments) share its
  sharding; other leaves (factored Adafactor rows/columns, counts) are
  replicated, as they are small.
  """
  param_shardings = sharding.tree_shardings(abstract_boxed_params, mesh, rules)
  replicated = sharding.replicated(mesh)
  opt_shardings = optax.tree_map_params(
      tx,
      lambda leaf, s, p: s if getattr(leaf, "shape", None) == p.shape else replicated,
      abstract_state.opt_state, param_shardings, abstract_state.params,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
  return TrainState(step=replicated, params=param_shardings,
                    opt_state=opt_shardings, rng=replicated)


def make_sharded_init(init_params: Callable, tx, mesh, rules):
  """A jitted `rng -> TrainState` whose outputs are born sharded.

  Args:
    init_params: rng -> params, possibly boxed with logical axis names.
  Returns:
    (init_fn, shardings, abstract_state): parameters are created directly in
    their shardings on the devices; no full copy is ever made on one host.
  """
  def init_state(rng):
    params_rng, state_rng = jax.random.split(rng)
    params = nn.unbox(init_params(params_rng))
    return TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                      opt_state=tx.init(params), rng=state_rng)

  rng = jax.random.PRNGKey(0)
  abstract_boxed = jax.eval_shape(init_params, rng)
  abstract_state = jax.eval_shape(init_state, rng)
  shardings = state_shardings(abstract_boxed, abstract_state, tx, mesh, rules)
  return jax.jit(init_state, out_shardings=shardings), shardings, abstract_state
