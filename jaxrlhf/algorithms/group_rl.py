"""Critic-free online RL: RLOO, GRPO and REINFORCE with a baseline.

No value network: a response's advantage comes from other rewards. Each
step samples `online.samples_per_prompt` (k) responses per prompt, adjacent
in the batch, and scores them as PPO does (EOS trick, reward at the EOS,
log-probs at the sampling temperature; `jaxrlhf.rl.rollout`).

  RLOO       (Ahmadian et al. 2024; RLHF book 11.1.3) the reward is the
             score minus beta * the response's KL to the reference summed
             over its tokens; the baseline of a response is the mean reward
             of the other k - 1 responses to its prompt.
  GRPO       (Shao et al. 2024; book 11.1.5, 11.2.3) advantages are the
             score's deviation from its group's mean, divided by the group
             std (or not: Dr. GRPO); the KL is a k3 term of the loss
             (grpo.kl_coef), not of the reward; eps_low / eps_high clipping
             and the loss reductions of `jaxrlhf.rl.reductions`.
  REINFORCE  (book 11.1.1) KL-penalised reward minus a baseline: a running
             mean of past batches (state, checkpointed), the batch mean, or
             none.

All three use the clipped surrogate (`rl.grpo.grpo_loss`): with one epoch and
one minibatch the ratio is 1 and its gradient is the plain policy gradient
-A grad log pi (tests/test_rl_losses.py checks it); with more it keeps
later updates near the sampling policy.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import online
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import grpo as grpo_lib
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import reductions

F = config_schema.Field

GRPO_GROUP = config_schema.Group(
    "grpo", "GRPO and its variants (DAPO's clip-higher, Dr. GRPO).", [
        F("kl_coef", 0.04,
          "beta of the k3 KL(pi || reference) term in the loss "
          "(DeepSeekMath: 0.04).", bounds=">=0"),
        F("clip_eps_high", None,
          "Upper clip epsilon (DAPO's clip-higher); unset = "
          "online.clip_eps.", type=float, bounds=">0"),
        F("reduction", "sequence_mean",
          "'sequence_mean' (GRPO), 'token_mean' (DAPO), 'constant_length' "
          "(Dr. GRPO: divide by batch * online.max_new_tokens), "
          "'sequence_sum'.", choices=reductions.LOSS_REDUCTIONS),
        F("scale_by_std", True,
          "Divide the group-centred rewards by the group std (GRPO); False "
          "is Dr. GRPO's unscaled advantage."),
    ])

BASELINES = ("running_mean", "batch_mean", "none")

REINFORCE_GROUP = config_schema.Group(
    "reinforce", "REINFORCE with a baseline.", [
        F("baseline", "running_mean",
          "Baseline subtracted from the KL-penalised sequence reward: "
          "'running_mean' (exponential moving average of past batches, part "
          "of the checkpointed state), 'batch_mean' or 'none'.",
          choices=BASELINES),
        F("baseline_decay", 0.9, "The running mean's decay.",
          bounds="[0, 1)"),
    ])


@dataclasses.dataclass(frozen=True)
class Clipping:
  """How a group algorithm's clipped surrogate is reduced and regularised:
  (eps_low, eps_high, reduction, KL coefficient in the loss or None)."""
  eps_low: float
  eps_high: float
  reduction: str
  loss_kl: bool


def pg_clipping(config) -> Clipping:
  """RLOO and REINFORCE: symmetric clipping, online.pg_reduction, the KL in
  the reward."""
  o = config.online
  return Clipping(o.clip_eps, o.clip_eps, o.pg_reduction, loss_kl=False)


def grpo_clipping(config) -> Clipping:
  o, g = config.online, config.grpo
  high = o.clip_eps if g.clip_eps_high is None else g.clip_eps_high
  return Clipping(o.clip_eps, high, g.reduction, loss_kl=True)


def penalized_rewards(trainer, rollout, kl_coef):
  """[rows] score - beta * KL(response) with the configured estimator."""
  return kl_lib.kl_penalized_sequence_rewards(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask,
      kl_coef, trainer.config.online.kl_estimator)


def make_targets(advantages_fn: Callable):
  """The targets of a group algorithm from its advantage function
  (trainer, state, rollout, kl_coef) -> ([rows], algorithm state, metrics)."""

  def targets(trainer, state, rollout):
    kl_coef = state.algorithm_state["kl_coef"]
    advantages, algorithm_state, metrics = advantages_fn(trainer, state,
                                                         rollout, kl_coef)
    data = dict(rollout.features, old_logprobs=rollout.logprobs,
                ref_logprobs=rollout.ref_logprobs, advantages=advantages,
                response_mask=rollout.mask)
    metrics = dict(metrics, kl_coef=kl_coef,
                   advantage_abs_mean=jnp.mean(jnp.abs(advantages)))
    algorithm_state = dict(algorithm_state,
                           kl_coef=online.next_kl_coef(trainer, kl_coef,
                                                       rollout))
    return data, algorithm_state, metrics

  return targets


def make_loss(clipping_fn: Callable):
  """The clipped-surrogate loss of one minibatch under `clipping_fn`."""

  def loss(trainer, params, minibatch, algorithm_state):
    clipping = clipping_fn(trainer.config)
    logprobs, entropy, mask = online.policy_logprobs(trainer, params,
                                                     minibatch)
    value, metrics = grpo_lib.grpo_loss(
        logprobs, minibatch["old_logprobs"], minibatch["ref_logprobs"],
        minibatch["advantages"], mask, clip_eps_low=clipping.eps_low,
        clip_eps_high=clipping.eps_high,
        kl_coef=(algorithm_state["kl_coef"] if clipping.loss_kl else 0.0),
        reduction=clipping.reduction,
        max_length=trainer.online.max_new_tokens)
    metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(
        jnp.sum(mask), 1.0)
    # grpo_loss's "kl" is the in-loss k3 term; name it for what it is.
    metrics["loss_kl_k3"] = metrics.pop("kl")
    return value, metrics

  return loss


def make_loss_count(clipping_fn: Callable):
  """A token mean counts tokens; the other reductions are means over
  responses (with a per-response or constant normaliser inside)."""

  def count(trainer, minibatch):
    if clipping_fn(trainer.config).reduction == "token_mean":
      return online.token_count(trainer, minibatch)
    return online.response_count(trainer, minibatch)

  return count


# --- RLOO ----------------------------------------------------------------------------


def rloo_advantages(trainer, state, rollout, kl_coef):
  rewards = penalized_rewards(trainer, rollout, kl_coef)
  return (advantages_lib.rloo_advantages(rewards,
                                         trainer.online.samples_per_prompt),
          state.algorithm_state, {})


RLOO = base.Algorithm(
    name="rloo",
    summary="REINFORCE leave-one-out: each response's baseline is the mean "
    "KL-penalised reward of the other responses to its prompt.",
    data=base.PROMPTS,
    networks=online.POLICY_REFERENCE_AND_REWARD,
    training=base.Online(
        samples_per_prompt=4,
        # Several clipped updates per batch, as TRL's RLOO trainer does.
        num_epochs=4,
        targets=make_targets(rloo_advantages), loss=make_loss(pg_clipping),
        loss_count=make_loss_count(pg_clipping),
        algorithm_state=online.kl_coef_state),
    evaluation=online.EVALUATION,
    config_groups=(online.ONLINE,),
    checks=(online.check_online, online.check_groups_of_two),
)


# --- GRPO ----------------------------------------------------------------------------


def grpo_advantages(trainer, state, rollout, kl_coef):
  del kl_coef  # GRPO's KL is in the loss
  return (advantages_lib.grpo_advantages(
      rollout.scores, trainer.online.samples_per_prompt,
      scale_by_std=trainer.config.grpo.scale_by_std), state.algorithm_state,
          {})


def grpo_state(config):
  """GRPO's carried KL coefficient is its loss's (grpo.kl_coef)."""
  return {"kl_coef": float(config.grpo.kl_coef)}


GRPO = base.Algorithm(
    name="grpo",
    summary="Group-relative policy optimisation: group-normalised "
    "advantages, a k3 KL term in the loss, asymmetric clipping and the loss "
    "reductions of DAPO and Dr. GRPO.",
    data=base.PROMPTS,
    networks=online.POLICY_REFERENCE_AND_REWARD,
    training=base.Online(
        samples_per_prompt=4, num_epochs=1,
        targets=make_targets(grpo_advantages), loss=make_loss(grpo_clipping),
        loss_count=make_loss_count(grpo_clipping),
        algorithm_state=grpo_state),
    evaluation=online.EVALUATION,
    config_groups=(online.ONLINE, GRPO_GROUP),
    checks=(online.check_online, online.check_groups_of_two),
)


# --- REINFORCE ----------------------------------------------------------------------


def reinforce_advantages(trainer, state, rollout, kl_coef):
  cfg = trainer.config.reinforce
  rewards = penalized_rewards(trainer, rollout, kl_coef)
  algorithm_state = dict(state.algorithm_state)
  if cfg.baseline == "running_mean":
    # The baseline from before this batch, so it does not depend on the
    # batch's own samples; except at the first step, where the batch's own
    # mean beats a baseline of 0 that may be far from the rewards.
    first = state.step == 0
    baseline = jnp.where(first, jnp.mean(rewards),
                         state.algorithm_state["baseline"])
    algorithm_state["baseline"] = advantages_lib.update_running_mean(
        baseline, rewards, cfg.baseline_decay)
  elif cfg.baseline == "batch_mean":
    baseline = advantages_lib.batch_mean_baseline(rewards)
  else:
    baseline = jnp.zeros((), rewards.dtype)
  return (advantages_lib.reinforce_advantages(rewards, baseline),
          algorithm_state, {"baseline": baseline})


def reinforce_state(config):
  return dict(online.kl_coef_state(config), baseline=0.0)


REINFORCE = base.Algorithm(
    name="reinforce",
    summary="REINFORCE on the KL-penalised reward with a running-mean, "
    "batch-mean or no baseline.",
    data=base.PROMPTS,
    networks=online.POLICY_REFERENCE_AND_REWARD,
    training=base.Online(
        samples_per_prompt=1, num_epochs=1,
        targets=make_targets(reinforce_advantages),
        loss=make_loss(pg_clipping), loss_count=make_loss_count(pg_clipping),
        algorithm_state=reinforce_state),
    evaluation=online.EVALUATION,
    config_groups=(online.ONLINE, REINFORCE_GROUP),
    checks=(online.check_online,),
)
