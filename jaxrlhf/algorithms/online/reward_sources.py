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
  judge         a generative reward model: a frozen instruction model
                (`rewards.judge.checkpoint`, of the policy's vocabulary)
                reads the prompt and response through a template, inside
                the step, and its verdict's probability is the reward
                (`jaxrlhf.rewards.judge`).
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
  episode       with online.environment or online.tools, each episode's
                own return (weight 1; `episode_step`): the other sources
                score its final answer.

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import answers
from jaxrlhf import config_schema
from jaxrlhf import console
from jaxrlhf.agents import environments
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.data import names
from jaxrlhf.eval import evaluation
from jaxrlhf.models import heads
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import rotary
from jaxrlhf.models import pretrained
from jaxrlhf.rewards import code_execution
from jaxrlhf.rewards import host
from jaxrlhf.rewards import judge as judge_lib
from jaxrlhf.rewards import learned_reward
from jaxrlhf.rewards import math_answer
from jaxrlhf.rewards import overlong
from jaxrlhf.rewards import text_rewards
from jaxrlhf.rl import rollout as rollout_lib

F = config_schema.Field
G = config_schema.Group

REWARD_MODEL = "reward_model"
OVERLONG = "overlong"
JUDGE = "judge"
# A multi-turn episode's own return (online.environment or online.tools:
# `episode_step`), weight 1, filled in on the host.
EPISODE = "episode"
# The rewards computed inside the compiled step; the others run on the host.
DEVICE_REWARDS = (REWARD_MODEL, OVERLONG, JUDGE)


def _weight(doc: str, default: float = 0.0) -> F:
  return F("weight", default, doc + " 0 = off.",
           bounds=config_schema.ANY_NUMBER)


GROUP = G("rewards", "What online RL trains on: the weighted sum of these "
          "sources (jaxrlhf/algorithms/online/reward_sources.py); each is "
          "logged as reward/<name>.", [
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
              G(JUDGE, "A generative reward model: a frozen instruction "
                "model reads each prompt and response through a template "
                "and its verdict, p(yes) / (p(yes) + p(no)) at the next "
                "token, is the reward (jaxrlhf/rewards/judge.py).", [
                    _weight("Its weight."),
                    F("checkpoint", "", "The judge: a jaxrlhf run's workdir "
                      "(its params/policy) or a Hugging Face folder, of the "
                      "policy's vocabulary; required while weight is not "
                      "0.", path=True,
                      read_when=lambda c: c.rewards.judge.weight != 0),
                    F("template", "{prompt}\n{response}\nIs the response "
                      "good? Answer:", "What the judge reads: text with "
                      "{prompt} and {response} once each, and {reference} "
                      "for the pairwise verdict (the row's tokens go "
                      "there; literal braces as {{ }})."),
                    F("choices", "Yes,No", "'yes,no': the verdict's token "
                      "and the one it is weighed against, each one token "
                      "of the vocabulary (pairwise: the labels of the "
                      "first and the second answer, e.g. 'A,B')."),
                    F("verdict", "yes_probability", "How the verdict is "
                      "read: 'yes_probability' (p(yes) / (p(yes) + p(no)) "
                      "at the next token), 'pairwise' (the template names "
                      "{reference} too, the prompt's own completion from "
                      "the task's targets; the probability that the "
                      "response is preferred, averaged over both orders), "
                      "'score' (the first number the judge writes greedily "
                      "in max_new_tokens tokens; a row without one is left "
                      "out).", choices=judge_lib.VERDICTS),
                    F("max_new_tokens", 4, "The tokens the score verdict "
                      "writes.", bounds=">0"),
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
                    F("network", "auto", "How the code is kept apart: "
                      "'bubblewrap' (bwrap's namespaces: no network, a "
                      "read-only filesystem but for its scratch directory, "
                      "no view of our processes), 'namespace' (a network "
                      "namespace), 'audit_hook' (Python refuses sockets "
                      "and programs); 'auto' takes the first of them that "
                      "works here.", choices=code_execution.NETWORK_MODES),
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
                choices=names.ON_BAD_ROW),
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
  if environments.episodic(config.online):
    out[EPISODE] = 1.0
  for path, weight in _parse_functions(r.functions):
    name = path.rpartition(":")[2].rpartition(".")[2] or path
    while name in out:
      name += "_"
    if weight != 0:
      out[name] = weight
  return out


def uses_reward_model(config) -> bool:
  return config.rewards.reward_model.weight != 0


def reads_references(config) -> bool:
  """Whether a pairwise judge reads each prompt's own completion."""
  j = config.rewards.judge
  return j.weight != 0 and j.verdict == "pairwise"


def check_rewards(c) -> None:
  """Something to train on; a reward model where one is weighted."""
  config_schema.require(
      bool(weights(c)), "rewards",
      "every reward's weight is 0, so there is nothing to train on; give "
      "one a weight (e.g. --config.rewards.gold_reward.weight=1).")
  if c.rewards.judge.weight != 0:
    config_schema.require(
        bool(c.rewards.judge.checkpoint), "rewards.judge.checkpoint",
        "rewards.judge.weight is not 0, so a judge scores the samples; set "
        "it to a jaxrlhf run's workdir or a Hugging Face folder of the "
        "policy's vocabulary.")
    config_schema.require(
        not environments.episodic(c.online), "rewards.judge.weight",
        "a judge does not yet read multi-turn episodes (online.environment "
        "/ online.tools); score their final answers with a host reward.")
    config_schema.require(
        not reads_references(c) or not (c.online.sampler_devices
                                        or c.online.off_policy_steps),
        "rewards.judge.verdict",
        "the pairwise judge does not yet read references on sampler "
        "devices (online.sampler_devices, online.off_policy_steps); unset "
        "them or use the yes_probability verdict.")
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


# --- the run's rewards, built once -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostReward:
  """A reward computed on the host from the decoded text."""
  name: str
  function: Callable


@dataclasses.dataclass(frozen=True)
class RewardSources:
  """What a run trains on, built once before its first step (`build`).

  Attributes:
    weights: {name: weight} of every source that is on (`weights`): the
      columns of a rollout's `rewards` [rows, len(weights)], in this order.
    reward_model: the frozen reward model's network, or None.
    lm: the scoring adapter reward-model-shaped networks use: the reward
      model's, or the policy's when there is none (a value network then
      has the policy's shape).
    host: the rewards computed on the host, in the order of `weights`
      (empty in a trainer built from shapes alone, which scores nothing).
    overlong: (L_max, L_cache) of DAPO's overlong penalty, or None.
    eos_trick: the missing-EOS penalty that replaces the reward model's
      score of a response without an EOS (detail 23), or None.
    judge: the generative reward model's network and template, or None.
  """
  weights: Dict[str, float]
  reward_model: Optional[learned_reward.FrozenNetwork]
  lm: Any
  host: Tuple[HostReward, ...]
  overlong: Optional[Tuple[int, int]]
  eos_trick: Optional[float]
  judge: Optional["Judge"] = None

  @property
  def names(self) -> List[str]:
    return list(self.weights)

  @property
  def host_names(self) -> List[str]:
    return [n for n in self.weights if n not in DEVICE_REWARDS]

  def device_rewards(self, rollout, judged=None) -> Dict[str, jax.Array]:
    """{name: [rows]} of the rewards computed in the step: the reward
    model's score at the EOS (the EOS trick applied: `rollout.scores` as
    `assemble_rollout` made it), the overlong penalty of each response and
    the judge's verdicts `judged` ([rows], `Judge.scores`)."""
    out = {}
    if judged is not None:
      out[JUDGE] = judged
    if self.reward_model is not None:
      out[REWARD_MODEL] = rollout.scores
    if self.overlong is not None:
      out[OVERLONG] = overlong.soft_overlong_penalty(
          jnp.sum(rollout.mask, axis=-1), *self.overlong)
    return out

  def with_device_rewards(self, rollout, judged=None):
    """The rollout with its rewards [rows, num rewards] (the host's NaN
    until `with_host_rewards` fills them) and their weighted sum; `judged`:
    the judge's verdicts [rows] when the run has one."""
    if not self.names:  # distillation alone: no rewards, scores 0
      return rollout
    device = self.device_rewards(rollout, judged)
    missing = jnp.full(rollout.has_eos.shape, jnp.nan, jnp.float32)
    rewards = jnp.stack([device.get(name, missing) for name in self.names],
                        axis=1)
    return rollout.replace(rewards=rewards, scores=self.combine(rewards))

  def with_host_rewards(self, rollout, host_values):
    """The rollout with the host rewards [rows, num host rewards] in their
    columns, and its scores summed again."""
    columns = jnp.asarray([self.names.index(n) for n in self.host_names])
    rewards = rollout.rewards.at[:, columns].set(host_values)
    return rollout.replace(rewards=rewards, scores=self.combine(rewards))

  def combine(self, components: jax.Array) -> jax.Array:
    """[rows] weighted sum of the rewards [rows, num rewards], a NaN (the
    reward does not apply) counting 0."""
    w = jnp.asarray(list(self.weights.values()), jnp.float32)
    return jnp.sum(jnp.where(jnp.isnan(components), 0.0, components) * w,
                   axis=-1)

  def metrics(self, components: jax.Array) -> Dict[str, jax.Array]:
    """reward/<name>: the mean over the rows it applies to (NaN, and so
    left out of the logs, when it applies to none); reward/<name>/rows:
    how many; reward/<name>_share: its part of the sum of
    |weight x reward|."""
    w = jnp.asarray(list(self.weights.values()), jnp.float32)
    applies = ~jnp.isnan(components)
    values = jnp.where(applies, components, 0.0)
    count = jnp.sum(applies, axis=0).astype(jnp.float32)
    means = jnp.where(count > 0, jnp.sum(values, axis=0)
                      / jnp.maximum(count, 1.0), jnp.nan)
    size = jnp.sum(jnp.abs(values * w), axis=0)
    shares = size / jnp.maximum(jnp.sum(size), 1e-12)
    metrics = {}
    for i, name in enumerate(self.names):
      metrics[f"reward/{name}"] = means[i]
      metrics[f"reward/{name}/rows"] = count[i]
      if len(self.names) > 1:
        metrics[f"reward/{name}_share"] = shares[i]
    return metrics

  def score_on_host(self, config, prompt_texts: Sequence[str],
                    completion_texts: Sequence[str], finished: Sequence[bool],
                    columns: Dict[str, list]
                    ) -> Tuple[np.ndarray, Dict[str, float]]:
    """This process's rows scored by every host reward.

    Returns:
      ([rows, num host rewards] float32, NaN where a reward does not apply
      or the row was skipped; {reward/<name>/skipped: count} of this
      process, for every host reward when rows may be skipped, else {}).
    """
    r = config.rewards
    columns = dict(columns, finished=list(finished))
    values, skipped = [], {}
    for reward in self.host:
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

  def describe(self) -> str:
    """"Rewards: reward_model x 1, math_answer x 0.5 (host)", for the
    console at start-up."""
    return "Rewards: " + ", ".join(
        f"{name} x {weight:g}" + (" (host)" if name not in DEVICE_REWARDS
                                  else "")
        for name, weight in self.weights.items())


@dataclasses.dataclass(frozen=True)
class Judge:
  """The generative reward model: its network, its template as tokens and
  how its verdict is read (`jaxrlhf.rewards.judge`).

  Attributes:
    network: the judge's network.
    template: the template as tokens.
    verdict: one of `judge_lib.VERDICTS`.
    max_new_tokens: the tokens the score verdict writes.
    numbers: the score verdict's (values, digits) of every token
      (`judge_lib.number_tokens`), or None.
  """
  network: learned_reward.FrozenNetwork
  template: judge_lib.JudgeTemplate
  verdict: str = "yes_probability"
  max_new_tokens: int = 4
  numbers: Optional[Tuple[Any, Any]] = None

  def scores(self, params, prompt_tokens, response_tokens, response_mask,
             eos_id: int, references=None):
    """[rows] the judge's verdicts of the responses (prompt_tokens [rows,
    Lp] encoder-style, response tokens and mask [rows, L]; references
    [rows, Lr], the pairwise verdict's, right-padded): each row's texts
    without padding or EOS in the template, read as `verdict` says."""
    def real(tokens, mask):
      return tokens, mask * (tokens != eos_id) * (tokens != 0)
    slots = {"prompt": real(prompt_tokens, jnp.ones_like(prompt_tokens)),
             "response": real(response_tokens,
                              response_mask.astype(jnp.int32))}
    if self.verdict == "pairwise":
      slots["reference"] = real(references, jnp.ones_like(references))
      swapped = dict(slots, response=slots["reference"],
                     reference=slots["response"])
      return judge_lib.pairwise_preference(
          self._next_token_verdict(params, slots, eos_id),
          self._next_token_verdict(params, swapped, eos_id),
          self.template.response_first)
    if self.verdict == "score":
      return self._written_number(params, slots, eos_id)
    return self._next_token_verdict(params, slots, eos_id)

  def _rows(self, slots, eos_id):
    """(tokens, mask) of the judging rows, laid out for the judge."""
    template = self.template
    encoder_decoder = self.network.adapter.is_encoder_decoder
    if encoder_decoder:  # its inputs end in EOS, as it was trained
      template = dataclasses.replace(template, pieces=template.pieces[:-1] + (
          template.pieces[-1] + (eos_id,),))
    return judge_lib.judge_rows(template, slots,
                                left_padded=not encoder_decoder)

  def _next_token_verdict(self, params, slots, eos_id):
    """[rows] p(choice 0) / (p(choice 0) + p(choice 1)) at the position
    after the judging rows."""
    tokens, mask = self._rows(slots, eos_id)
    lm = self.network.adapter
    rows = tokens.shape[0]
    if lm.is_encoder_decoder:
      # The encoder reads the rows; the decoder's first position (input
      # BOS 0, a target that marks the position real) answers.
      first = jnp.zeros((rows, 1), jnp.int32)
      batch = {"encoder_input_tokens": tokens, "decoder_input_tokens": first,
               "decoder_target_tokens": first + 1,
               "decoder_loss_weights": first + 1}
    else:
      # A column after the last token: its state answers (the states
      # `response_states` gives are those before each of the last tokens).
      tokens = jnp.pad(tokens, ((0, 0), (0, 1)))
      mask = jnp.pad(mask, ((0, 0), (0, 1)))
      batch = {"tokens": tokens, "attention_mask": mask,
               "positions": rotary.positions_from_mask(mask)}
    states, project = lm.response_states(params, batch, 1)
    return judge_lib.verdict(project(states)[:, 0], self.template.choices)

  def _written_number(self, params, slots, eos_id):
    """[rows] the first number of the judge's greedy continuation of the
    judging rows, NaN where it wrote none."""
    tokens, mask = self._rows(slots, eos_id)
    module = self.network.adapter.module
    options = dict(greedy=True, eos_id=eos_id, stop_when_done=True)
    key = jax.random.PRNGKey(0)  # unused: greedy
    if self.network.adapter.is_encoder_decoder:
      written = sampling.sample_encoder_decoder(
          module, params, tokens, key, self.max_new_tokens, **options)
    else:
      written = sampling.sample_decoder_only(
          module, params, tokens, mask, key, self.max_new_tokens, **options)
    values, digits = self.numbers
    return judge_lib.first_number(written.tokens, jnp.asarray(values),
                                  jnp.asarray(digits))


def build(config, vocabulary, policy_lm, platform: str, max_new_tokens: int,
          shapes_only: bool = False, used: bool = True) -> RewardSources:
  """The run's `RewardSources`: the reward model's network (its vocabulary
  checked against `vocabulary`) and the host rewards (a missing function or
  a task without a gold reward refused here, before the run writes
  anything); none at all when the algorithm does not train on rewards
  (`used` False: distillation)."""
  o, r = config.online, config.rewards
  if not used:
    return RewardSources(weights={}, reward_model=None, lm=policy_lm,
                         host=(), overlong=None, eos_trick=None)
  reward_model = None
  if uses_reward_model(config):
    reward_model = learned_reward.build(
        o.reward_model_checkpoint, "config.online.reward_model_checkpoint",
        vocabulary, config.model, platform,
        check_vocabulary=not shapes_only)
  overlong_cfg = None
  if r.overlong.weight != 0:
    overlong_cfg = (r.overlong.max_length or max_new_tokens,
                    r.overlong.cache_length)
  judge = None
  if r.judge.weight != 0:
    j = r.judge
    judge = Judge(
        learned_reward.build(
            j.checkpoint, "config.rewards.judge.checkpoint", vocabulary,
            config.model, platform, check_vocabulary=not shapes_only,
            what="the judge",
            fix="Judge with a model of the policy's vocabulary."),
        judge_lib.parse_template(j.template, j.choices, vocabulary.encode,
                                 j.verdict),
        verdict=j.verdict, max_new_tokens=j.max_new_tokens,
        numbers=(judge_lib.number_tokens(
            lambda i: vocabulary.decode([i]), vocabulary.vocab_size)
                 if j.verdict == "score" else None))
  return RewardSources(
      weights=weights(config), reward_model=reward_model,
      lm=reward_model.adapter if reward_model else policy_lm,
      host=() if shapes_only else _host_rewards(config),
      overlong=overlong_cfg,
      eos_trick=o.missing_eos_penalty if o.eos_trick else None, judge=judge)


def _host_rewards(config) -> Tuple[HostReward, ...]:
  r = config.rewards
  made = {}
  if r.gold_reward.weight != 0:
    made["gold_reward"] = _gold_reward_function(config.data.task)
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
        scoring=c.scoring, network=c.network)
  functions = iter(_parse_functions(r.functions))
  out = []
  for name in weights(config):
    if name in DEVICE_REWARDS or name == EPISODE:  # the episode's own return
      continue
    if name not in made:
      path, _ = next(functions)
      made[name] = host.load_function(path, "config.rewards.functions")
    out.append(HostReward(name, made[name]))
  return tuple(out)


def _gold_reward_function(task: str) -> Callable:
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
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


# --- the reward model's parameters -------------------------------------------------


def init_reward_net(trainer, rng):
  """Fresh (boxed) reward-model-shaped params {"backbone", "head"} (the
  policy's shape without a reward model)."""
  a, b = jax.random.split(rng)
  sources = trainer.online.rewards
  emb_dim = (sources.reward_model.model_config.emb_dim if sources.reward_model
             else trainer.model_config.emb_dim)
  backbone = trainer.init_lm(a, module=sources.lm.module)
  return heads.init_from_backbone(b, backbone, emb_dim)


def frozen_networks(trainer, rng) -> Dict[str, Any]:
  """{"reward": params} when a reward model is weighted, {"judge": params}
  when a judge is."""
  sources = trainer.online.rewards
  a, b = jax.random.split(rng)
  out = {}
  if sources.reward_model is not None:
    out["reward"] = init_reward_net(trainer, a)
  if sources.judge is not None:
    out[JUDGE] = trainer.init_lm(b, module=sources.judge.network.adapter.module)
  return out


def loaded_judge(judge, abstract_state, token_swap) -> Dict[str, Any]:
  """{"frozen/judge": its checkpoint's params} when a judge is weighted
  (`judge`: the run's `RewardSources.judge`, or None); `token_swap` as in
  `load_frozen_lm`."""
  if judge is None:
    return {}
  return {f"frozen/{JUDGE}": load_frozen_lm(
      judge.network, abstract_state, f"frozen/{JUDGE}",
      "config.rewards.judge.checkpoint", token_swap)}


def load_frozen_lm(network, abstract_state, target: str, field: str,
                   token_swap):
  """A frozen language model's params (a teacher, a judge: another run's
  latest params/policy or a Hugging Face folder), shaped and sharded as
  `target` of `abstract_state`; errors name `field`. token_swap: the ids
  the run's vocabulary exchanges (`Trainer.hf_options()["token_swap"]`),
  exchanged in a Hugging Face checkpoint's token rows too."""
  try:
    return pretrained.load_lm_params(
        network.path, state_lib.subtree(abstract_state, target),
        module=network.adapter.module, token_swap=token_swap)
  except ValueError as e:
    raise ValueError(f"{field}: {e}") from None


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
  reward_model = trainer.online.rewards.reward_model
  if reward_model is None:
    path = trainer.config.init.policy_checkpoint
    if not path or lora:
      return {}
    return {f"params/{name}/backbone": pretrained.load_lm_params(
        path, state_lib.subtree(abstract_state, f"params/{name}/backbone"),
        **trainer.hf_options()) for name in initialised_from_it}
  options = {"module": reward_model.adapter.module,
             "token_swap": trainer.hf_options()["token_swap"]}
  targets = ["frozen/reward"] + [f"params/{name}"
                                 for name in initialised_from_it]
  if lora:
    reward = pretrained.load_network_params(
        reward_model.path, state_lib.subtree(abstract_state, "frozen/reward"),
        "reward", **options)
    return {"frozen/reward": reward,
            **{f"params/{name}/head": jax.tree.map(jnp.copy, reward["head"])
               for name in initialised_from_it}}
  return {target: pretrained.load_network_params(
              reward_model.path, state_lib.subtree(abstract_state, target),
              "reward", **options)
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
  sources = trainer.online.rewards
  reward_fn = _reward_fn(sources.lm)
  # Laid out for the reward model's architecture, which may not be the
  # policy's.
  features = jax.tree.map(np.asarray, rollout_lib.response_features(
      sources.lm, jnp.asarray(prompt_tokens), jnp.asarray(samples.tokens),
      jnp.asarray(samples.mask), trainer.vocabulary.eos_id))
  n = len(prompt_tokens)
  scores = np.concatenate([
      evaluation.local_rows(reward_fn(reward_params, b))
      for b in evaluation.global_batches(
          features, trainer.config.eval.batch_size, trainer.mesh,
          trainer.rules)])[:n]
  if sources.eos_trick is not None:
    scores = np.where(np.asarray(samples.has_eos), scores, sources.eos_trick)
  return scores
