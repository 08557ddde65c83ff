"""Multi-turn episodes: the model speaks, its environment answers, until done.

`run_episodes` plays one episode per row against its environment
(`environments`: one object per episode, its calls in parallel threads):

  1. the opening messages (`reset()`) are rendered with the checkpoint's
     chat template (with the tools' schemas, so the model sees them as its
     family shows tools) and the generation prompt, and tokenized;
  2. the policy samples a turn for every episode still running, until its
     end-of-turn id (the vocabulary's EOS: Qwen's `<|im_end|>`), at most
     `max_turn_tokens` (`online.max_new_tokens`);
  3. each turn is decoded with its special tokens kept and its tool calls
     parsed (`tool_calls.parse_tool_calls`; a malformed call is a failed
     call the environment sees with its error, never an exception);
  4. every environment's `step` runs at once on the host; the messages it
     returns are rendered (`Renderer.block`) and appended, and the policy
     continues from them (its KV cache extended: `policies`).

Token in, token out: the model's turns are kept as the ids it sampled
(never decoded and re-encoded) with the sampler's log-probs of each; the
environment's messages are the template's text between the conversation
with and without them, tokenized. Only the model's tokens carry loss (the
`model` mask of `assemble`); the environment's are read, not trained.

What the trained tokens are, with a template that rewrites history (Qwen 3
drops the `<think>` blocks of turns before the last user message when it
renders a conversation): the tokens the model actually read and wrote,
turn after turn, its earlier thinking included; not the template's
rendering of the finished conversation. Training and sampling see the same
sequence.

An episode ends when its environment says done; when it has had
`max_turns` turns; or when it overflows: a turn that reaches
`max_turn_tokens` without its end-of-turn id, or a conversation that no
longer fits `max_episode_tokens` (model and environment tokens after the
opening). Its return is its environment's step rewards, step i's weighted
by `turn_discount` ** i, plus `failed_call_reward` per failed tool call and
`overflow_reward` if it overflowed.
"""

import dataclasses
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jaxrlhf.agents import environments
from jaxrlhf.agents import tool_calls as tool_calls_lib
from jaxrlhf.agents import tools as tools_lib
from jaxrlhf.data import chat_templates

Message = Dict[str, Any]
# The content of the stand-in assistant turn `Renderer.block` renders the
# environment's messages after.
_STAND_IN = "<<the model's turn>>"
# The markers of a turn's thinking (`Parser.message`).
_THINK = ("<think>", "</think>")


@dataclasses.dataclass(frozen=True)
class Limits:
  """An episode's bounds and the rewards of how it went (module
  docstring); `on_bad_row` is `rewards.on_bad_row`."""
  max_turns: int
  max_episode_tokens: int
  max_turn_tokens: int
  max_opening_tokens: int
  env_timeout_s: Optional[float] = None
  failed_call_reward: float = 0.0
  overflow_reward: float = 0.0
  turn_discount: float = 1.0
  on_bad_row: str = "raise"


@dataclasses.dataclass
class Episode:
  """One episode as it was played."""
  row: int
  opening: List[int] = dataclasses.field(default_factory=list)
  # The conversation after the opening: ids, which are the model's, and
  # the sampler's log-prob of each (0 for the environment's).
  tokens: List[int] = dataclasses.field(default_factory=list)
  is_model: List[bool] = dataclasses.field(default_factory=list)
  logprobs: List[float] = dataclasses.field(default_factory=list)
  messages: List[Message] = dataclasses.field(default_factory=list)
  step_rewards: List[float] = dataclasses.field(default_factory=list)
  turns: int = 0
  tool_calls: int = 0
  failed_calls: int = 0
  overflow: bool = False
  done: bool = False
  # Why it was dropped (rewards.on_bad_row=skip_and_report), or None.
  failure: Optional[str] = None
  final_text: str = ""
  # [len(opening) + len(tokens), moe layers, top_k] int32: the experts the
  # sampler routed each id to (-1: never fed), where it recorded them
  # (router replay); else None.
  routes: Optional[np.ndarray] = None

  @property
  def finished(self) -> bool:
    """Its last turn ended at its end-of-turn id (no overflow, not
    dropped): what reward functions get as `finished`."""
    return not self.overflow and not self.failure and self.turns > 0

  def episode_return(self, limits: Limits) -> float:
    if self.failure:
      return 0.0
    discounted = sum(r * limits.turn_discount ** i
                     for i, r in enumerate(self.step_rewards))
    return (discounted + limits.failed_call_reward * self.failed_calls
            + (limits.overflow_reward if self.overflow else 0.0))


