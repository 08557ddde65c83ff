"""Multi-turn episodes on decode slots (`agents.continuous`) against the
lockstep turn sampler.

The truths: (1) an episode's ids, masks, rewards and sampler log-probs do
not depend on the slots or the chunk size (one slot against three, chunks
of 2 steps against whole turns); (2) the episodes are what a lockstep
`TurnPolicy` plays for them all with the same key
(`episodes.run_episodes`: a contiguous cache extended between turns);
(3) every drawn token is one slot-step, so the occupancy is the tokens
drawn over steps x slots, and with one slot it is 1; (4) a pool too
small for every episode at once (online.engine_pages) preempts episodes,
some mid-turn, and plays exactly the same episodes, every page given back
at the end.

A tiny random Llama (its end-of-turn id made likely, so turns have spread
lengths) plays an environment of numbers: the ids are the numbers of the
messages (a renderer with no chat template), each answer a block of a
length that varies with the row and the turn. And through the training
loop: a GRPO step on the agents' miniature (tests/test_agent_training.py)
is the same with one slot as with three, on a pool that preempts, and in
lockstep; and episodes played a step ahead of the update.
"""

import json

import jax
import numpy as np
import pytest

from jaxrlhf.agents import continuous
from jaxrlhf.agents import episodes
from jaxrlhf.agents import policies
from jaxrlhf.train import loop

from conftest import tiny_llama
from test_agent_training import policy_run  # pylint: disable=unused-import

# The tests read the engine's preempted turns (`_paused`).
# pylint: disable=protected-access

VOCAB = 32
END = 3
LIMITS = episodes.Limits(max_turns=4, max_episode_tokens=28,
                         max_turn_tokens=5, max_opening_tokens=8)
KEY = jax.random.PRNGKey(7)
ROWS = [{"prompt": "", "row": r} for r in range(5)]


class NumberRenderer:
  """Messages of numbers as their ids (no chat template)."""
  end_id = END

  def opening(self, messages, tools=None):
    del tools
    return [int(x) for x in messages[0]["content"].split()]

  def block(self, opening, new, tools=None):
    del opening, tools
    return [int(x) for m in new for x in m["content"].split()]

  def turn_text(self, ids):
    return " ".join(str(i) for i in ids if i != END)

  answer_text = turn_text


class Numbers:
  """Answers turn t of row r with 1 + (r + 2t) % 5 numbers and the turn's
  length as its reward; done after 2 + r % 3 turns."""

  def __init__(self, row):
    self.r, self.t = row["row"], 0

  def reset(self):
    return [{"role": "user",
             "content": " ".join(str(4 + (self.r * 5 + j) % 27)
                                 for j in range(2 + self.r % 4))}]

  def step(self, message):
    self.t += 1
    said = len(message["content"].split())
    block = " ".join(str(5 + (self.r * 3 + self.t * 7 + j) % 26)
                     for j in range(1 + (self.r + 2 * self.t) % 5))
    return ([{"role": "user", "content": block}], float(said),
            self.t >= 2 + self.r % 3)


class Said:
  """Rewards each turn with the length of what the model said (so that a
  group's episodes score apart); done after two steps."""

  def __init__(self, row):
    self.t = 0

  def reset(self):
    return [{"role": "user", "content": "Say something."}]

  def step(self, message):
    self.t += 1
    return ([{"role": "user", "content": "more"}],
            len(message["content"]) / 10.0, self.t >= 2)


class SaidNothing(Said):
  """`Said`, every return 0: no group varies."""

  def step(self, message):
    said, _, done = super().step(message)
    return said, 0.0, done


class SaidToRow(Said):
  """`Said`, with the row's answer added to the last turn's reward: the
  returns tell the prompts apart."""

  def __init__(self, row):
    super().__init__(row)
    self.answer = float(row["answer"])

  def step(self, message):
    said, reward, done = super().step(message)
    return said, reward + (self.answer if done else 0.0), done


