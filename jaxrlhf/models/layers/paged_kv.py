"""A paged KV cache: a pool of fixed-size pages and a page table per
sequence, so that cache memory follows the sequences' real lengths.

The contiguous cache (`kv_cache`) gives every row of a batch its own
[T, ...] of positions, T the longest a row may become. Here each layer
holds one pool of `num_pages` pages of `page_size` positions (flax "cache"
collection, `cached_key` / `cached_value` [kv_heads, num_pages, page_size,
head_dim], stacked along 'layers' when scanned; `make_pool`; heads first,
the layout of JAX's TPU paged-attention kernel), and a
sequence's position p lives at (page_table[s, p // page_size], p %
page_size). Pages are taken from a free list as a sequence grows
(`reserve`) and given back when it ends (`release`); a group's samples
read their prompt's full pages in place and each gets its own copy of the
prompt's partial last page (`fork`), so no page is ever written by two
sequences and nothing needs copy-on-write later.

All of it is pure JAX data and jittable: `PageTables` holds the page
tables, the lengths, the free list (a stack and its count) and a count of
the sequences reading each page (a page shared by a group is free when the
last one releases it). A `reserve` the pool cannot satisfy allocates
nothing and sets the sticky `exhausted` flag (`check_not_exhausted` raises
on the host); the writes that would have needed the missing pages go to
the table's NO-page entry and are dropped.

The attention layer (`attentions.Attention`) reads and writes pages when a
decode call's `cache_index` is a `PagedIndex` (the page tables and where
each sequence's new tokens start): it writes the new keys and values into
the pool (`write_pages`) and attends over the pages in use
(`paged_attention`: a loop over blocks of pages up to the batch's longest
position, or JAX's Pallas kernel on TPU), or gathers each sequence's whole
table back in the contiguous cache's layout (`gather_pages`: a short
table, or `PagedIndex.read` 'gather') and attends with `paged_mask`. A
call's L tokens of sequence b sit at positions start[b] .. start[b] + L -
1; negative positions (a left-padded prompt's pads) are neither written
nor attended to, so a prefill of left-padded prompts stores their real
tokens only.
"""

import dataclasses
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTables:
  """The pages of `num_seqs` sequences in a pool of `num_pages` pages.

  Attributes:
    page_table: int32 [num_seqs, max_pages]: sequence s's position p lives
      in page page_table[s, p // page_size]; entries it holds no page for
      are num_pages (no page: writes there are dropped).
    lengths: int32 [num_seqs] the positions each sequence holds pages for
      (its first pages_for(length) entries are pages).
    free: int32 [num_pages] a stack of the free pages, its first num_free
      entries (the top last).
    num_free: int32 scalar.
    refs: int32 [num_pages] the sequences holding each page (0: free).
    exhausted: bool scalar: some `reserve` or `fork` found too few free
      pages (sticky; `check_not_exhausted`).
    page_size: static positions per page.
  """
  page_table: Array
  lengths: Array
  free: Array
  num_free: Array
  refs: Array
  exhausted: Array
  page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

  @property
  def num_pages(self) -> int:
    return self.free.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedIndex:
  """A paged decode call's `cache_index`: where each sequence's new tokens
  go. The call's token j of row b sits at position start[b] + j of its
  sequence; a negative position (a pad) is neither written nor read.

  Attributes:
    page_table: int32 [batch, max_pages], `PageTables.page_table`'s rows of
      the call's sequences (num_pages: no page).
    start: int32 [batch] the position of each row's first token.
    page_size: static positions per page.
    read: static, how attention reads the pages (`paged_attention.READS`):
      'auto' (`paged_attention.choose`: the TPU kernel where it applies,
      a short table gathered, else 'pages'), 'pages' (XLA, the pages in
      use), 'kernel' (JAX's Pallas TPU kernel, interpreted off TPU, for
      the calls it takes: one query per row, no window; 'pages' for the
      rest) or 'gather' (XLA, the table's whole width).
  """
  page_table: Array
  start: Array
  page_size: int = dataclasses.field(metadata=dict(static=True), default=16)
  read: str = dataclasses.field(metadata=dict(static=True), default="auto")

  @property
  def capacity(self) -> int:
    """The positions a row can address: max_pages x page_size."""
    return self.page_table.shape[-1] * self.page_size


