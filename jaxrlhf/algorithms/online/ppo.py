"""PPO for RLHF with the published implementation details.

"The N+ implementation details of RLHF with PPO" (Huang et al. 2024,
details 20-25, Table 7), after Stiennon et al. 2020 / Ziegler et al. 2019.
One train step is one PPO iteration (`recipe.Online.step`):

  rollout     the policy samples a fixed number of tokens at temperature 0.7,
              cut after the first EOS; the frozen reward model scores the EOS
              and a response without EOS gets -1 (detail 23); the policy and
              reference log-probs are taken at the same temperature
              (`jaxrlhf.rl.rollout`);
  targets     per-token reward = -beta * KL_t (k1 by default) plus the score
              at the last token; optional reward whitening that keeps the
              mean (detail 24); GAE with gamma = 1, lambda = 0.95; advantage
              whitening (detail 25); values from a separate value network
              initialised from the reward model (detail 22);
  updates     `online.num_epochs` (K = 4) passes of `online.num_minibatches`
              (1) clipped policy + clipped value updates (eps 0.2, c1 = 0.1),
              all inside the one jitted step.

The KL coefficient is fixed (0.05) or adaptive (`online.adaptive_kl`), kept
in the train state. Dropout is off (detail 7, checked by the config).

The `online` and `ppo` config defaults are Table 7's. What the pipeline
(`jaxrlhf.offline_pipeline`) and experiments/ppo_details.py scale down for a
tiny T5 trained from scratch on the synthetic task: 32 prompts per batch
instead of 512, 100-150 iterations (3,200-4,800 episodes) instead of 1M
episodes, and the shared optimizer (Adafactor, constant 1e-3 after warm-up)
instead of AdamW at 3e-6 with a linear decay; responses are at most 16
tokens instead of 53.
"""

import copy

import jax
import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_model_eval
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.losses import common
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import ppo_losses
from jaxrlhf.rl import rollout as rollout_lib

F = config_schema.Field

GROUP = config_schema.Group(
    "ppo", "PPO (Table 7's defaults).", [
        F("gamma", 1.0, "GAE discount (Table 7: 1.0).", bounds="[0, 1]"),
        F("lam", 0.95, "GAE lambda (Table 7: 0.95).", bounds="[0, 1]"),
        F("value_clipping", True, "Clip the value loss (Table 7: on)."),
        F("value_clip_eps", 0.2, "The value clipping epsilon (Table 7: 0.2).",
          bounds=">0"),
        F("vf_coef", 0.1, "Value loss weight c1 (Table 7: 0.1).",
          bounds=">=0"),
        F("whiten_rewards", False,
          "Whiten the per-token rewards of each batch without shifting their "
          "mean (detail 24; optional, off in Table 7)."),
        F("whiten_advantages", True, "Whiten the advantages (detail 25)."),
        F("value_learning_rate", None,
          "Learning rate of the value network (same optimizer kind and "
          "schedule); unset = optimizer.learning_rate, as in Table 7.",
          type=float, bounds=">0"),
        F("entropy_coef", 0.0,
          "Weight of an entropy bonus (0 in the paper; entropy is logged "
          "anyway).", bounds=">=0"),
    ])


def networks(trainer, rng):
  a, b = jax.random.split(rng)
  return {"policy": trainer.init_lm(a),
          "value": reward_sources.init_reward_net(trainer, b)}


def optimizers(config):
  cfg = config
  value = copy.deepcopy(cfg.optimizer)
  if cfg.ppo.value_learning_rate is not None:
    value.learning_rate = cfg.ppo.value_learning_rate
  return {"policy": cfg.optimizer, "value": value}


def values(value_lm, value_params, features, response_length: int):
  """V(s_t) [rows, L] at every response token t: the value head at the state
  that produced t, which has read the prompt and response tokens < t (for a
  decoder-only value network, the position before t;
  `rollout.response_values`). `features` are laid out for the value network,
  which has the reward model's architecture (detail 22)."""
  return rollout_lib.response_values(value_lm, value_params, features,
                                     response_length)


