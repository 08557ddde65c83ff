"""Turning sampled responses into scored episodes: the EOS trick.

PPO samples a fixed number of tokens and keeps sampling after EOS ("N+
implementation details", detail 23, step 1). Everything after the first EOS is
then replaced by padding (step 2), the reward model reads its score at the last
real token (detail 12: "first index of the padding token minus 1"), and a
response that never produced EOS gets a constant penalty instead of its score
(step 3; the RM was only trained to score at EOS, detail 13, so its output
elsewhere is not a valid reward).
"""

import jax.numpy as jnp

from jaxrlhf import checks

# Detail 23: "the EOS trick sets the reward to a constant -1".
DEFAULT_MISSING_EOS_PENALTY = -1.0


def truncate_after_eos(tokens, eos_id=1, pad_id=0):
  """Pads everything after the first EOS of each response.

  Args:
    tokens: [batch, length] int sampled response tokens (response only, no
      prompt), possibly with more tokens sampled after an EOS.
    eos_id: the end-of-sequence id (1 in the T5 vocabularies).
    pad_id: the id written after the first EOS (0 in the T5 vocabularies).

  Returns:
    truncated: [batch, length] `tokens` with every position after the first
      EOS set to `pad_id`; the EOS itself is kept.
    response_mask: [batch, length] int32, 1 on the positions up to and
      including the first EOS, or on every position when there is no EOS.
      It is positional, so a sampled token that happens to equal `pad_id`
      before the EOS still counts as a real token.
    has_eos: [batch] bool, whether the response contains an EOS at all.
  """
  checks.check_rank("truncate_after_eos", "tokens", tokens, 2)
  is_eos = tokens == eos_id
  # Number of EOS strictly before position t: > 0 means t is after the first.
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos
  response_mask = (eos_before == 0).astype(jnp.int32)
  truncated = jnp.where(response_mask > 0, tokens, jnp.asarray(pad_id,
                                                               tokens.dtype))
  has_eos = jnp.any(is_eos, axis=-1)
  return truncated, response_mask, has_eos


def last_token_index(mask):
  """Index of the last real token of each row: where a reward model scores.

  Works for any mask layout: a response-only mask starting at 0, or a
  decoder-only full-sequence mask where the response follows the prompt.

  Args:
    mask: [batch, length], nonzero on real response tokens.

  Returns:
    [batch] int32 index of the last nonzero entry; 0 for an all-zero row
    (callers that add a score there multiply by the mask, so nothing lands).
  """
  checks.check_rank("last_token_index", "mask", mask, 2)
  positions = jnp.arange(mask.shape[-1], dtype=jnp.int32)
  last = jnp.max(jnp.where(mask > 0, positions, -1), axis=-1)
  return jnp.maximum(last, 0)


def score_at_last_token(per_token_scores, mask):
  """Reads a reward model's per-token outputs at the last real token.

  Args:
    per_token_scores: [batch, length] reward-head output at every position.
    mask: [batch, length] response mask.

  Returns:
    [batch] the score at `last_token_index(mask)` (detail 12).
  """
  checks.check_same_shape("score_at_last_token",
                           per_token_scores=per_token_scores, mask=mask)
  index = last_token_index(mask)[:, None]
  return jnp.take_along_axis(per_token_scores, index, axis=-1)[:, 0]


def replace_score_without_eos(scores, has_eos,
                              penalty=DEFAULT_MISSING_EOS_PENALTY):
  """The EOS trick: a response without EOS gets `penalty` instead of its score.

  Args:
    scores: [batch] reward-model scores.
    has_eos: [batch] bool, from `truncate_after_eos`.
    penalty: the replacement reward (detail 23 uses -1).

  Returns:
    [batch] scores, with `penalty` where `has_eos` is False.
  """
  checks.check_same_shape("replace_score_without_eos", scores=scores,
                           has_eos=has_eos)
  return jnp.where(has_eos, scores, jnp.asarray(penalty, scores.dtype))