def pages_for(length, page_size: int):
  """The pages `length` positions take: ceil(length / page_size)."""
  return (length + page_size - 1) // page_size


def default_num_pages(num_seqs: int, length: int, page_size: int) -> int:
  """A pool that can never run out: each of num_seqs sequences the pages of
  `length` positions (`engine.generate`'s default: slots x the pages of
  prompt + budget - 1)."""
  return int(num_seqs) * pages_for(int(length), int(page_size))


def init_tables(num_pages: int, page_size: int, num_seqs: int,
                max_pages: int) -> PageTables:
  """An empty pool: every page free, no sequence holding any."""
  for name, value in (("num_pages", num_pages), ("page_size", page_size),
                      ("num_seqs", num_seqs), ("max_pages", max_pages)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"paged KV cache: {name} must be a positive int, got "
                       f"{value!r}.")
  return PageTables(
      page_table=jnp.full((num_seqs, max_pages), num_pages, jnp.int32),
      lengths=jnp.zeros((num_seqs,), jnp.int32),
      # Page 0 on top: pages are handed out in order from a fresh pool.
      free=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
      num_free=jnp.int32(num_pages),
      refs=jnp.zeros((num_pages,), jnp.int32),
      exhausted=jnp.zeros((), bool), page_size=int(page_size))


def reserve(tables: PageTables, lengths: Array) -> PageTables:
  """Grows each sequence s to hold pages for lengths[s] positions (a
  length below its current one changes nothing), new pages taken from the
  free list. All or nothing: when the free pages do not cover every
  sequence's need (or a length passes max_pages x page_size), nothing is
  allocated and `exhausted` is set.

  Args:
    tables: the pool's state.
    lengths: int [num_seqs] the positions each sequence is to hold.
  Returns:
    the new PageTables.
  """
  size = tables.page_size
  max_pages = tables.page_table.shape[1]
  lengths = jnp.maximum(jnp.asarray(lengths, jnp.int32), tables.lengths)
  have = pages_for(tables.lengths, size)
  need = pages_for(lengths, size)
  column = jnp.arange(max_pages)[None, :]
  wanted = (column >= have[:, None]) & (column < need[:, None])
  total = jnp.sum(wanted, dtype=jnp.int32)
  ok = (total <= tables.num_free) & jnp.all(need <= max_pages)
  # The k-th wanted entry (row-major) takes the k-th page from the top.
  rank = (jnp.cumsum(wanted.reshape(-1)) - 1).reshape(wanted.shape)
  page = tables.free[jnp.clip(tables.num_free - 1 - rank, 0,
                              tables.num_pages - 1)]
  take = wanted & ok
  page_table = jnp.where(take, page, tables.page_table)
  refs = tables.refs.at[jnp.where(take, page, tables.num_pages)].add(
      1, mode="drop")
  return dataclasses.replace(
      tables, page_table=page_table,
      lengths=jnp.where(ok, lengths, tables.lengths),
      num_free=tables.num_free - jnp.where(ok, total, 0), refs=refs,
      exhausted=tables.exhausted | ~ok)


def release(tables: PageTables, which: Array) -> PageTables:
  """Sequences `which` (bool [num_seqs]) give back their pages and hold
  nothing; a page goes back to the free list when no sequence holds it any
  more (a shared prompt page with its last reader)."""
  which = jnp.asarray(which, bool)
  held = ((jnp.arange(tables.page_table.shape[1])[None, :]
           < pages_for(tables.lengths, tables.page_size)[:, None])
          & which[:, None])
  dropped = jnp.where(held, tables.page_table, tables.num_pages)
  refs = tables.refs.at[dropped.reshape(-1)].add(-1, mode="drop")
  freed = (refs == 0) & (tables.refs > 0)
  position = tables.num_free + jnp.cumsum(freed) - 1
  free = tables.free.at[jnp.where(freed, position, tables.num_pages)].set(
      jnp.arange(tables.num_pages, dtype=jnp.int32), mode="drop")
  return dataclasses.replace(
      tables,
      page_table=jnp.where(which[:, None], tables.num_pages,
                           tables.page_table),
      lengths=jnp.where(which, 0, tables.lengths), free=free,
      num_free=tables.num_free + jnp.sum(freed, dtype=jnp.int32), refs=refs)


