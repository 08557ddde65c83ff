"""BCO: Binary Classifier Optimization (Jung et al. 2024, "Binary Classifier
Optimization for Large Language Model Alignment") on thumbs up / down.

The policy is trained as a binary classifier whose logit is the implicit
reward minus a shift:

  r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x))
  loss    = mean_i [ -log sigmoid(r_i - delta)     if y_i is desirable
                     -log sigmoid(-(r_i - delta))  if y_i is undesirable ]

The reward shift delta is the running mean of every implicit reward the run
has seen (desirable and undesirable alike), the current batch's included:
the mean is updated with the batch first and then used, as TRL's
`BCOTrainer` does with its `RunningMoments` (count-weighted, so it is the
mean over all examples so far, not an exponential average). It is carried
between train steps (`running_mean_update`), and no gradient flows through
it. The paper's optional underlying-distribution matching (a density-ratio
weight on the undesirable examples from a prompt classifier) is not
implemented.
"""

from typing import Any, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common

Array = Any


def running_mean_update(mean: Array, count: Array, values: Array
                        ) -> Tuple[Array, Array]:
  """(mean, count) of a stream after the batch `values` [batch]: the mean of
  every value seen (TRL's RunningMoments.update, whose count starts at
  1e-24, so that the first batch's mean replaces the initial 0)."""
  values = jnp.asarray(values, jnp.float32)
  n = jnp.asarray(values.size, jnp.float32)
  total = count + n
  return mean + (jnp.mean(values) - mean) * n / total, total


def bco_loss(policy_logps: Array, ref_logps: Array, desirable: Array, *,
             beta: float, running_mean: Array, running_count: Array
             ) -> Tuple[Array, dict]:
  """BCO's loss of one batch (module docstring).

  Args:
    policy_logps: [batch] log pi(y_i | x_i), summed over tokens.
    ref_logps: [batch] log pi_ref(y_i | x_i).
    desirable: [batch] bool or 0/1, True for thumbs-up completions.
    beta: the implicit reward's beta (TRL's default 0.1).
    running_mean, running_count: the reward shift's state before this
      batch.
  Returns:
    (loss, metrics): `delta` and `delta_count` are the state after this
    batch (what the next step starts from), `chosen_reward` /
    `rejected_reward` the mean implicit rewards of the desirable /
    undesirable examples (0 for an empty class), `classifier_accuracy` the
    share of examples on the right side of delta.
  """
  where = "bco_loss"
  checks.check_rank(where, "policy_logps", policy_logps, 1,
                    "pass per-sequence log-probs ([batch]).")
  checks.check_same_shape(where, policy_logps=policy_logps,
                          ref_logps=ref_logps, desirable=desirable)
  is_desirable = jnp.asarray(desirable) > 0
  rewards = beta * (policy_logps - jax.lax.stop_gradient(ref_logps))
  delta, count = running_mean_update(running_mean, running_count,
                                     jax.lax.stop_gradient(rewards))
  logits = rewards - delta
  per_example = jnp.where(is_desirable, jax.nn.softplus(-logits),
                          jax.nn.softplus(logits))
  loss = jnp.mean(per_example)
  fixed = jax.lax.stop_gradient(rewards)
  chosen = is_desirable.astype(jnp.float32)
  metrics = {
      "loss": loss,
      "delta": delta,
      "delta_count": count,
      "chosen_reward": common.masked_mean(fixed, chosen),
      "rejected_reward": common.masked_mean(fixed, 1.0 - chosen),
      "classifier_accuracy": jnp.mean(
          (is_desirable == (fixed > delta)).astype(jnp.float32)),
  }
  return loss, metrics