@pytest.fixture(scope="module")
def tiny():
  model, params = tiny_llama(VOCAB)
  # The end-of-turn id's logit raised: turns of a few tokens, some cut.
  params["decoder"]["logits_dense"]["kernel"][:, END] *= 5.0
  return model, params


def play(tiny, rows=ROWS, key=KEY, **engine_options):
  model, params = tiny
  engine = continuous.EpisodeEngine(
      model, params, end_id=END, temperature=1.0, turn_tokens=5,
      max_length=LIMITS.max_opening_tokens + LIMITS.max_episode_tokens,
      page_size=4, **engine_options)
  played, stats = continuous.run_episodes(
      Numbers, rows, engine, NumberRenderer(), episodes.Parser("qwen"),
      LIMITS, key)
  return played, stats, engine


def assert_same(got, want):
  for g, w in zip(got, want):
    assert (g.opening, g.tokens, g.is_model) == (w.opening, w.tokens,
                                                 w.is_model)
    assert (g.step_rewards, g.turns, g.overflow, g.done) == (
        w.step_rewards, w.turns, w.overflow, w.done)
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-5)


@pytest.fixture(scope="module")
def three_slots(tiny):
  return play(tiny, num_slots=3)


def test_episodes_do_not_depend_on_slots_or_chunks(tiny, three_slots):
  played, _, _ = three_slots
  one, _, engine = play(tiny, num_slots=1, chunk_steps=2)
  assert_same(one, played)
  # The episodes are not trivial: several turns, spread lengths, cuts.
  assert sum(e.turns for e in played) > len(played)
  assert len({len(e.tokens) for e in played}) > 2
  # (3) one slot never idles: every step drew a token.
  drawn = sum(sum(e.is_model) for e in one)
  assert engine.useful_slot_steps == engine.decode_steps == drawn


def test_the_episodes_are_the_lockstep_policys(tiny, three_slots):
  model, params = tiny
  played, stats, engine = three_slots
  policy = policies.TurnPolicy(
      model, params, end_id=END, temperature=1.0,
      width=(LIMITS.max_opening_tokens + LIMITS.max_episode_tokens
             + LIMITS.max_turn_tokens), turn_tokens=5)
  lockstep, _ = episodes.run_episodes(
      Numbers, ROWS, policy, NumberRenderer(), episodes.Parser("qwen"),
      LIMITS, KEY)
  assert_same(played, lockstep)
  drawn = sum(sum(e.is_model) for e in played)
  assert engine.useful_slot_steps == drawn
  assert stats["preemptions"] == 0  # a pool for every episode at once
  # Every episode gave its pages back when it ended.
  assert int(engine.tables.num_free) == engine.tables.num_pages
  assert 0 < engine.pages_peak < engine.tables.num_pages
  assert stats["slot_occupancy"] == pytest.approx(
      drawn / (3 * engine.decode_steps))
  assert stats["decode_steps"] == engine.decode_steps


class Failing(Numbers):
  """Row 1's environment raises at its second step."""

  def step(self, message):
    if self.r == 1 and self.t == 1:
      raise KeyError("no such room")
    return super().step(message)


def test_a_failing_environment_drops_its_episode_alone(tiny, three_slots):
  limits = LIMITS
  try:
    globals()["LIMITS"] = episodes.Limits(**{
        **LIMITS.__dict__, "on_bad_row": "skip_and_report"})
    model, params = tiny
    engine = continuous.EpisodeEngine(
        model, params, end_id=END, temperature=1.0, turn_tokens=5,
        max_length=36, page_size=4, num_slots=2)
    played, _ = continuous.run_episodes(
        Failing, ROWS, engine, NumberRenderer(), episodes.Parser("qwen"),
        LIMITS, KEY)
  finally:
    globals()["LIMITS"] = limits
  assert "raised KeyError" in played[1].failure
  assert "row 1, turn 2" in played[1].failure
  assert played[1].turns == 2 and played[1].tokens == (
      three_slots[0][1].tokens[:len(played[1].tokens)])
  others = [e for i, e in enumerate(played) if i != 1]
  assert_same(others, [e for i, e in enumerate(three_slots[0]) if i != 1])
  assert int(engine.tables.num_free) == engine.tables.num_pages
  with pytest.raises(episodes.environments.EnvironmentFailure,
                     match="raised KeyError"):
    continuous.run_episodes(
        Failing, ROWS, engine, NumberRenderer(), episodes.Parser("qwen"),
        LIMITS, KEY)