def copy_pages(pool: Any, source: Array, target: Array) -> Any:
  """Every pool leaf [(layers,) kv_heads, num_pages, page_size, head_dim]
  with page target[i] overwritten by page source[i] (a target out of range
  is dropped)."""
  def copy(leaf):
    rest = (slice(None), slice(None))
    return leaf.at[(Ellipsis, target) + rest].set(
        leaf[(Ellipsis, jnp.clip(source, 0, leaf.shape[-3] - 1)) + rest],
        mode="drop")
  return jax.tree.map(copy, pool)


def fork(tables: PageTables, pool: Any, source: Array, target: Array
         ) -> Tuple[PageTables, Any]:
  """Sequence target[i] starts as a copy of sequence source[i] (a sample
  of a prompt): it reads source's full pages in place (shared, held until
  their last reader releases them) and gets a fresh page holding a copy of
  source's partial last page, where its own tokens then go. No page is
  written by two sequences.

  Args:
    tables: the pool's state; each target must hold nothing (released or
      never used) and appear once.
    pool: the model's "cache" collection of pools (`make_pool`).
    source, target: int [k] sequence indices; a target out of range
      (num_seqs: none) forks nothing.
  Returns:
    (tables, pool). When the free pages do not cover the partial pages,
    `exhausted` is set and the targets hold the shared full pages only.
  """
  size = tables.page_size
  source = jnp.asarray(source, jnp.int32)
  target = jnp.asarray(target, jnp.int32)
  valid = (target >= 0) & (target < tables.lengths.shape[0])
  length = jnp.where(valid, tables.lengths[source], 0)
  full = length // size
  column = jnp.arange(tables.page_table.shape[1])[None, :]
  shared = column < full[:, None]
  rows = jnp.where(shared, tables.page_table[source], tables.num_pages)
  refs = tables.refs.at[rows.reshape(-1)].add(1, mode="drop")
  page_table = tables.page_table.at[target].set(rows)
  lengths = tables.lengths.at[target].set(full * size)
  tables = dataclasses.replace(tables, page_table=page_table,
                               lengths=lengths, refs=refs)
  tables = reserve(tables, tables.lengths.at[target].set(length))
  partial = (valid & (length % size > 0)
             & (tables.lengths[target] == length))
  pick = lambda table: jnp.take_along_axis(table, full[:, None], 1)[:, 0]
  pool = copy_pages(
      pool, pick(tables.page_table[source]),
      jnp.where(partial, pick(tables.page_table[target]), tables.num_pages))
  return tables, pool


def check_not_exhausted(tables: PageTables) -> None:
  """Raises (on the host) when an allocation found the pool too small."""
  if bool(tables.exhausted):
    raise RuntimeError(
        f"paged KV cache: the pool of {tables.num_pages} pages of "
        f"{tables.page_size} positions ran out (or a sequence outgrew its "
        "table's max_pages); give make_pool and init_tables more pages (or "
        "decode fewer sequences at once).")


def positions_of(index: PagedIndex, length: int) -> Array:
  """int32 [batch, length]: the sequence positions of a call's tokens."""
  return index.start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def write_pages(pool: Array, index: PagedIndex, new: Array) -> Array:
  """pool [heads, num_pages, page_size, head_dim] with the call's `new`
  [batch, L, heads, head_dim] written at their positions' pages and slots;
  a negative position, one past the table, or one whose page is missing
  (num_pages) is dropped."""
  num_pages = pool.shape[1]
  position = positions_of(index, new.shape[1])
  valid = (position >= 0) & (position < index.capacity)
  column = jnp.clip(position // index.page_size, 0,
                    index.page_table.shape[1] - 1)
  page = jnp.take_along_axis(index.page_table, column, axis=1)
  page = jnp.where(valid, page, num_pages)
  return pool.at[:, page, position % index.page_size].set(
      jnp.moveaxis(new, 2, 0).astype(pool.dtype), mode="drop")


