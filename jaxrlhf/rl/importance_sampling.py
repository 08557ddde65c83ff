"""Importance-sampling corrections for rollouts sampled by another policy.

In asynchronous or overlapped RL the policy that sampled a rollout (log-probs
`sampler_logprobs`, kept by the sampler as it drew each token) differs from
the policy the update starts from (`trainer_logprobs`, the trainer's scoring
of the same tokens): a stale sampler, another engine, bf16 sampling. The
per-token log ratio is
  r_t = trainer_logprobs_t - sampler_logprobs_t = log pi_train / pi_sampler,
and each correction turns it into per-token weights on the advantages and a
loss mask with the tokens it distrusts removed:
  none            w_t = 1, nothing dropped.
  token_tis       w_t = min(exp(r_t), cap): truncated importance sampling per
                  token (Yao et al. 2025, "Your efficient RL framework
                  secretly brings you off-policy RL training"; verl's TIS;
                  AReaL's decoupled PPO weight pi_prox / pi_behave).
  sequence_tis    w = min(exp(sum_t r_t), cap) per response, on its tokens.
  token_mask      w_t = 1, tokens with exp(r_t) outside [low, high] dropped
                  (masked importance sampling, "MIS").
  sequence_mask   w = 1, responses with exp(sum_t r_t) outside [low, high]
                  dropped.
  icepop          IcePop (Ring-1T, "Every Step Evolves", inclusionAI 2025):
                  the objective multiplies each token's clipped surrogate by
                  M(k) = k if k in [alpha, beta] else 0, with k the token's
                  pi_train / pi_infer; so w_t = exp(r_t) on the kept tokens
                  and the others dropped. (Formula as summarised from the
                  report at themoonlight.io's review of arXiv 2510.18855 and
                  the authors' follow-up post ringtech.notion.site/kpop.)
  geometric_mean  w = exp(mean_t r_t) per response, the length-normalised
                  sequence ratio of GSPO, optionally truncated at `cap` and/or
                  responses outside [low, high] dropped.

Boundaries: a ratio exactly at `low` or `high` is kept (the band is closed,
as IcePop's M(k) with k in [alpha, beta]); a ratio exactly at `cap` counts as
capped (its weight is `cap` either way). The band of the sequence and
geometric-mean variants is tested on the untruncated ratio.

Every correction returns (token_weights, loss_mask, metrics):
  token_weights [rows, L]: stop-gradient constants multiplying the advantage
    of each token; 0 wherever loss_mask is 0.
  loss_mask [rows, L]: `mask` with the dropped tokens set to 0.
  metrics: "correction/weight_mean" (mean weight over kept tokens),
    "correction/dropped_fraction" (of the tokens in `mask`),
    "correction/capped_fraction" (of the tokens in `mask`, or of the
    responses with a token in `mask`, whose weight hit `cap`; 0 without one).
Values at positions outside `mask` never influence anything.
"""

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common

NONE = "none"
CORRECTIONS = (NONE, "token_tis", "sequence_tis", "token_mask",
               "sequence_mask", "icepop", "geometric_mean")


def _clean(log_ratio, mask):
  """The log ratio with 0 outside the mask (so inf/nan there cannot leak),
  and the mask as a float array of the same dtype."""
  mask = mask.astype(jnp.result_type(log_ratio.dtype, jnp.float32))
  return jnp.where(mask > 0, log_ratio, 0.0), mask


def _in_band(ratio, low, high):
  """1 where low <= ratio <= high (closed band), as a float array."""
  return ((ratio >= low) & (ratio <= high)).astype(ratio.dtype)


def _rows_with_tokens(mask):
  """[rows] 1 for the responses with at least one token in the mask."""
  return (jnp.sum(mask, axis=-1) > 0).astype(mask.dtype)


def _finish(weights, mask, keep, capped, capped_over):
  """Assembles (token_weights, loss_mask, metrics) from per-token arrays.

  Args:
    weights: [rows, L] the correction's weight of each token.
    mask: [rows, L] the float mask given.
    keep: [rows, L] 1 on the tokens the correction keeps.
    capped: [rows, L] or [rows] 1 where the weight hit the cap.
    capped_over: mask of the same shape as `capped` it is a fraction of.
  """
  loss_mask = mask * keep
  token_weights = jax.lax.stop_gradient(
      jnp.where(loss_mask > 0, weights, 0.0))
  loss_mask = jax.lax.stop_gradient(loss_mask)
  metrics = {
      "correction/weight_mean": common.masked_mean(token_weights, loss_mask),
      "correction/dropped_fraction": common.masked_mean(1.0 - keep, mask),
      "correction/capped_fraction": common.masked_mean(capped, capped_over),
  }
  return token_weights, loss_mask, metrics


