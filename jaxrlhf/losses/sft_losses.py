"""Token cross-entropy for supervised fine-tuning."""

import jax
import jax.numpy as jnp


def cross_entropy_loss(logits, targets, weights, z_loss=0.0):
  """Weighted mean token cross-entropy, with t5x's optional z-loss.

  The z-loss z_loss * (log Z)^2 keeps the softmax normaliser near 1 so bf16
  logits stay in range (Mesh TensorFlow / t5x practice).

  Args:
    logits: [batch, length, vocab].
    targets: [batch, length] int token ids.
    weights: [batch, length] loss weights (0 on padding).
    z_loss: coefficient of the z-loss term.
  Returns:
    (loss, metrics): loss is the weighted mean over tokens; metrics hold
    the token-summed numerators and the weight sum so that means over
    micro-batches and devices can be formed exactly.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = jnp.argmax(logits, axis=-1) == targets
  return cross_entropy_from_stats(log_z, target_logits, correct, weights,
                                  z_loss)


def cross_entropy_from_stats(log_z, target_logits, correct, weights,
                             z_loss=0.0):
  """`cross_entropy_loss` from what it reads of the logits, per token: a
  model's output layer and this loss can then be computed a chunk of
  positions at a time (`jaxrlhf.models.scoring.hidden_token_stats`),
  without the [batch, length, vocab] logits.

  Args:
    log_z: [batch, length] logsumexp of each position's logits.
    target_logits: [batch, length] the target's logit.
    correct: [batch, length] bool, the target is the argmax.
    weights: [batch, length] loss weights (0 on padding).
    z_loss: coefficient of the z-loss term.
  Returns:
    (loss, metrics) as `cross_entropy_loss`.
  """
  weights = weights.astype(jnp.float32)
  nll = log_z - target_logits
  total = nll + z_loss * jnp.square(log_z)
  denom = jnp.maximum(jnp.sum(weights), 1.0)
  correct = correct.astype(jnp.float32)
  metrics = {
      "nll_sum": jnp.sum(nll * weights),
      "correct_sum": jnp.sum(correct * weights),
      "weight_sum": jnp.sum(weights),
  }
  return jnp.sum(total * weights) / denom, metrics
