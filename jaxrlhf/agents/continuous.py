"""Multi-turn episodes on decode slots: a turn that waits on its
environment frees its slot.

`episodes.run_episodes` decodes every live episode's turn in lockstep, then
steps every environment, then extends every cache: a short turn's row
idles until the longest turn ends, and the device idles while the
environments run. Here (`run_episodes`, same arguments and results, an
`EpisodeEngine` in place of the policy) E episodes share S decode slots:

  * every episode's KV cache lives on pages of one pool (`paged_kv`), its
    page table indexed by episode, not by slot, so an episode keeps its
    earlier turns' pages while it has no slot;
  * the host runs compiled chunks of at most `chunk_steps` decode steps of
    the live slots (`EpisodeEngine.decode`); a chunk returns as soon as a
    slot's turn ends (its end-of-turn id, or its budget), or with
    `return_on_end=False` after its steps (fewer returns to the host, the
    slots of ended turns idle until then: experiments/bench_agents.py
    measures both);
  * a finished turn frees its slot; its environment's step is submitted at
    once to a thread pool, and the host goes on decoding the others;
  * when an environment answers, its block of ids is prefilled onto the
    episode's own pages at its length (earlier turns never recomputed) in
    a free slot (`EpisodeEngine.prefill`, several episodes in one call);
    new episodes (their openings) fill free slots the same way;
  * an episode ends, and gives its pages back, as the lockstep loop's
    rules say (the same `episodes.Opened` steps);
  * the pool (`EpisodeEngine` num_pages, online.engine_pages) may be
    smaller than every episode at its longest: a chunk stops before a
    step its free pages do not cover, and a turn that needs a page when
    none is free preempts an episode (`run_episodes` says which): its
    pages go back, and when it next gets a slot its whole sequence so far
    (opening, turns, answers, the preempted turn's draws) is prefilled
    again onto fresh pages and its turn goes on with the key it had. A
    preempted episode draws what it draws without preemption;
  * new parameters handed over (`EpisodeEngine.update_params`, partial
    rollouts) are taken between two chunks: the tokens drawn before keep
    the old policy's log-probs, and every episode's cache is recomputed
    with the new (the same preemption, its whole sequence prefilled
    again).

Every drawn token is fed, as the lockstep sampler feeds it, but one step
later: a slot's step feeds the token its episode drew last (or the last id
of its opening or block) and draws the next, so a block is prefilled
together with the end-of-turn id before it, and an episode's last token,
never read, is never fed. With `record_routes` (router replay) every
write records the experts of the ids it feeds at their positions
(`EpisodeEngine.routes`; an episode prefilled again records its latest).

The draws are the lockstep loop's: episode i's turn t draws from
fold_in(key, t), split once per token as `turn_sampler.decode` splits its
key (`turn_sampler.choose`), each draw row i of that key's draw over all
the episodes (`row_draws`), on the episode's logits alone; so an
episode's ids and log-probs depend neither on the slots, the chunk size
nor when its environment answers, and are those the lockstep loop
(`episodes.run_episodes` with a `TurnPolicy`) plays with the same key
(log-probs to float rounding, and so a token where two candidates' noisy
logits tie to that rounding; tests/test_engine_episodes.py). A turn's
budget is the room left in max_episode_tokens (at most max_turn_tokens),
which cuts a turn where the lockstep loop cuts it.

The stats: decode steps (chunk iterations), slot occupancy (slot-steps
that drew a token / decode steps x S), preemptions, env_seconds (the
wall time the host waited on environments with no slot to decode: the
device idle), and env_hidden_seconds (the device's chunk and prefill
time while at least one environment was running: environment time hidden
behind decoding).
"""

import concurrent.futures
import functools
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.agents import environments
from jaxrlhf.agents import episodes as episodes_lib
from jaxrlhf.agents import turn_sampler
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import row_draws
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import paged_kv
from jaxrlhf.models.layers import param_recording

# pylint: disable=protected-access


def _rows(tables: paged_kv.PageTables, episodes: jax.Array):
  """The page-table rows [k, max_pages] and lengths [k] of `episodes` [k]
  (an index out of range: no pages, length 0)."""
  return (tables.page_table.at[episodes].get(mode="fill",
                                             fill_value=tables.num_pages),
          tables.lengths.at[episodes].get(mode="fill", fill_value=0))


