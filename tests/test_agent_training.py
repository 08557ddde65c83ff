"""Agents on a model: episodes sampled with the KV cache extended between
turns, scored for training, and trained through `python -m jaxrlhf.main`.

A tiny Qwen2-shaped policy (random, with its end-of-turn id made likely so
that its turns end within a few tokens)
plays the guessing game of tests/agent_envs.py through the Qwen 2.5
template of tests/fixtures/tokenizers/chat_qwen.

Truths used: a fresh prefill of each whole conversation (the cache
extended between turns must draw the same episodes); a plain forward pass
over each episode's tokens (the sampler's and the trainer's log-probs of
the model's tokens must be its); the single-turn path (an episode's loss
under a token mean must be the loss of its turns as single-turn responses
to everything before them, the environment's tokens then being prompt).
"""

import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_OVERRIDES, from_scratch, quiet_env, tiny_config
from conftest import trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.agents import episodes
from jaxrlhf.agents import policies
from jaxrlhf.data import chat_templates
from jaxrlhf.data import hf_tokenizer
from jaxrlhf.models import scoring
from jaxrlhf.models.layers import rotary
from jaxrlhf.rl import policy_gradient_losses
from jaxrlhf.rl import rollout as rollout_lib
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

import agent_envs

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "chat_qwen"
TEMPERATURE = 0.7
MAX_NEW = 6
EPISODE_TOKENS = 60


def _overrides(algorithm="grpo", **extra):
  return dict(
      algorithm=algorithm, model__arch="qwen2", model__size="tiny",
      model__num_encoder_layers=None, data__task="agent_guess_files",
      data__inputs_length=64, data__targets_length=MAX_NEW,
      rewards__reward_model__weight=0.0, online__temperature=TEMPERATURE,
      online__environment="agent_envs:make_guess", online__max_turns=3,
      online__max_episode_tokens=EPISODE_TOKENS,
      online__max_new_tokens=MAX_NEW, online__samples_per_prompt=2,
      train__batch_size=2, train__num_steps=2, optimizer__warmup_steps=0,
      **extra)


HELD_OUT = [{"prompt": f"Guess again {i}", "answer": 9 - i}
            for i in range(4)]


def _files(root):
  rows = [{"prompt": f"Guess {i}", "answer": i % 9 + 1} for i in range(4)]
  path = root / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  (root / "test.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in HELD_OUT))
  return {"data.files.train": str(path),
          "data.files.test": str(root / "test.jsonl"),
          "data.files.vocabulary": str(TOKENIZER / "tokenizer.json"),
          "data.files.column_mapping": "prompt=prompt,answer=answer"}


def _config(root, **overrides):
  config = tiny_config(**_overrides(**overrides))
  for field, value in _files(root).items():
    group, name = field.rsplit(".", 1)
    setattr(config.data.files, name, value)
  return config


def _biased(params, end_id: int):
  """The policy's (tied) embedding of the end-of-turn id scaled up: its
  logit grows, so turns end within a few tokens."""
  params = jax.tree.map(np.array, nn.meta.unbox(params))
  params["decoder"]["token_embedder"]["embedding"][end_id] *= 6.0
  return params


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory):
  """A workdir holding the biased random policy, and its module, params
  and vocabulary."""
  return make_policy_run(tmp_path_factory.mktemp("agents"))


def make_policy_run(root):
  """`policy_run` under the directory `root`."""
  root = pathlib.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  config = _config(root)
  vocabulary = hf_tokenizer.HFTokenizerVocabulary(
      str(TOKENIZER / "tokenizer.json"))
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    state = trainer.init_state()
    module = trainer.lm.module
  policy = _biased(state.params["policy"], vocabulary.eos_id)
  state = state.replace(params={"policy": policy}, opt_state={})
  workdir = root / "sft"
  loop.prepare_workdir(str(workdir), config)
  checkpointer = checkpointing.Checkpointer(str(workdir / "checkpoints"),
                                            keep=1)
  checkpointer.save(1, state, 0)
  checkpointer.close()
  return {"root": root, "workdir": str(workdir), "module": module,
          "params": policy, "vocabulary": vocabulary}


def _play(run, extend_cache, rows, seed=0, max_turns=3,
          temperature=TEMPERATURE):
  vocabulary = run["vocabulary"]
  renderer = episodes.Renderer(chat_templates.for_vocabulary(vocabulary),
                               vocabulary)
  limits = episodes.Limits(max_turns=max_turns,
                           max_episode_tokens=EPISODE_TOKENS,
                           max_turn_tokens=MAX_NEW, max_opening_tokens=64)
  policy = policies.TurnPolicy(
      run["module"], run["params"], end_id=vocabulary.eos_id,
      temperature=temperature, width=256, turn_tokens=MAX_NEW,
      extend_cache=extend_cache)
  played, _ = episodes.run_episodes(
      agent_envs.make_guess, rows, policy, renderer,
      episodes.Parser("qwen"), limits, jax.random.PRNGKey(seed))
  return played, limits, policy