def test_a_small_pool_preempts_and_plays_the_same_episodes(tiny):
  """(4): eight episodes on four slots and a pool of 9 pages of 4 (one
  longest episode: 36 positions) against a pool for all of them."""
  rows = [{"prompt": "", "row": r} for r in range(8)]
  want, _, _ = play(tiny, rows, num_slots=4)
  got, stats, engine = play(tiny, rows, num_slots=4, num_pages=9)
  assert_same(got, want)
  assert stats["preemptions"] == engine.preemptions > 0
  assert engine.tables.num_pages == 9 and engine.pages_peak <= 9
  # Every page given back, none lost to a preempted episode.
  assert int(engine.tables.num_free) == 9
  assert not engine.lengths.any() and not bool(engine.tables.exhausted)


def _first_chunk(model, params, openings, **options):
  """An engine of a slot per opening (episodes of up to 36 positions,
  turns of 5 tokens, pages of 4) with the openings prefilled and one
  chunk decoded: (engine, the turns that chunk ended)."""
  engine = continuous.EpisodeEngine(
      model, params, end_id=END, temperature=1.0, num_slots=len(openings),
      max_length=36, turn_tokens=5, page_size=4, **options)
  engine.reset(len(openings), KEY)
  engine.prefill([(i, o, 0, 5) for i, o in enumerate(openings)])
  return engine, engine.decode()


def _drain(engine, out):
  """`out` with every turn still under way decoded to its end."""
  while (engine.slot_episode >= 0).any():
    out.update(engine.decode())
  return out


