"""DRO-V: Direct Reward Optimisation with a learned value (Richemond et al.).

Single-trajectory data (x_i, y_i, r_i), y_i ~ mu(.|x_i) for any behaviour
policy mu. Paper: Richemond et al. 2024, "Offline Regularised Reinforcement
Learning for Large Language Models Alignment", section 3.

The DRO loss (equation 4), for a policy pi_theta and a value V_phi:

  L(pi, V) = 1/2 E_{x, y~mu}[(r(x, y) - V(x) - tau log(pi(y|x)/pi_ref(y|x)))^2]

Its unique minimiser (Theorem 1, when mu and pi_ref have the same support) is
equation 2: pi*(y|x) = pi_ref(y|x) exp(r(x, y)/tau) / exp(V*(x)/tau) with
V*(x) = tau log E_{y~pi_ref}[exp(r(x, y)/tau)], whatever mu is.

Writing l_i = log pi(y_i|x_i) - log pi_ref(y_i|x_i), the gradients (batch
mean, as in Algorithm 1) are

  eq. 7  grad_phi L   = mean_i (V(x_i) - r_i + tau l_i) grad_phi V(x_i)
  eq. 8  grad_theta L = -tau mean_i [grad_theta log pi(y_i|x_i) (r_i - V(x_i))
                                     - tau/2 grad_theta l_i^2]

DRO-V multiplies the policy's *update* by 1/tau ("policy learning rate
rescaling", end of section 3.3: "we rescale the policy gradient Equation (8) by
multiplying the update by a factor of 1/tau"). That is not part of the loss:
Adafactor and Adam normalise the gradient's scale away, so a loss multiplied by
1/tau would move them exactly as far as the loss itself. The algorithm applies
it to the policy's update after its optimizer
(`jaxrlhf.algorithms.offline.dro.update_scales`); this module's losses give eq. 8 and
eq. 7 as they are.

Note on Algorithm 1: as printed it writes the regulariser of the rescaled
policy gradient as 1/2 grad l^2, without tau. That only agrees with eq. 8 / tau
for tau = 1 (the paper's setting). For other tau it is not a rescaled gradient
of eq. 4: per sample it pushes towards log(pi/pi_ref) = r - V instead of
(r - V)/tau, so it cannot converge to the optimum of Theorem 1. We implement
eq. 8 (whose rescaled update is eq. 8 / tau, i.e. tau/2 grad l^2);
tests/test_losses_dro.py checks that descending it reaches pi* and V* of
equation 2 for tau = 0.5 and 2.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxrlhf import checks
from jaxrlhf.losses import common

Array = Any
Metrics = dict


def dro_v_losses(policy_logps: Array,
                 ref_logps: Array,
                 values: Array,
                 rewards: Array,
                 *,
                 tau: float = 1.0,
                 single_value_per_batch: bool = False,
                 weights: Optional[Array] = None
                 ) -> tuple[Array, Array, Metrics]:
  """Surrogate losses whose gradients are DRO-V's eqs. 8 (policy) and 7 (value).

  With l = log pi - log pi_ref and a = stop_gradient(r - V):

    policy_loss = tau mean_i [-a_i log pi(y_i|x_i) + tau/2 l_i^2]       (eq. 8)
    value_loss  = 1/2 mean_i (stop_gradient(r_i - tau l_i) - V(x_i))^2  (eq. 7)

  so d policy_loss / d log pi_i = -tau (w_i / sum w) (r_i - V_i - tau l_i) and
  d value_loss / d V_i = (w_i / sum w) (V_i - r_i + tau l_i). Each loss stops
  the gradient into the other network's output, so the two networks (separate
  parameters, learning rates and optimizers, section 3.3) can be updated from
  `jax.grad` of policy_loss + value_loss and each receives exactly its own
  equation. The value of value_loss is the DRO loss (eq. 4); the value of
  policy_loss is only a surrogate. DRO-V's 1/tau policy rescaling belongs to
  the policy's update, not here (see the module docstring).

  Args:
    policy_logps: [batch] log pi_theta(y_i | x_i), summed over completion
      tokens (`common.sequence_logprob`).
    ref_logps: [batch] log pi_ref(y_i | x_i) (treated as a constant).
    values: [batch] V_phi(x_i), one value per example (the paper's default);
      or a scalar [] shared by the whole batch.
    rewards: [batch] scalar rewards r(x_i, y_i) (the paper normalises them to
      mean 0, variance 1 over the dataset).
    tau: KL regularisation strength (paper default 1.0).
    single_value_per_batch: the Figure 5 ablation: every example uses the
      batch mean of `values` as V, so one number per batch is learned; its
      gradient is eq. 7 summed over the batch and shared out equally.
    weights: optional [batch] example weights (0 marks padding); the batch
      means above become weighted means.
  Returns:
    (policy_loss, value_loss, metrics): metrics `dro_loss` (eq. 4),
    `value_mean`, `reward_mean`, `log_ratio_mean` (an off-policy estimate of
    KL-like drift), `advantage_mean` (mean r - V), `residual_abs_mean` (mean
    |r - V - tau l|, 0 at the optimum).
  """
  where = "dro_v_losses"
  if jnp.ndim(policy_logps) != 1:
    raise ValueError(
        f"{where}: policy_logps must be [batch] per-sequence log-probs, got "
        f"shape {jnp.shape(policy_logps)}; reduce per-token log-probs with "
        "`common.sequence_logprob(token_logprobs, mask)`.")
  checks.check_same_shape(where, policy_logps=policy_logps, ref_logps=ref_logps,
                    rewards=rewards, weights=weights)
  if jnp.ndim(values) not in (0, 1) or (
      jnp.ndim(values) == 1 and jnp.shape(values) != jnp.shape(policy_logps)):
    raise ValueError(
        f"{where}: values must be [batch] (one V(x_i) per example, shape "
        f"{jnp.shape(policy_logps)}) or a scalar shared by the batch, got "
        f"shape {jnp.shape(values)}.")
  if isinstance(tau, (int, float)) and tau <= 0:
    raise ValueError(f"{where}: tau must be > 0, got {tau}.")
  if weights is None:
    weights = jnp.ones(jnp.shape(policy_logps), jnp.float32)

  if single_value_per_batch:
    values = common.masked_mean(jnp.broadcast_to(values, jnp.shape(policy_logps)),
                            weights)
  values = jnp.broadcast_to(values, jnp.shape(policy_logps))
  ref_logps = jax.lax.stop_gradient(ref_logps)
  rewards = jax.lax.stop_gradient(rewards)
  log_ratio = policy_logps - ref_logps

  # Eq. 8. V enters only through the stopped advantage: it is the value
  # network's output, not a function of the policy parameters.
  advantage = rewards - jax.lax.stop_gradient(values)
  policy_loss = tau * common.masked_mean(
      -advantage * policy_logps + 0.5 * tau * jnp.square(log_ratio), weights)

  # Eq. 7: regress V onto r - tau l with the policy held fixed.
  value_target = rewards - tau * jax.lax.stop_gradient(log_ratio)
  value_loss = 0.5 * common.masked_mean(jnp.square(value_target - values), weights)

  residual = jax.lax.stop_gradient(rewards - values - tau * log_ratio)
  metrics = {
      "dro_loss": 0.5 * common.masked_mean(jnp.square(residual), weights),
      "value_mean": common.masked_mean(jax.lax.stop_gradient(values), weights),
      "reward_mean": common.masked_mean(rewards, weights),
      "log_ratio_mean": common.masked_mean(jax.lax.stop_gradient(log_ratio),
                                       weights),
      "advantage_mean": common.masked_mean(advantage, weights),
      "residual_abs_mean": common.masked_mean(jnp.abs(residual), weights),
  }
  return policy_loss, value_loss, metrics


def optimal_policy_and_value(ref_logprobs: Array, rewards: Array, *,
                             tau: float = 1.0) -> tuple[Array, Array]:
  """Closed-form optimum of equation 2 for a finite set of completions.

  Useful as ground truth on tabular problems and for evaluating learned
  values on enumerable toy tasks.

  Args:
    ref_logprobs: [..., num_completions] log pi_ref(y|x), normalised over
      the last axis.
    rewards: [..., num_completions] r(x, y).
    tau: regularisation strength.
  Returns:
    (log pi*(y|x) [..., num_completions], V*(x) [...]), with
    V* = tau log sum_y pi_ref(y|x) exp(r(x, y)/tau).
  """
  checks.check_same_shape("optimal_policy_and_value", ref_logprobs=ref_logprobs,
                    rewards=rewards)
  scores = ref_logprobs + rewards / tau
  log_partition = jax.nn.logsumexp(scores, axis=-1)
  return scores - log_partition[..., None], tau * log_partition
