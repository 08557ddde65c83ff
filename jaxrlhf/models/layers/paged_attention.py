"""Attention over a paged KV cache (`paged_kv`) that reads only the pages
in use.

`paged_kv.gather_pages` reads every row's max_pages x page_size positions
at every call, however short the rows are. `attend_pages` (XLA, any
backend) loops over blocks of pages from the first position any query may
see to the batch's longest position, and combines the blocks with the
online softmax of flash decoding (a running maximum, sum and weighted sum
per query, in float32): a short batch in a long table reads its own pages
only. `tpu_kernel` calls JAX's Pallas paged-attention kernel for TPU
(`jax.experimental.pallas.ops.tpu.paged_attention`; off TPU in Pallas'
interpret mode), which reads the same pages with its own DMA pipeline; it
takes one query per row, no window, a head_dim of a multiple of 128 (what
Mosaic compiles for v5e chips), and reads keys and values in bfloat16 (it
rounds them to bfloat16), so `choose` picks it on TPU for a bfloat16
pool's decode step only. Under a mesh of several devices it runs in
`jax.shard_map` (XLA does not partition a Mosaic kernel), each device on
its rows of the mesh's batch axes, the pools whole. `PagedIndex.read`
chooses (`READS`; 'auto': `choose`).

The loop pays where the batch's sequences are short beside the table: on
bench_engine.py's CPU workload of responses averaging 47 tokens (longest
200) in a budget of 1024, the paged engine ran 0.65 s reading the pages in
use against 0.90 s gathering the whole table; with 12-page tables (192
positions, responses averaging 11 tokens after prompts of 64) the gather
was the faster (0.23 s against 0.30 s). So 'auto' gathers tables of at most
GATHER_POSITIONS positions. On GPU the same XLA loop runs (each block a
gather of its pages and two small einsums; no fused kernel is used).

Both equal softmax attention over each row's keys up to its query's
position (and its window) to float rounding (tests/test_paged_kv.py). A
query that may see nothing (a pad, a negative position) returns zeros.

The choice follows the platform the call is compiled for: JAX's default
backend, or inside `compiled_for(platform)` that platform (a plan of TPU
chips traced on a CPU host: `jaxrlhf.plan`).
"""

import contextlib
import contextvars
import dataclasses
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models.layers import paged_kv

Array = jax.Array

READS = ("auto", "pages", "kernel", "gather")
# Positions a block of `attend_pages` covers at least: a loop step's fixed
# cost is then small beside its reads (bench_engine.py on CPU).
BLOCK_POSITIONS = 128
# The TPU kernel's pages per compute block, in positions.
KERNEL_BLOCK_POSITIONS = 512
# The kernel's blocks take a head_dim of a multiple of this only (Mosaic
# refuses the others for v5e chips: tests/test_plan.py compiles it).
KERNEL_HEAD_DIM = 128
# Tables of at most this many positions are gathered whole under 'auto'
# (two blocks: the loop's fixed cost outweighs what it leaves unread).
GATHER_POSITIONS = 2 * BLOCK_POSITIONS