class Renderer:
  """Messages to token ids with the checkpoint's chat template, and a
  turn's ids to text.

  Args:
    template: the `chat_templates.ChatTemplate`.
    vocabulary: an `HFTokenizerVocabulary` (its `tokenizer` encodes blocks
      without special tokens of its own and decodes with them kept); other
      vocabularies encode and decode through `encode`/`decode`.
  """

  def __init__(self, template, vocabulary):
    self.template = template
    self.vocabulary = vocabulary
    self.end_id = int(vocabulary.eos_id)
    self._tokenizer = getattr(vocabulary, "tokenizer", None)
    # What the template writes after an assistant turn's end-of-turn text
    # (Qwen's "\n" after `<|im_end|>`): the model stops at the id, so the
    # next block starts with it.
    self._eot = template.eos_text or ""

  def _ids(self, text: str) -> List[int]:
    if self._tokenizer is None:
      return [int(i) for i in self.vocabulary.encode(text)]
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    return [int(self.vocabulary.to_model_id(i)) for i in ids]

  def opening(self, messages: Sequence[Message], tools=None) -> List[int]:
    """The opening messages with the generation prompt, as the model reads
    them before its first turn; `tools`: the schemas of the tools offered
    (the template's `tools`), or None."""
    text = self.template.render(messages, add_generation_prompt=True,
                                tools=tools)
    return [int(i) for i in self.vocabulary.encode(text)]

  def block(self, opening: Sequence[Message], new: Sequence[Message],
            tools=None) -> List[int]:
    """The ids of the environment's messages `new` after a model turn that
    ended at its end-of-turn id, up to the next generation prompt: the
    template's text after an assistant turn's end-of-turn text, in the
    conversation with `new` and the generation prompt.

    The assistant turn rendered is a stand-in (the model's own tokens are
    kept as sampled), and only what follows it is read, so a template that
    renders earlier turns differently once more follows (Qwen 3 drops
    their thinking) changes nothing here."""
    if not self._eot:
      raise ValueError(
          f"{self.template.origin}: the end-of-turn text is unknown (the "
          "vocabulary's EOS has no text), so the environment's messages "
          "cannot be cut from the template's rendering; use a Hugging Face "
          "tokenizer (config.data.files.vocabulary).")
    base = list(opening) + [{"role": "assistant", "content": _STAND_IN}]
    after = self.template.render(base + list(new), tools=tools,
                                 add_generation_prompt=True)
    stand_in = after.rfind(_STAND_IN)
    end = after.find(self._eot, stand_in) if stand_in >= 0 else -1
    if end < 0:
      raise chat_templates.ChatTemplateError(
          f"{self.template.origin}: the chat template does not end an "
          f"assistant turn with {self._eot!r} (the vocabulary's EOS), so "
          "the environment's messages cannot be cut from its rendering.")
    return self._ids(after[end + len(self._eot):])

  def turn_text(self, ids: Sequence[int]) -> str:
    """A turn's text with its special tokens kept (tool-call markers may
    be special tokens), its end-of-turn id left out."""
    ids = [int(i) for i in ids if int(i) != self.end_id]
    if self._tokenizer is None:
      return self.vocabulary.decode(ids)
    return self._tokenizer.decode(
        [self.vocabulary.to_model_id(i) for i in ids],
        skip_special_tokens=False)

  def answer_text(self, ids: Sequence[int]) -> str:
    """A turn's text as reward functions read a completion (special
    tokens dropped)."""
    return self.vocabulary.decode(
        [int(i) for i in ids if int(i) != self.end_id])


