"""Best-of-N / rejection-sampling selection and the best-of-N KL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import rl

# The RLHF book's example (10.2.2.3): 5 prompts x 4 completions.
BOOK_REWARDS = np.array([
    [0.7, 0.3, 0.5, 0.2],
    [0.4, 0.8, 0.6, 0.5],
    [0.9, 0.3, 0.4, 0.7],
    [0.2, 0.5, 0.8, 0.6],
    [0.5, 0.4, 0.3, 0.6],
], np.float32)


def test_top_per_prompt_book_example():
  # Book: S(R) = [1, 2, 1, 3, 4] (1-based).
  np.testing.assert_array_equal(jax.jit(rl.top_per_prompt)(BOOK_REWARDS),
                                [0, 1, 0, 2, 3])


def test_top_k_overall_book_example():
  prompt, completion, scores = rl.top_k_overall(BOOK_REWARDS, 5)
  # The five largest: 0.9 (p3,c1), 0.8 (p2,c2), 0.8 (p4,c3), 0.7 (p1,c1),
  # 0.7 (p3,c4). (The book's list says index 19 for the last one, a typo:
  # flat index 19 holds 0.6; 0.7 sits at flat index 11.)
  assert set(zip(prompt.tolist(), completion.tolist())) == {
      (2, 0), (1, 1), (3, 2), (0, 0), (2, 3)}
  np.testing.assert_allclose(scores, [0.9, 0.8, 0.8, 0.7, 0.7])
  with pytest.raises(ValueError, match="k=21"):
    rl.top_k_overall(BOOK_REWARDS, 21)


def test_gather_per_prompt_picks_the_best_sample():
  samples = jnp.arange(5 * 4 * 3).reshape(5, 4, 3)
  best = rl.gather_per_prompt(samples, rl.top_per_prompt(BOOK_REWARDS))
  np.testing.assert_array_equal(best, np.asarray(samples)[
      np.arange(5), [0, 1, 0, 2, 3]])


def exact_best_of_n_kl(base_probs, rewards, n):
  """KL(best-of-n || base) by enumeration, for distinct rewards.

  The best of n i.i.d. draws is outcome i (in ascending reward order) with
  probability F_i^n - F_{i-1}^n, F the base CDF over that order.
  """
  order = np.argsort(rewards)
  p = np.asarray(base_probs, np.float64)[order]
  cdf = np.cumsum(p)
  cdf_before = np.concatenate([[0.0], cdf[:-1]])
  q = cdf ** n - cdf_before ** n
  keep = q > 0
  return float(np.sum(q[keep] * np.log(q[keep] / p[keep])))


def test_best_of_n_kl_formula_values():
  np.testing.assert_allclose(rl.best_of_n_kl(1), 0.0, atol=1e-7)
  np.testing.assert_allclose(rl.best_of_n_kl(2), np.log(2) - 0.5, rtol=1e-6)
  np.testing.assert_allclose(rl.best_of_n_kl(jnp.array([4.0, 64.0])),
                             [np.log(4) - 0.75, np.log(64) - 63 / 64],
                             rtol=1e-6)


@pytest.mark.parametrize("n", [2, 4, 16, 64])
def test_best_of_n_kl_bound_becomes_tight_for_continuous_rewards(n):
  # M equally likely outcomes with distinct rewards: as M grows the reward
  # becomes continuous and the exact KL rises to the formula.
  formula = float(rl.best_of_n_kl(n))
  gaps = []
  for num_outcomes in (10, 1000, 100_000):
    rewards = np.random.default_rng(n).permutation(num_outcomes)
    exact = exact_best_of_n_kl(np.full(num_outcomes, 1 / num_outcomes),
                               rewards, n)
    assert exact <= formula * (1 + 1e-6)   # float32 formula, float64 exact
    gaps.append(formula - exact)
  assert gaps[0] > gaps[1] > abs(gaps[2])
  np.testing.assert_allclose(exact, formula, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_of_n_kl_is_an_upper_bound_for_coarse_distributions(seed):
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.full(6, 0.5))
  rewards = rng.permutation(6)
  for n in (2, 4, 8, 32):
    exact = exact_best_of_n_kl(probs, rewards, n)
    assert 0.0 <= exact < float(rl.best_of_n_kl(n))
