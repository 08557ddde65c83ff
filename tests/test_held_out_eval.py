"""Held-out accuracy of an online run, scored by its own rewards: the
unbiased pass@k estimator against enumeration over subsets and hand
computation; the metrics of hand-made reward arrays; a tiny GRPO run on a
GSM8K-layout file pair (train, test) reporting eval/pass@1 and
eval/pass@k, with pass@1 recomputed here from the policy's greedy
completions of the test questions; the same numbers from eval.only on the
run's checkpoint; and when the evaluation switches itself on.

Truths used: C(n-c, k) / C(n, k) is the share of k-subsets of n samples
that miss all c passing ones (counted here by itertools); the run's
checkpoint sampled greedily through `api.Run.sample` and scored by the
math verifier and the test's own reward function.
"""

import itertools
import json
import math

import jax
import numpy as np
import pytest
import seqio

from conftest import tiny_config
from jaxrlhf import algorithms
from jaxrlhf import api
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.data import tasks
from jaxrlhf.eval import pass_at_k
from jaxrlhf.rewards import math_answer
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

import reward_functions


# --- the estimator -------------------------------------------------------------------


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass():
  for n in range(1, 7):
    for c in range(n + 1):
      for k in range(1, n + 1):
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k.pass_at_k(n, c, k) == pytest.approx(expected,
                                                             abs=1e-12)
  # By hand: 5 samples, 2 right, pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
  assert pass_at_k.pass_at_k(5, 2, 2) == pytest.approx(0.7)
  # pass@1 is the share that passes; with k = n, whether any passes.
  np.testing.assert_allclose(pass_at_k.pass_at_k(4, np.array([0, 1, 3]), 1),
                             [0.0, 0.25, 0.75])
  np.testing.assert_allclose(pass_at_k.pass_at_k(4, np.array([0, 1, 4]), 4),
                             [0.0, 1.0, 1.0])
  # Large n: no overflowing binomials (C(200, 100) ~ 9e58).
  assert pass_at_k.pass_at_k(200, 3, 100) == pytest.approx(
      1 - math.comb(197, 100) / math.comb(200, 100))
  with pytest.raises(ValueError, match="1 <= k <= n"):
    pass_at_k.pass_at_k(4, 1, 5)


def test_the_k_values_are_read_and_refused_in_one_line():
  assert pass_at_k.parse_ks("", 4) == (4,)
  assert pass_at_k.parse_ks("", 0) == ()
  assert pass_at_k.parse_ks("8, 2", 8) == (2, 8)
  with pytest.raises(ValueError, match=r"^config.eval.pass_k: pass@1 needs "
                     r"2 <= k <= config.eval.samples_per_prompt \(4\): "
                     r"pass@1 is the greedy"):
    pass_at_k.parse_ks("1,4", 4)
  with pytest.raises(ValueError, match=r"^config.eval.pass_k: pass@8 needs"):
    defaults.validate(tiny_config(eval__pass_k="8",
                                  eval__samples_per_prompt=4))
  with pytest.raises(ValueError, match="not a comma-separated list"):
    pass_at_k.parse_ks("two", 4)
  # eval.only evaluates one run, not a pipeline of them.
  with pytest.raises(ValueError, match=r"^config.eval.only: evaluates one "
                     r"run's policy"):
    defaults.validate(tiny_config(eval__only=True, pipeline__stages="sft"))


