"""Teachers and judges: on-policy distillation and GKD
(`jaxrlhf.algorithms.online.distill`, `teacher`), and a generative reward
model as a reward source (`rewards.judge`).

Checked against independent computations: the teacher's log-probs of the
sampled tokens and the student's, from each row run alone and unpadded
through the networks (numpy log-softmax of their logits), give the
per-token advantage -coef * (log pi_student - log pi_teacher); the loss
mode's term is coef x the reverse KL over the whole vocabulary of the same
logits; GKD with lambda 0 trains on the dataset's completions and with
lambda 1 on samples; a teacher of another vocabulary is refused in one
line. Then both algorithms train through `python -m jaxrlhf.main` (a T5
teacher and student of different widths; a Llama teacher deeper and wider
than its Llama student), and the divergence to the teacher falls.

The judge's reward of each row equals the verdict computed by hand: the
row's prompt and response without padding or EOS placed in the template's
tokens (written out from the vocabulary, not parsed by the code under
test), run alone through the judge (a Llama, and a T5 whose inputs end in
EOS), p(yes) / (p(yes) + p(no)) of its next-token logits; GRPO trains on
it through `python -m jaxrlhf.main`.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli_args, quiet_env, tiny_config
from test_online_decoder_only import (EOS, PROMPTS, _init_lm_params, _padded,
                                      _right_padded_outputs, _write_workdir)
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import teacher as teacher_lib
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.models import hf_io
from jaxrlhf.models import sampling

MAX_NEW = 6
LLAMA = {"model__arch": "llama", "model__size": "tiny",
         "model__num_encoder_layers": None}
# The teacher: wider and deeper than the student.
BIGGER = {"model__emb_dim": 64, "model__mlp_dim": 128,
          "model__num_decoder_layers": 2}
RESPONSES = [[3, 4, EOS], [8, 9, 10, 11, 12, 13], [EOS], [6, 7, 8, EOS]]


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
  """Random Llama student and teacher (of another size) run workdirs."""
  root = tmp_path_factory.mktemp("distill")
  student_config = tiny_config(algorithm="sft", **LLAMA)
  teacher_config = tiny_config(algorithm="sft", **LLAMA, **BIGGER)
  student, _ = _init_lm_params(student_config, 1)
  teacher, _ = _init_lm_params(teacher_config, 2)
  _write_workdir(root / "student", student_config, {"policy": student})
  _write_workdir(root / "teacher", teacher_config, {"policy": teacher})
  return {"student": str(root / "student"), "teacher": str(root / "teacher"),
          "root": root}


def _config(pair, algorithm="distill", **overrides):
  return tiny_config(**{
      "algorithm": algorithm, "init__policy_checkpoint": pair["student"],
      "distill__teacher_checkpoint": pair["teacher"],
      "online__max_new_tokens": MAX_NEW, "optimizer__warmup_steps": 0,
      "train__batch_size": 4, "online__temperature": 0.8, **LLAMA,
      **overrides})


def _samples(responses):
  tokens = _padded(responses, MAX_NEW)
  mask = (_padded([[1] * len(r) for r in responses], MAX_NEW)
          ).astype(np.float32)
  return sampling.Samples(tokens=jnp.asarray(tokens),
                          logprobs=jnp.zeros(mask.shape), mask=jnp.asarray(mask),
                          has_eos=jnp.asarray([EOS in r for r in responses]),
                          num_steps=jnp.int32(MAX_NEW))


def _alone(module, params, temperature):
  """Each row's log-softmax over the vocabulary at each response token,
  from the row run alone and unpadded: [rows] of [n, vocab]."""
  prompts = [p[:-1] for p in PROMPTS]  # no EOS before the response
  logits = _right_padded_outputs(module, params,
                                 [p + r for p, r in zip(prompts, RESPONSES)])
  return [_log_softmax(l[len(p) - 1:len(p) - 1 + len(r)] / temperature)
          for p, r, l in zip(prompts, RESPONSES, logits)]


def test_teacher_scores_give_the_per_token_advantage_and_the_loss(llama_pair):
  """Advantage mode: rows' advantages are -coef (log pi_s - log pi_t) on
  each response token; loss mode: the loss is coef x the reverse KL of the
  whole next-token distributions, averaged over response tokens."""
  coef = 0.5
  results = {}
  for mode in ("advantage", "loss"):
    config = _config(llama_pair, distill__coef=coef, distill__mode=mode)
    with sharding.activate(config, jax.devices()[:1]) as mesh:
      trainer = algorithms.build(config, mesh)
      assert trainer.online.teacher.model_config.emb_dim == 64
      state = trainer.init_state()
      prompts = jnp.asarray(_padded(PROMPTS, config.data.inputs_length))
      rollout = jax.jit(lambda s, p: iteration.score(
          trainer, s.params, s.frozen, p, _samples(RESPONSES)))(state, prompts)
      rows, _, metrics = jax.jit(
          lambda s, r: iteration.advantages(trainer, s, r))(state, rollout)
      loss_fn = teacher_lib.with_distill_loss(
          trainer, lambda params, minibatch: (jnp.zeros(()), {}),
          state.frozen)
      loss, loss_metrics = jax.jit(loss_fn)(state.params, rows)
      student = _alone(trainer.model, state.params["policy"],
                       config.online.temperature)
      teacher = _alone(trainer.online.teacher.adapter.module,
                       state.frozen["teacher"], config.online.temperature)
      results[mode] = (rollout, rows, metrics, loss, loss_metrics)

  rollout, rows, metrics, _, _ = results["advantage"]
  mask = np.asarray(rollout.mask)
  want_gap, want_kl, count = np.zeros(mask.shape), 0.0, 0
  for b, r in enumerate(RESPONSES):
    n = len(r)
    np.testing.assert_array_equal(mask[b], [1] * n + [0] * (MAX_NEW - n))
    want_t = [teacher[b][t, r[t]] for t in range(n)]
    np.testing.assert_allclose(np.asarray(rollout.teacher_logprobs)[b, :n],
                               want_t, atol=2e-5)
    want_gap[b, :n] = [student[b][t, r[t]] - teacher[b][t, r[t]]
                       for t in range(n)]
    p = np.exp(student[b])
    want_kl += float(np.sum(p * (student[b] - teacher[b])))
    count += n
  np.testing.assert_allclose(np.asarray(rows["advantages"]),
                             -coef * want_gap, atol=5e-5)
  np.testing.assert_allclose(float(metrics["distill/reverse_kl"]),
                             want_gap.sum() / mask.sum(), atol=2e-5)
  _, _, _, loss, loss_metrics = results["loss"]
  np.testing.assert_allclose(float(loss_metrics["distill/divergence"]),
                             want_kl / count, rtol=1e-4)
  np.testing.assert_allclose(float(loss), coef * want_kl / count, rtol=1e-4)


def test_gkd_lambda_chooses_samples_or_the_dataset_completions(llama_pair):
  """lambda 0: the step's responses are the prompts' own targets; lambda
  1: the student's samples (which are not the targets)."""
  completions = {}
  for lmbda in (0.0, 1.0):
    config = _config(llama_pair, "gkd", gkd__lmbda=lmbda)
    with sharding.activate(config, jax.devices()[:1]) as mesh:
      trainer = algorithms.build(config, mesh)
      state = trainer.init_state()
      batch = next(iter(trainer.algorithm.training.batches(trainer, 0)))
      parts = iteration.step_parts(trainer)
      samples = jax.jit(parts.sample)(state.params, state.frozen,
                                      jax.tree.map(jnp.asarray, batch),
                                      jax.random.PRNGKey(3))
      source = trainer.online.prompt_source.prompts
      targets = [source.completions[i] for i in batch[
          prompts_lib.PROMPT_INDEX]]
      completions[lmbda] = (np.asarray(samples.tokens), targets,
                            np.asarray(samples.mask))
  tokens, targets, mask = completions[0.0]
  for row, target, row_mask in zip(tokens, targets, mask):
    n = min(len(target), MAX_NEW)
    np.testing.assert_array_equal(row[:n], target[:n])
    assert row_mask[:n].all()
  sampled, targets, _ = completions[1.0]
  assert any(not np.array_equal(row[:len(t)], t[:MAX_NEW])
             for row, t in zip(sampled, targets))


