"""Router replay for online RL (issue 43, item 4; `online.router_replay`).

The sampler records the experts it routed each fed token to
(`sampling.sample_decoder_only(record_routes=True)`), and the rollout's
scoring and the updates route those tokens alike (`moe_decoder.apply`'s
`replayed`, `layers.moe.route`). Checked here:

  * a block given routes computes each token with exactly those experts,
    weighted by its own router's probabilities of them (a per-token
    reference written apart, values and the router's gradient), and a
    token marked -1 routes itself;
  * the recorded routes are the experts a teacher-forced forward pass
    routes the same tokens to (unrolled and scanned layers), with -1 where
    the sampler fed nothing;
  * where the sampler's numerics differ from the trainer's (its router
    perturbed so that some tokens go to other experts), the trainer's
    log-probs of the sampled tokens are far closer to the sampler's with
    replay than without;
  * through a tiny Qwen3-MoE GRPO trainer: the rollout carries the routes,
    the update's loss replays them (its ratio is exactly 1 before the
    first update even with routes the trainer would never choose itself,
    and is not without them), and a step split around the host logs the
    gap with and without;
  * multi-turn episodes: both episode players (lockstep turns, the cache
    extended or prefilled afresh; the engine's slots on a pool that
    preempts) record the teacher-forced experts of every id they feed,
    and an episode step's rollout carries them to its scoring (the
    sampler's own log-probs) and to the update, as above.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import from_scratch, one_device_mesh, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.models import engine
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import qwen3_moe
from jaxrlhf.models import sampling
from jaxrlhf.models import scoring
from jaxrlhf.models.layers import moe
from jaxrlhf.rl import rollout as rollout_lib

E, TOP_K, MLP, EMBED = 4, 2, 6, 5


def _unboxed(variables):
  return jax.tree.map(lambda p: getattr(p, "value", p), variables,
                      is_leaf=lambda p: hasattr(p, "value"))


def _reference_block(params, x, experts, norm_topk_prob):
  """Per token, written apart from `MoeMlp`: the given experts (or, where
  the first is -1, the top k of the softmax), each weighted by the
  softmax's probability of it (renormalised over the k), their SwiGLU
  outputs summed."""
  tokens = x.reshape(-1, EMBED)
  chosen_all = experts.reshape(-1, TOP_K)
  outs = []
  for t in range(tokens.shape[0]):
    h = tokens[t]
    probs = jax.nn.softmax(h @ params["router"]["kernel"])
    own = jnp.argsort(-probs)[:TOP_K]
    chosen = jnp.where(chosen_all[t, 0] >= 0, chosen_all[t], own)
    w = probs[chosen]
    if norm_topk_prob:
      w = w / jnp.sum(w)
    y = 0.0
    for i in range(TOP_K):
      e = chosen[i]
      gate = h @ params["wi_0"][e]
      up = h @ params["wi_1"][e]
      y = y + w[i] * ((jax.nn.silu(gate) * up) @ params["wo"][e])
    outs.append(y)
  return jnp.stack(outs).reshape(x.shape)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_a_block_routes_as_replayed_and_its_router_still_learns(
    norm_topk_prob):
  block = moe.MoeMlp(num_experts=E, top_k=TOP_K, mlp_dim=MLP,
                     norm_topk_prob=norm_topk_prob)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, EMBED))
  params = _unboxed(block.init(jax.random.PRNGKey(1), x))["params"]
  # Experts no top-k would pick together in this order: (e + 1, e + 3)
  # mod E from the own top expert, and two tokens left to themselves.
  _, own = block.apply({"params": params}, x)
  top = jnp.argmax(own, axis=-1)
  replayed = jnp.stack([(top + 1) % E, (top + 3) % E], axis=-1)
  replayed = replayed.at[0, :2].set(-1)

  def run(p):
    y, _ = block.apply({"params": p, moe.ROUTING: {moe.EXPERTS: replayed}}, x)
    return y

  def reference(p):
    return _reference_block(p, x, replayed, norm_topk_prob)
  np.testing.assert_allclose(run(params), reference(params), rtol=2e-5,
                             atol=2e-5)
  # The routing differs from the block's own: a replay that was ignored
  # would not match.
  own_y, _ = block.apply({"params": params}, x)
  assert float(jnp.max(jnp.abs(own_y - run(params)))) > 1e-2
  # The router's gradient flows through the replayed experts' weights.
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(run(p))))(params)
  want = jax.grad(lambda p: jnp.sum(jnp.sin(reference(p))))(params)
  assert float(jnp.max(jnp.abs(grads["router"]["kernel"]))) > 1e-4
  np.testing.assert_allclose(grads["router"]["kernel"],
                             want["router"]["kernel"], rtol=1e-4, atol=1e-5)
  # Recorded: the experts used.
  _, state = block.apply({"params": params, moe.ROUTING: {
      moe.EXPERTS: replayed}}, x, mutable=[moe.INTERMEDIATES])
  used = state[moe.INTERMEDIATES][moe.EXPERTS][0]
  np.testing.assert_array_equal(used[0, 2:], replayed[0, 2:])
  np.testing.assert_array_equal(
      jnp.sort(used[0, :2], axis=-1),
      jnp.sort(jax.lax.top_k(own[0, :2], TOP_K)[1], axis=-1))


def _tiny(scan_layers):
  config = qwen3_moe.Qwen3MoeConfig.preset("tiny", scan_layers=scan_layers)
  module = qwen3_moe.Qwen3Moe(config)
  tokens = jnp.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], jnp.int32)
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  params = _unboxed(module.init(jax.random.PRNGKey(0), tokens, positions,
                                mask))["params"]
  return module, params, tokens, mask


def _whole(prompt_tokens, prompt_mask, samples, k):
  """The teacher-forced rows [prompt | new tokens] of `samples`."""
  tokens = jnp.concatenate([jnp.repeat(prompt_tokens, k, 0), samples.tokens],
                           axis=1)
  mask = jnp.concatenate([jnp.repeat(prompt_mask, k, 0),
                          jnp.ones_like(samples.tokens)], axis=1)
  return tokens, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0), mask


def _forced_and_recorded(module, params, prompt_tokens, prompt_mask,
                         samples, k):
  """(the experts the teacher-forced rows [prompt | new tokens] route to,
  the experts `samples` recorded, each sorted per token; the rows' mask)."""
  tokens, positions, mask = _whole(prompt_tokens, prompt_mask, samples, k)
  _, state = module.apply({"params": params}, tokens, positions, mask,
                          mutable=[moe_decoder.INTERMEDIATES])
  forced = np.sort(np.asarray(moe_decoder.routes(
      state[moe_decoder.INTERMEDIATES])), axis=-1)
  return forced, np.sort(np.asarray(samples.routes), axis=-1), mask


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("stop_when_done", [False, True])
def test_the_sampler_records_the_experts_of_every_token_it_fed(
    scan_layers, stop_when_done):
  module, params, prompt, prompt_mask = _tiny(scan_layers)
  new, k = 6, 2
  options = dict(num_samples=k, eos_id=-1)
  if stop_when_done:
    # Every row the same greedy one (the padded prompt twice), its third
    # token taken as EOS: the loop stops before its last steps.
    prompt, prompt_mask = (jnp.tile(x[:1], (2, 1)) for x in (prompt,
                                                             prompt_mask))
    first = sampling.sample_decoder_only(module, params, prompt, prompt_mask,
                                         jax.random.PRNGKey(3), new,
                                         greedy=True, **options)
    options = dict(options, eos_id=int(first.tokens[0, 2]), greedy=True,
                   stop_when_done=True)
  samples = sampling.sample_decoder_only(
      module, params, prompt, prompt_mask, jax.random.PRNGKey(3), new,
      record_routes=True, **options)
  layers = sum(module.config.sparse_layers)
  assert samples.routes.shape == (4, prompt.shape[1] + new, layers, TOP_K)
  forced, recorded, mask = _forced_and_recorded(
      module, params, prompt, prompt_mask, samples, k)
  # Fed: every real prompt token, and new tokens 0 .. steps - 2.
  fed = np.asarray(mask, bool).copy()
  steps = int(samples.num_steps)
  fed[:, prompt.shape[1] + steps - 1:] = False
  np.testing.assert_array_equal(recorded[fed], forced[fed])
  assert np.all(recorded[:, prompt.shape[1] + steps - 1:] == -1)
  if stop_when_done:
    assert steps <= 3  # the loop stopped early: -1 columns were tested
  # A dense model, or no recording, records nothing.
  assert sampling.sample_decoder_only(
      module, params, prompt, prompt_mask, jax.random.PRNGKey(3),
      new).routes is None


def _mean_abs_gap(trainer_logprobs, sampler_logprobs, mask):
  """The mean |log pi_train - log pi_sampler| over the masked tokens (a
  gap that signed sums such as k1 could hide by cancelling)."""
  return float(jnp.sum(jnp.abs(trainer_logprobs - sampler_logprobs) * mask)
               / jnp.sum(mask))


def test_replay_closes_the_gap_when_the_sampler_routes_otherwise():
  """The sampler's router kernel perturbed a little (other numerics, as a
  bfloat16 engine's): tokens near a tie go to other experts there (7% of
  them here). Scoring its
  samples with the trainer's weights, the gap to the sampler's log-probs
  shrinks by far with replay, which removes the routing's part and leaves
  the small one of the router weights' difference."""
  module, params, prompt, prompt_mask = _tiny(False)
  noisy = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.005 * jax.random.normal(
          jax.random.PRNGKey(len(str(path))), x.shape)
      if "router" in str(path) else x, params)
  new, k = 8, 4
  prompt = jnp.tile(prompt, (4, 1))
  prompt_mask = jnp.tile(prompt_mask, (4, 1))
  samples = sampling.sample_decoder_only(
      module, noisy, prompt, prompt_mask, jax.random.PRNGKey(5), new,
      num_samples=k, eos_id=-1, record_routes=True)
  tokens, positions, mask = _whole(prompt, prompt_mask, samples, k)
  lm = scoring.adapter_for(module)
  features = {"tokens": tokens, "positions": positions,
              "attention_mask": mask,
              "loss_weights": mask.at[:, :prompt.shape[1]].set(0)}
  own, _, response_mask = rollout_lib.logprobs_and_entropy(
      lm, params, features, response_length=new)
  replayed, _, _ = rollout_lib.logprobs_and_entropy(
      lm, params, features, response_length=new, routes=samples.routes)
  # The perturbation moves some routes (else the test shows nothing).
  _, state = module.apply({"params": params}, tokens, positions, mask,
                          mutable=[moe_decoder.INTERMEDIATES])
  trainer_routes = np.sort(np.asarray(moe_decoder.routes(
      state[moe_decoder.INTERMEDIATES])), axis=-1)[:, :-1]
  moved = np.mean(np.any(trainer_routes != np.sort(
      np.asarray(samples.routes), axis=-1)[:, :-1], axis=(-1, -2)))
  assert moved > 0.05
  without = _mean_abs_gap(own, samples.logprobs, response_mask)
  with_replay = _mean_abs_gap(replayed, samples.logprobs, response_mask)
  assert with_replay < 0.25 * without, (with_replay, without)
  # With the sampler's own weights, replay reproduces its log-probs.
  exact, _, _ = rollout_lib.logprobs_and_entropy(
      lm, noisy, features, response_length=new, routes=samples.routes)
  np.testing.assert_allclose(exact, samples.logprobs, atol=2e-5)


