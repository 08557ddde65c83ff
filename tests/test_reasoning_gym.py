"""reasoning-gym as a task source: the prompts file, the reward, the
environment (jaxrlhf/rewards/reasoning_gym_tasks.py)."""

import json
import subprocess
import sys

import pytest
# In the test extras (setup.cfg): installed wherever the suite runs.
import reasoning_gym

from jaxrlhf.agents import episodes
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import chat_templates
from jaxrlhf.data import file_sources
from jaxrlhf.data import hf_tokenizer
from jaxrlhf.rewards import reasoning_gym_tasks as rgt

from test_agent_episodes import FIXTURES, limits, play

DATASET = "leg_counting"


def _reference(size=4, seed=0):
  return reasoning_gym.create_dataset(DATASET, size=size, seed=seed)


def _wrong(truth: str) -> str:
  return str(int(truth) + 1)


def test_written_rows_are_the_datasets_entries(tmp_path):
  out = tmp_path / "rg.jsonl"
  rgt.main([f"--dataset={DATASET}", "--size=4", "--seed=0", f"--out={out}",
            "--max_attempts=2"])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  reference = _reference()
  assert len(rows) == 4
  for row, entry in zip(rows, reference):
    assert row["prompt"].startswith(entry["question"].rstrip())
    assert row["prompt"].endswith(rgt.INSTRUCTION)
    assert row["answer"] == entry["answer"]
    task = json.loads(row[rgt.ENTRY_COLUMN])
    assert task["dataset"] == DATASET and task["max_attempts"] == 2
    assert task["entry"] == json.loads(json.dumps(entry))


def test_seed_and_config_reach_the_dataset():
  a = rgt.rows(DATASET, 3, seed=1, config_json='{"max_animals": 3}')
  b = _reference(size=3, seed=1)
  assert [r["answer"] for r in a] != [e["answer"] for e in b]
  for r in a:
    assert len(json.loads(r[rgt.ENTRY_COLUMN])["entry"]["metadata"][
        "animals"]) == 3


def test_reward_agrees_with_the_datasets_own_scorer():
  reference = _reference()
  rows = rgt.rows(DATASET, 4, seed=0)
  entries = [r[rgt.ENTRY_COLUMN] for r in rows]
  right = [f"Counting... <answer> {e['answer']} </answer>" for e in reference]
  wrong = [f"<answer>{_wrong(e['answer'])}</answer>" for e in reference]
  untagged = [e["answer"] for e in reference]
  for completions, answers in ((right, [e["answer"] for e in reference]),
                               (wrong, [_wrong(e["answer"])
                                        for e in reference]),
                               (untagged, [None] * 4)):
    got = rgt.score([""] * 4, completions, rg_entry=entries, answer=["x"] * 4)
    assert got == [reference.score_answer(a, e)
                   for a, e in zip(answers, reference)]
  assert rgt.score([""] * 4, right, rg_entry=entries) == [1.0] * 4
  assert rgt.score([""] * 4, wrong, rg_entry=entries) == [0.0] * 4


def test_reward_skips_rows_without_an_entry():
  rows = rgt.rows(DATASET, 1, seed=0)
  got = rgt.score(["", ""], ["<answer>1</answer>"] * 2,
                  rg_entry=[None, rows[0][rgt.ENTRY_COLUMN]])
  assert got[0] is None and got[1] in (0.0, 1.0)
  assert rgt.score([""], ["x"]) == [None]


def test_last_answer_tag_counts():
  assert rgt.extract_answer("<answer>1</answer> no, <answer>\n2 </answer>"
                            ) == "2"
  assert rgt.extract_answer("2") is None


