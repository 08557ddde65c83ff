"""Continuous batching: a fixed number of decode slots that never wait.

  samples, stats = engine.generate(llama_model, params, prompt_tokens,
                                   prompt_attention_mask, rng, num_slots=16,
                                   max_new_tokens=256, top_p=0.9)

`sampling.sample_decoder_only` decodes its batch in lockstep: a row that has
drawn its EOS keeps its place (and its share of every step) until the
longest row ends. Here N prompts share `num_slots` (S) decode slots: the
first S are prefilled into the slots, every decode step draws a token for
each live slot and feeds it, and when a sequence ends (its EOS, or its
`max_new_tokens` budget) its slot takes the next pending prompt, prefilled
into that slot while the others keep decoding. Everything runs in one
compiled `lax.while_loop`: one iteration is one decode step of all S slots
followed, when enough slots are free, by a prefill of the next
`refill_size` (R) pending prompts (a `lax.cond`), their caches written into
the free slots; the host is never consulted, so no step waits on it.
R trades the slots' idle steps (a slot waits until R are free; R = 1
refills at once) against the prefill's batch (R prompts in one call);
`experiments/bench_engine.py` measures it.

Each slot keeps its own cache row laid out exactly as a one-prompt run of
`sample_decoder_only` lays out its cache (the prompt in columns 0 .. P - 1,
new token t in column P + t): the decode step is the model's own
`decode_step` mapped over the slots (`jax.vmap` of a one-row call), so each
slot writes its own column and attends with its own causal mask. Its
draws are the lockstep sampler's: token t of prompt i is drawn with the
noise row i of `sample_decoder_only`'s draw t over all N rows
(`row_draws`). So prompt i's tokens and log-probs are row i of
`sample_decoder_only(model, params, tokens, mask, rng, max_new_tokens,
...)` whatever the slots, the refill size, the pool or the order the
sequences end in (tests/test_engine.py; the log-probs to float rounding,
and so a token where two candidates' noisy logits tie to that rounding: a
slot's products run in a batch of S rows, not N). The decode
steps read the weights cast once and joined as the lockstep sampler's do
(`sampling._decode_params`); the prefills read them as they are.

With `page_size`, the slots' caches are pages of one pool instead
(`layers/paged_kv.py`): a prefill takes the pages its prompt's real tokens
need (no pads, no budget), each decode step a new page for a slot whose
sequence crosses a page boundary, and a sequence's pages go back to the
free list when it ends, so the cache held follows the live sequences'
lengths; `EngineStats.pages_peak` counts the most pages held at once. All
S slots then decode in one batched `decode_step` over the pool (not under
vmap); the draws and the samples are the same (tests/test_paged_kv.py). A
pool of `num_pages` below the default (S x the pages of P + M - 1
positions, never too small) can run short: before a decode step whose live
sequences need more new pages than are free, the youngest live sequence
(the highest prompt index) is preempted, until they fit: its pages go back,
and it waits with its tokens; a waiting sequence resumes, the oldest
first and before any new prompt, into a free slot when the pages of its
prompt and tokens so far are free, prefilled again with them, and draws
on from its next draw: the same samples (the prefill's logits to float
rounding; tests/test_paged_kv.py). New prompts are admitted only when
their pages are free. The oldest live sequence is never preempted, so a
pool of `least_pages` (one longest sequence) always finishes. Only
`attentions.Attention` reads pages.
With `group_size` k (the k samples of each prompt, its rows repeated),
a group enters the slots whole and its prompt is prefilled once: the k
sequences share its full pages and each gets a copy of its partial last
page (`paged_kv.fork`), so the prefill's work and the prompt's pages are
divided by k, and the samples are unchanged (tests/test_paged_kv.py).

With `record_routes` a mixture-of-experts model records the experts each
token it feeds is routed to (router replay), in `sample_decoder_only`'s
layout: the prompt's at its prefill, each new token's as it is fed (a
preempted sequence's unfed token at its resumption).

Not supported (refused with a message): T5 (an encoder-decoder; use
`sampling.sample_encoder_decoder`), a prefix-LM prompt, cache segments
(every slot holds P + max_new_tokens - 1 columns), `num_samples` (repeat
the prompts, as `sample_decoder_only` lays out its samples' rows; with
pages, `group_size` shares their prefill), a PRNG other than JAX's default
(`row_draws.check_key`), a mixture-of-experts model without pages (the
contiguous cache's slots decode under vmap, which its grouped expert
matmul does not take). On a mesh the slots are split like a batch
(tests/test_eight_devices.py: a GRPO step on 4x2 equals one device's).
"""