MOE_GRPO = dict(model__arch="qwen3_moe", model__size="tiny",
                model__num_encoder_layers=None,
                model__num_decoder_layers=None, optimizer__warmup_steps=0,
                train__batch_size=4, algorithm="grpo",
                rewards__reward_model__weight=0.0,
                rewards__gold_reward__weight=1.0,
                online__reward_model_checkpoint="",
                online__samples_per_prompt=2,
                online__router_replay_gap=True,
                # A host reward: the step is split around the host.
                rewards__functions="reward_functions:word_count")


@pytest.fixture(scope="module")
def grpo_run():
  config = tiny_config(**MOE_GRPO)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    state = trainer.init_state()
    batch = jax.device_get(next(trainer.train_batches(0)))
  return trainer, state, batch, mesh, rules


def test_the_update_replays_the_rollouts_routes(grpo_run):
  trainer, state, batch, mesh, rules = grpo_run
  assert trainer.online.router_replay
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    rollout = iteration.rollout_for_step(trainer, state, batch)
    _assert_the_update_replays(trainer, state, rollout)


def _assert_the_update_replays(trainer, state, rollout):
  """The rollout's routes laid out over its features' columns, and the
  update's forward pass replaying them: with routes the trainer would not
  choose (each expert moved by one) and the log-probs they give as the
  old policy, the ratios are exactly 1, and not without the routes."""
  rows, length = rollout.mask.shape
  layers = sum(trainer.lm.module.config.sparse_layers)
  assert rollout.routes.shape == (
      rows, rollout.features["tokens"].shape[1], layers, TOP_K)
  moved = jnp.where(rollout.routes >= 0, (rollout.routes + 1) % E,
                    rollout.routes)
  rescored = rollout_lib.logprobs_and_entropy(
      trainer.lm, state.params["policy"], rollout.features, None,
      trainer.config.online.temperature, length, routes=moved)[0]
  assert float(jnp.max(jnp.abs(rescored - rollout.logprobs))) > 1e-3
  rollout = rollout.replace(routes=moved, logprobs=rescored)
  data, algorithm_state, _ = trainer.algorithm.training.targets(
      trainer, state, rollout)
  assert rollout_lib.ROUTES in data
  loss = trainer.algorithm.training.loss
  _, metrics = loss(trainer, state.params, data, algorithm_state)
  np.testing.assert_allclose(metrics["approx_kl_k3"], 0.0, atol=1e-10)
  np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-6)
  # Without the routes the loss's forward pass routes itself: not 1.
  del data[rollout_lib.ROUTES]
  _, metrics = loss(trainer, state.params, data, algorithm_state)
  assert float(metrics["approx_kl_k3"]) > 1e-5


