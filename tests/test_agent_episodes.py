"""Multi-turn episodes: the loop, the chat template's tokens, failures.

The loop is tested with a scripted policy (its turns are fixed ids) against
environments of tests/agent_envs.py and the tiny Qwen 2.5 tokenizer and
template of tests/fixtures/tokenizers/chat_qwen; the model's side (the KV
cache extended between turns, the training log-probs) is
tests/test_agent_training.py.
"""

import pathlib

import numpy as np
import pytest

from jaxrlhf.agents import environments
from jaxrlhf.agents import episodes
from jaxrlhf.agents import tools as tools_lib
from jaxrlhf.data import chat_templates
from jaxrlhf.data import hf_tokenizer

import agent_envs

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def vocabulary():
  return hf_tokenizer.HFTokenizerVocabulary(
      str(FIXTURES / "tokenizers" / "chat_qwen" / "tokenizer.json"))


@pytest.fixture(scope="module")
def renderer(vocabulary):
  return episodes.Renderer(chat_templates.for_vocabulary(vocabulary),
                           vocabulary)


def char_ids(vocabulary, text):
  """`text` as one id per character: ids the tokenizer would never
  produce for it (it merges), so a re-encoding would show."""
  return [i for ch in text for i in vocabulary.encode(ch)]


class ScriptedPolicy:
  """Turn j of row b is script[b][j] (a text, its ids one per character,
  then the end id unless the text is None: a turn that never ends)."""

  def __init__(self, vocabulary, script):
    self.vocabulary, self.script = vocabulary, script
    self.decode_steps, self.started, self.extended = 0, None, []
    self.turn = {}

  def start(self, openings):
    self.started = [list(o) for o in openings]

  def decode(self, active, max_tokens, key):
    del key
    out = []
    for b, on in enumerate(active):
      if not on:
        out.append(([], [], False))
        continue
      j = self.turn.get(b, 0)
      self.turn[b] = j + 1
      text = self.script[b][j]
      if text is None:  # never ends
        ids = [self.vocabulary.encode("a")[0]] * max_tokens
        ended = False
      else:
        ids = char_ids(self.vocabulary, text) + [self.vocabulary.eos_id]
        ended = True
      ids = ids[:max_tokens]
      out.append((ids, [-0.5] * len(ids), ended))
    self.decode_steps += max_tokens
    return out

  def extend(self, blocks):
    self.extended.append([list(b) for b in blocks])


def limits(**overrides):
  base = dict(max_turns=4, max_episode_tokens=400, max_turn_tokens=120,
              max_opening_tokens=1000, env_timeout_s=5.0)
  base.update(overrides)
  return episodes.Limits(**base)


def play(vocabulary, renderer, make_env, rows, script, **limit_overrides):
  policy = ScriptedPolicy(vocabulary, script)
  played, timing = episodes.run_episodes(
      make_env, rows, policy, renderer, episodes.Parser("qwen"),
      limits(**limit_overrides), key=np.uint32([0, 0]),
      name="online.environment 'agent_envs:x'")
  return played, timing, policy


CALL = ('<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}'
        '\n</tool_call>')


