"""KL to the reference policy: per-token estimators, penalties, controllers.

RLHF keeps the policy near the reference with a KL penalty (RLHF book, ch. 4.2
and 8): J = E[r] - beta * KL(pi || pi_ref). On sampled tokens the KL is
estimated from the two log-probs of the token actually sampled (book, 8.1.2).

Estimators (Schulman, "Approximating KL divergence", 2020). For x ~ q and
r = p(x) / q(x), KL(q || p) = E_q[-log r]. Here q = pi (we sample from the
policy) and p = pi_ref, so r = pi_ref / pi and log r = ref_logprob - logprob:
  k1 = -log r                  unbiased, can be negative per token
  k2 = 1/2 (log r)^2           biased (low bias when pi ~ pi_ref), >= 0
  k3 = (r - 1) - log r         unbiased, >= 0 per token (log is concave)
"""

import jax.numpy as jnp

from jaxrlhf.losses import common
from jaxrlhf import checks
from jaxrlhf.rl import rollout_rewards

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs, ref_logprobs, estimator="k1"):
  """Per-sample estimate of KL(pi || pi_ref) for samples drawn from pi.

  Args:
    logprobs: [...] log pi(x) of the sampled x (the sampling policy).
    ref_logprobs: [...] log pi_ref(x) of the same x.
    estimator: "k1", "k2" or "k3" (see the module docstring).

  Returns:
    [...] per-sample estimates; their mean under pi is KL(pi || pi_ref) for
    k1 and k3, and E_pi[(log pi - log pi_ref)^2] / 2 for k2.
  """
  checks.check_choice("kl_estimate", "estimator", estimator, KL_ESTIMATORS)
  checks.check_same_shape("kl_estimate", logprobs=logprobs,
                           ref_logprobs=ref_logprobs)
  log_pi_over_ref = logprobs - ref_logprobs  # = -log r
  if estimator == "k1":
    return log_pi_over_ref
  if estimator == "k2":
    return 0.5 * jnp.square(log_pi_over_ref)
  # k3 = r - 1 - log r; expm1 keeps precision when r is close to 1, which is
  # the usual case near the reference. It grows as exp(.) when pi_ref >> pi on
  # a sampled token, which is rare under sampling from pi.
  return jnp.expm1(-log_pi_over_ref) + log_pi_over_ref


def sequence_kl(logprobs, ref_logprobs, mask, estimator="k1"):
  """Per-sequence KL estimate: the per-token estimates summed over the mask.

  Args:
    logprobs, ref_logprobs: [batch, length] log-probs of the sampled tokens.
    mask: [batch, length] response mask.
    estimator: "k1", "k2" or "k3".

  Returns:
    [batch] sum over response tokens (the KL of the whole response, since
    the sequence log-ratio is the sum of the token log-ratios).
  """
  checks.check_same_shape("sequence_kl", logprobs=logprobs,
                           ref_logprobs=ref_logprobs, mask=mask)
  per_token = kl_estimate(logprobs, ref_logprobs, estimator)
  return common.masked_sum(per_token, mask.astype(per_token.dtype), axis=-1)


def per_token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef,
                      estimator="k1"):
  """PPO's per-token reward: a KL penalty at every token, the score at the end.

  As in Ziegler et al. 2019 / Stiennon et al. 2020 (and Figure 11 of "N+
  implementation details", detail 22): reward_t = -beta * kl_t on every
  response token, plus the sequence score on the last real token.

  Args:
    scores: [batch] sequence scores (already EOS-penalised if wanted, see
      `rollout_rewards.replace_score_without_eos`).
    logprobs: [batch, length] log pi of the sampled tokens at rollout time.
    ref_logprobs: [batch, length] log pi_ref of the same tokens.
    mask: [batch, length] response mask.
    kl_coef: scalar beta (float or 0-d array, e.g. an adaptive controller's).
    estimator: "k1" (the usual choice for PPO rewards), "k2" or "k3".

  Returns:
    rewards: [batch, length], zero outside the mask.
    kl: [batch, length] per-token KL estimates, zero outside the mask.
  """
  checks.check_same_shape("per_token_rewards", logprobs=logprobs,
                           ref_logprobs=ref_logprobs, mask=mask)
  if scores.shape != logprobs.shape[:1]:
    raise ValueError(
        f"per_token_rewards: scores has shape {list(scores.shape)}; expected "
        f"[batch] = [{logprobs.shape[0]}], one score per response.")
  mask = mask.astype(logprobs.dtype)
  kl = kl_estimate(logprobs, ref_logprobs, estimator) * mask
  last = rollout_rewards.last_token_index(mask)
  at_last = (jnp.arange(mask.shape[-1])[None, :] == last[:, None])
  score_tokens = jnp.where(at_last, scores[:, None], 0.0) * mask
  return -kl_coef * kl + score_tokens, kl


def kl_penalized_sequence_rewards(scores, logprobs, ref_logprobs, mask,
                                  kl_coef, estimator="k1"):
  """Sequence-level reward with the KL folded in: r - beta * KL_seq.

  This is how REINFORCE/RLOO treat the whole response as one action (RLHF
  book, 11.1.3: "RLOO sums it over the completion").

  Args:
    scores: [batch] sequence scores.
    logprobs, ref_logprobs, mask: [batch, length].
    kl_coef: scalar beta.
    estimator: "k1", "k2" or "k3".

  Returns:
    [batch] scores - kl_coef * sequence_kl.
  """
  if scores.shape != logprobs.shape[:1]:
    raise ValueError(
        f"kl_penalized_sequence_rewards: scores has shape "
        f"{list(scores.shape)}; expected [batch] = [{logprobs.shape[0]}].")
  return scores - kl_coef * sequence_kl(logprobs, ref_logprobs, mask,
                                        estimator)


# The KL controller. Its state is just the coefficient: a float or 0-d
# array carried in the train state, updated once per rollout batch (a fixed
# coefficient is one that is never updated).


def adaptive_kl_coef(kl_coef, observed_kl, n_steps, target, horizon):
  """Adaptive controller of Ziegler et al. 2019 (section 2.2).

  beta <- beta * (1 + clip((KL - target) / target, -0.2, 0.2) * n / horizon):
  beta rises when the policy drifts past the target KL and falls below it,
  by at most 20% of n / horizon per update.

  Args:
    kl_coef: current beta (scalar).
    observed_kl: mean per-sequence KL(pi || pi_ref) of the last batch.
    n_steps: episodes in that batch (Ziegler et al. count samples).
    target: target KL (6.0 in Ziegler et al.'s lm-human-preferences).
    horizon: in samples (10000 there).

  Returns:
    The new beta.
  """
  proportional_error = jnp.clip((observed_kl - target) / target, -0.2, 0.2)
  return kl_coef * (1.0 + proportional_error * n_steps / horizon)