def test_metrics_of_hand_made_rewards():
  """Two rewards, math (weight 1) and format (weight 0.1), threshold 1:
  a right answer passes, a marked wrong one does not; NaN (the reward does
  not apply) counts 0 in the sum and is left out of its reward's mean."""
  nan = np.nan
  greedy = np.array([[1.0, 1.0], [0.0, 1.0], [nan, 0.0]])
  sampled = np.array([  # [3 prompts, 3 samples, 2 rewards]
      [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]],
      [[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]],
      [[nan, 0.0], [nan, 1.0], [nan, 0.0]]])
  metrics = pass_at_k.reward_metrics(greedy, sampled, ["math", "format"],
                                     [1.0, 0.1], 1.0, (2, 3))
  expected = {
      "eval/pass@1": 1 / 3,
      "eval/reward": (1.1 + 0.1 + 0.0) / 3,
      "eval/reward/math": 1 / 2,
      "eval/reward/format": 2 / 3,
      "eval/mean@3": (1.1 + 1.0 + 0.0 + 0.1 + 0.1 + 1.1 + 0 + 0.1 + 0) / 9,
      "eval/reward/math_mean@3": 3 / 6,
      "eval/reward/format_mean@3": 5 / 9,
      # Passing samples per prompt: 2, 1, 0 of 3.
      "eval/pass@2": ((1 - 0 / 3) + (1 - 1 / 3) + 0) / 3,
      "eval/pass@3": 2 / 3,
  }
  assert sorted(metrics) == sorted(expected)
  for name, value in expected.items():
    assert metrics[name] == pytest.approx(value), name
  # No samples: the greedy numbers alone.
  alone = pass_at_k.reward_metrics(greedy, np.zeros((3, 0, 2)),
                                   ["math", "format"], [1.0, 0.1], 1.0, ())
  assert sorted(alone) == ["eval/pass@1", "eval/reward",
                           "eval/reward/format", "eval/reward/math"]


# --- a tiny GRPO run on GSM8K-layout files -------------------------------------------

TASK = "gsm8k_held_out"
WORDS = ("red", "blue", "green", "gold", "cat", "dog", "fox", "owl")


def _rows(count, offset):
  return [{"question": f"{WORDS[(i + offset) % 8]} {' '.join(WORDS[:i % 5])}"
                       f" count",
           "answer": f"{WORDS[i % 8]} has {i}\n#### {i + offset}"}
          for i in range(count)]


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _config(tmp_path, **overrides):
  config = tiny_config(**{
      "algorithm": "grpo", "data__task": TASK, "data__inputs_length": 16,
      "data__targets_length": 6, "rewards__reward_model__weight": 0.0,
      "rewards__math_answer__weight": 1.0,
      "rewards__functions": "reward_functions:same_word_count_parity",
      "online__samples_per_prompt": 2, "train__batch_size": 4,
      "train__num_steps": 1, "optimizer__warmup_steps": 0,
      "eval__num_examples": 6, "eval__batch_size": 8,
      "eval__samples_per_prompt": 4, "eval__pass_k": "2,4",
      "eval__split": "test", **overrides})
  config.data.files.train = _write(tmp_path / "train.jsonl", _rows(8, 0))
  config.data.files.test = _write(tmp_path / "test.jsonl", _rows(6, 3))
  config.data.files.layout = "gsm8k"
  return config


def _random_policy(workdir):
  """A workdir holding a random tiny "SFT" policy of the synthetic
  vocabulary (the file task's)."""
  config = tiny_config(algorithm="sft", data__task="synthetic_summarize")
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    state = algorithms.build(config, mesh, evaluate=False).init_state()
  loop.prepare_workdir(str(workdir), config)
  checkpointer = checkpointing.Checkpointer(str(workdir / "checkpoints"),
                                            keep=1)
  checkpointer.save(1, state, 0)
  checkpointer.close()
  return str(workdir)


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("gsm8k_held_out")
  config = _config(root,
                   init__policy_checkpoint=_random_policy(root / "sft"))
  workdir = root / "run"
  summary = loop.train(config, str(workdir), devices=jax.devices()[:1])
  yield config, workdir, summary
  seqio.TaskRegistry.remove(TASK)


