"""Asynchronous online RL with bounded staleness (issue 41, item 3):
`online.off_policy_steps=k` keeps the next k steps' rollouts in flight
(`overlap.OverlappedStep`), so step t trains on responses sampled with step
t-k's parameters (the run's first step's for its first k steps).

Checked on one device (the sampler is the training mesh) with k = 2 and
GRPO, 4 steps: each step's update starts from the rollout an independent
computation makes, for that step's prompts and key, with the parameters of
the step k before it. What the update reads of the rollout, the first
update's approx_kl_k1 (the masked token mean of log pi_sample - log
pi_start, one update per step), is compared with the same mean computed
here from `iteration.sample` and `iteration.score`, for the parameters
that should have sampled and for the ones the step starts from.

With DAPO's dynamic sampling a step ahead samples as many rounds of
prompts as it needs: with parameters held still, the run k = 2 steps
ahead is the on-policy run step for step, data position included.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from conftest import from_scratch, one_device_mesh, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.data import prompts as prompts_lib

K, STEPS = 2, 4


def test_step_t_trains_on_the_rollout_of_step_t_minus_k():
  config = tiny_config(algorithm="grpo", train__batch_size=4,
                       train__num_steps=STEPS,
                       rewards__reward_model__weight=0.0,
                       rewards__gold_reward__weight=1.0,
                       online__reward_model_checkpoint="",
                       online__samples_per_prompt=2,
                       online__max_new_tokens=8, online__off_policy_steps=K,
                       optimizer__warmup_steps=0)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    stream = trainer.online.prompt_source.stream
    params, keys, measured, prompts = [], [], [], []
    for step in range(STEPS):
      params.append(jax.tree.map(jnp.copy, state.params))
      keys.append(iteration.split_step_key(state.rng)[1])
      prompts.append(stream.batch_at(step)[prompts_lib.PROMPT_FEATURE])
      batch = sharding.global_batch(next(batches), mesh, rules)
      state, metrics = trainer.train_step(state, batch)
      measured.append(float(metrics["approx_kl_k1"]))

    @jax.jit
    def drift(sampler, start, tokens, key):
      samples = iteration.sample(trainer, sampler, state.frozen, tokens, key)
      old, new = (iteration.score(trainer, p, state.frozen, tokens, samples)
                  for p in (sampler, start))
      return jnp.sum((old.logprobs - new.logprobs) * old.mask) / jnp.sum(
          old.mask)

    for step in range(STEPS):
      sampler = max(step - K, 0)
      want = float(drift(params[sampler], params[step], prompts[step],
                         keys[step]))
      np.testing.assert_allclose(measured[step], want, rtol=1e-4, atol=1e-7)
      if step > 0:
        # The parameters that sampled differ from the step's own: a rollout
        # of the wrong age would not match.
        wrong = step - 1 if step - 1 != sampler else step
        other = float(drift(params[wrong], params[step], prompts[step],
                            keys[step]))
        assert abs(other - want) > 1e-6, (step, other, want)


def _dynamic_sampling_run(**overrides):
  """Per-step (metrics, stream position after the step) of 4 GRPO steps
  with dynamic sampling, from scratch, rewarded by the responses' word
  counts: a random policy's responses to a prompt are often all 8 words
  long, a group with no signal, so the steps need 1 to 3 rounds."""
  config = tiny_config(algorithm="grpo", train__batch_size=2,
                       train__num_steps=STEPS,
                       rewards__reward_model__weight=0.0,
                       rewards__functions="reward_functions:word_count",
                       online__reward_model_checkpoint="",
                       online__samples_per_prompt=2,
                       online__max_new_tokens=8,
                       grpo__dynamic_sampling=True,
                       grpo__max_sampling_rounds=3,
                       optimizer__warmup_steps=0, **overrides)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    out = []
    for unused_step in range(STEPS):
      batch = sharding.global_batch(next(batches), mesh, rules)
      state, metrics = trainer.train_step(state, batch)
      out.append((jax.device_get(metrics), batches.position))
  return out


def test_dynamic_sampling_ahead_reads_the_rounds_its_steps_would_read():
  """Dynamic sampling with k = 2 steps ahead: each step made ahead samples
  its rounds from the stream batches after those of the steps in flight,
  and the data position moves past a step's rounds when it trains. With
  the parameters held still (a learning rate of 1e-30), that is the
  on-policy run, step for step: a step ahead that read the wrong batches,
  or with the wrong keys, would score other responses and need other
  rounds. With a real learning rate the run is stale (step 2's rollout
  comes from step 0's parameters) and its data position is still the sum
  of the rounds its steps trained on."""
  still = dict(optimizer__learning_rate=1e-30)
  on_policy = _dynamic_sampling_run(**still)
  ahead = _dynamic_sampling_run(online__off_policy_steps=K, **still)
  rounds = [m["dynamic_sampling/rounds"] for m, _ in on_policy]
  # The workload needs the dynamic sampling's decisions to differ by step,
  # or a step read at the wrong position could still need the same rounds.
  assert len(set(rounds)) > 1, rounds
  assert [p for _, p in on_policy] == list(np.cumsum(rounds)), rounds
  for step, ((want, want_position), (got, got_position)) in enumerate(
      zip(on_policy, ahead)):
    assert got_position == want_position, (step, got_position, want_position)
    assert set(got) == set(want), step
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                 atol=1e-7, err_msg=f"step {step}: {name}")

  stale = _dynamic_sampling_run(online__off_policy_steps=K)
  assert abs(float(stale[K][0]["approx_kl_k1"])) > 1e-6
  assert [p for _, p in stale] == list(np.cumsum(
      [m["dynamic_sampling/rounds"] for m, _ in stale]))