def block_pages(page_size: int, max_pages: int) -> int:
  """The pages one step of `attend_pages` reads per row: BLOCK_POSITIONS
  worth (at least one page, at most the table)."""
  return max(1, min(max_pages, BLOCK_POSITIONS // page_size))


def attend_pages(query: Array, key_pool: Array, value_pool: Array,
                 index: paged_kv.PagedIndex, *, scale: float,
                 logit_softcap: Optional[float] = None, window=None,
                 pages_per_block: Optional[int] = None) -> Array:
  """softmax(softcap(q k^T * scale)) v over each row's positions up to its
  query's, read from the pages in use only.

  Args:
    query: [batch, L, heads, head_dim], row b's token j at position
      index.start[b] + j (negative: a pad, which sees nothing).
    key_pool, value_pool: [kv_heads, num_pages, page_size, head_dim]
      (`paged_kv.make_pool`'s layer pool, this call's tokens written);
      heads % kv_heads == 0, query head h reading kv head h // (heads //
      kv_heads). A missing page (num_pages in the table) reads zeros.
    index: the call's `paged_kv.PagedIndex`.
    scale: the logits' multiplier.
    logit_softcap: cap of the logits (`attentions.softcap`), or None.
    window: None, or keys fewer than `window` positions before the query
      (an int, or a traced int32 scalar: a scanned layer's).
    pages_per_block: pages per loop step (None: `block_pages`).
  Returns:
    [batch, L, heads, head_dim] in query's dtype.
  """
  batch, length, heads, head_dim = query.shape
  kv_heads, num_pages, size, _ = key_pool.shape
  groups = heads // kv_heads
  table = index.page_table
  max_pages = table.shape[1]
  per_block = pages_per_block or block_pages(size, max_pages)
  num_blocks = -(-max_pages // per_block)
  # Pad the table to whole blocks with missing pages (read as zeros, and
  # past every query anyway).
  table = jnp.pad(table, ((0, 0), (0, num_blocks * per_block - max_pages)),
                  constant_values=num_pages)
  span = per_block * size
  position = paged_kv.positions_of(index, length)  # [batch, L]
  real = position >= 0
  # Blocks [first, last): up to the batch's longest position, from the
  # earliest position a query's window reaches.
  last = jnp.minimum(
      jnp.max(jnp.where(real, position, -1)) // span + 1, num_blocks)
  first = jnp.int32(0)
  if window is not None:
    earliest = jnp.maximum(position - window + 1, 0)
    first = jnp.min(jnp.where(real, earliest, jnp.iinfo(jnp.int32).max))
    first = jnp.minimum(first // span, last)
  q = query.reshape(batch, length, kv_heads, groups, head_dim)

  def step(block, carry):
    top, total, mixed = carry
    pages = jax.lax.dynamic_slice_in_dim(table, block * per_block,
                                         per_block, axis=1)
    read = lambda pool: pool.at[:, pages].get(
        mode="fill", fill_value=0).reshape(kv_heads, batch, span, head_dim)
    keys, values = read(key_pool), read(value_pool)
    logits = jnp.einsum("btkgh,kbsh->bkgts", q, keys,
                        preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
      logits = jnp.tanh(logits / logit_softcap) * logit_softcap
    key_position = block * span + jnp.arange(span, dtype=jnp.int32)
    seen = ((key_position[None, None, :] <= position[:, :, None])
            & real[:, :, None])
    if window is not None:
      seen &= (position[:, :, None] - key_position[None, None, :]) < window
    seen = seen[:, None, None]  # [batch, 1, 1, L, span]
    # Masked logits never set the maximum nor add weight: a row that has
    # seen nothing yet keeps a finite running maximum and zero sums.
    new_top = jnp.maximum(top, jnp.max(
        jnp.where(seen, logits, jnp.finfo(jnp.float32).min), axis=-1))
    weights = jnp.where(seen, jnp.exp(logits - new_top[..., None]), 0.0)
    rescale = jnp.exp(top - new_top)
    total = total * rescale + jnp.sum(weights, axis=-1)
    mixed = mixed * rescale[..., None] + jnp.einsum(
        "bkgts,kbsh->bkgth", weights, values.astype(jnp.float32))
    return new_top, total, mixed

  shape = (batch, kv_heads, groups, length)
  carry = (jnp.full(shape, jnp.finfo(jnp.float32).min, jnp.float32),
           jnp.zeros(shape, jnp.float32),
           jnp.zeros(shape + (head_dim,), jnp.float32))
  _, total, mixed = jax.lax.fori_loop(first, last, step, carry)
  out = mixed / jnp.where(total > 0, total, 1.0)[..., None]
  out = jnp.moveaxis(out, 3, 1)  # [batch, L, kv_heads, groups, head_dim]
  return out.reshape(batch, length, heads, head_dim).astype(query.dtype)


# The platform the calls traced now are compiled for (None: JAX's default
# backend); `compiled_for` sets it.
_PLATFORM = contextvars.ContextVar("paged_attention_platform", default=None)


@contextlib.contextmanager
def compiled_for(platform: str):
  """The paged reads traced inside are chosen, and the TPU kernel run
  (not interpreted), as on `platform` ('tpu', 'gpu', 'cpu')."""
  token = _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def platform() -> str:
  """The platform the paged reads traced now are compiled for."""
  return _PLATFORM.get() or jax.default_backend()


def _several_devices() -> bool:
  """Whether the call is traced under a mesh of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


def _kernel_split(batch: int) -> Optional[Tuple[str, ...]]:
  """The mesh axes the kernel's call of `batch` rows is split over under
  the mesh traced in (a Mosaic kernel is not partitioned by XLA: on
  several devices it runs in `jax.shard_map`, each device on its rows,
  the pools whole): the logical 'batch' axis's mesh axes (() for one
  device or none, or no rule for 'batch': every device all the rows);
  None where they do not divide the rows (the kernel is not taken)."""
  if not _several_devices():
    return ()
  mesh = jax.sharding.get_abstract_mesh()
  axes = nn.logical_to_mesh_axes(("batch",))[0]
  axes = (() if axes is None else tuple(axes) if isinstance(axes, tuple)
          else (axes,))
  ways = math.prod(mesh.shape[a] for a in axes)
  return axes if batch % ways == 0 else None


def tpu_kernel(query: Array, key_pool: Array, value_pool: Array,
               index: paged_kv.PagedIndex, *, scale: float,
               logit_softcap: Optional[float] = None,
               interpret: Optional[bool] = None) -> Array:
  """`attend_pages` for one query per row, no window, through JAX's Pallas
  TPU kernel (`paged_attention`), which takes this module's pool layout
  as it is. The kernel reads keys and values rounded to bfloat16.

  Args:
    query: [batch, 1, heads, head_dim]; key_pool, value_pool, index, scale,
      logit_softcap: as `attend_pages`'s.
    interpret: run in Pallas' TPU interpret mode (None: off TPU,
      `platform()`).
  Returns:
    [batch, 1, heads, head_dim] in query's dtype.
  """
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import paged_attention  # pylint: disable=g-import-not-at-top
  batch, length, heads, head_dim = query.shape
  if length != 1:
    raise ValueError(f"paged attention: the TPU kernel takes one query per "
                     f"row, got {length}; read='pages' takes any.")
  num_pages, size = key_pool.shape[1], key_pool.shape[2]
  table = index.page_table
  max_pages = table.shape[1]
  start = index.start
  # The kernel attends to positions 0 .. lengths - 1. A row whose query's
  # page is missing (a slot holding no pages) gets length 0 (zeros, as
  # `attend_pages` over missing pages gives); the kernel copies every
  # table entry it reads, so missing ones point at page 0 (past the length).
  own = jnp.take_along_axis(
      table, jnp.clip(start // size, 0, max_pages - 1)[:, None], 1)[:, 0]
  lengths = jnp.where((start >= 0) & (own < num_pages), start + 1, 0)
  per_block = max(1, min(max_pages, KERNEL_BLOCK_POSITIONS // size))
  table = jnp.where(table < num_pages, table, 0)
  table = jnp.pad(table, ((0, 0), (0, -max_pages % per_block)))
  if interpret is None:
    interpret = platform() != "tpu"

  def call(query, key_pool, value_pool, lengths, table):
    with (pltpu.force_tpu_interpret_mode() if interpret
          else contextlib.nullcontext()):
      return paged_attention.paged_attention(
          query, key_pool, value_pool, lengths, table,
          attn_logits_soft_cap=logit_softcap,
          pages_per_compute_block=per_block)
  args = ((query[:, 0].astype(jnp.float32) * scale), key_pool, value_pool,
          lengths.astype(jnp.int32), table.astype(jnp.int32))
  split = _kernel_split(batch)
  if split is None:
    raise ValueError(f"paged attention: the TPU kernel's {batch} rows do "
                     "not divide over the mesh's batch axes; read='pages' "
                     "takes them.")
  if _several_devices():
    rows = jax.sharding.PartitionSpec(split or None)
    whole = jax.sharding.PartitionSpec()
    call = jax.shard_map(call, in_specs=(rows, whole, whole, rows, rows),
                         out_specs=rows, check_vma=False)
  return call(*args)[:, None].astype(query.dtype)


def choose(index: paged_kv.PagedIndex, length: int, window,
           key_pool: Array) -> str:
  """How a call of `length` queries per row reads its pages (of
  `key_pool`, [kv_heads, pages, page_size, head_dim]): index.read
  ('kernel' where the kernel takes the call, one query per row, no window,
  a head_dim a multiple of KERNEL_HEAD_DIM and rows that divide over the
  mesh's batch axes, else 'pages'), or for 'auto' the TPU kernel on a TPU
  (`platform()`) for a bfloat16 pool's decode step (where its bfloat16
  reads are exact), 'gather' for a table of at most GATHER_POSITIONS
  positions, else 'pages'."""
  read = index.read
  if read not in READS:
    raise ValueError(f"paged attention: PagedIndex.read={read!r}; choose "
                     f"one of {list(READS)}.")
  kernel_takes = (length == 1 and window is None
                  and key_pool.shape[-1] % KERNEL_HEAD_DIM == 0
                  and _kernel_split(index.page_table.shape[0]) is not None)
  if read == "kernel":
    return "kernel" if kernel_takes else "pages"
  if read != "auto":
    return read
  if (kernel_takes and key_pool.dtype == jnp.bfloat16
      and platform() == "tpu"):
    return "kernel"
  return "gather" if index.capacity <= GATHER_POSITIONS else "pages"


def attend(query: Array, key_pool: Array, value_pool: Array,
           index: paged_kv.PagedIndex, *, scale: float,
           logit_softcap: Optional[float] = None, window=None) -> Array:
  """Attention over the pages in use as `choose` says: 'kernel' the TPU
  kernel, 'pages' `attend_pages` ('gather' is `attentions.Attention`'s
  own path and not taken here). Arguments as `attend_pages`'s."""
  read = choose(index, query.shape[1], window, key_pool)
  if read == "gather":
    raise ValueError("paged attention: read 'gather' is "
                     "attentions.Attention's path (paged_kv.gather_pages).")
  if read == "kernel":
    return tpu_kernel(query, key_pool, value_pool, index, scale=scale,
                      logit_softcap=logit_softcap)
  return attend_pages(query, key_pool, value_pool, index, scale=scale,
                      logit_softcap=logit_softcap, window=window)


def reading(model, read: str):
  """`model` (a decoder-only module; same config and parameters) whose
  paged calls read their pages as `read` says (`PagedIndex.read`), for a
  caller that builds no index itself (`engine.generate`): a benchmark or a
  test comparing the reads."""
  if read not in READS:
    raise ValueError(f"paged attention: read={read!r}; choose one of "
                     f"{list(READS)}.")

  class Reading(type(model)):

    def decode_step(self, tokens, positions, attention_mask, cache_index):
      if isinstance(cache_index, paged_kv.PagedIndex):
        cache_index = dataclasses.replace(cache_index, read=read)
      return super().decode_step(tokens, positions, attention_mask,
                                 cache_index)

  Reading.__name__ = f"{type(model).__name__}Reading{read.title()}"
  return Reading(model.config)
