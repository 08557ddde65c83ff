"""TextArena's single-player games as environments of agent episodes.

`online.environment='jaxrlhf.agents.textarena_env:make_env'` plays, per
prompt row, the TextArena game named in its `GAME_COLUMN` ("ta_game",
default `DEFAULT_GAME`; any single-player id of `textarena.make`:
"GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0", "Mastermind-v0",
...), seeded by its `SEED_COLUMN` ("ta_seed"; unseeded without one). Map
them in the data (`column_mapping='prompt=prompt,ta_game=ta_game,
ta_seed=ta_seed'`); the row's prompt itself is not shown (the game's own
opening is).

The mapping (`pip install textarena`; imported when first used):
* reset(): the game's opening observation (its rules and board) as a user
  message;
* step(message): the model's text is the action (`env.step(text)`), as
  TextArena's own agents pass it; the game's new messages (hints, boards,
  "invalid move" notices; not the echo of the action) come back as one
  user message, reward 0; when the game is done the episode ends with
  the player's reward from `env.close()` (TextArena's: 1 for a win, a
  game-defined partial score or -1 otherwise).
The game runs unwrapped: TextArena's default wrappers replay the whole
history in every observation (the chat already holds it) and rewrite
actions into brackets; the model is asked for the brackets by the game's
own rules.

Randomness. TextArena's games draw from Python's global `random` (seeded by
`reset(seed=...)`), and episodes' environments run in parallel threads. So
each game's calls run under one lock with its own `random` state swapped in
and out: a seeded row plays the same game whatever runs beside it.
Games that draw from numpy's global generator (SpellingBee, Sokoban) are
not isolated so. Word games that read NLTK corpora (Wordle, Hangman, ...)
download them at first use and so do not run offline.
"""

import random
import threading
from typing import Any, Callable, Dict, List, Mapping

GAME_COLUMN = "ta_game"
SEED_COLUMN = "ta_seed"
DEFAULT_GAME = "GuessTheNumber-v0"
# TextArena's player id of the game's own messages (`textarena.GAME_ID`).
_GAME_ID = -1
_RANDOM_LOCK = threading.Lock()


def _textarena():
  """The textarena package, or a one-line ImportError saying how to get
  it."""
  try:
    import textarena  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError("textarena is not installed: pip install textarena"
                      ) from None
  return textarena


class TextArenaGame:
  """One single-player TextArena game as an episode's environment (module
  docstring)."""

  def __init__(self, row: Mapping[str, Any]):
    ta = _textarena()
    self.game = row.get(GAME_COLUMN) or DEFAULT_GAME
    if self.game not in ta.envs.registration.ENV_REGISTRY:
      raise ValueError(f"{GAME_COLUMN}: TextArena has no game {self.game!r}; "
                       "textarena.envs.registration.ENV_REGISTRY lists them")
    seed = row.get(SEED_COLUMN)
    self._seed = None if seed is None or seed == "" else int(seed)
    self._random_state = random.Random(self._seed).getstate()
    env = self._isolated(lambda: ta.make(self.game))
    while isinstance(env, ta.Wrapper):
      env = env.env
    self.env = env

  def _isolated(self, fn: Callable[[], Any]) -> Any:
    """fn() with this game's own state of the global `random`."""
    with _RANDOM_LOCK:
      outer = random.getstate()
      random.setstate(self._random_state)
      try:
        return fn()
      finally:
        self._random_state = random.getstate()
        random.setstate(outer)

  def _observation(self) -> str:
    """The game's messages to the player since the last call, the echo of
    the player's own action left out."""
    _, messages = self.env.get_observation()
    return "\n".join(text.strip() for sender, text, _ in messages
                     if sender == _GAME_ID and text.strip())

  def reset(self) -> List[Dict[str, str]]:
    ta = _textarena()

    def start():
      self.env.reset(num_players=1, seed=self._seed)
      return self._observation()

    try:
      opening = self._isolated(start)
    except AssertionError as e:
      raise ValueError(f"{GAME_COLUMN}: TextArena's {self.game!r} is not a "
                       f"single-player game ({e})") from None
    if not isinstance(self.env.state, ta.SinglePlayerState):
      raise ValueError(f"{GAME_COLUMN}: TextArena's {self.game!r} is not a "
                       "single-player game")
    return [{"role": "user", "content": opening}]

  def step(self, message: Mapping[str, Any]):
    action = message.get("content") or ""
    done, _ = self._isolated(lambda: self.env.step(action))
    if done:
      rewards, _ = self.env.close()
      return [], float((rewards or {}).get(0, 0.0)), True
    text = self._isolated(self._observation) or "Your move."
    return [{"role": "user", "content": text}], 0.0, False


def make_env(row: Mapping[str, Any]) -> TextArenaGame:
  """`online.environment`'s factory (module docstring)."""
  return TextArenaGame(row)