@dataclasses.dataclass(frozen=True)
class Parser:
  """How a turn's tool calls are read (`tool_calls.parse_tool_calls`)."""
  style: str
  pattern: Optional[str] = None

  def message(self, text: str, schemas=None) -> Message:
    """The assistant's message of a turn's text; calls are checked against
    `schemas` (the tools offered) when given. A turn that opens with a
    `<think>` block (Qwen 3, DeepSeek-R1) has it as the message's
    "reasoning_content", as transformers' templates take it; "content" is
    what follows."""
    reasoning = None
    opened = text.lstrip()
    if opened.startswith(_THINK[0]) and _THINK[1] in opened:
      reasoning, text = opened[len(_THINK[0]):].split(_THINK[1], 1)
      reasoning = reasoning.strip()
    turn = tool_calls_lib.parse_tool_calls(
        text, self.style, schemas=schemas, pattern=self.pattern or None)
    message = {"role": "assistant", "content": turn.content}
    if reasoning is not None:
      message["reasoning_content"] = reasoning
    if turn.calls:
      message["tool_calls"] = [{"name": c.name, "arguments": c.arguments,
                                "error": c.error} for c in turn.calls]
    return message


class _Failures:
  """Raises, or drops the episode and counts it (`Limits.on_bad_row`)."""

  def __init__(self, limits: Limits, name: str, row_names: Sequence[str]):
    self.limits, self.name, self.row_names = limits, name, row_names

  def __call__(self, episode: Episode, turn: Optional[int], what: str):
    where = (f"{self.row_names[episode.row]}"
             + ("" if turn is None else f", turn {turn}"))
    message = f"{self.name} {what} ({where})."
    if self.limits.on_bad_row == "raise":
      raise environments.EnvironmentFailure(
          message + " To go on without such episodes, set "
          "--config.rewards.on_bad_row=skip_and_report.")
    episode.failure, episode.done = message, True


@dataclasses.dataclass
class Opened:
  """Episodes opened (`open_episodes`): their environments and the
  schemas of the tools each offers (by episode index; a dropped episode
  has none), how failures are handled, and the wall time spent waiting on
  the environments so far."""
  episodes: List[Episode]
  envs: Dict[int, Any]
  schemas: Dict[int, Any]
  fail: _Failures
  env_seconds: float = 0.0

  def check(self, i: int, turn: Optional[int], outcome, check=None
            ) -> bool:
    """Whether episode i's environment call `outcome` (in turn `turn`,
    counted from 1; None: before the first) succeeded and its value passes
    `check`; a failure raises, or drops the episode."""
    problem = outcome.error or (check(outcome.value) if check else None)
    if problem:
      self.fail(self.episodes[i], turn, problem)
    return not problem

  def on_all(self, fns, live, turn, check):
    """Runs fns[i] for the live episodes at once: {i: value} of those that
    did not fail (`check`)."""
    start = time.perf_counter()
    outcomes = environments.call_all([fns[i] for i in live],
                                     self.fail.limits.env_timeout_s)
    self.env_seconds += time.perf_counter() - start
    return {i: outcome.value for i, outcome in zip(live, outcomes)
            if self.check(i, turn, outcome, check)}

  def take_turn(self, i: int, ids, logprobs, ended: bool, renderer,
                parser):
    """Appends episode i's turn (its ids, the sampler's log-probs, whether
    it ended at its end-of-turn id); cut to the room left in
    max_episode_tokens. Returns the assistant's message to step the
    environment with, or None when the turn overflowed (episode over)."""
    e, limits = self.episodes[i], self.fail.limits
    room = limits.max_episode_tokens - len(e.tokens)
    if len(ids) > room:
      ids, logprobs, ended = ids[:room], logprobs[:room], False
    e.tokens += ids
    e.is_model += [True] * len(ids)
    e.logprobs += logprobs
    e.turns += 1
    e.final_text = renderer.answer_text(ids)
    if not ended:
      e.overflow = e.done = True
      return None
    message = parser.message(renderer.turn_text(ids), self.schemas[i])
    calls = message.get("tool_calls", ())
    e.tool_calls += len(calls)
    e.failed_calls += sum(c["error"] is not None for c in calls)
    e.messages.append(message)
    return message

  def take_answer(self, i: int, answer, renderer) -> Optional[List[int]]:
    """Appends the environment's answer (new messages, reward, done) to
    episode i after its latest turn: the block of ids the model reads
    next, or None when the episode is over (done, max_turns, or no room
    left in max_episode_tokens)."""
    e, limits = self.episodes[i], self.fail.limits
    new, reward, done = answer
    e.step_rewards.append(float(reward))
    if done or e.turns >= limits.max_turns:
      e.done = True
      return None
    e.messages += [dict(m) for m in new]
    block = renderer.block(e.messages[:_opening_length(e)], new,
                           self.schemas[i])
    if len(e.tokens) + len(block) >= limits.max_episode_tokens:
      e.overflow = e.done = True  # no room left for the model to speak
      return None
    e.tokens += block
    e.is_model += [False] * len(block)
    e.logprobs += [0.0] * len(block)
    return block