import functools
from typing import Any, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import moe_decoder
from jaxrlhf.models import row_draws
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import paged_kv
from jaxrlhf.models.layers import param_recording
from jaxrlhf.models.layers import rotary

# pylint: disable=protected-access


@flax.struct.dataclass
class EngineStats:
  """What one `generate` call ran (int32 scalars)."""
  # Loop iterations: each draws a token in every live slot and feeds the
  # drawn tokens (a decode step of all S slots).
  decode_steps: jax.Array
  # Slot-steps that drew a token of a live sequence: the tokens drawn (the
  # sum of the sequences' lengths, EOS included).
  useful_slot_steps: jax.Array
  # Prefill calls: the first fill (S prompts) and each refill (R prompts).
  prefills: jax.Array
  # With pages: the most pages held at once (0 without), and whether the
  # pool ran out (the samples are then wrong; `generate` raises).
  pages_peak: jax.Array
  pages_exhausted: jax.Array
  # With a pool below the worst case: sequences preempted for pages (each
  # resumed later, its tokens so far prefilled again).
  preemptions: jax.Array

  def utilisation(self, num_slots: int) -> float:
    """useful slot-steps / (decode steps x num_slots), a host float."""
    steps = int(self.decode_steps) * int(num_slots)
    return float(self.useful_slot_steps) / steps if steps else 0.0


@flax.struct.dataclass
class _Slots:
  """The S slots' device state (leading axis S everywhere)."""
  cache: Any             # the model's cache, one row per slot: every leaf
  #                        [S, (layers,) 1, kv_heads, P + M - 1, head_dim];
  #                        paged: (pools, PageTables of S sequences)
  cache_mask: jax.Array  # [S, P + M - 1] int32: the prompt's mask, then 1s
  #                        (paged: [S, 0], unused)
  num_real: jax.Array    # [S] int32 the prompt's real tokens
  logits: jax.Array      # [S, vocab] float32 logits of the next draw
  t: jax.Array           # [S] int32 tokens its sequence has drawn
  seq: jax.Array         # [S] int32 the prompt it holds (N: none)
  active: jax.Array      # [S] bool: it holds a sequence still drawing


@flax.struct.dataclass
class _Parked:
  """Sequences preempted for pages, waiting to resume (leading axis N:
  the prompts' order, which is also the order they were first admitted
  in, so a lower index is the older sequence)."""
  waiting: jax.Array  # [N] bool
  t: jax.Array        # [N] int32 tokens it had drawn


def _slot_rows(x: jax.Array) -> jax.Array:
  """A cache leaf [(layers,) n, heads, T, head_dim] as n one-row caches
  [n, (layers,) 1, heads, T, head_dim] (the layout `jax.vmap` maps)."""
  lead = x.ndim - 4
  if lead not in (0, 1):
    raise ValueError(f"engine: a KV-cache entry of shape {x.shape} is not "
                     "[(layers,) batch, heads, length, head_dim].")
  return jnp.expand_dims(jnp.moveaxis(x, lead, 0), lead + 1)


def _prefill(model, params, tokens, mask, width, routes):
  """Prefills n left-padded prompts [n, P] into caches of `width` columns:
  (logits [n, vocab] float32, cache in slot rows (`_slot_rows`), cache_mask
  [n, width], num_real [n], routes [n, P, ...] or None), as
  `sample_decoder_only`'s prefill."""
  n, length = tokens.shape
  cache_mask = jnp.concatenate(
      [mask, jnp.ones((n, width - length), jnp.int32)], axis=1)
  logits, cache, routed = sampling.decode_step(
      model, {"params": params}, tokens, rotary.positions_from_mask(mask),
      cache_mask, 0, routes=routes)
  cache = jax.tree.map(_slot_rows, cache)
  return (logits.astype(jnp.float32), cache, cache_mask,
          jnp.sum(mask, axis=-1).astype(jnp.int32), routed)


