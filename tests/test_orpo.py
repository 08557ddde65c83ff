"""ORPO (jaxrlhf/losses/orpo_losses.py, jaxrlhf/algorithms/offline/orpo.py).

Truths used: the ORPO paper's objective (the chosen completion's token NLL
plus lambda times -log sigmoid of the log odds ratio of the length-
normalised likelihoods) and TRL's ORPOTrainer arrangement of it
(`policy_nll_loss - mean(beta * logsigmoid(log_odds))`), both in float64
numpy; lambda = 0 is SFT on the chosen completions, checked against the SFT
loss of the model itself; a training run that must make the chosen
completions the likelier ones without holding a reference network; and the
command line.
"""


import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, tiny_config
from conftest import one_device_mesh, synthetic_feedback_file, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.offline import orpo
from jaxrlhf.algorithms.offline import sft
from jaxrlhf.losses import orpo_losses as orpo_losses
from jaxrlhf.losses import sft_losses as sft_losses
from jaxrlhf.models import scoring

CHOSEN = np.array([-4.0, -9.0, -2.5, -12.0, -0.3], np.float32)
REJECTED = np.array([-6.0, -7.5, -2.0, -30.0, -9.0], np.float32)
CHOSEN_LEN = np.array([4, 6, 2, 8, 3], np.float32)
REJECTED_LEN = np.array([3, 5, 4, 10, 6], np.float32)


def _log_sigmoid(z):
  return -np.logaddexp(0.0, -z)


def _paper_loss(chosen, rejected, lc, lr, lam):
  """Hong et al. 2024: mean over pairs of L_SFT + lambda L_OR, with
  P = exp(mean token log-prob) and odds = P / (1 - P)."""
  p_w, p_l = np.exp(chosen / lc), np.exp(rejected / lr)
  odds_w, odds_l = p_w / (1 - p_w), p_l / (1 - p_l)
  l_or = -_log_sigmoid(np.log(odds_w / odds_l))
  l_sft = -chosen / lc
  return np.mean(l_sft + lam * l_or), np.mean(l_or)


def _trl_loss(chosen, rejected, lc, lr, beta):
  """TRL ORPOTrainer (encoder-decoder): average log-probs, log_odds =
  (avg_w - avg_l) - (log1p(-exp(avg_w)) - log1p(-exp(avg_l))), losses =
  beta * logsigmoid(log_odds); loss = NLL over all chosen tokens - mean."""
  avg_w, avg_l = chosen / lc, rejected / lr
  log_odds = (avg_w - avg_l) - (np.log1p(-np.exp(avg_w))
                                - np.log1p(-np.exp(avg_l)))
  token_nll = -np.sum(chosen) / np.sum(lc)
  return token_nll - np.mean(beta * _log_sigmoid(log_odds))


def _orpo(chosen, rejected, lam, lc=CHOSEN_LEN, lr=REJECTED_LEN):
  return orpo_losses.orpo_loss(chosen, rejected, lc, lr,
                               odds_ratio_weight=lam)


@pytest.mark.parametrize("lam", [0.1, 0.2, 1.0])
def test_loss_matches_the_paper(lam):
  loss, metrics = _orpo(CHOSEN, REJECTED, lam)
  c, r = CHOSEN.astype(np.float64), REJECTED.astype(np.float64)
  expected, odds_ratio_loss = _paper_loss(c, r, CHOSEN_LEN, REJECTED_LEN, lam)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["odds_ratio_loss"], odds_ratio_loss,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["nll"], np.mean(-c / CHOSEN_LEN),
                             rtol=1e-6)
  # Per token: -1, -1.5, -1.25, -1.5, -0.1 against -2, -1.5, -0.5, -3, -1.5.
  np.testing.assert_allclose(metrics["reward_accuracy"], 3.5 / 5)


def test_loss_is_trls_when_the_chosen_lengths_agree():
  """TRL averages the NLL over the batch's chosen tokens, the paper over
  each completion's: the same number for chosen completions of one length."""
  lc = np.full(5, 4.0, np.float32)
  loss, _ = _orpo(CHOSEN, REJECTED, 0.1, lc=lc)
  np.testing.assert_allclose(loss, _trl_loss(
      CHOSEN.astype(np.float64), REJECTED.astype(np.float64), lc,
      REJECTED_LEN, 0.1), rtol=1e-6)