def test_gkd_on_the_engines_pool_takes_the_dataset_completions_too(
    llama_pair):
  """With the continuous engine on a pool (online.engine_pages: the
  samples count preemptions), lambda 0's dataset branch is laid out as the
  sampler's: the step's responses are the targets, none preempted."""
  config = _config(llama_pair, "gkd", gkd__lmbda=0.0,
                   online__engine="continuous", online__engine_page_size=4,
                   online__engine_pages=1000)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
    batch = next(iter(trainer.algorithm.training.batches(trainer, 0)))
    samples = jax.jit(iteration.step_parts(trainer).sample)(
        state.params, state.frozen, jax.tree.map(jnp.asarray, batch),
        jax.random.PRNGKey(3))
    source = trainer.online.prompt_source.prompts
    targets = [source.completions[i] for i in batch[
        prompts_lib.PROMPT_INDEX]]
  assert int(samples.preemptions) == 0
  for row, target in zip(np.asarray(samples.tokens), targets):
    n = min(len(target), MAX_NEW)
    np.testing.assert_array_equal(row[:n], target[:n])


def test_a_teacher_of_another_vocabulary_is_refused(llama_pair, tmp_path):
  """A Hugging Face teacher whose vocabulary has another size: one line
  naming the teacher and both sizes."""
  config = tiny_config(algorithm="sft", **LLAMA, model__vocab_size=256)
  params, model_config = _init_lm_params(config, 4)
  hf_io.export_hf_checkpoint(model_config, params, tmp_path / "hf")
  config = _config(llama_pair, distill__teacher_checkpoint=str(tmp_path / "hf"))
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    with pytest.raises(ValueError, match=r"config\.distill\.teacher_checkpoint"
                       r": the teacher .* 256 tokens.*policy's has"):
      algorithms.build(config, mesh)