def open_episodes(make_env: Callable, rows: Sequence[Mapping[str, Any]],
                  renderer: Renderer, limits: Limits, name: str,
                  row_names: Optional[Sequence[str]] = None) -> Opened:
  """Each row's environment made and reset (in parallel threads), its
  opening rendered (`run_episodes` step 1); an episode that failed here
  is done with its end-of-turn id as its opening."""
  row_names = row_names or [f"row {i}" for i in range(len(rows))]
  opened = Opened(episodes=[Episode(row=i) for i in range(len(rows))],
                  envs={}, schemas={},
                  fail=_Failures(limits, name, row_names))
  everyone = list(range(len(rows)))
  envs = opened.on_all([lambda r=r: make_env(r) for r in rows], everyone,
                       None, None)
  openings = opened.on_all(
      {i: envs[i].reset for i in envs}, list(envs), None,
      lambda v: environments.check_messages(v, "reset()"))
  opened.envs = envs
  opened.schemas = {i: _schemas(env, name) for i, env in envs.items()}
  for i, messages in openings.items():
    e = opened.episodes[i]
    e.messages = [dict(m) for m in messages]
    e.opening = renderer.opening(e.messages, opened.schemas[i])
    if len(e.opening) > limits.max_opening_tokens:
      opened.fail(e, None, f"opens with {len(e.opening)} tokens, more than "
                  f"the {limits.max_opening_tokens} of "
                  "config.data.inputs_length; raise it")
  for e in opened.episodes:
    if not e.opening:
      e.opening, e.done = [renderer.end_id], True
  return opened


def run_episodes(make_env: Callable, rows: Sequence[Mapping[str, Any]],
                 policy, renderer: Renderer, parser: Parser, limits: Limits,
                 key, *, name: str = "online.environment",
                 row_names: Optional[Sequence[str]] = None
                 ) -> Tuple[List[Episode], Dict[str, float]]:
  """One episode per row (module docstring), the turns in lockstep.

  Args:
    make_env: (row) -> an environment (`environments`).
    rows: {"prompt": text, **columns} per episode.
    policy: a `policies.TurnPolicy` (start, decode, extend).
    key: the PRNG key of the sampling (turn t draws with fold_in(key, t)).
    name: what the messages call the environment.
    row_names: how the messages call each row ("row 12"), per episode.

  Returns:
    (the episodes, {"env_seconds": the wall time spent waiting on
    environments, "decode_steps": the policy's decode steps}).
  """
  import jax  # pylint: disable=g-import-not-at-top
  opened = open_episodes(make_env, rows, renderer, limits, name, row_names)
  episodes = opened.episodes
  policy.start([e.opening for e in episodes])

  for turn in range(limits.max_turns):
    live = [i for i, e in enumerate(episodes) if not e.done]
    if not live:
      break
    active = np.zeros(len(episodes), bool)
    active[live] = True
    drawn = policy.decode(active, limits.max_turn_tokens,
                          jax.random.fold_in(key, turn))
    stepping = {}
    for i in live:
      message = opened.take_turn(i, *drawn[i], renderer, parser)
      if message is not None:
        stepping[i] = (lambda env=opened.envs[i], m=message: env.step(m))
    answers = opened.on_all(stepping, list(stepping), turn + 1,
                            environments.check_step)
    blocks = [[] for _ in episodes]
    for i, answer in answers.items():
      blocks[i] = opened.take_answer(i, answer, renderer) or []
    if any(blocks):
      policy.extend(blocks)
  return episodes, {"env_seconds": opened.env_seconds,
                    "decode_steps": float(policy.decode_steps)}


