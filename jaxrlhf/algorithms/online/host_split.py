"""The driver that runs the online step around the host: rewards computed by
programs, and DAPO's dynamic sampling.

A reward that a Python function computes from decoded text cannot run
inside the compiled step. `HostSplitStep` runs `iteration.online_step` with
its device parts compiled one by one and does the host's part between them,
keeping the device busy meanwhile:

  sample       the responses (compiled)
  score        their log-probs, reference log-probs and device rewards
               (compiled, dispatched without waiting: the device computes
               it while the host scores)
  host         this process's responses decoded and scored by the host
               rewards (`RewardSources.score_on_host`): each process scores
               its own rows
  advantages,  the host rewards added to the scores, the algorithm's
  update       targets and the updates (compiled; the state donated)

Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a group whose
responses all score the same has zero advantage and carries no signal.
With `Online.dynamic_sampling` the step drops such groups and samples more
prompts (the next batches of the prompt stream, so the data position moves
on and a resumed run draws the same) until it has train.batch_size groups
that vary, or has sampled its cap of rounds; the places still empty then
take dropped groups, so the update always trains on the same number of
rows. `dynamic_sampling/rounds` and `dynamic_sampling/dropped_fraction`
(of the groups sampled) are logged. Steps sampled ahead of the update
(online.off_policy_steps) decide their rounds the same way (`overlap`).
"""

import dataclasses
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import sharding
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import options
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.models import sampling
from jaxrlhf.rl import rollout as rollout_lib


def dynamic_sampling_rounds(algorithm, config):
  """The cap of sampling rounds of dynamic sampling, or None when off."""
  choose = algorithm.training.dynamic_sampling
  return choose(config) if choose else None


def needs_host(trainer) -> bool:
  """The step must be split: host rewards, or dynamic sampling."""
  return bool(trainer.online.rewards.host_names) or (
      dynamic_sampling_rounds(trainer.algorithm, trainer.config) is not None)


