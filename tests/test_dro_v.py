"""DRO-V as an algorithm (jaxrlhf/algorithms/offline/dro.py): the policy learning-rate
rescaling by 1/tau, and where the value comes from.

Truths used: Adafactor's and AdamW's invariance to the gradient's scale
(which makes a loss multiplied by 1/tau a no-op for them), the first step
from policy = reference, where equation 8 is tau times a tau-free gradient
and equation 7 does not depend on tau; and, for the paper's single-network
ablation, the policy's logits computed by its own forward pass on the
prompt alone.
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.offline import dro
from jaxrlhf.algorithms import optimizers
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback
from jaxrlhf.models import scoring


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
  examples = synthetic.make_examples("train", 32)
  path = os.path.join(tmp_path_factory.mktemp("dro_v"), "trajectory.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, "trajectory", [e["inputs"] for e in examples],
      [[e["ideal"], e["targets"]] for e in examples], synthetic.gold_reward)
  return path


def _config(path, arch="t5", **overrides):
  settings = dict(algorithm="dro_v", data__task=f"dro_v_algorithm_{arch}",
                  optimizer__warmup_steps=0, optimizer__grad_clip_norm=0.0)
  if arch != "t5":
    settings.update(model__arch=arch, model__size="tiny",
                    model__num_encoder_layers=None)
  settings.update(overrides)
  config = tiny_config(**settings)
  config.data.files.train = path
  return config


def _mesh(config):
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  return mesh, sharding.as_rules(config.sharding.logical_axis_rules)


def _optimizer_config(name):
  return ml_collections.ConfigDict(dict(
      name=name, learning_rate=1e-2, warmup_steps=0, schedule="constant",
      decay_rate=0.8, multiply_by_parameter_scale=True, b1=0.9, b2=0.999,
      eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0))


@pytest.mark.parametrize("name", ["adafactor", "adamw", "sgd"])
def test_update_scale_multiplies_the_update_a_loss_scale_does_not(name):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  tx = optimizers.make_optimizer(_optimizer_config(name), 10)

  def first_update(tx, g):
    return tx.update(g, tx.init(params), params)[0]["w"]

  base = first_update(tx, grads)
  scaled_loss = first_update(tx, jax.tree.map(lambda g: 0.1 * g, grads))
  if name == "sgd":  # only SGD follows the loss's scale
    np.testing.assert_allclose(scaled_loss, 0.1 * base, rtol=1e-6)
  else:
    np.testing.assert_allclose(scaled_loss, base, rtol=1e-4)
  scaled_update = optimizers.scale_updates(tx, 10.0)
  np.testing.assert_allclose(first_update(scaled_update, grads), 10 * base,
                             rtol=1e-6)
  # Same optimizer state, so checkpoints do not depend on the factor.
  assert (jax.tree.structure(scaled_update.init(params))
          == jax.tree.structure(tx.init(params)))
  assert optimizers.scale_updates(tx, 1.0) is tx


def _first_step_displacements(config, host_state):
  """(|policy update|, |value update|, logged learning rate) of one train
  step from host_state."""
  mesh, rules = _mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("dro_v")), config, mesh)
    state = jax.device_put(host_state, trainer.state_shardings)
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    state, metrics = trainer.train_step(state, batch)
    assert metrics["nonfinite"] == 0
    new = jax.device_get(state.params)

  def norm(name):
    deltas = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b,
                          new[name], host_state.params[name])
    return np.sqrt(sum(np.sum(d * d) for d in jax.tree.leaves(deltas)))

  return norm("policy"), norm("value"), float(metrics["learning_rate"])


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw"])
def test_tau_rescales_the_policy_update_not_the_value_update(trajectories,
                                                             optimizer):
  """DRO paper section 3.3: the policy's update is multiplied by 1/tau. From
  policy = reference, equation 8 is tau * (a tau-free gradient) and equation
  7 does not depend on tau; Adafactor and AdamW remove the tau in the
  gradient, so tau = 0.1 must move the policy 10 times as far as tau = 1,
  and the value exactly as far."""
  # AdamW's eps (1e-5 by default) would break its scale invariance on the
  # tiny model's small gradients.
  settings = dict(optimizer__name=optimizer, optimizer__eps=1e-12)
  config = _config(trajectories, **settings)
  mesh, rules = _mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("dro_v")), config, mesh)
    state = trainer.init_state()
  # The reference is the starting policy (both come from one checkpoint in
  # a real run), so log pi / pi_ref = 0 on the first step.
  state = jax.device_get(state)
  state = state.replace(frozen={"reference": state.params["policy"]})
  moved = {tau: _first_step_displacements(
      _config(trajectories, dro__tau=tau, **settings), state)
           for tau in (1.0, 0.1)}
  assert moved[1.0][0] > 0 and moved[1.0][1] > 0
  np.testing.assert_allclose(moved[0.1][0] / moved[1.0][0], 10.0, rtol=1e-3)
  np.testing.assert_allclose(moved[0.1][1], moved[1.0][1], rtol=1e-6)
  # The logged learning rate is the policy's effective one.
  np.testing.assert_allclose([moved[1.0][2], moved[0.1][2]], [1e-2, 1e-1],
                             rtol=1e-6)


@pytest.mark.parametrize("arch", ["t5", "llama"])
def test_policy_logits_value_is_the_first_step_logit(trajectories, arch):
  """The single-network ablation reads V(x) from the policy's own output:
  the logit of dro.value_token_id where it predicts the completion's first
  token, computed here by a forward pass over the prompt alone; the policy's
  log-probs from the same pass equal the scoring API's."""
  token = 3
  config = _config(trajectories, arch, dro__value_source="policy_logits",
                   dro__value_token_id=token)
  mesh, rules = _mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("dro_v")), config, mesh)
    state = trainer.init_state()
    assert set(state.params) == {"policy"}  # no value parameters
    params = state.params["policy"]
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    logps, values = jax.jit(
        lambda p, b: dro.logprobs_and_logit_values(
            trainer.lm, trainer.config.dro.value_token_id, p, b))(params,
                                                                   batch)
    scored = scoring.sequence_logprobs(trainer.lm, params, batch,
                                       ("completion",))["completion"]
    if arch == "t5":
      prompt = batch["encoder_input_tokens"]
      start = jnp.zeros((prompt.shape[0], 1), jnp.int32)  # T5's BOS is PAD
      # Any non-PAD target: it only marks the position as real.
      logits = trainer.model.apply({"params": params}, prompt, start,
                                   start + 1)
      expected = logits[:, 0, token]
    else:  # prompts are left-padded: the last slot predicts the completion
      logits = trainer.model.apply(
          {"params": params}, batch["prompt_tokens"],
          batch["prompt_positions"], batch["prompt_attention_mask"])
      expected = logits[:, -1, token]
    np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logps, scored, rtol=1e-5, atol=1e-4)
    # One step trains the policy through both equations.
    state, metrics = trainer.train_step(state, batch)
    assert metrics["nonfinite"] == 0
    assert np.isfinite(float(metrics["value_loss"]))


def test_value_token_beyond_the_vocabulary_is_a_config_error(trajectories):
  config = _config(trajectories, dro__value_source="policy_logits",
                   dro__value_token_id=10**6)
  mesh, rules = _mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with pytest.raises(ValueError, match="config.dro.value_token_id: 1000000"):
      trainer_of(from_scratch(algorithms.get("dro_v")), config, mesh)