def test_turns_preempted_mid_decode_go_on_with_their_draws(tiny):
  """Which episodes `run_episodes` preempts, and when, follows the
  environments' timing; here the engine alone: the five openings, one
  decode step, every turn still under way preempted (its first draw
  made) and started again on fresh pages. Each turn is the one drawn
  without preemption."""
  n = len(ROWS)
  openings = [NumberRenderer().opening(Numbers(row).reset()) for row in ROWS]

  def turns(preempt):
    engine, out = _first_chunk(*tiny, openings, chunk_steps=1)
    going = [i for i in range(n) if i not in out] if preempt else []
    for i in going:
      engine.preempt(i)
      assert len(engine._paused[i][0]) == 1
    if going:
      engine.decode()  # nothing live: the pages go back
      lengths = np.asarray(engine.tables.lengths)
      assert not lengths[going].any()
      assert int(engine.tables.num_free) == engine.tables.num_pages - sum(
          -(-lengths // 4))  # the turns that ended keep theirs
      engine.prefill([(i, openings[i], 0, 5) for i in going])
    return _drain(engine, out), engine, going

  want, _, _ = turns(False)
  got, engine, going = turns(True)
  assert going and engine.preemptions == len(going)
  assert sorted(got) == list(range(n))
  for i in range(n):
    assert got[i][0] == want[i][0] and got[i][2] == want[i][2]
    np.testing.assert_allclose(got[i][1], want[i][1], atol=2e-5)


def test_new_parameters_between_chunks(tiny):
  """Partial rollouts: the five openings' first turns on parameters A for
  one chunk of 2 steps, then on B (`update_params`, the cache recomputed).
  The ids drawn before the update are A's alone (a run on A throughout);
  every log-prob is that of the policy that drew its token: A's before,
  B's after, each against a full forward pass over the episode's ids."""
  model, a = tiny
  b = jax.tree.map(np.array, a)
  b["decoder"]["logits_dense"]["kernel"] *= -0.5  # another policy
  n = len(ROWS)
  openings = [NumberRenderer().opening(Numbers(row).reset()) for row in ROWS]

  def first_turns(update):
    engine, out = _first_chunk(model, a, openings, chunk_steps=2,
                               return_on_end=False)
    drawn_by_a = {i: len(ids) for i, (ids, _, _) in out.items()}
    if update:
      engine.update_params(b)
      under_way = engine.take_params()
      for i in under_way:
        drawn_by_a[i] = len(engine._paused[i][0])
      engine.prefill([(i, openings[i], 0, 5) for i in under_way])
    return _drain(engine, out), drawn_by_a, engine

  on_a, _, _ = first_turns(False)
  got, drawn_by_a, engine = first_turns(True)
  assert engine.param_updates == 1 and engine.preemptions == 0
  after = 0
  for i in range(n):
    ids, logprobs, _ = got[i]
    k = drawn_by_a[i]
    assert ids[:k] == on_a[i][0][:k]
    sequence = np.asarray(openings[i] + ids, np.int32)[None]
    for params, part in ((a, slice(0, k)), (b, slice(k, len(ids)))):
      logits = model.apply(
          {"params": params}, sequence,
          np.arange(sequence.shape[1], dtype=np.int32)[None],
          np.ones_like(sequence))
      # Turn token j is predicted at the column before it.
      full = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32)))
      columns = len(openings[i]) - 1 + np.arange(len(ids))[part]
      np.testing.assert_allclose(
          logprobs[part], full[columns, sequence[0, columns + 1]],
          atol=1e-4)
    after += len(ids) - k
  # Some turns went on after the update, some drew on A first.
  assert after > 0 and any(drawn_by_a.values())


class UpdatedAfterThreeChunks(continuous.EpisodeEngine):
  """Hands itself its own parameters again during its fourth chunk."""
  chunks = 0

  def decode(self):
    self.chunks += 1
    if self.chunks == 4:
      self.update_params(jax.tree.map(np.array, self.params))
    return super().decode()


def test_run_episodes_takes_new_parameters_between_chunks(tiny,
                                                          three_slots):
  """The same parameters handed over mid-run: every episode's cache is
  recomputed and the episodes are the ones played without."""
  model, params = tiny
  engine = UpdatedAfterThreeChunks(
      model, params, end_id=END, temperature=1.0, turn_tokens=5,
      max_length=36, page_size=4, num_slots=3)
  played, stats = continuous.run_episodes(
      Numbers, ROWS, engine, NumberRenderer(), episodes.Parser("qwen"),
      LIMITS, KEY)
  assert engine.param_updates == 1 and stats["preemptions"] == 0
  assert_same(played, three_slots[0])
  assert int(engine.tables.num_free) == engine.tables.num_pages
  # The same through `params_source`, polled before each chunk: given
  # from the fourth poll on, taken once (the same parameters are not taken
  # again), and reported.
  polls = []
  given = jax.tree.map(np.array, params)

  def source():
    polls.append(1)
    return given if len(polls) >= 4 else None
  engine = continuous.EpisodeEngine(
      model, params, end_id=END, temperature=1.0, turn_tokens=5,
      max_length=36, page_size=4, num_slots=3)
  engine.params_source = source
  played, stats = continuous.run_episodes(
      Numbers, ROWS, engine, NumberRenderer(), episodes.Parser("qwen"),
      LIMITS, KEY)
  assert len(polls) > 4 and stats["param_updates"] == 1
  assert_same(played, three_slots[0])


