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

All three use the clipped surrogate: with one epoch and one minibatch the
ratio is 1 and its gradient is the plain policy gradient -A grad log pi;
with more it keeps later updates near the sampling policy.
"""

import jax.numpy as jnp

from jaxrlhf.recipes import online
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import grpo as grpo_lib
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import rollout as rollout_lib


class _GroupRecipe(online.OnlineRecipe):
  """Shared update: advantages per response, then the clipped surrogate."""

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def advantages(self, state, rollout, kl_coef):
    """hook: ([rows] advantages, new rl state, extra metrics)."""
    raise NotImplementedError

  def loss_settings(self):
    """hook: (eps_low, eps_high, reduction, in-loss KL coefficient or None)."""
    o = self.config.online
    return o.clip_eps, o.clip_eps, o.pg_reduction, None

  def loss_count(self, minibatch):
    """A token mean counts tokens; the other reductions are means over
    responses (with a per-response or constant normaliser inside)."""
    reduction = self.loss_settings()[2]
    if reduction == "token_mean":
      return super().loss_count(minibatch)
    return jnp.asarray(minibatch["response_mask"].shape[0], jnp.float32)

  def penalized_rewards(self, rollout, kl_coef):
    """[rows] score - beta * KL(response) with the configured estimator."""
    return kl_lib.kl_penalized_sequence_rewards(
        rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask,
        kl_coef, self.config.online.kl_estimator)

  def update(self, state, rollout, rng):
    kl_coef = state.rl["kl_coef"]
    advantages, rl, extra = self.advantages(state, rollout, kl_coef)
    eps_low, eps_high, reduction, loss_kl_coef = self.loss_settings()

    def loss_fn(params, minibatch):
      logprobs, entropy, mask = self.policy_logprobs(params, minibatch)
      loss, metrics = grpo_lib.grpo_loss(
          logprobs, minibatch["old_logprobs"], minibatch["ref_logprobs"],
          minibatch["advantages"], mask, clip_eps_low=eps_low,
          clip_eps_high=eps_high,
          kl_coef=0.0 if loss_kl_coef is None else kl_coef,
          reduction=reduction, max_length=self.max_new_tokens)
      metrics["entropy"] = jnp.sum(entropy * mask) / jnp.maximum(
          jnp.sum(mask), 1.0)
      # grpo_loss's "kl" is the in-loss k3 term; name it for what it is.
      metrics["loss_kl_k3"] = metrics.pop("kl")
      return loss, metrics

    data = dict(rollout.features, old_logprobs=rollout.logprobs,
                ref_logprobs=rollout.ref_logprobs, advantages=advantages,
                response_mask=rollout.mask)
    params, opt_state, metrics = self.run_updates(state, data, loss_fn, rng)
    metrics.update(rollout_lib.rollout_metrics(
        rollout, kl_coef, self.config.online.kl_estimator))
    metrics.update(extra, kl_coef=kl_coef,
                   advantage_abs_mean=jnp.mean(jnp.abs(advantages)))
    rl = dict(rl, kl_coef=self.next_kl_coef(kl_coef, rollout))
    return params, opt_state, rl, metrics


class RLOORecipe(_GroupRecipe):
  default_samples_per_prompt = 4
  # Several clipped updates per batch, as TRL's RLOO trainer does by default.
  default_num_epochs = 4

  def advantages(self, state, rollout, kl_coef):
    rewards = self.penalized_rewards(rollout, kl_coef)
    return (advantages_lib.rloo_advantages(rewards, self.samples_per_prompt),
            state.rl, {})


class GRPORecipe(_GroupRecipe):
  default_samples_per_prompt = 4

  def init_rl_state(self):
    return {"kl_coef": float(self.config.grpo.kl_coef)}

  def loss_settings(self):
    cfg = self.config
    high = (cfg.online.clip_eps if cfg.grpo.clip_eps_high is None
            else cfg.grpo.clip_eps_high)
    return cfg.online.clip_eps, high, cfg.grpo.reduction, cfg.grpo.kl_coef

  def advantages(self, state, rollout, kl_coef):
    del kl_coef  # GRPO's KL is in the loss
    return (advantages_lib.grpo_advantages(
        rollout.scores, self.samples_per_prompt,
        scale_by_std=self.config.grpo.scale_by_std), state.rl, {})


class ReinforceRecipe(_GroupRecipe):
  default_samples_per_prompt = 1

  def init_rl_state(self):
    return dict(super().init_rl_state(), baseline=0.0)

  def advantages(self, state, rollout, kl_coef):
    cfg = self.config.reinforce
    rewards = self.penalized_rewards(rollout, kl_coef)
    rl = dict(state.rl)
    if cfg.baseline == "running_mean":
      # The baseline from before this batch, so it does not depend on the
      # batch's own samples; except at the first step, where the batch's own
      # mean beats a baseline of 0 that may be far from the rewards.
      first = state.step == 0
      baseline = jnp.where(first, jnp.mean(rewards), state.rl["baseline"])
      rl["baseline"] = advantages_lib.update_running_mean(
          baseline, rewards, cfg.baseline_decay)
    elif cfg.baseline == "batch_mean":
      baseline = advantages_lib.batch_mean_baseline(rewards)
    else:
      baseline = jnp.zeros((), rewards.dtype)
    return (advantages_lib.reinforce_advantages(rewards, baseline), rl,
            {"baseline": baseline})