def rollout_targets(config, value_lm, value_params, rollout, kl_coef):
  """Old values (of the value network `value_lm` [rows, L]) and the PPO
  targets (rewards, advantages, returns) of a rollout; every entry
  [rows, L]."""
  cfg = config
  old_values = jax.lax.stop_gradient(
      values(value_lm, value_params, rollout.reward_features,
             rollout.mask.shape[1]))
  targets = ppo_losses.ppo_rollout_targets(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, old_values,
      rollout.mask, kl_coef, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam,
      kl_estimator=cfg.online.kl_estimator,
      whiten_rewards=cfg.ppo.whiten_rewards,
      whiten_advantages=cfg.ppo.whiten_advantages)
  return dict(targets, old_values=old_values)


def update_data(rollout, targets):
  """The rows PPO's epochs and minibatches train on: the policy's features
  and the value network's (the same keys when the architectures agree,
  disjoint keys when they do not), with the rollout's targets."""
  return dict(rollout.reward_features, **rollout_lib.update_rows(rollout),
              old_logprobs=rollout.logprobs, response_mask=rollout.mask,
              old_values=targets["old_values"],
              advantages=targets["advantages"], returns=targets["returns"])


def targets(trainer, state, rollout):
  """The update rows, the next KL coefficient, and the targets' metrics."""
  kl_coef = kl_control.coefficient(state)
  estimator = trainer.config.online.kl_estimator
  target = rollout_targets(trainer.config, trainer.online.rewards.lm,
                           state.params["value"], rollout, kl_coef)
  mask = rollout.mask
  count = jnp.maximum(jnp.sum(mask), 1.0)
  # Mean m and std s of the per-token rewards before any whitening: a
  # response of L tokens gains L * m * (1 - 1/s) of return from reward
  # whitening that keeps the mean (detail 24), a length bonus or penalty.
  raw_rewards, _ = kl_lib.per_token_rewards(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_coef,
      estimator)
  metrics = {
      "token_reward_mean": common.masked_mean(raw_rewards, mask),
      "token_reward_std": jnp.sqrt(common.masked_var(raw_rewards, mask,
                                                     unbiased=False)),
      "kl_coef": kl_coef,
      "advantage_mean": jnp.sum(target["advantages"] * mask) / count,
      "return_mean": jnp.sum(target["returns"] * mask) / count,
      "value_mean": jnp.sum(target["old_values"] * mask) / count,
      "reward_per_token_mean": jnp.sum(target["rewards"] * mask) / count,
  }
  algorithm_state = dict(state.algorithm_state, **{
      kl_control.KL_COEF: kl_control.next_coefficient(trainer.config, kl_coef,
                                                      rollout)})
  return update_data(rollout, target), algorithm_state, metrics


def minibatch_loss(trainer, params, minibatch, algorithm_state=None):
  """PPO's loss on one minibatch of rollout rows."""
  del algorithm_state
  cfg = trainer.config
  logprobs, entropy, mask = rollout_lib.policy_logprobs(
      trainer.lm, params["policy"], minibatch, cfg.online.temperature,
      trainer.online.response_length)
  value = values(trainer.online.rewards.lm, params["value"], minibatch,
                 trainer.online.response_length)
  return ppo_losses.ppo_loss(
      logprobs, minibatch["old_logprobs"], minibatch["advantages"], value,
      minibatch["old_values"], minibatch["returns"], mask,
      clip_eps=cfg.online.clip_eps,
      value_clip_eps=(cfg.ppo.value_clip_eps if cfg.ppo.value_clipping
                      else None),
      vf_coef=cfg.ppo.vf_coef, entropy=entropy,
      entropy_coef=cfg.ppo.entropy_coef)


ALGORITHM = base.Algorithm(
    name="ppo",
    summary="PPO with the N+ implementation details: value network from the "
    "reward model, GAE, clipped policy and value losses, EOS trick, "
    "whitening, fixed or adaptive KL.",
    data=base.PROMPTS,
    networks=base.Networks(
        trainable=networks, frozen=recipe.frozen_reference_and_reward,
        checkpoints=recipe.policy_and_reference_checkpoints,
        optimizers=optimizers, reference=True),
    training=recipe.Online(
        samples_per_prompt=1, num_epochs=4,  # Table 7: K = 4
        targets=targets, loss=minibatch_loss,
        value_from_reward_model=("value",)),  # detail 22
    carried=kl_control.carried("online.kl_coef"),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, teacher.GROUP, GROUP),
    checks=(options.check_online,),
    pipeline_stage=True,
)