def test_a_grpo_step_logs_the_gap_with_and_without_replay(grpo_run):
  """A step split around the host (its samples' routes laid out over the
  rows as the rest)."""
  trainer, state, batch, mesh, rules = grpo_run
  state = jax.tree.map(jnp.copy, state)  # the step donates its state
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    _, metrics = trainer.train_step(
        state, sharding.global_batch(batch, mesh, rules))
  metrics = jax.device_get(metrics)
  # The sampler and the trainer compute alike here: both gaps near 0.
  for name in ("gap/k1", f"{iteration.UNREPLAYED_GAP}/k1"):
    assert abs(metrics[name]) < 1e-3, (name, metrics[name])


@pytest.mark.parametrize("paged", [True])
def test_the_engine_records_the_experts_of_every_token_it_fed(paged):
  """engine.generate(record_routes=True): 4 sequences in 2 slots (refilled
  one at a time), contiguous or on pages in the smallest pool (sequences
  preempted and resumed): the recorded experts of every token fed are
  those the teacher-forced sequence routes to; the last token, never fed,
  has -1."""
  module, params, prompt, prompt_mask = _tiny(False)
  new = 6
  rows = jnp.tile(prompt, (2, 1)), jnp.tile(prompt_mask, (2, 1))
  options = dict(page_size=2, num_pages=engine.least_pages(
      prompt.shape[1], new, 2)) if paged else {}
  samples, stats = engine.generate(module, params, *rows,
                                   jax.random.PRNGKey(3), 2, new, eos_id=-1,
                                   refill_size=1, record_routes=True,
                                   **options)
  assert int(stats.preemptions) > 0 if paged else True
  layers = sum(module.config.sparse_layers)
  assert samples.routes.shape == (4, prompt.shape[1] + new, layers, TOP_K)
  forced, recorded, mask = _forced_and_recorded(module, params, *rows,
                                                samples, 1)
  fed = np.asarray(mask, bool).copy()
  fed[:, -1] = False
  np.testing.assert_array_equal(recorded[fed], forced[fed])
  assert np.all(recorded[:, -1] == -1)
  if not paged:
    return
  with pytest.raises(ValueError, match="decodes on pages"):
    engine.generate(module, params, *rows, jax.random.PRNGKey(3), 2, new)


