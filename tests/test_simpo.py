"""SimPO (jaxrlhf/algorithms/offline/simpo.py).

Truths used: the SimPO paper's loss -log sigmoid(beta/|y_w| log pi(y_w) -
beta/|y_l| log pi(y_l) - gamma) and TRL's CPOTrainer arrangement of it
(loss_type "simpo": beta * ((avg_w - avg_l) - gamma / beta)), both written
in numpy; the closed-form gradient of the logistic loss; a training run
that must raise the chosen completions' reward above the rejected ones'
without ever holding a reference network; and the command line.
"""


import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, tiny_config
from conftest import one_device_mesh, synthetic_feedback_file, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.offline import simpo
from jaxrlhf.losses import preference
from jaxrlhf.models import scoring

# Hand-made pairs: summed log-probs and completion lengths (EOS included).
CHOSEN = np.array([-4.0, -9.0, -2.5, -12.0], np.float32)
REJECTED = np.array([-6.0, -7.5, -2.0, -30.0], np.float32)
CHOSEN_LEN = np.array([4, 6, 2, 8], np.float32)
REJECTED_LEN = np.array([3, 5, 4, 10], np.float32)


def _log_sigmoid(z):
  return -np.logaddexp(0.0, -z)


def _paper_loss(chosen, rejected, lc, lr, beta, gamma):
  """Meng et al. 2024, section 2: the mean over pairs."""
  return np.mean(-_log_sigmoid(beta * chosen / lc - beta * rejected / lr
                               - gamma))


def _trl_loss(chosen, rejected, lc, lr, beta, gamma):
  """TRL CPOTrainer, loss_type='simpo', label_smoothing 0, cpo_alpha 0:
  average log-probs, logits = (avg_w - avg_l) - simpo_gamma / beta,
  losses = -logsigmoid(beta * logits), then the mean."""
  logits = (chosen / lc - rejected / lr) - gamma / beta
  return np.mean(-_log_sigmoid(beta * logits))


def _simpo(chosen, rejected, beta, gamma, lc=CHOSEN_LEN, lr=REJECTED_LEN):
  return preference.direct_preference_loss(
      chosen, rejected, None, None, beta=beta, target_margin=gamma,
      length_normalize=True, reference_free=True, chosen_lengths=lc,
      rejected_lengths=lr)


@pytest.mark.parametrize("beta,gamma", [(2.0, 1.0), (2.5, 0.3), (0.1, 0.5)])
def test_loss_matches_the_paper_and_trl(beta, gamma):
  loss, metrics = _simpo(CHOSEN, REJECTED, beta, gamma)
  expected = _paper_loss(CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN, beta,
                         gamma)
  np.testing.assert_allclose(expected, _trl_loss(
      CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN, beta, gamma), rtol=1e-12)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  # Rewards are TRL's: beta times the average log-probs, no reference.
  np.testing.assert_allclose(metrics["chosen_reward"],
                             np.mean(beta * CHOSEN / CHOSEN_LEN), rtol=1e-6)
  np.testing.assert_allclose(metrics["rejected_reward"],
                             np.mean(beta * REJECTED / REJECTED_LEN),
                             rtol=1e-6)
  # Per-token: -1, -1.5, -1.25, -1.5 against -2, -1.5, -0.5, -3.
  np.testing.assert_allclose(metrics["reward_accuracy"], (1 + 0.5 + 0 + 1) / 4)


def test_gradient_vanishes_once_the_margin_is_met_by_far():
  """d loss / d log pi(y_w) = -sigmoid(gamma - beta * Delta) * beta / |y_w|
  / B: beta / (2 |y_w| B) where beta * Delta = gamma, ~0 where beta * Delta
  exceeds gamma by far, whatever the completions' lengths."""
  beta, gamma = 2.0, 1.0
  lc, lr = np.array([5.0, 9.0], np.float32), np.array([3.0, 7.0], np.float32)
  grad = jax.grad(lambda c, r: _simpo(c, r, beta, gamma, lc, lr)[0],
                  argnums=(0, 1))
  rejected = np.array([-3.0, -14.0], np.float32)

  def chosen_for(z):  # beta * Delta - gamma = z in every pair
    return (lc * ((z + gamma) / beta + rejected / lr)).astype(np.float32)

  g_chosen, g_rejected = grad(chosen_for(0.0), rejected)
  np.testing.assert_allclose(g_chosen, -beta / (2 * lc * 2), rtol=1e-5)
  np.testing.assert_allclose(g_rejected, beta / (2 * lr * 2), rtol=1e-5)
  g_chosen, g_rejected = grad(chosen_for(30.0), rejected)
  assert np.max(np.abs(g_chosen)) < 1e-12 and np.max(np.abs(g_rejected)) < 1e-12
  # Short of the margin the gradient is the full logistic slope.
  g_chosen, _ = grad(chosen_for(-30.0), rejected)
  np.testing.assert_allclose(g_chosen, -beta / (lc * 2), rtol=1e-5)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  return synthetic_feedback_file(tmp_path_factory.mktemp("simpo"), "pairs",
                                 beta=10.0)


def _config(pairs_path, **overrides):
  config = tiny_config(algorithm="simpo", data__task="simpo_pairs",
                       optimizer__warmup_steps=0,
                       eval__task="synthetic_summarize", **overrides)
  config.data.files.train = pairs_path
  return config


def test_trains_without_a_reference_network(pairs):
  config = _config(pairs)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("simpo")), config, mesh)
    state = trainer.init_state()
    assert state.frozen == {} and set(state.params) == {"policy"}
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    # The algorithm's loss is the paper's formula of the policy's own
    # log-probs and of the completions' token counts (EOS included).
    logps = scoring.sequence_logprobs(trainer.lm, state.params["policy"],
                                      batch, ("chosen", "rejected"))
    lengths = {n: np.sum(np.asarray(batch[f"{n}_decoder_target_tokens"]) > 0,
                         axis=-1) for n in ("chosen", "rejected")}
    loss, _ = simpo.loss(trainer, state.params, state, batch, None)
    np.testing.assert_allclose(loss, _paper_loss(
        np.asarray(logps["chosen"], np.float64),
        np.asarray(logps["rejected"], np.float64), lengths["chosen"],
        lengths["rejected"], config.simpo.beta, config.simpo.gamma),
                               rtol=1e-5)
    history = []
    for _ in range(8):
      state, metrics = trainer.train_step(state, batch)
      history.append((float(metrics["loss"]),
                      float(metrics["reward_accuracy"])))
    result = trainer.evaluate(state)
  (first_loss, first_accuracy), (last_loss, last_accuracy) = (history[0],
                                                              history[-1])
  assert last_loss < first_loss and last_accuracy > first_accuracy
  # Judged against the policy it started from, which is no longer equal.
  assert 0.0 <= result["eval/win_rate"] <= 1.0 and result["eval/kl"] > 0.0
