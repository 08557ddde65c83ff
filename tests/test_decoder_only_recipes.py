"""Offline algorithms train and evaluate a decoder-only (Llama) policy too."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.eval import evaluation
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback


def _setup(tmp_path, algorithm, kind):
  examples = synthetic.make_examples("train", 64)
  path = str(tmp_path / f"{kind}.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, kind, [e["inputs"] for e in examples],
      [[e["ideal"], e["targets"]] for e in examples], synthetic.gold_reward,
      beta=10.0)
  config = tiny_config(algorithm=algorithm, data__task=f"llama_{algorithm}",
                       model__arch="llama", model__size="tiny",
                       model__num_encoder_layers=None,
                       optimizer__warmup_steps=0, eval__num_examples=16,
                       eval__task="synthetic_summarize")
  config.data.files.train = path
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)

  return from_scratch(algorithms.get(algorithm)), config, mesh, rules


@pytest.mark.parametrize("algorithm,kind", [("dpo", "pairs"),
                                            ("dro_v", "trajectory")])
def test_llama_policy_trains_and_is_evaluated(tmp_path, algorithm, kind):
  algorithm, config, mesh, rules = _setup(tmp_path, algorithm, kind)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(algorithm, config, mesh)
    assert not trainer.lm.is_encoder_decoder
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    batch = next(batches)
    assert "chosen_tokens" in batch or "completion_tokens" in batch
    assert "prompt_tokens" in batch
    losses = []
    for _ in range(8):
      state, metrics = trainer.train_step(
          state, sharding.global_batch(batch, mesh, rules))
      losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    # Evaluation samples both policies with the decoder-only KV-cache sampler.
    result = trainer.evaluate(state)
  assert 0.0 <= result["eval/win_rate"] <= 1.0
  assert result["eval/kl"] > 0.0
  assert 0 < result["eval/length"] <= config.data.targets_length


def test_eval_kl_of_the_reference_against_itself_is_zero_at_any_temperature(
    tmp_path):
  """Policy = reference: every sequence's log-ratio is 0 when both log-probs
  are taken at the sampling temperature (scoring the reference at 1 instead
  gave about 0.5 here at temperature 0.7); both are the same teacher-forced
  pass, so the estimate is exactly 0, not -0.0000 from rounding."""
  algorithm, config, mesh, rules = _setup(tmp_path, "dpo", "pairs")
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(algorithm, config, mesh)
    params = trainer.init_state().params["policy"]
    tokens, texts, judge = policy_eval.eval_prompts(trainer)
    result = evaluation.compare_with_reference(
        trainer, params, params, tokens, texts, judge, temperature=0.7)
  assert result["eval/kl"] == 0.0