def _run_main(workdir, **overrides):
  # A field overridden with None keeps the config's own value (None: a
  # decoder-only model has no encoder layers).
  unset = tuple(f"--config.{k.replace('__', '.')}="
                for k, v in overrides.items() if v is None)
  args = [sys.executable, "-m", "jaxrlhf.main",
          "--config=configs/quickstart.py", f"--workdir={workdir}",
          *(a for a in cli_args(**overrides) if not a.startswith(unset))]
  out = subprocess.run(args, cwd=REPO, env=quiet_env(), capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return out.stdout, [json.loads(line) for line in f]


def _falls(metrics, key):
  values = [m[key] for m in metrics if key in m]
  assert len(values) >= 8, (key, values)
  return np.mean(values[-3:]) < np.mean(values[:3])


def test_distill_and_gkd_train_through_main(llama_pair, tmp_path):
  """`python -m jaxrlhf.main`: on-policy distillation of a T5 student from
  a wider T5 teacher, and GKD of a Llama student from a deeper, wider
  Llama teacher; the divergence to the teacher falls in both."""
  root = llama_pair["root"]
  t5_teacher, t5_student = str(root / "t5_teacher"), str(root / "t5_student")
  t5_bigger = {"model__emb_dim": 64, "model__mlp_dim": 128}
  for path, sizes, seed in ((t5_teacher, t5_bigger, 5), (t5_student, {}, 6)):
    config = tiny_config(algorithm="sft", **sizes)
    params, _ = _init_lm_params(config, seed)
    _write_workdir(path, config, {"policy": params})
  stdout, metrics = _run_main(
      tmp_path / "distill", algorithm="distill", train__num_steps=10,
      init__policy_checkpoint=t5_student,
      distill__teacher_checkpoint=t5_teacher, distill__mode="loss",
      online__max_new_tokens=MAX_NEW, online__temperature=1.0,
      eval__num_examples=8, eval__batch_size=8)
  assert "Teacher: " in stdout and "emb_dim 64" in stdout
  assert _falls(metrics, "distill/divergence"), metrics
  _, metrics = _run_main(
      tmp_path / "gkd", algorithm="gkd", train__num_steps=10,
      init__policy_checkpoint=llama_pair["student"],
      distill__teacher_checkpoint=llama_pair["teacher"],
      online__max_new_tokens=MAX_NEW, online__temperature=1.0,
      eval__num_examples=8, eval__batch_size=8, **LLAMA)
  assert _falls(metrics, "distill/divergence"), metrics


# --- the judge ----------------------------------------------------------------

# The synthetic vocabulary's ids: "gold" 7, "moon" 13, "red" 4, "blue" 5.
JUDGE = {"rewards__reward_model__weight": 0, "rewards__judge__weight": 1,
         "rewards__judge__template": "{prompt} gold {response} moon",
         "rewards__judge__choices": "red,blue"}
GOLD, MOON, RED, BLUE = 7, 13, 4, 5


def _t5_first_logits(module, params, inputs):
  """Each row's decoder logits at its first position, the row alone."""
  out = []
  for row in inputs:
    enc = np.asarray([row], np.int32)
    # Decoder input BOS (0); a nonzero target marks the position real.
    logits = module.apply({"params": params}, enc, np.zeros((1, 1), np.int32),
                          np.ones((1, 1), np.int32))
    out.append(np.asarray(logits, np.float64)[0, 0])
  return out


def test_the_judge_reward_is_the_verdict_of_each_row_alone(llama_pair):
  """Llama and T5 judges: reward/judge of each row is p(red) / (p(red) +
  p(blue)) after [prompt, gold, response, moon] (T5: and an EOS)."""
  root = llama_pair["root"]
  t5_config = tiny_config(algorithm="sft")
  t5_params, _ = _init_lm_params(t5_config, 7)
  _write_workdir(root / "t5_judge", t5_config, {"policy": t5_params})
  prompts = [p[:-1] for p in PROMPTS]  # no EOS
  responses = [[t for t in r if t != EOS] for r in RESPONSES]
  rows = [p + [GOLD] + r + [MOON] for p, r in zip(prompts, responses)]
  for judge in (llama_pair["teacher"], str(root / "t5_judge")):
    config = tiny_config(**{
        "algorithm": "reinforce",
        "init__policy_checkpoint": llama_pair["student"],
        "online__max_new_tokens": MAX_NEW, "train__batch_size": 4,
        "online__samples_per_prompt": 1, **LLAMA,
        **JUDGE, "rewards__judge__checkpoint": judge})
    with sharding.activate(config, jax.devices()[:1]) as mesh:
      trainer = algorithms.build(config, mesh)
      state = trainer.init_state()
      padded = jnp.asarray(_padded(PROMPTS, config.data.inputs_length))
      rollout = jax.jit(lambda s, p: iteration.score(
          trainer, s.params, s.frozen, p, _samples(RESPONSES)))(state,
                                                                 padded)
      network = trainer.online.rewards.judge.network
      params = state.frozen["judge"]
      if network.adapter.is_encoder_decoder:
        logits = _t5_first_logits(network.adapter.module, params,
                                  [r + [EOS] for r in rows])
      else:
        logits = [l[-1] for l in _right_padded_outputs(
            network.adapter.module, params, rows)]
    want = [1 / (1 + np.exp(l[BLUE] - l[RED])) for l in logits]
    column = trainer.online.rewards.names.index("judge")
    np.testing.assert_allclose(np.asarray(rollout.rewards)[:, column], want,
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rollout.scores), want, rtol=1e-5)


