"""Advantage estimators: GAE (PPO), RLOO, GRPO, REINFORCE baselines, whitening.

Token-level arrays are [batch, length] with a response mask that is 1 on the
response tokens up to and including the first EOS. `values[b, t]` is the value
of the state from which response token t was sampled; `rewards[b, t]` is the
reward for emitting token t (see `kl.per_token_rewards`).

Sequence-level estimators (RLOO, GRPO) take a flat [batch] of rewards laid out
as [num_prompts * group_size] with the samples of one prompt adjacent, the
same layout as the token arrays they will be broadcast onto.
"""

import jax
import jax.numpy as jnp

from jaxrlhf.losses import common
from jaxrlhf import checks


def whiten_rewards(rewards, mask):
  """Reward whitening without shifting the mean ("N+ details", detail 24).

  Scales the rewards of the batch to unit std but keeps their mean, as
  lm-human-preferences' `whiten(rewards, shift_mean=False)`. Optional: the
  paper finds it shortens responses without clearly changing quality.

  Args:
    rewards: [batch, length] per-token rewards.
    mask: [batch, length] response mask.

  Returns:
    [batch, length] whitened rewards, zero outside the mask.
  """
  checks.check_same_shape("whiten_rewards", rewards=rewards, mask=mask)
  return common.masked_whiten(rewards, mask.astype(rewards.dtype),
                              shift_mean=False)


def whiten_advantages(advantages, mask):
  """Advantage whitening to zero mean, unit std over the batch (detail 25).

  Args:
    advantages: [batch, length].
    mask: [batch, length] response mask.

  Returns:
    [batch, length], zero outside the mask.
  """
  checks.check_same_shape("whiten_advantages", advantages=advantages,
                           mask=mask)
  return common.masked_whiten(advantages, mask.astype(advantages.dtype),
                              shift_mean=True)


def generalized_advantage_estimation(rewards, values, mask, gamma=1.0,
                                     lam=0.95):
  """GAE(gamma, lambda) of Schulman et al. 2016 over masked responses.

  delta_t = r_t + gamma * V_{t+1} - V_t and A_t = sum_l (gamma lam)^l
  delta_{t+l}, computed backwards as A_t = delta_t + gamma lam A_{t+1}.
  Defaults gamma = 1, lam = 0.95 are Table 7 of "N+ implementation details".

  The episode ends at the last masked token: the value after it is 0 (the
  response is finished, nothing more is earned) and rewards, values,
  advantages and returns outside the mask are 0. A gap in the mask is not
  a step of the agent: a multi-turn episode's environment tokens lie
  between its turns (`jaxrlhf.agents.episodes`), and the last token of a
  turn bootstraps from the value of the next turn's first token, t + 1
  counting the masked tokens' steps only. A mask of one contiguous run
  (a response after its prompt) is the usual single-turn GAE.

  Args:
    rewards: [batch, length] per-token rewards.
    values: [batch, length] value estimates V(s_t) from the rollout.
    mask: [batch, length] response mask.
    gamma: discount.
    lam: GAE lambda.

  Returns:
    advantages: [batch, length].
    returns: [batch, length] advantages + values (the value-function target).
  """
  checks.check_same_shape("generalized_advantage_estimation",
                           rewards=rewards, values=values, mask=mask)
  checks.check_rank("generalized_advantage_estimation", "rewards", rewards, 2)
  mask = mask.astype(values.dtype)
  rewards = rewards * mask
  values = values * mask

  def backward_step(carry, step):
    # carry: V and A of the next masked token (0 past the last one: the
    # bootstrap of a finished episode); a masked-out step passes it on.
    next_value, next_advantage = carry
    reward, value, step_mask = step
    delta = reward + gamma * next_value - value
    advantage = (delta + gamma * lam * next_advantage) * step_mask
    on = step_mask > 0
    carry = (jnp.where(on, value, next_value),
             jnp.where(on, advantage, next_advantage))
    return carry, advantage

  # scan runs over the leading axis, so time goes first.
  zeros = jnp.zeros_like(values[:, 0])
  _, advantages = jax.lax.scan(
      backward_step, (zeros, zeros), (rewards.T, values.T, mask.T),
      reverse=True)
  advantages = advantages.T
  returns = (advantages + values) * mask
  return advantages, returns


def _grouped(rewards, group_size, where):
  checks.check_rank(where, "rewards", rewards, 1)
  checks.check_groups(where, rewards.shape[0], group_size)
  return rewards.reshape(-1, group_size)


