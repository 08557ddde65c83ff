"""What an online run trains on: a weighted sum of reward sources.

`config.rewards` names the sources, each with a weight (0 = off), and every
one of them is logged on its own (`reward/<name>`, and `reward/<name>_share`,
its share of the sum's absolute size):

  reward_model  a jaxrlhf reward_model run (`online.reward_model_checkpoint`),
                frozen in the train state, scoring each response at its EOS
                inside the step, with the EOS trick (`online.eos_trick`:
                detail 23) as before; PPO's value network starts from it
                (detail 22). Built with its run's own model config, so it
                may be larger than the policy or of the other architecture;
                its vocabulary must be the policy's (checked at start-up).
  overlong      DAPO's soft overlong penalty of the response length, inside
                the step (`jaxrlhf.rewards.overlong`).
  gold_reward   the task's registered gold reward (the synthetic tasks have
                one), on the host.
  math_answer   the completion's final answer checked against the row's
                reference answer with `math-verify`, on the host.
  format        a regular expression the completion must match, on the host.
  code          the share of the row's unit tests the completion's code
                passes, run in a separate limited process, on the host.
  functions     your own functions, "package.module:function=weight, ...",
                called on the host as fn(prompts, completions, **columns)
                (TRL's convention; `jaxrlhf.rewards`).

A host reward returns None for a row it does not apply to; the sum leaves
it out (as TRL's nansum does). A function that fails (raises, returns the
wrong count, NaN or a non-number, or passes `rewards.timeout_s`) stops the
run in one line naming the function, the row and why, or with
`rewards.on_bad_row=skip_and_report` scores those rows None and counts them
(`reward/<name>/skipped`, and a console line). With any host reward the
online step is split around the host (`online.HostSplitStep`); with only
the reward model and the overlong penalty it stays one compiled function.
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrlhf import answers
from jaxrlhf import config_schema
from jaxrlhf import console
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.data import file_sources
from jaxrlhf.data import tasks as tasks_lib
from jaxrlhf.data import vocab
from jaxrlhf.eval import evaluation
from jaxrlhf.models import heads
from jaxrlhf.models import pretrained
from jaxrlhf.models import scoring
from jaxrlhf.models.registry import build_model
from jaxrlhf.rewards import code_execution
from jaxrlhf.rewards import host
from jaxrlhf.rewards import math_answer
from jaxrlhf.rewards import overlong
from jaxrlhf.rewards import text_rewards
from jaxrlhf.rl import rollout as rollout_lib

F = config_schema.Field
G = config_schema.Group

REWARD_MODEL = "reward_model"
OVERLONG = "overlong"
# The rewards computed inside the compiled step; the others run on the host.
DEVICE_REWARDS = (REWARD_MODEL, OVERLONG)


def _weight(doc: str, default: float = 0.0) -> F:
  return F("weight", default, doc + " 0 = off.",
           bounds=config_schema.ANY_NUMBER)


GROUP = G("rewards", "What online RL trains on: the weighted sum of these "
          "sources (jaxrlhf/algorithms/online/reward_sources.py); each is logged as "
          "reward/<name>.", [
              G(REWARD_MODEL, "A trained jaxrlhf reward model "
                "(online.reward_model_checkpoint), at each response's EOS.",
                [_weight("Its weight; the default trains on it alone, as "
                         "RLHF with a reward model does.", 1.0)]),
              G(OVERLONG, "DAPO's soft overlong penalty (eq. 13): 0 up to "
                "max_length - cache_length response tokens, falling to -1 at "
                "max_length, -1 beyond.", [
                    _weight("Its weight (DAPO: 1)."),
                    F("max_length", None, "L_max; unset = "
                      "online.max_new_tokens.", type=int, bounds=">0"),
                    F("cache_length", 4, "L_cache, the band below max_length "
                      "where the penalty grows (DAPO: 4096 of 20480).",
                      bounds=">=0"),
                ]),
              G("gold_reward", "The task's registered gold reward "
                "(jaxrlhf.data.tasks.register_gold_reward; the synthetic "
                "tasks have one): a run on them needs no reward model.",
                [_weight("Its weight.")]),
              G("math_answer", "1 when the completion's final answer equals "
                "the row's reference answer symbolically (math-verify), "
                "else 0; rows without a reference are left out.", [
                    _weight("Its weight."),
                    F("answer_column", "answer",
                      "The prompt rows' column of reference answers (the "
                      "gsm8k and math layouts, synthetic_arithmetic: "
                      "'answer')."),
                    F("style", "auto", "How the completion's answer is "
                      "found: 'boxed' (the last \\\\boxed{}), 'gsm8k' (after "
                      "'####'), 'auto' (boxed, else ####, else the last "
                      "number), 'regex' (pattern's group).",
                      choices=answers.STYLES),
                    F("pattern", "", "style 'regex': a regular expression "
                      "with one group around the answer."),
                ]),
              G("format", "1 when the completion matches a regular "
                "expression, else 0 (a format reward).", [
                    _weight("Its weight."),
                    F("pattern", r"#### -?\d+", "The regular expression "
                      "(Python syntax, '.' crosses lines)."),
                    F("match", "search", "'search' (anywhere) or 'full' (the "
                      "whole completion).", choices=text_rewards.MATCH_MODES),
                ]),
              G("code", "The share of the row's unit tests (a list of Python "
                "assert statements) the completion's code passes, run in a "
                "separate process with a time and memory limit, no network "
                "and a scratch directory (README: what it protects against "
                "and what it does not).", [
                    _weight("Its weight."),
                    F("tests_column", "tests", "The prompt rows' column of "
                      "tests."),
                    F("timeout_s", 5.0, "Seconds a row's code may run.",
                      bounds=">0"),
                    F("memory_mb", 512, "Its address-space limit.",
                      bounds=">0"),
                    F("scoring", "fraction", "'fraction' of the tests passed, "
                      "or 'all' (1 only when every test passes).",
                      choices=code_execution.SCORING),
                ]),
              F("functions", "",
                "Your reward functions, 'package.module:function=weight, "
                "...' (weight 1 when left out), each called on the host as "
                "fn(prompts, completions, **columns) -> list of float or "
                "None, TRL's convention: columns are the prompt rows' other "
                "fields (e.g. answer=[...])."),
              F("timeout_s", 120.0,
                "Seconds one call of a host reward may take for a step's "
                "rows.", bounds=">0"),
              F("on_bad_row", "raise",
                "A host reward that fails on a row: 'raise' stops the run "
                "naming the function, the row and why; 'skip_and_report' "
                "leaves that row out of the reward, counted in the console "
                "and metrics.jsonl (reward/<name>/skipped).",
                choices=file_sources.ON_BAD_ROW),
          ])


def _parse_functions(text: str) -> List[Tuple[str, float]]:
  """`rewards.functions` as [(import path, weight)]."""
  out = []
  for item in filter(None, (part.strip() for part in text.split(","))):
    path, sep, weight = item.rpartition("=")
    if not sep:
      path, weight = item, "1"
    try:
      value = float(weight)
    except ValueError:
      raise ValueError(
          f"config.rewards.functions: {item!r} is not "
          "'package.module:function=weight'; the weight must be a "
          "number.") from None
    out.append((path.strip(), value))
  return out


def weights(config) -> Dict[str, float]:
  """{reward name: weight} of every source that is on, in a fixed order:
  the device rewards first, then the host ones."""
  r = config.rewards
  out = {name: float(r[name].weight)
         for name in DEVICE_REWARDS + ("gold_reward", "math_answer", "format",
                                       "code")
         if r[name].weight != 0}
  for path, weight in _parse_functions(r.functions):
    name = path.rpartition(":")[2].rpartition(".")[2] or path
    while name in out:
      name += "_"
    if weight != 0:
      out[name] = weight
  return out


def uses_reward_model(config) -> bool:
  return config.rewards.reward_model.weight != 0


def check_rewards(c) -> None:
  """Something to train on; a reward model where one is weighted."""
  config_schema.require(
      bool(weights(c)), "rewards",
      "every reward's weight is 0, so there is nothing to train on; give "
      "one a weight (e.g. --config.rewards.gold_reward.weight=1).")
  if uses_reward_model(c):
    config_schema.require(
        bool(c.online.reward_model_checkpoint),
        "online.reward_model_checkpoint",
        f"{c.algorithm} scores its samples with a trained reward model "
        "(rewards.reward_model.weight is not 0); set it to a reward_model "
        "run's workdir, or set rewards.reward_model.weight=0 and train on "
        "other rewards (rewards.gold_reward, rewards.math_answer, "
        "rewards.functions, ...).")
  _parse_functions(c.rewards.functions)


# --- the reward model -------------------------------------------------------------


def reward_run(trainer):
  """The reward model run's resolved config (a dict), or None."""
  return trainer.once("reward_run", lambda: pretrained.run_config(
      trainer.config.online.reward_model_checkpoint))


