"""ORPO: odds-ratio preference optimisation without a reference model.

Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
Reference Model", section 4. For a pair (x, y_w, y_l) and the policy's
length-normalised likelihood

  log P(y|x) = (1/|y|) sum_t log pi(y_t | x, y_<t),

the odds of a completion and the loss are

  odds(y|x) = P(y|x) / (1 - P(y|x))
  L_OR      = -log sigmoid(log odds(y_w|x) - log odds(y_l|x))
  L_SFT     = -log P(y_w|x)            (the chosen completion's token NLL)
  L_ORPO    = mean over pairs of [L_SFT + lambda L_OR],

where log odds(y|x) = log P - log(1 - P) = log P - log1mexp(log P). With
lambda = 0 it is supervised fine-tuning on the chosen completions.

Conventions beside TRL's ORPOTrainer (whose `beta` is lambda): the odds
ratio term is the same, with the same length normalisation (EOS counted as
a completion token). L_SFT here is the paper's: each chosen completion's
mean token NLL given its prompt, averaged over pairs; TRL averages over all
chosen tokens of the batch (and, for decoder-only models, over the prompt's
tokens as well), which is the same number when every chosen completion has
the same length and no prompt is scored.

Log-probabilities are per-sequence sums ([batch]) with their lengths, as for
`preference.direct_preference_loss`.
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common

Array = Any

# A length-normalised likelihood closer to 1 than this is taken as this: at
# P = 1 the log odds is +inf and its gradient not finite (it happens once
# every token of a completion rounds to probability 1 in float32).
MAX_MEAN_LOGPROB = -1e-6
_LOG_HALF = -math.log(2.0)


def log1mexp(x: Array) -> Array:
  """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (log1p of
  -exp(x) far from 0, log of -expm1(x) near it)."""
  return jnp.where(x < _LOG_HALF, jnp.log1p(-jnp.exp(x)),
                   jnp.log(-jnp.expm1(x)))


def orpo_loss(policy_chosen_logps: Array,
              policy_rejected_logps: Array,
              chosen_lengths: Array,
              rejected_lengths: Array,
              *,
              odds_ratio_weight: float = 0.1,
              weights: Optional[Array] = None) -> tuple[Array, dict]:
  """The ORPO loss (module docstring) of a batch of pairs.

  Args:
    policy_chosen_logps: [batch] log pi(y_w | x), summed over tokens.
    policy_rejected_logps: [batch] log pi(y_l | x).
    chosen_lengths: [batch] completion tokens of y_w (EOS included).
    rejected_lengths: [batch] completion tokens of y_l.
    odds_ratio_weight: lambda, the weight of L_OR (TRL's `beta`; its
      default 0.1).
    weights: optional [batch] per-pair weights (0 marks padding pairs).
  Returns:
    (loss scalar, metrics) with `loss`, `nll` (mean L_SFT),
    `odds_ratio_loss` (mean L_OR), `log_odds_ratio` (mean log odds(y_w) -
    log odds(y_l)), `chosen_logp` / `rejected_logp` (mean length-normalised
    log-likelihoods) and `reward_accuracy` (pairs whose chosen completion
    is the likelier per token, ties 1/2).
  """
  where = "orpo_loss"
  checks.check_rank(where, "policy_chosen_logps", policy_chosen_logps, 1,
                    "pass per-sequence log-probs ([batch]), e.g. "
                    "`common.sequence_logprob(token_logprobs, mask)`.")
  checks.check_same_shape(where, policy_chosen_logps=policy_chosen_logps,
                          policy_rejected_logps=policy_rejected_logps,
                          chosen_lengths=chosen_lengths,
                          rejected_lengths=rejected_lengths, weights=weights)
  if (isinstance(odds_ratio_weight, (int, float))
      and not odds_ratio_weight >= 0):
    raise ValueError(f"{where}: odds_ratio_weight must be >= 0, got "
                     f"{odds_ratio_weight}.")
  if weights is None:
    weights = jnp.ones(jnp.shape(policy_chosen_logps), jnp.float32)

  chosen = policy_chosen_logps / jnp.maximum(chosen_lengths, 1)
  rejected = policy_rejected_logps / jnp.maximum(rejected_lengths, 1)

  def log_odds(mean_logp):
    mean_logp = jnp.minimum(mean_logp, MAX_MEAN_LOGPROB)
    return mean_logp - log1mexp(mean_logp)

  log_odds_ratio = log_odds(chosen) - log_odds(rejected)
  odds_ratio_loss = common.masked_mean(-jax.nn.log_sigmoid(log_odds_ratio),
                                       weights)
  nll = common.masked_mean(-chosen, weights)
  loss = nll + odds_ratio_weight * odds_ratio_loss

  chosen, rejected = jax.lax.stop_gradient((chosen, rejected))
  metrics = {
      "loss": loss,
      "nll": nll,
      "odds_ratio_loss": odds_ratio_loss,
      "log_odds_ratio": common.masked_mean(
          jax.lax.stop_gradient(log_odds_ratio), weights),
      "chosen_logp": common.masked_mean(chosen, weights),
      "rejected_logp": common.masked_mean(rejected, weights),
      "reward_accuracy": common.masked_mean(
          common.win_indicator(chosen, rejected), weights),
  }
  return loss, metrics
