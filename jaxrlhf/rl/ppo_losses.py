"""PPO for language models: rollout post-processing and the clipped losses.

Follows Stiennon et al. 2020 as reproduced in "The N+ implementation details
of RLHF with PPO" (details 20-25, Table 7) and the RLHF book, 11.2.2.

Token-level arrays are [batch, length] over response tokens with a response
mask; `old_*` arrays are from the rollout (the policy that sampled), the
others from the network being updated. All reductions are masked means over
the tokens of the batch.
"""

import jax
import jax.numpy as jnp

from jaxrlhf.losses import common
from jaxrlhf import checks
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import reductions


def ppo_rollout_targets(scores, logprobs, ref_logprobs, values, mask, kl_coef,
                        gamma=1.0, lam=0.95, kl_estimator="k1",
                        whiten_rewards=False, whiten_advantages=True):
  """Per-token rewards, advantages and returns of a rollout batch.

  The order is lm-human-preferences': per-token rewards (KL penalty plus the
  score at the last token), optional reward whitening (detail 24), GAE, then
  advantage whitening (detail 25). Returns are computed from the unwhitened
  advantages, so the value function fits the actual returns.

  Args:
    scores: [batch] sequence scores (EOS-penalised already, detail 23).
    logprobs: [batch, length] log pi_old of the sampled tokens.
    ref_logprobs: [batch, length] log pi_ref of the same tokens.
    values: [batch, length] V(s_t) at rollout time.
    mask: [batch, length] response mask.
    kl_coef: scalar beta.
    gamma, lam: GAE parameters (Table 7: 1.0, 0.95).
    kl_estimator: estimator of the per-token KL penalty.
    whiten_rewards: detail 24 (optional; default off).
    whiten_advantages: detail 25 (helpful; default on).

  Returns:
    dict with [batch, length] "rewards", "kl", "advantages", "returns"; all
    zero outside the mask.
  """
  rewards, kl = kl_lib.per_token_rewards(scores, logprobs, ref_logprobs, mask,
                                         kl_coef, kl_estimator)
  if whiten_rewards:
    rewards = advantages_lib.whiten_rewards(rewards, mask)
  advantages, returns = advantages_lib.generalized_advantage_estimation(
      rewards, values, mask, gamma, lam)
  if whiten_advantages:
    advantages = advantages_lib.whiten_advantages(advantages, mask)
  return dict(rewards=rewards, kl=kl, advantages=advantages, returns=returns)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low=0.2,
                      clip_eps_high=None):
  """Per-token negated PPO-clip objective.

  loss_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high)) with
  rho_t = pi / pi_old (book 11.2.2). Taking the max of the two losses is the
  pessimistic bound: once rho has moved past the clip edge in the direction
  the advantage favours, the clipped term wins and the gradient is zero.
  eps_high > eps_low is DAPO's "clip-higher" (Yu et al. 2025).

  Args:
    logprobs: [batch, length] log pi of the sampled tokens (differentiated).
    old_logprobs: [batch, length] log pi_old of the same tokens (constants).
    advantages: [batch, length], or [batch] for one advantage per response.
    clip_eps_low: eps below 1.
    clip_eps_high: eps above 1; None means equal to `clip_eps_low`.

  Returns:
    per_token_loss: [batch, length].
    clipped: [batch, length] bool, where the clipped term is the larger loss
      (its gradient is then zero): the clip fraction's numerator.
  """
  checks.check_same_shape("clipped_surrogate", logprobs=logprobs,
                           old_logprobs=old_logprobs)
  if clip_eps_high is None:
    clip_eps_high = clip_eps_low
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  advantages = jax.lax.stop_gradient(advantages)
  ratio = jnp.exp(logprobs - jax.lax.stop_gradient(old_logprobs))
  unclipped_loss = -advantages * ratio
  clipped_loss = -advantages * jnp.clip(ratio, 1.0 - clip_eps_low,
                                        1.0 + clip_eps_high)
  return (jnp.maximum(unclipped_loss, clipped_loss),
          clipped_loss > unclipped_loss)


def policy_drift_metrics(logprobs, old_logprobs, mask):
  """Approximate KL(pi_old || pi) on the rollout tokens (sampled from pi_old).

  Args:
    logprobs, old_logprobs, mask: [batch, length].

  Returns:
    dict with scalar "approx_kl_k1", "approx_kl_k3" (masked token means) and
    "ratio_mean".
  """
  logprobs = jax.lax.stop_gradient(logprobs)
  mask = mask.astype(logprobs.dtype)
  # Samples come from pi_old, so pi_old is the sampling policy in kl_estimate.
  return dict(
      approx_kl_k1=common.masked_mean(
          kl_lib.kl_estimate(old_logprobs, logprobs, "k1"), mask),
      approx_kl_k3=common.masked_mean(
          kl_lib.kl_estimate(old_logprobs, logprobs, "k3"), mask),
      ratio_mean=common.masked_mean(jnp.exp(logprobs - old_logprobs), mask))


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2):
  """PPO clipped policy loss, masked mean over tokens (Table 7: eps = 0.2).

  Args:
    logprobs: [batch, length] log pi (differentiated).
    old_logprobs: [batch, length] log pi_old from the rollout.
    advantages: [batch, length] (whitened) advantages.
    mask: [batch, length] response mask.
    clip_eps: policy clipping coefficient.

  Returns:
    (scalar loss, metrics dict with "policy_loss", "clip_fraction",
    "approx_kl_k1", "approx_kl_k3", "ratio_mean").
  """
  checks.check_same_shape("ppo_policy_loss", logprobs=logprobs,
                           old_logprobs=old_logprobs, advantages=advantages,
                           mask=mask)
  per_token_loss, clipped = clipped_surrogate(logprobs, old_logprobs,
                                              advantages, clip_eps)
  fmask = mask.astype(per_token_loss.dtype)
  loss = reductions.reduce_token_losses(per_token_loss, fmask, "token_mean")
  metrics = dict(policy_loss=loss,
                 clip_fraction=common.masked_mean(
                     clipped.astype(fmask.dtype), fmask))
  metrics.update(policy_drift_metrics(logprobs, old_logprobs, fmask))
  return loss, metrics