class HostSplitStep:
  """(state, batch) -> (state, metrics): `iteration.online_step` split around
  the host (module docstring); `fused` is the same device work as one
  compiled function (the host rewards counting 0), what `jaxrlhf.plan`
  lays out."""

  def __init__(self, trainer, mesh=None):
    """`mesh`: where rollouts are sampled and scored (default: the
    trainer's; `overlap` gives the sampler's)."""
    t = trainer
    self.mesh = mesh or t.mesh
    self._rules = t.rules
    self._training_mesh = t.mesh
    self._rewards = t.online.rewards
    self._prompt_source = t.online.prompt_source
    self._config = t.config
    self._k = t.online.samples_per_prompt
    self._eos_id = t.vocabulary.eos_id
    self._decode = t.vocabulary.decode
    self._cap = dynamic_sampling_rounds(t.algorithm, t.config)
    rows = sharding.batch_sharding(self.mesh, t.rules, 1)
    replicated = sharding.replicated(self.mesh)
    samples = sampling.Samples(
        tokens=rows, logprobs=rows, mask=rows, has_eos=rows,
        num_steps=replicated,
        routes=rows if t.online.router_replay else None,
        preemptions=replicated if rollout_lib.counts_preemptions(
            options.decoding(t.config)[0], t.config.online.engine_pages)
        else None)
    parts = iteration.step_parts(t)
    self._add_host = jax.jit(self._rewards.with_host_rewards)
    self._scores = jax.jit(lambda rollout: rollout.scores,
                           out_shardings=replicated)
    self._select = jax.jit(_select_rows)
    self.parts = dataclasses.replace(
        parts, rounds=self._rounds,
        sample=jax.jit(parts.sample, out_shardings=samples),
        score=jax.jit(parts.score),
        host_rewards=self._host_rewards, keep=self._keep,
        correct=jax.jit(parts.correct), advantages=jax.jit(parts.advantages),
        update=jax.jit(parts.update, donate_argnums=0,
                       out_shardings=(t.state_shardings,
                                      sharding.replicated(t.mesh))))
    self.fused = iteration.fused_step(t)

  def __call__(self, state, batch):
    return iteration.online_step(self.parts, state, batch)

  # --- the host's parts -----------------------------------------------------

  def _rounds(self, batch, rounds):
    """The step's batch, then the prompt stream's next batches
    (`dynamic_rounds`)."""
    return self.dynamic_rounds(
        batch, rounds, lambda unused_round: sharding.global_batch(
            next(self._prompt_source.stream), self._training_mesh,
            self._rules))

  def dynamic_rounds(self, first, rounds, later):
    """A step's prompt batches (`StepParts.rounds`): `first`, then, while
    dynamic sampling wants more (fewer than train.batch_size groups of
    `rounds`, the step's [(rollout, host metrics)] so far, vary, and the
    cap allows), `later(r)` for round r."""
    yield first
    while len(rounds) < (self._cap or 1):
      kept, _ = self._groups(rounds)
      if len(kept) >= self._groups_per_round(rounds):
        return
      yield later(len(rounds))

  def _host_rewards(self, rollout, samples, batch):
    """The rollout with this process's rows scored by the host rewards, and
    this process's {reward/<name>/skipped: count}."""
    if not self._rewards.host_names:
      return rollout, {}
    tokens = evaluation.local_rows(samples.tokens)
    finished = evaluation.local_rows(samples.has_eos)
    prompt_index = np.repeat(evaluation.local_rows(
        batch[prompts_lib.PROMPT_INDEX]), self._k)
    prompts = self._prompt_source.prompts
    completions = [self._decode(evaluation.until_eos(row, self._eos_id))
                   for row in tokens]
    columns = {name: [values[i] for i in prompt_index]
               for name, values in prompts.columns.items()}
    values, skipped = self._rewards.score_on_host(
        self._config, [prompts.texts[i] for i in prompt_index], completions,
        [bool(f) for f in finished], columns)
    values = jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self._rules, 2), values)
    return self._add_host(rollout, values), skipped

  def _keep(self, rounds):
    """The rollout to train on and the host's metrics: with dynamic
    sampling, the first train.batch_size groups that vary, then dropped
    ones where too few vary."""
    metrics: Dict[str, float] = {}
    for _, skipped in rounds:
      for name, count in skipped.items():
        metrics[name] = metrics.get(name, 0.0) + count
    if self._cap is None:
      return rounds[0][0], self.step_metrics(summed_over_processes(metrics))
    kept, dropped = self._groups(rounds)
    per_round = self._groups_per_round(rounds)
    chosen = (kept + dropped)[:per_round]
    rows = np.asarray([(r * per_round + g) * self._k + j
                       for r, g in chosen for j in range(self._k)], np.int32)
    rollout = self._select([r for r, _ in rounds], jnp.asarray(rows))
    metrics["dynamic_sampling/rounds"] = float(len(rounds))
    metrics["dynamic_sampling/dropped_fraction"] = (
        len(dropped) / (len(kept) + len(dropped)))
    return rollout, self.step_metrics(summed_over_processes(metrics))

  @staticmethod
  def step_metrics(metrics: Dict[str, float]) -> Dict[str, float]:
    """The step's host metrics from the rounds' sums over processes (a
    subclass's to average)."""
    return metrics

  def _groups_per_round(self, rounds) -> int:
    return rounds[0][0].scores.shape[0] // self._k

  def _groups(self, rounds) -> Tuple[List[Tuple[int, int]],
                                     List[Tuple[int, int]]]:
    """(round, group) of the groups whose scores vary, and of those that do
    not, in the order sampled."""
    kept, dropped = [], []
    for round_, (rollout, _) in enumerate(rounds):
      scores = np.asarray(jax.device_get(self._scores(rollout)))
      groups = scores.reshape(-1, self._k)
      for g, varies in enumerate(groups.max(axis=1) != groups.min(axis=1)):
        (kept if varies else dropped).append((round_, g))
    return kept, dropped


def _select_rows(rollouts, rows):
  """The rollout of `rows` of the rollouts' rows laid end to end; its decode
  steps (and preemptions) are all the rounds'."""
  total = lambda name: (None if getattr(rollouts[0], name) is None
                        else sum(getattr(r, name) for r in rollouts))
  steps, preemptions = total("decode_steps"), total("preemptions")
  joined = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[
      r.replace(decode_steps=None, preemptions=None) for r in rollouts])
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), joined).replace(
      decode_steps=steps, preemptions=preemptions)


def summed_over_processes(metrics: Dict[str, float]) -> Dict[str, float]:
  """Host counts of every process added (the dynamic-sampling figures are
  the same on every process and are kept as they are)."""
  if jax.process_count() == 1 or not metrics:
    return metrics
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  names = sorted(metrics)
  values = multihost_utils.process_allgather(
      np.asarray([metrics[n] for n in names], np.float64))
  return {n: (float(values[0, i]) if n.startswith("dynamic_sampling/")
              else float(values[:, i].sum())) for i, n in enumerate(names)}
