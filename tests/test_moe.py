"""The dropless MoE block against a naive per-token numpy reference, and the
router's load-balancing loss against a hand-computed value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.layers import moe

E, K_MLP, EMBED = 4, 6, 5


def _init(top_k, norm_topk_prob, seed=0):
  block = moe.MoeMlp(num_experts=E, top_k=top_k, mlp_dim=K_MLP,
                     norm_topk_prob=norm_topk_prob)
  x = jax.random.normal(jax.random.PRNGKey(seed), (2, 7, EMBED))
  params = jax.tree.map(lambda p: getattr(p, "value", p),
                        block.init(jax.random.PRNGKey(seed + 1), x)["params"],
                        is_leaf=lambda p: hasattr(p, "value"))
  return block, params, x


def _reference(params, x, top_k, norm_topk_prob):
  """Per token: softmax over experts, its top-k, each chosen expert's SwiGLU
  MLP computed densely, weighted sum."""
  p = jax.tree.map(np.asarray, params)
  tokens = np.asarray(x, np.float64).reshape(-1, EMBED)
  out = np.zeros_like(tokens)
  for t, h in enumerate(tokens):
    logits = h @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs)[:top_k]
    w = probs[chosen]
    if norm_topk_prob:
      w = w / w.sum()
    for weight, e in zip(w, chosen):
      gate = h @ p["wi_0"][e]
      up = h @ p["wi_1"][e]
      out[t] += weight * ((gate / (1 + np.exp(-gate)) * up) @ p["wo"][e])
  return out.reshape(x.shape)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_block_equals_the_naive_reference(top_k, norm_topk_prob):
  block, params, x = _init(top_k, norm_topk_prob)
  y, logits = block.apply({"params": params}, x)
  assert logits.shape == (2, 7, E)
  np.testing.assert_allclose(np.asarray(y),
                             _reference(params, x, top_k, norm_topk_prob),
                             rtol=2e-5, atol=2e-5)


def test_dropless_when_every_token_picks_one_expert():
  """A router skewed to expert 2 (and 0 second): all 14 tokens' copies land
  on two experts, none is dropped."""
  block, params, x = _init(2, False)
  params = dict(params)
  kernel = np.asarray(params["router"]["kernel"]) * 0.01
  # A constant first feature with a large router row skews every token.
  x = x.at[..., 0].set(1.0)
  kernel[0] = [5.0, -5.0, 10.0, -5.0]
  params["router"] = {"kernel": jnp.asarray(kernel)}
  y, logits = block.apply({"params": params}, x)
  load = moe.expert_load(logits, 2)
  np.testing.assert_allclose(np.asarray(load), [0.5, 0, 0.5, 0], atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), _reference(params, x, 2, False),
                             rtol=2e-5, atol=2e-5)


def test_gradients_reach_router_and_experts():
  block, params, x = _init(2, True)

  def loss(params):
    y, logits = block.apply({"params": params}, x)
    return jnp.sum(y ** 2) + moe.load_balancing_loss(logits, 2, E)

  grads = jax.grad(loss)(params)
  for name in ("wi_0", "wi_1", "wo"):
    g = np.asarray(grads[name])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name
  g = np.asarray(grads["router"]["kernel"])
  assert np.all(np.isfinite(g)) and np.abs(g).max() > 0


def test_bfloat16_block_close_to_float32():
  block, params, x = _init(2, True)
  y32, _ = block.apply({"params": params}, x)
  y16, _ = block.clone(dtype=jnp.bfloat16).apply({"params": params}, x)
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32),
                             atol=0.1, rtol=0.1)


def test_load_balancing_loss_by_hand():
  """Two experts, top-1, three tokens with probabilities (a, 1-a):
  p1 = (0.8, 0.2), p2 = (0.4, 0.6), p3 = (0.9, 0.1) picks 0, 1, 0.
  f = (2/3, 1/3); P = (0.7, 0.3); loss = 2 (1.4/3 + 0.3/3) = 3.4/3.
  Masking token 3: f = (1/2, 1/2), P = (0.6, 0.4); loss = 2 * 0.5 = 1.0."""
  probs = np.array([[0.8, 0.2], [0.4, 0.6], [0.9, 0.1]])
  logits = jnp.asarray(np.log(probs), jnp.float32)
  np.testing.assert_allclose(float(moe.load_balancing_loss(logits, 1, 2)),
                             3.4 / 3, rtol=1e-6)
  mask = jnp.array([1, 1, 0])
  np.testing.assert_allclose(
      float(moe.load_balancing_loss(logits, 1, 2, mask)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(moe.expert_load(logits, 1)),
                             [2 / 3, 1 / 3], rtol=1e-6)
  # Top-2 of 2 experts: f = (1, 1) whatever P is: loss = 2 * sum(P) = 2.
  np.testing.assert_allclose(float(moe.load_balancing_loss(logits, 2, 2)),
                             2.0, rtol=1e-6)


def test_clear_errors():
  with pytest.raises(ValueError, match="num_experts=3"):
    moe.load_balancing_loss(jnp.zeros((4, 2)), 1, 3)
  with pytest.raises(ValueError, match="mask has 2 entries"):
    moe.load_balancing_loss(jnp.zeros((4, 2)), 1, 2, jnp.ones(2))
