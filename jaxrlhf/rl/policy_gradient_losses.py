"""The clipped policy-gradient loss of the critic-free algorithms.

RLOO, REINFORCE and GRPO (RLHF book 11.1 and 11.2.3) train on one advantage
per response (`advantages`) with PPO's clipped surrogate, and GRPO
(DeepSeekMath, Shao et al. 2024) adds the KL to the reference as a term of
the loss, estimated per token with k3, instead of a penalty in the reward:
  loss_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))
           + beta * k3_t,   k3_t = pi_ref/pi - log(pi_ref/pi) - 1.
With one update per rollout the ratio rho is 1 and the gradient is the
plain policy gradient -A grad log pi.

The 2025 variants are arguments:
  DAPO        asymmetric clipping (eps_high > eps_low, "clip-higher") and
              the token-level mean (`reductions`);
  Dr. GRPO    the constant-length normaliser (with
              `advantages.grpo_advantages(scale_by_std=False)`);
  GSPO        (Zheng et al. 2025) `ratio_level="sequence"`: one importance
              ratio per response, the geometric mean of its token ratios
              s = exp(mean_t log(pi / pi_old)), clipped per response (its
              paper's eps are ~3e-4 / 4e-4), every token of the response
              weighted by it;
  CISPO       (MiniMax-M1, 2025) `objective="cispo"`: a REINFORCE token loss
              -sg(min(rho_t, eps_max)) A log pi_t whose importance weight is
              clipped and stopped instead of the update, so no token's
              gradient is dropped (TRL's loss_type "cispo": the weight's cap
              is epsilon_high itself, e.g. 5).
"""

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import ppo_losses
from jaxrlhf.rl import reductions

RATIO_LEVELS = ("token", "sequence")
OBJECTIVES = ("clipped", "cispo")


def importance_log_ratios(logprobs, old_logprobs, mask, level="token"):
  """log(pi / pi_old) of each token ("token"), or each response's mean over
  its tokens, the log of GSPO's sequence ratio, at every token of it
  ("sequence"). [batch, length]."""
  checks.check_choice("importance_log_ratios", "level", level, RATIO_LEVELS)
  log_ratio = logprobs - jax.lax.stop_gradient(old_logprobs)
  if level == "token":
    return log_ratio
  mask = mask.astype(log_ratio.dtype)
  per_response = (jnp.sum(log_ratio * mask, axis=-1)
                  / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))
  return jnp.broadcast_to(per_response[:, None], log_ratio.shape)


def clipped_policy_gradient_loss(logprobs, old_logprobs, ref_logprobs,
                                 advantages, mask, clip_eps_low=0.2,
                                 clip_eps_high=0.2, kl_coef=0.0,
                                 reduction="sequence_mean", max_length=None,
                                 ratio_level="token", objective="clipped"):
  """The clipped surrogate on per-response advantages, with an optional k3
  KL term in the loss (GRPO), and the variants of the module docstring.

  Args:
    logprobs: [batch, length] log pi of the sampled tokens (differentiated).
    old_logprobs: [batch, length] log pi_old (the sampling policy).
    ref_logprobs: [batch, length] log pi_ref, or None: no KL term (the
      reference did not score the samples) and no "loss_kl_k3" metric.
    advantages: [batch] one advantage per response, or [batch, length].
    mask: [batch, length] response mask.
    clip_eps_low, clip_eps_high: clip range [1 - low, 1 + high] of the
      ratio; with objective "cispo", clip_eps_high is the importance
      weight's cap itself and clip_eps_low is not used.
    kl_coef: beta of the k3 KL term in the loss (GRPO; DeepSeekMath uses
      0.04); 0 (RLOO, REINFORCE: their KL is in the reward) drops it.
    reduction: "sequence_mean" (GRPO), "token_mean" (DAPO),
      "constant_length" (Dr. GRPO) or "sequence_sum"; see `reductions`.
    max_length: the constant of "constant_length" (default: length).
    ratio_level: "token" (PPO, GRPO) or "sequence" (GSPO).
    objective: "clipped" (PPO-clip) or "cispo".

  Returns:
    (scalar loss, metrics dict with "loss", "policy_loss", "loss_kl_k3"
    (masked token mean of k3 against the reference, when there is one),
    "clip_fraction" (the tokens whose update the clip stops; for CISPO,
    whose weight it caps), "approx_kl_k1", "approx_kl_k3", "ratio_mean").
  """
  where = "clipped_policy_gradient_loss"
  checks.check_same_shape(where, logprobs=logprobs, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, mask=mask)
  checks.check_choice(where, "objective", objective, OBJECTIVES)
  checks.check_choice(where, "ratio_level", ratio_level, RATIO_LEVELS)
  if advantages.shape not in (mask.shape, mask.shape[:1]):
    raise ValueError(
        f"{where}: advantages has shape {list(advantages.shape)}; expected "
        f"[batch] = [{mask.shape[0]}] or [batch, length] = {list(mask.shape)}.")
  fmask = mask.astype(logprobs.dtype)
  if ratio_level == "token":
    ratio_logprobs = logprobs
  else:  # log pi_old + GSPO's log ratio: the surrogate of that ratio
    ratio_logprobs = jax.lax.stop_gradient(old_logprobs) + (
        importance_log_ratios(logprobs, old_logprobs, fmask, ratio_level))
  if objective == "clipped":
    policy_per_token, clipped = ppo_losses.clipped_surrogate(
        ratio_logprobs, old_logprobs, advantages, clip_eps_low,
        clip_eps_high)
  else:
    a = jax.lax.stop_gradient(advantages if advantages.ndim == 2
                              else advantages[:, None])
    ratio = jnp.exp(ratio_logprobs - jax.lax.stop_gradient(old_logprobs))
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, clip_eps_high))
    policy_per_token = -weight * a * logprobs
    clipped = (ratio > clip_eps_high) & (a > 0)
  per_token_loss = policy_per_token
  metrics = {}
  if ref_logprobs is not None:
    # Gradient flows through logprobs into k3: the loss itself pulls pi
    # toward pi_ref, unlike PPO's penalty in the (constant) reward.
    kl_per_token = kl_lib.kl_estimate(
        logprobs, jax.lax.stop_gradient(ref_logprobs), "k3")
    per_token_loss = policy_per_token + kl_coef * kl_per_token
    metrics["loss_kl_k3"] = common.masked_mean(
        jax.lax.stop_gradient(kl_per_token), fmask)
  loss = reductions.reduce_token_losses(per_token_loss, fmask, reduction,
                                        max_length)
  metrics.update(
      loss=loss,
      policy_loss=reductions.reduce_token_losses(policy_per_token, fmask,
                                                 reduction, max_length),
      clip_fraction=common.masked_mean(clipped.astype(fmask.dtype), fmask))
  metrics.update(ppo_losses.policy_drift_metrics(logprobs, old_logprobs, fmask))
  return loss, metrics
