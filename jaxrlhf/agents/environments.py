"""Environments an agent acts in, and the calls into them that may fail.

The protocol (`online.environment='pkg.module:make_env'`): `make_env(row)`
gets the prompt row (`{"prompt": its text, **its extra columns}`, as reward
functions see them) and returns one environment object per episode with

  reset() -> [message, ...]
      the opening messages ({"role": "system" | "user", "content": str});
  step(message) -> ([message, ...], reward, done)
      given the assistant's message ({"role": "assistant", "content": its
      text without the calls, "tool_calls": [{"name", "arguments",
      "error"}, ...] when it made any; "error" is None for a call that
      parsed and fits the tools' schemas, else the message a tool would
      answer with; "reasoning_content": the turn's opening <think> block,
      when it has one), the messages to append (role "tool" or "user"), the
      reward of this step (a number) and whether the episode is over;
  tools (optional attribute): a list of Python functions offered to the
      model (`tools.tool_schema`); `run_tool_calls(message, env.tools)`
      answers the calls of a message as the default loop does.

Twenty lines make one (guess the number, told higher or lower):

    class GuessTheNumber:
      def __init__(self, row):
        self.secret = int(row["answer"])

      def reset(self):
        return [{"role": "user", "content": "Guess my number, 1 to 100."}]

      def step(self, message):
        guess = message["content"].strip()
        if not guess.isdigit():
          return [{"role": "user", "content": "A number, please."}], 0.0, False
        if int(guess) == self.secret:
          return [], 1.0, True
        hint = "higher" if int(guess) < self.secret else "lower"
        return [{"role": "user", "content": hint}], 0.0, False

    def make_env(row):
      return GuessTheNumber(row)

`ToolLoop` is the environment of `online.tools` alone (TRL's `tools=`):
the row's messages open the episode (a "messages"-layout row's
conversation, its `messages` column), or else its prompt text as one user
message; each call runs and
its result (or error) comes back as a `tool` message, and the episode ends
when the model answers without a call (reward 0: `config.rewards` scores
the final answer).

Calls into an environment (`call`) run in daemon threads, all episodes'
at once, each waited for at most `online.env_timeout_s`; one that raises,
hangs or returns the wrong types is an `EnvironmentFailure` whose message
names the environment, the row and the turn in one line.
"""

import dataclasses
import numbers
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from jaxrlhf.agents import tool_calls as tool_calls_lib
from jaxrlhf.agents import tools as tools_lib
from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.rewards import host

Message = Dict[str, Any]
ROLES_FROM_ENVIRONMENT = ("tool", "user", "system")
_PREVIEW = 60


class EnvironmentFailure(RuntimeError):
  """An environment raised, hung or answered with the wrong types."""


def load_environment(import_path: str,
                     field: str = "online.environment") -> Callable:
  """The `make_env(row)` named "pkg.module:make_env" (a one-line
  ValueError naming `field` when it cannot be imported)."""
  return host.load_function(import_path, field)


@dataclasses.dataclass
class Outcome:
  """What one call returned (value), or why not (error: one line)."""
  value: Any = None
  error: Optional[str] = None
  seconds: float = 0.0


def call_all(calls: Sequence[Callable[[], Any]],
             timeout_s: Optional[float]) -> List[Outcome]:
  """Every call in a daemon thread of its own, at once; each waited for
  until `timeout_s` seconds after they started (None: no limit). A call
  still running then is abandoned (it runs on, unheard) and reported as
  timed out."""
  outcomes = [Outcome() for _ in calls]
  threads = []
  start = time.perf_counter()

  def run(fn, outcome):
    begun = time.perf_counter()
    try:
      outcome.value = fn()
    except BaseException as e:  # pylint: disable=broad-except
      lines = str(e).strip().splitlines()
      outcome.error = (f"raised {type(e).__name__}"
                       + (f": {lines[0]}" if lines else ""))
    outcome.seconds = time.perf_counter() - begun

  for fn, outcome in zip(calls, outcomes):
    thread = threading.Thread(target=run, args=(fn, outcome), daemon=True,
                              name="environment step")
    thread.start()
    threads.append(thread)
  for thread, outcome in zip(threads, outcomes):
    left = None if timeout_s is None else max(
        0.0, timeout_s - (time.perf_counter() - start))
    thread.join(left)
    if thread.is_alive():
      outcome.error = f"did not answer within {timeout_s:g} s (online.env_timeout_s)"
      outcome.seconds = float(timeout_s)
  return outcomes