def _write(model, params, pool, tables, episodes, tokens, real,
           routes=None):
  """`tokens` [k, L] of `episodes` [k] (each row's first real[k] ids,
  then pads) written at each episode's length, its pages reserved: the
  model's decode step over the pool -> (float32 logits [k, vocab] after
  the last column, pool, tables, routes). A pad sits past its row's real
  ids, at positions whose pages are not reserved (dropped) or that the
  episode's next token writes before any query reads them. `routes` [E,
  max_length, moe layers, top_k] (router replay; None: not recorded)
  comes back with the real ids' experts at their positions."""
  _, start = _rows(tables, episodes)
  tables = paged_kv.reserve(
      tables, tables.lengths.at[episodes].set(start + real, mode="drop"))
  page_table, _ = _rows(tables, episodes)
  index = paged_kv.PagedIndex(page_table, start, tables.page_size)
  columns = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  positions = start[:, None] + columns
  logits, pool, routed = sampling.decode_step(
      model, {"params": params, "cache": pool}, tokens, positions, None,
      index, routes=routes is not None)
  if routes is not None:  # (a pad's position is dropped)
    at = jnp.where(columns < real[:, None], positions, routes.shape[1])
    routes = routes.at[episodes[:, None], at].set(routed, mode="drop")
  return logits.astype(jnp.float32), pool, tables, routes


@functools.lru_cache(maxsize=4)
def _pool_shapes(model, params_shapes, num_pages, page_size):
  """`paged_kv.make_pool`'s shapes (traced once per model and size)."""
  params = jax.tree.unflatten(params_shapes[0], params_shapes[1])
  return jax.eval_shape(lambda p: paged_kv.make_pool(model, p, num_pages,
                                                     page_size), params)


def _pool(model, params, num_pages, page_size):
  """Zero page pools for `model` (`paged_kv.make_pool`)."""
  leaves, tree = jax.tree.flatten(params)
  shapes = (tree, tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                        for x in leaves))
  try:
    hash(shapes)
    hash(model)
  except TypeError:
    return paged_kv.make_pool(model, params, num_pages, page_size)
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                      _pool_shapes(model, shapes, num_pages, page_size))


def _prefill(model, params, pool, tables, episodes, tokens, real, routes):
  model = sampling._inference_module(model)
  _, pool, tables, routes = _write(model, params, pool, tables, episodes,
                                   tokens, real, routes)
  return pool, tables, routes


def _decode_params(model, params, pool, tables, fuse_projections):
  """`params` as the decode steps read them (`sampling._decode_params`),
  from the reads of one step traced (never run)."""
  model = sampling._inference_module(model)
  one = jnp.zeros((1,), jnp.int32)
  with param_recording.recording_param_reads() as reads, \
      param_recording.recording_param_fusions() as fusions:
    jax.eval_shape(lambda p: _write(model, p, pool, tables, one,
                                    one[:, None], one), params)
  return sampling._decode_params(params, reads, fusions, fuse_projections)