def test_tool_episode_tokens_are_the_templates_and_the_models_own(
    vocabulary, renderer):
  """The stateless tool loop: a call, the tool's reply, an answer. The
  model's ids are kept as drawn; everything else is what the template
  renders for the whole conversation, token for token."""
  tools = [agent_envs.multiply]
  make_env = lambda row: environments.ToolLoop(row, tools)
  played, _, policy = play(vocabulary, renderer, make_env,
                           [{"prompt": "What is 12 times 34?"}],
                           [[CALL, "It is 408."]])
  e, = played
  assert e.turns == 2 and e.tool_calls == 1 and e.failed_calls == 0
  assert e.done and not e.overflow and e.failure is None
  assert e.final_text == "It is 408."
  assert [m["role"] for m in e.messages] == ["user", "assistant", "tool",
                                             "assistant"]
  assert e.messages[2]["content"] == "408"  # the tool ran
  # The model's tokens are the scripted ids, exactly.
  model_ids = [t for t, m in zip(e.tokens, e.is_model) if m]
  eos = vocabulary.eos_id
  assert model_ids == (char_ids(vocabulary, CALL) + [eos]
                       + char_ids(vocabulary, "It is 408.") + [eos])
  assert e.logprobs == [-0.5 if m else 0.0 for m in e.is_model]
  # The rest is the template's: the whole conversation rendered by it
  # (the assistant turns as the text they decode to) and tokenized, from
  # the opening (with the tool's schema) to the last generation prompt.
  schemas = tools_lib.tool_schemas(tools)
  conversation = [
      {"role": "user", "content": "What is 12 times 34?"},
      {"role": "assistant", "content": "", "tool_calls": [{
          "type": "function", "function": {"name": "multiply",
                                           "arguments": {"a": 12, "b": 34}}}]},
      {"role": "tool", "content": "408"}]
  text = renderer.template.render(conversation, add_generation_prompt=True,
                                  tools=schemas)
  expected = vocabulary.encode(text)
  opening_ids = vocabulary.encode(renderer.template.render(
      conversation[:1], add_generation_prompt=True, tools=schemas))
  assert e.opening == opening_ids
  env_ids = [t for t, m in zip(e.tokens, e.is_model) if not m]
  # The template writes the call as the model did (after "assistant\n"):
  # its tokens are the opening, the call's (canonical) ids, the end id,
  # then exactly the environment's ids of the episode.
  assert expected == (opening_ids + vocabulary.encode(CALL) + [eos]
                      + env_ids)
  assert vocabulary.tokenizer.decode(env_ids, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>"
      "<|im_end|>\n<|im_start|>assistant\n")
  assert policy.started == [e.opening]
  assert policy.extended == [[env_ids]]


def test_a_rows_conversation_opens_the_tool_loop(vocabulary, renderer):
  """A "messages"-layout row (system and user turns) opens the episode with
  its own messages, rendered once with the tools; without them the prompt
  text is one user message."""
  tools = [agent_envs.multiply]
  make_env = lambda row: environments.ToolLoop(row, tools)
  conversation = [{"role": "system", "content": "Use the tools."},
                  {"role": "user", "content": "What is 12 times 34?"}]
  rows = [{"prompt": renderer.template.render(conversation,
                                              add_generation_prompt=True),
           "messages": conversation},
          {"prompt": "What is 12 times 34?"}]
  played, _, _ = play(vocabulary, renderer, make_env, rows,
                      [["It is 408."], ["It is 408."]])
  schemas = tools_lib.tool_schemas(tools)
  for e, opening in zip(played, (conversation, conversation[1:])):
    assert e.messages[:len(opening)] == opening
    assert e.opening == vocabulary.encode(renderer.template.render(
        opening, add_generation_prompt=True, tools=schemas))


def test_guessing_game_returns_discounts_and_hints(vocabulary, renderer):
  rows = [{"prompt": "", "answer": 5}, {"prompt": "", "answer": 2}]
  script = [["3", "7", "5"], ["2"]]
  played, timing, _ = play(vocabulary, renderer, agent_envs.make_guess, rows,
                           script)
  first, second = played
  assert first.turns == 3 and second.turns == 1
  assert [m["content"] for m in first.messages if m["role"] == "user"] == [
      "Guess my number, 1 to 9.", "higher", "lower"]
  assert first.step_rewards == [0.0, 0.0, 1.0]
  lim = limits(turn_discount=0.5)
  assert first.episode_return(lim) == pytest.approx(0.25)
  assert second.episode_return(lim) == pytest.approx(1.0)
  assert timing["env_seconds"] >= 0
  arrays = episodes.assemble(played, lim)
  np.testing.assert_allclose(arrays.returns, [0.25, 1.0])
  # The mask is the model's tokens; present covers the hints too.
  row = arrays.model[0]
  assert row.sum() == sum(first.is_model) == 2 * 3
  assert arrays.present[0].sum() == len(first.tokens)
  assert arrays.opening_mask[0].sum() == len(first.opening)
  assert arrays.ended.tolist() == [True, True]
  m = episodes.metrics(played)
  assert m["episode/turns"] == 4 and m["episode/count"] == 2