ROWS = [{"prompt": "", "answer": a} for a in (3, 5, 7, 9)]


@pytest.fixture(scope="module")
def played(policy_run):
  return _play(policy_run, True, ROWS)


def test_extending_the_cache_plays_the_episodes_a_fresh_prefill_plays(
    policy_run, played):
  extended, _, cached = played
  fresh, _, prefilled = _play(policy_run, False, ROWS)
  # Several turns (the environment answered in between), some cut short.
  assert max(e.turns for e in extended) >= 2
  assert prefilled.prefills > cached.prefills == 1
  for a, b in zip(extended, fresh):
    assert a.tokens == b.tokens and a.is_model == b.is_model
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert a.step_rewards == b.step_rewards


def _real_sequence_logprobs(module, params, episode):
  """log pi(token) at TEMPERATURE of each of the episode's tokens after its
  opening, from one forward pass over its ids."""
  ids = jnp.asarray([episode.opening + episode.tokens], jnp.int32)
  mask = jnp.ones_like(ids)
  logits = module.apply({"params": params}, ids,
                        rotary.positions_from_mask(mask), mask)
  logp = jax.nn.log_softmax(logits[0, :-1] / TEMPERATURE, axis=-1)
  per_token = jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1)[:, 0]
  return np.asarray(per_token[len(episode.opening) - 1:])


def _episode_rollout(run, params, assembled):
  lm = scoring.adapter_for(run["module"])
  return rollout_lib.assemble_rollout(
      lm, params, None, None, None, jnp.asarray(assembled.opening),
      jnp.asarray(assembled.tokens), temperature=TEMPERATURE,
      eos_id=run["vocabulary"].eos_id, missing_eos_penalty=None,
      episodes=(jnp.asarray(assembled.opening_mask),
                jnp.asarray(assembled.present),
                jnp.asarray(assembled.model), jnp.asarray(assembled.ended)))


def test_the_sampled_and_trained_log_probs_are_the_models(policy_run,
                                                          played):
  episodes_, limits, _ = played
  assembled = episodes.assemble(episodes_, limits)
  rollout = _episode_rollout(policy_run, policy_run["params"], assembled)
  np.testing.assert_array_equal(np.asarray(rollout.mask), assembled.model)
  for r, e in enumerate(episodes_):
    truth = _real_sequence_logprobs(policy_run["module"],
                                    policy_run["params"], e)
    model = np.asarray(e.is_model)
    n = len(e.tokens)
    # The sampler's (cached, across turns) and the trainer's (teacher
    # forced on the rollout's layout), on the model's tokens only.
    np.testing.assert_allclose(np.asarray(e.logprobs)[model], truth[model],
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(rollout.logprobs)[r, :n][model],
                               truth[model], atol=1e-4)
    assert np.all(np.asarray(rollout.logprobs)[r, :n][~model] == 0)


def _turns_as_single_turn_rows(e):
  """Each model turn of an episode as a single-turn (prompt, response):
  everything before it, then its ids."""
  rows, start = [], 0
  flags = e.is_model + [False]
  for j in range(len(e.tokens) + 1):
    if flags[j] and (j == 0 or not flags[j - 1]):
      start = j
    if j and flags[j - 1] and not flags[j]:
      rows.append((e.opening + e.tokens[:start], e.tokens[start:j]))
  return rows