def _preview(value) -> str:
  text = repr(value)
  return text if len(text) <= _PREVIEW else text[:_PREVIEW] + "..."


def check_messages(value, what: str) -> Optional[str]:
  """None when `value` is a list of {"role", "content": str} messages with
  a role an environment may speak in, else what is wrong."""
  if not isinstance(value, (list, tuple)):
    return (f"{what} returned {_preview(value)} (a {type(value).__name__}), "
            "not a list of messages")
  for i, m in enumerate(value):
    if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
      return (f"{what} returned message {i} = {_preview(m)}; a message is "
              "{'role': ..., 'content': str}")
    if m.get("role") not in ROLES_FROM_ENVIRONMENT:
      return (f"{what} returned message {i} with role {m.get('role')!r}; an "
              f"environment speaks as one of {list(ROLES_FROM_ENVIRONMENT)}")
  return None


def check_step(value) -> Optional[str]:
  """None when `value` is step()'s (messages, reward, done), else what is
  wrong."""
  if not isinstance(value, (tuple, list)) or len(value) != 3:
    return (f"step() returned {_preview(value)}; it returns (messages, "
            "reward, done)")
  messages, reward, done = value
  bad = check_messages(messages, "step()")
  if bad:
    return bad
  if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
    return f"step() returned the reward {_preview(reward)}, not a number"
  if reward != reward or abs(float(reward)) == float("inf"):
    return f"step() returned the reward {reward}, not a finite number"
  if not isinstance(done, (bool, int)) or isinstance(done, float):
    return f"step() returned done = {_preview(done)}, not a bool"
  return None


def run_tool_calls(message: Message, tools: Sequence[Callable]
                   ) -> List[Message]:
  """A `tool` message per call of the assistant's `message`: the tool's
  result, or the error the model reads (`tool_calls.run_tool_call`)."""
  replies = []
  for c in message.get("tool_calls") or ():
    call = tool_calls_lib.ToolCall(name=c["name"], arguments=c["arguments"],
                                   raw="", error=c.get("error"))
    replies.append({"role": "tool", "name": c["name"] or "",
                    "content": tool_calls_lib.run_tool_call(call, tools)})
  return replies


class ToolLoop:
  """The environment of stateless tools (`online.tools` without an
  environment): module docstring."""

  def __init__(self, row: Mapping[str, Any], tools: Sequence[Callable]):
    conversation = row.get(kinds_lib.CONVERSATION_COLUMN)
    self._opening = ([dict(m) for m in conversation] if conversation else
                     [{"role": "user", "content": row["prompt"]}])
    self.tools = list(tools)

  def reset(self) -> List[Message]:
    return [dict(m) for m in self._opening]

  def step(self, message: Message):
    if not message.get("tool_calls"):
      return [], 0.0, True
    return run_tool_calls(message, self.tools), 0.0, False


def episodic(online_config) -> bool:
  """Whether a run's responses are episodes: `online.environment` or
  `online.tools` is set."""
  return bool(online_config.environment or online_config.tools)


def environment_factory(environment: str, tools: str) -> Callable:
  """(row) -> an environment: `online.environment`'s factory, or the
  `ToolLoop` over `online.tools`."""
  if environment:
    return load_environment(environment)
  loaded = tools_lib.load_tools(tools)
  return lambda row: ToolLoop(row, loaded)