def _reward_model(trainer) -> Tuple[Any, Any]:
  """(scoring adapter, model config) of the reward model, built once per
  trainer from its run's config."""

  def build():
    run = reward_run(trainer)
    path = trainer.config.online.reward_model_checkpoint
    vocabulary = tasks_lib.run_vocabulary(run) if run else None
    if vocabulary is not None and (vocab.fingerprint(vocabulary)
                                   != vocab.fingerprint(trainer.vocabulary)):
      raise ValueError(
          f"config.online.reward_model_checkpoint: the reward model {path!r} "
          f"was trained with vocabulary {vocab.describe(vocabulary)}, but "
          f"the policy (config.data.task {trainer.config.data.task!r}) uses "
          f"{vocab.describe(trainer.vocabulary)}. Its scores of the policy's "
          "token ids would be meaningless: train a reward model on the "
          "policy's vocabulary.")
    model_config = trainer.config.model
    if run and "model" in run:
      # The reward model's own architecture and size: it may be T5 for a
      # decoder-only policy or the reverse (`rollout.response_features` lays
      # the responses out for each).
      model_config = ml_collections.ConfigDict(run["model"])
      if "arch" not in model_config:
        with model_config.unlocked():
          model_config.arch = "t5"  # runs from before decoder-only models
    module, module_config = build_model(model_config,
                                        trainer.vocabulary.vocab_size,
                                        trainer.platform)
    return scoring.adapter_for(module), module_config

  return trainer.once("reward_model", build)


