"""A generative reward model's input and verdict, as functions of tokens.

A judge (`rewards.judge`: a frozen instruction model of the policy's
vocabulary) reads the prompt and the response through a template such as

  "Question: {prompt}\\nAnswer: {response}\\nIs the answer correct? Answer:"

and its verdict is read one of three ways (`VERDICTS`):

  yes_probability  the probability it gives the first of two choice tokens
                   against the second at the next position (verl's and
                   NeMo-RL's generative reward models read a "yes" the same
                   way): p(yes) / (p(yes) + p(no)), in [0, 1];
  pairwise         the template names a {reference} response too (the
                   prompt's own completion, the task's target) and the
                   choices label the first and the second of the two
                   answers ("A,B"); the reward is the probability that the
                   response is preferred, averaged over both orders of the
                   two (MT-Bench's swap against position bias), in [0, 1];
  score            the judge writes a few tokens greedily and the first
                   number in them is the reward (e.g. "Score 1 to 10:");
                   a verdict without a number is left out of the reward
                   (NaN: the row is not counted in reward/judge/rows).

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

# The placeholders a template may name: the first two always, the third
# with the pairwise verdict.
PLACEHOLDERS = ("prompt", "response", "reference")
VERDICTS = ("yes_probability", "pairwise", "score")


@dataclasses.dataclass(frozen=True)
class JudgeTemplate:
  """A template as token ids.

  Attributes:
    pieces: the token ids of the text before, between and after the slots
      (len(slots) + 1 pieces, any of them empty).
    slots: the placeholder of each slot, in the template's order.
    choices: (the verdict's token, the token it is weighed against); the
      pairwise verdict's labels of the first and second answer; unused by
      the score verdict.
  """
  pieces: Tuple[Tuple[int, ...], ...]
  slots: Tuple[str, ...]
  choices: Tuple[int, int]

  @property
  def response_first(self) -> bool:
    """Whether {response} comes before {reference} (pairwise)."""
    return self.slots.index("response") < self.slots.index("reference")

  @property
  def fixed_length(self) -> int:
    """The tokens of the template's own text."""
    return sum(len(p) for p in self.pieces)


def parse_template(template: str, choices: str,
                   encode: Callable[[str], Sequence[int]],
                   verdict_kind: str = "yes_probability",
                   field: str = "config.rewards.judge") -> JudgeTemplate:
  """`template` with {prompt} and {response} (and {reference} for the
  pairwise verdict), and `choices` "yes,no" (the verdict's token first;
  pairwise: the labels of the first and second answer), as token ids;
  refuses, naming `field`, a template without its placeholders or with
  another one, and a choice that is not one token of the vocabulary."""
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
  needed = PLACEHOLDERS if verdict_kind == "pairwise" else PLACEHOLDERS[:2]
  for name in PLACEHOLDERS:
    if name not in needed and name in slots:
      raise ValueError(f"{field}.template: {{{name}}} is read by the "
                       "pairwise verdict only.")
  for name in needed:
    if slots.count(name) != 1:
      raise ValueError(f"{field}.template: it must name {{{name}}} once "
                       f"(it names it {slots.count(name)} times).")
  pieces = tuple(tuple(int(t) for t in encode(p)) if p else ()
                 for p in pieces)
  if verdict_kind == "score":  # no choices: the judge writes a number
    return JudgeTemplate(pieces, tuple(slots), (0, 0))
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
  return JudgeTemplate(pieces, tuple(slots), (ids[0], ids[1]))


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


def pairwise_preference(first_order, second_order, response_first: bool):
  """[batch] the probability that the response is preferred, from the
  verdicts p(first label) / (p(first) + p(second)) with the two answers as
  the template places them (`first_order`) and swapped (`second_order`),
  averaged over the two orders."""
  if response_first:
    return 0.5 * (first_order + (1.0 - second_order))
  return 0.5 * ((1.0 - first_order) + second_order)


def number_tokens(decode: Callable[[int], str], vocab_size: int):
  """(values int32 [vocab], digits int32 [vocab]): each token's number and
  its count of digits when its text (spaces stripped) is all digits, else
  -1 and 0."""
  values, digits = [], []
  for i in range(vocab_size):
    try:
      text = decode(i).strip()
    except Exception:  # pylint: disable=broad-except
      text = ""  # ids past the tokenizer's own (padding of the vocab)
    ok = text.isascii() and text.isdigit() and len(text) <= 6
    values.append(int(text) if ok else -1)
    digits.append(len(text) if ok else 0)
  return (jnp.asarray(values, jnp.int32), jnp.asarray(digits, jnp.int32))


def first_number(tokens, values, digits):
  """[batch] float32 the first number in the written tokens [batch, L]
  (consecutive number tokens, read as one), NaN where there is none."""
  v = values[tokens]
  d = digits[tokens]
  is_number = d > 0
  seen = jnp.cumsum(is_number, axis=1) > 0
  # The first run: number tokens before the first non-number after it.
  stopped = jnp.cumsum(seen & ~is_number, axis=1) > 0
  take = is_number & ~stopped

  def step(acc, x):
    value, count, keep = x
    return jnp.where(keep, acc * 10.0 ** count + value, acc), None

  total, _ = jax.lax.scan(
      step, jnp.zeros(tokens.shape[0], jnp.float32),
      (v.T.astype(jnp.float32), d.T.astype(jnp.float32), take.T))
  return jnp.where(jnp.any(take, axis=1), total, jnp.nan)
