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
NeMo-RL's one-step off-policy mode, AReaL's staleness 1). With
`off_policy_steps` = k > 1 the sampler runs up to k steps ahead (a bounded
staleness, AReaL's eta = k, prime-rl's async level): a queue holds the
rollouts of steps t+1 .. t+k, and each step's update is followed by the
rollout of step t+k, sampled with the parameters step t started from, so
step t trains on responses of the parameters of step t-k (of the run's
first step for its first k steps: its first call fills the queue with
them). The parameters
move to the sampler with a resharding `jax.device_put` once per step (the
frozen reference and reward model once per run), and each rollout moves
back the same way. Prompts t+1 are the stream's next batch, read ahead
without moving it, so the data position (and a resumed run's) is the
on-policy run's. With dynamic sampling (`host_split`) a step made ahead
samples its rounds from the batches after those of the steps in flight,
deciding on more rounds as the on-policy step does; when it trains, the
stream moves past its rounds, so the data position is where the next
step's prompts start (tests/test_staleness.py).

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
             Logged: correction/weight_mean, correction/capped_fraction.

Multi-turn episodes (`episode_step.EpisodeStep`'s parts) are played on the
host, their turns decoded on the sampler's devices: a rollout ahead is
played once the update is dispatched, so the environments' time overlaps
the update's (tests/test_engine_episodes.py, tests/test_eight_devices.py);
with online.partial_rollouts they go on with the update's parameters once
it is done (`_newer_params`).

The first step of a run, and of a resumed one, has no rollout in flight: it
samples with the parameters it starts from. `off_policy_steps=0` with
sampler devices samples every step's rollout with the parameters its update
starts from: the on-policy results on a mesh split in two
(tests/test_eight_devices.py).
"""

import collections
import dataclasses

import jax

from jaxrlhf import sharding
from jaxrlhf.algorithms.online import host_split
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.eval import evaluation
from jaxrlhf.rl import rollout as rollout_lib


def overlaps(config) -> bool:
  """The run samples on devices of its own, or one step ahead."""
  o = config.online
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


def decoupled_correction(config, lm, params, rollout):
  """AReaL's decoupled correction (module docstring): the rollout re-scored
  with `params` (pi_start, which the ratios take as their old policy), and
  `online.importance_correction` (token_tis unless set: each token's
  truncated importance weight min(pi_start / pi_sample, cap) [rows, L]) of
  its gap to the sampling policy's scoring."""
  start, _, _ = rollout_lib.logprobs_and_entropy(
      lm, params["policy"], rollout.features, None,
      config.online.temperature, rollout.mask.shape[1],
      routes=rollout.routes)
  return iteration.importance_correction(
      config, start, rollout.logprobs, rollout.replace(logprobs=start))


class OverlappedStep:
  """(state, batch) -> (state, metrics): `iteration.online_step` with its
  rollout made on the sampler's mesh, up to k steps ahead with
  `online.off_policy_steps=k` (module docstring), by the parts of
  `sampler` (`host_split.HostSplitStep`, or `episode_step.EpisodeStep`:
  episodes, played on the host while the update runs)."""

  def __init__(self, trainer, sampler=host_split.HostSplitStep):
    t = trainer
    o = t.config.online
    self._ahead = int(o.off_policy_steps)  # k: the staleness bound
    mesh = sharding.sampler_mesh(t.config)
    if mesh is None:
      mesh = t.mesh
    elif set(mesh.devices.flat) & set(t.mesh.devices.flat):
      raise ValueError(
          "config.online.sampler_devices: the sampler's devices are among "
          "the training mesh's; build the trainer on "
          "`sharding.training_mesh(config)`.")
    self.mesh = mesh
    self._training_mesh, self._rules = t.mesh, t.rules
    self._num_steps = t.config.train.num_steps
    self._prompt_source = t.online.prompt_source
    self._sampler = sampler(t, mesh=mesh)
    self._partial = bool(o.partial_rollouts)
    self._params_on_sampler = _on_mesh(t.state_shardings.params, mesh)
    self._frozen_on_sampler = _on_mesh(t.state_shardings.frozen, mesh)
    self._frozen = None  # the frozen networks on the sampler, moved once
    # The rollouts made ahead, oldest first: (rollout on the sampler, host
    # metrics) of the next steps' prompts, in step order.
    self._pending = collections.deque()
    self._step = None  # the step the next call runs
    correct = self._sampler.parts.correct
    if self._ahead and o.off_policy_correction == "decoupled":
      scored = jax.jit(lambda params, rollout: decoupled_correction(
          t.config, t.lm, params, rollout))
      correct = lambda state, rollout: scored(state.params, rollout)
    self.parts = dataclasses.replace(
        self._sampler.parts, rounds=self._rounds, sample=self._sample,
        score=self._score, host_rewards=self._host_rewards, keep=self._keep,
        correct=correct)
    self.fused = self._sampler.fused

  def __call__(self, state, batch):
    if self._step is None:  # the first call: where the run starts
      self._step = int(jax.device_get(state.step))
    # The steps whose rollouts this step makes ahead: up to step t + k,
    # those not made yet (all k on a run's first call, then one), within
    # the run.
    # (The queue holds steps t .. : this step's own first, unless empty.)
    made = self._step + max(len(self._pending) - 1, 0)
    ahead = range(made + 1,
                  min(self._step + self._ahead, self._num_steps - 1) + 1)
    if ahead:  # step t's parameters, copied before the update donates them
      params = jax.device_put(state.params, self._params_on_sampler,
                              may_alias=False)
    state, metrics = iteration.online_step(self.parts, state, batch)
    # While the training devices update, the sampler samples the later
    # steps' prompts with the parameters this step started from (read
    # ahead: the stream's position is already step t + 1's), each with its
    # own step's key (the keys' chain, `split_step_key`, run forward).
    rng = state.rng  # step t + 1's
    if self._partial and ahead:
      self._sampler.params_source = self._newer_params(state)
    for step in range(self._step + 1, ahead.stop):
      if step in ahead:
        _, key, _ = iteration.split_step_key(rng)
        self._pending.append(self._rounds_ahead(params, state, key))
      rng = iteration.split_step_key(rng)[0]
    if self._partial:
      self._sampler.params_source = None
    self._step += 1
    return state, metrics

  def _newer_params(self, state):
    """online.partial_rollouts: a source (`EpisodeEngine.params_source`)
    of the policy's view of `state`'s parameters on the sampler, None
    until the update that makes them is done (polled between decode
    chunks: the episodes being played ahead go on with them, and every
    round or step played ahead after it starts from them)."""
    made = []

    def source():
      if not made:
        if not all(x.is_ready() for x in jax.tree.leaves(state.params)):
          return None
        params = jax.device_put(state.params, self._params_on_sampler,
                                may_alias=False)
        with jax.set_mesh(self.mesh):
          made.append(self._sampler.view(params,
                                         self._frozen_for(state.frozen)))
      return made[0]
    return source

  # --- the parts that run on the sampler ------------------------------------

  def _on_sampler(self, local_batch):
    return sharding.global_batch(local_batch, self.mesh, self._rules)

  def _rounds(self, batch, rounds):
    """Nothing to sample when the rollout was made a step ahead; else the
    step's batch, moved to the sampler, then the stream's next batches
    while dynamic sampling wants more (the stream moving on, as
    `host_split`'s do)."""
    if self._pending:
      return ()
    return self._sampler.dynamic_rounds(
        self._on_sampler({k: evaluation.local_rows(v)
                          for k, v in batch.items()}), rounds,
        lambda unused_round: self._on_sampler(
            next(self._prompt_source.stream)))

  def _frozen_for(self, frozen):
    """The frozen networks on the sampler (moved once); the live state's
    own when the sampler is the training mesh (a copy would be donated)."""
    if self.mesh is self._training_mesh:
      return frozen
    if self._frozen is None:
      self._frozen = jax.device_put(frozen, self._frozen_on_sampler)
    return self._frozen

  def _sample(self, params, frozen, prompts, key):
    with jax.set_mesh(self.mesh):
      return self._sampler.parts.sample(
          jax.device_put(params, self._params_on_sampler),
          self._frozen_for(frozen), prompts,
          jax.device_put(key, sharding.replicated(self.mesh)))

  def _score(self, params, frozen, prompt_tokens, samples, references=None):
    with jax.set_mesh(self.mesh):
      return self._sampler.parts.score(
          jax.device_put(params, self._params_on_sampler),
          self._frozen_for(frozen), prompt_tokens, samples, references)

  def _host_rewards(self, rollout, samples, batch):
    with jax.set_mesh(self.mesh):
      return self._sampler.parts.host_rewards(rollout, samples, batch)

  def _rounds_ahead(self, params, state, key):
    """The rounds of the next step not yet made, sampled ahead with
    `params` (already on the sampler) as `online_step` samples a step's:
    its prompts the stream's batches after those of the steps in flight
    (one each, or a step's dynamic-sampling rounds), read without moving
    the stream."""
    stream = self._prompt_source.stream
    start = stream.position + sum(len(r) for r in self._pending)

    def rounds(batch, so_far):
      return self._sampler.dynamic_rounds(
          batch, so_far,
          lambda r: self._on_sampler(stream.batch_at(start + r)))
    return iteration.sample_rounds(
        dataclasses.replace(self.parts, rounds=rounds), params, state.frozen,
        self._on_sampler(stream.batch_at(start)), key)

  def _keep(self, rounds):
    """The rollout made ahead (or this step's), moved to the training mesh,
    and the host's metrics: the sampler's `keep` of its rounds. A step made
    ahead moves the stream past its later rounds' batches, so the data
    position (and a resumed run's) is where the next step's prompts
    start."""
    if self._pending:
      rounds = self._pending.popleft()
      for unused_round in rounds[1:]:
        next(self._prompt_source.stream)
    with jax.set_mesh(self.mesh):
      rollout, metrics = self._sampler.parts.keep(rounds)
    return (jax.device_put(rollout, _rows_on(self._training_mesh,
                                             self._rules, rollout)),
            metrics)