def reward_lm(trainer):
  """The reward model's scoring adapter (its run's architecture and size);
  without a reward model, the policy's (a value network then has the
  policy's shape)."""
  if not uses_reward_model(trainer.config):
    return trainer.lm
  return _reward_model(trainer)[0]


def init_reward_net(trainer, rng):
  """Fresh (boxed) reward-model-shaped params {"backbone", "head"} (the
  policy's shape without a reward model)."""
  a, b = jax.random.split(rng)
  if uses_reward_model(trainer.config):
    adapter, reward_config = _reward_model(trainer)
    emb_dim = reward_config.emb_dim
  else:
    adapter, emb_dim = trainer.lm, trainer.model_config.emb_dim
  backbone = trainer.init_lm(a, module=adapter.module)
  return heads.init_from_backbone(b, backbone, emb_dim)


def frozen_networks(trainer, rng) -> Dict[str, Any]:
  """{"reward": params} when a reward model is weighted, else {}."""
  if not uses_reward_model(trainer.config):
    return {}
  return {"reward": init_reward_net(trainer, rng)}


def loaded_networks(trainer, abstract_state,
                    initialised_from_it=()) -> Dict[str, Any]:
  """{target: loaded tree} of the frozen reward model and the trained
  networks `initialised_from_it` (PPO's "value", detail 22), shaped and
  sharded as in `abstract_state`; without a reward model, those networks'
  backbones start from the policy's checkpoint (their heads fresh).

  In a LoRA run (`lora_state`) those backbones are adapters on the frozen
  network they start from: the policy's base (loaded once, as the
  policy's) or the frozen reward model, whose head is copied as theirs."""
  lora = getattr(trainer, "lora", None) is not None
  if not uses_reward_model(trainer.config):
    path = trainer.config.init.policy_checkpoint
    if not path or lora:
      return {}
    return {f"params/{name}/backbone": pretrained.load_lm_params(
        path, state_lib.subtree(abstract_state, f"params/{name}/backbone"),
        **trainer.hf_options()) for name in initialised_from_it}
  path = trainer.config.online.reward_model_checkpoint
  options = {"module": reward_lm(trainer).module,
             "token_swap": trainer.hf_options()["token_swap"]}
  targets = ["frozen/reward"] + [f"params/{name}"
                                 for name in initialised_from_it]
  if lora:
    reward = pretrained.load_network_params(
        path, state_lib.subtree(abstract_state, "frozen/reward"), "reward",
        **options)
    return {"frozen/reward": reward,
            **{f"params/{name}/head": jax.tree.map(jnp.copy, reward["head"])
               for name in initialised_from_it}}
  return {target: pretrained.load_network_params(
              path, state_lib.subtree(abstract_state, target), "reward",
              **options)
          for target in targets}


