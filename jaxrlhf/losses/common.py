"""Masked reductions shared by every loss.

All functions take a `mask` of the same shape as `x` (1 = counts, 0 = padding),
in any numeric dtype, and never let padded entries change the result.
"""

import jax.numpy as jnp


def masked_sum(x, mask, axis=None):
  """Sum of `x` over the entries where `mask` is set."""
  return jnp.sum(x * mask, axis=axis)


def masked_mean(x, mask, axis=None):
  """sum(mask * x) / sum(mask): the mean over the entries where `mask` is set
  (0 where none is). Fractional masks act as weights and are exact."""
  total = jnp.sum(mask, axis=axis)
  return masked_sum(x, mask, axis) / jnp.where(total > 0, total, 1.0)


def masked_var(x, mask, unbiased=True):
  """Variance of `x` over the masked entries (Bessel-corrected by default)."""
  mean = masked_mean(x, mask)
  count = jnp.sum(mask)
  var = masked_sum(jnp.square(x - mean), mask) / jnp.maximum(count, 1)
  if unbiased:
    var = var * count / jnp.maximum(count - 1, 1)
  return var


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
  """(x - mean) / std over masked entries; keeps the mean when not shift_mean.

  `shift_mean=False` is the reward whitening of the PPO implementation-details
  paper (detail 24): scale by the std but add the mean back. The variance is
  the biased (population) one, as in that paper's `whiten`.
  """
  mean = masked_mean(x, mask)
  var = masked_var(x, mask, unbiased=False)
  whitened = (x - mean) * jnp.reciprocal(jnp.sqrt(var + eps))
  if not shift_mean:
    whitened = whitened + mean
  return whitened * mask


def sequence_logprob(token_logprobs, mask):
  """Log-probability of whole sequences.

  Args:
    token_logprobs: [batch, length] log p(token_t | prefix).
    mask: [batch, length], 1 on completion tokens.
  Returns:
    [batch] sum of the masked per-token log-probs.
  """
  return masked_sum(token_logprobs, mask, axis=-1)


def win_indicator(a, b):
  """1 where a > b, 0 where a < b, 1/2 for ties, so that an untrained model
  (all scores equal) reports the chance accuracy 0.5."""
  return jnp.where(a > b, 1.0, jnp.where(a < b, 0.0, 0.5))