def test_limits_end_episodes(vocabulary, renderer):
  rows = [{"prompt": "x"}] * 3
  # Row 0 never ends its turn; rows 1 and 2 talk until max_turns.
  script = [[None], ["hi", "hi", "hi"], ["hi", "hi", "hi"]]
  played, _, _ = play(vocabulary, renderer, agent_envs.make_echo, rows,
                      script, max_turns=2, overflow_reward=-1.0,
                      max_turn_tokens=10)
  assert played[0].overflow and played[0].turns == 1
  assert played[0].episode_return(limits(overflow_reward=-1.0)) == -1.0
  assert not played[1].overflow and played[1].turns == 2
  # The last step's reward counts; its messages are not appended.
  assert played[1].step_rewards == [0.5, 0.5]
  assert played[1].is_model[-1]
  # A budget the environment's reply cannot fit ends the episode.
  played, _, _ = play(vocabulary, renderer, agent_envs.make_echo,
                      [{"prompt": "x"}], [["hi", "hi"]],
                      max_episode_tokens=8)
  assert played[0].overflow and played[0].turns == 1
  assert len(played[0].tokens) <= 8


def test_failed_calls_are_replies_and_count(vocabulary, renderer):
  make_env = lambda row: environments.ToolLoop(row, [agent_envs.multiply])
  bad = ['<tool_call>\n{"name": "multiply", "arguments": {"a": 1}}\n'
         '</tool_call>', '<tool_call>\n{"name": oops}\n</tool_call>', "done"]
  played, _, _ = play(vocabulary, renderer, make_env, [{"prompt": "q"}],
                      [bad])
  e, = played
  assert e.tool_calls == 2 and e.failed_calls == 2 and e.turns == 3
  replies = [m["content"] for m in e.messages if m["role"] == "tool"]
  assert replies[0] == "error: multiply is missing the required argument 'b'."
  assert replies[1].startswith("error: the tool call is not valid JSON")
  assert e.episode_return(limits(failed_call_reward=-0.25)) == -0.5


@pytest.mark.parametrize("failure,why", [
    ("raise", "raised KeyError: 'no such room'"),
    ("types", "step() returned 'not a tuple'"),
    ("reward", "step() returned the reward '1', not a number"),
    ("hang", "did not answer within 0.5 s (online.env_timeout_s)"),
])
def test_a_failing_environment_is_one_line(vocabulary, renderer, failure,
                                           why):
  rows = [{"prompt": "a"}, {"prompt": "b", "failure": failure}]
  script = [["hi"] * 4, ["hi"] * 4]
  with pytest.raises(environments.EnvironmentFailure) as raised:
    play(vocabulary, renderer, agent_envs.make_broken, rows, script,
         env_timeout_s=0.5)
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith("online.environment 'agent_envs:x' " + why)
  assert "(row 1, turn 2)" in message
  assert "rewards.on_bad_row=skip_and_report" in message
  # Skipped instead: the episode is dropped (no loss, return 0), counted.
  played, _, _ = play(vocabulary, renderer, agent_envs.make_broken, rows,
                      script, env_timeout_s=0.5, on_bad_row="skip_and_report")
  assert played[1].failure and not played[0].failure
  assert played[0].turns == 4
  arrays = episodes.assemble(played, limits())
  assert arrays.model[1].sum() == 0 and arrays.model[0].sum() > 0
  assert arrays.returns[1] == 0.0
  assert episodes.metrics(played)["episode/skipped"] == 1


def test_a_factory_that_fails_names_the_row(vocabulary, renderer):
  def make_env(row):
    if row["prompt"] == "b":
      raise ValueError("bad row\nmore")
    return agent_envs.Echo(row)
  with pytest.raises(environments.EnvironmentFailure,
                     match=r"raised ValueError: bad row \(row 1\)\."):
    play(vocabulary, renderer, make_env, [{"prompt": "a"}, {"prompt": "b"}],
         [["hi"], ["hi"]])


def test_an_opening_too_long_says_which_field(vocabulary, renderer):
  with pytest.raises(environments.EnvironmentFailure,
                     match="config.data.inputs_length"):
    play(vocabulary, renderer, agent_envs.make_echo, [{"prompt": "a" * 50}],
         [["hi"]], max_opening_tokens=20)


