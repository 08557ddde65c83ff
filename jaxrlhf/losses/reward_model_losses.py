"""Reward-model losses: Bradley–Terry pairs, and rankings by Plackett–Luce or
by Bradley–Terry over all their pairs (InstructGPT).

Every loss is a pure function of per-sequence rewards (the scalar the reward
head gives at the EOS token, PPO implementation-details paper detail 12) and
returns `(loss, metrics)`; it knows nothing about the network that made them.

References:
  Lambert, "Reinforcement Learning from Human Feedback" (the RLHF book,
    2025), chapter 7: the Bradley–Terry loss (eq. 3), the
    Llama 2 margin (eq. 5), InstructGPT's per-prompt balancing of the C(K, 2)
    comparisons of one prompt (eq. 6; `prompt_balanced_weights`,
    `all_pairs_ranking_loss`), the K-wise Plackett–Luce loss (7.4.3).
  Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case
    Study on TL;DR Summarization",
    details 15 (bias that makes the reference rewards mean 0) and 18
    (calibration: accuracy vs. confidence).
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common

Array = Any
Metrics = dict


def _rank(name, x, rank, where):
  checks.check_rank(where, name, x, rank,
                    "pass one value per example (reduce per-token values "
                    "with `sequence_logprob` or take the reward at the EOS "
                    "token first).")


def prompt_balanced_weights(prompt_ids: Array,
                            weights: Optional[Array] = None) -> Array:
  """Per-pair weights under which every prompt counts once.

  InstructGPT (RLHF book eq. 6): a prompt ranked over K completions yields
  C(K, 2) pairs; weighting each by 1 / C(K, 2) stops prompts with many
  completions from dominating (and over-fitting). Here the count is taken over
  the pairs of the prompt present in the batch, so a prompt's pairs should be
  kept in one batch, as InstructGPT does.

  Args:
    prompt_ids: [batch] integer id of the prompt each pair belongs to.
    weights: optional [batch] base weights (0 marks padding pairs).
  Returns:
    [batch] weights w_i = weights_i / sum_{j: same prompt} weights_j. Their
    sum is the number of prompts with a non-zero total weight.
  """
  _rank("prompt_ids", prompt_ids, 1, "prompt_balanced_weights")
  if weights is None:
    weights = jnp.ones(jnp.shape(prompt_ids), jnp.float32)
  checks.check_same_shape("prompt_balanced_weights", prompt_ids=prompt_ids,
                    weights=weights)
  # A [batch, batch] same-prompt matrix keeps this jit-friendly without a
  # static number of prompts; batches of pairs are small.
  same_prompt = prompt_ids[:, None] == prompt_ids[None, :]
  prompt_total = jnp.sum(jnp.where(same_prompt, weights[None, :], 0.0), axis=1)
  return weights / jnp.where(prompt_total > 0, prompt_total, 1.0)


def bradley_terry_loss(chosen_rewards: Array,
                       rejected_rewards: Array,
                       *,
                       margin: Optional[Array] = None,
                       weights: Optional[Array] = None,
                       prompt_ids: Optional[Array] = None,
                       centering_coef: float = 0.0) -> tuple[Array, Metrics]:
  """Pairwise Bradley–Terry reward-model loss.

    loss_i = -log sigmoid(r_c - r_r - m_i)               (book eqs. 3 and 5)
           + centering_coef * (r_c + r_r)^2               (reward centring)
    loss   = sum_i w_i loss_i / sum_i w_i

  Args:
    chosen_rewards: [batch] reward of the preferred completion.
    rejected_rewards: [batch] reward of the dis-preferred completion.
    margin: optional [batch] (or scalar) Llama 2 preference margin m(r) >= 0,
      e.g. the gap between the two ratings; the loss asks r_c - r_r to
      exceed it.
    weights: optional [batch] per-pair weights (0 for padding pairs).
    prompt_ids: optional [batch] prompt id of each pair; when given the pairs
      of one prompt share one unit of weight (`prompt_balanced_weights`), so the
      loss is the mean over prompts of each prompt's mean pair loss.
    centering_coef: weight of the penalty (r_c + r_r)^2 that pins the reward
      scale's free offset near 0 (Eisenstein et al. 2023); 0 turns it off.
  Returns:
    (loss scalar, metrics) with metrics `loss`, `bt_loss` (without centring),
    `accuracy` (ties count 1/2), `chosen_reward`, `rejected_reward`, `margin`
    (mean r_c - r_r), all weighted like the loss.
  """
  where = "bradley_terry_loss"
  _rank("chosen_rewards", chosen_rewards, 1, where)
  checks.check_same_shape(where, chosen_rewards=chosen_rewards,
                    rejected_rewards=rejected_rewards, weights=weights,
                    prompt_ids=prompt_ids)
  if weights is None:
    weights = jnp.ones(jnp.shape(chosen_rewards), jnp.float32)
  if prompt_ids is not None:
    weights = prompt_balanced_weights(prompt_ids, weights)
  reward_gap = chosen_rewards - rejected_rewards
  logits = reward_gap if margin is None else reward_gap - margin
  # -log sigmoid(z) = softplus(-z), stable for large |z|.
  bt_loss = common.masked_mean(jax.nn.softplus(-logits), weights)
  centering = common.masked_mean(jnp.square(chosen_rewards + rejected_rewards),
                             weights)
  loss = bt_loss + centering_coef * centering
  metrics = {
      "loss": loss,
      "bt_loss": bt_loss,
      "centering_penalty": centering,
      "accuracy": common.masked_mean(
          common.win_indicator(chosen_rewards, rejected_rewards), weights),
      "chosen_reward": common.masked_mean(chosen_rewards, weights),
      "rejected_reward": common.masked_mean(rejected_rewards, weights),
      "margin": common.masked_mean(reward_gap, weights),
  }
  return loss, metrics


def plackett_luce_loss(ranked_rewards: Array,
                       mask: Optional[Array] = None,
                       *,
                       weights: Optional[Array] = None
                       ) -> tuple[Array, Metrics]:
  """K-wise Plackett–Luce negative log-likelihood of a ranking (book 7.4.3).

    P(ranking) = prod_k exp(r_k) / sum_{j >= k} exp(r_j)

  with the completions listed best first. For K = 2 this is Bradley–Terry.

  Args:
    ranked_rewards: [batch, K] rewards in rank order: column 0 holds the most
      preferred completion, column K-1 the least preferred.
    mask: optional [batch, K], 1 for completions that take part; a ranking of
      fewer than K completions masks the unused columns (the present ones keep
      their relative order).
    weights: optional [batch] per-ranking weights; give rankings that are
      pure padding weight 0 (their NLL is 0 and would dilute the mean).
  Returns:
    (mean weighted negative log-likelihood, metrics) with `loss`,
    `top1_accuracy` (the highest reward is the top-ranked completion) and
    `pairwise_accuracy` (fraction of ordered pairs the rewards order right,
    ties 1/2), averaged over rankings with the same weights.
  """
  where = "plackett_luce_loss"
  _rank("ranked_rewards", ranked_rewards, 2, where)
  if mask is None:
    mask = jnp.ones(jnp.shape(ranked_rewards), jnp.float32)
  checks.check_same_shape(where, ranked_rewards=ranked_rewards, mask=mask)
  batch, num_items = jnp.shape(ranked_rewards)
  if weights is None:
    weights = jnp.ones((batch,), jnp.float32)
  checks.check_same_shape(where, ranked_rewards_batch=ranked_rewards[:, 0],
                    weights=weights)
  present = mask > 0
  rewards = jnp.where(present, ranked_rewards, 0.0)
  index = jnp.arange(num_items)
  at_or_below = index[None, :] >= index[:, None]  # [k, j]: j ranked at/below k
  # The denominator of stage k runs over the present items j >= k. Item k is
  # always included, even if masked, so the log-sum-exp is never over an empty
  # set (that would give -inf and NaN gradients); a masked k's term is dropped.
  in_denominator = at_or_below[None] & (present[:, None, :]
                                        | jnp.eye(num_items, dtype=bool)[None])
  log_denominator = jax.nn.logsumexp(
      jnp.broadcast_to(rewards[:, None, :], (batch, num_items, num_items)),
      axis=-1, where=in_denominator)
  stage_logprob = jnp.where(present, rewards - log_denominator, 0.0)
  nll = -jnp.sum(stage_logprob, axis=-1)

  loss = common.masked_mean(nll, weights)
  return loss, dict(_ranking_metrics(rewards, present, weights), loss=loss)


def _ordered_pairs(present: Array) -> Array:
  """[batch, K, K] bool: (k, j) with k ranked above j, both present."""
  index = jnp.arange(present.shape[-1])
  return (present[:, :, None] & present[:, None, :]
          & (index[:, None] < index[None, :])[None])


def _ranking_metrics(rewards: Array, present: Array, weights: Array) -> Metrics:
  """`top1_accuracy` and `pairwise_accuracy` of [batch, K] ranked rewards."""
  pair_present = _ordered_pairs(present)
  pair_wins = common.win_indicator(rewards[:, :, None], rewards[:, None, :])
  pairwise = jnp.sum(jnp.where(pair_present, pair_wins, 0.0), axis=(1, 2))
  num_pairs = jnp.sum(pair_present, axis=(1, 2))
  pairwise_accuracy = pairwise / jnp.maximum(num_pairs, 1)
  index = jnp.arange(rewards.shape[-1])
  best_other = jnp.max(jnp.where(present & (index[None] > 0), rewards,
                                 -jnp.inf), axis=-1)
  top1 = common.win_indicator(rewards[:, 0], best_other)
  return {
      "top1_accuracy": common.masked_mean(top1, weights),
      "pairwise_accuracy": common.masked_mean(pairwise_accuracy, weights),
  }


def all_pairs_ranking_loss(ranked_rewards: Array,
                           mask: Optional[Array] = None,
                           *,
                           weights: Optional[Array] = None
                           ) -> tuple[Array, Metrics]:
  """Bradley–Terry on all C(K, 2) pairs of each ranking (InstructGPT).

  InstructGPT trains on every comparison a K-wise ranking implies, the pairs
  of one prompt in one batch element, each weighted 1 / C(K, 2) so that every
  prompt counts once (RLHF book section 7.4.2, eq. 6):

    loss_b = -1/C(K_b, 2) sum_{k ranked above j} log sigmoid(r_bk - r_bj)
    loss   = sum_b w_b loss_b / sum_b w_b

  Unlike Plackett–Luce (`plackett_luce_loss`), which models the ranking as a
  sequence of choices, this uses only its pairwise orderings; for K = 2 both
  are Bradley–Terry.

  Args:
    ranked_rewards: [batch, K] rewards in rank order, column 0 the most
      preferred completion.
    mask: optional [batch, K], 1 for completions that take part (K_b of
      them); a ranking with fewer than 2 has no pair and adds 0 (give it
      weight 0).
    weights: optional [batch] per-ranking weights (0 for padding rankings).
  Returns:
    (loss, metrics) with `loss`, `top1_accuracy` and `pairwise_accuracy`
    (ties count 1/2), averaged over rankings with `weights`.
  """
  where = "all_pairs_ranking_loss"
  _rank("ranked_rewards", ranked_rewards, 2, where)
  if mask is None:
    mask = jnp.ones(jnp.shape(ranked_rewards), jnp.float32)
  checks.check_same_shape(where, ranked_rewards=ranked_rewards, mask=mask)
  if weights is None:
    weights = jnp.ones(jnp.shape(ranked_rewards)[:1], jnp.float32)
  checks.check_same_shape(where, ranked_rewards_batch=ranked_rewards[:, 0],
                          weights=weights)
  present = mask > 0
  rewards = jnp.where(present, ranked_rewards, 0.0)
  pair_present = _ordered_pairs(present)
  # -log sigmoid(r_k - r_j) = softplus(r_j - r_k), stable for large gaps.
  pair_loss = jax.nn.softplus(rewards[:, None, :] - rewards[:, :, None])
  num_pairs = jnp.sum(pair_present, axis=(1, 2))
  per_ranking = (jnp.sum(jnp.where(pair_present, pair_loss, 0.0), axis=(1, 2))
                 / jnp.maximum(num_pairs, 1))
  loss = common.masked_mean(per_ranking, weights)
  return loss, dict(_ranking_metrics(rewards, present, weights), loss=loss)


def calibration_table(chosen_rewards: Array,
                      rejected_rewards: Array,
                      *,
                      num_bins: int = 10,
                      weights: Optional[Array] = None) -> dict:
  """Reliability table of a pairwise reward model (PPO paper detail 18).

  The model's predicted probability that the chosen completion wins is
  p = sigmoid(r_c - r_r). Binning p itself against "chosen won" is degenerate
  (the label is always 1), so, as in Bai et al. (2022), we bin the model's
  confidence in its own pick, max(p, 1 - p) in [0.5, 1], against how often
  that pick is the human's. This is the same as binning p with the pair's order
  shuffled, folded at 0.5. A calibrated model has accuracy == confidence in
  every bin.

  Args:
    chosen_rewards: [batch] rewards of the preferred completions.
    rejected_rewards: [batch] rewards of the dis-preferred completions.
    num_bins: equal-width bins over [0.5, 1]; the last bin includes 1.
    weights: optional [batch] example weights (0 drops an example).
  Returns:
    dict of arrays: `bin_edges` [num_bins + 1], `counts` [num_bins] (summed
    weights), `mean_confidence` [num_bins], `accuracy` [num_bins] (0 in empty
    bins; ties count 1/2), and `expected_calibration_error` (scalar,
    count-weighted mean |accuracy - confidence|).
  """
  where = "calibration_table"
  _rank("chosen_rewards", chosen_rewards, 1, where)
  checks.check_same_shape(where, chosen_rewards=chosen_rewards,
                    rejected_rewards=rejected_rewards, weights=weights)
  if not isinstance(num_bins, int) or num_bins < 1:
    raise ValueError(f"{where}: num_bins must be a positive int, got "
                     f"{num_bins!r}.")
  if weights is None:
    weights = jnp.ones(jnp.shape(chosen_rewards), jnp.float32)
  gap = chosen_rewards - rejected_rewards
  confidence = jax.nn.sigmoid(jnp.abs(gap))
  correct = common.win_indicator(chosen_rewards, rejected_rewards)
  bin_index = jnp.clip(
      jnp.floor((confidence - 0.5) * 2.0 * num_bins).astype(jnp.int32), 0,
      num_bins - 1)
  in_bin = jax.nn.one_hot(bin_index, num_bins) * weights[:, None]
  counts = jnp.sum(in_bin, axis=0)
  safe_counts = jnp.where(counts > 0, counts, 1.0)
  mean_confidence = jnp.sum(in_bin * confidence[:, None], axis=0) / safe_counts
  accuracy = jnp.sum(in_bin * correct[:, None], axis=0) / safe_counts
  total = jnp.sum(counts)
  ece = jnp.sum(counts * jnp.abs(accuracy - mean_confidence)) / jnp.where(
      total > 0, total, 1.0)
  return {
      "bin_edges": jnp.linspace(0.5, 1.0, num_bins + 1),
      "counts": counts,
      "mean_confidence": mean_confidence,
      "accuracy": accuracy,
      "expected_calibration_error": ece,
  }


def zero_mean_reward_bias(reference_rewards: Array,
                          mask: Optional[Array] = None) -> Array:
  """Bias that makes the reference rewards mean 0 (PPO paper detail 15).

  Stiennon et al. (2020): "at the end of training, we normalize the reward
  model outputs such that the reference summaries from our dataset achieve a
  mean score of 0". Add the returned scalar to the reward head's bias.

  Args:
    reference_rewards: rewards of (prompt, reference completion) pairs, any
      shape (e.g. [num_examples]).
    mask: optional, same shape, 1 for entries that count.
  Returns:
    scalar bias = -mean(reference_rewards).
  """
  if mask is None:
    mask = jnp.ones(jnp.shape(reference_rewards), jnp.float32)
  checks.check_same_shape("zero_mean_reward_bias",
                    reference_rewards=reference_rewards, mask=mask)
  return -common.masked_mean(reference_rewards, mask)


def reward_gain_and_bias(reference_rewards: Array,
                         mask: Optional[Array] = None,
                         *,
                         target_mean: float = 0.0,
                         target_std: float = 1.0,
                         eps: float = 1e-8) -> tuple[Array, Array]:
  """Affine map r -> gain * r + bias giving reference rewards a set mean/std.

  The std is the population std (no Bessel correction), so the mapped
  reference set has exactly `target_std`.

  Args:
    reference_rewards: rewards of a reference set, any shape.
    mask: optional, same shape, 1 for entries that count.
    target_mean: mean of the mapped rewards.
    target_std: std of the mapped rewards.
    eps: added to the variance so a constant reference set cannot divide by 0.
  Returns:
    (gain, bias) scalars.
  """
  if mask is None:
    mask = jnp.ones(jnp.shape(reference_rewards), jnp.float32)
  checks.check_same_shape("reward_gain_and_bias",
                    reference_rewards=reference_rewards, mask=mask)
  mean = common.masked_mean(reference_rewards, mask)
  var = common.masked_var(reference_rewards, mask, unbiased=False)
  gain = target_std / jnp.sqrt(var + eps)
  bias = target_mean - gain * mean
  return gain, bias
