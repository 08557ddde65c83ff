"""GRPO's loss: PPO-clip on group-relative advantages, KL inside the loss.

DeepSeekMath (Shao et al. 2024; RLHF book 11.1.5 and 11.2.3): no value
network; each response's advantage comes from the other responses to the same
prompt (`advantages.grpo_advantages`), and the KL to the reference is a term
of the loss, estimated per token with k3, instead of a penalty in the reward:
  loss_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))
           + beta * k3_t,   k3_t = pi_ref/pi - log(pi_ref/pi) - 1.
Variants covered by arguments: DAPO's asymmetric clipping (eps_high > eps_low)
and token-level mean, Dr. GRPO's constant-length normaliser (with
`grpo_advantages(scale_by_std=False)`); see `reductions`.
"""

import jax

from jaxrlhf.losses import common
from jaxrlhf import checks
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import ppo
from jaxrlhf.rl import reductions


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask,
              clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.04,
              reduction="sequence_mean", max_length=None):
  """GRPO loss with the k3 KL term in the loss.

  Args:
    logprobs: [batch, length] log pi of the sampled tokens (differentiated).
    old_logprobs: [batch, length] log pi_old (the sampling policy).
    ref_logprobs: [batch, length] log pi_ref.
    advantages: [batch] one advantage per response, or [batch, length].
    mask: [batch, length] response mask.
    clip_eps_low, clip_eps_high: clip range [1 - low, 1 + high].
    kl_coef: beta of the KL term (DeepSeekMath uses 0.04); 0 drops it.
    reduction: "sequence_mean" (GRPO), "token_mean" (DAPO),
      "constant_length" (Dr. GRPO) or "sequence_sum"; see `reductions`.
    max_length: the constant of "constant_length" (default: length).

  Returns:
    (scalar loss, metrics dict with "loss", "policy_loss", "kl" (masked token
    mean of k3 against the reference), "clip_fraction", "approx_kl_k1",
    "approx_kl_k3", "ratio_mean").
  """
  checks.check_same_shape("grpo_loss", logprobs=logprobs,
                           old_logprobs=old_logprobs,
                           ref_logprobs=ref_logprobs, mask=mask)
  if advantages.shape not in (mask.shape, mask.shape[:1]):
    raise ValueError(
        f"grpo_loss: advantages has shape {list(advantages.shape)}; expected "
        f"[batch] = [{mask.shape[0]}] or [batch, length] = {list(mask.shape)}.")
  fmask = mask.astype(logprobs.dtype)
  policy_per_token, clipped = ppo.clipped_surrogate(
      logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high)
  # Gradient flows through logprobs into k3: the loss itself pulls pi toward
  # pi_ref, unlike PPO's penalty in the (constant) reward.
  kl_per_token = kl_lib.kl_estimate(logprobs,
                                    jax.lax.stop_gradient(ref_logprobs), "k3")
  per_token_loss = policy_per_token + kl_coef * kl_per_token
  loss = reductions.reduce_token_losses(per_token_loss, fmask, reduction,
                                        max_length)
  metrics = dict(
      loss=loss,
      policy_loss=reductions.reduce_token_losses(policy_per_token, fmask,
                                                 reduction, max_length),
      kl=common.masked_mean(jax.lax.stop_gradient(kl_per_token), fmask),
      clip_fraction=common.masked_mean(clipped.astype(fmask.dtype), fmask))
  metrics.update(ppo.policy_drift_metrics(logprobs, old_logprobs, fmask))
  return loss, metrics