def test_a_grpo_run_on_gsm8k_files_reports_held_out_pass_at_k(gsm8k_run):
  config, workdir, summary = gsm8k_run
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  evaluated = [r for r in rows if "eval/pass@1" in r]
  # Before training (step 0) and after (step 1).
  assert [r["step"] for r in evaluated] == [0, 1]
  names = ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4",
           "eval/reward", "eval/reward/math_answer",
           "eval/reward/same_word_count_parity")
  for row in evaluated:
    for name in names:
      assert 0.0 <= row[name] <= 1.0 + 0.0, name
    # More chances never pass less often.
    assert row["eval/pass@2"] <= row["eval/pass@4"]
  after = evaluated[-1]
  for name in names:
    assert summary[name] == after[name]

  # pass@1 recomputed from the checkpoint's greedy completions of the
  # test questions, scored by the verifier and the function, weight 1 each.
  with jax.default_device(jax.devices()[0]):
    run = api.Run(config, devices=jax.devices()[:1], evaluate=False)
    state, step = run.restore(str(workdir))
  assert step == 1
  questions = [r["question"] for r in _rows(6, 3)]
  answers = [r["answer"].split("#### ")[1] for r in _rows(6, 3)]
  completions = run.sample(state, questions, greedy=True)
  verified = math_answer.make_math_answer_reward()(
      questions, completions, answer=answers)
  parity = reward_functions.same_word_count_parity(questions, completions)
  passed = [m + f >= 1.0 for m, f in zip(verified, parity)]
  assert after["eval/pass@1"] == pytest.approx(np.mean(passed))
  assert after["eval/reward/math_answer"] == pytest.approx(np.mean(verified))
  assert after["eval/reward/same_word_count_parity"] == pytest.approx(
      np.mean(parity))
  # Not all alike (the test would hold for a constant score too).
  assert 0 < after["eval/pass@1"] < 1


def test_eval_only_scores_the_checkpoint_without_training(gsm8k_run,
                                                          tmp_path):
  config, workdir, summary = gsm8k_run
  before = (workdir / "metrics.jsonl").read_text().splitlines()
  checkpoints = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  only = config.copy_and_resolve_references()
  only.eval.only = True
  again = loop.train(only, str(workdir), devices=jax.devices()[:1])
  # The same policy, prompts and sampling key: the same numbers, logged
  # once more at the checkpoint's step; nothing trained or saved.
  for name in ("eval/pass@1", "eval/pass@4", "eval/mean@4"):
    assert again[name] == pytest.approx(summary[name])
  after = (workdir / "metrics.jsonl").read_text().splitlines()
  assert after[:len(before)] == before and len(after) == len(before) + 1
  assert json.loads(after[-1])["step"] == 1
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == (
      checkpoints)
  # A fresh workdir: the policy the run starts from (init.policy_checkpoint:
  # here the trained run's workdir), at step 0.
  fresh = only.copy_and_resolve_references()
  fresh.init.policy_checkpoint = str(workdir)
  started = loop.train(fresh, str(tmp_path / "eval"),
                       devices=jax.devices()[:1])
  assert started["eval/pass@1"] == pytest.approx(summary["eval/pass@1"])
  assert not (tmp_path / "eval" / "checkpoints").exists() or not list(
      (tmp_path / "eval" / "checkpoints").iterdir())


def test_the_evaluation_switches_itself_on_only_where_nothing_else_judges():
  # A synthetic task has a gold reward, which judges the policy (the
  # quickstart's evaluation): 'auto' leaves it alone, 'on' adds the rewards.
  config = tiny_config(algorithm="grpo", data__task="synthetic_arithmetic",
                       rewards__math_answer__weight=1.0)
  assert tasks.gold_reward_for("synthetic_arithmetic") is not None
  assert not policy_eval.scores_with_rewards(config)
  config.eval.with_rewards = "on"
  assert policy_eval.scores_with_rewards(config)
  # Without host rewards (a reward model alone) or online training: never.
  for overrides in ({"algorithm": "grpo"}, {"algorithm": "dpo"}):
    config = tiny_config(data__task="synthetic_arithmetic",
                         eval__with_rewards="on", **overrides)
    assert not policy_eval.scores_with_rewards(config)
