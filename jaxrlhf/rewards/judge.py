"""A generative reward model's input and verdict, as functions of tokens.

A judge (`rewards.judge`: a frozen instruction model of the policy's
vocabulary) reads the prompt and the response through a template such as

  "Question: {prompt}\\nAnswer: {response}\\nIs the answer correct? Answer:"

and its verdict is the probability it gives the first of two choice tokens
against the second at the next position (verl's and NeMo-RL's generative
reward models read a "yes" the same way): p(yes) / (p(yes) + p(no)), in
[0, 1], the reward.

Since the judge reads the policy's vocabulary, the judging rows are made
from token ids on the device, with no decoding and encoding on the host:
the template's text pieces are encoded once (`parse_template`), and each
row is the pieces and the row's own prompt and response tokens (their
padding and EOS left out) put together, the real tokens moved to one end
(`judge_rows`). Encoding the pieces apart from the text between them can
split a word at a placeholder differently than encoding the whole text
would; templates whose placeholders sit after a space or a newline read as
the judge was trained to read them.
"""

import dataclasses
import re
import string
from typing import Callable, Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp

# The placeholders a template may name.
PLACEHOLDERS = ("prompt", "response")


@dataclasses.dataclass(frozen=True)
class JudgeTemplate:
  """A template as token ids.

  Attributes:
    pieces: the token ids of the text before, between and after the slots
      (len(slots) + 1 pieces, any of them empty).
    slots: the placeholder of each slot, in the template's order.
    choices: (the verdict's token, the token it is weighed against).
  """
  pieces: Tuple[Tuple[int, ...], ...]
  slots: Tuple[str, ...]
  choices: Tuple[int, int]

  @property
  def fixed_length(self) -> int:
    """The tokens of the template's own text."""
    return sum(len(p) for p in self.pieces)


def parse_template(template: str, choices: str,
                   encode: Callable[[str], Sequence[int]],
                   field: str = "config.rewards.judge") -> JudgeTemplate:
  """`template` with {prompt} and {response}, and `choices` "yes,no" (the
  verdict's token first), as token ids; refuses, naming `field`, a
  template without both placeholders or with another one, and a choice
  that is not one token of the vocabulary."""
  pieces, slots = [], []
  try:
    parsed = list(string.Formatter().parse(template))
  except ValueError as e:
    raise ValueError(f"{field}.template: {e}; write literal braces as "
                     "{{ and }}.") from None
  for text, name, spec, conversion in parsed:
    pieces.append(text)
    if name is None:
      continue
    if name not in PLACEHOLDERS or spec or conversion:
      raise ValueError(f"{field}.template: {{{name}}} is not one of "
                       f"{['{' + p + '}' for p in PLACEHOLDERS]}.")
    slots.append(name)
  if len(pieces) == len(slots):
    pieces.append("")
  for name in PLACEHOLDERS:
    if slots.count(name) != 1:
      raise ValueError(f"{field}.template: it must name {{{name}}} once "
                       f"(it names it {slots.count(name)} times).")
  parts = [c.strip() for c in choices.split(",")]
  if len(parts) != 2 or not all(parts):
    raise ValueError(f"{field}.choices: {choices!r} is not two texts "
                     "'yes,no' (the verdict's token first).")
  ids = []
  for text in parts:
    encoded = list(encode(text))
    if len(encoded) != 1:
      raise ValueError(
          f"{field}.choices: {text!r} is {len(encoded)} tokens of the "
          f"vocabulary ({encoded}), not one; choose texts that are single "
          "tokens.")
    ids.append(int(encoded[0]))
  if ids[0] == ids[1]:
    raise ValueError(f"{field}.choices: {parts[0]!r} and {parts[1]!r} are "
                     f"the same token ({ids[0]}).")
  return JudgeTemplate(
      pieces=tuple(tuple(int(t) for t in encode(p)) if p else ()
                   for p in pieces),
      slots=tuple(slots), choices=(ids[0], ids[1]))


def judge_rows(template: JudgeTemplate, slot_tokens: Dict[str, Tuple],
               left_padded: bool = True):
  """The judging rows of a batch: the template's pieces and each row's
  slot tokens, the real tokens together at the right end (left padding,
  a decoder-only judge's layout) or the left end.

  Args:
    template: the parsed template.
    slot_tokens: {placeholder: (tokens [batch, L], mask [batch, L])}, 1 on
      the tokens the judge reads.
    left_padded: the real tokens at the right end (True) or the left.

  Returns:
    (tokens int32 [batch, T], mask int32 [batch, T]) with T the template's
    tokens plus every slot's width; row order of tokens kept.
  """
  batch = next(iter(slot_tokens.values()))[0].shape[0]
  tokens, masks = [], []
  for i, piece in enumerate(template.pieces):
    if piece:
      tokens.append(jnp.broadcast_to(jnp.asarray(piece, jnp.int32),
                                     (batch, len(piece))))
      masks.append(jnp.ones((batch, len(piece)), jnp.int32))
    if i < len(template.slots):
      slot, slot_mask = slot_tokens[template.slots[i]]
      tokens.append(slot.astype(jnp.int32))
      masks.append(slot_mask.astype(jnp.int32))
  tokens = jnp.concatenate(tokens, axis=1)
  mask = jnp.concatenate(masks, axis=1)
  # A stable sort on the mask moves every real token to one end in its
  # order: padding (0) first for left padding, last otherwise.
  key = mask if left_padded else 1 - mask
  order = jnp.argsort(key, axis=1, stable=True)
  tokens = jnp.take_along_axis(tokens, order, axis=1)
  mask = jnp.take_along_axis(mask, order, axis=1)
  return tokens * mask, mask


def verdict(logits, choices: Tuple[int, int]):
  """[batch] p(choices[0]) / (p(choices[0]) + p(choices[1])) of the
  next-token logits [batch, vocab], in float32."""
  pair = logits[:, jnp.asarray(choices)].astype(jnp.float32)
  return jax.nn.softmax(pair, axis=-1)[:, 0]
