"""turn_sampler against fresh prefills and full forward passes.

The truths: (1) a conversation whose cache was extended turn by turn (with
the holes that inactive rows, ended rows and right-aligned blocks leave)
decodes exactly as the same conversation prefilled afresh without holes;
(2) the log-probs a turn reports are the full forward pass's, teacher
forced over each row's hole-free sequence; (3) the stopping rule read off
a run that never stops (greedy draws do not depend on the end id until it
is drawn).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrlhf.agents import turn_sampler
from jaxrlhf.models import gemma3
from jaxrlhf.models.layers import rotary

from conftest import tiny_llama

VOCAB = 32
NEVER = VOCAB  # an end id no draw can match


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(VOCAB, scale=2.0)


def left_padded(rows):
  """Rows of ids as (tokens, mask) [B, longest], padded on the left."""
  length = max(len(r) for r in rows)
  tokens = np.zeros((len(rows), length), np.int32)
  mask = np.zeros_like(tokens)
  for b, r in enumerate(rows):
    tokens[b, length - len(r):] = r
    mask[b, length - len(r):] = 1
  return tokens, mask


def right_aligned_block(blocks, m):
  tokens = np.zeros((len(blocks), m), np.int32)
  mask = np.zeros_like(tokens)
  for b, block in enumerate(blocks):
    if block:
      tokens[b, m - len(block):] = block
      mask[b, m - len(block):] = 1
  return tokens, mask


def drawn(turn, b):
  return np.asarray(turn.tokens)[b, :int(turn.lengths[b])].tolist()


OPENINGS = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11], [2, 3, 5, 7, 11]]
BLOCKS = [[4, 4], [], [1, 2, 3, 9], [6]]


def _two_turns(model, params, end_id, greedy, temperature=1.0):
  """Openings, a turn of rows 0, 1 and 3 (row 2 inactive), a block of 2,
  0, 4 and 1 tokens, a turn of every row. Returns (turn1, turn2, context,
  every row's hole-free ids before turn 2)."""
  tokens, mask = left_padded(OPENINGS)
  context = turn_sampler.start(model, params, tokens, mask, 40)
  key1, key2 = jax.random.split(jax.random.PRNGKey(7))
  active = np.array([True, True, False, True])
  turn1, context = turn_sampler.decode(model, params, context, key1, 5,
                                       active, end_id, temperature, greedy)
  context = turn_sampler.extend(model, params, context,
                                *right_aligned_block(BLOCKS, 4))
  before = [OPENINGS[b] + drawn(turn1, b) + BLOCKS[b] for b in range(4)]
  turn2, context = turn_sampler.decode(model, params, context, key2, 5,
                                       np.ones(4, bool), end_id, temperature,
                                       greedy)
  return turn1, turn2, context, before


def test_extending_equals_recomputing(tiny):
  model, params = tiny
  # An end id that row 1 draws at its second step (greedy), so that row's
  # turn ends early and leaves masked columns behind it.
  tokens, mask = left_padded(OPENINGS)
  probe, _ = turn_sampler.decode(
      model, params, turn_sampler.start(model, params, tokens, mask, 16),
      None, 5, np.ones(4, bool), NEVER, greedy=True)
  end_id = int(probe.tokens[1, 1])
  turn1, turn2, _, before = _two_turns(model, params, end_id, greedy=True)
  assert bool(turn1.ended[1]) and int(turn1.lengths[1]) <= 2
  assert int(turn1.lengths[2]) == 0

  fresh_tokens, fresh_mask = left_padded(before)
  fresh = turn_sampler.start(model, params, fresh_tokens, fresh_mask,
                             fresh_tokens.shape[1] + 5)
  want, _ = turn_sampler.decode(model, params, fresh, None, 5,
                                np.ones(4, bool), end_id, greedy=True)
  np.testing.assert_array_equal(turn2.tokens, want.tokens)
  np.testing.assert_array_equal(turn2.lengths, want.lengths)
  np.testing.assert_array_equal(turn2.ended, want.ended)
  np.testing.assert_allclose(turn2.logprobs, want.logprobs, atol=1e-4)
  assert np.all(np.asarray(turn2.lengths) > 0)


def _teacher_forced_logprobs(model, params, rows, temperature):
  """[B, longest, vocab] log-softmax(logits / T) of a full forward pass over
  the rows' ids, left-padded: [b, i] predicts the id after column i."""
  tokens, mask = left_padded(rows)
  logits = model.apply({"params": params}, tokens,
                       rotary.positions_from_mask(mask), mask)
  return np.asarray(jax.nn.log_softmax(logits / temperature)), tokens.shape[1]


def test_logprobs_are_the_full_forward_passes(tiny):
  model, params = tiny
  t = 0.7
  turn1, turn2, _, before = _two_turns(model, params, NEVER, greedy=False,
                                       temperature=t)
  full = [before[b] + drawn(turn2, b) for b in range(4)]
  logprobs, length = _teacher_forced_logprobs(model, params, full, t)
  checked = 0
  for b in range(4):
    # Each turn's token i sits at its row's own offset in `full`, which is
    # right-aligned at `length`.
    pad = length - len(full[b])
    first = len(OPENINGS[b])
    second = len(before[b])
    for turn, start in ((turn1, first), (turn2, second)):
      for i, token in enumerate(drawn(turn, b)):
        column = pad + start + i
        assert full[b][start + i] == token
        np.testing.assert_allclose(
            float(turn.logprobs[b, i]), logprobs[b, column - 1, token],
            atol=1e-4)
        checked += 1
      # Nothing drawn after a row's turn: zeros.
      n = int(turn.lengths[b])
      assert not np.any(np.asarray(turn.tokens)[b, n:])
      assert not np.any(np.asarray(turn.logprobs)[b, n:])
  assert checked >= 15


def test_rows_stop_at_the_end_id_and_inactive_rows_draw_nothing(tiny):
  model, params = tiny
  tokens, mask = left_padded(OPENINGS)
  context = turn_sampler.start(model, params, tokens, mask, 24)
  active = np.array([True, False, True, True])
  free, _ = turn_sampler.decode(model, params, context, None, 6, active,
                                NEVER, greedy=True)
  free_tokens = np.asarray(free.tokens)
  # The end id: what row 0 draws at its third step. Each active row then
  # stops after its first draw of it (greedy draws are the same until then).
  end_id = int(free_tokens[0, 2])
  want_lengths = []
  for b in range(4):
    hits = np.flatnonzero(free_tokens[b] == end_id)
    want_lengths.append(0 if not active[b] else
                        int(hits[0]) + 1 if hits.size else 6)
  steps = max(want_lengths)

  turn, after = turn_sampler.decode(model, params, context, None, 6, active,
                                    end_id, greedy=True)
  np.testing.assert_array_equal(turn.lengths, want_lengths)
  np.testing.assert_array_equal(
      turn.ended, [bool(active[b] and np.any(free_tokens[b] == end_id))
                   for b in range(4)])
  for b in range(4):
    n = want_lengths[b]
    np.testing.assert_array_equal(turn.tokens[b, :n], free_tokens[b, :n])
    assert not np.any(np.asarray(turn.tokens)[b, n:])
  assert int(after.column) == int(context.column) + steps
  assert turn_sampler.room(after) == turn_sampler.room(context) - steps
  # The new columns: exactly each row's drawn tokens are real.
  new = np.asarray(after.cache_mask)[:, int(context.column):]
  np.testing.assert_array_equal(new.sum(axis=-1), want_lengths)
  for b in range(4):
    assert np.all(new[b, :want_lengths[b]] == 1)
  assert not np.any(new[1])
  np.testing.assert_array_equal(after.num_real,
                                np.asarray(context.num_real) + want_lengths)
  # The inactive row keeps its logits.
  np.testing.assert_array_equal(after.logits[1], context.logits[1])

  # No active row: no step runs.
  none, same = turn_sampler.decode(model, params, context, None, 6,
                                   np.zeros(4, bool), end_id, greedy=True)
  assert int(same.column) == int(context.column)
  assert not np.any(np.asarray(none.lengths))


def test_more_than_the_room_left_is_refused(tiny):
  model, params = tiny
  tokens, mask = left_padded(OPENINGS)
  context = turn_sampler.start(model, params, tokens, mask, 10)
  assert turn_sampler.room(context) == 4
  with pytest.raises(ValueError, match="needs 5 cache columns but the cache "
                     "has 4 left"):
    turn_sampler.decode(model, params, context, None, 5, np.ones(4, bool),
                        NEVER, greedy=True)
  with pytest.raises(ValueError, match="needs 6 cache columns but the cache "
                     "has 4 left"):
    turn_sampler.extend(model, params, context,
                        *right_aligned_block(BLOCKS, 6))
  with pytest.raises(ValueError, match="right-align"):
    turn_sampler.extend(model, params, context,
                        np.ones((4, 2), np.int32),
                        np.array([[1, 0]] * 4, np.int32))
  with pytest.raises(ValueError, match="left-padded"):
    turn_sampler.start(model, params, tokens[:, ::-1], mask[:, ::-1], 10)


def test_a_sliding_window_the_cache_could_exceed_is_refused():
  """The layers measure a window in cache columns, which holes stretch."""
  model = gemma3.Gemma3(gemma3.Gemma3Config.preset("tiny", vocab_size=VOCAB,
                                                   sliding_window=8))
  tokens, mask = left_padded(OPENINGS)
  with pytest.raises(ValueError, match="use width <= 8"):
    turn_sampler.start(model, None, tokens, mask, 9)


def test_joined_projections_decode_the_same(tiny):
  """A bfloat16 model's loop reads cast, joined weights: the same turn as
  reading them apart."""
  model, params = tiny
  model = type(model)(dataclasses.replace(model.config, dtype="bfloat16"))
  tokens, mask = left_padded(OPENINGS)
  context = turn_sampler.start(model, params, tokens, mask, 12)
  joined = turn_sampler._decode_params(model, params, context, True)
  assert "fused_qkv" in joined["decoder"]["layers_0"]["self_attention"]
  turns = [turn_sampler.decode(model, params, context, None, 4,
                               np.ones(4, bool), NEVER, greedy=True,
                               fuse_projections=fuse)[0]
           for fuse in (True, False)]
  np.testing.assert_array_equal(turns[0].tokens, turns[1].tokens)
  np.testing.assert_allclose(turns[0].logprobs, turns[1].logprobs, atol=2e-2)
