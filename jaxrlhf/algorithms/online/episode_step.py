"""The driver of agents: the online step on multi-turn episodes.

With `online.environment` (or `online.tools`) every response is an episode
(`jaxrlhf.agents.episodes`): the policy speaks, its environment answers on
the host, until done. `EpisodeStep` runs `iteration.online_step` with the
host split's compiled parts (`host_split.HostSplitStep`: dynamic sampling
and the host rewards work as they do there) and three parts of its own:

  sample        the episodes of this process's rows of the prompt batch,
                `samples_per_prompt` per row (adjacent, so group baselines
                compare the episodes of one row), played on the host with
                turns sampled on the device (`agents.policies.TurnPolicy`:
                the KV cache extended between turns)
  score         the episodes' log-probs (the policy's and the reference's,
                over the model's tokens; the environment's tokens are read
                by the model but carry no loss) and the device rewards
                (`rollout.assemble_rollout(..., episodes=...)`)
  host rewards  `config.rewards` on each episode's final answer (its last
                turn's text), and the episode's own return as the reward
                source "episode" (weight 1: its environment's step rewards
                discounted across turns, the failed-call and overflow
                rewards)

The algorithms' targets and updates are the single-turn ones: a rollout's
[rows, L] arrays hold the conversation after the opening, its mask the
model's tokens (GAE steps over the environment's tokens:
`rl.advantages.generalized_advantage_estimation`). Metrics: episode/turns,
episode/tool_calls, episode/failed_calls, episode/overflow (per episode),
episode/skipped (dropped by rewards.on_bad_row=skip_and_report),
episode/env_seconds (the step's wall time waiting on environments).
"""

import dataclasses
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import sharding
from jaxrlhf.agents import environments
from jaxrlhf.agents import episodes as episodes_lib
from jaxrlhf.agents import policies
from jaxrlhf.algorithms.online import host_split
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.data import chat_templates
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.rl import rollout as rollout_lib

# Per-episode means of these sums (`episodes.metrics`).
_MEANS = ("episode/turns", "episode/tool_calls", "episode/failed_calls",
          "episode/overflow")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EpisodeSamples:
  """A step's episodes on the device ([rows, ...], `episodes.Assembled`),
  and what the host keeps of them for its rewards."""
  opening: jax.Array
  opening_mask: jax.Array
  tokens: jax.Array
  present: jax.Array
  model: jax.Array
  logprobs: jax.Array
  ended: jax.Array
  decode_steps: jax.Array
  host: dict = dataclasses.field(metadata=dict(static=True), default=None)


def episode_tokens(config, max_new_tokens: int) -> int:
  """An episode's most tokens after its opening (the rollout's response
  length): `online.max_episode_tokens`, unset = max_turns x
  max_new_tokens."""
  o = config.online
  return o.max_episode_tokens or o.max_turns * max_new_tokens


def limits(config, prompt_length: int, max_new_tokens: int
           ) -> episodes_lib.Limits:
  """An episode's bounds, from the config (`online.max_turns`, ...)."""
  o = config.online
  return episodes_lib.Limits(
      max_turns=o.max_turns,
      max_episode_tokens=episode_tokens(config, max_new_tokens),
      max_turn_tokens=max_new_tokens, max_opening_tokens=prompt_length,
      env_timeout_s=o.env_timeout_s or None,
      failed_call_reward=o.failed_call_reward,
      overflow_reward=o.overflow_reward, turn_discount=o.turn_discount,
      on_bad_row=config.rewards.on_bad_row)