def _schemas(env, name: str):
  """The schemas of an environment's `tools` (None: it offers none)."""
  offered = getattr(env, "tools", None)
  if not offered:
    return None
  try:
    return tools_lib.tool_schemas(offered)
  except ValueError as e:
    raise ValueError(f"{name}: its environment's tools: {e}") from None


def _opening_length(episode: Episode) -> int:
  """How many of the episode's messages opened it (system and user
  messages before the first assistant one)."""
  for i, m in enumerate(episode.messages):
    if m.get("role") == "assistant":
      return i
  return len(episode.messages)


@dataclasses.dataclass
class Assembled:
  """Episodes as fixed-shape arrays (numpy), E episodes.

  opening/opening_mask [E, Lp]: the openings left-padded; tokens [E, L]:
  the conversation after the opening, right-padded; present [E, L]: 1 on
  its tokens; model [E, L]: 1 on the model's (0 for a dropped episode);
  logprobs [E, L]: the sampler's, on the model's tokens; ended [E]: the
  last turn ended at its end-of-turn id; returns [E]: each episode's
  return (`Episode.episode_return`); routes [E, Lp + L, moe layers,
  top_k]: the sampler's experts of the openings' and conversations' ids,
  laid out as they are (-1 elsewhere), where the episodes carry them
  (`Episode.routes`), else None."""
  opening: np.ndarray
  opening_mask: np.ndarray
  tokens: np.ndarray
  present: np.ndarray
  model: np.ndarray
  logprobs: np.ndarray
  ended: np.ndarray
  returns: np.ndarray
  routes: Optional[np.ndarray] = None


def assemble(episodes: Sequence[Episode], limits: Limits,
             pad_id: int = 0) -> Assembled:
  """The episodes laid out for scoring (`Assembled`)."""
  n, width, length = (len(episodes), limits.max_opening_tokens,
                      limits.max_episode_tokens)
  out = Assembled(
      opening=np.full((n, width), pad_id, np.int32),
      opening_mask=np.zeros((n, width), np.int32),
      tokens=np.full((n, length), pad_id, np.int32),
      present=np.zeros((n, length), np.int32),
      model=np.zeros((n, length), np.float32),
      logprobs=np.zeros((n, length), np.float32),
      ended=np.zeros((n,), bool), returns=np.zeros((n,), np.float32))
  recorded = [e.routes for e in episodes if e.routes is not None]
  if recorded:
    out.routes = np.full((n, width + length) + recorded[0].shape[1:], -1,
                         np.int32)
  for r, e in enumerate(episodes):
    opening = e.opening[-width:]
    if out.routes is not None and e.routes is not None:
      out.routes[r, width - len(opening):width + len(e.tokens)] = e.routes[
          len(e.opening) - len(opening):len(e.opening) + len(e.tokens)]
    out.opening[r, width - len(opening):] = opening
    out.opening_mask[r, width - len(opening):] = 1
    m = len(e.tokens)
    out.tokens[r, :m] = e.tokens
    out.present[r, :m] = 1
    if not e.failure:
      out.model[r, :m] = e.is_model
      out.logprobs[r, :m] = np.asarray(e.logprobs) * np.asarray(e.is_model)
    out.ended[r] = e.finished
    out.returns[r] = e.episode_return(limits)
  return out


def metrics(episodes: Sequence[Episode]) -> Dict[str, float]:
  """Sums over the episodes (a driver divides by episode/count after
  adding them over processes)."""
  return {"episode/count": float(len(episodes)),
          "episode/turns": float(sum(e.turns for e in episodes)),
          "episode/tool_calls": float(sum(e.tool_calls for e in episodes)),
          "episode/failed_calls": float(sum(e.failed_calls
                                            for e in episodes)),
          "episode/overflow": float(sum(e.overflow for e in episodes)),
          "episode/skipped": float(sum(bool(e.failure) for e in episodes))}
