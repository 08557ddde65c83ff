"""REINFORCE with a baseline (RLHF book 11.1.1): the KL-penalised sequence
reward minus a baseline, which is a running mean of past batches (carried
between steps, checkpointed), the batch mean, or none.
"""

import dataclasses

import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_model_eval
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.algorithms.online import critic_free
from jaxrlhf.rl import advantages as advantages_lib

F = config_schema.Field

BASELINES = ("running_mean", "batch_mean", "none")

GROUP = config_schema.Group(
    "reinforce", "REINFORCE with a baseline.", [
        F("baseline", "running_mean",
          "Baseline subtracted from the KL-penalised sequence reward: "
          "'running_mean' (exponential moving average of past batches, part "
          "of the checkpointed state), 'batch_mean' or 'none'.",
          choices=BASELINES),
        F("baseline_decay", 0.9, "The running mean's decay.",
          bounds="[0, 1)"),
    ])



def advantages(trainer, state, rollout):
  cfg = trainer.config.reinforce
  rewards = critic_free.penalized_rewards(
      rollout, kl_control.coefficient(state),
      trainer.config.online.kl_estimator)
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


KL_PENALTY = kl_control.carried("online.kl_coef")

ALGORITHM = base.Algorithm(
    name="reinforce",
    summary="REINFORCE on the KL-penalised reward with a running-mean, "
    "batch-mean or no baseline.",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=recipe.Online(
        samples_per_prompt=1, num_epochs=1,
        targets=critic_free.make_targets(advantages),
        loss=critic_free.make_loss(critic_free.symmetric_clipping),
        loss_count=critic_free.make_loss_count(
            critic_free.symmetric_clipping)),
    carried=dataclasses.replace(KL_PENALTY, init=lambda config: dict(
        KL_PENALTY.init(config), baseline=0.0)),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, teacher.GROUP, GROUP),
    checks=(options.check_online,),
    pipeline_stage=True,
)
