"""Tests for reward-model losses (jaxrlhf/losses/reward_model_losses.py).

Truths used: values and gradients computed by hand, the Plackett–Luce
probabilities of every permutation summing to 1, and numpy statistics.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.losses import reward_model_losses as rm

# Compiled once per shape: op-by-op dispatch of the K x K log-sum-exp is slow.
plackett_luce_loss = jax.jit(rm.plackett_luce_loss)


def _log_sigmoid(x):
  return -math.log1p(math.exp(-x))


def test_bradley_terry_value_and_gradient_by_hand():
  chosen = np.array([2.0, 0.0, -1.0], np.float32)
  rejected = np.array([1.0, 0.5, -1.0], np.float32)
  loss, metrics = rm.bradley_terry_loss(chosen, rejected)
  expected = -(_log_sigmoid(1.0) + _log_sigmoid(-0.5) + _log_sigmoid(0.0)) / 3
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  # Accuracy: win, loss, tie (1/2).
  np.testing.assert_allclose(metrics["accuracy"], 1.5 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["chosen_reward"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["rejected_reward"], 0.5 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["margin"], 0.5 / 3, rtol=1e-6)

  # d/dr_c -log s(r_c - r_r) = -(1 - s(r_c - r_r)) = -s(r_r - r_c).
  grad_c, grad_r = jax.grad(lambda c, r: rm.bradley_terry_loss(c, r)[0],
                            argnums=(0, 1))(chosen, rejected)
  sig = lambda x: 1 / (1 + math.exp(-x))
  expected_c = np.array([-sig(-1.0), -sig(0.5), -sig(0.0)]) / 3
  np.testing.assert_allclose(grad_c, expected_c, rtol=1e-5)
  np.testing.assert_allclose(grad_r, -expected_c, rtol=1e-5)


def test_bradley_terry_margin_and_centering_by_hand():
  chosen = np.array([2.0, 1.0], np.float32)
  rejected = np.array([1.0, 2.0], np.float32)
  margin = np.array([0.5, 1.0], np.float32)
  loss, metrics = rm.bradley_terry_loss(chosen, rejected, margin=margin,
                                        centering_coef=0.01)
  bt = -(_log_sigmoid(1.0 - 0.5) + _log_sigmoid(-1.0 - 1.0)) / 2
  centering = (3.0**2 + 3.0**2) / 2
  np.testing.assert_allclose(metrics["bt_loss"], bt, rtol=1e-6)
  np.testing.assert_allclose(loss, bt + 0.01 * centering, rtol=1e-6)
  # The margin shifts the loss, not the reported reward margin.
  np.testing.assert_allclose(metrics["margin"], 0.0, atol=1e-7)


def test_prompt_balancing_counts_each_prompt_once():
  rng = np.random.default_rng(0)
  chosen = rng.normal(size=4).astype(np.float32)
  rejected = rng.normal(size=4).astype(np.float32)
  prompt_ids = np.array([7, 7, 7, 3])  # prompt 7: C(3,2) = 3 pairs
  per_pair = [-_log_sigmoid(float(c - r)) for c, r in zip(chosen, rejected)]
  expected = 0.5 * (np.mean(per_pair[:3]) + per_pair[3])
  loss, _ = rm.bradley_terry_loss(chosen, rejected, prompt_ids=prompt_ids)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)

  # Repeating a prompt's comparisons does not change its share of the loss.
  loss_dup, _ = rm.bradley_terry_loss(
      np.concatenate([chosen, chosen[3:]]),
      np.concatenate([rejected, rejected[3:]]),
      prompt_ids=np.array([7, 7, 7, 3, 3]))
  np.testing.assert_allclose(loss_dup, expected, rtol=1e-6)

  weights = rm.prompt_balanced_weights(jnp.array([1, 2, 1, 1, 2]),
                                       jnp.array([1.0, 1.0, 1.0, 0.0, 1.0]))
  np.testing.assert_allclose(weights, [0.5, 0.5, 0.5, 0.0, 0.5])
  # Padding pairs (weight 0) are ignored under jit too.
  padded = jax.jit(lambda c, r, p, w: rm.bradley_terry_loss(
      c, r, prompt_ids=p, weights=w)[0])(
          np.append(chosen, 9.0), np.append(rejected, -9.0),
          np.append(prompt_ids, 3), np.array([1, 1, 1, 1, 0], np.float32))
  np.testing.assert_allclose(padded, expected, rtol=1e-6)


def test_plackett_luce_k2_equals_bradley_terry():
  rng = np.random.default_rng(1)
  chosen = rng.normal(size=6).astype(np.float32)
  rejected = rng.normal(size=6).astype(np.float32)
  pl, pl_metrics = plackett_luce_loss(np.stack([chosen, rejected], 1))
  bt, bt_metrics = rm.bradley_terry_loss(chosen, rejected)
  np.testing.assert_allclose(pl, bt, rtol=1e-5)
  np.testing.assert_allclose(pl_metrics["pairwise_accuracy"],
                             bt_metrics["accuracy"], rtol=1e-6)


def test_plackett_luce_probabilities_sum_to_one_over_permutations():
  rewards = np.array([0.3, -1.2, 2.0], np.float32)
  orders = list(itertools.permutations(range(3)))
  ranked = np.stack([rewards[list(order)] for order in orders])
  # Per-ranking NLL via weights that pick one row at a time.
  total = 0.0
  for row in range(len(orders)):
    weights = np.eye(len(orders), dtype=np.float32)[row]
    nll, _ = plackett_luce_loss(ranked, weights=weights)
    total += math.exp(-float(nll))
  np.testing.assert_allclose(total, 1.0, rtol=1e-5)


def test_plackett_luce_k3_by_hand_and_mask():
  r = [1.0, 0.5, -0.5]
  ranked = np.array([r], np.float32)
  lse = lambda xs: math.log(sum(math.exp(x) for x in xs))
  expected = -((r[0] - lse(r)) + (r[1] - lse(r[1:])))
  nll, metrics = plackett_luce_loss(ranked)
  np.testing.assert_allclose(nll, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["top1_accuracy"], 1.0)
  np.testing.assert_allclose(metrics["pairwise_accuracy"], 1.0)

  # A ranking of 2 out of K = 3 columns (middle one unused, filled with junk)
  # is the Bradley–Terry loss of the two present items.
  ranked = np.array([[1.0, 50.0, -0.5]], np.float32)
  mask = np.array([[1, 0, 1]], np.float32)
  nll, metrics = plackett_luce_loss(ranked, mask)
  np.testing.assert_allclose(nll, -_log_sigmoid(1.5), rtol=1e-6)
  np.testing.assert_allclose(metrics["pairwise_accuracy"], 1.0)
  grads = jax.grad(lambda x: plackett_luce_loss(x, mask)[0])(ranked)
  assert np.all(np.isfinite(grads))
  assert grads[0, 1] == 0.0
  # Trailing padding too, including a single present item (NLL 0).
  ranked = np.array([[2.0, 0.0, 0.0], [3.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  nll, _ = plackett_luce_loss(ranked, mask)
  np.testing.assert_allclose(nll, -_log_sigmoid(2.0) / 2, rtol=1e-6)
  grads = jax.grad(lambda x: plackett_luce_loss(x, mask)[0])(ranked)
  assert np.all(np.isfinite(grads))


all_pairs_ranking_loss = jax.jit(rm.all_pairs_ranking_loss)


def test_all_pairs_ranking_loss_matches_plain_python():
  rng = np.random.default_rng(3)
  ranked = rng.normal(size=(4, 4)).astype(np.float32)
  # Rankings of 4, 3 (last column padding), 2 (middle columns unused) items,
  # and one whose padded column holds junk that must not count.
  mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0]],
                  np.float32)
  ranked[3, 2:] = 100.0
  weights = np.array([1.0, 2.0, 1.0, 0.5], np.float32)
  per_ranking, top1, pairwise = [], [], []
  for row, present in zip(ranked, mask):
    items = [float(r) for r, m in zip(row, present) if m]
    pairs = list(itertools.combinations(range(len(items)), 2))
    # InstructGPT: each of the C(K, 2) comparisons weighs 1 / C(K, 2).
    per_ranking.append(sum(-_log_sigmoid(items[a] - items[b])
                           for a, b in pairs) / len(pairs))
    pairwise.append(sum(items[a] > items[b] for a, b in pairs) / len(pairs))
    top1.append(float(items[0] > max(items[1:])))
  mean = lambda xs: float(np.dot(weights, xs) / weights.sum())
  loss, metrics = all_pairs_ranking_loss(ranked, mask, weights=weights)
  np.testing.assert_allclose(loss, mean(per_ranking), rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], loss)
  np.testing.assert_allclose(metrics["pairwise_accuracy"], mean(pairwise),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["top1_accuracy"], mean(top1), rtol=1e-6)
  grads = jax.grad(lambda x: rm.all_pairs_ranking_loss(x, mask)[0])(ranked)
  assert np.all(np.isfinite(grads))
  np.testing.assert_array_equal(grads[mask == 0], 0.0)


def test_all_pairs_ranking_loss_k2_equals_bradley_terry():
  rng = np.random.default_rng(4)
  chosen = rng.normal(size=5).astype(np.float32)
  rejected = rng.normal(size=5).astype(np.float32)
  loss, metrics = all_pairs_ranking_loss(np.stack([chosen, rejected], 1))
  bt, bt_metrics = rm.bradley_terry_loss(chosen, rejected)
  np.testing.assert_allclose(loss, bt, rtol=1e-5)
  np.testing.assert_allclose(metrics["pairwise_accuracy"],
                             bt_metrics["accuracy"], rtol=1e-6)


def test_calibration_table_on_hand_made_pairs():
  # gap r_c - r_r and confidence sigmoid(|gap|), 5 bins of width 0.1 on [.5,1]:
  #  0.0 -> 0.500 bin 0, tie (1/2)
  #  0.2 -> 0.550 bin 0, right
  # -0.2 -> 0.550 bin 0, wrong
  #  1.0 -> 0.731 bin 2, right
  #  3.0 -> 0.953 bin 4, right
  # -3.0 -> 0.953 bin 4, wrong
  # 10.0 -> 1.000 bin 4, right
  gaps = np.array([0.0, 0.2, -0.2, 1.0, 3.0, -3.0, 10.0], np.float32)
  table = rm.calibration_table(gaps, np.zeros_like(gaps), num_bins=5)
  np.testing.assert_allclose(table["bin_edges"], [0.5, 0.6, 0.7, 0.8, 0.9,
                                                  1.0], atol=1e-7)
  np.testing.assert_array_equal(table["counts"], [3, 0, 1, 0, 3])
  np.testing.assert_allclose(table["accuracy"], [0.5, 0, 1, 0, 2 / 3],
                             atol=1e-6)
  sig = lambda x: 1 / (1 + math.exp(-x))
  conf0 = (0.5 + 2 * sig(0.2)) / 3
  conf4 = (2 * sig(3.0) + sig(10.0)) / 3
  np.testing.assert_allclose(table["mean_confidence"],
                             [conf0, 0, sig(1.0), 0, conf4], rtol=1e-5)
  ece = (3 * abs(0.5 - conf0) + abs(1 - sig(1.0)) + 3 * abs(2 / 3 - conf4)) / 7
  np.testing.assert_allclose(table["expected_calibration_error"], ece,
                             rtol=1e-5)
  with pytest.raises(ValueError, match="num_bins"):
    rm.calibration_table(gaps, gaps, num_bins=0)


def test_reward_normalisation_helpers():
  rng = np.random.default_rng(2)
  reference = rng.normal(3.0, 2.5, size=50).astype(np.float32)
  bias = rm.zero_mean_reward_bias(reference)
  np.testing.assert_allclose(np.mean(reference + np.asarray(bias)), 0.0,
                             atol=1e-5)
  gain, bias = rm.reward_gain_and_bias(reference)
  mapped = reference * float(gain) + float(bias)
  np.testing.assert_allclose(np.mean(mapped), 0.0, atol=1e-5)
  np.testing.assert_allclose(np.std(mapped), 1.0, rtol=1e-5)
  # Masked entries do not count.
  mask = np.ones(51, np.float32)
  mask[-1] = 0
  padded = np.append(reference, 1e6).astype(np.float32)
  np.testing.assert_allclose(rm.zero_mean_reward_bias(padded, mask),
                             -np.mean(reference), rtol=1e-5)
  gain2, bias2 = rm.reward_gain_and_bias(padded, mask, target_mean=1.0,
                                         target_std=2.0)
  mapped = reference * float(gain2) + float(bias2)
  np.testing.assert_allclose([np.mean(mapped), np.std(mapped)], [1.0, 2.0],
                             rtol=1e-5)


def test_reward_model_errors():
  x = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="shapes must match"):
    rm.bradley_terry_loss(x, np.zeros(4))
  with pytest.raises(ValueError, match="rank 1"):
    rm.bradley_terry_loss(np.zeros((3, 2)), np.zeros((3, 2)))
  with pytest.raises(ValueError, match="rank 2"):
    rm.plackett_luce_loss(x)
  with pytest.raises(ValueError, match="rank 2"):
    rm.all_pairs_ranking_loss(x)
  with pytest.raises(ValueError, match="shapes must match"):
    rm.all_pairs_ranking_loss(np.zeros((3, 2)), np.zeros((3, 3)))
