"""engine.generate against the lockstep sampler.

The truths: (1) each prompt's sequence is its row of what
`sample_decoder_only` draws for the whole batch with the same key, whatever
the slots and the refill size; (2) greedy decoding of a batch
equals the lockstep sampler's on the same batch; (3) the counts: every
drawn token is one useful slot-step, and with one slot (or with every
sequence running to the budget) the steps follow in closed form.
"""

import jax
import numpy as np
import pytest

from jaxrlhf.models import engine
from jaxrlhf.models import sampling
from jaxrlhf.models import t5

from conftest import tiny_llama

VOCAB = 32
NEVER = VOCAB  # an EOS id no draw can match
EOS = 3
NEW = 8
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11], [2, 3, 5, 7, 11], [4, 4, 4],
           [9, 8], [6, 2, 10, 12], [13]]


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(VOCAB, scale=2.0)


@pytest.fixture(scope="module")
def prompts():
  """The prompts left-padded to one width: (tokens, mask) [N, width]."""
  width = max(len(r) for r in PROMPTS)
  tokens = np.zeros((len(PROMPTS), width), np.int32)
  mask = np.zeros_like(tokens)
  for b, r in enumerate(PROMPTS):
    tokens[b, width - len(r):] = r
    mask[b, width - len(r):] = 1
  return tokens, mask


KEY = jax.random.PRNGKey(0)
OPTIONS = {"plain": dict(temperature=1.0),
           "filtered": dict(temperature=0.7, top_k=8, top_p=0.9)}


@pytest.fixture(scope="module")
def lockstep(tiny, prompts):
  """{(options name, eos): the batch sampled by the lockstep sampler with
  KEY: Samples [N, NEW]} (computed once)."""
  model, params = tiny
  tokens, mask = prompts
  cache = {}

  def get(name, eos):
    if (name, eos) not in cache:
      cache[name, eos] = jax.device_get(sampling.sample_decoder_only(
          model, params, tokens, mask, KEY, NEW, eos_id=eos,
          **OPTIONS[name]).replace(num_steps=None))
    return cache[name, eos]
  return get


def assert_same_samples(got, want):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_array_equal(got.has_eos, want.has_eos)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5,
                             rtol=1e-5)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("num_slots,refill_size",
                         [(3, 1), (3, 3), (1, 1), (16, 4)])
def test_each_sequence_is_its_row_of_the_lockstep_batch(tiny, prompts,
                                                       lockstep, options,
                                                       num_slots,
                                                       refill_size):
  model, params = tiny
  tokens, mask = prompts
  want = lockstep(options, EOS)
  # The prompts end both ways, and at several lengths: the refills happen
  # at different steps.
  assert want.has_eos.any() and not want.has_eos.all()
  assert len(set(want.mask.sum(1).tolist())) > 2
  got, stats = engine.generate(model, params, tokens, mask, KEY, num_slots,
                               NEW, eos_id=EOS, refill_size=refill_size,
                               **OPTIONS[options])
  assert_same_samples(got, want)
  assert int(got.num_steps) == int(want.mask.sum(1).max())
  assert int(stats.useful_slot_steps) == int(want.mask.sum())
  # At least the longest sequence's steps; never more than one prompt at
  # a time would take.
  assert int(want.mask.sum(1).max()) <= int(stats.decode_steps)
  assert int(stats.decode_steps) <= int(want.mask.sum())


def test_greedy_equals_lockstep_greedy_of_the_batch(tiny, prompts):
  model, params = tiny
  tokens, mask = prompts
  want = sampling.sample_decoder_only(model, params, tokens, mask, KEY, NEW,
                                      greedy=True, eos_id=EOS)
  got, _ = engine.generate(model, params, tokens, mask, KEY, 3, NEW,
                           greedy=True, eos_id=EOS, refill_size=2)
  assert_same_samples(got, jax.device_get(want))


def test_budget_without_eos(tiny, prompts, lockstep):
  """Every sequence runs to the budget: the lockstep batch's rows, full
  masks, no EOS; with R = S the slots refill together, ceil(N / S) rounds
  of NEW steps each."""
  model, params = tiny
  tokens, mask = prompts
  got, stats = engine.generate(model, params, tokens, mask, KEY, 3, NEW,
                               eos_id=NEVER, refill_size=3)
  assert_same_samples(got, lockstep("plain", NEVER))
  assert np.all(np.asarray(got.mask) == 1) and not np.any(got.has_eos)
  n = len(PROMPTS)
  assert int(stats.decode_steps) == -(-n // 3) * NEW
  assert int(stats.prefills) == -(-n // 3)
  assert int(stats.useful_slot_steps) == n * NEW


def test_one_slot_never_idles(tiny, prompts, lockstep):
  """One slot runs the prompts one after the other, refilled right after
  each end: one step per drawn token, one prefill per prompt."""
  model, params = tiny
  tokens, mask = prompts
  got, stats = engine.generate(model, params, tokens, mask, KEY, 1, NEW,
                               eos_id=EOS)
  want = lockstep("plain", EOS)
  assert_same_samples(got, want)
  assert int(stats.decode_steps) == int(want.mask.sum())
  assert int(stats.prefills) == len(PROMPTS)
  assert stats.utilisation(1) == 1.0


def test_budget_of_one(tiny, prompts):
  """max_new_tokens 1: a draw from each prompt's prefill, no decode step
  fed; the lockstep sampler's."""
  model, params = tiny
  tokens, mask = prompts
  got, _ = engine.generate(model, params, tokens[:3], mask[:3], KEY, 2, 1,
                           eos_id=EOS)
  want = sampling.sample_decoder_only(model, params, tokens[:3], mask[:3],
                                      KEY, 1, eos_id=EOS)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=0), "num_slots"),
    (dict(num_slots=2, refill_size=3), "refill_size"),
    (dict(num_slots=2, max_new_tokens=0), "max_new_tokens"),
])
def test_bad_options(tiny, prompts, kwargs, match):
  model, params = tiny
  tokens, mask = prompts
  kwargs = {"max_new_tokens": NEW, **kwargs}
  with pytest.raises(ValueError, match=match):
    engine.generate(model, params, tokens, mask, KEY, **kwargs)


def test_right_padding_refused(tiny, prompts):
  model, params = tiny
  tokens, mask = prompts
  with pytest.raises(ValueError, match="left-padded"):
    engine.generate(model, params, tokens, mask[:, ::-1], KEY, 2, NEW)


def test_encoder_decoder_refused(prompts):
  model = t5.T5(t5.t5_config("tiny", vocab_size=VOCAB))
  tokens, mask = prompts
  with pytest.raises(ValueError, match="sample_encoder_decoder"):
    engine.generate(model, {}, tokens, mask, KEY, 2, NEW)
