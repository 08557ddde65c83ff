"""What an algorithm carries between steps: BCO's running reward shift and
TR-DPO's moving reference, each added by registration alone.

Truths used: TRL's semantics, written in numpy here — BCOTrainer updates its
RunningMoments with the batch's implicit rewards beta * (log pi - log
pi_ref) before using their mean as the shift delta, and its loss is the
mean of -log sigmoid(r - delta) (desirable) and -log sigmoid(-(r - delta))
(undesirable); SyncRefModelCallback mixes ref <- alpha * policy + (1 -
alpha) * ref after every step whose count is a multiple of
ref_model_sync_steps — and an uninterrupted run, which a resumed one must
equal bit for bit.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import evaluated_by, from_scratch, one_device_mesh
from conftest import synthetic_feedback_file, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import checkpoint_files
from jaxrlhf import sharding
from jaxrlhf.data import synthetic
from jaxrlhf.losses import bco_losses as bco_losses
from jaxrlhf.losses import preference
from jaxrlhf.models import scoring
from jaxrlhf.train import loop


def _softplus(z):
  return np.logaddexp(0.0, z)


class TrlRunningMoments:
  """TRL's RunningMoments.update, for the mean (its count starts at 1e-24)."""

  def __init__(self):
    self.mean, self.count = 0.0, 1e-24

  def update(self, xs):
    xs = np.asarray(xs, np.float64)
    delta = xs.mean() - self.mean
    total = self.count + xs.size
    self.mean += delta * xs.size / total
    self.count = total


def trl_bco_loss(rewards, desirable, running):
  """TRL's bco_loss on the rewards of one batch: update, then use."""
  running.update(rewards)
  logits = rewards - running.mean
  return np.mean(np.where(desirable, _softplus(-logits), _softplus(logits)))


def test_bco_loss_is_trls_over_several_batches():
  running = TrlRunningMoments()
  mean, count = 0.0, 0.0
  batches = [(np.array([0.5, -1.0, 2.0, 0.25]), np.array([1, 0, 1, 0])),
             (np.array([-0.5, 3.0]), np.array([0, 1])),
             (np.array([1.5, 1.5, -2.0]), np.array([1, 1, 0]))]
  beta = 0.5
  for rewards, desirable in batches:
    # log pi - log pi_ref = rewards / beta, split between the two.
    policy = rewards / beta + 1.0
    loss, metrics = bco_losses.bco_loss(
        jnp.asarray(policy, jnp.float32), jnp.ones(len(rewards), jnp.float32),
        jnp.asarray(desirable), beta=beta, running_mean=mean,
        running_count=count)
    expected = trl_bco_loss(rewards, desirable > 0, running)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["delta"], running.mean, rtol=1e-5)
    mean, count = metrics["delta"], metrics["delta_count"]
  # The shift is the mean of all nine rewards, not an exponential average.
  np.testing.assert_allclose(mean, np.mean(np.concatenate(
      [b[0] for b in batches])), rtol=1e-5)
  assert float(count) == 9


def test_bco_gradient_is_the_classifiers():
  """d loss / d log pi_i = -beta * sigmoid(-(r_i - delta)) / B for a
  desirable example, beta * sigmoid(r_i - delta) / B for an undesirable one
  (delta, a running mean, passes no gradient)."""
  beta = 0.2
  policy = jnp.array([-3.0, -5.0, -1.0], jnp.float32)
  ref = jnp.array([-4.0, -4.0, -4.0], jnp.float32)
  desirable = jnp.array([1, 0, 1])
  grad = jax.grad(lambda p: bco_losses.bco_loss(
      p, ref, desirable, beta=beta, running_mean=0.3, running_count=5.0)[0])(
          policy)
  r = beta * np.asarray(policy - ref, np.float64)
  delta = (0.3 * 5 + r.sum()) / 8
  sig = lambda z: 1 / (1 + np.exp(-z))
  want = np.where(np.asarray(desirable) > 0, -beta * sig(-(r - delta)),
                  beta * sig(r - delta)) / 3
  np.testing.assert_allclose(grad, want, rtol=1e-5)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """A thumbs file (the ideal summary up, the noisy demonstration up or
  down by its gold reward) and a pairs file, on 16 prompts."""
  root = tmp_path_factory.mktemp("carried")
  rows = []
  for e in synthetic.make_examples("train", 16):
    rows.append({"prompt": e["inputs"], "completion": e["ideal"], "label": 1})
    good = synthetic.gold_reward(e["inputs"], e["targets"]) > 0.9
    rows.append({"prompt": e["inputs"], "completion": e["targets"],
                 "label": int(good)})
  thumbs = root / "thumbs.jsonl"
  thumbs.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return {"thumbs": str(thumbs), "root": root,
          "pairs": synthetic_feedback_file(root, "pairs", count=16,
                                           beta=10.0)}