def _decode(model, params, pool, tables, slot_episode, pending, drawn,
            budget, rng, live, tokens, logprobs, routes, max_steps, end_id,
            temperature, greedy, return_on_end):
  """At most max_steps decode steps of the live slots, with return_on_end
  stopping after a step in which some slot's turn ended. Slot arrays
  [S]: slot_episode (its episode), pending (the id to feed), drawn (this
  turn's tokens so far), budget (this turn's most), rng [S, ...] (its
  turn's key), live; tokens / logprobs [S, max_turn_tokens] this turn's
  draws; routes: the episodes' experts (`_write`), or None."""
  model = sampling._inference_module(model)
  slots = slot_episode.shape[0]
  rows = jnp.arange(slots, dtype=jnp.int32)

  def draw(key, logits, episode):
    key, token, logprob = turn_sampler.choose(logits[None], key, temperature,
                                              greedy, row=episode)
    return key, token[0], logprob[0]

  def body(carry):
    (pool, tables, pending, drawn, rng, live, tokens, logprobs, steps,
     useful, _, routes) = carry
    episode = jnp.where(live, slot_episode, tables.lengths.shape[0])
    logits, pool, tables, routes = _write(
        model, params, pool, tables, episode, pending[:, None],
        live.astype(jnp.int32), routes)
    row_draws.check_rows(tables.lengths.shape[0], logits.shape[-1])
    rng, token, logprob = jax.vmap(draw)(rng, logits, slot_episode)
    at = jnp.where(live, rows, slots)  # a slot not live writes nothing
    tokens = tokens.at[at, drawn].set(token, mode="drop")
    logprobs = logprobs.at[at, drawn].set(logprob, mode="drop")
    drawn = drawn + live.astype(jnp.int32)
    ended = live & ((token == end_id) | (drawn >= budget))
    return (pool, tables, jnp.where(live, token, pending), drawn, rng,
            live & ~ended, tokens, logprobs, steps + 1,
            useful + jnp.sum(live, dtype=jnp.int32), jnp.any(ended), routes)

  def going(carry):
    tables, live, steps, any_ended = carry[1], carry[5], carry[8], carry[10]
    # A step that would need more fresh pages than are free is not taken:
    # the host preempts an episode first (`run_episodes`).
    held = tables.lengths[jnp.where(live, slot_episode, 0)]
    need = jnp.sum(live & (held % tables.page_size == 0), dtype=jnp.int32)
    going = ((steps < max_steps) & jnp.any(live)
             & (need <= tables.num_free))
    return going & ~any_ended if return_on_end else going

  zero = jnp.int32(0)
  carry = (pool, tables, pending, drawn, rng, live, tokens, logprobs, zero,
           zero, jnp.zeros((), bool), routes)
  out = jax.lax.while_loop(going, body, carry)
  return out[:10] + out[11:]


def _assign(slots, key, slot, episode, turn, pending, budget, resume,
            saved_rng, drawn, tokens, logprobs):
  """The slots' arrays (`_decode`'s) with slot[k] starting episode[k]'s
  turn turn[k]: its key fold_in(key, turn), the id to feed, the turn's
  budget, none drawn; or, where resume[k], going on with a preempted
  turn: its key as it was (saved_rng[k]), its drawn[k] tokens and
  log-probs (tokens / logprobs [k, max_turn_tokens]). All [k]; a slot
  index S is dropped."""
  keys = jax.vmap(lambda t: jax.random.fold_in(key, t))(turn)
  put = lambda old, new: old.at[slot].set(new.astype(old.dtype),
                                          mode="drop")
  return dict(slots, pending=put(slots["pending"], pending),
              budget=put(slots["budget"], budget),
              drawn=put(slots["drawn"], drawn),
              tokens=put(slots["tokens"], tokens),
              logprobs=put(slots["logprobs"], logprobs),
              rng=slots["rng"].at[slot].set(keys, mode="drop").at[
                  jnp.where(resume, slot, slots["pending"].shape[0])].set(
                      saved_rng, mode="drop"))


_prefill_jit = sampling._jit_static(_prefill, ("model",))
_assign_jit = jax.jit(_assign)
_decode_params_jit = sampling._jit_static(_decode_params,
                                          ("model", "fuse_projections"))
_decode_jit = sampling._jit_static(
    _decode, ("model", "end_id", "temperature", "greedy", "return_on_end"))
_release_jit = jax.jit(paged_kv.release)


