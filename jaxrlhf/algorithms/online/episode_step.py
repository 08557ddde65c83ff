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
                the KV cache extended between turns; with the
                continuous engine, online.engine 'continuous' or 'auto',
                `agents.continuous`: decode slots, a turn waiting on its
                environment freeing its own)
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
episode/env_seconds (the step's wall time waiting on environments with
nothing to decode); with the continuous engine (`agents.continuous`:
a turn waiting on its environment frees its decode slot),
episode/env_hidden_seconds (decoding while an environment ran: its time
hidden), episode/slot_occupancy (slot-steps that drew a token / steps x
slots) and episode/preemptions (episodes preempted when a turn needed a
page and none was free: a pool of online.engine_pages under every episode
at its longest; each is prefilled again later, drawing the same tokens).
"""

import dataclasses
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import run_cache
from jaxrlhf import sharding
from jaxrlhf.agents import continuous
from jaxrlhf.agents import environments
from jaxrlhf.agents import episodes as episodes_lib
from jaxrlhf.agents import policies
from jaxrlhf.algorithms.online import host_split
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.data import chat_templates
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import pass_at_k
from jaxrlhf.models import engine as engine_lib

# What `play` counts, summed as episode/<name> (the step's, not per
# episode): the wall time the device waited on environments; with the
# continuous engine, the device time while an environment ran (hidden
# behind decoding), and the slot-steps run and those that drew a token
# (`_per_episode` logs their ratio, episode/slot_occupancy), and the
# episodes preempted for pages (online.engine_pages).
_TIMING = ("env_seconds", "env_hidden_seconds", "slot_steps",
           "useful_slot_steps", "preemptions", "param_updates")
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
  routes: Any = None  # the sampler's experts (router replay), or None
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


@dataclasses.dataclass(frozen=True)
class Agent:
  """What a run plays its episodes with (`agent`)."""
  make_env: Callable
  renderer: episodes_lib.Renderer
  parser: episodes_lib.Parser
  limits: episodes_lib.Limits
  name: str  # what messages call the environment


@run_cache.per_run
def agent(trainer) -> Agent:
  """The run's environments, chat template, tool-call format and limits,
  built once (an environment or a tool that cannot be imported, or a
  template missing, is refused here, before the first step)."""
  t, o = trainer, trainer.config.online
  if t.lm.is_encoder_decoder:
    raise ValueError(
        "config.online.environment / online.tools: multi-turn episodes "
        "need a decoder-only policy (model.arch llama, qwen2, ...); an "
        "encoder-decoder (T5) has no chat turns to continue.")
  files = t.config.data.files
  template = chat_templates.for_vocabulary(
      t.vocabulary, files.chat_template,
      chat_templates.parse_variables(files.chat_template_kwargs))
  return Agent(
      make_env=environments.environment_factory(o.environment, o.tools),
      renderer=episodes_lib.Renderer(template, t.vocabulary),
      parser=episodes_lib.Parser(o.tool_call_style,
                                 o.tool_call_pattern or None),
      limits=limits(t.config, t.prompt_length, t.online.max_new_tokens),
      name=(f"online.environment {o.environment!r}" if o.environment
            else "online.tools"))


def play(trainer, policy_params, rows, key, temperature: float,
         row_names=None, params_source=None, record_routes=False):
  """The episodes of `rows` ({"prompt", **columns}) with the policy's
  parameters (its view: LoRA merged) at `temperature` (0: greedy):
  (episodes, {"env_seconds", "decode_steps", and with the continuous
  engine "env_hidden_seconds", "slot_occupancy", "preemptions"}).
  online.engine 'lockstep' plays the turns in lockstep
  (`agents.policies.TurnPolicy`), 'continuous' (and 'auto') on decode
  slots (`agents.continuous`), its pages' pool online.engine_pages (unset:
  every episode at its longest, none preempted): the same episodes.
  `params_source` (continuous): new parameters mid-play
  (`EpisodeEngine.params_source`, online.partial_rollouts).
  `record_routes` (router replay, a mixture-of-experts policy): each
  episode carries the experts its ids were routed to
  (`Episode.routes`)."""
  a = agent(trainer)
  lim = a.limits
  o = trainer.config.online
  decoder, page_size = options.decoding(trainer.config)
  if decoder == "continuous":
    player = continuous.EpisodeEngine(
        trainer.lm.module, policy_params, end_id=trainer.vocabulary.eos_id,
        temperature=temperature,
        num_slots=o.engine_slots or engine_lib.default_slots(len(rows)),
        max_length=lim.max_opening_tokens + lim.max_episode_tokens,
        turn_tokens=lim.max_turn_tokens,
        page_size=page_size, num_pages=o.engine_pages,
        record_routes=record_routes)
    player.params_source = params_source
    played, timing = continuous.run_episodes(
        a.make_env, rows, player, a.renderer, a.parser, lim, key,
        name=a.name, row_names=row_names)
  else:
    player = policies.TurnPolicy(
        trainer.lm.module, policy_params, end_id=trainer.vocabulary.eos_id,
        temperature=temperature,
        width=(lim.max_opening_tokens + lim.max_episode_tokens
               + lim.max_turn_tokens),
        turn_tokens=lim.max_turn_tokens,
        extend_cache=o.extend_kv_cache, record_routes=record_routes)
    played, timing = episodes_lib.run_episodes(
        a.make_env, rows, player, a.renderer, a.parser, lim, key,
        name=a.name, row_names=row_names)
  if player.record_routes:
    for i, e in enumerate(played):
      e.routes = player.routes(i, len(e.opening) + len(e.tokens))
  return played, timing


def episode_rewards(trainer, played, rows) -> Tuple[np.ndarray, dict]:
  """[episodes, len(host_names)] float32 host rewards of played episodes,
  in `RewardSources.host_names` order: `config.rewards` on each final
  answer (NaN where one does not apply) and the episode's return; and
  {reward/<name>/skipped: count}."""
  sources = trainer.online.rewards
  lim = agent(trainer).limits
  values, skipped = sources.score_on_host(
      trainer.config, [r["prompt"] for r in rows],
      [e.final_text for e in played], [e.finished for e in played],
      {c: [r[c] for r in rows] for c in (rows[0] if rows else {})
       if c != "prompt"})
  by_name = dict(zip([n for n in sources.host_names
                      if n != reward_sources.EPISODE], values.T))
  by_name[reward_sources.EPISODE] = [e.episode_return(lim) for e in played]
  return np.stack([np.asarray(by_name[n], np.float32)
                   for n in sources.host_names], axis=1), skipped


def held_out_metrics(trainer, policy_params, texts, columns, *, n: int,
                     temperature: float, seed: int, threshold: float,
                     ks) -> Dict[str, float]:
  """`policy_eval.held_out_reward_metrics` for a run of episodes: a greedy
  episode and n at `temperature` per held-out row, scored by the run's
  host rewards and the episode's return (`pass_at_k.reward_metrics`),
  with eval/episode/turns and eval/episode/tool_calls of the greedy
  ones."""
  sources = trainer.online.rewards
  rows = [{"prompt": text, **{c: v[i] for c, v in columns.items()}}
          for i, text in enumerate(texts)]
  names = [f"held-out row {i}" for i in range(len(rows))]
  key = jax.random.PRNGKey(seed)
  greedy_played, _ = play(trainer, policy_params, rows, key, 0.0, names)
  greedy, _ = episode_rewards(trainer, greedy_played, rows)
  sampled = np.zeros((len(rows), 0, greedy.shape[1]), np.float32)
  if n:
    repeated = [r for r in rows for _ in range(n)]
    played, _ = play(trainer, policy_params, repeated, key, temperature,
                     [name for name in names for _ in range(n)])
    sampled = episode_rewards(trainer, played, repeated)[0].reshape(
        len(rows), n, -1)
  names = sources.host_names
  metrics = pass_at_k.reward_metrics(
      greedy, sampled, names, [sources.weights[name] for name in names],
      threshold, ks)
  count = max(len(greedy_played), 1)
  metrics["eval/episode/turns"] = sum(e.turns for e in greedy_played) / count
  metrics["eval/episode/tool_calls"] = sum(
      e.tool_calls for e in greedy_played) / count
  return metrics


class EpisodeStep(host_split.HostSplitStep):
  """(state, batch) -> (state, metrics) on multi-turn episodes (module
  docstring)."""

  def __init__(self, trainer, mesh=None):
    agent(trainer)  # refuses what cannot be played before anything else
    super().__init__(trainer, mesh=mesh)
    self._trainer = trainer
    self._limits = agent(trainer).limits
    self.view = jax.jit(lambda params, frozen: trainer.view_parts(
        params, frozen)[0]["policy"])
    # online.partial_rollouts: () -> the policy's view of newer parameters
    # to play on with, or None; set by `overlap` for the episodes ahead.
    self.params_source = None
    self._score_episodes = jax.jit(self._score_fn)
    self.parts = dataclasses.replace(
        self.parts, sample=self._sample, score=self._score,
        host_rewards=self._episode_rewards)

  # --- sample: the episodes, on the host ------------------------------------

  def _sample(self, params, frozen, prompts, key):
    indices = np.repeat(evaluation.local_rows(
        prompts[prompts_lib.PROMPT_INDEX]), self._k)
    source = self._prompt_source.prompts
    rows = [{"prompt": source.texts[i],
             **{c: v[i] for c, v in source.columns.items()}}
            for i in indices]
    played, timing = play(self._trainer, self.view(params, frozen), rows,
                          key, self._config.online.temperature,
                          [f"prompt row {i}" for i in indices],
                          params_source=self.params_source,
                          record_routes=self._trainer.online.router_replay)
    arrays = episodes_lib.assemble(played, self._limits)
    place = lambda x: jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self._rules, x.ndim), x)
    host = {"played": played, "rows": rows,
            "metrics": {**episodes_lib.metrics(played),
                        **{f"episode/{name}": timing[name]
                           for name in _TIMING if name in timing}}}
    return EpisodeSamples(
        opening=place(arrays.opening), opening_mask=place(arrays.opening_mask),
        tokens=place(arrays.tokens), present=place(arrays.present),
        model=place(arrays.model), logprobs=place(arrays.logprobs),
        ended=place(arrays.ended),
        routes=None if arrays.routes is None else place(arrays.routes),
        decode_steps=jnp.int32(timing["decode_steps"]), host=host)

  # --- score: log-probs over the model's tokens -----------------------------

  def _score_fn(self, params, frozen, samples: EpisodeSamples):
    t = self._trainer
    params, frozen = t.view_parts(params, frozen)
    rollout = iteration.score_rows(
        t, params, frozen, samples.opening, samples.tokens,
        routes=samples.routes,
        episodes=(samples.opening_mask, samples.present, samples.model,
                  samples.ended))
    rollout = iteration.with_sampler_stats(rollout, samples.decode_steps,
                                           samples.logprobs)
    if t.config.online.partial_rollouts:
      # A token's old log-prob is that of the policy that drew it.
      rollout = rollout.replace(logprobs=rollout.sample_logprobs)
    return rollout

  def _score(self, params, frozen, prompt_tokens, samples, references=None):
    del prompt_tokens, references  # the episodes' openings are their own
    return self._score_episodes(params, frozen,
                                dataclasses.replace(samples, host=None))

  # --- host rewards: config.rewards on the final answers, and the return ----

  def _episode_rewards(self, rollout, samples, batch):
    del batch
    host = samples.host
    values, skipped = episode_rewards(self._trainer, host["played"],
                                      host["rows"])
    values = jax.make_array_from_process_local_data(
        sharding.batch_sharding(self.mesh, self._rules, 2), values)
    return self._add_host(rollout, values), {**skipped, **host["metrics"]}

  @staticmethod
  def step_metrics(metrics: Dict[str, float]) -> Dict[str, float]:
    return _per_episode(metrics)


def _per_episode(metrics: Dict[str, float]) -> Dict[str, float]:
  """The episode sums of every round (added over processes) as means per
  episode, and the slots' occupancy; env_seconds, preemptions and
  param_updates stay the step's totals."""
  metrics = dict(metrics)
  if "episode/slot_steps" in metrics:
    metrics["episode/slot_occupancy"] = (
        metrics.pop("episode/useful_slot_steps")
        / max(metrics.pop("episode/slot_steps"), 1.0))
  count = max(metrics.pop("episode/count", 0.0), 1.0)
  for name in _MEANS:
    if name in metrics:
      metrics[name] /= count
  return metrics
