"""Building blocks every recipe's train step shares."""

import jax
import jax.numpy as jnp
import optax


def split_microbatches(batch, num_microbatches: int):
  """[batch, ...] -> [num_microbatches, batch / num_microbatches, ...].

  Micro-batch m takes rows m, m + M, m + 2M, ...: each device's rows of the
  data-sharded batch feed every micro-batch, so no rows move between devices.
  """
  def split(x):
    x = x.reshape((x.shape[0] // num_microbatches, num_microbatches)
                  + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def accumulate_gradients(loss_fn, params, batch, rng, num_microbatches: int):
  """Sum of `loss_fn` values, gradients and metrics over micro-batches.

  `loss_fn(params, microbatch, rng) -> (loss, metrics)` must already be
  normalised by the whole batch, so that the sum equals the full-batch loss.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_microbatches == 1:
    (loss, metrics), grads = grad_fn(params, batch, rng)
    return loss, metrics, grads
  micro = split_microbatches(batch, num_microbatches)
  rngs = jax.random.split(rng, num_microbatches)

  def body(carry, xs):
    mb, mb_rng = xs
    (loss, metrics), grads = grad_fn(params, mb, mb_rng)
    return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

  zero_metrics = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(
      lambda x: x[0], micro), rngs[0])[0][1])
  init = (jnp.zeros((), jnp.float32),
          jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_metrics),
          jax.tree.map(jnp.zeros_like, params))
  (loss, metrics, grads), _ = jax.lax.scan(body, init, (micro, rngs))
  return loss, metrics, grads


def guarded_update(state, grads, loss, tx, extra_metrics):
  """Applies the optimizer unless the loss or gradient is non-finite.

  A non-finite step leaves params and optimizer state untouched and reports
  `nonfinite` = 1; the loop stops the run there without saving.
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(finite, n, o), new, old)
  metrics = {"loss": loss, "grad_norm": grad_norm,
             "nonfinite": 1.0 - finite.astype(jnp.float32), **extra_metrics}
  return (keep(new_params, state.params), keep(new_opt_state, state.opt_state),
          metrics)
