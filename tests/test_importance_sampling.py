"""Importance-sampling corrections against their formulas in plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.rl import importance_sampling as isx

# Two responses of 4 tokens; the last token of row 0 and the last two of
# row 1 are padding. Token ratios exp(r) chosen around the bands used below.
LOG_RATIO = np.log(np.array([[0.4, 1.3, 3.0, 7.0],
                             [1.1, 0.9, 5.0, 0.01]])).astype(np.float32)
MASK = np.array([[1., 1., 1., 0.],
                 [1., 1., 0., 0.]], np.float32)
SAMPLER = np.array([[-1.0, -2.0, -0.5, -3.0],
                    [-0.7, -1.2, -2.2, -0.1]], np.float32)
TRAINER = SAMPLER + LOG_RATIO
CAP, LOW, HIGH = 2.0, 0.5, 2.0
KW = {"cap": CAP, "low": LOW, "high": HIGH}


def _np_reference(name, r, m, cap=CAP, low=LOW, high=HIGH):
  """(weights, loss_mask) of each correction, straight from its formula."""
  r = np.where(m > 0, r, 0.0).astype(np.float64)
  tok = np.exp(r)
  seq_sum = np.exp((r * m).sum(-1, keepdims=True)) * np.ones_like(r)
  seq_geo = np.exp((r * m).sum(-1, keepdims=True)
                   / m.sum(-1, keepdims=True)) * np.ones_like(r)
  band = lambda x: (x >= low) & (x <= high)
  if name == "none":
    w, keep = np.ones_like(r), np.ones_like(r)
  elif name == "token_tis":
    w, keep = np.minimum(tok, cap), np.ones_like(r)
  elif name == "sequence_tis":
    w, keep = np.minimum(seq_sum, cap), np.ones_like(r)
  elif name == "token_mask":
    w, keep = np.ones_like(r), band(tok)
  elif name == "sequence_mask":
    w, keep = np.ones_like(r), band(seq_sum)
  elif name == "icepop":
    w, keep = tok, band(tok)
  else:
    w, keep = np.minimum(seq_geo, cap), band(seq_geo)
  loss_mask = m * keep
  return np.where(loss_mask > 0, w, 0.0), loss_mask


def _correct(name, trainer=TRAINER, sampler=SAMPLER, mask=MASK, **kw):
  kw = kw or KW
  return isx.correct(name, jnp.asarray(trainer), jnp.asarray(sampler),
                     jnp.asarray(mask), **kw)


@pytest.mark.parametrize("name", isx.CORRECTIONS)
def test_each_correction_matches_its_formula(name):
  weights, loss_mask, _ = _correct(name)
  want_w, want_m = _np_reference(name, LOG_RATIO, MASK)
  np.testing.assert_allclose(np.asarray(loss_mask), want_m)
  np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)


def test_hand_values():
  # Spelled out for one case each, independently of _np_reference.
  w, m, _ = _correct("token_tis")
  np.testing.assert_allclose(w[0, :3], [0.4, 1.3, 2.0], rtol=1e-6)
  w, m, _ = _correct("sequence_tis")  # row 1: 1.1 * 0.9 = 0.99 < cap
  np.testing.assert_allclose(w[1, :2], [0.99, 0.99], rtol=1e-5)
  np.testing.assert_allclose(w[0, :3], [1.56] * 3, rtol=1e-5)  # 0.4*1.3*3
  w, m, _ = _correct("icepop")  # [0.5, 2]: 0.4 and 3.0 dropped
  np.testing.assert_allclose(m, [[0, 1, 0, 0], [1, 1, 0, 0]])
  np.testing.assert_allclose(w, [[0, 1.3, 0, 0], [1.1, 0.9, 0, 0]],
                             rtol=1e-6)


@pytest.mark.parametrize("name", isx.CORRECTIONS)
def test_masked_out_positions_change_nothing(name):
  out = _correct(name)
  noisy_trainer = np.where(MASK > 0, TRAINER, np.array(50.0, np.float32))
  noisy_sampler = np.where(MASK > 0, SAMPLER, np.array(-np.inf, np.float32))
  other = _correct(name, trainer=noisy_trainer, sampler=noisy_sampler)
  for a, b in zip(out[:2], other[:2]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for key in out[2]:
    np.testing.assert_array_equal(np.asarray(out[2][key]),
                                  np.asarray(other[2][key]))
  gap = isx.gap_metrics(jnp.asarray(TRAINER), jnp.asarray(SAMPLER), MASK)
  gap_other = isx.gap_metrics(jnp.asarray(noisy_trainer),
                              jnp.asarray(noisy_sampler), MASK)
  for key in gap:
    np.testing.assert_array_equal(np.asarray(gap[key]),
                                  np.asarray(gap_other[key]))


@pytest.mark.parametrize("name", isx.CORRECTIONS)
def test_on_policy_is_the_identity(name):
  weights, loss_mask, metrics = _correct(name, trainer=SAMPLER)
  np.testing.assert_array_equal(np.asarray(loss_mask), MASK)
  np.testing.assert_array_equal(np.asarray(weights), MASK)
  assert float(metrics["correction/dropped_fraction"]) == 0.0
  assert float(metrics["correction/weight_mean"]) == 1.0
  gap = isx.gap_metrics(jnp.asarray(SAMPLER), jnp.asarray(SAMPLER), MASK)
  for key in ("gap/k1", "gap/k3", "gap/ratio_std"):
    assert float(gap[key]) == 0.0, key
  for key in ("gap/ratio_mean", "gap/ratio_min", "gap/ratio_max"):
    assert float(gap[key]) == 1.0, key


def test_none_is_the_identity_off_policy_too():
  weights, loss_mask, metrics = _correct("none")
  np.testing.assert_array_equal(np.asarray(loss_mask), MASK)
  np.testing.assert_array_equal(np.asarray(weights), MASK)
  assert float(metrics["correction/capped_fraction"]) == 0.0


def test_boundaries_band_closed_and_cap_reached_counts_as_capped():
  # Ratios exactly 1 (log ratio 0, exact in float) at the edges of bands
  # [1, 2] and [0.5, 1]: kept (closed band). Cap 1: weight 1, counted capped.
  r = np.zeros((1, 2), np.float32)
  m = np.ones((1, 2), np.float32)
  for low, high in ((1.0, 2.0), (0.5, 1.0)):
    for fn in (isx.token_mask, isx.sequence_mask, isx.icepop):
      _, loss_mask, _ = fn(r, m, low, high)
      np.testing.assert_array_equal(np.asarray(loss_mask), m)
    _, loss_mask, _ = isx.geometric_mean_sequence(r, m, low=low, high=high)
    np.testing.assert_array_equal(np.asarray(loss_mask), m)
  for fn in (isx.token_tis, isx.sequence_tis,
             lambda a, b, c: isx.geometric_mean_sequence(a, b, cap=c)):
    w, _, metrics = fn(r, m, 1.0)
    np.testing.assert_array_equal(np.asarray(w), m)
    assert float(metrics["correction/capped_fraction"]) == 1.0
  # Just outside the band (one float step): dropped.
  eps = np.float32(1e-6)
  _, loss_mask, _ = isx.token_mask(np.array([[eps, -eps]], np.float32), m,
                                   1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(loss_mask), [[0.0, 0.0]])


def test_metrics_against_numpy():
  # token_tis: kept tokens are all masked ones: 0.4, 1.3, 2 (capped), 1.1, .9
  _, _, met = _correct("token_tis")
  np.testing.assert_allclose(met["correction/weight_mean"],
                             (0.4 + 1.3 + 2.0 + 1.1 + 0.9) / 5, rtol=1e-6)
  np.testing.assert_allclose(met["correction/capped_fraction"], 1 / 5)
  np.testing.assert_allclose(met["correction/dropped_fraction"], 0.0)
  # token_mask [0.5, 2]: 0.4 and 3.0 dropped of 5 masked-in tokens.
  _, _, met = _correct("token_mask")
  np.testing.assert_allclose(met["correction/dropped_fraction"], 2 / 5)
  np.testing.assert_allclose(met["correction/weight_mean"], 1.0)
  # icepop: kept 1.3, 1.1, 0.9 weighted by their ratio.
  _, _, met = _correct("icepop")
  np.testing.assert_allclose(met["correction/weight_mean"],
                             (1.3 + 1.1 + 0.9) / 3, rtol=1e-6)
  # sequence_tis, cap 1.5: row 0's 0.4*1.3*3 = 1.56 capped, row 1's 0.99 not.
  _, _, met = _correct("sequence_tis", cap=1.5)
  np.testing.assert_allclose(met["correction/capped_fraction"], 0.5)
  np.testing.assert_allclose(met["correction/weight_mean"],
                             (3 * 1.5 + 2 * 0.99) / 5, rtol=1e-5)
  # sequence_mask [0.5, 1.5]: row 0 (1.56) dropped: 3 of 5 tokens.
  _, _, met = _correct("sequence_mask", low=0.5, high=1.5)
  np.testing.assert_allclose(met["correction/dropped_fraction"], 3 / 5)


def test_geometric_mean_weight():
  w, _, _ = _correct("geometric_mean", cap=None, low=None, high=None)
  np.testing.assert_allclose(w[0, :3], [(0.4 * 1.3 * 3.0) ** (1 / 3)] * 3,
                             rtol=1e-5)
  np.testing.assert_allclose(w[1, :2], [(1.1 * 0.9) ** 0.5] * 2, rtol=1e-5)


@pytest.mark.parametrize("name", isx.CORRECTIONS)
def test_weights_carry_no_gradient(name):
  def total(trainer):
    w, m, _ = isx.correct(name, trainer, jnp.asarray(SAMPLER),
                          jnp.asarray(MASK), **KW)
    return jnp.sum(w * m)
  grad = jax.grad(total)(jnp.asarray(TRAINER))
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_gap_metrics_against_numpy():
  gap = isx.gap_metrics(jnp.asarray(TRAINER), jnp.asarray(SAMPLER), MASK)
  r = LOG_RATIO.astype(np.float64)
  on = MASK > 0
  k1 = [(-r[i][on[i]]).sum() for i in range(2)]
  k3 = [(np.exp(r[i][on[i]]) - 1 - r[i][on[i]]).sum() for i in range(2)]
  ratios = np.exp(r[on])
  np.testing.assert_allclose(gap["gap/k1"], np.mean(k1), rtol=1e-5)
  np.testing.assert_allclose(gap["gap/k3"], np.mean(k3), rtol=1e-5)
  np.testing.assert_allclose(gap["gap/ratio_mean"], ratios.mean(), rtol=1e-5)
  np.testing.assert_allclose(gap["gap/ratio_std"], ratios.std(), rtol=1e-5)
  np.testing.assert_allclose(gap["gap/ratio_min"], 0.4, rtol=1e-6)
  np.testing.assert_allclose(gap["gap/ratio_max"], 3.0, rtol=1e-6)


def test_bad_input_errors():
  with pytest.raises(ValueError, match="not supported"):
    _correct("tis")
  with pytest.raises(ValueError, match="`cap` is required"):
    _correct("token_tis", low=0.5, high=2.0)
  with pytest.raises(ValueError, match="low <= high"):
    _correct("icepop", low=2.0, high=0.5)
  with pytest.raises(ValueError, match="shapes must match"):
    isx.correct("none", jnp.zeros((2, 3)), jnp.zeros((2, 4)),
                jnp.ones((2, 3)))
