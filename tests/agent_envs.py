"""Environments and tools the agent tests and the agents' miniature load by
import path (`online.environment='agent_envs:make_guess'`, ...)."""

import time


def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: the first factor.
    b: the second factor.
  """
  return a * b


class GuessTheNumber:
  """Guess the row's number; told 'higher' or 'lower' after each guess."""

  def __init__(self, row):
    self.secret = int(row.get("answer", 7))

  def reset(self):
    return [{"role": "user", "content": "Guess my number, 1 to 9."}]

  def step(self, message):
    guess = message["content"].strip()
    if not guess.isdigit():
      return [{"role": "user", "content": "A number, please."}], 0.0, False
    if int(guess) == self.secret:
      return [], 1.0, True
    hint = "higher" if int(guess) < self.secret else "lower"
    return [{"role": "user", "content": hint}], 0.0, False


def make_guess(row):
  return GuessTheNumber(row)


class Echo:
  """Answers every turn with a user message; a step reward of 0.5."""

  def __init__(self, row):
    self.row = row

  def reset(self):
    return [{"role": "user", "content": self.row["prompt"]}]

  def step(self, message):
    return [{"role": "user", "content": "again"}], 0.5, False


def make_echo(row):
  return Echo(row)


class _Broken(Echo):
  """Fails at its second step, in the way its row's "failure" says."""

  def __init__(self, row):
    super().__init__(row)
    self.steps = 0

  def step(self, message):
    self.steps += 1
    if self.steps < 2:
      return super().step(message)
    failure = self.row.get("failure")
    if failure == "raise":
      raise KeyError("no such room")
    if failure == "hang":
      time.sleep(30)
    if failure == "types":
      return "not a tuple"
    if failure == "reward":
      return [], "1", True
    return super().step(message)


def make_broken(row):
  return _Broken(row)