def test_a_moe_rollout_on_the_engine_carries_its_routes(grpo_run):
  """online.engine='continuous' on pages: the rollout carries the routes
  the engine recorded, an expert for every token it fed (the prompt's
  real tokens, each response's tokens but its last), and the trainer's
  scoring replaying them gives the sampler's own log-probs."""
  trainer, state, batch, mesh, rules = grpo_run
  o = trainer.config.online
  o.engine, o.engine_page_size = "continuous", 4
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      _, key, _ = iteration.split_step_key(state.rng)
      tokens = batch[prompts_lib.PROMPT_FEATURE]
      samples = iteration.sample(trainer, state.params, state.frozen,
                                 tokens, key)
      rollout = iteration.score(trainer, state.params, state.frozen, tokens,
                                samples)
  finally:
    o.engine, o.engine_page_size = "lockstep", None
  mask = np.asarray(rollout.mask, bool)
  routes = np.asarray(rollout.routes)
  prompt = routes.shape[1] - mask.shape[1]
  fed = np.concatenate(
      [np.asarray(rollout.features["attention_mask"])[:, :prompt] > 0,
       mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
  assert np.all(routes[fed] >= 0)
  assert np.all(routes[:, prompt:][~fed[:, prompt:]] == -1)
  np.testing.assert_allclose(
      np.asarray(rollout.logprobs)[mask],
      np.asarray(samples.logprobs)[mask], atol=1e-4)


def _forced_routes(module, params, sequences):
  """The experts a teacher-forced forward pass routes each id of
  `sequences` (lists of ids) to, sorted per token: a list of [n, moe
  layers, top_k] (the rows right-padded into one causal pass)."""
  longest = max(len(s) for s in sequences)
  tokens = np.zeros((len(sequences), longest), np.int32)
  mask = np.zeros_like(tokens)
  for r, s in enumerate(sequences):
    tokens[r, :len(s)], mask[r, :len(s)] = s, 1
  positions = np.broadcast_to(np.arange(longest, dtype=np.int32),
                              tokens.shape)
  _, state = module.apply({"params": params}, tokens, positions, mask,
                          mutable=[moe_decoder.INTERMEDIATES])
  forced = np.sort(np.asarray(moe_decoder.routes(
      state[moe_decoder.INTERMEDIATES])), axis=-1)
  return [forced[r, :len(s)] for r, s in enumerate(sequences)]


@pytest.mark.parametrize("player", ["lockstep", "lockstep_fresh_prefills",
                                    "engine_preempting"])
def test_episode_players_record_the_experts_of_every_id_they_fed(player):
  """Multi-turn episodes (the numbers environment of
  tests/test_engine_episodes.py) of a tiny Qwen3-MoE, played in lockstep
  (the cache extended between turns, or prefilled afresh every turn) and
  on the engine's slots in a pool that preempts: each episode's recorded
  experts of its opening, turns and answers are those a teacher-forced
  pass over the whole episode routes its ids to; the engine never feeds
  an episode's last id (-1), the lockstep loop feeds every drawn one."""
  import test_engine_episodes as numbers  # pylint: disable=g-import-not-at-top
  from jaxrlhf.agents import continuous  # pylint: disable=g-import-not-at-top
  from jaxrlhf.agents import episodes  # pylint: disable=g-import-not-at-top
  from jaxrlhf.agents import policies  # pylint: disable=g-import-not-at-top
  module, params, _, _ = _tiny(False)
  # The end-of-turn id's logit raised: turns of a few tokens.
  params = jax.tree.map(np.array, params)
  params["decoder"]["logits_dense"]["kernel"][:, numbers.END] *= 8.0
  limits = numbers.LIMITS
  length = limits.max_opening_tokens + limits.max_episode_tokens
  rows = [{"prompt": "", "row": r} for r in range(8)]
  if player.startswith("lockstep"):
    policy = policies.TurnPolicy(
        module, params, end_id=numbers.END, temperature=1.0,
        width=length + limits.max_turn_tokens,
        turn_tokens=limits.max_turn_tokens,
        extend_cache=player == "lockstep", record_routes=True)
    played, _ = episodes.run_episodes(
        numbers.Numbers, rows, policy, numbers.NumberRenderer(),
        episodes.Parser("qwen"), limits, numbers.KEY)
  else:
    policy = continuous.EpisodeEngine(
        module, params, end_id=numbers.END, temperature=1.0, num_slots=4,
        max_length=length, turn_tokens=limits.max_turn_tokens, page_size=4,
        num_pages=-(-length // 4), record_routes=True)
    played, stats = continuous.run_episodes(
        numbers.Numbers, rows, policy, numbers.NumberRenderer(),
        episodes.Parser("qwen"), limits, numbers.KEY)
    assert stats["preemptions"] > 0
  sequences = [e.opening + e.tokens for e in played]
  assert sum(e.turns for e in played) > len(played)  # several turns
  for e, sequence, forced in zip(played, sequences,
                                 _forced_routes(module, params, sequences)):
    recorded = np.sort(policy.routes(e.row, len(sequence)), axis=-1)
    assert recorded.shape == forced.shape
    fed = len(sequence) - (player == "engine_preempting")
    np.testing.assert_array_equal(recorded[:fed], forced[:fed])
    assert np.all(recorded[fed:] == -1)
  # A dense model records nothing.
  assert not policies.TurnPolicy(
      numbers.tiny_llama(numbers.VOCAB)[0], None, end_id=numbers.END,
      temperature=1.0, width=8, turn_tokens=2,
      record_routes=True).record_routes


def test_moe_episodes_carry_their_routes_to_the_update(tmp_path):
  """A GRPO step's episodes (tests/test_agent_training.py's guessing game,
  a tiny Qwen3-MoE policy whose turns end within a few tokens) played on
  the engine (online.engine 'auto'): the rollout carries an expert for
  every id the engine fed (the openings' and conversations', each
  episode's last id but one: -1 elsewhere), the trainer's scoring
  replaying them gives the sampler's own log-probs, and the update
  replays them."""
  from jaxrlhf.algorithms.online import episode_step  # pylint: disable=g-import-not-at-top
  import test_agent_training as agents  # pylint: disable=g-import-not-at-top
  config = agents._config(tmp_path)  # pylint: disable=protected-access
  config.model.arch, config.model.num_decoder_layers = "qwen3_moe", None
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("grpo")), config, mesh)
    assert trainer.online.router_replay
    state = trainer.init_state()
    policy = jax.tree.map(np.array, state.params["policy"])
    # The end-of-turn id's column scaled (negated: its logit is large and
    # positive for this initialisation's states) so that turns end early.
    policy["decoder"]["logits_dense"]["kernel"][
        :, trainer.vocabulary.eos_id] *= -8.0
    state = state.replace(params={"policy": policy})
    step = episode_step.EpisodeStep(trainer)
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                  rules)
    _, key, _ = iteration.split_step_key(state.rng)
    samples = step.parts.sample(state.params, state.frozen, batch, key)
    assert max(e.turns for e in samples.host["played"]) > 1
    rollout = step.parts.score(state.params, state.frozen, None, samples)
    present = np.asarray(samples.present, bool)
    last = np.zeros_like(present)
    last[np.arange(len(present)), present.sum(axis=1) - 1] = True
    fed = np.concatenate([np.asarray(samples.opening_mask, bool),
                          present & ~last], axis=1)
    routes = np.asarray(rollout.routes)
    assert np.all(routes[fed] >= 0) and np.all(routes[~fed] == -1)
    mask = np.asarray(rollout.mask, bool)
    np.testing.assert_allclose(np.asarray(rollout.logprobs)[mask],
                               np.asarray(rollout.sample_logprobs)[mask],
                               atol=1e-4)
    _assert_the_update_replays(trainer, state, rollout)
