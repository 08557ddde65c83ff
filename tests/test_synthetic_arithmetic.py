"""The verifiable task synthetic_arithmetic: its answers are the sums
(checked with Python's own arithmetic), its demonstrations are wrong at the
declared rate, its gold reward is exact and agrees with the math answer
reward, and its answer column reaches the online prompts."""

import math

import pytest
import seqio

from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import synthetic_arithmetic as arithmetic
from jaxrlhf.data import tasks
from jaxrlhf.rewards import math_answer

NAME = tasks.SYNTHETIC_ARITHMETIC


@pytest.fixture(scope="module")
def train():
  return arithmetic.make_examples("train", arithmetic.SPLIT_SIZES["train"])


def _sum_of(prompt):
  words = prompt.split()
  assert words[0] == "add:" and words[2] == "+" and len(words) == 4
  return int(words[1]) + int(words[3])


def _final(text):
  return int(text.rsplit("####", 1)[1])


def test_answers_are_the_sums_and_ideal_working_is_the_digits_units_first(
    train):
  for example in train:
    total = _sum_of(example["inputs"])
    assert example["answer"] == str(total)
    assert example["ideal"] == (f"units first: {''.join(reversed(str(total)))}"
                                f" #### {total}")
    operands = example["inputs"].split()[1::2]
    assert all(1 <= len(x) <= arithmetic.MAX_DIGITS for x in operands)


def test_demonstrations_are_wrong_at_the_declared_rate(train):
  wrong = 0
  for example in train:
    total = _sum_of(example["inputs"])
    working, shown = example["targets"].split(" #### ")
    assert working == "units first: " + shown[::-1]  # Consistent working.
    is_wrong = int(shown) != total
    assert is_wrong == example["mistaken"]
    wrong += is_wrong
    if is_wrong:
      a, b = (int(x) for x in example["inputs"].split()[1::2])
      carried = any(a % 10 ** (k + 1) + b % 10 ** (k + 1) >= 10 ** (k + 1)
                    for k in range(arithmetic.MAX_DIGITS))
      if carried:  # A forgotten carry: the sum less a power of ten.
        assert math.log10(total - int(shown)).is_integer()
      else:  # One digit off by one.
        differ = [(x, y) for x, y in zip(str(total).zfill(len(shown)),
                                         shown.zfill(len(str(total))))
                  if x != y]
        assert len(differ) == 1
        assert (int(differ[0][0]) - int(differ[0][1])) % 10 in (1, 9)
  rate = wrong / len(train)
  sigma = math.sqrt(0.2 * 0.8 / len(train))
  assert arithmetic.DEMONSTRATION_ERROR_RATE == 0.2
  assert abs(rate - 0.2) < 4 * sigma


def test_splits_are_disjoint_and_deterministic(train):
  validation = arithmetic.make_examples("validation", 512)
  test = arithmetic.make_examples("test", 512)
  prompts = {split: {e["inputs"] for e in examples} for split, examples in
             (("train", train), ("validation", validation), ("test", test))}
  assert not prompts["train"] & prompts["validation"]
  assert not prompts["train"] & prompts["test"]
  assert not prompts["validation"] & prompts["test"]
  assert arithmetic.make_examples("validation", 512) == validation


def test_gold_reward_is_exact():
  gold = arithmetic.gold_reward
  prompt = "add: 47 + 85"
  assert gold(prompt, "units first: 231 #### 132") == 1.0
  assert gold(prompt, "units first: 221 #### 122") == 0.0  # Forgot a carry.
  assert gold(prompt, "units first: 231 #### 132", finished=False) == 0.0
  assert gold(prompt, "units first: 231") == 0.0  # No answer given.
  assert gold(prompt, "#### 132 #### 133") == 0.0  # The last one counts.
  assert gold(prompt, "#### 0132") == 1.0
  assert gold(prompt, "#### 1 32") == 0.0  # "1", then a stray "32".
  with pytest.raises(ValueError, match=r"'summarize: fox' is not a prompt of "
                     r"this task \('add: a \+ b'\)"):
    gold("summarize: fox", "#### 1")


def test_gold_reward_agrees_with_the_math_answer_reward(train):
  reward = math_answer.make_math_answer_reward(style="gsm8k")
  rows = train[:40]
  completions = [e["targets"] for e in rows] + [
      "units first: 231 #### 132", "units first: 231", "#### 0132",
      "#### 1 32", "", "#### 132.0"]
  prompts = [e["inputs"] for e in rows] + ["add: 47 + 85"] * 6
  answers = [e["answer"] for e in rows] + ["132"] * 6
  golds = [arithmetic.gold_reward(p, c) for p, c in zip(prompts, completions)]
  assert reward(prompts, completions, answer=answers) == golds
  assert 0 < sum(golds) < len(golds)  # Both outcomes were compared.


def test_vocabulary_spells_numbers_one_digit_per_token():
  vocabulary = arithmetic.vocabulary()
  pieces = lambda text: [vocabulary.tokenizer.id_to_piece(i)
                         for i in vocabulary.encode(text)]
  assert pieces("add: 47 + 385") == ["\u2581add:", "\u25814", "7",
                                     "\u2581+", "\u25813", "8", "5"]
  assert pieces("units first: 234 #### 432")[-4:] == [
      "\u2581####", "\u25814", "3", "2"]
  assert vocabulary.decode(vocabulary.encode("units first: 234 #### 432")) == (
      "units first: 234 #### 432")
  assert (vocabulary.pad_id, vocabulary.eos_id) == (0, 1)


def test_registered_task_reaches_online_prompts_with_its_answers():
  assert NAME in seqio.TaskRegistry.names()
  assert tasks.gold_reward_for(NAME) is arithmetic.gold_reward
  expected = arithmetic.make_examples(
      "validation", arithmetic.SPLIT_SIZES["validation"])
  prompts = prompts_lib.load_prompts(NAME, "validation", 16)
  assert prompts.texts == [e["inputs"] for e in expected]
  assert prompts.columns == {"answer": [e["answer"] for e in expected]}
  vocabulary = arithmetic.vocabulary()
  row = prompts.tokens[3]
  assert vocabulary.decode(row[row != 0].tolist()[:-1]) == expected[3][
      "inputs"]


def test_the_default_lengths_hold_every_example(train):
  # 16 and 16 tokens, EOS included (data.inputs_length, targets_length).
  vocabulary = arithmetic.vocabulary()
  examples = train + arithmetic.make_examples(
      "test", arithmetic.SPLIT_SIZES["test"])
  for field in ("inputs", "targets", "ideal"):
    longest = max(len(vocabulary.tokenizer.encode(ex[field]))
                  for ex in examples)
    assert longest + 1 <= 16, field