def ppo_value_loss(values, old_values, returns, mask, clip_eps=0.2):
  """Clipped value loss: 1/2 max((V - R)^2, (V_clip - R)^2), masked mean.

  V_clip = V_old + clip(V - V_old, -eps, eps) (Table 7: value clipping on,
  eps = 0.2). As with the policy, the max makes the loss pessimistic: a value
  that moved more than eps from V_old gets no gradient when moving it back
  would not reduce the clipped error.

  Args:
    values: [batch, length] V from the network being updated.
    old_values: [batch, length] V at rollout time.
    returns: [batch, length] targets from GAE.
    mask: [batch, length] response mask.
    clip_eps: value clipping coefficient; None turns clipping off.

  Returns:
    (scalar loss, metrics with "value_loss", "value_clip_fraction",
    "value_error" (masked mean squared error of V), "explained_variance").
  """
  checks.check_same_shape("ppo_value_loss", values=values,
                           old_values=old_values, returns=returns, mask=mask)
  fmask = mask.astype(values.dtype)
  returns = jax.lax.stop_gradient(returns)
  old_values = jax.lax.stop_gradient(old_values)
  unclipped = jnp.square(values - returns)
  if clip_eps is None:
    per_token, clipped = unclipped, jnp.zeros_like(unclipped, dtype=bool)
  else:
    clipped_values = old_values + jnp.clip(values - old_values, -clip_eps,
                                           clip_eps)
    clipped_error = jnp.square(clipped_values - returns)
    per_token = jnp.maximum(unclipped, clipped_error)
    clipped = clipped_error > unclipped
  loss = 0.5 * common.masked_mean(per_token, fmask)
  metrics = dict(
      value_loss=loss,
      value_clip_fraction=common.masked_mean(clipped.astype(fmask.dtype),
                                             fmask),
      value_error=common.masked_mean(jax.lax.stop_gradient(unclipped), fmask),
      explained_variance=explained_variance(values, returns, fmask))
  return loss, metrics


def explained_variance(values, returns, mask):
  """1 - Var[R - V] / Var[R] over masked tokens; 1 is perfect, <= 0 useless.

  Args:
    values, returns, mask: [batch, length].

  Returns:
    Scalar (0 when the returns have no variance).
  """
  values = jax.lax.stop_gradient(values)
  returns = jax.lax.stop_gradient(returns)
  mask = mask.astype(values.dtype)
  var_returns = common.masked_var(returns, mask)
  var_residual = common.masked_var(returns - values, mask)
  return jnp.where(var_returns > 0,
                   1.0 - var_residual / jnp.where(var_returns > 0,
                                                  var_returns, 1.0),
                   0.0)


def ppo_loss(logprobs, old_logprobs, advantages, values, old_values, returns,
             mask, clip_eps=0.2, value_clip_eps=0.2, vf_coef=0.1,
             entropy=None, entropy_coef=0.0):
  """PPO's total loss: policy + c1 * value - c2 * entropy (Table 7: c1 = 0.1).

  Args:
    logprobs, old_logprobs, advantages, mask: as in `ppo_policy_loss`.
    values, old_values, returns: as in `ppo_value_loss`.
    clip_eps: policy clipping coefficient.
    value_clip_eps: value clipping coefficient (None: no value clipping).
    vf_coef: value-loss weight c1.
    entropy: optional [batch, length] entropies
      (`jaxrlhf.models.scoring.entropy_from_logits`); logged, and rewarded
      when `entropy_coef` > 0.
    entropy_coef: entropy bonus weight (0 in the paper).

  Returns:
    (scalar loss, metrics dict of scalars).
  """
  policy_loss, metrics = ppo_policy_loss(logprobs, old_logprobs, advantages,
                                         mask, clip_eps)
  value_loss, value_metrics = ppo_value_loss(values, old_values, returns, mask,
                                             value_clip_eps)
  metrics.update(value_metrics)
  loss = policy_loss + vf_coef * value_loss
  if entropy is not None:
    checks.check_same_shape("ppo_loss", entropy=entropy, mask=mask)
    mean_entropy = common.masked_mean(entropy, mask.astype(entropy.dtype))
    loss = loss - entropy_coef * mean_entropy
    metrics["entropy"] = jax.lax.stop_gradient(mean_entropy)
  metrics["loss"] = loss
  return loss, metrics