def gather_pages(pool: Array, page_table: Array) -> Array:
  """Each row's positions 0 .. max_pages x page_size - 1, read through its
  page table: pool [heads, num_pages, page_size, head_dim], page_table
  [batch, max_pages] -> [batch, heads, max_pages x page_size, head_dim]
  (the contiguous cache's layout, `kv_cache.update_kv_cache`); a missing
  page reads zeros."""
  pages = pool.at[:, page_table].get(mode="fill", fill_value=0)
  heads, batch, max_pages, size, head_dim = pages.shape
  return jnp.swapaxes(pages.reshape(heads, batch, max_pages * size,
                                    head_dim), 0, 1)


def paged_mask(index: PagedIndex, length: int) -> Array:
  """bool [batch, 1, length, max_pages x page_size]: each of the call's
  queries attends to its sequence's positions up to its own
  (`kv_cache.cache_mask`'s rule, every held position real); a pad (a
  negative position) attends to nothing and is not read."""
  query = positions_of(index, length)
  key = jnp.arange(index.capacity, dtype=jnp.int32)
  mask = (key[None, None, :] <= query[:, :, None]) & (query[:, :, None] >= 0)
  return mask[:, None]


def paged_window_mask(index: PagedIndex, length: int, window) -> Array:
  """bool [batch, 1, length, max_pages x page_size]: keys fewer than
  `window` positions before the query (`attentions.window_mask` with
  per-row positions)."""
  query = positions_of(index, length)
  key = jnp.arange(index.capacity, dtype=jnp.int32)
  return ((query[:, :, None] - key[None, None, :]) < window)[:, None]


def update_paged(module: nn.Module, name: str, new: Array,
                 index: PagedIndex) -> Array:
  """The paged counterpart of `kv_cache.update_kv_cache`: writes `new`
  [batch, L, heads, head_dim] into the pool `name` of the "cache"
  collection and returns the pool written [heads, num_pages, page_size,
  head_dim] (read by `paged_attention.attend_pages`, or by `attend` as
  `gather_pages`' one chunk)."""
  if not module.has_variable("cache", name):
    raise ValueError(
        f"paged KV cache: no page pool {name!r} in the 'cache' collection; "
        "pass the pools of paged_kv.make_pool as the cache.")
  var = module.variable("cache", name)
  pool = var.value
  if pool.ndim != 4 or pool.shape[2] != index.page_size:
    raise ValueError(
        f"paged KV cache: the pool {name!r} has shape {pool.shape}; a pool "
        f"of pages of {index.page_size} positions is [kv_heads, num_pages, "
        f"{index.page_size}, head_dim] (paged_kv.make_pool).")
  var.value = write_pages(pool, index, new)
  return var.value


def make_pool(model: nn.Module, params: Any, num_pages: int,
              page_size: int) -> Any:
  """The model's "cache" collection as page pools: each `cached_key` /
  `cached_value` of its decode step as zeros [(layers,) kv_heads,
  num_pages, page_size, head_dim] in the cache's dtype. `model` is a
  decoder-only module with `decode_step` (`attentions.Attention` layers)."""
  one = jnp.ones((1, 1), jnp.int32)
  shapes = jax.eval_shape(
      lambda p: model.apply({"params": p}, one, one, one, 0,
                            method=model.decode_step, mutable=["cache"])[1],
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                   params))["cache"]

  def pool(leaf):
    if leaf.ndim not in (4, 5):
      raise ValueError(f"paged KV cache: a cache entry of shape {leaf.shape} "
                       "is not [(layers,) batch, kv_heads, length, head_dim].")
    lead = leaf.shape[:-4]
    _, heads, _, head_dim = leaf.shape[-4:]
    return jnp.zeros(lead + (heads, num_pages, page_size, head_dim),
                     leaf.dtype)
  return jax.tree.map(pool, shapes)