def test_an_episode_trains_as_its_turns_would_as_single_turn_responses(
    policy_run, played):
  episodes_, limits, _ = played
  run, vocabulary = policy_run, policy_run["vocabulary"]
  lm = scoring.adapter_for(run["module"])
  old = run["params"]
  new = jax.tree.map(lambda x: x * 1.05 + 0.01, old)
  advantage = {r: float(r) - 1.5 for r in range(len(episodes_))}

  def loss(rollout, advantages, length):
    logprobs, _, mask = rollout_lib.logprobs_and_entropy(
        lm, new, rollout.features, None, TEMPERATURE, length)
    value, _ = policy_gradient_losses.clipped_policy_gradient_loss(
        logprobs, rollout.logprobs, None, advantages, mask,
        clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0,
        reduction="token_mean")
    return float(value)

  assembled = episodes.assemble(episodes_, limits)
  rollout = _episode_rollout(run, old, assembled)
  per_row = jnp.asarray([advantage[r] for r in range(len(episodes_))])
  whole = loss(rollout, per_row[:, None] * jnp.ones_like(rollout.mask),
               limits.max_episode_tokens)

  prompts, responses, advantages = [], [], []
  for r, e in enumerate(episodes_):
    for prompt, response in _turns_as_single_turn_rows(e):
      prompts.append(prompt)
      responses.append(response)
      advantages.append(advantage[r])
  assert len(prompts) > len(episodes_)  # several turns per episode
  width = max(map(len, prompts))
  length = max(map(len, responses))
  prompt_tokens = np.zeros((len(prompts), width), np.int32)
  response_tokens = np.zeros((len(prompts), length), np.int32)
  for i, (p, y) in enumerate(zip(prompts, responses)):
    prompt_tokens[i, :len(p)] = p  # encoder-style: right-padded
    response_tokens[i, :len(y)] = y
  single = rollout_lib.assemble_rollout(
      lm, old, None, None, None, jnp.asarray(prompt_tokens),
      jnp.asarray(response_tokens), temperature=TEMPERATURE,
      eos_id=vocabulary.eos_id, missing_eos_penalty=None)
  turns = loss(single, jnp.asarray(advantages)[:, None]
               * jnp.ones_like(single.mask), length)
  assert whole == pytest.approx(turns, rel=1e-4, abs=1e-6)
  assert abs(whole) > 1e-4  # the ratios moved: a loss that says something


@pytest.mark.parametrize("algorithm,how", [
    # (The tool's schema in the system prompt takes 600 tokens of this
    # tiny tokenizer.)
    ("grpo", {"online.tools": "agent_envs:multiply",
              "online.environment": "", "data.inputs_length": 640}),
    # Held-out episodes scored too (the test split, greedy and sampled).
    ("ppo", {"eval.split": "test", "eval.num_examples": 4,
             "eval.samples_per_prompt": 2}),
])
def test_grpo_with_tools_and_ppo_in_an_environment_train_from_main(
    policy_run, algorithm, how):
  root = policy_run["root"]
  workdir = root / f"main_{algorithm}"
  overrides = dict(TINY_OVERRIDES)
  overrides.update({k.replace("__", "."): v for k, v in _overrides(
      algorithm).items()})
  overrides.update(_files(root))
  overrides.update({"init.policy_checkpoint": policy_run["workdir"], **how})
  del overrides["model.num_encoder_layers"]  # (None: a decoder-only's)
  if algorithm == "ppo":
    overrides["online.num_epochs"] = 1
  args = [sys.executable, "-m", "jaxrlhf.main",
          "--config=configs/quickstart.py", f"--workdir={workdir}",
          *[f"--config.{k}={v}" for k, v in overrides.items()]]
  env = quiet_env(PYTHONPATH=str(REPO / "tests"))
  result = subprocess.run(args, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Rewards: episode x 1 (host)" in result.stdout + result.stderr
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  steps = [r for r in rows if "episode/turns" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert r["episode/turns"] >= 1 and np.isfinite(r["loss"])
    assert r["reward/episode/rows"] == 4
    # The trainer scores the model's tokens as the sampler drew them.
    assert abs(r["gap/k1"]) < 1e-4
  assert (workdir / "checkpoints").exists()
  evaluated = [r for r in rows if "eval/pass@1" in r]
  if algorithm == "grpo":  # no held-out split
    assert not evaluated
    return
  # Before training (step 0) and at the end; step 0's greedy episodes
  # are the starting policy's, played again here.
  assert [r["step"] for r in evaluated] == [0, 2]
  greedy, limits, _ = _play(policy_run, True, HELD_OUT, temperature=0.0)
  first = evaluated[0]
  assert first["eval/episode/turns"] == pytest.approx(
      np.mean([e.turns for e in greedy]))
  assert first["eval/pass@1"] == pytest.approx(
      np.mean([e.episode_return(limits) >= 1.0 for e in greedy]))
  assert first["eval/reward/episode"] == pytest.approx(
      np.mean([e.episode_return(limits) for e in greedy]))
  assert 0 <= first["eval/pass@2"] <= 1


def test_rejection_sampling_keeps_the_best_episodes(policy_run):
  """Rejection sampling's targets (the selected samples) on episodes: the
  run trains, and its episodes are scored by their returns."""
  root = policy_run["root"]
  config = _config(root, algorithm="rejection_sampling")
  config.init.policy_checkpoint = policy_run["workdir"]
  workdir = root / "rejection_sampling"
  loop.train(config, str(workdir), devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  steps = [r for r in rows if "episode/turns" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert np.isfinite(r["loss"]) and r["loss"] > 0
    assert r["reward/episode/rows"] == 4