def _check(where, log_ratio, mask, cap=None, low=None, high=None,
           needs=()):
  checks.check_rank(where, "log_ratio", log_ratio, 2, "expected [rows, L].")
  checks.check_same_shape(where, log_ratio=log_ratio, mask=mask)
  given = {"cap": cap, "low": low, "high": high}
  for name in needs:
    if given[name] is None:
      raise ValueError(f"{where}: `{name}` is required; set it (e.g. "
                       "online.importance_weight_cap or "
                       "online.importance_ratio_low/_high).")
  if cap is not None and not cap > 0:
    raise ValueError(f"{where}: cap={cap} must be > 0 (an upper bound on "
                     "an importance ratio, e.g. 2).")
  if low is not None and high is not None and not 0 <= low <= high:
    raise ValueError(f"{where}: the band [low={low}, high={high}] must have "
                     "0 <= low <= high (e.g. [0.5, 2]).")


def none(log_ratio, mask):
  """The identity: weights 1 on the mask, the mask as given.

  Args:
    log_ratio: [rows, L] log pi_train - log pi_sampler (unused).
    mask: [rows, L] 1 on the tokens that carry loss.
  """
  _check("importance_sampling.none", log_ratio, mask)
  _, mask = _clean(log_ratio, mask)
  ones = jnp.ones_like(mask)
  return _finish(ones, mask, ones, jnp.zeros_like(mask), mask)


def token_tis(log_ratio, mask, cap):
  """Truncated IS per token: w_t = min(exp(r_t), cap).

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_sampler.
    mask: [rows, L] 1 on the tokens that carry loss.
    cap: the largest weight (> 0).
  """
  _check("token_tis", log_ratio, mask, cap=cap, needs=("cap",))
  log_ratio, mask = _clean(log_ratio, mask)
  ratio = jnp.exp(log_ratio)
  capped = (ratio >= cap).astype(mask.dtype)
  return _finish(jnp.minimum(ratio, cap), mask, jnp.ones_like(mask), capped,
                 mask)


def _sequence_weights(weight, mask):
  """Broadcasts [rows] weights to [rows, L]."""
  return jnp.broadcast_to(weight[:, None], mask.shape)


def sequence_tis(log_ratio, mask, cap):
  """Truncated IS per response: w = min(exp(sum_t r_t over the mask), cap).

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_sampler.
    mask: [rows, L] 1 on the tokens that carry loss.
    cap: the largest weight (> 0).
  """
  _check("sequence_tis", log_ratio, mask, cap=cap, needs=("cap",))
  log_ratio, mask = _clean(log_ratio, mask)
  # exp of a long sum can overflow to inf; min(inf, cap) is still cap.
  ratio = jnp.exp(common.masked_sum(log_ratio, mask, axis=-1))
  capped = (ratio >= cap).astype(mask.dtype)
  weights = _sequence_weights(jnp.minimum(ratio, cap), mask)
  return _finish(weights, mask, jnp.ones_like(mask), capped,
                 _rows_with_tokens(mask))


def token_mask(log_ratio, mask, low, high):
  """Masked IS per token: weight 1, tokens with exp(r_t) outside [low, high]
  dropped.

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_sampler.
    mask: [rows, L] 1 on the tokens that carry loss.
    low, high: the closed band of ratios kept.
  """
  _check("token_mask", log_ratio, mask, low=low, high=high,
         needs=("low", "high"))
  log_ratio, mask = _clean(log_ratio, mask)
  keep = _in_band(jnp.exp(log_ratio), low, high)
  return _finish(jnp.ones_like(mask), mask, keep, jnp.zeros_like(mask), mask)


def sequence_mask(log_ratio, mask, low, high):
  """Weight 1, whole responses dropped when exp(sum_t r_t) is outside
  [low, high].

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_sampler.
    mask: [rows, L] 1 on the tokens that carry loss.
    low, high: the closed band of sequence ratios kept.
  """
  _check("sequence_mask", log_ratio, mask, low=low, high=high,
         needs=("low", "high"))
  log_ratio, mask = _clean(log_ratio, mask)
  ratio = jnp.exp(common.masked_sum(log_ratio, mask, axis=-1))
  keep = _sequence_weights(_in_band(ratio, low, high), mask)
  rows = _rows_with_tokens(mask)
  return _finish(jnp.ones_like(mask), mask, keep, jnp.zeros_like(rows), rows)


def icepop(log_ratio, mask, low, high):
  """IcePop: w_t = M(exp(r_t)), M(k) = k on [low, high], dropped outside.

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_infer.
    mask: [rows, L] 1 on the tokens that carry loss.
    low, high: IcePop's [alpha, beta] (closed band of ratios kept).
  """
  _check("icepop", log_ratio, mask, low=low, high=high,
         needs=("low", "high"))
  log_ratio, mask = _clean(log_ratio, mask)
  ratio = jnp.exp(log_ratio)
  keep = _in_band(ratio, low, high)
  return _finish(ratio, mask, keep, jnp.zeros_like(mask), mask)


