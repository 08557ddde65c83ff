"""Vanilla policy-gradient loss for REINFORCE and RLOO.

The gradient of -A * log pi(y|x) is the REINFORCE estimator (RLHF book
11.1.1-11.1.3): grad J = E[A grad log pi]. With several gradient steps per
batch use the clipped surrogate (`grpo.grpo_loss` with `kl_coef=0` and the
KL folded into the reward) instead: with one step both give this gradient.
"""

import jax

from jaxrlhf import checks
from jaxrlhf.rl import reductions


def policy_gradient_loss(logprobs, advantages, mask,
                         reduction="sequence_sum", max_length=None):
  """-A * log pi, reduced over the response tokens.

  Args:
    logprobs: [batch, length] log pi of the sampled tokens (differentiated).
    advantages: [batch] per-response (e.g. `advantages.rloo_advantages`,
      `advantages.reinforce_advantages`) or [batch, length].
    mask: [batch, length] response mask.
    reduction: "sequence_sum" treats the response as one action
      (log pi(y|x) = sum_t log pi(y_t|...)); see `reductions` for the others.
    max_length: for "constant_length".

  Returns:
    Scalar loss.
  """
  checks.check_same_shape("policy_gradient_loss", logprobs=logprobs,
                           mask=mask)
  if advantages.shape not in (mask.shape, mask.shape[:1]):
    raise ValueError(
        f"policy_gradient_loss: advantages has shape "
        f"{list(advantages.shape)}; expected [batch] = [{mask.shape[0]}] or "
        f"[batch, length] = {list(mask.shape)}.")
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  per_token_loss = -jax.lax.stop_gradient(advantages) * logprobs
  return reductions.reduce_token_losses(per_token_loss, mask, reduction,
                                        max_length)