def _greedy_continuation(module, params, row, steps):
  """The judge's greedy tokens after `row`, one full forward pass per
  token (no cache)."""
  row = list(row)
  for _ in range(steps):
    logits = _right_padded_outputs(module, params, [row])[0][-1]
    row.append(int(np.argmax(logits)))
  return row[-steps:]


def test_the_pairwise_and_score_verdicts_of_each_row_alone(llama_pair):
  """pairwise: the mean over both orders of p(the response's label);
  score: the first number (by a made-up table of number tokens) in the
  judge's greedy continuation, NaN (left out, not counted) without one."""
  references = [[9, 10, EOS], [4, EOS], [11, 12, 13, EOS], [EOS]]
  prompts = [p[:-1] for p in PROMPTS]
  responses = [[t for t in r if t != EOS] for r in RESPONSES]
  refs = [[t for t in r if t != EOS] for r in references]
  # A made-up table of number tokens: ids 3 to 63 are the digit id % 10,
  # but id 20 is "10" (two digits); the others are words.
  values = -np.ones(128, np.int32)
  digits = np.zeros(128, np.int32)
  for token in range(3, 64):
    value = 10 if token == 20 else token % 10
    values[token], digits[token] = value, len(str(value))
  got = {}
  for verdict in ("pairwise", "score"):
    template = ("{prompt} gold {response} moon {reference}"
                if verdict == "pairwise" else JUDGE["rewards__judge__template"])
    config = tiny_config(**{
        "algorithm": "reinforce",
        "init__policy_checkpoint": llama_pair["student"],
        "online__max_new_tokens": MAX_NEW, "train__batch_size": 4,
        "online__samples_per_prompt": 1, **LLAMA, **JUDGE,
        "rewards__judge__template": template,
        "rewards__judge__verdict": verdict,
        "rewards__judge__max_new_tokens": 3,
        "rewards__judge__checkpoint": llama_pair["teacher"]})
    with sharding.activate(config, jax.devices()[:1]) as mesh:
      trainer = algorithms.build(config, mesh)
      rewards = trainer.online.rewards
      if verdict == "score":
        trainer.online.rewards = dataclasses.replace(
            rewards, judge=dataclasses.replace(rewards.judge,
                                               numbers=(values, digits)))
      state = trainer.init_state()
      padded = jnp.asarray(_padded(PROMPTS, config.data.inputs_length))
      rollout = jax.jit(lambda s, p, r: iteration.score(
          trainer, s.params, s.frozen, p, _samples(RESPONSES), r))(
              state, padded, jnp.asarray(_padded(references, MAX_NEW)))
      module = rewards.judge.network.adapter.module
      params = state.frozen["judge"]
      if verdict == "pairwise":
        first = [p + [GOLD] + r + [MOON] + f
                 for p, r, f in zip(prompts, responses, refs)]
        second = [p + [GOLD] + f + [MOON] + r
                  for p, r, f in zip(prompts, responses, refs)]
        p1, p2 = ([1 / (1 + np.exp(l[-1][BLUE] - l[-1][RED])) for l in
                   _right_padded_outputs(module, params, rows)]
                  for rows in (first, second))
        want = [0.5 * (a + 1 - b) for a, b in zip(p1, p2)]
      else:
        want = []
        for p, r in zip(prompts, responses):
          written = _greedy_continuation(module, params,
                                         p + [GOLD] + r + [MOON], 3)
          text, started = "", False
          for token in written:
            if digits[token]:
              text += str(values[token])
              started = True
            elif started:
              break
          want.append(float(text) if text else np.nan)
      got[verdict] = (np.asarray(rollout.rewards)[:, 0], want,
                      trainer.online.rewards.metrics(rollout.rewards))
  np.testing.assert_allclose(got["pairwise"][0], got["pairwise"][1],
                             rtol=1e-5)
  scores, want, metrics = got["score"]
  assert not np.all(np.isnan(want)), want  # the judge wrote numbers
  np.testing.assert_allclose(scores, want, rtol=1e-6)
  assert float(metrics["reward/judge/rows"]) == np.sum(~np.isnan(want))


