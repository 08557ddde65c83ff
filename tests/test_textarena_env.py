"""TextArena's single-player games as agent environments
(jaxrlhf/agents/textarena_env.py), played by scripted assistants."""

import re
import subprocess
import sys
import threading

import pytest
# In the test extras (setup.cfg): installed wherever the suite runs.
import textarena  # pylint: disable=unused-import

from jaxrlhf.agents import environments
from jaxrlhf.agents import textarena_env


def _say(text):
  return {"role": "assistant", "content": text}


def _bisect(env):
  """Plays Guess The Number by bisection on the hints the user messages
  carry; returns the guesses and the steps' (messages, reward, done)."""
  opening = env.reset()
  assert environments.check_messages(opening, "reset()") is None
  low, high = map(int, re.search(r"between (\d+) and (\d+)",
                                 opening[0]["content"]).groups())
  bounds = (low, high)
  guesses, steps = [], []
  while True:
    guess = (low + high) // 2
    guesses.append(guess)
    step = env.step(_say(f"My guess is [{guess}]."))
    assert environments.check_step(step) is None
    steps.append(step)
    messages, _, done = step
    if done:
      return bounds, guesses, steps
    hint = messages[0]["content"]
    if "higher" in hint:
      low = guess + 1
    else:
      assert "lower" in hint
      high = guess - 1


def test_bisection_wins_guess_the_number():
  env = textarena_env.make_env({"ta_game": "GuessTheNumber-v0", "ta_seed": 3})
  (low, high), guesses, steps = _bisect(env)
  assert (low, high) == (1, 20)
  secret = env.env.state.game_state["game_number"]
  assert guesses[-1] == secret
  # Bisection over 20 numbers needs at most ceil(log2(21)) = 5 guesses.
  assert len(guesses) <= 5
  # The win's reward comes at the end, TextArena's 1 for a win.
  assert steps[-1] == ([], 1.0, True)
  for messages, reward, done in steps[:-1]:
    assert reward == 0.0 and not done
    assert [m["role"] for m in messages] == ["user"]
    # The echo of the action is not sent back.
    assert "My guess" not in messages[0]["content"]


def test_a_seed_fixes_the_game_whatever_runs_beside_it():
  secrets = {}

  def play(name, seed):
    env = textarena_env.make_env({"ta_game": "GuessTheNumber-v0",
                                  "ta_seed": seed})
    env.reset()
    secrets[name] = env.env.state.game_state["game_number"]

  threads = [threading.Thread(target=play, args=(f"{seed}-{i}", seed))
             for i in range(4) for seed in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for seed in range(6):
    assert len({secrets[f"{seed}-{i}"] for i in range(4)}) == 1
  assert len({secrets[f"{seed}-0"] for seed in range(6)}) > 1


def test_global_random_is_left_as_it_was():
  import random  # pylint: disable=import-outside-toplevel
  random.seed(123)
  expected = random.Random(123).random()
  env = textarena_env.make_env({"ta_game": "GuessTheNumber-v0", "ta_seed": 1})
  env.reset()
  env.step(_say("[10]"))
  assert random.random() == expected


def test_invalid_moves_are_answered_then_lose():
  env = textarena_env.make_env({"ta_game": "GuessTheNumber-v0", "ta_seed": 0})
  env.reset()
  messages, reward, done = env.step(_say("ten"))
  assert (reward, done) == (0.0, False)
  assert "invalid move" in messages[0]["content"]
  # TextArena's SinglePlayerState allows one invalid move; the second ends
  # the game with the partial score, 0 before any valid guess.
  assert env.step(_say("eleven")) == ([], 0.0, True)


def test_other_games_and_bad_names():
  env = textarena_env.make_env({"ta_game": "TowerOfHanoi-v0"})
  assert "Tower of Hanoi" in env.reset()[0]["content"]
  with pytest.raises(ValueError, match="not a single-player game"):
    textarena_env.make_env({"ta_game": "TicTacToe-v0"}).reset()
  with pytest.raises(ValueError, match="no game 'NoSuchGame-v0'"):
    textarena_env.make_env({"ta_game": "NoSuchGame-v0"})


def test_default_game_without_columns():
  env = textarena_env.make_env({"prompt": "ignored"})
  assert env.game == textarena_env.DEFAULT_GAME
  assert "Guess The Number" in env.reset()[0]["content"]


def test_without_textarena_the_error_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "textarena", None)
  with pytest.raises(ImportError, match="pip install textarena"):
    textarena_env.make_env({})


def test_module_does_not_import_textarena():
  code = ("import sys; import jaxrlhf.agents.textarena_env; "
          "assert 'textarena' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)
