"""The scoring API: both architectures, padding sides, one concatenated pass."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models.scoring import token_logprobs
from jaxrlhf.models import heads
from jaxrlhf.models import llama
from jaxrlhf.models import scoring
from jaxrlhf.models import t5

PROMPTS = [[5, 6, 7], [8, 9]]
CHOSEN = [[10, 11, 1], [12, 1]]
REJECTED = [[13, 1], [14, 15, 16, 1]]


def _rows(seqs, length):
  return np.array([s + [0] * (length - len(s)) for s in seqs], np.int32)


def _encdec_batch():
  batch = {"encoder_input_tokens": _rows([p + [1] for p in PROMPTS], 6)}
  for name, seqs in (("chosen", CHOSEN), ("rejected", REJECTED)):
    targets = _rows(seqs, 5)
    batch[f"{name}_decoder_target_tokens"] = targets
    batch[f"{name}_decoder_input_tokens"] = np.pad(targets[:, :-1],
                                                   ((0, 0), (1, 0)))
    batch[f"{name}_decoder_loss_weights"] = (targets > 0).astype(np.int32)
  return batch


def _decoder_batch(left_pad: bool):
  """Prompt+completion rows, padded on one side; loss weights on completions."""
  batch, length = {}, 9
  for name, seqs in (("chosen", CHOSEN), ("rejected", REJECTED)):
    tokens, weights = [], []
    for p, c in zip(PROMPTS, seqs):
      row, w = p + c, [0] * len(p) + [1] * len(c)
      pad = [0] * (length - len(row))
      tokens.append(pad + row if left_pad else row + pad)
      weights.append(pad + w if left_pad else w + pad)
    tokens = np.array(tokens, np.int32)
    mask = (tokens > 0).astype(np.int32)
    batch[f"{name}_tokens"] = tokens
    batch[f"{name}_attention_mask"] = mask
    batch[f"{name}_positions"] = np.maximum(np.cumsum(mask, -1) - 1, 0)
    batch[f"{name}_loss_weights"] = np.array(weights, np.int32)
  return batch


@pytest.fixture(scope="module")
def tiny_t5():
  cfg = t5.T5Config(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8,
                    mlp_dim=32, num_encoder_layers=1, num_decoder_layers=1)
  model = t5.T5(cfg)
  x = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), x, x, x)["params"]
  return scoring.EncoderDecoderLM(model), params


@pytest.fixture(scope="module")
def tiny_llama():
  cfg = llama.LlamaConfig.preset("tiny", vocab_size=32)
  model = llama.Llama(cfg)
  x = jnp.ones((1, 4), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), x, jnp.arange(4)[None], x)["params"]
  return scoring.DecoderOnlyLM(model), params


def test_encoder_decoder_logprobs_by_hand(tiny_t5):
  lm, params = tiny_t5
  batch = _encdec_batch()
  lp, mask = lm.completion_logprobs(params, batch, "chosen", temperature=0.5)
  logits = lm.module.apply({"params": params}, batch["encoder_input_tokens"],
                           batch["chosen_decoder_input_tokens"],
                           batch["chosen_decoder_target_tokens"])
  expected = jax.nn.log_softmax(logits / 0.5)
  for i, seq in enumerate(CHOSEN):
    for t, token in enumerate(seq):
      assert lp[i, t] == pytest.approx(float(expected[i, t, token]), abs=1e-5)
    assert mask[i].tolist() == [1.0] * len(seq) + [0.0] * (5 - len(seq))
    assert np.all(np.asarray(lp[i, len(seq):]) == 0)


@pytest.mark.parametrize("which", ["t5", "llama"])
def test_concatenated_pass_equals_separate_passes(which, tiny_t5, tiny_llama):
  lm, params = tiny_t5 if which == "t5" else tiny_llama
  batch = _encdec_batch() if which == "t5" else _decoder_batch(left_pad=False)
  joint = scoring.score_many(lm, params, batch, ("chosen", "rejected"))
  for name in ("chosen", "rejected"):
    alone, mask = lm.completion_logprobs(params, batch, name)
    np.testing.assert_allclose(joint[name][0], alone, atol=1e-5)
    np.testing.assert_array_equal(joint[name][1], mask)


def test_decoder_only_left_and_right_padding_score_alike(tiny_llama):
  lm, params = tiny_llama
  right = _decoder_batch(left_pad=False)
  left = _decoder_batch(left_pad=True)
  for name, seqs in (("chosen", CHOSEN), ("rejected", REJECTED)):
    lp_r, m_r = lm.completion_logprobs(params, right, name)
    lp_l, m_l = lm.completion_logprobs(params, left, name)
    np.testing.assert_allclose(np.sum(lp_r, -1), np.sum(lp_l, -1), atol=1e-5)
    assert np.sum(m_r, -1).tolist() == np.sum(m_l, -1).tolist() == [
        len(s) for s in seqs]
    # Entry t scores token t given tokens < t, from a plain forward pass.
    logits = lm.module.apply({"params": params}, right[f"{name}_tokens"],
                             right[f"{name}_positions"],
                             right[f"{name}_attention_mask"])
    tokens = right[f"{name}_tokens"]
    expected = token_logprobs(logits[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(lp_r[:, 1:], expected * m_r[:, 1:], atol=1e-5)


def test_reward_is_read_at_the_last_completion_token(tiny_t5):
  lm, params = tiny_t5
  batch = _encdec_batch()
  rm = nn.unbox(heads.init_from_backbone(jax.random.PRNGKey(1), params, 16))
  rewards = heads.sequence_rewards(lm, rm, batch, "chosen")
  hidden, _ = lm.completion_hidden(params, batch, "chosen")
  for i, seq in enumerate(CHOSEN):
    eos_state = hidden[i, len(seq) - 1]
    assert rewards[i] == pytest.approx(
        float(eos_state @ rm["head"]["kernel"] + rm["head"]["bias"]), abs=1e-5)