def _config(path, algorithm, **overrides):
  config = tiny_config(algorithm=algorithm, data__task=f"{algorithm}_data",
                       optimizer__warmup_steps=0, train__batch_size=8,
                       **overrides)
  config.data.files.train = path
  return config


def _trainer(config):
  mesh, rules = one_device_mesh(config)
  algorithm = evaluated_by(from_scratch(algorithms.get(config.algorithm)))
  return trainer_of(algorithm, config, mesh), mesh, rules


def test_bco_carries_the_running_mean_of_its_implicit_rewards(data):
  config = _config(data["thumbs"], "bco", bco__beta=0.5)
  trainer, mesh, rules = _trainer(config)
  running = TrlRunningMoments()
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer.init_state()
    assert {k: float(v) for k, v in state.algorithm_state.items()} == {
        "reward_mean": 0.0, "reward_count": 0.0}
    batches = trainer.train_batches(0)
    for _ in range(3):
      batch = sharding.global_batch(next(batches), mesh, rules)
      pi, ref = (np.asarray(scoring.sequence_logprobs(
          trainer.lm, params, batch, ("completion",))["completion"],
                            np.float64)
                 for params in (state.params["policy"],
                                state.frozen["reference"]))
      expected = trl_bco_loss(0.5 * (pi - ref),
                              np.asarray(batch["label"]) > 0.5, running)
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-4)
      np.testing.assert_allclose(state.algorithm_state["reward_mean"],
                                 running.mean, rtol=1e-4, atol=1e-6)
  assert float(state.algorithm_state["reward_count"]) == 24
  # The policy has moved away from the reference: the shift is not 0.
  assert abs(running.mean) > 1e-4


def _params_of(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_tr_dpo_mixes_the_policy_into_its_reference(data):
  config = _config(data["pairs"], "tr_dpo", tr_dpo__sync_steps=2,
                   tr_dpo__mixup_alpha=0.5, optimizer__name="sgd",
                   optimizer__learning_rate=0.5,
                   optimizer__grad_clip_norm=0.0)
  trainer, mesh, rules = _trainer(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer.init_state()
    start = _params_of(state.params["policy"])
    ref = _params_of(state.frozen["reference"])
    batches = trainer.train_batches(0)
    for step in range(1, 5):
      batch = sharding.global_batch(next(batches), mesh, rules)
      pi = scoring.sequence_logprobs(trainer.lm, state.params["policy"],
                                     batch, ("chosen", "rejected"))
      ref_lp = scoring.sequence_logprobs(trainer.lm, ref, batch,
                                         ("chosen", "rejected"))
      # The step's DPO loss reads the reference as it stands.
      expected, _ = preference.direct_preference_loss(
          pi["chosen"], pi["rejected"], ref_lp["chosen"], ref_lp["rejected"],
          beta=config.dpo.beta)
      state, metrics = trainer.train_step(state, batch)
      np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
      policy = _params_of(state.params["policy"])
      if step % 2 == 0:
        ref = jax.tree.map(lambda p, r: 0.5 * p + 0.5 * r, policy, ref)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                           atol=1e-7),
                   _params_of(state.frozen["reference"]), ref)
    # Evaluation compares with the policy the run started from, not the
    # moving reference.
    jax.tree.map(np.testing.assert_array_equal,
                 _params_of(trainer.reference_params(state)), start)


@pytest.mark.parametrize("algorithm", ["bco", "tr_dpo"])
def test_a_resumed_run_carries_on_exactly(data, algorithm, tmp_path,
                                          monkeypatch):
  """2 steps, then 2 more after a resume, equal 4 steps at once: the
  parameters, the optimizer state and what the algorithm carries."""
  monkeypatch.setitem(algorithms.REGISTRY, algorithm, evaluated_by(
      from_scratch(algorithms.get(algorithm))))
  path = data["thumbs" if algorithm == "bco" else "pairs"]
  extra = {"tr_dpo__sync_steps": 3} if algorithm == "tr_dpo" else {}

  def run(workdir, steps):
    config = _config(path, algorithm, train__num_steps=steps,
                     checkpoint__every_steps=2, **extra)
    loop.train(config, str(workdir), devices=jax.devices()[:1])
    return checkpoint_files.restore_state_as_numpy(os.path.join(
        workdir, "checkpoints", str(steps), "state"))

  run(tmp_path / "resumed", 2)
  resumed = run(tmp_path / "resumed", 4)
  straight = run(tmp_path / "straight", 4)
  for part in ("params", "opt_state", "frozen", "algorithm_state"):
    jax.tree.map(np.testing.assert_array_equal, resumed[part], straight[part])
  if algorithm == "bco":
    assert float(straight["algorithm_state"]["reward_count"]) == 32