def test_the_first_written_number():
  from jaxrlhf.rewards import judge  # pylint: disable=g-import-not-at-top
  # Tokens 10..19 are "0".."9", token 20 is "10"; the rest are words.
  names = {i: str(i - 10) for i in range(10, 20)}
  names[20] = "10"
  values, digits = judge.number_tokens(lambda i: names.get(i, "w"), 24)
  rows = jnp.asarray([[3, 11, 12, 2], [3, 4, 5, 6], [11, 20, 14, 3],
                      [11, 3, 12, 13]])
  got = np.asarray(judge.first_number(rows, values, digits))
  np.testing.assert_array_equal(got[[0, 2, 3]], [12.0, 1104.0, 1.0])
  assert np.isnan(got[1])


@pytest.mark.parametrize("template,choices,message", [
    ("{prompt} only", "red,blue", r"must name \{response\} once"),
    ("{prompt} {response} {answer}", "red,blue", r"\{answer\} is not one"),
    ("{prompt} {response}", "red", r"not two texts"),
    ("{prompt} {response}", "red,red", r"the same token"),
])
def test_a_bad_judge_template_is_refused(template, choices, message):
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  from jaxrlhf.rewards import judge  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=message):
    judge.parse_template(template, choices,
                         tasks.synthetic_vocabulary().encode)


