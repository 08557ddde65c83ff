"""How per-token losses become one scalar.

The choice changes how much each token of a ragged batch weighs:
  "sequence_mean"   mean over each response's tokens, then over responses
                    (GRPO as in DeepSeekMath; the RLHF book's 11.2.3 code).
                    A token of a short response weighs more than one of a
                    long response.
  "token_mean"      sum over all response tokens of the batch / their count
                    (PPO's masked mean; DAPO's token-level loss). Every token
                    weighs the same.
  "constant_length" sum over all response tokens / (batch * max_length)
                    (Dr. GRPO, Liu et al. 2025): a fixed normaliser, so
                    neither response length nor batch composition rescales
                    a token's gradient.
  "sequence_sum"    sum over each response's tokens, mean over responses:
                    the response is one action with log pi(y|x) = sum_t
                    log pi(y_t|...), as in REINFORCE/RLOO (book 11.1.3).
"""

import jax
import jax.numpy as jnp

from jaxrlhf.losses import common
from jaxrlhf import checks

LOSS_REDUCTIONS = ("sequence_mean", "token_mean", "constant_length",
                   "sequence_sum")


def reduce_token_losses(per_token_loss, mask, reduction="token_mean",
                        max_length=None):
  """Reduces [batch, length] per-token losses to a scalar.

  Args:
    per_token_loss: [batch, length].
    mask: [batch, length] response mask.
    reduction: one of LOSS_REDUCTIONS (see the module docstring).
    max_length: the constant of "constant_length"; defaults to `length`
      (the generation budget when responses are sampled to a fixed length).

  Returns:
    Scalar loss.
  """
  checks.check_choice("reduce_token_losses", "reduction", reduction,
                       LOSS_REDUCTIONS)
  checks.check_same_shape("reduce_token_losses",
                           per_token_loss=per_token_loss, mask=mask)
  checks.check_rank("reduce_token_losses", "per_token_loss", per_token_loss,
                     2)
  mask = mask.astype(per_token_loss.dtype)
  if reduction == "token_mean":
    return common.masked_mean(per_token_loss, mask)
  if reduction == "sequence_mean":
    return jnp.mean(common.masked_mean(per_token_loss, mask, axis=-1))
  if reduction == "sequence_sum":
    return jnp.mean(common.masked_sum(per_token_loss, mask, axis=-1))
  if max_length is None:
    max_length = per_token_loss.shape[-1]
  if max_length <= 0:
    raise ValueError(
        f"reduce_token_losses: max_length={max_length} must be positive.")
  return common.masked_sum(per_token_loss, mask) / (
      per_token_loss.shape[0] * max_length)


def response_token_count(minibatch) -> jax.Array:
  """Response tokens of a (micro-)batch: what a token-mean loss averages
  over (its share of an update with micro-batches)."""
  return jnp.sum(minibatch["response_mask"].astype(jnp.float32))


def response_count(minibatch) -> jax.Array:
  """Responses of a (micro-)batch: what a per-response loss averages."""
  return jnp.asarray(minibatch["response_mask"].shape[0], jnp.float32)
