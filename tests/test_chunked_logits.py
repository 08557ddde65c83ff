"""Per-token statistics of the logits without the whole [batch, T, vocab]
array (scoring.hidden_token_stats, the adapters' next_token_stats, the SFT
loss and the online rollout's log-probs and entropies built on them): the
same numbers and gradients as from the full logits, chunked or not, and
T5's SFT loss unchanged to the bit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.offline import sft
from jaxrlhf.losses import sft_losses as sft_losses
from jaxrlhf.models import llama
from jaxrlhf.models import scoring
from jaxrlhf.models import t5
from jaxrlhf.rl import rollout as rollout_lib


def _full_stats(logits, targets):
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, -1)
  return (jax.nn.logsumexp(logits, -1),
          jnp.take_along_axis(logits, targets[..., None], -1)[..., 0],
          jnp.argmax(logits, -1) == targets,
          # The entropy from its definition, -sum p log p.
          -jnp.sum(probs * jnp.log(probs), -1))


def _project(w, h):
  return jnp.einsum("ble,ev->blv", h, w)


# chunk_bytes: None (this backend's default: one chunk here), and chunks
# of 2 and 3 positions (7 positions padded to 8 and 9).
@pytest.mark.parametrize("chunk_positions", [None, 2, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_token_stats_equal_the_full_logits_and_their_gradients(
    chunk_positions, temperature):
  batch, length, emb, vocab = 3, 7, 8, 40
  w = jax.random.normal(jax.random.PRNGKey(0), (emb, vocab)) * 2.0
  hidden = jax.random.normal(jax.random.PRNGKey(1), (batch, length, emb))
  targets = jax.random.randint(jax.random.PRNGKey(2), (batch, length), 0,
                               vocab)
  weights = jax.random.uniform(jax.random.PRNGKey(3), (batch, length))
  chunk_bytes = (None if chunk_positions is None
                 else chunk_positions * 4 * batch * vocab)

  def chunked(w, hidden):
    s = scoring.hidden_token_stats(_project, w, hidden, targets,
                                   temperature=temperature, with_top1=True,
                                   with_entropy=True, chunk_bytes=chunk_bytes)
    return s.log_z, s.target_logits, s.top1, s.entropy

  def full(w, hidden):
    return _full_stats(_project(w, hidden) / temperature, targets)

  got, want = chunked(w, hidden), full(w, hidden)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[2], want[2])
  np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-6)

  def loss(stats_fn):
    # Every statistic with a gradient feeds the loss (PPO's entropy bonus
    # trains through the entropy).
    def f(w, hidden):
      log_z, target_logits, _, entropy = stats_fn(w, hidden)
      return jnp.sum((log_z - target_logits + 0.1 * log_z**2
                      - 0.3 * entropy + 0.05 * entropy**2) * weights)
    return f

  got_grads = jax.grad(loss(chunked), argnums=(0, 1))(w, hidden)
  want_grads = jax.grad(loss(full), argnums=(0, 1))(w, hidden)
  for g, h in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_top1_is_the_first_maximum_as_argmax():
  # Ties: the target counts as the argmax only where no earlier token ties.
  logits = jnp.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])
  targets = jnp.array([[2, 0]])
  stats = scoring.logit_stats(logits, targets, with_top1=True)
  assert stats.top1.tolist() == [[False, True]]


def test_nonfinite_logits_stay_as_logsumexp_has_them():
  logits = jnp.array([[[-jnp.inf, -jnp.inf], [0.0, -jnp.inf]]])
  stats = scoring.logit_stats(logits, jnp.array([[0, 0]]))
  np.testing.assert_array_equal(stats.log_z,
                                jax.nn.logsumexp(logits, axis=-1))


@pytest.fixture(scope="module")
def tiny_llama():
  cfg = llama.LlamaConfig.preset("tiny", vocab_size=48)
  model = llama.Llama(cfg)
  tokens = np.array([[5, 6, 7, 8, 9, 10, 1, 0], [11, 12, 13, 14, 1, 0, 0, 0]],
                    np.int32)
  mask = (tokens > 0).astype(np.int32)
  batch = {"tokens": tokens, "attention_mask": mask,
           "positions": np.maximum(np.cumsum(mask, -1) - 1, 0),
           "loss_weights": np.array([[0, 0, 0, 1, 1, 1, 1, 0],
                                     [0, 0, 1, 1, 1, 0, 0, 0]], np.int32)}
  params = nn.unbox(model.init(jax.random.PRNGKey(0), tokens,
                               batch["positions"], mask)["params"])
  return scoring.adapter_for(model), params, batch


@pytest.mark.parametrize("chunk_bytes", [None, 4 * 2 * 48 * 3])
def test_decoder_only_sft_loss_and_gradient_equal_the_full_logits(
    tiny_llama, chunk_bytes, monkeypatch):
  lm, params, batch = tiny_llama
  monkeypatch.setattr(scoring, "LOGITS_CHUNK_BYTES", chunk_bytes)

  def chunked(p):
    return sft.token_cross_entropy(lm, p, batch, z_loss=1e-2)

  def full(p):
    return sft_losses.cross_entropy_loss(*sft.next_token_targets(lm, p, batch),
                                         z_loss=1e-2)

  (got, got_m), got_g = jax.value_and_grad(chunked, has_aux=True)(params)
  (want, want_m), want_g = jax.value_and_grad(full, has_aux=True)(params)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for key in want_m:
    np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-6, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               got_g, want_g)
  # The log-probs of the scoring API, from the same statistics.
  logprobs, mask = lm.completion_logprobs(params, batch)
  logits = lm.completion_logits(params, batch)
  expected = scoring.token_logprobs(logits[:, :-1], batch["tokens"][:, 1:])
  np.testing.assert_allclose(logprobs[:, 1:], expected * mask[:, 1:],
                             rtol=1e-6, atol=1e-6)


def test_t5_sft_loss_and_gradient_are_those_of_the_logits_to_the_bit():
  cfg = t5.T5Config(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8,
                    mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(cfg)
  lm = scoring.adapter_for(model)
  targets = np.array([[4, 5, 6, 1], [7, 1, 0, 0]], np.int32)
  batch = {"encoder_input_tokens": np.array([[3, 8, 9, 1], [10, 11, 1, 0]],
                                            np.int32),
           "decoder_target_tokens": targets,
           "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
           "decoder_loss_weights": (targets > 0).astype(np.int32)}
  x = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), x, x, x)["params"])

  def now(p):
    return sft.token_cross_entropy(lm, p, batch, z_loss=1e-3)

  def before(p):  # the SFT loss as it was computed from the logits
    return sft_losses.cross_entropy_loss(*sft.next_token_targets(lm, p, batch),
                                         z_loss=1e-3)

  got = jax.jit(jax.value_and_grad(now, has_aux=True))(params)
  want = jax.jit(jax.value_and_grad(before, has_aux=True))(params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("chunk_bytes", [None, 4 * 2 * 48 * 2])
@pytest.mark.parametrize("response_length", [None, 5])
def test_rollout_logprobs_and_entropy_equal_the_full_logits(
    tiny_llama, chunk_bytes, response_length, monkeypatch):
  # The online step's scoring (policy, reference, and the update's loss
  # with its entropy bonus) reads the states a chunk at a time; the
  # numbers and gradients are those of the whole logits.
  lm, params, batch = tiny_llama
  monkeypatch.setattr(scoring, "LOGITS_CHUNK_BYTES", chunk_bytes)
  temperature = 0.8

  def chunked(p):
    return rollout_lib.logprobs_and_entropy(lm, p, batch, None, temperature,
                                            response_length)

  def full(p):
    logits = lm.completion_logits(p, batch).astype(jnp.float32) / temperature
    _, target, _, entropy = _full_stats(logits[:, :-1], batch["tokens"][:, 1:])
    logprobs = target - jax.nn.logsumexp(logits[:, :-1], -1)
    pad = ((0, 0), (1, 0))
    logprobs, entropy = jnp.pad(logprobs, pad), jnp.pad(entropy, pad)
    mask = batch["loss_weights"].astype(jnp.float32)
    if response_length is not None:
      logprobs, entropy, mask = (x[:, -response_length:]
                                 for x in (logprobs, entropy, mask))
    return logprobs * mask, entropy * mask, mask

  got, want = chunked(params), full(params)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

  def objective(fn):
    def f(p):
      logprobs, entropy, _ = fn(p)
      return jnp.sum(logprobs) + 0.5 * jnp.sum(entropy)
    return f

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               jax.grad(objective(chunked))(params),
               jax.grad(objective(full))(params))