def rloo_advantages(rewards, group_size):
  """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024; book 11.1.3).

  A_i = r_i - mean_{j != i} r_j over the k samples of the same prompt, so the
  baseline does not depend on the sample it is subtracted from (unbiased).
  Pass `kl.kl_penalized_sequence_rewards` as `rewards` to fold the KL in.

  Args:
    rewards: [batch] sequence rewards, batch = num_prompts * group_size.
    group_size: k >= 2 samples per prompt.

  Returns:
    [batch] advantages.
  """
  if group_size < 2:
    raise ValueError(
        f"rloo_advantages: group_size={group_size}; the leave-one-out "
        "baseline needs at least 2 samples per prompt.")
  grouped = _grouped(rewards, group_size, "rloo_advantages")
  others_mean = (jnp.sum(grouped, axis=1, keepdims=True) - grouped) / (
      group_size - 1)
  return (grouped - others_mean).reshape(-1)


def grpo_advantages(rewards, group_size, scale_by_std=True, eps=1e-4,
                    unbiased_std=True):
  """GRPO's group-normalised advantages (DeepSeekMath; book eq. 10).

  A_i = (r_i - mean(group)) / (std(group) + eps). Dr. GRPO (Liu et al. 2025)
  drops the std division (`scale_by_std=False`): dividing by it up-weights
  prompts whose samples barely differ (too easy or too hard).

  Args:
    rewards: [batch] sequence rewards, batch = num_prompts * group_size.
    group_size: samples per prompt.
    scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
    eps: added to the std, as in the book's code (1e-4); a group with equal
      rewards gets advantage 0.
    unbiased_std: Bessel-corrected std, as torch's `.std()` in the book's code.

  Returns:
    [batch] advantages, one per response (broadcast over its tokens).
  """
  grouped = _grouped(rewards, group_size, "grpo_advantages")
  centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
  if scale_by_std:
    ddof = 1 if unbiased_std and group_size > 1 else 0
    std = jnp.std(grouped, axis=1, keepdims=True, ddof=ddof)
    centred = centred / (std + eps)
  return centred.reshape(-1)


def reinforce_advantages(rewards, baseline):
  """REINFORCE with a baseline: A = r - b (book eq. 9, "offset reinforcement").

  Args:
    rewards: [batch] sequence rewards.
    baseline: scalar or [batch], e.g. `batch_mean_baseline(rewards)` or a
      running mean from `update_running_mean` computed before this batch.

  Returns:
    [batch] advantages.
  """
  return rewards - baseline


def batch_mean_baseline(rewards):
  """The simplest baseline: the mean reward of the batch (book 11.1.1)."""
  return jnp.mean(rewards)


def update_running_mean(running_mean, rewards, decay=0.9):
  """Exponential moving average of batch mean rewards, a REINFORCE baseline.

  Use the value from before a batch as that batch's baseline, then update:
  the baseline then does not depend on the batch's own samples.

  Args:
    running_mean: scalar state.
    rewards: [batch] rewards of the new batch.
    decay: weight of the old mean.

  Returns:
    The new running mean.
  """
  return decay * running_mean + (1.0 - decay) * jnp.mean(rewards)


def reinforce_pp_advantages(token_rewards, mask):
  """REINFORCE++'s advantages (Hu 2025, "REINFORCE++: A Simple and Efficient
  Approach for Aligning Large Language Models", eqs. 2-3).

  The return of each token, G_t = sum_{s >= t} r_s over its response (gamma
  1), of the per-token rewards (the score at the last token, -beta * KL_t at
  every token: `kl.per_token_rewards`), normalised over every token of the
  batch (the "global batch normalisation" that replaces a critic and a
  per-prompt baseline): A_t = (G_t - mean) / std.

  Args:
    token_rewards: [batch, length] per-token rewards.
    mask: [batch, length] response mask.

  Returns:
    [batch, length] advantages, zero outside the mask.
  """
  checks.check_same_shape("reinforce_pp_advantages",
                          token_rewards=token_rewards, mask=mask)
  mask = mask.astype(token_rewards.dtype)
  rewards = token_rewards * mask
  # Reverse cumulative sum along the response: the return of each token.
  returns = jnp.flip(jnp.cumsum(jnp.flip(rewards, -1), axis=-1), -1) * mask
  return whiten_advantages(returns, mask)
