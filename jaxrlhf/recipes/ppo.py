"""PPO for RLHF with the published implementation details.

"The N+ implementation details of RLHF with PPO" (Huang et al. 2024,
details 20-25, Table 7), after Stiennon et al. 2020 / Ziegler et al. 2019.
One train step is one PPO iteration:

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

from jaxrlhf.losses import common
from jaxrlhf.recipes import online
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import ppo as ppo_lib
from jaxrlhf.rl import rollout as rollout_lib


class PPORecipe(online.OnlineRecipe):
  """Policy + value network (from the reward model) + frozen reference and
  reward model."""

  default_samples_per_prompt = 1
  default_num_epochs = 4  # Table 7: K = 4

  def init_trainable(self, rng):
    a, b = jax.random.split(rng)
    return {"policy": self.init_lm(a), "value": self.init_reward_net(b)}

  def networks_from_reward_model(self):
    return ("value",)  # detail 22

  def optimizer_configs(self):
    value = copy.deepcopy(self.config.optimizer)
    if self.config.ppo.value_learning_rate is not None:
      value.learning_rate = self.config.ppo.value_learning_rate
    return {"policy": self.config.optimizer, "value": value}

  def values(self, value_params, features):
    """V(s_t) [rows, L] at every response token t: the value head at the
    state that produced t, which has read the prompt and response tokens
    < t (for a decoder-only value network, the position before t;
    `rollout.response_values`). `features` are laid out for the value
    network, which has the reward model's architecture (detail 22)."""
    return rollout_lib.response_values(self.reward_lm, value_params, features,
                                       self.max_new_tokens)

  def rollout_targets(self, value_params, rollout, kl_coef):
    """Old values and the PPO targets (rewards, advantages, returns) of a
    rollout; every entry [rows, L]."""
    cfg = self.config
    old_values = jax.lax.stop_gradient(
        self.values(value_params, rollout.reward_features))
    targets = ppo_lib.ppo_rollout_targets(
        rollout.scores, rollout.logprobs, rollout.ref_logprobs, old_values,
        rollout.mask, kl_coef, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam,
        kl_estimator=cfg.online.kl_estimator,
        whiten_rewards=cfg.ppo.whiten_rewards,
        whiten_advantages=cfg.ppo.whiten_advantages)
    return dict(targets, old_values=old_values)

  def minibatch_loss(self, params, minibatch):
    """PPO's loss on one minibatch of rollout rows."""
    cfg = self.config
    logprobs, entropy, mask = self.policy_logprobs(params, minibatch)
    values = self.values(params["value"], minibatch)
    return ppo_lib.ppo_loss(
        logprobs, minibatch["old_logprobs"], minibatch["advantages"], values,
        minibatch["old_values"], minibatch["returns"], mask,
        clip_eps=cfg.online.clip_eps,
        value_clip_eps=(cfg.ppo.value_clip_eps if cfg.ppo.value_clipping
                        else None),
        vf_coef=cfg.ppo.vf_coef, entropy=entropy,
        entropy_coef=cfg.ppo.entropy_coef)

  def update_data(self, rollout, targets):
    """The rows PPO's epochs and minibatches train on: the policy's features
    and the value network's (the same keys when the architectures agree,
    disjoint keys when they do not), with the rollout's targets."""
    return dict(rollout.reward_features, **rollout.features,
                old_logprobs=rollout.logprobs, response_mask=rollout.mask,
                old_values=targets["old_values"],
                advantages=targets["advantages"], returns=targets["returns"])

  def update(self, state, rollout, rng):
    kl_coef = state.rl["kl_coef"]
    targets = self.rollout_targets(state.params["value"], rollout, kl_coef)
    params, opt_state, metrics = self.run_updates(
        state, self.update_data(rollout, targets), self.minibatch_loss, rng)
    mask = rollout.mask
    count = jnp.maximum(jnp.sum(mask), 1.0)
    metrics.update(rollout_lib.rollout_metrics(
        rollout, kl_coef, self.config.online.kl_estimator))
    # Mean m and std s of the per-token rewards before any whitening: a
    # response of L tokens gains L * m * (1 - 1/s) of return from reward
    # whitening that keeps the mean (detail 24), a length bonus or penalty.
    raw_rewards, _ = kl_lib.per_token_rewards(
        rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_coef,
        self.config.online.kl_estimator)
    metrics.update(token_reward_mean=common.masked_mean(raw_rewards, mask),
                   token_reward_std=jnp.sqrt(common.masked_var(
                       raw_rewards, mask, unbiased=False)))
    metrics.update(
        kl_coef=kl_coef,
        advantage_mean=jnp.sum(targets["advantages"] * mask) / count,
        return_mean=jnp.sum(targets["returns"] * mask) / count,
        value_mean=jnp.sum(targets["old_values"] * mask) / count,
        reward_per_token_mean=jnp.sum(targets["rewards"] * mask) / count)
    rl = dict(state.rl, kl_coef=self.next_kl_coef(kl_coef, rollout))
    return params, opt_state, rl, metrics
