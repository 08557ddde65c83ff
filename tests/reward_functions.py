"""Reward functions a test names by import path ("reward_functions:..."),
under the TRL convention fn(prompts, completions, **columns)."""

import time


def word_count(prompts, completions, **unused):
  """The number of words of each completion."""
  del prompts, unused
  return [float(len(c.split())) for c in completions]


def zero(prompts, completions, **unused):
  del prompts, unused
  return [0.0] * len(completions)


def none_for_odd_rows(prompts, completions, **unused):
  del prompts, unused
  return [None if i % 2 else 1.0 for i in range(len(completions))]


def raises(prompts, completions, **unused):
  del prompts, completions, unused
  raise RuntimeError("the grader is down")


def slow(prompts, completions, **unused):
  del prompts, unused
  time.sleep(30)
  return [0.0] * len(completions)


def first_prompt_word_is_even(prompts, completions, **unused):
  """1 or 0 by the prompt alone: every response of a prompt scores the
  same (a group with no signal) when the prompt's number is even, and the
  completion decides otherwise."""
  del unused
  out = []
  for prompt, completion in zip(prompts, completions):
    if len(prompt.split()[1]) % 2 == 0:
      out.append(1.0)
    else:
      out.append(float(len(completion.split()) % 2))
  return out


def same_word_count_parity(prompts, completions, **unused):
  """1 when the completion has as many words as its prompt modulo 2, else
  0: a 0/1 reward that tells apart even a policy whose completions do not
  depend on the prompt."""
  del unused
  return [float(len(c.split()) % 2 == len(p.split()) % 2)
          for p, c in zip(prompts, completions)]