class EpisodeStep(host_split.HostSplitStep):
  """(state, batch) -> (state, metrics) on multi-turn episodes (module
  docstring)."""

  def __init__(self, trainer):
    t, o = trainer, trainer.config.online
    if t.lm.is_encoder_decoder:
      raise ValueError(
          "config.online.environment / online.tools: multi-turn episodes "
          "need a decoder-only policy (model.arch llama, qwen2, ...); an "
          "encoder-decoder (T5) has no chat turns to continue.")
    super().__init__(t)
    self._trainer = t
    self._limits = limits(t.config, t.prompt_length, t.online.max_new_tokens)
    self._make_env = environments.environment_factory(o.environment, o.tools)
    files = t.config.data.files
    template = chat_templates.for_vocabulary(
        t.vocabulary, files.chat_template,
        chat_templates.parse_variables(files.chat_template_kwargs))
    self._renderer = episodes_lib.Renderer(template, t.vocabulary)
    self._parser = episodes_lib.Parser(o.tool_call_style,
                                       o.tool_call_pattern or None)
    self._view = jax.jit(lambda params, frozen: t.view_parts(
        params, frozen)[0]["policy"])
    self._score_episodes = jax.jit(self._score_fn)
    self.parts = dataclasses.replace(
        self.parts, sample=self._sample, score=self._score,
        host_rewards=self._episode_rewards)

  # --- sample: the episodes, on the host ------------------------------------

  def _sample(self, params, frozen, prompts, key):
    t, k = self._trainer, self._k
    indices = np.repeat(evaluation.local_rows(
        prompts[prompts_lib.PROMPT_INDEX]), k)
    source = self._prompt_source.prompts
    rows = [{"prompt": source.texts[i],
             **{c: v[i] for c, v in source.columns.items()}}
            for i in indices]
    names = [f"prompt row {i}" for i in indices]
    policy = policies.TurnPolicy(
        t.lm.module, self._view(params, frozen), end_id=self._eos_id,
        temperature=self._config.online.temperature,
        width=(self._limits.max_opening_tokens
               + self._limits.max_episode_tokens
               + self._limits.max_turn_tokens),
        turn_tokens=self._limits.max_turn_tokens,
        extend_cache=self._config.online.extend_kv_cache)
    played, timing = episodes_lib.run_episodes(
        self._make_env, rows, policy, self._renderer, self._parser,
        self._limits,
        key, name=self._env_name(), row_names=names)
    arrays = episodes_lib.assemble(played, self._limits)
    place = lambda x: jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self._rules, x.ndim), x)
    texts = [e.final_text for e in played]
    host = {"prompt_texts": [r["prompt"] for r in rows],
            "final_texts": texts, "finished": arrays.ended.tolist(),
            "columns": {c: [r[c] for r in rows] for c in source.columns},
            "returns": arrays.returns,
            "metrics": {**episodes_lib.metrics(played),
                        "episode/env_seconds": timing["env_seconds"]}}
    return EpisodeSamples(
        opening=place(arrays.opening), opening_mask=place(arrays.opening_mask),
        tokens=place(arrays.tokens), present=place(arrays.present),
        model=place(arrays.model), logprobs=place(arrays.logprobs),
        ended=place(arrays.ended),
        decode_steps=jnp.int32(timing["decode_steps"]), host=host)

  def _env_name(self) -> str:
    o = self._config.online
    return (f"online.environment {o.environment!r}" if o.environment
            else "online.tools")

  # --- score: log-probs over the model's tokens -----------------------------

  def _score_fn(self, params, frozen, samples: EpisodeSamples):
    t = self._trainer
    rewards = t.online.rewards
    params, frozen = t.view_parts(params, frozen)
    scores_reference = kl_control.scores_reference(t.algorithm, t.config)
    rollout = rollout_lib.assemble_rollout(
        t.lm, params["policy"],
        frozen["reference"] if scores_reference else None,
        rewards.lm if rewards.reward_model else None, frozen.get("reward"),
        samples.opening, samples.tokens,
        temperature=t.config.online.temperature, eos_id=self._eos_id,
        missing_eos_penalty=rewards.eos_trick,
        episodes=(samples.opening_mask, samples.present, samples.model,
                  samples.ended))
    rollout = rewards.with_device_rewards(rollout)
    return rollout.replace(decode_steps=samples.decode_steps,
                           sample_logprobs=samples.logprobs * rollout.mask)

  def _score(self, params, frozen, prompt_tokens, samples):
    del prompt_tokens  # the episodes' openings are their own
    return self._score_episodes(params, frozen,
                                dataclasses.replace(samples, host=None))

  # --- host rewards: config.rewards on the final answers, and the return ----

  def _episode_rewards(self, rollout, samples, batch):
    del batch
    host = samples.host
    values, skipped = self._rewards.score_on_host(
        self._config, host["prompt_texts"], host["final_texts"],
        host["finished"], host["columns"])
    by_name = dict(zip([n for n in self._rewards.host_names
                        if n != reward_sources.EPISODE], values.T))
    by_name[reward_sources.EPISODE] = host["returns"]
    stacked = np.stack([np.asarray(by_name[n], np.float32)
                        for n in self._rewards.host_names], axis=1)
    values = jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self._rules, 2), stacked)
    return self._add_host(rollout, values), {**skipped, **host["metrics"]}

  def _keep(self, rounds):
    rollout, metrics = super()._keep(rounds)
    return rollout, _per_episode(metrics)


def _per_episode(metrics: Dict[str, float]) -> Dict[str, float]:
  """The episode sums of every round (added over processes) as means per
  episode; env_seconds stays the step's total."""
  metrics = dict(metrics)
  count = max(metrics.pop("episode/count", 0.0), 1.0)
  for name in _MEANS:
    if name in metrics:
      metrics[name] /= count
  return metrics