def test_lambda_zero_is_the_chosen_nll_exactly():
  grad = jax.grad(lambda c, r: _orpo(c, r, 0.0)[0], argnums=(0, 1))
  loss, _ = _orpo(CHOSEN, REJECTED, 0.0)
  np.testing.assert_allclose(loss, np.mean(-CHOSEN / CHOSEN_LEN), rtol=1e-7)
  g_chosen, g_rejected = grad(CHOSEN, REJECTED)
  np.testing.assert_allclose(g_chosen, -1.0 / (CHOSEN_LEN * len(CHOSEN)),
                             rtol=1e-6)
  np.testing.assert_array_equal(g_rejected, np.zeros(len(REJECTED)))


def test_log1mexp_is_accurate_near_zero_and_far_from_it():
  x = -np.logspace(-6, 2, 50).astype(np.float32)
  np.testing.assert_allclose(orpo_losses.log1mexp(x),
                             np.log(-np.expm1(x.astype(np.float64))),
                             rtol=1e-5, atol=1e-7)


def test_certain_completions_keep_the_loss_and_gradient_finite():
  """A completion whose every token has probability 1 (mean log-prob 0) has
  infinite odds; the loss stays finite and so does its gradient."""
  chosen = np.array([0.0, -3.0], np.float32)
  rejected = np.array([-2.0, 0.0], np.float32)
  lengths = np.array([2.0, 3.0], np.float32)
  value, grads = jax.value_and_grad(lambda c, r: _orpo(
      c, r, 0.5, lengths, lengths)[0], argnums=(0, 1))(chosen, rejected)
  assert np.isfinite(value)
  assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  return synthetic_feedback_file(tmp_path_factory.mktemp("orpo"), "pairs",
                                 beta=10.0)


def _config(pairs_path, **overrides):
  config = tiny_config(algorithm="orpo", data__task="orpo_pairs",
                       optimizer__warmup_steps=0,
                       eval__task="synthetic_summarize", **overrides)
  config.data.files.train = pairs_path
  return config


def test_trains_without_a_reference_network(pairs):
  config = _config(pairs)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("orpo")), config, mesh)
    state = trainer.init_state()
    assert state.frozen == {} and set(state.params) == {"policy"}
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    params = state.params["policy"]
    # The algorithm's loss is the paper's formula of the policy's own
    # log-probs and of the completions' token counts (EOS included).
    logps = scoring.sequence_logprobs(trainer.lm, params, batch,
                                      ("chosen", "rejected"))
    lengths = {n: np.sum(np.asarray(batch[f"{n}_decoder_target_tokens"]) > 0,
                         axis=-1) for n in ("chosen", "rejected")}
    loss, _ = orpo.loss(trainer, state.params, state, batch, None)
    expected, _ = _paper_loss(
        np.asarray(logps["chosen"], np.float64),
        np.asarray(logps["rejected"], np.float64), lengths["chosen"],
        lengths["rejected"], config.orpo.odds_ratio_weight)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # lambda = 0: the SFT loss (token cross-entropy) of each chosen
    # completion given its prompt, averaged over pairs.
    with config.unlocked():
      config.orpo.odds_ratio_weight = 0.0
    nll_only, _ = orpo.loss(trainer, state.params, state, batch, None)
    view = {"encoder_input_tokens": batch["encoder_input_tokens"]}
    view.update({k[len("chosen_"):]: v for k, v in batch.items()
                 if k.startswith("chosen_")})  # an SFT batch of the chosen
    logits, targets, weights = sft.next_token_targets(trainer.lm, params, view)
    per_pair = [sft_losses.cross_entropy_loss(logits[i:i + 1],
                                              targets[i:i + 1],
                                              weights[i:i + 1])[0]
                for i in range(logits.shape[0])]
    np.testing.assert_allclose(nll_only, np.mean(per_pair), rtol=1e-5)
    with config.unlocked():
      config.orpo.odds_ratio_weight = 0.1
    history = []
    for _ in range(8):
      state, metrics = trainer.train_step(state, batch)
      history.append((float(metrics["loss"]),
                      float(metrics["odds_ratio_loss"])))
  (first_loss, first_or), (last_loss, last_or) = history[0], history[-1]
  assert last_loss < first_loss and last_or < first_or
  assert metrics["reward_accuracy"] > 0.5 and metrics["log_odds_ratio"] > 0
