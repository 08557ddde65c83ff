"""What the critic-free online algorithms share: a response's advantage
comes from other rewards, not from a value network, and the update is the
clipped policy gradient (`jaxrlhf.rl.policy_gradient_losses`).

Each step samples `online.samples_per_prompt` (k) responses per prompt,
adjacent in the batch, and scores them as PPO does (EOS trick, reward at the
EOS, log-probs at the sampling temperature; `jaxrlhf.rl.rollout`). An
algorithm of this kind (`rloo`, `grpo`, `reinforce`) is its advantage
function plus its `Clipping` (how the surrogate is clipped, reduced and
regularised): `make_targets` and `make_loss` build the rest. With one
epoch and one minibatch the ratio is 1 and the gradient is the plain policy
gradient -A grad log pi (tests/test_rl_losses.py checks it); with more it
keeps later updates near the sampling policy.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import policy_gradient_losses
from jaxrlhf.rl import reductions
from jaxrlhf.rl import rollout as rollout_lib


@dataclasses.dataclass(frozen=True)
class Clipping:
  """How an algorithm's clipped surrogate is reduced and regularised:
  (eps_low, eps_high, reduction, whether its carried KL coefficient weighs
  a KL term of the loss, the importance ratio's level and the objective of
  `jaxrlhf.rl.policy_gradient_losses`)."""
  eps_low: float
  eps_high: float
  reduction: str
  loss_kl: bool
  ratio_level: str = "token"
  objective: str = "clipped"


def symmetric_clipping(config) -> Clipping:
  """RLOO and REINFORCE: symmetric clipping, online.pg_reduction, the KL in
  the reward."""
  o = config.online
  return Clipping(o.clip_eps, o.clip_eps, o.pg_reduction, loss_kl=False)


def penalized_rewards(rollout, kl_coef, kl_estimator: str):
  """[rows] score - beta * KL(response) with `kl_estimator`."""
  return kl_lib.kl_penalized_sequence_rewards(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask,
      kl_coef, kl_estimator)


def make_targets(advantages_fn: Callable):
  """The targets of a critic-free algorithm from its advantage function
  (trainer, state, rollout) -> ([rows], algorithm state, metrics); the
  carried KL coefficient (if any) moves by the KL controller."""

  def targets(trainer, state, rollout):
    advantages, algorithm_state, metrics = advantages_fn(trainer, state,
                                                         rollout)
    data = dict(rollout_lib.update_rows(rollout),
                old_logprobs=rollout.logprobs,
                advantages=advantages, response_mask=rollout.mask)
    if kl_control.scores_reference(trainer.algorithm, trainer.config):
      data["ref_logprobs"] = rollout.ref_logprobs
    metrics = dict(metrics, advantage_abs_mean=jnp.mean(jnp.abs(advantages)))
    kl_coef = kl_control.coefficient(state)
    if kl_coef is not None:
      metrics[kl_control.KL_COEF] = kl_coef
      algorithm_state = dict(
          algorithm_state, **{kl_control.KL_COEF: kl_control.next_coefficient(
              trainer.config, kl_coef, rollout)})
    return data, algorithm_state, metrics

  return targets


def make_loss(clipping_fn: Callable):
  """The clipped-surrogate loss of one minibatch under `clipping_fn`."""

  def loss(trainer, params, minibatch, algorithm_state):
    clipping = clipping_fn(trainer.config)
    logprobs, entropy, mask = rollout_lib.policy_logprobs(
        trainer.lm, params["policy"], minibatch,
        trainer.config.online.temperature, trainer.online.response_length)
    value, metrics = policy_gradient_losses.clipped_policy_gradient_loss(
        logprobs, minibatch["old_logprobs"], minibatch.get("ref_logprobs"),
        minibatch["advantages"], mask, clip_eps_low=clipping.eps_low,
        clip_eps_high=clipping.eps_high,
        kl_coef=(algorithm_state[kl_control.KL_COEF] if clipping.loss_kl
                 else 0.0),
        reduction=clipping.reduction,
        max_length=trainer.online.response_length,
        ratio_level=clipping.ratio_level, objective=clipping.objective)
    metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(
        jnp.sum(mask), 1.0)
    return value, metrics

  return loss


def make_loss_count(clipping_fn: Callable):
  """A token mean counts tokens; the other reductions are means over
  responses (with a per-response or constant normaliser inside)."""

  def count(config, minibatch):
    if clipping_fn(config).reduction == "token_mean":
      return reductions.response_token_count(minibatch)
    return reductions.response_count(minibatch)

  return count
