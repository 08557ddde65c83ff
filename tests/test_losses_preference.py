"""Tests for the DPO family and KTO (jaxrlhf/losses/preference.py).

Truths used: closed-form optima of the expected losses (derived in the
docstrings), identities between the losses under label flips, and values
computed by hand with `math`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.losses import preference

dpl = preference.direct_preference_loss


def _sigmoid(x):
  return 1.0 / (1.0 + math.exp(-x))


def _minimise(loss_fn, params, steps, learning_rate):
  # The step size decays to 0, so the iterate settles on the minimum instead
  # of orbiting it at a distance that depends on rounding.
  optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, steps))

  def step(carry, _):
    params, opt_state = carry
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  run = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps)[0])
  return run((params, optimizer.init(params)))[0]


def _all_ordered_pairs(n):
  return np.array([(i, j) for i in range(n) for j in range(n) if i != j])


def test_dpo_optimum_recovers_bradley_terry_reward_differences():
  """Expected DPO loss on BT preferences P(i > j) = sigmoid(r_i - r_j) is
  minimised when beta log(pi/pi_ref)(i) - beta log(pi/pi_ref)(j) = r_i - r_j:
  the per-pair expected loss -p log s(z) - (1-p) log s(-z) is minimal at
  s(z) = p, and the BT differences are consistent across pairs."""
  rng = np.random.default_rng(0)
  n, beta = 4, 0.5
  rewards = rng.normal(size=n)
  ref_logits = rng.normal(size=n)
  ref_logp = ref_logits - np.log(np.exp(ref_logits).sum())
  pairs = _all_ordered_pairs(n)
  chosen, rejected = pairs[:, 0], pairs[:, 1]
  # Each ordered pair (i chosen, j rejected) weighted by how often it is
  # labelled that way: the exact expectation over the preference labels.
  weights = 1 / (1 + np.exp(-(rewards[chosen] - rewards[rejected])))

  def loss_fn(logits):
    logp = jax.nn.log_softmax(logits)
    return dpl(logp[chosen], logp[rejected], ref_logp[chosen],
               ref_logp[rejected], loss_type="dpo", beta=beta,
               weights=weights)[0]

  logits = _minimise(loss_fn, jnp.zeros(n), steps=3000, learning_rate=0.05)
  implicit = beta * (np.asarray(jax.nn.log_softmax(logits)) - ref_logp)
  np.testing.assert_allclose(implicit[:, None] - implicit[None, :],
                             rewards[:, None] - rewards[None, :], atol=1e-3)


def _two_completion_prompts(probabilities):
  """Prompt k has completions (1, 2) and P(1 > 2) = p_k. Rows: (1 > 2) weighted
  p_k and (2 > 1) weighted 1 - p_k."""
  p = np.asarray(probabilities)
  weights = np.concatenate([p, 1 - p])
  return weights


def _learn_pairwise_delta(probabilities, **loss_kwargs):
  num_prompts = len(probabilities)
  weights = _two_completion_prompts(probabilities)
  ref_logp = np.log(np.array([0.3, 0.7]))

  def loss_fn(logits):  # logits [num_prompts, 2]
    logp = jax.nn.log_softmax(logits, axis=-1)
    first, second = logp[:, 0], logp[:, 1]
    chosen = jnp.concatenate([first, second])
    rejected = jnp.concatenate([second, first])
    ref_c = np.concatenate([np.full(num_prompts, ref_logp[0]),
                            np.full(num_prompts, ref_logp[1])])
    ref_r = np.concatenate([np.full(num_prompts, ref_logp[1]),
                            np.full(num_prompts, ref_logp[0])])
    return dpl(chosen, rejected, ref_c, ref_r, weights=weights,
               **loss_kwargs)[0]

  logits = _minimise(loss_fn, jnp.zeros((num_prompts, 2)), steps=3000,
                     learning_rate=0.05)
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  return (logp[:, 0] - ref_logp[0]) - (logp[:, 1] - ref_logp[1])


def test_ipo_reaches_its_fixed_point():
  """IPO: E[loss] = p (D - c)^2 + (1 - p)(-D - c)^2 with c = 1/(2 beta);
  d/dD = 2p(D - c) + 2(1-p)(D + c) = 0  =>  D* = (2p - 1) c
  = (2p - 1)/(2 beta)."""
  probabilities = np.array([0.9, 0.6, 0.5, 0.2])
  for beta in (0.5, 2.0):
    delta = _learn_pairwise_delta(probabilities, loss_type="ipo", beta=beta)
    np.testing.assert_allclose(delta, (2 * probabilities - 1) / (2 * beta),
                               atol=1e-3)


def test_dpo_two_completion_optimum_is_logit_of_preference():
  probabilities = np.array([0.9, 0.6, 0.2])
  beta = 0.3
  delta = _learn_pairwise_delta(probabilities, loss_type="dpo", beta=beta)
  np.testing.assert_allclose(beta * delta,
                             np.log(probabilities / (1 - probabilities)),
                             atol=2e-3)


def _random_logps(seed, batch=5):
  rng = np.random.default_rng(seed)
  return tuple(rng.normal(size=batch).astype(np.float32) * 3 for _ in range(4))


def _swapped(logps):
  pc, pr, rc, rr = logps
  return pr, pc, rr, rc


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_cdpo_is_dpo_under_soft_labels(eps):
  logps = _random_logps(1)
  per_pair = lambda lp, **kw: dpl(*lp, beta=0.7, **kw)[0]
  # Batch means of a convex combination = combination of the batch means.
  expected = (1 - eps) * per_pair(logps, loss_type="dpo") + eps * per_pair(
      _swapped(logps), loss_type="dpo")
  got = per_pair(logps, loss_type="cdpo", label_smoothing=eps)
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_cdpo_optimum_is_finite():
  """With all labels y_w > y_l, DPO's loss keeps falling as z grows, cDPO's
  is minimised at z* = log((1 - eps)/eps)."""
  eps, beta = 0.2, 0.5
  z_star = math.log((1 - eps) / eps)

  def loss_at(delta):
    return dpl(jnp.array([delta]), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1),
               loss_type="cdpo", beta=beta, label_smoothing=eps)[0]

  grad = jax.grad(loss_at)
  assert abs(float(grad(z_star / beta))) < 1e-6
  assert float(grad(z_star / beta - 0.5)) < 0 < float(grad(z_star / beta + 0.5))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
def test_robust_dpo_is_unbiased_under_label_flips(eps):
  """Chowdhury et al. 2024: if labels flip with probability eps, the expected
  robust loss over the flip equals the clean DPO loss, for every pair."""
  logps = _random_logps(2)
  for i in range(5):
    pair = tuple(x[i:i + 1] for x in logps)
    clean = dpl(*pair, loss_type="dpo", beta=0.4)[0]
    robust = dpl(*pair, loss_type="robust_dpo", beta=0.4, label_smoothing=eps)
    robust_flipped = dpl(*_swapped(pair), loss_type="robust_dpo", beta=0.4,
                         label_smoothing=eps)
    np.testing.assert_allclose(
        (1 - eps) * robust[0] + eps * robust_flipped[0], clean, rtol=1e-4,
        atol=1e-5)


def test_slic_hinge_by_hand():
  beta, delta_margin = 0.5, 1.0
  # Delta = chosen log-ratio - rejected log-ratio; refs are 0 here.
  deltas = np.array([4.0, 2.0, 1.0, -2.0], np.float32)
  zeros = np.zeros(4, np.float32)
  loss, _ = dpl(deltas, zeros, zeros, zeros, loss_type="slic", beta=beta,
                slic_delta=delta_margin)
  # max(0, 1 - 0.5 * Delta): 0, 0, 0.5, 2.0
  np.testing.assert_allclose(loss, (0 + 0 + 0.5 + 2.0) / 4, rtol=1e-6)
  grad = jax.grad(lambda d: dpl(d, zeros, zeros, zeros, loss_type="slic",
                                beta=beta)[0])(deltas)
  # Zero beyond the margin (beta * Delta >= delta), -beta / B inside it.
  np.testing.assert_allclose(grad, [0, 0, -0.125, -0.125], atol=1e-7)


def test_dpo_value_gradient_and_metrics_by_hand():
  beta = 0.5
  pc = np.array([-3.0, -5.0], np.float32)
  pr = np.array([-4.0, -4.0], np.float32)
  rc = np.array([-3.5, -4.0], np.float32)
  rr = np.array([-3.0, -4.5], np.float32)
  # chosen log-ratios 0.5, -1.0 ; rejected -1.0, 0.5 ; Delta 1.5, -1.5
  loss, metrics = dpl(pc, pr, rc, rr, loss_type="dpo", beta=beta)
  expected = (-math.log(_sigmoid(0.75)) - math.log(_sigmoid(-0.75))) / 2
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["chosen_reward"], (0.25 - 0.5) / 2,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["rejected_reward"], (-0.5 + 0.25) / 2,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["reward_accuracy"], 0.5)
  np.testing.assert_allclose(metrics["reward_margin"], 0.0, atol=1e-7)
  grad = jax.grad(lambda x: dpl(x, pr, rc, rr, beta=beta)[0])(pc)
  # d/dpc -log s(beta Delta) = -beta s(-beta Delta), over a batch of 2.
  np.testing.assert_allclose(
      grad, [-beta * _sigmoid(-0.75) / 2, -beta * _sigmoid(0.75) / 2],
      rtol=1e-5)
  # The reference model is frozen.
  ref_grad = jax.grad(lambda x: dpl(pc, pr, x, rr, beta=beta)[0])(rc)
  np.testing.assert_array_equal(ref_grad, np.zeros(2))


def test_length_normalised_and_reference_free_by_hand():
  pc = np.array([-6.0], np.float32)
  pr = np.array([-4.0], np.float32)
  rc = np.array([-4.0], np.float32)
  rr = np.array([-5.0], np.float32)
  lc, lr = np.array([4.0], np.float32), np.array([2.0], np.float32)
  loss, metrics = dpl(pc, pr, rc, rr, beta=2.0, length_normalize=True,
                      chosen_lengths=lc, rejected_lengths=lr)
  # chosen: -2/4 = -0.5 ; rejected: 1/2 = 0.5 ; Delta = -1
  np.testing.assert_allclose(loss, -math.log(_sigmoid(-2.0)), rtol=1e-6)
  np.testing.assert_allclose(metrics["chosen_reward"], -1.0, rtol=1e-6)
  # SimPO: reference-free, length-normalised, margin gamma.
  loss, _ = dpl(pc, pr, None, None, beta=2.0, length_normalize=True,
                reference_free=True, target_margin=0.5, chosen_lengths=lc,
                rejected_lengths=lr)
  # -6/4 - (-4/2) = 0.5 ; z = 2 * 0.5 - 0.5 = 0.5
  np.testing.assert_allclose(loss, -math.log(_sigmoid(0.5)), rtol=1e-6)


def test_dpo_plus_nll_by_hand():
  pc = np.array([-6.0, -2.0], np.float32)
  pr = np.array([-5.0, -3.0], np.float32)
  zeros = np.zeros(2, np.float32)
  lengths = np.array([3.0, 1.0], np.float32)
  loss, metrics = dpl(pc, pr, zeros, zeros, beta=1.0, nll_coef=0.5,
                      chosen_lengths=lengths)
  dpo = (-math.log(_sigmoid(-1.0)) - math.log(_sigmoid(1.0))) / 2
  nll = (6.0 / 3 + 2.0 / 1) / 2
  np.testing.assert_allclose(metrics["nll"], nll, rtol=1e-6)
  np.testing.assert_allclose(loss, dpo + 0.5 * nll, rtol=1e-6)


def test_weights_drop_padding_pairs_and_jit():
  logps = _random_logps(3, batch=4)
  weights = np.array([1, 1, 0, 0], np.float32)
  for loss_type in preference.PAIRWISE_LOSS_TYPES:
    kwargs = {"label_smoothing": 0.1} if loss_type in ("cdpo",
                                                       "robust_dpo") else {}
    fn = functools.partial(dpl, loss_type=loss_type, beta=0.3, **kwargs)
    full = fn(*logps, weights=weights)[0]
    head = fn(*(x[:2] for x in logps))[0]
    np.testing.assert_allclose(full, head, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(fn)(*logps)[0], fn(*logps)[0],
                               rtol=1e-5)


def test_direct_preference_errors():
  x = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="unknown loss_type"):
    dpl(x, x, x, x, loss_type="dpp")
  with pytest.raises(ValueError, match="chosen_lengths"):
    dpl(x, x, x, x, length_normalize=True)
  with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
    dpl(x, x, x, x, loss_type="robust_dpo", label_smoothing=0.5)
  with pytest.raises(ValueError, match="label_smoothing"):
    dpl(x, x, x, x, loss_type="dpo", label_smoothing=0.1)
  with pytest.raises(ValueError, match="shapes must match"):
    dpl(x, np.zeros(4), x, x)
  with pytest.raises(ValueError, match="reference_free"):
    dpl(x, x, None, None)
  with pytest.raises(ValueError, match="nll_coef"):
    dpl(x, x, x, x, nll_coef=1.0)
  with pytest.raises(ValueError, match="target_margin"):
    dpl(x, x, x, x, loss_type="ipo", target_margin=1.0)


def test_kto_loss_by_hand_with_kl_baseline():
  beta, lam_d, lam_u = 0.5, 1.0, 2.0
  policy = np.array([-1.0, -2.0, -3.0, -1.0], np.float32)
  ref = np.array([-2.0, -1.0, -3.5, -1.5], np.float32)
  desirable = np.array([True, False, True, False])
  kl_policy = np.array([-2.0, -1.0, -4.0], np.float32)
  kl_ref = np.array([-2.5, -2.0, -3.5], np.float32)
  # log-ratios r = [1, -1, 0.5, 0.5]; KL estimate mean(0.5, 1, -0.5) = 1/3.
  z0 = 1 / 3
  terms = [
      lam_d * (1 - _sigmoid(beta * (1 - z0))),
      lam_u * (1 - _sigmoid(beta * (z0 - (-1)))),
      lam_d * (1 - _sigmoid(beta * (0.5 - z0))),
      lam_u * (1 - _sigmoid(beta * (z0 - 0.5))),
  ]
  loss, metrics = preference.kto_loss(
      policy, ref, desirable, kl_policy, kl_ref, beta=beta,
      desirable_weight=lam_d, undesirable_weight=lam_u)
  np.testing.assert_allclose(loss, sum(terms) / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics["kl_baseline"], z0, rtol=1e-6)
  np.testing.assert_allclose(metrics["desirable_reward"], beta * 0.75,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["undesirable_reward"], beta * -0.25,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["desirable_fraction"], 0.5)

  # z0 is a detached baseline: no gradient flows into the mismatched pairs.
  kl_grad = jax.grad(lambda k: preference.kto_loss(
      policy, ref, desirable, k, kl_ref, beta=beta)[0])(kl_policy)
  np.testing.assert_array_equal(kl_grad, np.zeros(3))
  # d/dr of lambda (1 - s(beta(r - z0))) = -lambda beta s (1 - s), and the
  # undesirable term has the opposite sign.
  grad = jax.grad(lambda p: preference.kto_loss(
      p, ref, desirable, kl_policy, kl_ref, beta=beta,
      desirable_weight=lam_d, undesirable_weight=lam_u)[0])(policy)
  s = [_sigmoid(beta * (1 - z0)), _sigmoid(beta * (z0 + 1)),
       _sigmoid(beta * (0.5 - z0)), _sigmoid(beta * (z0 - 0.5))]
  expected = [-lam_d * beta * s[0] * (1 - s[0]) / 4,
              lam_u * beta * s[1] * (1 - s[1]) / 4,
              -lam_d * beta * s[2] * (1 - s[2]) / 4,
              lam_u * beta * s[3] * (1 - s[3]) / 4]
  np.testing.assert_allclose(grad, expected, rtol=1e-5)


def test_kto_kl_baseline_is_clipped_at_zero():
  policy = np.array([0.0, 0.0], np.float32)
  kl_policy = np.array([-3.0, -1.0], np.float32)  # KL estimate -2 -> 0
  loss, metrics = preference.kto_loss(policy, policy, np.array([True, False]),
                                      kl_policy, np.zeros(2), beta=1.0)
  np.testing.assert_allclose(metrics["kl_baseline"], 0.0)
  np.testing.assert_allclose(loss, 0.5, rtol=1e-6)  # both terms 1 - s(0)


def test_desirable_from_rewards_uses_batch_mean():
  rewards = np.array([1.0, 2.0, 3.0, 6.0], np.float32)  # mean 3
  np.testing.assert_array_equal(preference.desirable_from_rewards(rewards),
                                [False, False, False, True])
  # Padding is excluded from the mean (now 2) and never labelled desirable.
  mask = np.array([1, 1, 1, 0], np.float32)
  np.testing.assert_array_equal(
      preference.desirable_from_rewards(rewards, mask),
      [False, False, True, False])


def test_kto_mismatched_indices_is_a_derangement():
  idx = np.asarray(preference.kto_mismatched_indices(5))
  assert sorted(idx.tolist()) == list(range(5))
  assert np.all(idx != np.arange(5))
  with pytest.raises(ValueError, match="at least 2"):
    preference.kto_mismatched_indices(1)
