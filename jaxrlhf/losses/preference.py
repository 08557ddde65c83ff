"""Direct alignment losses on preference pairs (DPO family) and on single
trajectories with binary feedback (KTO).

The pairwise losses all have the general form of the DRO paper (section 2):

  loss = mean_i f(z_i),   z_i = beta * Delta_i,
  Delta = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)],

with one f per `loss_type`:

  "dpo"         f(z) = -log sigmoid(z)                     Rafailov et al. 2023
  "cdpo"        f(z) = -(1-eps) log sigmoid(z) - eps log sigmoid(-z)
                conservative DPO: the label is trusted with prob. 1 - eps
  "robust_dpo"  f(z) = [(1-eps)(-log sigmoid(z)) - eps(-log sigmoid(-z))]
                       / (1 - 2 eps)                       Chowdhury et al. 2024
                an unbiased estimate of the clean DPO loss when labels are
                flipped with probability eps
  "ipo"         (Delta - 1/(2 beta))^2                     Azar et al. 2023
                (IPO's tau is `beta` here)
  "slic"        max(0, delta - beta * Delta)               hinge; see below

SLiC parametrisation: we use the DRO paper's f(z) = max(0, 1 - z) with z =
beta * Delta, generalised to a margin delta (`slic_delta`, default 1). The
original SLiC-HF calibration loss max(0, delta - log pi(y_w) + log pi(y_l)) is
the reference-free case with beta = 1 (`reference_free=True`). Scaling beta and
delta together only rescales the loss, so only their ratio delta / beta (the
log-ratio margin asked for) shapes the solution.

Length normalisation (`length_normalize=True`, SimPO / R-DPO style) divides
each completion's log-ratio by its length before taking Delta, so that long
completions do not dominate; `reference_free=True` drops pi_ref (SimPO), and
`target_margin` gamma is SimPO's margin in the logistic losses:
f(beta * Delta - gamma).

Log-probabilities are per-sequence sums over completion tokens ([batch]), e.g.
from `common.sequence_logprob`. Reference log-probabilities are treated as
constants (stop_gradient).

References: Richemond et al. 2024, "Offline Regularised Reinforcement
Learning for Large Language Models Alignment", section 2 (the general form)
and section 4 "KTO baseline" (mean-reward labels); Lambert, "Reinforcement
Learning from Human Feedback" (the RLHF book, 2025), 8.2 (DPO + NLL).
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
                    "pass per-sequence log-probs ([batch]), e.g. "
                    "`common.sequence_logprob(token_logprobs, mask)`.")


PAIRWISE_LOSS_TYPES = ("dpo", "cdpo", "robust_dpo", "ipo", "slic")
_LOGISTIC_LOSS_TYPES = ("dpo", "cdpo", "robust_dpo")


def _is_static_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def direct_preference_loss(policy_chosen_logps: Array,
                           policy_rejected_logps: Array,
                           ref_chosen_logps: Optional[Array],
                           ref_rejected_logps: Optional[Array],
                           *,
                           loss_type: str = "dpo",
                           beta: float = 0.1,
                           label_smoothing: float = 0.0,
                           slic_delta: float = 1.0,
                           target_margin: float = 0.0,
                           length_normalize: bool = False,
                           reference_free: bool = False,
                           chosen_lengths: Optional[Array] = None,
                           rejected_lengths: Optional[Array] = None,
                           nll_coef: float = 0.0,
                           weights: Optional[Array] = None
                           ) -> tuple[Array, Metrics]:
  """One entry point for DPO, cDPO, robust DPO, IPO and SLiC (+ NLL term).

  Args:
    policy_chosen_logps: [batch] log pi(y_w | x), summed over tokens.
    policy_rejected_logps: [batch] log pi(y_l | x).
    ref_chosen_logps: [batch] log pi_ref(y_w | x); None iff reference_free.
    ref_rejected_logps: [batch] log pi_ref(y_l | x); None iff reference_free.
    loss_type: one of PAIRWISE_LOSS_TYPES (see the module docstring).
    beta: inverse temperature of the implicit KL regularisation (IPO's tau).
      0.1 is DPO's usual value.
    label_smoothing: eps, the assumed label-flip rate, for "cdpo" (in
      [0, 1/2]) and "robust_dpo" (in [0, 1/2)); must be 0 for other losses.
    slic_delta: the hinge margin delta of "slic" (DRO paper: 1).
    target_margin: SimPO's gamma, subtracted from beta * Delta in the logistic
      losses ("dpo", "cdpo", "robust_dpo"); must be 0 for "ipo" and "slic".
    length_normalize: divide each completion's (policy and reference)
      log-probs by its length; needs `chosen_lengths` and `rejected_lengths`.
    reference_free: ignore pi_ref (its log-probs count as 0), as SimPO and the
      original SLiC-HF do.
    chosen_lengths: [batch] number of completion tokens of y_w (for
      `length_normalize` and the NLL term).
    rejected_lengths: [batch] number of completion tokens of y_l.
    nll_coef: alpha of DPO + NLL (RLHF book 8.2): adds alpha times the mean over
      pairs of the per-token NLL of the chosen completion,
      -log pi(y_w) / |y_w|; needs `chosen_lengths`.
    weights: optional [batch] per-pair weights (0 marks padding pairs); every
      mean above is weighted by them.
  Returns:
    (loss scalar, metrics) with `loss`, `preference_loss` (without NLL),
    `nll`, `log_ratio_gap` (mean Delta) and the implicit-reward metrics of
    the same normalised log-ratios that enter Delta
    (`implicit_reward_metrics`).
  """
  where = "direct_preference_loss"
  _rank("policy_chosen_logps", policy_chosen_logps, 1, where)
  if reference_free:
    ref_chosen_logps = jnp.zeros_like(policy_chosen_logps)
    ref_rejected_logps = jnp.zeros_like(policy_rejected_logps)
  elif ref_chosen_logps is None or ref_rejected_logps is None:
    raise ValueError(f"{where}: ref_chosen_logps and ref_rejected_logps are "
                     "required unless reference_free=True.")
  checks.check_same_shape(where, policy_chosen_logps=policy_chosen_logps,
                          policy_rejected_logps=policy_rejected_logps,
                          ref_chosen_logps=ref_chosen_logps,
                          ref_rejected_logps=ref_rejected_logps,
                          chosen_lengths=chosen_lengths,
                          rejected_lengths=rejected_lengths, weights=weights)
  _check_options(where, loss_type, beta, label_smoothing, target_margin)
  if length_normalize and (chosen_lengths is None or rejected_lengths is None):
    raise ValueError(f"{where}: length_normalize=True needs chosen_lengths and "
                     "rejected_lengths ([batch] completion token counts).")
  if not (_is_static_number(nll_coef) and nll_coef == 0) and (
      chosen_lengths is None):
    raise ValueError(f"{where}: nll_coef != 0 needs chosen_lengths to "
                     "normalise the chosen NLL per token.")

  if weights is None:
    weights = jnp.ones(jnp.shape(policy_chosen_logps), jnp.float32)
  chosen_log_ratio = policy_chosen_logps - jax.lax.stop_gradient(
      ref_chosen_logps)
  rejected_log_ratio = policy_rejected_logps - jax.lax.stop_gradient(
      ref_rejected_logps)
  if length_normalize:
    chosen_log_ratio = chosen_log_ratio / jnp.maximum(chosen_lengths, 1)
    rejected_log_ratio = rejected_log_ratio / jnp.maximum(rejected_lengths, 1)
  delta = chosen_log_ratio - rejected_log_ratio
  preference_loss = common.masked_mean(pairwise_losses(
      loss_type, delta, beta=beta, target_margin=target_margin,
      label_smoothing=label_smoothing, slic_delta=slic_delta), weights)
  if chosen_lengths is not None:
    nll = common.masked_mean(
        -policy_chosen_logps / jnp.maximum(chosen_lengths, 1), weights)
  else:
    nll = jnp.zeros((), preference_loss.dtype)
  loss = preference_loss + nll_coef * nll
  metrics = {
      "loss": loss,
      "preference_loss": preference_loss,
      "nll": nll,
      "log_ratio_gap": common.masked_mean(jax.lax.stop_gradient(delta),
                                          weights),
      **implicit_reward_metrics(beta * chosen_log_ratio,
                                beta * rejected_log_ratio, weights),
  }
  return loss, metrics


def _check_options(where, loss_type, beta, label_smoothing, target_margin):
  """The loss type and the options that are Python numbers (a traced value
  cannot be checked)."""
  if loss_type not in PAIRWISE_LOSS_TYPES:
    raise ValueError(f"{where}: unknown loss_type {loss_type!r}; choose one of "
                     f"{PAIRWISE_LOSS_TYPES}.")
  if _is_static_number(beta) and beta <= 0:
    raise ValueError(f"{where}: beta must be > 0, got {beta}.")
  if _is_static_number(label_smoothing):
    if loss_type == "robust_dpo" and not 0 <= label_smoothing < 0.5:
      raise ValueError(f"{where}: robust_dpo needs label_smoothing in "
                       f"[0, 0.5) (it divides by 1 - 2 eps), got "
                       f"{label_smoothing}.")
    if loss_type == "cdpo" and not 0 <= label_smoothing <= 0.5:
      raise ValueError(f"{where}: cdpo needs label_smoothing in [0, 0.5], got "
                       f"{label_smoothing}.")
    if loss_type not in ("cdpo", "robust_dpo") and label_smoothing != 0:
      raise ValueError(f"{where}: label_smoothing is only used by 'cdpo' and "
                       f"'robust_dpo', got {label_smoothing} with "
                       f"loss_type={loss_type!r}.")
  if (_is_static_number(target_margin) and target_margin != 0
      and loss_type not in _LOGISTIC_LOSS_TYPES):
    raise ValueError(f"{where}: target_margin applies to {_LOGISTIC_LOSS_TYPES}"
                     f" only; for {loss_type!r} use its own parameter "
                     "(slic_delta, or beta for ipo).")


def pairwise_losses(loss_type: str, delta: Array, *, beta, target_margin=0.0,
                    label_smoothing=0.0, slic_delta=1.0) -> Array:
  """f of the module docstring for each pair: [batch] losses of the
  log-ratio differences delta [batch]."""
  logits = beta * delta - target_margin
  eps = label_smoothing
  if loss_type == "dpo":
    return jax.nn.softplus(-logits)
  if loss_type == "cdpo":
    return (1 - eps) * jax.nn.softplus(-logits) + eps * jax.nn.softplus(logits)
  if loss_type == "robust_dpo":
    return ((1 - eps) * jax.nn.softplus(-logits)
            - eps * jax.nn.softplus(logits)) / (1 - 2 * eps)
  if loss_type == "ipo":
    return jnp.square(delta - 1.0 / (2.0 * beta))
  return jax.nn.relu(slic_delta - beta * delta)  # slic


def implicit_reward_metrics(chosen_reward: Array, rejected_reward: Array,
                            weights: Optional[Array] = None) -> Metrics:
  """What a pairwise loss reports of its implicit rewards (e.g. beta * (log
  pi - log pi_ref) of each completion, [batch] each): their means
  `chosen_reward` and `rejected_reward`, `reward_accuracy` (the chosen one
  above the rejected one, ties 1/2) and `reward_margin` (the mean
  difference); weighted means when `weights` are given."""
  if weights is None:
    weights = jnp.ones(jnp.shape(chosen_reward), jnp.float32)
  chosen_reward = jax.lax.stop_gradient(chosen_reward)
  rejected_reward = jax.lax.stop_gradient(rejected_reward)
  return {
      "chosen_reward": common.masked_mean(chosen_reward, weights),
      "rejected_reward": common.masked_mean(rejected_reward, weights),
      "reward_accuracy": common.masked_mean(
          common.win_indicator(chosen_reward, rejected_reward), weights),
      "reward_margin": common.masked_mean(chosen_reward - rejected_reward,
                                          weights),
  }


def kto_loss(policy_logps: Array,
             ref_logps: Array,
             desirable: Array,
             kl_policy_logps: Array,
             kl_ref_logps: Array,
             *,
             beta: float = 0.1,
             desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0,
             weights: Optional[Array] = None,
             kl_weights: Optional[Array] = None) -> tuple[Array, Metrics]:
  """Kahneman–Tversky Optimisation (Ethayarajh et al. 2024).

    r(x, y)  = log pi(y|x) - log pi_ref(y|x)
    z0       = stop_gradient(max(0, mean_j log pi(y'_j|x_j)
                                             - log pi_ref(y'_j|x_j)))
    v(x, y)  = lambda_D * sigmoid(beta (r - z0))   if y is desirable
               lambda_U * sigmoid(beta (z0 - r))   if y is undesirable
    loss     = mean_i [lambda_{y_i} - v(x_i, y_i)]

  z0 is KTO's batch estimate of KL(pi || pi_ref): it is computed on
  *mismatched* pairs (x_j, y'_j), a prompt with another example's completion
  (e.g. `kto_mismatched_indices`), so that it is not the log-ratio the loss is
  pushing on; it is a baseline, not a training signal, hence the stop-gradient.

  The DRO paper's KTO baseline (section 4) uses lambda_D = lambda_U = 1 ("do
  not weigh the loss in any manner") with labels from
  `desirable_from_rewards`.

  Args:
    policy_logps: [batch] log pi(y_i | x_i), summed over tokens.
    ref_logps: [batch] log pi_ref(y_i | x_i).
    desirable: [batch] bool (or 0/1), True for thumbs-up completions.
    kl_policy_logps: [kl_batch] log pi(y'_j | x_j) on mismatched pairs.
    kl_ref_logps: [kl_batch] log pi_ref(y'_j | x_j).
    beta: KTO's beta (the DRO paper's tau); 0.1 is KTO's default.
    desirable_weight: lambda_D.
    undesirable_weight: lambda_U.
    weights: optional [batch] per-example weights (0 for padding).
    kl_weights: optional [kl_batch] weights of the mismatched pairs.
  Returns:
    (loss scalar, metrics) with `loss`, `kl_baseline` (z0),
    `desirable_reward` / `undesirable_reward` (mean beta * r over each class,
    0 if the class is empty) and `desirable_fraction`.
  """
  where = "kto_loss"
  _rank("policy_logps", policy_logps, 1, where)
  _rank("kl_policy_logps", kl_policy_logps, 1, where)
  checks.check_same_shape(where, policy_logps=policy_logps, ref_logps=ref_logps,
                    desirable=desirable, weights=weights)
  checks.check_same_shape(where, kl_policy_logps=kl_policy_logps,
                    kl_ref_logps=kl_ref_logps, kl_weights=kl_weights)
  if weights is None:
    weights = jnp.ones(jnp.shape(policy_logps), jnp.float32)
  if kl_weights is None:
    kl_weights = jnp.ones(jnp.shape(kl_policy_logps), jnp.float32)
  is_desirable = jnp.asarray(desirable) > 0

  log_ratio = policy_logps - jax.lax.stop_gradient(ref_logps)
  kl_estimate = common.masked_mean(kl_policy_logps - kl_ref_logps, kl_weights)
  kl_baseline = jax.lax.stop_gradient(jnp.maximum(kl_estimate, 0.0))
  value = jnp.where(is_desirable,
                    desirable_weight * jax.nn.sigmoid(beta * (log_ratio
                                                              - kl_baseline)),
                    undesirable_weight * jax.nn.sigmoid(beta * (kl_baseline
                                                                - log_ratio)))
  class_weight = jnp.where(is_desirable, desirable_weight, undesirable_weight)
  loss = common.masked_mean(class_weight - value, weights)

  reward = jax.lax.stop_gradient(beta * log_ratio)
  desirable_w = weights * is_desirable
  undesirable_w = weights * (~is_desirable)
  metrics = {
      "loss": loss,
      "kl_baseline": kl_baseline,
      "desirable_reward": common.masked_mean(reward, desirable_w),
      "undesirable_reward": common.masked_mean(reward, undesirable_w),
      "desirable_fraction": common.masked_mean(is_desirable.astype(jnp.float32),
                                           weights),
  }
  return loss, metrics


def desirable_from_rewards(rewards: Array,
                           mask: Optional[Array] = None) -> Array:
  """Thumbs-up labels from scalar rewards, the DRO paper's KTO setup.

  Section 4, "KTO baseline": a completion is desirable when its reward is
  greater than the average reward over the minibatch, undesirable otherwise
  (a reward exactly at the mean counts as undesirable).

  Args:
    rewards: [batch] scalar rewards of single trajectories.
    mask: optional [batch], 1 for real examples; padding neither enters the
      mean nor is labelled desirable.
  Returns:
    [batch] bool, True for desirable.
  """
  _rank("rewards", rewards, 1, "desirable_from_rewards")
  if mask is None:
    mask = jnp.ones(jnp.shape(rewards), jnp.float32)
  checks.check_same_shape("desirable_from_rewards", rewards=rewards, mask=mask)
  batch_mean = common.masked_mean(rewards, mask)
  return (rewards > batch_mean) & (mask > 0)


def kto_mismatched_indices(batch_size: int) -> Array:
  """Completion index to pair with each prompt for KTO's KL baseline.

  Prompt i is scored with completion (i + 1) mod batch_size, so no pair is a
  real example (for batch_size > 1); the KTO reference implementation shifts
  the completions of the microbatch the same way.

  Returns:
    [batch_size] int32 indices into the batch's completions.
  """
  if batch_size < 2:
    raise ValueError("kto_mismatched_indices: the KL baseline needs at least 2"
                     f" examples to mismatch, got batch_size={batch_size}.")
  return (jnp.arange(batch_size, dtype=jnp.int32) + 1) % batch_size
