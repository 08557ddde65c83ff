"""The built-in verifiable task `synthetic_arithmetic`: add two numbers.

A prompt asks for a sum ("add: 47 + 385"); a demonstration shows a short
working, the sum's digits from the units up (the order in which column
addition finds them, each digit needing only the digits above it and the
previous carry), then the answer in GSM8K's form:

  add: 47 + 385  ->  units first: 234 #### 432

Operands have 1 to `MAX_DIGITS` digits. Each example carries its reference
answer in an extra column `answer` ("432"; `alignment_kinds.column_feature`),
as the GSM8K and MATH file layouts do, so the reward functions of online RL
see it (`jaxrlhf.rewards.math_answer.math_answer_reward`).

The gold reward is exact: 1.0 when the number after the completion's last
"####" is the sum, else 0.0, and 0.0 for a completion that never ended. It
agrees with `make_math_answer_reward(style="gsm8k")` on the `answer`
column.

The demonstrations are deliberately imperfect, so that RL has headroom above
SFT: a share `DEMONSTRATION_ERROR_RATE` of them (drawn at random) get the
sum wrong, the working and the answer alike, the way people do: a forgotten
carry (the sum less 10^k), or, when the sum has no carry, one digit off by
one.

Splits are disjoint by construction: a pair (a, b) belongs to the split its
hash picks (5% "validation", 15% "test"), so no held-out prompt is trained
on. Generation is deterministic per split; a split draws its pairs with
replacement, so a small split of two-digit sums repeats some.

The vocabulary is a SentencePiece model made here, with no training run: the
digits are pieces of their own ("0".."9", and "▁0".."▁9" for a digit that
starts a number), so a number is one token per digit and the model can learn
carries, while texts keep their ordinary spelling ("#### 432" decodes as
written, so text-based rewards read it as a number). Pad 0, EOS 1, unk 2, as
in T5.
"""

import hashlib
import re
from typing import Dict, List, Optional, TYPE_CHECKING

import numpy as np
from sentencepiece import sentencepiece_model_pb2

from jaxrlhf.data import vocab
from jaxrlhf import answers

if TYPE_CHECKING:
  import seqio  # pylint: disable=g-bad-import-order

PROMPT_PREFIX = "add:"
WORKING_PREFIX = "units first:"
ANSWER_MARK = "####"
# Two digits: a tiny T5 learns to add them in a few hundred SFT steps on 2
# CPU cores (gold reward 0 -> 0.19 after 300 steps); three it does not.
MAX_DIGITS = 2
# The share of demonstrations whose sum is wrong.
DEMONSTRATION_ERROR_RATE = 0.2
# Per mille of (a, b) pairs in each held-out split; the rest are "train".
_HELD_OUT_PER_MILLE = {"validation": 50, "test": 150}
SPLIT_SIZES = {"train": 20000, "validation": 512, "test": 2000}

_PROMPT = re.compile(r"^\s*" + re.escape(PROMPT_PREFIX)
                     + r"\s*(\d+)\s*\+\s*(\d+)\s*$")
_WORDS = (PROMPT_PREFIX, "+") + tuple(WORKING_PREFIX.split()) + (ANSWER_MARK,)


# --- vocabulary ----------------------------------------------------------------


def model_proto() -> bytes:
  """The task's serialized SentencePiece unigram model (module docstring):
  every piece scores the same, so segmentation takes the fewest pieces."""
  piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece
  model = sentencepiece_model_pb2.ModelProto()
  # The special ids, the normaliser and whitespace handling of the word
  # models (no-break spaces read as spaces).
  model.ParseFromString(vocab.word_model_proto(["x"]))
  del model.pieces[3:]
  model.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.UNIGRAM
  pieces = (["\u2581" + w for w in _WORDS]
            + ["\u2581" + str(d) for d in range(10)]
            + [str(d) for d in range(10)] + ["\u2581"])
  for text in pieces:
    piece = model.pieces.add()
    piece.piece, piece.score, piece.type = text, -1.0, piece_type.NORMAL
  model.trainer_spec.vocab_size = len(model.pieces)
  return model.SerializeToString()


def vocabulary() -> "seqio.SentencePieceVocabulary":
  """The task's vocabulary, cached on disk by content hash
  (`vocab.cached_vocabulary`)."""
  return vocab.cached_vocabulary("arithmetic", model_proto())


