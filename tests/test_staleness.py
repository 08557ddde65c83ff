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