@functools.lru_cache(maxsize=None)
def _reward_fn(adapter):
  """Jitted reward-model scoring, shared by every run with the same reward
  model (the stages of a pipeline compile it once)."""
  return jax.jit(lambda params, batch: heads.sequence_rewards(adapter,
                                                              params, batch))


def reward_scores(trainer, reward_params, prompt_tokens,
                  samples) -> np.ndarray:
  """Reward-model scores of sampled completions (host arrays), with the EOS
  trick as in training. [n]."""
  reward_fn = _reward_fn(reward_lm(trainer))
  # Laid out for the reward model's architecture, which may not be the
  # policy's.
  features = jax.tree.map(np.asarray, rollout_lib.response_features(
      reward_lm(trainer), jnp.asarray(prompt_tokens),
      jnp.asarray(samples.tokens), jnp.asarray(samples.mask),
      trainer.vocabulary.eos_id))
  n = len(prompt_tokens)
  scores = np.concatenate([
      evaluation.local_rows(reward_fn(reward_params, b))
      for b in evaluation.global_batches(
          features, trainer.config.eval.batch_size, trainer.mesh,
          trainer.rules)])[:n]
  o = trainer.config.online
  if o.eos_trick:
    scores = np.where(np.asarray(samples.has_eos), scores,
                      o.missing_eos_penalty)
  return scores


# --- the device rewards -----------------------------------------------------------


def device_rewards(trainer, frozen, rollout) -> Dict[str, jax.Array]:
  """{name: [rows]} of the rewards computed in the step: the reward model's
  score at the EOS (the EOS trick applied: `rollout.scores` as
  `assemble_rollout` made it) and the overlong penalty of each response."""
  del frozen
  config = trainer.config
  out = {}
  if uses_reward_model(config):
    out[REWARD_MODEL] = rollout.scores
  if config.rewards.overlong.weight != 0:
    cfg = config.rewards.overlong
    out[OVERLONG] = overlong.soft_overlong_penalty(
        jnp.sum(rollout.mask, axis=-1),
        cfg.max_length or trainer.online.max_new_tokens, cfg.cache_length)
  return out


def combine(trainer, components: jax.Array) -> jax.Array:
  """[rows] weighted sum of the rewards [rows, num rewards] (in the order of
  `weights`), a NaN (the reward does not apply) counting 0."""
  w = jnp.asarray(list(weights(trainer.config).values()), jnp.float32)
  return jnp.sum(jnp.where(jnp.isnan(components), 0.0, components) * w,
                 axis=-1)


def reward_metrics(trainer, components: jax.Array) -> Dict[str, jax.Array]:
  """reward/<name> (the mean over the rows it applies to) and
  reward/<name>_share (its part of the sum of |weight x reward|)."""
  names = list(weights(trainer.config))
  w = jnp.asarray(list(weights(trainer.config).values()), jnp.float32)
  applies = ~jnp.isnan(components)
  values = jnp.where(applies, components, 0.0)
  count = jnp.sum(applies, axis=0).astype(jnp.float32)
  means = jnp.sum(values, axis=0) / jnp.maximum(count, 1.0)
  size = jnp.sum(jnp.abs(values * w), axis=0)
  shares = size / jnp.maximum(jnp.sum(size), 1e-12)
  metrics = {}
  for i, name in enumerate(names):
    metrics[f"reward/{name}"] = means[i]
    if len(names) > 1:
      metrics[f"reward/{name}_share"] = shares[i]
  return metrics