def test_environment_retries_until_right():
  row = rgt.rows(DATASET, 1, seed=0, max_attempts=3)[0]
  truth = row["answer"]
  env = rgt.make_env(row)
  assert env.reset() == [{"role": "user", "content": row["prompt"]}]
  messages, reward, done = env.step({"role": "assistant",
                                     "content": "no tags"})
  assert (reward, done) == (0.0, False)
  assert rgt.INSTRUCTION in messages[0]["content"]
  messages, reward, done = env.step(
      {"role": "assistant", "content": f"<answer>{_wrong(truth)}</answer>"})
  assert (reward, done) == (0.0, False) and messages[0]["role"] == "user"
  messages, reward, done = env.step(
      {"role": "assistant", "content": f"<answer>{truth}</answer>"})
  assert (messages, reward, done) == ([], 1.0, True)


def test_environment_ends_at_its_last_attempt_with_that_score():
  entry = _reference(size=1)[0]
  row = rgt.rows(DATASET, 1, seed=0, max_attempts=2)[0]
  env = rgt.make_env(row)
  env.reset()
  wrong = {"role": "assistant",
           "content": f"<answer>{_wrong(entry['answer'])}</answer>"}
  assert env.step(wrong)[2] is False
  messages, reward, done = env.step(wrong)
  assert done and messages == []
  assert reward == _reference(size=1).score_answer(_wrong(entry["answer"]),
                                                  entry)


def test_environment_needs_the_entry_column():
  with pytest.raises(ValueError, match="rg_entry"):
    rgt.make_env({"prompt": "p"})


def test_unknown_dataset_is_one_line():
  with pytest.raises(ValueError, match="no dataset 'no_such_task'"):
    rgt.rows("no_such_task", 1, seed=0)


def test_without_reasoning_gym_the_error_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)
  with pytest.raises(ImportError, match="pip install reasoning-gym"):
    rgt.rows(DATASET, 1, seed=0)


def test_module_does_not_import_reasoning_gym():
  code = ("import sys; import jaxrlhf.rewards.reasoning_gym_tasks; "
          "assert 'reasoning_gym' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_episode_loop_plays_the_environment():
  """The real episode loop (tests/test_agent_episodes.py's scripted policy
  and tiny Qwen template): wrong, then right; the return is the right
  answer's score, discounted once."""
  vocabulary = hf_tokenizer.HFTokenizerVocabulary(
      str(FIXTURES / "tokenizers" / "chat_qwen" / "tokenizer.json"))
  renderer = episodes.Renderer(chat_templates.for_vocabulary(vocabulary),
                               vocabulary)
  row = rgt.rows(DATASET, 1, seed=0)[0]
  truth = row["answer"]
  played, _, _ = play(vocabulary, renderer, rgt.make_env, [row],
                      [[f"<answer>{_wrong(truth)}</answer>",
                        f"<answer>{truth}</answer>"]],
                      max_episode_tokens=2000)
  e, = played
  assert e.failure is None and e.done and e.turns == 2
  assert e.step_rewards == [0.0, 1.0]
  assert e.episode_return(limits(turn_discount=0.5)) == pytest.approx(0.5)


def test_the_file_reads_as_prompts_with_the_entry_column(tmp_path):
  """The written file through the "columns" layout of online runs'
  prompts: each prompt carries its entry, and the reward scores it."""
  out = tmp_path / "rg.jsonl"
  rgt.main([f"--dataset={DATASET}", "--size=3", "--seed=0", f"--out={out}"])
  source = file_sources.AlignmentFileSource(
      [str(out)], kind=alignment_kinds.PROMPTS,
      column_mapping={"prompt": "prompt", "answer": "answer",
                      rgt.ENTRY_COLUMN: rgt.ENTRY_COLUMN})
  examples = source.examples()
  reference = _reference(size=3)
  assert [e["answer"] for e in examples] == [e["answer"] for e in reference]
  completions = [f"<answer>{e['answer']}</answer>" for e in reference]
  assert rgt.score([e["prompt"] for e in examples], completions,
                   **{rgt.ENTRY_COLUMN: [e[rgt.ENTRY_COLUMN]
                                         for e in examples]}) == [1.0] * 3