class EpisodeEngine:
  """E episodes' pages and S decode slots on the device (module
  docstring); `run_episodes` drives it, and chooses which episode to
  preempt when the pool runs short.

  Args:
    model, params: a decoder-only module whose attention reads pages
      (`attentions.Attention`: Llama, Qwen, Gemma, ...) and its parameters
      (the policy's view: LoRA adapters merged by the caller).
    end_id: the end-of-turn id.
    temperature: the sampling temperature (0: greedy).
    num_slots: S, the turns decoded at once.
    max_length: the most positions an episode holds (its opening and
      conversation).
    turn_tokens: a turn's most tokens.
    page_size: positions per page.
    chunk_steps: the most decode steps between two returns to the host
      (None: turn_tokens).
    return_on_end: a chunk returns as soon as a turn ends (its slot free
      at once, its environment stepped at once); False: after chunk_steps
      steps (or none live), fewer returns but slots idle until then.
    num_pages: the pool's pages (online.engine_pages); None: E x the pages
      of max_length, never short. Fewer: episodes are preempted when a
      turn needs a page and none is free (`run_episodes`); at least the
      pages of one max_length episode.
    record_routes: keep the experts of every id each episode feeds
      (`routes`: router replay; a mixture-of-experts model's only), those
      of its latest prefill where it was prefilled again.
  """

  def __init__(self, model, params, *, end_id: int, temperature: float,
               num_slots: int, max_length: int, turn_tokens: int,
               page_size: int = 16, chunk_steps: Optional[int] = None,
               return_on_end: bool = True, num_pages: Optional[int] = None,
               record_routes: bool = False):
    for field, value in (("num_slots", num_slots), ("max_length", max_length),
                         ("turn_tokens", turn_tokens),
                         ("page_size", page_size),
                         ("chunk_steps", chunk_steps or 1),
                         ("num_pages", num_pages or 1)):
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"EpisodeEngine: {field} must be a positive int, "
                         f"got {value!r}.")
    self.model, self.params = model, params
    self.end_id, self.temperature = int(end_id), float(temperature)
    self.num_slots, self.turn_tokens = int(num_slots), int(turn_tokens)
    self.max_length, self.page_size = int(max_length), int(page_size)
    self.max_pages = paged_kv.pages_for(self.max_length, self.page_size)
    if num_pages is not None and num_pages < self.max_pages:
      raise ValueError(
          f"online.engine_pages: {num_pages} pages of {self.page_size} "
          f"positions cannot hold one longest episode ({self.max_length} "
          f"positions: {self.max_pages} pages); set it to at least "
          f"{self.max_pages}, or unset it.")
    self.num_pages = None if num_pages is None else int(num_pages)
    self.chunk_steps = int(chunk_steps or turn_tokens)
    self.return_on_end = bool(return_on_end)
    self.record_routes = sampling.records_routes(model, record_routes)
    self.decode_steps = 0
    self.useful_slot_steps = 0
    self.prefills = 0
    self.pages_peak = 0
    self.preemptions = 0
    self.param_updates = 0
    self._next_params, self._lock = None, threading.Lock()
    # Polled by `take_params`: () -> the newest parameters, or None (the
    # online step's partial rollouts: the update beside it, once done);
    # taken when they are not the ones it last gave.
    self.params_source = None
    self._sourced = None

  # --- the pool, by episode --------------------------------------------------

  def reset(self, num_episodes: int, key) -> None:
    """An empty pool (`num_pages`, or `num_episodes` episodes at their
    longest) and S free slots; `key` the episodes' sampling key."""
    if self.temperature > 0:
      row_draws.check_key(key)
    num_pages = self.num_pages or num_episodes * self.max_pages
    self.key = key
    # A pool of the right size is reused as it is: every position is
    # written before any query reads it.
    if getattr(self, "pool", None) is None or self._num_pages != num_pages:
      self.pool = _pool(self.model, self.params, num_pages, self.page_size)
      self._num_pages = num_pages
    self.tables = paged_kv.init_tables(num_pages, self.page_size,
                                       num_episodes, self.max_pages)
    self._dparams = _decode_params_jit(
        model=self.model, params=self.params, pool=self.pool,
        tables=self.tables, fuse_projections=True)
    s, m = self.num_slots, self.turn_tokens
    self.slot_episode = np.full((s,), -1, np.int64)
    # The slots' device arrays (`_decode`'s).
    self._slots = dict(
        pending=jnp.zeros((s,), jnp.int32), drawn=jnp.zeros((s,), jnp.int32),
        budget=jnp.ones((s,), jnp.int32), rng=jnp.stack([key] * s),
        tokens=jnp.zeros((s, m), jnp.int32),
        logprobs=jnp.zeros((s, m), jnp.float32))
    self._to_release: List[int] = []
    # The host's copy of the positions each episode holds pages for (the
    # device's `tables.lengths` after every call), and the turns preempted
    # mid-decode: episode -> (ids, log-probs, key, budget).
    self.lengths = np.zeros((num_episodes,), np.int64)
    self._paused: Dict[int, Tuple[List[int], List[float], Any, int]] = {}
    # The experts of each episode's fed ids by position (-1: none fed),
    # on the device, and its host copy once read (`routes`).
    self._routes = self._host_routes = None
    if self.record_routes:
      self._routes = jnp.full(
          (num_episodes, self.max_length)
          + moe_decoder.route_shape(self.model.config), -1, jnp.int32)

  def routes(self, episode: int, length: int) -> np.ndarray:
    """int32 [length, moe layers, top_k]: the experts of the episode's
    first `length` ids (`record_routes`); -1 for an id never fed (an
    episode's last)."""
    if self._host_routes is None:
      self._host_routes = np.asarray(jax.device_get(self._routes))
    return self._host_routes[episode, :length]

  def free_slots(self) -> List[int]:
    return [s for s in range(self.num_slots) if self.slot_episode[s] < 0]

  def free_pages(self) -> int:
    """The pool's free pages (with the releases not yet flushed)."""
    return self.tables.num_pages - int(np.sum(paged_kv.pages_for(
        self.lengths, self.page_size)))

  def pages_to_start(self, episode: int, sequence: Sequence[int]) -> int:
    """The fresh pages `prefill` takes to start `episode` with its
    `sequence` so far (its preempted turn's ids added), through the first
    position its slot feeds."""
    total = len(sequence) + len(self._paused.get(episode, ((),))[0])
    return (paged_kv.pages_for(total, self.page_size)
            - paged_kv.pages_for(int(self.lengths[episode]), self.page_size))

  def pages_short(self) -> int:
    """The fresh pages the live slots' next decode step takes beyond the
    free ones (> 0: the step cannot be taken; preempt an episode)."""
    live = self.slot_episode[self.slot_episode >= 0]
    need = int(np.sum(self.lengths[live] % self.page_size == 0))
    return need - self.free_pages()

  def holders(self) -> List[int]:
    """The episodes that hold pages or a slot (those `preempt` frees)."""
    return sorted(set(np.flatnonzero(self.lengths > 0).tolist())
                  | set(self.slot_episode[self.slot_episode >= 0].tolist()))

  def live(self, episode: int) -> bool:
    return bool(np.any(self.slot_episode == episode))

  def release(self, episode: int) -> None:
    """Episode `episode` is over: its pages go back (with the next call)."""
    self._to_release.append(int(episode))
    self.lengths[episode] = 0

  def preempt(self, episode: int, count: bool = True) -> None:
    """Episode `episode`'s pages go back to the free list (with the next
    call) and its slot, if it has one, is freed, its turn's draws and key
    kept: its next `prefill` writes its whole sequence again onto fresh
    pages and goes on with the turn where it stopped (`count`: one more
    of `preemptions`)."""
    for slot in np.flatnonzero(self.slot_episode == episode):
      d = self._slots
      tokens, logprobs, drawn, budget = jax.device_get(
          (d["tokens"][slot], d["logprobs"][slot], d["drawn"][slot],
           d["budget"][slot]))
      n = int(drawn)
      self._paused[int(episode)] = (
          [int(x) for x in tokens[:n]], [float(x) for x in logprobs[:n]],
          d["rng"][slot], int(budget))
      self.slot_episode[slot] = -1
    self.release(episode)
    self.preemptions += int(count)

  # --- new parameters between chunks (partial rollouts) ---------------------

  def update_params(self, params) -> None:
    """Hands the engine new parameters (same structure), from any thread:
    `take_params` takes them between two chunks (`run_episodes` does
    before each), so a turn under way draws its next tokens with them.

    Each model token's log-prob is that of the parameters that drew it
    (the chunk's). The KV cache is recomputed with the new parameters:
    every episode holding pages is preempted (not counted in
    `preemptions`) and prefilled again with its whole sequence, so the
    tokens after the update are exactly the new policy's continuing the
    same prefix, and the trainer's recomputed log-probs match the
    sampler's up to rounding. AReaL and PipelineRL keep the old
    parameters' keys and values instead (no recompute; the new policy
    reads a stale cache, so its tokens are drawn from neither policy
    exactly); the recompute costs one prefill of the held positions per
    update, which is small against a rollout's decode."""
    with self._lock:
      self._next_params = params

  def take_params(self) -> List[int]:
    """Takes the parameters handed over by `update_params`, or given by
    `params_source` (when they are not the ones it gave last time), if any
    (their decode view rebuilt, every episode's pages given back): the
    episodes whose turns were under way, now without a slot, to start
    again (their draws and keys kept). Nothing handed over: []."""
    if self.params_source is not None:
      new = self.params_source()
      if new is not None and new is not self._sourced:
        self._sourced = new
        self.update_params(new)
    with self._lock:
      params, self._next_params = self._next_params, None
    if params is None:
      return []
    self.params = params
    self.param_updates += 1
    under_way = [int(i) for i in self.slot_episode if i >= 0]
    for i in self.holders():
      self.preempt(i, count=False)
    self._dparams = _decode_params_jit(
        model=self.model, params=self.params, pool=self.pool,
        tables=self.tables, fuse_projections=True)
    return under_way

  def _flush_releases(self) -> None:
    if self._to_release:
      which = np.zeros((self.tables.lengths.shape[0],), bool)
      which[self._to_release] = True
      self.tables = _release_jit(self.tables, which)
      self._to_release = []

  def prefill(self, starts: Sequence[Tuple[int, Sequence[int], int, int]]
              ) -> None:
    """Starts turns: per (episode, sequence, turn, budget), the episode's
    `sequence` so far (its opening and conversation; a preempted turn's
    draws are added here) but the last id written onto its pages from
    what they hold on, and a free slot set to feed the last and draw at
    most `budget` tokens with the turn's key fold_in(key, turn), as the
    episode's row of the lockstep batch draws; a preempted turn goes on
    with its own key, draws and budget. The caller checks the pages
    (`pages_to_start`)."""
    self._flush_releases()
    free = self.free_slots()
    if not 0 < len(starts) <= len(free):
      raise ValueError(f"EpisodeEngine.prefill: {len(starts)} turns for "
                       f"{len(free)} free slots.")
    count = turn_sampler.bucket(len(starts), 1)
    rows = []
    for i, sequence, turn, most in starts:
      ids, logprobs, rng, most = self._paused.pop(
          i, ([], [], self.key, most))
      held = int(self.lengths[i])
      rows.append((i, list(sequence[held:]) + ids, turn, most, ids,
                   logprobs, rng))
    longest = max(len(r[1]) - 1 for r in rows)
    if longest:
      tokens = np.zeros((count, turn_sampler.bucket(longest, 8)), np.int32)
      real = np.zeros((count,), np.int32)
      episodes = np.full((count,), self.tables.lengths.shape[0], np.int32)
      for r, (i, ids, *_) in enumerate(rows):
        tokens[r, :len(ids) - 1] = ids[:-1]
        real[r], episodes[r] = len(ids) - 1, i
        self.lengths[i] += len(ids) - 1
      self.pool, self.tables, self._routes = _prefill_jit(
          model=self.model, params=self.params, pool=self.pool,
          tables=self.tables, episodes=episodes, tokens=tokens, real=real,
          routes=self._routes)
      self._host_routes = None
      self.prefills += 1
    # The slots' new turns, padded to a bucket (slot S: dropped).
    m = self.turn_tokens
    slot = np.full((count,), self.num_slots, np.int32)
    episode, turn, last, budget, drawn = (np.zeros((count,), np.int32)
                                          for _ in range(5))
    resume = np.zeros((count,), bool)
    tokens, logprobs = np.zeros((count, m), np.int32), np.zeros(
        (count, m), np.float32)
    keys = [self.key] * count
    for r, (free_slot, (i, ids, t, most, drew, logs, rng)) in enumerate(
        zip(free, rows)):
      self.slot_episode[free_slot] = i
      slot[r], episode[r], turn[r], last[r], budget[r] = (free_slot, i, t,
                                                          ids[-1], most)
      resume[r], drawn[r], keys[r] = bool(drew), len(drew), rng
      tokens[r, :len(drew)], logprobs[r, :len(drew)] = drew, logs
    self._slots = _assign_jit(self._slots, self.key, slot, episode, turn,
                              last, budget, resume, jnp.stack(keys), drawn,
                              tokens, logprobs)

  def decode(self) -> Dict[int, Tuple[List[int], List[float], bool]]:
    """One chunk of decode steps (stopping before a step the free pages do
    not cover): {episode: (the turn's ids, their log-probs, whether it
    ended at the end-of-turn id)} of the turns that ended (their slots
    now free)."""
    self._flush_releases()
    live = self.slot_episode >= 0
    d = self._slots
    greedy = self.temperature <= 0
    (self.pool, self.tables, d["pending"], d["drawn"], d["rng"], live_after,
     d["tokens"], d["logprobs"], steps, useful, self._routes) = _decode_jit(
         model=self.model, params=self._dparams, pool=self.pool,
         tables=self.tables,
         slot_episode=np.maximum(self.slot_episode, 0).astype(np.int32),
         pending=d["pending"], drawn=d["drawn"], budget=d["budget"],
         rng=d["rng"], live=live, tokens=d["tokens"],
         logprobs=d["logprobs"], routes=self._routes,
         max_steps=np.int32(self.chunk_steps),
         end_id=self.end_id,
         temperature=1.0 if greedy else self.temperature, greedy=greedy,
         return_on_end=self.return_on_end)
    self._host_routes = None
    live_after, steps, useful, used, lengths = jax.device_get(
        (live_after, steps, useful,
         self.tables.num_pages - self.tables.num_free, self.tables.lengths))
    self.lengths = np.asarray(lengths, np.int64).copy()
    self.decode_steps += int(steps)
    self.useful_slot_steps += int(useful)
    self.pages_peak = max(self.pages_peak, int(used))
    ended = np.flatnonzero(live & ~np.asarray(live_after))
    if not ended.size:
      return {}
    tokens, logprobs, drawn = jax.device_get(
        (d["tokens"], d["logprobs"], d["drawn"]))
    out = {}
    for slot in ended:
      n = int(drawn[slot])
      ids = [int(x) for x in tokens[slot, :n]]
      out[int(self.slot_episode[slot])] = (
          ids, [float(x) for x in logprobs[slot, :n]],
          bool(ids and ids[-1] == self.end_id))
      self.slot_episode[slot] = -1
    return out

  def occupancy(self) -> float:
    """Slot-steps that drew a token / (decode steps x S)."""
    steps = self.decode_steps * self.num_slots
    return self.useful_slot_steps / steps if steps else 0.0