# --- the host rewards --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostReward:
  """A reward computed on the host from the decoded text."""
  name: str
  function: Callable


def host_rewards(trainer) -> List[HostReward]:
  """The run's host rewards, in the order of `weights` (built once)."""

  def build():
    r = trainer.config.rewards
    made = {}
    if r.gold_reward.weight != 0:
      made["gold_reward"] = _gold_reward_function(trainer)
    if r.math_answer.weight != 0:
      m = r.math_answer
      made["math_answer"] = math_answer.make_math_answer_reward(
          m.answer_column, m.style, m.pattern or None)
    if r.format.weight != 0:
      made["format"] = text_rewards.make_regex_reward(r.format.pattern,
                                                      match=r.format.match)
    if r.code.weight != 0:
      c = r.code
      made["code"] = code_execution.make_code_reward(
          c.tests_column, timeout_s=c.timeout_s, memory_mb=c.memory_mb,
          scoring=c.scoring)
    functions = iter(_parse_functions(r.functions))
    out = []
    for name in weights(trainer.config):
      if name in DEVICE_REWARDS:
        continue
      if name not in made:
        path, _ = next(functions)
        made[name] = host.load_function(path, "config.rewards.functions")
      out.append(HostReward(name, made[name]))
    return out

  return trainer.once("host_rewards", build)


def _gold_reward_function(trainer) -> Callable:
  task = trainer.config.data.task
  gold = tasks_lib.gold_reward_for(task)
  if gold is None:
    raise ValueError(
        f"config.rewards.gold_reward.weight: config.data.task {task!r} has "
        "no gold reward (jaxrlhf.data.tasks.register_gold_reward); train on "
        "another reward, or on a task that has one (e.g. "
        "'synthetic_summarize', 'synthetic_arithmetic').")

  def gold_reward(prompts, completions, finished, **unused):
    del unused
    return [float(gold(p, c, f)) for p, c, f in
            zip(prompts, completions, finished)]

  return gold_reward


def check_host_rewards(trainer) -> None:
  """Builds the host rewards at start-up, so that a missing function or a
  task without a gold reward stops the run before it trains."""
  host_rewards(trainer)


def score_on_host(trainer, prompt_texts: Sequence[str],
                  completion_texts: Sequence[str], finished: Sequence[bool],
                  columns: Dict[str, list]
                  ) -> Tuple[np.ndarray, Dict[str, float]]:
  """This process's rows scored by every host reward.

  Returns:
    ([rows, num host rewards] float32, NaN where a reward does not apply or
    the row was skipped; {reward/<name>/skipped: count} of this process,
    for every host reward when rows may be skipped, else {}).
  """
  r = trainer.config.rewards
  columns = dict(columns, finished=list(finished))
  values, skipped = [], {}
  for reward in host_rewards(trainer):
    scores = host.score(reward.function, reward.name, prompt_texts,
                        completion_texts, columns, timeout_s=r.timeout_s,
                        on_bad_row=r.on_bad_row)
    values.append(scores.values)
    if r.on_bad_row != "raise":
      skipped[f"reward/{reward.name}/skipped"] = float(scores.num_skipped)
    if scores.num_skipped:
      reasons = ", ".join(f"{k} {v}"
                          for k, v in sorted(scores.skipped.items()))
      console.log(f"Reward {reward.name}: skipped {scores.num_skipped} "
                  f"row(s) ({reasons}); the first: "
                  f"{scores.messages[0] if scores.messages else ''}")
  if not values:
    return np.zeros((len(prompt_texts), 0), np.float32), skipped
  return np.stack(values, axis=1).astype(np.float32), skipped