def geometric_mean_sequence(log_ratio, mask, cap=None, low=None, high=None):
  """w = exp(mean_t r_t over the mask) on every token of the response.

  Args:
    log_ratio: [rows, L] r_t = log pi_train - log pi_sampler.
    mask: [rows, L] 1 on the tokens that carry loss.
    cap: if given, the weight is min(w, cap).
    low, high: if given (both), responses with w outside [low, high] (before
      the cap) are dropped.
  """
  if (low is None) != (high is None):
    raise ValueError("geometric_mean_sequence: give both `low` and `high` "
                     f"or neither (got low={low}, high={high}).")
  _check("geometric_mean_sequence", log_ratio, mask, cap=cap, low=low,
         high=high)
  log_ratio, mask = _clean(log_ratio, mask)
  ratio = jnp.exp(common.masked_mean(log_ratio, mask, axis=-1))
  rows = _rows_with_tokens(mask)
  weight, capped = ratio, jnp.zeros_like(rows)
  if cap is not None:
    weight = jnp.minimum(ratio, cap)
    capped = (ratio >= cap).astype(mask.dtype)
  keep = jnp.ones_like(mask)
  if low is not None:
    keep = _sequence_weights(_in_band(ratio, low, high), mask)
  return _finish(_sequence_weights(weight, mask), mask, keep, capped, rows)


def correct(name, trainer_logprobs, sampler_logprobs, mask, *, cap=None,
            low=None, high=None):
  """Applies the correction `name` (one of CORRECTIONS).

  Args:
    name: the correction, e.g. a config field's value.
    trainer_logprobs: [rows, L] log pi_train of the sampled tokens.
    sampler_logprobs: [rows, L] log pi_sampler of the same tokens.
    mask: [rows, L] 1 on the tokens that carry loss.
    cap: the weight cap of token_tis, sequence_tis (required) and
      geometric_mean (optional).
    low, high: the ratio band of token_mask, sequence_mask, icepop
      (required) and geometric_mean (optional).

  Returns:
    (token_weights [rows, L], loss_mask [rows, L], metrics dict).
  """
  checks.check_choice("importance_sampling.correct", "name", name,
                      CORRECTIONS)
  checks.check_same_shape("importance_sampling.correct",
                          trainer_logprobs=trainer_logprobs,
                          sampler_logprobs=sampler_logprobs, mask=mask)
  log_ratio = trainer_logprobs - sampler_logprobs
  if name == NONE:
    return none(log_ratio, mask)
  if name == "token_tis":
    return token_tis(log_ratio, mask, cap)
  if name == "sequence_tis":
    return sequence_tis(log_ratio, mask, cap)
  if name == "token_mask":
    return token_mask(log_ratio, mask, low, high)
  if name == "sequence_mask":
    return sequence_mask(log_ratio, mask, low, high)
  if name == "icepop":
    return icepop(log_ratio, mask, low, high)
  return geometric_mean_sequence(log_ratio, mask, cap=cap, low=low,
                                 high=high)


def gap_metrics(trainer_logprobs, sampler_logprobs, mask,
                prefix: str = "gap"):
  """The gap between the sampling and the training policy on the same tokens.

  Args:
    trainer_logprobs: [rows, L] log pi_train of the sampled tokens.
    sampler_logprobs: [rows, L] log pi_sampler of the same tokens.
    mask: [rows, L] 1 on the tokens that carry loss.
    prefix: the metrics' names' start.

  Returns:
    dict of scalars (named for prefix "gap"): "gap/k1" and "gap/k3", KL(sampler || trainer) per
    response estimated on the sampler's samples (k1 = sum_t -r_t, k3 =
    sum_t (exp(r_t) - 1) - r_t), averaged over the responses with a token in
    the mask; "gap/ratio_mean", "_std" (population), "_min", "_max" of the
    per-token ratio exp(r_t) over the mask (1 when the mask is empty).
  """
  checks.check_same_shape("gap_metrics", trainer_logprobs=trainer_logprobs,
                          sampler_logprobs=sampler_logprobs, mask=mask)
  log_ratio, mask = _clean(trainer_logprobs - sampler_logprobs, mask)
  log_ratio = jax.lax.stop_gradient(log_ratio)
  rows = _rows_with_tokens(mask)
  k1 = common.masked_sum(-log_ratio, mask, axis=-1)
  # expm1 keeps precision near ratio 1, the usual case.
  k3 = common.masked_sum(jnp.expm1(log_ratio) - log_ratio, mask, axis=-1)
  ratio = jnp.exp(log_ratio)
  inside = mask > 0
  any_token = jnp.any(inside)
  ratio_min = jnp.min(jnp.where(inside, ratio, jnp.inf))
  ratio_max = jnp.max(jnp.where(inside, ratio, -jnp.inf))
  mean = common.masked_mean(ratio, mask)
  return {
      f"{prefix}/k1": common.masked_mean(k1, rows),
      f"{prefix}/k3": common.masked_mean(k3, rows),
      f"{prefix}/ratio_mean": jnp.where(any_token, mean, 1.0),
      f"{prefix}/ratio_std": jnp.sqrt(common.masked_var(ratio, mask,
                                                        unbiased=False)),
      f"{prefix}/ratio_min": jnp.where(any_token, ratio_min, 1.0),
      f"{prefix}/ratio_max": jnp.where(any_token, ratio_max, 1.0),
  }