def test_grpo_trains_on_a_judge_and_a_teacher_through_main(llama_pair,
                                                           tmp_path):
  """GRPO with the judge as its reward and the teacher's per-token term
  (the GRPO mix of on-policy distillation): both are logged every step."""
  stdout, metrics = _run_main(
      tmp_path / "grpo", algorithm="grpo", train__num_steps=4,
      init__policy_checkpoint=llama_pair["student"],
      distill__teacher_checkpoint=llama_pair["teacher"],
      rewards__judge__checkpoint=llama_pair["teacher"],
      online__max_new_tokens=MAX_NEW, online__samples_per_prompt=2,
      train__batch_size=4, eval__num_examples=8, eval__batch_size=8,
      **LLAMA, **JUDGE)
  assert "Rewards: judge x 1" in stdout and "Teacher: " in stdout
  steps = [m for m in metrics if "reward/judge" in m]
  assert len(steps) == 4
  for m in steps:
    assert 0 < m["reward/judge"] < 1 and np.isfinite(m["distill/reverse_kl"])


@pytest.mark.parametrize("overrides,message", [
    ({"algorithm": "distill"},
     r"config\.distill\.teacher_checkpoint: distill learns from a teacher"),
    ({"algorithm": "grpo", "distill__teacher_checkpoint": "/t",
      "rewards__reward_model__weight": 0, "rewards__gold_reward__weight": 1,
      "online__tools": "agent_tools:add"},
     r"config\.distill\.teacher_checkpoint: a teacher does not yet score "
     r"multi-turn"),
    ({"algorithm": "rejection_sampling", "distill__teacher_checkpoint": "/t",
      "rewards__reward_model__weight": 0, "rewards__gold_reward__weight": 1},
     r"rejection sampling trains on its chosen samples"),
    ({"algorithm": "gkd", "distill__teacher_checkpoint": "/t",
      "gkd__beta": 1.5}, r"config\.gkd\.beta: 1\.5 must be"),
    ({"algorithm": "grpo", "rewards__judge__weight": 1,
      "rewards__reward_model__weight": 0},
     r"config\.rewards\.judge\.checkpoint: rewards\.judge\.weight is not 0"),
])
def test_a_config_that_cannot_distil_or_judge_is_refused_in_one_line(
    overrides, message):
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = tiny_config(**overrides)
  with pytest.raises(ValueError, match=message) as raised:
    defaults.validate(config)
  assert "\n" not in str(raised.value)
