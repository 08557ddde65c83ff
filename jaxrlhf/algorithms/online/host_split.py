"""The online step split around the host: rewards computed by programs, and
DAPO's dynamic sampling.

A reward that a Python function computes from decoded text cannot run
inside the compiled step. `HostSplitStep` runs the step's functions
(`online_step`) as three compiled calls and does the host's part between
them, keeping the device busy meanwhile:

  1. sample       the responses (compiled)
  2. assemble     their log-probs, reference log-probs and device rewards
                  (compiled, dispatched without waiting: the device computes
                  it while the host scores)
     host         this process's responses decoded and scored by the host
                  rewards (`reward_sources.score_on_host`): each process
                  scores its own rows
  3. update       the host rewards added to the scores, the algorithm's
                  targets and the updates (compiled; the state donated)

The random keys are the fused step's, so a run whose host rewards add 0
trains exactly as the fused step does (tests/test_online_rewards.py).

Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): a group whose
responses all score the same has zero advantage and carries no signal.
With `Online.dynamic_sampling` the step drops such groups and samples more
prompts (the next batches of the prompt stream, so the data position moves
on and a resumed run draws the same) until it has train.batch_size groups
that vary, or has sampled its cap of rounds; the places still empty then
take dropped groups, so the update always trains on the same number of
rows. `dynamic_sampling/rounds` and `dynamic_sampling/dropped_fraction`
(of the groups sampled) are logged.
"""

from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import sharding
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.models import sampling


def dynamic_sampling_rounds(trainer):
  """The cap of sampling rounds of dynamic sampling, or None when off."""
  choose = trainer.algorithm.training.dynamic_sampling
  return choose(trainer.config) if choose else None


def needs_host(trainer) -> bool:
  """The step must be split: host rewards, or dynamic sampling."""
  return bool(reward_sources.host_rewards(trainer)) or (
      dynamic_sampling_rounds(trainer) is not None)


class HostSplitStep:
  """(state, batch) -> (state, metrics), the online step split around the
  host (module docstring); `fused` is the same device work as one compiled
  function (the host rewards counting 0), what `jaxrlhf.plan` lays out."""

  def __init__(self, trainer, mesh=None):
    """`mesh`: where rollouts are sampled and scored (default: the
    trainer's; `online_overlap` gives the sampler's)."""
    self._trainer = trainer
    t = trainer
    self.mesh = mesh or t.mesh
    rows = sharding.batch_sharding(self.mesh, t.rules, 1)
    replicated = sharding.replicated(self.mesh)
    samples = sampling.Samples(tokens=rows, logprobs=rows, mask=rows,
                               has_eos=rows, num_steps=replicated)
    self._sample = jax.jit(
        lambda params, frozen, prompts, key: iteration.sample(
            t, params, frozen, prompts, key),
        out_shardings=samples)
    self._assemble = jax.jit(
        lambda params, frozen, prompts, samples: iteration.assemble(
            t, params, frozen, prompts, samples))
    self._add_host = jax.jit(
        lambda rollout, values: iteration.with_host_rewards(t, rollout,
                                                              values))
    self._scores = jax.jit(lambda rollout: rollout.scores,
                           out_shardings=replicated)
    self._select = jax.jit(_select_rows)
    self._finish = jax.jit(
        lambda state, rollout, update_rng, next_rng: iteration.finish_step(
            t, state, rollout, update_rng, next_rng),
        donate_argnums=0,
        out_shardings=(t.state_shardings, replicated))
    self.fused = base.Training.train_step_function(t.algorithm.training, t)

  def __call__(self, state, batch):
    t = self._trainer
    next_rng, rollout_rng, update_rng = iteration.step_rngs(state)
    cap = dynamic_sampling_rounds(t)
    rollouts, host_metrics = [], {}
    kept: List[Tuple[int, int]] = []  # (round, group) of groups that vary
    dropped: List[Tuple[int, int]] = []
    for round_ in range(cap or 1):
      if round_:
        batch = sharding.global_batch(next(t.online.prompt_stream), t.mesh,
                                      t.rules)
      key = (rollout_rng if not round_
             else jax.random.fold_in(rollout_rng, round_))
      rollout, skipped = self.rollout(state.params, state.frozen, batch, key)
      for name, count in skipped.items():
        host_metrics[name] = host_metrics.get(name, 0.0) + count
      rollouts.append(rollout)
      if cap is None:
        break
      scores = np.asarray(jax.device_get(self._scores(rollout)))
      groups = scores.reshape(-1, t.online.samples_per_prompt)
      varies = groups.max(axis=1) != groups.min(axis=1)
      for g, keep in enumerate(varies):
        (kept if keep else dropped).append((round_, g))
      if len(kept) >= len(groups):
        break
    if cap is not None:
      rollout = self._keep(rollouts, kept, dropped)
      sampled = len(kept) + len(dropped)
      host_metrics["dynamic_sampling/rounds"] = float(len(rollouts))
      host_metrics["dynamic_sampling/dropped_fraction"] = (
          len(dropped) / sampled)
    state, metrics = self._finish(state, rollout, update_rng, next_rng)
    metrics.update(summed_over_processes(host_metrics))
    return state, metrics

  def rollout(self, params, frozen, batch, key):
    """One round: the rollout of the batch's prompts (on `mesh`) with every
    reward, and this process's {reward/<name>/skipped: count}."""
    t = self._trainer
    prompts = batch[prompts_lib.PROMPT_FEATURE]
    samples = self._sample(params, frozen, prompts, key)
    # Dispatched without waiting: the device assembles the rollout while
    # the host scores the responses.
    rollout = self._assemble(params, frozen, prompts, samples)
    if not reward_sources.host_rewards(t):
      return rollout, {}
    values, skipped = self._score_on_host(samples, batch)
    return self._add_host(rollout, values), skipped

  def _score_on_host(self, samples, batch):
    """This process's responses scored by the host rewards, as a global
    [rows, num host rewards] array."""
    t = self._trainer
    k = t.online.samples_per_prompt
    tokens = evaluation.local_rows(samples.tokens)
    finished = evaluation.local_rows(samples.has_eos)
    prompt_index = np.repeat(evaluation.local_rows(
        batch[prompts_lib.PROMPT_INDEX]), k)
    prompts = t.online.prompts
    eos = t.vocabulary.eos_id
    completions = [t.vocabulary.decode(evaluation.until_eos(row, eos))
                   for row in tokens]
    columns = {name: [values[i] for i in prompt_index]
               for name, values in prompts.columns.items()}
    values, skipped = reward_sources.score_on_host(
        t, [prompts.texts[i] for i in prompt_index], completions,
        [bool(f) for f in finished], columns)
    return jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, t.rules, 2), values), skipped

  def _keep(self, rollouts, kept, dropped):
    """The rows of the groups to train on: the first train.batch_size
    groups that vary, then dropped ones where too few vary."""
    t = self._trainer
    k = t.online.samples_per_prompt
    per_round = rollouts[0].scores.shape[0] // k
    chosen = (kept + dropped)[:per_round]
    rows = np.asarray([(r * per_round + g) * k + j
                       for r, g in chosen for j in range(k)], np.int32)
    return self._select(rollouts, jnp.asarray(rows))


def _select_rows(rollouts, rows):
  """The rollout of `rows` of the rollouts' rows laid end to end; its decode
  steps are all the rounds'."""
  steps = sum(r.decode_steps for r in rollouts)
  joined = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[
      r.replace(decode_steps=None) for r in rollouts])
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), joined).replace(
      decode_steps=steps)


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