def test_the_python_tool_runs_code_apart_and_answers_with_its_output():
  from jaxrlhf.agents import python_tool  # pylint: disable=g-import-not-at-top
  from jaxrlhf.rewards import code_execution  # pylint: disable=g-import-not-at-top
  assert tools_lib.tool_schema(python_tool.python)["function"][
      "parameters"]["required"] == ["code"]
  message = {"role": "assistant", "content": "", "tool_calls": [
      {"name": "python", "arguments": {"code": "print(6 * 7)"},
       "error": None},
      {"name": "python", "arguments": {"code": "1 / 0"}, "error": None},
      {"name": "python", "arguments": {
          "code": "import socket\nsocket.create_connection(('127.0.0.1', 9))"},
       "error": None}]}
  replies = environments.run_tool_calls(message, [python_tool.python])
  assert replies[0] == {"role": "tool", "name": "python", "content": "42"}
  assert replies[1]["content"] == ("error: ZeroDivisionError: division by "
                                   "zero")
  # No network, whichever protection this machine gives.
  assert replies[2]["content"].startswith("error: ")
  assert code_execution.network_protection() in ("bubblewrap", "namespace",
                                                  "audit_hook")


def test_qwen3_thinking_stays_in_the_trained_tokens(vocabulary):
  """Qwen 3's template drops an earlier turn's <think> block when it
  renders a conversation after a later user message; the episode keeps
  the model's thinking as it wrote it (what it read in its next turn), and
  the environment's block is the template's own text."""
  import json  # pylint: disable=g-import-not-at-top
  family = json.loads(
      (FIXTURES / "chat_templates" / "qwen3.json").read_text())
  template = chat_templates.ChatTemplate(
      family["template"], special_tokens=family["special_tokens"],
      eos_text="<|im_end|>")
  renderer = episodes.Renderer(template, vocabulary)
  thought = "<think>\nlow first\n</think>\n\n3"
  played, _, _ = play(vocabulary, renderer, agent_envs.make_guess,
                      [{"prompt": "", "answer": 5}], [[thought, "5"]])
  e, = played
  assert e.turns == 2 and e.step_rewards == [0.0, 1.0]
  # The environment read the answer; the thinking came apart.
  assert e.messages[1] == {"role": "assistant", "content": "3",
                           "reasoning_content": "low first"}
  model_ids = [t for t, m in zip(e.tokens, e.is_model) if m]
  eos = vocabulary.eos_id
  assert model_ids == (char_ids(vocabulary, thought) + [eos]
                       + char_ids(vocabulary, "5") + [eos])
  env_ids = [t for t, m in zip(e.tokens, e.is_model) if not m]
  assert vocabulary.tokenizer.decode(env_ids, skip_special_tokens=False) == (
      "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")
  # The template's rendering of the finished conversation has lost the
  # thinking the model read: the trained tokens are not it.
  rendered = template.render(e.messages[:3], add_generation_prompt=True)
  assert "low first" not in rendered
  assert "low first" in vocabulary.tokenizer.decode(
      e.opening + e.tokens, skip_special_tokens=False)


@pytest.mark.parametrize("overrides,message", [
    ({"online__environment": "agent_envs:make_guess",
      "online__tools": "agent_envs:multiply"},
     r"^config.online.tools: set with online.environment"),
    ({"online__tool_call_style": "regex"},
     r"^config.online.tool_call_pattern: tool_call_style 'regex'"),
    # Partial rollouts: episodes played ahead, on the continuous engine.
    ({"online__tools": "agent_envs:multiply",
      "online__partial_rollouts": True},
     r"^config.online.partial_rollouts: True needs episodes"),
    ({"online__tools": "agent_envs:multiply", "online__off_policy_steps": 1,
      "online__engine": "lockstep", "online__partial_rollouts": True},
     r"^config.online.partial_rollouts: True needs episodes"),
])
def test_episode_settings_are_refused_in_one_line(overrides, message):
  from conftest import tiny_config  # pylint: disable=g-import-not-at-top
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = tiny_config(algorithm="grpo", rewards__reward_model__weight=0.0,
                       rewards__gold_reward__weight=1.0, **overrides)
  with pytest.raises(ValueError, match=message):
    defaults.validate(config)


def test_environments_and_tools_that_cannot_load_name_their_field():
  with pytest.raises(ValueError, match=r"^online.environment: cannot import "
                     r"module 'no_such_envs'"):
    environments.environment_factory("no_such_envs:make", "")
  with pytest.raises(ValueError, match=r"^online.tools: "):
    environments.environment_factory("", "agent_envs:no_such_tool")