def test_bad_slots_are_one_line(tiny):
  with pytest.raises(ValueError, match="num_slots must be a positive int"):
    continuous.EpisodeEngine(*tiny, end_id=END, temperature=1.0,
                             num_slots=0, max_length=8, turn_tokens=2)
  # One episode of 36 positions takes 9 pages of 4.
  with pytest.raises(ValueError, match=r"online.engine_pages: 8 pages .* "
                     r"at least 9"):
    continuous.EpisodeEngine(*tiny, end_id=END, temperature=1.0,
                             num_slots=2, max_length=36, turn_tokens=5,
                             page_size=4, num_pages=8)


def test_a_grpo_step_on_episodes_is_the_same_on_one_slot_as_on_three(
    policy_run):
  """`online.engine='continuous'` through the training loop (the agents'
  miniature config, its biased tiny Qwen2): the step's episodes, rewards
  and loss do not depend on `online.engine_slots`, nor on a pool of
  `online.engine_pages` that preempts (8 pages of 16: one episode of 64 +
  60 positions), and are the lockstep loop's."""
  logged = {}
  for slots, pages in ((1, None), (3, None), (3, 8), ("lockstep", None)):
    engine = {"online__engine": "lockstep"} if slots == "lockstep" else {
        "online__engine": "continuous", "online__engine_slots": slots,
        "online__engine_pages": pages}
    (logged[slots, pages],) = _episode_steps(
        policy_run, f"continuous_{slots}_{pages}", 1, **engine)
  one, three, small, lockstep = (logged[1, None], logged[3, None],
                                 logged[3, 8], logged["lockstep", None])
  assert one["episode/slot_occupancy"] == 1.0
  assert 0 < three["episode/slot_occupancy"] <= 1.0
  assert one["episode/preemptions"] == three["episode/preemptions"] == 0
  assert small["episode/preemptions"] > 0
  # Several turns (an environment between), rewards that differ.
  assert one["episode/turns"] > 1 and one["advantage_abs_mean"] > 0
  for other in (three, small, lockstep):
    _same_steps(other, one)


