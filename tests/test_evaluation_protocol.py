"""The papers' evaluation: judges of side-by-side comparisons, win rates over
folds of prompts (DRO paper: 5 folds of 1,000 test prompts), held-out
prompts taken out of the training files, the best checkpoint kept besides
the latest, and accuracy on held-out pairs by annotation batch and
confidence (PPO details 16 and 19).

Truths: numbers computed by hand in numpy from the outcomes, log-probs taken
from the model's logits directly, and the checkpoints a run saved at every
step.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from conftest import evaluated_by, from_scratch, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.checkpoint_files import restore_state_as_numpy
from jaxrlhf.data import file_sources
from jaxrlhf.data import file_tasks
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import synthetic
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab as vocab_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import judges
from jaxrlhf.eval import pair_metrics
from jaxrlhf.models import sampling
from jaxrlhf.train import loop


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


# --- win rates over folds -------------------------------------------------------


def test_fold_statistics_by_hand():
  # Two draws of 6 prompts in 3 folds: prompts {0,1}, {2,3}, {4,5}.
  outcomes = np.array([[1, 1, 0, 0.5, 1, 0], [1, 0, 0, 0, 1, 1]], float)
  rates = [3 / 4, 0.5 / 4, 3 / 4]
  std = np.sqrt(sum((r - np.mean(rates)) ** 2 for r in rates) / 2)
  got = evaluation.fold_statistics(outcomes, 3)
  assert got["eval/win_rate_fold_std"] == pytest.approx(std)
  assert got["eval/win_rate_fold_stderr"] == pytest.approx(std / np.sqrt(3))


# --- judges ---------------------------------------------------------------------


class _Trainer:
  """What a judge reads of a trainer: the vocabulary."""
  vocabulary = tasks.synthetic_vocabulary()


def _samples(texts):
  vocab = _Trainer.vocabulary
  ids = [vocab.encode(t) + [vocab.eos_id] for t in texts]
  tokens = np.zeros((len(ids), 8), np.int32)
  for i, row in enumerate(ids):
    tokens[i, :len(row)] = row
  return sampling.Samples(tokens=tokens, logprobs=np.zeros(tokens.shape),
                          mask=(tokens != 0).astype(np.float32),
                          has_eos=np.ones(len(ids), bool))


_CALLS = []


def prefers_first(prompts, first, second):
  _CALLS.append((list(prompts), list(first), list(second)))
  return [1.0] * len(prompts)


def prefers_longer(prompts, first, second):
  return [float(len(a) > len(b)) + 0.5 * (len(a) == len(b))
          for a, b in zip(first, second)]


def wrong_length(prompts, first, second):
  return [0.5]


def test_function_judge_alternates_positions():
  mine, theirs = (_samples(["red blue", "red", "red blue", "red"]),
                  _samples(["red", "red blue", "red", "red blue"]))
  prompts = ["p0", "p1", "p2", "p3"]
  _CALLS.clear()
  outcome, values = judges.Function(f"{__name__}:prefers_first")(
      _Trainer(), None, prompts, mine, theirs)
  # A judge that always picks the first position favours neither side.
  assert outcome.tolist() == [1.0, 0.0, 1.0, 0.0] and values == {}
  [(seen, first, second)] = _CALLS
  assert seen == prompts
  assert first == ["red blue", "red blue", "red blue", "red blue"]
  assert second == ["red", "red", "red", "red"]
  outcome, _ = judges.Function(f"{__name__}.prefers_longer")(
      _Trainer(), None, prompts, mine, theirs)
  assert outcome.tolist() == [1.0, 0.0, 1.0, 0.0]
  with pytest.raises(ValueError, match="one probability in .0, 1. per "
                     "prompt .4."):
    judges.Function(f"{__name__}:wrong_length")(_Trainer(), None, prompts,
                                                 mine, theirs)


def test_judge_functions_are_imported_by_path_or_named_errors():
  assert judges.import_judge(f"{__name__}:prefers_first") is prefers_first
  assert judges.import_judge(f"{__name__}.prefers_first") is prefers_first
  for path, message in (("no_such_module_xyz:f", "cannot import"),
                        (f"{__name__}:missing", "cannot import"),
                        ("judge", "not an import path")):
    with pytest.raises(ValueError, match=f"config.eval.judge_function: "
                       f".*{message}"):
      judges.import_judge(path)


def test_a_reward_model_judges_only_completions_that_end():
  scores, ref = np.array([1.0, 1.0, -5.0, 2.0, 0.0]), np.array(
      [0.5, 1.0, 3.0, 9.0, 7.0])
  ended = np.array([True, True, True, False, False])
  ref_ended = np.array([True, True, False, True, False])
  assert judges.score_outcomes(scores, ref, ended, ref_ended).tolist() == [
      1.0, 0.5, 1.0, 0.0, 0.5]


@pytest.mark.parametrize("judge,path,message", [
    ("reward_model", "", "config.eval.judge_checkpoint: eval.judge is "
     "'reward_model'; set it"),
    ("reward_model", "other_vocabulary", "config.eval.judge_checkpoint: the "
     "reward model .* was trained with vocabulary"),
    ("function", "", "config.eval.judge_function: eval.judge is 'function'"),
    ("function", "no_such_module_xyz:f", "config.eval.judge_function: cannot "
     "import"),
])
def test_a_judge_that_cannot_work_is_refused_at_start_up(tmp_path, judge,
                                                         path, message):
  if path == "other_vocabulary":  # a reward model run's config.json
    other = vocab_lib.word_vocabulary(["alpha", "beta"])
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps(
        {"data": {"files": {"vocabulary": other.sentencepiece_model_file}}}))
    path = str(tmp_path / "rm")
  config = tiny_config(algorithm="dpo", eval__judge=judge)
  config.eval["judge_checkpoint" if judge == "reward_model"
              else "judge_function"] = path
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    with pytest.raises(ValueError, match=message):
      trainer_of(from_scratch(algorithms.get("dpo")), config, mesh)


# --- held-out prompts -------------------------------------------------------------


def _trajectories(n_prompts, per_prompt=3):
  return [{"prompt": f"summarize: red blue {i}", "completion": f"red {j}",
           "reward": float(j)}
          for i in range(n_prompts) for j in range(per_prompt)]


def test_held_out_prompts_take_every_row_of_a_prompt(tmp_path):
  rows = _trajectories(10)
  def split_prompts(path):
    source = file_tasks.HeldOutPrompts(
        file_sources.AlignmentFileSource(path, kind="trajectory"),
        {"validation": 2, "test": 3}, seed=0)
    out = {}
    for split in ("train", "validation", "test"):
      ds = source.get_dataset(split, shuffle=False)
      out[split] = [ex["prompt"].decode() for ex in ds.as_numpy_iterator()]
      assert source.num_input_examples(split) == len(out[split])
    return source, out
  source, out = split_prompts(write_jsonl(tmp_path / "a.jsonl", rows))
  assert source.splits == ("train", "test", "validation")
  counts = {s: len(set(p)) for s, p in out.items()}
  assert counts == {"train": 5, "validation": 2, "test": 3}
  assert {s: len(p) for s, p in out.items()} == {
      "train": 15, "validation": 6, "test": 9}
  assert not (set(out["train"]) & set(out["validation"])
              or set(out["train"]) & set(out["test"])
              or set(out["validation"]) & set(out["test"]))
  # The choice depends on the prompts, not on the file's order.
  _, reordered = split_prompts(write_jsonl(tmp_path / "b.jsonl", rows[::-1]))
  assert {s: set(p) for s, p in reordered.items()} == {
      s: set(p) for s, p in out.items()}
  # Sharded reading gives each row to exactly one shard.
  shards = [[ex["completion"].decode() + ex["prompt"].decode()
             for ex in source.get_dataset(
                 "train", shuffle=False,
                 shard_info=seqio.ShardInfo(k, 2)).as_numpy_iterator()]
            for k in range(2)]
  assert sorted(shards[0] + shards[1]) == sorted(
      c + p for c, p in zip(
          [ex["completion"].decode() for ex in source.get_dataset(
              "train", shuffle=False).as_numpy_iterator()], out["train"]))
  too_many = file_tasks.HeldOutPrompts(source.inner, {"validation": 10},
                                       seed=0)
  with pytest.raises(ValueError, match="would leave none to train on"):
    too_many.num_input_examples("train")


def test_evaluation_reads_distinct_prompts_of_a_task_of_trajectories(
    tmp_path):
  config = tiny_config(algorithm="dro_v", data__task="distinct_prompts")
  config.data.files.train = write_jsonl(tmp_path / "t.jsonl",
                                        _trajectories(6))
  config.data.files.holdout_validation_prompts = 3
  file_tasks.register_task_from_files(config, "trajectory")
  tokens, texts = prompts_lib.held_out_prompts("distinct_prompts",
                                               "validation", 16, 2)
  vocab = tasks.synthetic_vocabulary()
  assert len(texts) == 2 == len(set(texts))
  for row, text in zip(tokens, texts):
    ids = vocab.encode(text) + [vocab.eos_id]
    assert row.tolist() == ids + [0] * (16 - len(ids))
  everything = set(r["prompt"] for r in _trajectories(6))
  _, all_three = prompts_lib.held_out_prompts("distinct_prompts",
                                              "validation", 16, 100)
  assert len(all_three) == 3 and set(all_three) <= everything


# --- accuracy on held-out pairs -----------------------------------------------------


def test_grouped_accuracy_by_hand():
  correct = np.array([1, 0, 0.5, 1, 1, 0])
  features = {"annotation_batch": np.array([6, 6, 7, 7, 7, -1.0]),
              "confidence": np.array([1, 1, 1, 2, 2, 2]) / 9}
  got = pair_metrics.grouped_accuracy(correct, features, "eval/accuracy",
                                      scale=9.0)
  assert got == {"eval/accuracy_batch6": 0.5,
                 "eval/accuracy_batch7": pytest.approx(2.5 / 3),
                 "eval/accuracy_confidence1": pytest.approx(0.5),
                 "eval/accuracy_confidence2": pytest.approx(2 / 3)}
  # One confidence and no known batch: nothing to break down.
  assert pair_metrics.grouped_accuracy(
      correct, {"annotation_batch": -np.ones(6), "confidence": np.ones(6)},
      "eval/accuracy") == {}


def test_implicit_reward_accuracy_on_held_out_pairs(tmp_path):
  examples = synthetic.make_examples("train", 8)
  rows = [{"prompt": e["inputs"], "chosen": e["ideal"],
           "rejected": e["targets"] + " owl", "confidence": (1 + i % 2) / 2}
          for i, e in enumerate(examples)]
  config = tiny_config(algorithm="dpo", data__task="implicit_pairs",
                       eval__num_examples=8, eval__batch_size=8,
                       eval__task="synthetic_summarize")
  config.data.files.train = write_jsonl(tmp_path / "train.jsonl", rows)
  config.data.files.validation = write_jsonl(tmp_path / "val.jsonl", rows)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("dpo")), config, mesh)
    policy = nn.unbox(trainer.init_lm(jax.random.PRNGKey(1)))
    ref = nn.unbox(trainer.init_lm(jax.random.PRNGKey(2)))
    same = policy_eval.implicit_reward_metrics(trainer, ref, ref)
    got = policy_eval.implicit_reward_metrics(trainer, policy, ref)
    features = policy_eval.eval_split_features(trainer)

    def logprob(params, name):
      logits = trainer.model.apply(
          {"params": params}, jnp.asarray(features["encoder_input_tokens"]),
          jnp.asarray(features[f"{name}_decoder_input_tokens"]),
          jnp.asarray(features[f"{name}_decoder_target_tokens"]))
      lp = jax.nn.log_softmax(logits.astype(jnp.float32))
      targets = features[f"{name}_decoder_target_tokens"]
      picked = np.take_along_axis(np.asarray(lp), targets[..., None], -1)
      return (picked[..., 0] * features[f"{name}_decoder_loss_weights"]).sum(-1)

    chosen = logprob(policy, "chosen") - logprob(ref, "chosen")
    rejected = logprob(policy, "rejected") - logprob(ref, "rejected")
  # The policy is its reference: every implicit reward is 0, a tie.
  assert same["eval/implicit_reward_accuracy"] == 0.5
  assert same["eval/implicit_reward_margin"] == 0.0
  wins = (chosen > rejected) + 0.5 * (chosen == rejected)
  assert got["eval/implicit_reward_accuracy"] == pytest.approx(wins.mean())
  assert got["eval/implicit_reward_margin"] == pytest.approx(
      (chosen - rejected).mean(), abs=1e-4)
  for level, where in (("0.5", slice(0, None, 2)), ("1", slice(1, None, 2))):
    assert got[f"eval/implicit_reward_accuracy_confidence{level}"] == (
        pytest.approx(wins[where].mean()))
  assert 0 < got["eval/implicit_reward_accuracy"] < 1  # not all ties


# --- the best checkpoint ------------------------------------------------------------


def test_the_best_checkpoint_is_kept_and_judged_on_the_test_split(
    tmp_path, monkeypatch):
  """A scripted eval/win_rate peaks at step 2 of 4: <workdir>/best holds
  step 2's policy (the run's own checkpoint of step 2, bit for bit), and
  the test split judges that policy, not the last one."""
  script = {1: 0.5, 2: 0.8, 3: 0.6, 4: 0.7}
  seen = []

  def scripted(trainer, state):
    step = int(jax.device_get(state.step))
    seen.append(step)
    return {"eval/win_rate": script.get(step, 0.0)}

  algorithm = evaluated_by(from_scratch(algorithms.get("dpo")), scripted)
  examples = synthetic.make_examples("train", 16)
  rows = [{"prompt": e["inputs"], "chosen": e["ideal"],
           "rejected": e["targets"] + " owl"} for e in examples]
  config = tiny_config(
      algorithm="dpo", data__task="best_pairs", train__num_steps=4,
      train__batch_size=4, eval__every_steps=1, checkpoint__every_steps=1,
      checkpoint__keep=10, checkpoint__best_metric="eval/win_rate",
      eval__task="synthetic_summarize", eval__test_split="test",
      eval__num_examples=4, eval__batch_size=4)
  config.data.files.train = write_jsonl(tmp_path / "p.jsonl", rows)
  workdir = tmp_path / "run"
  monkeypatch.setitem(algorithms.REGISTRY, "dpo", algorithm)
  summary = loop.train(config, str(workdir))
  assert seen == [0, 1, 2, 3, 4]
  best = json.load(open(workdir / "best" / "best.json"))
  assert (best["step"], best["metric"], best["value"]) == (
      2, "eval/win_rate", 0.8)
  saved = restore_state_as_numpy(workdir / "best" / "checkpoints" / "2" /
                                 "state")
  run = restore_state_as_numpy(workdir / "checkpoints" / "2" / "state")
  for a, b in zip(jax.tree.leaves(saved["params"]),
                  jax.tree.leaves(run["params"])):
    np.testing.assert_array_equal(a, b)
  assert summary["test/step"] == 2.0 == best["test"]["test/step"]
  rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows if "test/win_rate" in r] == [4]
  # The test numbers are those of step 2's policy (judged afresh here), not
  # of the final one.
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(algorithm, config, mesh)
    state = trainer.init_state()

    def judged_at(step):
      params = restore_state_as_numpy(
          workdir / "checkpoints" / str(step) / "state")["params"]
      return policy_eval.against_reference(
          trainer, state.replace(params=jax.tree.map(jnp.asarray, params)),
          split="test")

    at_2, at_4 = judged_at(2), judged_at(4)
  assert summary["test/kl"] == pytest.approx(at_2["eval/kl"], abs=1e-6)
  assert summary["test/win_rate"] == at_2["eval/win_rate"]
  assert at_4["eval/kl"] != pytest.approx(at_2["eval/kl"], abs=1e-6)
  # Resumed for two more steps: later evaluations compete with the saved
  # best (0.8 at step 2), not with each other.
  script.update({5: 0.7, 6: 0.75})
  config.train.num_steps = 6
  summary = loop.train(config, str(workdir))
  assert seen[-2:] == [5, 6]
  assert json.load(open(workdir / "best" / "best.json"))["step"] == 2
  assert summary["test/step"] == 2.0