def _feed(model, params, cache, tokens, positions, cache_mask, index,
          routes):
  """One decode step of every slot, each a one-row `decode_step` at its own
  cache column: tokens, positions, index [S], cache_mask [S, T] ->
  (logits [S, vocab] float32, cache, routes [S, ...] of the tokens fed or
  None)."""
  def one(cache, token, position, mask, index):
    logits, cache, routed = sampling.decode_step(
        model, {"params": params, "cache": cache}, token[None, None],
        position[None, None], mask[None], index, routes=routes)
    return (logits[0].astype(jnp.float32), cache,
            None if routed is None else routed[0, 0])
  return jax.vmap(one)(cache, tokens, positions, cache_mask, index)


def _prefill_pages(model, params, pages, tokens, mask, rows, routes):
  """Prefills n left-padded prompts [n, P] into the pages of slots `rows`
  [n] (a row out of range is dropped), taking the pages of their real
  tokens: (logits [n, vocab] float32, pages, num_real [n], routes
  [n, P, ...] or None)."""
  pool, tables = pages
  length = tokens.shape[1]
  num_real = jnp.sum(mask, axis=-1).astype(jnp.int32)
  tables = paged_kv.reserve(
      tables, tables.lengths.at[rows].set(num_real, mode="drop"))
  index = paged_kv.PagedIndex(
      tables.page_table.at[rows].get(mode="fill",
                                     fill_value=tables.num_pages),
      num_real - length, tables.page_size)
  logits, pool, routed = sampling.decode_step(
      model, {"params": params, "cache": pool}, tokens,
      rotary.positions_from_mask(mask), None, index, routes=routes)
  return logits.astype(jnp.float32), (pool, tables), num_real, routed


def _feed_pages(model, params, pages, tokens, live, routes):
  """One decode step of every slot on pages: each live slot's token [S]
  at its sequence's next position (a new page where it starts one); a
  slot not live holds no pages and writes nothing. -> (logits [S, vocab]
  float32, pages, routes [S, ...] of the tokens fed or None)."""
  pool, tables = pages
  start = tables.lengths  # prompt + tokens fed: the token's position
  tables = paged_kv.reserve(tables, start + live.astype(jnp.int32))
  index = paged_kv.PagedIndex(tables.page_table, start, tables.page_size)
  logits, pool, routed = sampling.decode_step(
      model, {"params": params, "cache": pool}, tokens[:, None],
      start[:, None], None, index, routes=routes)
  return (logits.astype(jnp.float32), (pool, tables),
          None if routed is None else routed[:, 0])


def _draw(keys, seq, t, logits, temperature, top_k, top_p, greedy):
  """Each slot's draw as the lockstep sampler draws its sequence's row:
  keys [M] (`row_draws.step_keys`; None when greedy), seq, t [S] (the row,
  the draw), logits [S, vocab] -> (tokens [S], log-probs [S])."""
  vocab = logits.shape[-1]
  def one(seq, t, logits):
    key = None if greedy else row_draws.row_key(keys[t], seq, vocab)
    token, logprob = sampling.choose_tokens(logits[None], key, temperature,
                                            top_k, top_p, greedy)
    return token[0], logprob[0]
  return jax.vmap(one)(seq, t, logits)


def _put(old, rows, new, columns=None):
  """old with old[rows[j]] = new[j] (with `columns` C: old[rows[j], :C]);
  a row index out of range is dropped."""
  where = rows if columns is None else (rows, slice(0, columns))
  return old.at[where].set(new.astype(old.dtype), mode="drop")


