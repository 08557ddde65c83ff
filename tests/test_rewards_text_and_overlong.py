"""The small text rewards (format regex, length bounds) and DAPO's soft
overlong punishment, against values worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.rewards import overlong
from jaxrlhf.rewards import text_rewards

# --- text rewards --------------------------------------------------------------


def test_regex_reward_search_and_full_match():
  completions = ["<think>a\nb</think> 42", "42 <think>x</think>",
                 "<think>no end", "#### 17"]
  think = text_rewards.make_regex_reward(r"<think>.*?</think>\s*\S.*",
                                         match="full")
  assert think(["p"] * 4, completions, answer=[1] * 4) == [1.0, 0.0, 0.0, 0.0]
  anywhere = text_rewards.make_regex_reward(r"<think>.*?</think>")
  assert anywhere(["p"] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
  gsm8k = text_rewards.make_regex_reward(r"#### -?\d+")
  assert gsm8k(["p"] * 4, completions) == [0.0, 0.0, 0.0, 1.0]
  with pytest.raises(ValueError, match=r"pattern '\(' is not a valid"):
    text_rewards.make_regex_reward("(")
  with pytest.raises(ValueError, match=r"match='prefix' is not supported"):
    text_rewards.make_regex_reward("a", match="prefix")


def test_length_reward_bounds():
  texts = ["", "abc", "  abcd  ", "abcdef"]
  assert text_rewards.make_length_reward(3, 4)(["p"] * 4, texts) == [
      0.0, 1.0, 1.0, 0.0]
  assert text_rewards.make_length_reward(max_chars=3)(["p"] * 4, texts) == [
      1.0, 1.0, 0.0, 0.0]
  assert text_rewards.make_length_reward(min_chars=5)(["p"] * 4, texts) == [
      0.0, 0.0, 0.0, 1.0]
  with pytest.raises(ValueError, match=r"give min_chars, max_chars or both"):
    text_rewards.make_length_reward()
  with pytest.raises(ValueError, match=r"min_chars=5 is more than "
                     r"max_chars=2"):
    text_rewards.make_length_reward(5, 2)
  with pytest.raises(ValueError, match=r"max_chars=-1 must be a whole"):
    text_rewards.make_length_reward(max_chars=-1)


# --- soft overlong punishment ------------------------------------------------------


def test_soft_overlong_penalty_at_the_boundaries():
  # L_max = 10, L_cache = 4: free up to 6, then -1/4 per token, -1 past 10.
  lengths = jnp.array([0, 5, 6, 7, 8, 9, 10, 11, 100])
  expected = [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
  penalty = overlong.soft_overlong_penalty(lengths, 10, 4)
  assert penalty.dtype == jnp.float32
  np.testing.assert_allclose(penalty, expected, rtol=0, atol=1e-7)
  # Float lengths fall on the line; under jit too.
  jitted = jax.jit(lambda l: overlong.soft_overlong_penalty(l, 10, 4))
  np.testing.assert_allclose(jitted(jnp.array([6.5, 9.5])), [-0.125, -0.875],
                             atol=1e-7)
  # DAPO's own numbers: 20480 and 4096; 18432 is half-way down the ramp.
  np.testing.assert_allclose(
      overlong.soft_overlong_penalty(np.array([16384, 18432, 20480, 20481]),
                                     20480, 4096), [0, -0.5, -1, -1])
  # No cache: a hard cut.
  np.testing.assert_array_equal(
      overlong.soft_overlong_penalty(jnp.array([9, 10, 11]), 10, 0),
      [0, 0, -1])


@pytest.mark.parametrize("args,message", [
    ((0, 0), r"max_length=0 must be > 0"),
    ((10, 11), r"cache_length=11 must be in \[0, max_length=10\]"),
    ((10, -1), r"cache_length=-1 must be in"),
    ((10.0, 4), r"max_length=10.0 must be a whole number"),
    ((10, True), r"cache_length=True must be a whole number"),
])
def test_soft_overlong_penalty_checks_its_arguments(args, message):
  with pytest.raises(ValueError, match=message):
    overlong.soft_overlong_penalty(jnp.array([1, 2]), *args)


def test_soft_overlong_penalty_refuses_boolean_lengths():
  with pytest.raises(ValueError, match=r"integer or float token counts, got "
                     r"dtype bool"):
    overlong.soft_overlong_penalty(jnp.array([True, False]), 10, 4)