def run_episodes(make_env, rows: Sequence[Mapping[str, Any]],
                 engine: EpisodeEngine, renderer, parser, limits, key, *,
                 name: str = "online.environment",
                 row_names: Optional[Sequence[str]] = None
                 ) -> Tuple[List[episodes_lib.Episode], Dict[str, float]]:
  """One episode per row on the engine's slots (module docstring);
  arguments and episodes as `episodes.run_episodes`' (`engine` for its
  policy). Returns (episodes, {"env_seconds", "env_hidden_seconds",
  "slot_occupancy", "slot_steps", "useful_slot_steps", "decode_steps",
  "preemptions"}: module docstring).

  On a pool smaller than every episode at its longest (`EpisodeEngine`'s
  num_pages), a turn that needs a page when none is free (a decode step,
  or an answer's or a preempted episode's prefill) preempts an episode:
  first one waiting on its environment (it needs no page until it is
  answered, and may wait long), the most recently admitted of those; else
  the most recently admitted episode holding pages, and for a prefill
  only one admitted after the one starting. The oldest episode is thus
  never preempted for a younger one while it decodes: it always goes on,
  so the episodes all end (no two preempting each other in turn), and
  the episodes preempted are the ones that hold the least work to redo.
  A new episode's opening preempts nothing: it waits for free pages (and
  starts only with its pages through its first decode step), else
  admitting it would preempt the episodes it then waits behind."""
  opened = episodes_lib.open_episodes(make_env, rows, renderer, limits,
                                      name, row_names)
  episodes = opened.episodes
  engine.reset(len(episodes), key)
  timeout = limits.env_timeout_s
  # Episodes ready to start a turn (an opening, an answer, or a turn
  # preempted), the admitted ones first, oldest first.
  ready = [i for i, e in enumerate(episodes) if not e.done]
  admitted = {}  # episode -> the order it first started a turn in
  waiting = {}  # future -> episode
  hidden = waited = 0.0
  pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=max(1, len(episodes)),  # every step at once if need be
      thread_name_prefix="environment step")

  def budget(i):
    room = limits.max_episode_tokens - len(episodes[i].tokens)
    return max(1, min(limits.max_turn_tokens, room))

  def sequence(i):
    return list(episodes[i].opening) + episodes[i].tokens

  def preempt_until(short, younger_than=-1, spare=()):
    """Preempts episodes (the docstring's order; not `spare`) while
    short() > 0; whether it then is not."""
    while short() > 0:
      on_env = set(waiting.values())
      holders = [j for j in engine.holders() if j not in spare]
      victims = ([j for j in holders if j in on_env]
                 or [j for j in holders if admitted[j] > younger_than])
      if not victims:
        return False
      victim = max(victims, key=admitted.get)
      if engine.live(victim):
        ready.append(victim)
      engine.preempt(victim)
    return True

  def answered(future):
    i = waiting.pop(future)
    outcome = future.result()
    if not opened.check(i, episodes[i].turns, outcome,
                        environments.check_step):
      engine.release(i)
      return
    if opened.take_answer(i, outcome.value, renderer) is None:
      engine.release(i)
    else:
      ready.append(i)

  try:
    while True:
      ready += engine.take_params()  # new parameters between chunks
      for future in [f for f in waiting if f.done()]:
        answered(future)
      free = engine.free_slots()
      starts, taken = [], 0
      ready.sort(key=lambda i: (admitted.get(i, len(episodes)), i))
      while ready and len(starts) < len(free):
        i = ready[0]
        need = taken + engine.pages_to_start(i, sequence(i))
        short = lambda need=need: need - engine.free_pages()
        if i in admitted:
          preempt_until(short, admitted[i], {i, *(s[0] for s in starts)})
        if short() > 0:
          break  # the oldest waits for pages, and the others behind it
        taken = need
        admitted.setdefault(ready.pop(0), len(admitted))
        starts.append((i, sequence(i), episodes[i].turns, budget(i)))
      if starts:
        begun = time.perf_counter()
        engine.prefill(starts)
        if waiting:
          hidden += time.perf_counter() - begun
      if (engine.slot_episode >= 0).any():
        if not preempt_until(engine.pages_short):
          raise RuntimeError("EpisodeEngine: no episode to preempt for a "
                             "decode step (a pool under one episode?).")
      if (engine.slot_episode >= 0).any():
        begun = time.perf_counter()
        ended = engine.decode()
        if waiting:
          hidden += time.perf_counter() - begun
        for i, (ids, logprobs, end) in ended.items():
          message = opened.take_turn(i, ids, logprobs, end, renderer, parser)
          if message is None:
            engine.release(i)
            continue
          env = opened.envs[i]
          future = pool.submit(
              lambda env=env, m=message: environments.call_all(
                  [lambda: env.step(m)], timeout)[0])
          waiting[future] = i
      elif waiting:
        begun = time.perf_counter()
        concurrent.futures.wait(list(waiting),
                                return_when=concurrent.futures.FIRST_COMPLETED)
        waited += time.perf_counter() - begun
      elif not ready:
        break
      elif not starts:
        raise RuntimeError(f"EpisodeEngine: episodes {ready} cannot start "
                           "on an empty pool (a pool under one episode?).")
  finally:
    pool.shutdown(wait=False)
  engine._flush_releases()  # the last episodes' pages back to the pool
  paged_kv.check_not_exhausted(engine.tables)
  opened.env_seconds += waited
  return episodes, {"env_seconds": opened.env_seconds,
                    "env_hidden_seconds": hidden,
                    "slot_occupancy": engine.occupancy(),
                    "slot_steps": float(engine.decode_steps
                                        * engine.num_slots),
                    "useful_slot_steps": float(engine.useful_slot_steps),
                    "decode_steps": float(engine.decode_steps),
                    "preemptions": float(engine.preemptions),
                    "param_updates": float(engine.param_updates)}
