"""online.engine='continuous': a GRPO step sampling with the engine.

The truths: (1) a response is drawn as its row of the lockstep sampler's
batch whatever the slots (tests/test_engine.py), so a whole GRPO step (its
rollout, rewards, advantages, update) is the same with one slot as with a
slot per response and as with the lockstep sampler, only the decode steps
run differ; (2) on-policy in float32 the
sampler's log-probs are the trainer's scoring of the same tokens (the gap
metrics near 0); (3) what it does not support is refused from the config.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, one_device_mesh, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import options
from jaxrlhf.models import engine

GRPO = dict(model__arch="llama", model__size="tiny",
            model__num_encoder_layers=None, model__num_decoder_layers=None,
            optimizer__warmup_steps=0, train__batch_size=4, algorithm="grpo",
            rewards__reward_model__weight=0.0,
            rewards__gold_reward__weight=0.0,
            # Responses of different lengths score differently: nonzero
            # advantages, an update that moves the policy.
            rewards__functions="reward_functions:word_count",
            online__reward_model_checkpoint="",
            online__samples_per_prompt=2, online__engine="continuous")


def _step(slots, page_size=None, pool=None):
  """(metrics, updated policy params) of one GRPO step from the seeded
  start, sampling with `slots` engine slots ('lockstep': the lockstep
  sampler); with `page_size`, on pages, and `pool(trainer)` the pool's
  pages (online.engine_pages) when given."""
  engine = (dict(online__engine="lockstep") if slots == "lockstep"
            else dict(online__engine_slots=slots,
                      online__engine_page_size=page_size))
  config = tiny_config(**{**GRPO, **engine})
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    if pool:
      trainer.config.online.engine_pages = pool(trainer)
    state = trainer.init_state()
    batch = next(trainer.train_batches(0))
    state, metrics = trainer.train_step(
        state, sharding.global_batch(jax.device_get(batch), mesh, rules))
    return jax.device_get(metrics), jax.device_get(state.params["policy"])


def _least(trainer, fewer=0):
  """The smallest pool of pages of 2 the step's engine takes (one longest
  sequence), less `fewer`."""
  return engine.least_pages(trainer.prompt_length,
                            trainer.online.max_new_tokens, 2, 2) - fewer


@pytest.fixture(scope="module")
def steps():
  """One slot; a slot per response; a slot per response on pages of 2 in
  the smallest pool, where sequences are preempted (8 slots want 8 x
  that pool); the lockstep sampler."""
  return {**{slots: _step(slots) for slots in (1, 8, "lockstep")},
          "pool": _step(8, page_size=2, pool=_least)}


@pytest.mark.parametrize("other", [8, "pool", "lockstep"])
def test_a_grpo_step_does_not_depend_on_the_slots_or_the_sampler(steps,
                                                                 other):
  (one, params_one), (eight, params_eight) = steps[1], steps[other]
  if other == "pool":  # counted only with online.engine_pages
    eight = dict(eight)
    assert float(eight.pop("engine/preemptions")) > 0
  assert set(one) == set(eight)
  for name in one:
    if name == "decode_steps" or "time" in name or name.endswith("_s"):
      continue
    # The gap is a difference of near-equal log-probs, computed by the
    # sampler in a batch of 1 or 8 slots (or 8 rows in lockstep): equal
    # to their rounding.
    atol = 1e-5 if name.startswith("gap/") else 1e-6
    np.testing.assert_allclose(one[name], eight[name], rtol=1e-5, atol=atol,
                               err_msg=name)
  assert float(one["advantage_abs_mean"]) > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               params_one, params_eight)
  # One slot runs a step per token drawn; eight (a slot per response) run
  # as many as the longest response has tokens, lockstep the budget's.
  assert int(one["decode_steps"]) > int(eight["decode_steps"])


def test_a_pool_below_one_longest_sequence_is_refused_naming_the_least():
  with pytest.raises(ValueError, match=r"online.engine_pages=\d+: .*needs "
                     r"at least \d+ pages of 2"):
    _step(8, page_size=2, pool=lambda t: _least(t, fewer=1))


def test_the_samplers_log_probs_are_the_trainers(steps):
  metrics, _ = steps[1]
  assert abs(float(metrics["gap/k1"])) < 1e-4
  assert abs(float(metrics["gap/k3"])) < 1e-4


@pytest.mark.parametrize("overrides,field", [
    (dict(model__arch="t5"), "model.arch"),
    (dict(model__arch="llama", online__cache_segments=2),
     "online.cache_segments"),
    # A pool size without pages (online.engine_page_size or episodes).
    (dict(model__arch="llama", online__engine_pages=8),
     "online.engine_pages"),
    # A mixture-of-experts policy on the contiguous cache (vmapped slots).
    (dict(model__arch="qwen3_moe"), "online.engine_page_size"),
])
def test_unsupported_settings_are_refused(overrides, field):
  config = tiny_config(online__engine="continuous", algorithm="grpo",
                       **overrides)
  with pytest.raises(ValueError, match=f"config.{field}: .*engine"):
    options.check_engine(config)


@pytest.mark.parametrize("overrides,want", [
    # 'auto', the default: the engine on pages where it decodes the policy.
    (dict(model__arch="llama"), ("continuous", 16)),
    (dict(model__arch="llama", online__engine_page_size=4), ("continuous", 4)),
    (dict(model__arch="llama", online__environment="guess_number"),
     ("continuous", 16)),
    # Where it does not: lockstep.
    (dict(model__arch="t5"), ("lockstep", None)),
    (dict(model__arch="llama", online__cache_segments=2), ("lockstep", None)),
    # Named: as named; continuous single-turn contiguous unless paged.
    (dict(model__arch="llama", online__engine="continuous"),
     ("continuous", None)),
    (dict(model__arch="llama", online__engine="continuous",
          online__tools="calculator"), ("continuous", 16)),
    (dict(model__arch="llama", online__engine="lockstep"), ("lockstep", None)),
])
def test_auto_decodes_with_the_engine_where_it_can(overrides, want):
  config = tiny_config(algorithm="grpo", **overrides)
  assert options.decoding(config) == want
  options.check_engine(config)


@pytest.mark.parametrize("overrides,field", [
    (dict(model__arch="t5", online__engine_page_size=16),
     "online.engine_page_size"),
    (dict(model__arch="llama", online__cache_segments=2,
          online__engine_pages=8), "online.engine_pages"),
])
def test_page_settings_of_a_run_auto_decodes_in_lockstep_are_refused(
    overrides, field):
  config = tiny_config(algorithm="grpo", **overrides)
  with pytest.raises(ValueError, match=f"config.{field}: .*continuous "
                     "engine's"):
    options.check_engine(config)