def _generate(*, model, params, prompt_tokens, prompt_attention_mask, rng,
              num_slots, refill_size, max_new_tokens, temperature, top_k,
              top_p, greedy, eos_id, fuse_projections, page_size,
              num_pages, group_size, record_routes):
  model = sampling._inference_module(model)
  # Router replay: the experts each fed token was routed to.
  record = sampling.records_routes(model, record_routes)
  tokens_in = jnp.asarray(prompt_tokens, jnp.int32)
  mask_in = jnp.asarray(prompt_attention_mask).astype(jnp.int32)
  n, length = tokens_in.shape
  slots, refill, new = num_slots, refill_size, max_new_tokens
  width = length + new - 1
  # The queue, with rows past its end for the prefills that reach beyond it
  # (their results are dropped): a dynamic slice must not be clamped back.
  pad = max(slots, refill)
  queue_tokens = jnp.concatenate(
      [tokens_in, jnp.zeros((pad, length), jnp.int32)])
  queue_mask = jnp.concatenate([mask_in, jnp.ones((pad, length), jnp.int32)])
  # Draw t of every sequence: a row of the lockstep sampler's draw t.
  keys = None if greedy else row_draws.step_keys(rng, new)

  paged = page_size is not None
  k = group_size
  # A pool below the worst case can run short: before a decode step whose
  # new pages are not free, the youngest live sequences are preempted.
  preemptible = (paged and new > 1 and num_pages
                 < paged_kv.default_num_pages(slots, width, page_size))
  first = jnp.arange(slots, dtype=jnp.int32)
  # The first fill: whole groups only (all S slots when k = 1).
  filled = min(n, slots - slots % k)

  def prompt_pages(real):
    """The new pages a group of k prompts of `real` tokens takes: its
    pages, and a copy of a partial last page for each other member."""
    return (paged_kv.pages_for(real, page_size)
            + (k - 1) * (real % page_size != 0).astype(jnp.int32))

  if preemptible:  # the first groups whose prompts' pages fit the pool
    need = jnp.cumsum(prompt_pages(jnp.sum(queue_mask[:filled:k], axis=-1)))
    filled = jnp.minimum(filled, jnp.sum(need <= num_pages) * k)

  def admit_pages(pages, tokens, mask, target):
    """Sequences `tokens`, `mask` [m, P] (m a multiple of k; groups of k
    adjacent rows share their prompt) into the pages of slots `target`
    [m] (S: dropped, a whole group at once): each group's prompt
    prefilled once, into its first sequence's slot, the others forked
    from it (`paged_kv.fork`: its full pages shared, its partial last
    page copied). -> (logits [m, vocab], pages, num_real [m], routes
    [m, P, ...] or None)."""
    logits, (pool, tables), num_real, routed = _prefill_pages(
        model, params, pages, tokens[::k], mask[::k], target[::k], record)
    if k > 1:
      groups = target.reshape(-1, k)
      tables, pool = paged_kv.fork(
          tables, pool, jnp.repeat(groups[:, 0], k - 1),
          groups[:, 1:].reshape(-1))
    return (jnp.repeat(logits, k, axis=0), (pool, tables),
            jnp.repeat(num_real, k),
            None if routed is None else jnp.repeat(routed, k, axis=0))

  with param_recording.recording_param_reads() as reads, \
      param_recording.recording_param_fusions() as fusions:
    if paged:
      pages = (paged_kv.make_pool(model, params, num_pages, page_size),
               paged_kv.init_tables(num_pages, page_size, slots,
                                    paged_kv.pages_for(width, page_size)))
      logits, cache, num_real, routed = admit_pages(
          pages, queue_tokens[:slots], queue_mask[:slots],
          jnp.where(first < filled, first, slots))
      cache_mask = jnp.zeros((slots, 0), jnp.int32)
    else:
      logits, cache, cache_mask, num_real, routed = _prefill(
          model, params, queue_tokens[:slots], queue_mask[:slots], width,
          record)
  decode_params = sampling._decode_params(params, reads, fusions,
                                          fuse_projections)
  row_draws.check_rows(n, logits.shape[-1])
  state = _Slots(cache=cache, cache_mask=cache_mask, num_real=num_real,
                 logits=logits, t=jnp.zeros((slots,), jnp.int32),
                 seq=jnp.where(first < filled, first, n),
                 active=first < filled)
  # Routes: [N, P + M, moe layers, top_k], as `sample_decoder_only`
  # records them (-1 where no token was fed: the last one drawn).
  routes = None
  if record:
    routes = _put(jnp.full((n, length + new) + routed.shape[2:], -1,
                           jnp.int32),
                  jnp.where(first < filled, first, n), routed, length)
  out = (jnp.zeros((n, new), jnp.int32), jnp.zeros((n, new), jnp.float32),
         jnp.zeros((n,), jnp.int32), jnp.zeros((n,), bool), routes)
  zero = jnp.int32(0)
  # steps, useful, prefills, peak, preemptions
  counts = (zero, zero, jnp.int32(1), zero, zero)
  parked = _Parked(waiting=jnp.zeros((n,), bool),
                   t=jnp.zeros((n,), jnp.int32))

  def preempt(state, parked, preemptions):
    """While the live slots' next tokens need more new pages than are
    free, the youngest live sequence (the highest prompt index, never the
    last one live) gives its pages back and waits, with its tokens so far,
    to be resumed (`resume_one`)."""
    def short(carry):
      state = carry[0]
      tables = state.cache[1]
      need = jnp.sum(state.active & (tables.lengths % page_size == 0),
                     dtype=jnp.int32)
      return (need > tables.num_free) & (jnp.sum(state.active) > 1)

    def one(carry):
      state, parked, preemptions = carry
      victim = jnp.argmax(jnp.where(state.active, state.seq, -1))
      which = jnp.arange(slots) == victim
      seq = state.seq[victim]
      parked = _Parked(waiting=parked.waiting.at[seq].set(True),
                       t=parked.t.at[seq].set(state.t[victim]))
      pool, tables = state.cache
      state = state.replace(cache=(pool, paged_kv.release(tables, which)),
                            active=state.active & ~which)
      return state, parked, preemptions + 1
    return jax.lax.while_loop(short, one, (state, parked, preemptions))

  def resume_one(state, parked, tokens, routes, prefills):
    """The oldest waiting sequence into the first free slot: its prompt
    and the tokens it had drawn prefilled again (the logits of its next
    draw; the routes of the one token not fed before), drawing on where
    it stopped."""
    seq = jnp.argmax(parked.waiting)
    slot = jnp.argmin(state.active)
    t = parked.t[seq]
    row = jnp.concatenate([queue_tokens[seq], tokens[seq, :new - 1]])
    row_mask = jnp.concatenate(
        [queue_mask[seq], (jnp.arange(new - 1) < t).astype(jnp.int32)])
    # Left-padded: the columns not drawn yet rolled to the front.
    row, row_mask = (jnp.roll(x, new - 1 - t)[None] for x in (row, row_mask))
    logits, cache, _, routed = _prefill_pages(
        model, params, state.cache, row, row_mask, slot[None], record)
    if record:
      routes = routes.at[seq, length + t - 1].set(routed[0, -1])
    put = functools.partial(_put, rows=slot[None])
    state = state.replace(
        cache=cache, logits=put(state.logits, new=logits),
        num_real=put(state.num_real, new=jnp.sum(queue_mask[seq])[None]),
        t=put(state.t, new=t[None]), seq=put(state.seq, new=seq[None]),
        active=put(state.active, new=jnp.ones((1,), bool)))
    return (state, parked.replace(waiting=parked.waiting.at[seq].set(False)),
            routes, prefills + 1)

  def refill_slots(state, next_prompt, routes, prefills):
    """The next R pending prompts prefilled into the first free slots."""
    free = ~state.active
    pending = n - next_prompt
    taken = jnp.minimum(jnp.minimum(pending, refill),
                        jnp.sum(free) // k * k)  # whole groups
    prompts = (
        jax.lax.dynamic_slice_in_dim(queue_tokens, next_prompt, refill),
        jax.lax.dynamic_slice_in_dim(queue_mask, next_prompt, refill))
    if preemptible:  # the groups whose prompts' pages are free
      need = jnp.cumsum(prompt_pages(jnp.sum(prompts[1][::k], axis=-1)))
      taken = jnp.minimum(
          taken, jnp.sum(need <= state.cache[1].num_free) * k)
    # New prompt j goes to the j-th free slot (slot index `slots`, dropped,
    # when j >= taken).
    rank = jnp.where(free, jnp.cumsum(free) - 1, refill)
    target = jnp.full((refill,), slots, jnp.int32).at[rank].set(
        jnp.arange(slots, dtype=jnp.int32), mode="drop")
    target = jnp.where(jnp.arange(refill) < taken, target, slots)
    if paged:
      logits, cache, num_real, routed = admit_pages(state.cache, *prompts,
                                                    target)
    else:
      logits, cache, cache_mask, num_real, routed = _prefill(
          model, params, *prompts, width, record)
    ids = next_prompt + jnp.arange(refill, dtype=jnp.int32)
    if record:
      routes = _put(routes, jnp.where(jnp.arange(refill) < taken, ids, n),
                    routed, length)
    put = functools.partial(_put, rows=target)
    state = _Slots(
        cache=cache if paged else jax.tree.map(
            lambda old, x: put(old, new=x), state.cache, cache),
        cache_mask=(state.cache_mask if paged
                    else put(state.cache_mask, new=cache_mask)),
        num_real=put(state.num_real, new=num_real),
        logits=put(state.logits, new=logits),
        t=put(state.t, new=jnp.zeros_like(ids)),
        seq=put(state.seq, new=ids),
        active=put(state.active, new=jnp.ones((refill,), bool)))
    return state, next_prompt + taken, routes, prefills + 1

  def body(carry):
    (state, parked, next_prompt,
     (tokens, logprobs, lengths, has_eos, routes), counts) = carry
    steps, useful, prefills, peak, preemptions = counts
    token, logprob = _draw(keys, state.seq, state.t, state.logits,
                           temperature, top_k, top_p, greedy)
    live = state.active
    row = jnp.where(live, state.seq, n)  # n: dropped
    tokens = tokens.at[row, state.t].set(token, mode="drop")
    logprobs = logprobs.at[row, state.t].set(logprob, mode="drop")
    is_eos = token == eos_id
    ended = live & (is_eos | (state.t + 1 >= new))
    ended_row = jnp.where(ended, state.seq, n)
    lengths = lengths.at[ended_row].set(state.t + 1, mode="drop")
    has_eos = has_eos.at[ended_row].set(is_eos, mode="drop")
    state = state.replace(t=state.t + 1, active=live & ~ended)
    if paged:  # an ended sequence's pages go back to the free list
      pool, tables = state.cache
      state = state.replace(cache=(pool, paged_kv.release(tables, ended)))
    if preemptible:
      state, parked, preemptions = preempt(state, parked, preemptions)
    if new > 1 and paged:
      logits, cache, routed = _feed_pages(model, decode_params, state.cache,
                                          token, state.active, record)
      state = state.replace(logits=logits, cache=cache)
    elif new > 1:  # a budget of 1 never feeds its token
      # Token t sits at rotary position num_real + t and cache column
      # length + t (a slot past its budget, whose step is wasted, writes
      # the last column, which its next prompt's steps write before they
      # read it).
      column = jnp.minimum(state.t - 1, new - 2)
      logits, cache, routed = _feed(model, decode_params, state.cache,
                                    token, state.num_real + column,
                                    state.cache_mask, length + column,
                                    record)
      state = state.replace(logits=logits, cache=cache)
    if new > 1 and record:  # a live slot fed its token t - 1
      routes = routes.at[jnp.where(state.active, state.seq, n),
                         length + state.t - 1].set(routed, mode="drop")
    go = jnp.bool_(True)
    if preemptible:  # the oldest waiting one first, then new prompts
      tables = state.cache[1]
      oldest = jnp.argmax(parked.waiting)
      waiting = jnp.any(parked.waiting)
      state, parked, routes, prefills = jax.lax.cond(
          waiting & ~jnp.all(state.active)
          & (paged_kv.pages_for(jnp.sum(queue_mask[oldest])
                                + parked.t[oldest], page_size)
             <= tables.num_free),
          resume_one, lambda s, p, _, r, f: (s, p, r, f), state, parked,
          tokens, routes, prefills)
      head = jnp.sum(jax.lax.dynamic_index_in_dim(queue_mask, next_prompt,
                                                  keepdims=False))
      go = ~jnp.any(parked.waiting) & (prompt_pages(head)
                                        <= state.cache[1].num_free)
    pending = n - next_prompt
    free = jnp.sum(~state.active)
    state, next_prompt, routes, prefills = jax.lax.cond(
        go & (pending > 0) & (free >= jnp.minimum(refill, pending)),
        refill_slots, lambda *a: a, state, next_prompt, routes, prefills)
    if paged:
      tables = state.cache[1]
      peak = jnp.maximum(peak, tables.num_pages - tables.num_free)
    return (state, parked, next_prompt,
            (tokens, logprobs, lengths, has_eos, routes),
            (steps + 1, useful + jnp.sum(live, dtype=jnp.int32), prefills,
             peak, preemptions))

  if paged:
    counts = counts[:3] + (num_pages - state.cache[1].num_free, zero)
  carry = (state, parked, jnp.int32(filled), out, counts)
  state, _, _, (tokens, logprobs, lengths, has_eos, routes), counts = (
      jax.lax.while_loop(lambda carry: jnp.any(carry[0].active), body,
                         carry))
  mask = (jnp.arange(new)[None, :] < lengths[:, None]).astype(jnp.float32)
  samples = sampling.Samples(tokens=tokens, logprobs=logprobs * mask,
                             mask=mask, has_eos=has_eos,
                             num_steps=jnp.max(lengths), routes=routes)
  stats = EngineStats(
      decode_steps=counts[0], useful_slot_steps=counts[1],
      prefills=counts[2], pages_peak=counts[3], preemptions=counts[4],
      pages_exhausted=state.cache[1].exhausted if paged
      else jnp.zeros((), bool))
  return samples, stats


_STATIC = ("model", "num_slots", "refill_size", "max_new_tokens",
           "temperature", "top_k", "top_p", "greedy", "eos_id",
           "fuse_projections", "page_size", "num_pages", "group_size",
           "record_routes")
_generate_jit = sampling._jit_static(_generate, _STATIC)


def default_slots(num_sequences: int, group_size: int = 1) -> int:
  """The slots an online step's engine takes when `online.engine_slots` is
  unset: a quarter of a rollout part's sequences (the setting
  bench_engine.py measured), rounded down to whole groups of `group_size`
  (at least one group)."""
  return max(group_size, num_sequences // 4 // group_size * group_size)


def default_refill_size(num_slots: int) -> int:
  """`refill_size` when unset: a quarter of the slots (at least 1)."""
  return max(1, num_slots // 4)


def generate(model, params, prompt_tokens, prompt_attention_mask, rng,
             num_slots: int, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
             eos_id: int = 1, refill_size: int = None,
             fuse_projections: bool = True, page_size: Optional[int] = None,
             num_pages: Optional[int] = None, group_size: int = 1,
             record_routes: bool = False
             ) -> Tuple[sampling.Samples, EngineStats]:
  """Samples a continuation of each prompt with `num_slots` decode slots.

  Args:
    model: a decoder-only module with the common `decode_step(tokens,
      positions, attention_mask, cache_index)` (Llama, Qwen, Gemma,
      GPT-NeoX, ...).
    params: its parameters (the tree under "params").
    prompt_tokens: int [N, prompt_len], LEFT-padded (each row's last column
      is its last prompt token), as `sampling.sample_decoder_only` takes.
    prompt_attention_mask: [N, prompt_len], 1 = real token, 0 = pad.
    rng: a PRNG key (JAX's default threefry, `row_draws.check_key`); row i
      draws as row i of `sampling.sample_decoder_only(..., rng)` over all
      N rows (unused when greedy).
    num_slots: static S, the sequences decoded at once (any N >= 1 works:
      S < N queues the rest, S > N leaves slots empty).
    max_new_tokens: static budget of new tokens per prompt.
    temperature, top_k, top_p, greedy: as in `sampling.sample_decoder_only`.
    eos_id: the end-of-sequence id.
    refill_size: static R in 1 .. S, the prompts a refill prefills at once:
      the loop refills when R slots are free (or all that is left pending
      fits); None: `default_refill_size` (S // 4).
    fuse_projections: as in `sampling.sample_decoder_only`.
    page_size: static; None: each slot a contiguous cache row of P + M - 1
      columns; an int: the slots' caches in pages of that many positions
      (`paged_kv`).
    num_pages: static, with page_size: the pool's pages (None: S x
      ceil((P + M - 1) / page_size), enough for any lengths). Fewer: when
      the live sequences' next tokens need more new pages than are free,
      the youngest are preempted (`EngineStats.preemptions`); at least
      `least_pages` (else ValueError).
    group_size: static k, with page_size: each k adjacent rows repeat one
      prompt (a group's samples, `jnp.repeat(prompts, k, axis=0)`), which
      is then prefilled once and its pages shared by the k (`paged_kv.fork`);
      a group enters the slots whole, so k divides N, S and refill_size.
      The samples are those of group_size 1.
    record_routes: static; a mixture-of-experts model (`MoeCausalLM`)
      records the experts each token it feeds is routed to, as
      `sample_decoder_only(record_routes=True)` does (`Samples.routes`
      [N, P + M, moe layers, top_k], -1 where no token was fed: the last
      one drawn); other models ignore it.
  Returns:
    (Samples of the new tokens, [N, max_new_tokens] in prompt order, EOS
    kept, then 0; num_steps the longest sequence's tokens; EngineStats).
  """
  sampling._check_options(max_new_tokens, temperature, top_k, top_p)
  if hasattr(model, "encode"):
    raise ValueError("engine.generate samples decoder-only models; for an "
                     "encoder-decoder (T5) use "
                     "sampling.sample_encoder_decoder.")
  sampling._check_left_padded(prompt_attention_mask)
  if isinstance(model, moe_decoder.MoeCausalLM) and page_size is None:
    raise ValueError(
        "engine.generate: a mixture-of-experts model decodes on pages "
        "(page_size): the contiguous cache's slots decode under vmap, which "
        "the experts' grouped matmul (ragged_dot) does not take.")
  if not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
    raise ValueError(f"num_slots must be a positive int, got {num_slots!r}.")
  if not isinstance(group_size, (int, np.integer)) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got "
                     f"{group_size!r}.")
  k = int(group_size)
  if k > 1 and page_size is None:
    raise ValueError("group_size > 1 shares a group's prompt pages: it "
                     "needs page_size (or pass group_size=1).")
  if refill_size is None:
    refill_size = max(k, default_refill_size(int(num_slots)) // k * k)
  if k > 1 and (np.shape(prompt_tokens)[0] % k or num_slots % k
                or refill_size % k):
    raise ValueError(f"group_size={k} must divide the prompts' rows "
                     f"({np.shape(prompt_tokens)[0]}), num_slots "
                     f"({num_slots}) and refill_size ({refill_size}): a "
                     "group enters the slots whole.")
  if (not isinstance(refill_size, (int, np.integer))
      or not 1 <= refill_size <= num_slots):
    raise ValueError(f"refill_size must be an int in 1 .. num_slots="
                     f"{num_slots}, got {refill_size!r}.")
  if np.shape(prompt_tokens)[0] < 1:
    raise ValueError("engine.generate needs at least one prompt.")
  if page_size is not None or num_pages is not None:
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
      raise ValueError(f"page_size must be a positive int (or None: no "
                       f"pages), got {page_size!r}.")
    width = np.shape(prompt_tokens)[1] + int(max_new_tokens) - 1
    if num_pages is None:
      num_pages = paged_kv.default_num_pages(num_slots, width, page_size)
    least = least_pages(np.shape(prompt_tokens)[1], max_new_tokens,
                        page_size, k)
    if not isinstance(num_pages, (int, np.integer)) or num_pages < least:
      raise ValueError(
          f"num_pages={num_pages!r}: a pool of pages of {page_size} "
          f"positions needs at least {least} pages here (one longest "
          f"sequence, prompt {np.shape(prompt_tokens)[1]} + "
          f"{max_new_tokens} - 1 positions, or one group's prompt), for "
          "the oldest sequence to go on when all the others are "
          "preempted; give it more pages (None: enough for any lengths).")
    page_size, num_pages = int(page_size), int(num_pages)
  greedy = greedy or temperature == 0
  if not greedy:
    row_draws.check_key(rng)
  samples, stats = _generate_jit(
      model=model, params=params, prompt_tokens=prompt_tokens,
      prompt_attention_mask=prompt_attention_mask, rng=rng,
      num_slots=int(num_slots), refill_size=int(refill_size),
      max_new_tokens=int(max_new_tokens),
      temperature=float(temperature) if not greedy else 1.0,
      top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
      eos_id=int(eos_id), fuse_projections=bool(fuse_projections),
      page_size=page_size, num_pages=num_pages, group_size=k,
      record_routes=bool(record_routes))
  exhausted = stats.pages_exhausted
  if not isinstance(exhausted, jax.core.Tracer) and bool(exhausted):
    raise RuntimeError(  # preemption keeps a pool of `least` from it
        f"engine.generate: the pool of {num_pages} pages of {page_size} "
        "positions ran out; this is a bug in the engine, please report "
        "it (num_pages=None avoids it).")
  return samples, stats


def least_pages(prompt_length: int, max_new_tokens: int, page_size: int,
                group_size: int = 1) -> int:
  """The smallest pool `generate` takes: the pages of one longest sequence
  (prompt_length + max_new_tokens - 1 positions), or of one group's prompt
  (its pages and a copy of its partial last page per other member) when
  that is more."""
  width = int(prompt_length) + int(max_new_tokens) - 1
  return max(paged_kv.pages_for(width, page_size),
             paged_kv.pages_for(prompt_length, page_size)
             + int(group_size) - 1)