def _episode_steps(policy_run, name, steps, environment="Said",
                   **overrides):
  """The logged rows of a GRPO run of `steps` steps on the agents'
  miniature config (its biased tiny Qwen2, the episodes of `environment`,
  a class here) with `overrides`, one per step."""
  from test_agent_training import _config  # pylint: disable=g-import-not-at-top
  config = _config(policy_run["root"], **overrides)
  config.train.num_steps = steps
  config.online.environment = f"test_engine_episodes:{environment}"
  config.init.policy_checkpoint = policy_run["workdir"]
  workdir = policy_run["root"] / name
  loop.train(config, str(workdir), devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return [r for r in rows if "episode/turns" in r]


def _same_steps(got, want):
  """Every logged figure of `want` but the timing's and the engine's
  counts is `got`'s."""
  timing = ("seconds", "occupancy", "decode_steps", "preemptions",
            "param_updates")
  for name, value in want.items():
    if isinstance(value, float) and not any(t in name for t in timing):
      # The gap is a difference of near-equal log-probs, each sampler's
      # to its rounding (a batch of 1 or 3 slots, or all 4 episodes).
      atol = 1e-5 if name.startswith("gap/") else 1e-6
      assert got[name] == pytest.approx(value, rel=1e-5, abs=atol), name


def test_episodes_ahead_with_dynamic_sampling(policy_run):
  """DAPO's dynamic sampling on episodes played k = 2 steps ahead: each
  step ahead plays as many rounds of prompts as it needs, from the batches
  after those of the steps in flight. With parameters held still that is
  the on-policy run, step for step, rounds included (they differ by step
  here: a group whose two episodes said as much scores alike). The
  returns count the rows' answers (`SaidToRow`), so a step ahead that
  played other prompts would log another reward."""
  options = dict(grpo__dynamic_sampling=True, grpo__max_sampling_rounds=3,
                 optimizer__learning_rate=1e-30)
  on, ahead = (_episode_steps(policy_run, f"dynamic_{k}", 4, "SaidToRow",
                              online__off_policy_steps=k, **options)
               for k in (0, 2))
  assert len({r["dynamic_sampling/rounds"] for r in on}) > 1
  assert len(ahead) == len(on) == 4
  for got, want in zip(ahead, on):
    _same_steps(got, want)


def test_partial_rollouts_play_every_later_round_on_the_new_parameters(
    policy_run):
  """online.partial_rollouts with dynamic sampling, one step ahead, every
  group tied (`SaidNothing`: each step samples its cap of 2 rounds): the
  second step's first round takes the update's parameters between two
  chunks, and its second round starts from them, so both count a
  handover."""
  rows = _episode_steps(policy_run, "partial_rounds", 2, "SaidNothing",
                        grpo__dynamic_sampling=True,
                        grpo__max_sampling_rounds=2,
                        online__off_policy_steps=1,
                        online__partial_rollouts=True)
  assert [r["dynamic_sampling/rounds"] for r in rows] == [2.0, 2.0]
  assert [r["episode/param_updates"] for r in rows] == [0.0, 2.0]


def test_episodes_one_step_ahead_of_the_update(policy_run):
  """online.off_policy_steps=1 on episodes: step t+1's episodes are played
  with step t's parameters while step t's update runs. With a learning
  rate too small to move a weight the run is the on-policy one, step for
  step (the same prompts and keys ahead); with one that moves them, the
  first step (which samples with its own parameters) is still the
  on-policy one, and the second trains on episodes of the parameters
  before the first update: its ratios start away from 1 (approx_kl_k1),
  where the on-policy step's start at 1."""
  still = dict(optimizer__learning_rate=1e-30)
  on_still, ahead = (_episode_steps(policy_run, f"ahead_still_{k}", 2,
                                    online__off_policy_steps=k, **still)
                     for k in (0, 1))
  for got, want in zip(ahead, on_still):
    _same_steps(got, want)
  on, ahead = (_episode_steps(policy_run, f"ahead_{k}", 2,
                              online__off_policy_steps=k) for k in (0, 1))
  _same_steps(ahead[0], on[0])
  assert abs(on[1]["approx_kl_k1"]) < 1e-6
  assert abs(ahead[1]["approx_kl_k1"]) > 1e-5
  # The decoupled correction re-scores the stale episodes with the
  # parameters the update starts from: the ratios start at 1 again, and
  # the lag is in the importance weights.
  decoupled = _episode_steps(policy_run, "ahead_decoupled", 2,
                             online__off_policy_steps=1,
                             online__off_policy_correction="decoupled")
  assert abs(decoupled[1]["approx_kl_k1"]) < 1e-6
  assert abs(decoupled[1]["correction/weight_mean"] - 1.0) > 1e-3
  # online.partial_rollouts: the second step's episodes take the first
  # update's parameters once it is done, between two decode chunks
  # (where depends on when it ends). With parameters the update does not
  # move, the handover changes no token: the on-policy run, wherever it
  # falls. With parameters it moves, each token's old log-prob is the
  # sampler's own (the gap between them is then nothing).
  partial_still = _episode_steps(policy_run, "ahead_partial_still", 2,
                                 online__off_policy_steps=1,
                                 online__partial_rollouts=True, **still)
  assert [r["episode/param_updates"] for r in partial_still] == [0.0, 1.0]
  for got, want in zip(partial_still, on_still):
    _same_steps(got, want)
  partial = _episode_steps(policy_run, "ahead_partial", 2,
                           online__off_policy_steps=1,
                           online__partial_rollouts=True)
  assert [r["episode/param_updates"] for r in partial] == [0.0, 1.0]
  _same_steps(partial[0], on[0])
  assert partial[1]["gap/k1"] == partial[1]["gap/k3"] == 0.0