def vocab_size() -> int:
  """The ids of `vocabulary()`, counted from its model without building it
  (what a plan lays the model out with)."""
  model = sentencepiece_model_pb2.ModelProto()
  model.ParseFromString(model_proto())
  return len(model.pieces)


# --- texts ---------------------------------------------------------------------


def prompt_text(a: int, b: int) -> str:
  return f"{PROMPT_PREFIX} {a} + {b}"


def demonstration(total: int) -> str:
  """The working (digits from the units up) and the answer."""
  return f"{WORKING_PREFIX} {str(total)[::-1]} {ANSWER_MARK} {total}"


def operands(prompt: str) -> Optional[tuple]:
  """(a, b) of a prompt "add: a + b", or None."""
  match = _PROMPT.match(prompt)
  return (int(match.group(1)), int(match.group(2))) if match else None


def gold_reward(prompt: str, completion: str, finished: bool = True) -> float:
  """1.0 when the number after the completion's last "####" is the sum the
  prompt asks for, else 0.0; 0.0 for a completion that never ended.

  Raises:
    ValueError: the prompt is not one of this task's.
  """
  pair = operands(prompt)
  if pair is None:
    raise ValueError(f"synthetic_arithmetic.gold_reward: {prompt!r} is not a "
                     f"prompt of this task ('{PROMPT_PREFIX} a + b').")
  if not finished:
    return 0.0
  answer = answers.gsm8k_answer(completion)
  return 1.0 if answer is not None and float(answer) == sum(pair) else 0.0


# --- examples ------------------------------------------------------------------


def split_of(a: int, b: int) -> str:
  """The split the pair (a, b) belongs to, by its hash."""
  digest = hashlib.sha256(f"arithmetic/{a}+{b}".encode()).digest()
  bucket = int.from_bytes(digest[:4], "little") % 1000
  for split, per_mille in _HELD_OUT_PER_MILLE.items():
    if bucket < per_mille:
      return split
    bucket -= per_mille
  return "train"


def carries(a: int, b: int) -> List[int]:
  """The columns k (0 = units) whose addition carries into column k + 1."""
  out, carry, k = [], 0, 0
  while a or b or carry:
    carry = int(a % 10 + b % 10 + carry >= 10)
    if carry:
      out.append(k)
    a, b, k = a // 10, b // 10, k + 1
  return out


def mistaken_sum(a: int, b: int, rng: np.random.Generator) -> int:
  """A wrong sum: a forgotten carry (one of them), else one digit of the sum
  off by one (never making a leading zero)."""
  columns = carries(a, b)
  total = a + b
  if columns:
    return total - 10 ** (int(rng.choice(columns)) + 1)
  digits = [int(d) for d in str(total)]
  k = int(rng.integers(len(digits)))
  step = 1 if rng.random() < 0.5 else -1
  if k == 0 and len(digits) > 1 and digits[0] == 1 and step == -1:
    step = 1
  digits[k] = (digits[k] + step) % 10
  return int("".join(map(str, digits)))


def _number(digits: int, rng: np.random.Generator) -> int:
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


def make_examples(split: str, num_examples: int, seed: int = 0,
                  max_digits: int = MAX_DIGITS,
                  error_rate: float = DEMONSTRATION_ERROR_RATE
                  ) -> List[Dict[str, object]]:
  """Deterministic examples of one split: {"inputs", "targets" (the
  demonstration), "ideal" (the right demonstration), "answer" (the sum, as
  text), "mistaken" (whether the demonstration is wrong)}."""
  if split not in SPLIT_SIZES:
    raise ValueError(f"synthetic_arithmetic: unknown split {split!r}; the "
                     f"splits are {sorted(SPLIT_SIZES)}.")
  digest = hashlib.sha256(f"arithmetic/{split}/{seed}".encode()).digest()
  rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
  examples = []
  while len(examples) < num_examples:
    a = _number(int(rng.integers(1, max_digits + 1)), rng)
    b = _number(int(rng.integers(1, max_digits + 1)), rng)
    mistaken = bool(rng.random() < error_rate)
    shown = mistaken_sum(a, b, rng) if mistaken else a + b
    if split_of(a, b) != split:
      continue
    examples.append({"inputs": prompt_text(a, b),
                     "targets": demonstration(shown),
                     "ideal": demonstration(a + b),
                     "answer": str(a + b), "mistaken": mistaken})
  return examples
