"""The one gradient update every algorithm's train step is made of.

`gradient_update` takes a loss function and a batch and does everything
between them and new parameters: micro-batching (gradient accumulation),
the optimizer (whose chain clips the global gradient norm, see
`optimizers`), and the non-finite guard. An offline train step is one
`gradient_update`; an online step scans it over the minibatches of its
rollouts (`jaxrlhf.algorithms.online.recipe`). How each micro-batch's loss is
weighted is part of an algorithm's loss: `loss_fn` returns each
micro-batch's share of the whole batch's loss (`mean_over_examples` and
`weighted_share` build the usual two), so the shares sum to the loss of the
whole batch.

The router of a mixture-of-experts model is trained here too, for every
algorithm: each micro-batch's loss gets router_aux_loss_coef x the
load-balancing loss of the forward passes its trained networks made, and
the metrics their `moe/...` load (`with_router_loss`). A dense model's step
is the loss alone, unchanged.

`check_split` is the one check that a batch splits evenly into micro-batches
and over the data-parallel devices.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxrlhf.models import moe_decoder


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


def accumulate_gradients(loss_fn, params, batch, rng, num_microbatches: int,
                         accumulator_shardings=None):
  """Sum of `loss_fn` values, gradients and metrics over micro-batches.

  `loss_fn(params, microbatch, rng) -> (loss, metrics)` must already be
  normalised by the whole batch, so that the sum equals the full-batch loss.
  `accumulator_shardings` (e.g. `sharding.spread_over_batch_axes` of the
  parameters') places the running sum of gradients: split over the
  data-parallel devices as well, it costs a fraction of one gradient, so
  that memory falls as micro-batches rise instead of growing by a full
  float32 copy of the gradients.
  """
  grad_fn = jax.value_and_grad(with_router_loss(loss_fn, num_microbatches),
                               has_aux=True)
  if num_microbatches == 1:
    (loss, metrics), grads = grad_fn(params, batch, rng)
    return loss, metrics, grads
  micro = split_microbatches(batch, num_microbatches)
  rngs = jax.random.split(rng, num_microbatches)
  place = ((lambda g: g) if accumulator_shardings is None else
           (lambda g: jax.lax.with_sharding_constraint(
               g, accumulator_shardings)))

  def body(carry, xs):
    mb, mb_rng = xs
    (loss, metrics), grads = grad_fn(params, mb, mb_rng)
    loss_sum, metrics_sum, grads_sum = carry
    return (loss_sum + loss, jax.tree.map(jnp.add, metrics_sum, metrics),
            place(jax.tree.map(jnp.add, grads_sum, place(grads)))), None

  zero_metrics = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(
      lambda x: x[0], micro), rngs[0])[0][1])
  init = (jnp.zeros((), jnp.float32),
          jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_metrics),
          place(jax.tree.map(jnp.zeros_like, params)))
  (loss, metrics, grads), _ = jax.lax.scan(body, init, (micro, rngs))
  return loss, metrics, grads


def with_router_loss(loss_fn: Callable, num_microbatches: int) -> Callable:
  """`loss_fn` with the routers' load-balancing loss of the mixture-of-experts
  forward passes it makes with the trained `params`
  (`moe_decoder.recording`): their mean coef x aux over M micro-batches
  (each micro-batch's divided by M) added to the loss, and the
  `moe_decoder.router_loss` metrics (means over the micro-batches) to the
  metrics. Where no such pass is made (a dense model; only frozen networks
  with experts) it returns what `loss_fn` returns, and traces to the same
  computation."""
  def loss_with_router(params, microbatch, rng):
    with moe_decoder.recording(params) as records:
      loss, metrics = loss_fn(params, microbatch, rng)
    if not records:
      return loss, metrics
    term, router_metrics = moe_decoder.router_loss(records)
    metrics = dict(metrics)
    metrics.update({k: v / num_microbatches
                    for k, v in router_metrics.items()})
    return loss + term / num_microbatches, metrics
  return loss_with_router


def guarded_update(params, opt_state, grads, loss, tx, extra_metrics):
  """Applies the optimizer unless the loss or gradient is non-finite.

  A non-finite step leaves params and optimizer state untouched and reports
  `nonfinite` = 1; the loop stops the run there without saving.

  Returns:
    (params, opt_state, metrics with "loss", "grad_norm", "nonfinite").
  """
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(finite, n, o), new, old)
  metrics = {"loss": loss, "grad_norm": grad_norm,
             "nonfinite": 1.0 - finite.astype(jnp.float32), **extra_metrics}
  return keep(new_params, params), keep(new_opt_state, opt_state), metrics


def gradient_update(tx, params, opt_state, batch, rng, loss_fn: Callable,
                    num_microbatches: int, accumulator_shardings=None):
  """One guarded optimizer update from the gradient of `loss_fn` on `batch`.

  Args:
    tx: the optax transformation (clipping included).
    params, opt_state: the trained networks and their optimizer state.
    batch: {name: [rows, ...]}.
    rng: the key micro-batch m's loss gets (split M ways).
    loss_fn: (params, microbatch, rng) -> (share of the batch loss,
      {metric: share}); see the module docstring.
    num_microbatches: M; the rows must split into M equal parts.
    accumulator_shardings: where the sum of M > 1 micro-batch gradients
      lives (`accumulate_gradients`); None lets XLA choose.
  Returns:
    (params, opt_state, metrics): the summed metric shares plus "loss",
    "grad_norm" and "nonfinite".
  """
  loss, metrics, grads = accumulate_gradients(loss_fn, params, batch, rng,
                                              num_microbatches,
                                              accumulator_shardings)
  return guarded_update(params, opt_state, grads, loss, tx, metrics)


def mean_over_examples(loss_fn: Callable, num_microbatches: int) -> Callable:
  """Micro-batch shares of a loss that is a mean over a batch's examples:
  each of the M equal micro-batches contributes 1/M of its loss and
  metrics."""
  def share(params, microbatch, rng):
    loss, metrics = loss_fn(params, microbatch, rng)
    return (loss / num_microbatches,
            jax.tree.map(lambda m: m / num_microbatches, metrics))
  return share


def weighted_share(loss_fn: Callable, count_fn: Callable, batch,
                   num_microbatches: int) -> Callable:
  """Micro-batch shares of a loss that is a mean over what `count_fn`
  counts (e.g. response tokens): micro-batch m contributes its loss times
  count(m) / count(batch), so micro-batches holding different numbers of
  tokens add up to the whole batch's mean. With one micro-batch the loss is
  used as it is."""
  if num_microbatches == 1:
    return loss_fn
  total = count_fn(batch)

  def share(params, microbatch, rng):
    loss, metrics = loss_fn(params, microbatch, rng)
    weight = count_fn(microbatch) / jnp.where(total > 0, total, 1.0)
    return loss * weight, jax.tree.map(lambda m: m * weight, metrics)
  return share


def check_split(rows: int, num_microbatches: int, data_parallel: int, *,
                what: str, field: str) -> None:
  """Each gradient's rows must split into the micro-batches, and each
  micro-batch's rows evenly over the data-parallel devices.

  Uneven data shards are not only slower: on a mesh with a model axis,
  XLA's partitioned backward pass gave NaN gradients for them (so every
  update was skipped as non-finite) while the loss itself was right.

  Args:
    rows: the rows one optimizer update is computed from.
    what: those rows, for the message (e.g. "train.batch_size 32").
    field: the config field(s) that set `rows`, for the second message.
  """
  if rows % num_microbatches:
    raise ValueError(
        f"config.train.num_microbatches: {num_microbatches} does not divide "
        f"{what} (rows per update); use a divisor of {rows}.")
  per_micro = rows // num_microbatches
  if per_micro % data_parallel:
    raise ValueError(
        f"config.{field}: each gradient is taken over {per_micro} rows "
        f"({what} / train.num_microbatches {num_microbatches}), which cannot "
        f"be split evenly over {data_parallel} data-parallel shards; make it "
        f"a multiple of {data_parallel}.")
