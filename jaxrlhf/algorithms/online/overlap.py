"""Generation overlapped with training: one-step off-policy online RL.

Most of an online step is sampling, and the update waits for it. With
`online.sampler_devices` = n, n devices (an equal share of each process's)
form a mesh of their own that samples and scores rollouts, and the rest
train; with `online.off_policy_steps=1` the two work at the same time:

  sampler devices    rollout t+1 = sample and score prompts t+1 with the
                     parameters step t starts from (and the host rewards,
                     which the host computes meanwhile)
  training devices   parameters t+1 = the update of step t on rollout t

so step t's update is not waited for by step t+1's sampling (verl's and
NeMo-RL's one-step off-policy mode, AReaL's staleness 1). The parameters
move to the sampler with a resharding `jax.device_put` once per step (the
frozen reference and reward model once per run), and each rollout moves
back the same way. Prompts t+1 are the stream's next batch, read ahead
without moving it, so the data position (and a resumed run's) is the
on-policy run's.

The update trains on responses of the previous parameters. The rollout's
log-probs are computed on the sampler with the parameters that sampled
(`iteration.assemble`), and `online.off_policy_correction` says what the
update does with them:

  sampling   the ratios of ppo, grpo, rloo and reinforce take them as the
             old policy: each token's importance ratio pi / pi_sample,
             truncated by the algorithm's clip (PPO's own answer to data
             from an older policy).
  decoupled  the training devices re-score the responses with the
             parameters the update starts from (pi_start), which the ratios
             take as their old policy, and each token's advantage is
             weighted by the truncated importance weight
             min(pi_start / pi_sample, online.importance_weight_cap), a
             constant of the loss (AReaL's decoupled PPO objective, Fu et
             al. 2025, eq. 5; verl's truncated importance sampling).
             Logged: off_policy/weight_mean, off_policy/capped_fraction.

The first step of a run, and of a resumed one, has no rollout in flight: it
samples with the parameters it starts from. `off_policy_steps=0` with
sampler devices samples every step's rollout with the parameters its update
starts from: the on-policy results on a mesh split in two
(tests/test_eight_devices.py).
"""

import jax
import jax.numpy as jnp

from jaxrlhf import sharding
from jaxrlhf.algorithms.online import host_split
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import common
from jaxrlhf.rl import rollout as rollout_lib


def overlaps(trainer) -> bool:
  """The run samples on devices of its own, or one step ahead."""
  o = trainer.config.online
  return bool(o.off_policy_steps or o.sampler_devices)


def _on_mesh(shardings, mesh):
  """The same partition specs on another mesh."""
  return jax.tree.map(
      lambda s: jax.sharding.NamedSharding(mesh, s.spec), shardings)


def _rows_on(mesh, rules, tree):
  """Shardings of a rollout's arrays on `mesh`: rows over the batch axes,
  scalars replicated."""
  return jax.tree.map(
      lambda x: (sharding.batch_sharding(mesh, rules, x.ndim) if x.ndim
                 else sharding.replicated(mesh)), tree)


class OverlappedStep:
  """(state, batch) -> (state, metrics) with rollouts made on the sampler's
  mesh, one step ahead with `online.off_policy_steps=1` (module
  docstring)."""

  def __init__(self, trainer):
    t = self._trainer = trainer
    o = t.config.online
    self._ahead = bool(o.off_policy_steps)
    self._decoupled = self._ahead and o.off_policy_correction == "decoupled"
    mesh = sharding.sampler_mesh(t.config)
    if mesh is None:
      mesh = t.mesh
    elif set(mesh.devices.flat) & set(t.mesh.devices.flat):
      raise ValueError(
          "config.online.sampler_devices: the sampler's devices are among "
          "the training mesh's; build the trainer on "
          "`sharding.training_mesh(config)`.")
    self.mesh = mesh
    self._rollouts = host_split.HostSplitStep(t, mesh=mesh)
    self._params_on_sampler = _on_mesh(t.state_shardings.params, mesh)
    self._frozen_on_sampler = _on_mesh(t.state_shardings.frozen, mesh)
    self._frozen = None  # the frozen networks on the sampler, moved once
    self._pending = None  # (rollout on the sampler, host metrics)
    self._step = None  # the step the next call runs
    cap = o.importance_weight_cap

    def finish(state, rollout, update_rng, next_rng):
      weights, metrics = None, {}
      if self._decoupled:
        start, _, _ = rollout_lib.logprobs_and_entropy(
            t.lm, state.params["policy"], rollout.features, None,
            o.temperature, rollout.mask.shape[1])
        ratio = jnp.exp(start - rollout.logprobs)
        weights = jnp.minimum(ratio, cap) * rollout.mask
        metrics = {
            "off_policy/weight_mean": common.masked_mean(weights,
                                                         rollout.mask),
            "off_policy/capped_fraction": common.masked_mean(
                (ratio > cap).astype(jnp.float32), rollout.mask)}
        rollout = rollout.replace(logprobs=start)
      state, out = iteration.finish_step(t, state, rollout, update_rng,
                                           next_rng, weights)
      out.update(metrics)
      return state, out

    self._finish = jax.jit(
        finish, donate_argnums=0,
        out_shardings=(t.state_shardings, sharding.replicated(t.mesh)))
    self.fused = self._rollouts.fused

  def _sample(self, params, state, batch, key):
    """The rollout of a local batch of prompts with `params` on the sampler
    (dispatched; with host rewards, scored by the host before it returns);
    `state` is the live train state, whose frozen networks it reads."""
    t = self._trainer
    if self.mesh is t.mesh:  # the live state's own (a copy would be donated)
      frozen = state.frozen
    else:
      if self._frozen is None:
        self._frozen = jax.device_put(state.frozen, self._frozen_on_sampler)
      frozen = self._frozen
    with jax.set_mesh(self.mesh):
      return self._rollouts.rollout(
          jax.device_put(params, self._params_on_sampler), frozen,
          sharding.global_batch(batch, self.mesh, t.rules),
          jax.device_put(key, sharding.replicated(self.mesh)))

  def __call__(self, state, batch):
    t = self._trainer
    if self._step is None:  # the first call: where the run starts
      self._step = int(jax.device_get(state.step))
    next_rng, rollout_rng, update_rng = iteration.step_rngs(state)
    if self._pending is None:
      local = {k: evaluation.local_rows(v) for k, v in batch.items()}
      self._pending = self._sample(state.params, state, local, rollout_rng)
    (rollout, host_metrics), self._pending = self._pending, None
    rollout = jax.device_put(rollout, _rows_on(t.mesh, t.rules, rollout))
    ahead = self._ahead and self._step + 1 < t.config.train.num_steps
    if ahead:  # step t's parameters, copied before the update donates them
      params = jax.device_put(state.params, self._params_on_sampler,
                              may_alias=False)
    state, metrics = self._finish(state, rollout, update_rng, next_rng)
    if ahead:
      # While the training devices update, the sampler samples the next
      # step's prompts with the parameters this step started from.
      stream = t.online.prompt_stream
      _, next_rollout_rng, _ = iteration.split_step_key(next_rng)
      self._pending = self._sample(params, state,
                                   stream.batch_at(stream.position),
                                   next_rollout_rng)
    self._step += 1
    metrics.update(host_split.summed_over_processes(host_metrics))
    return state, metrics
