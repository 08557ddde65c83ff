"""The paged KV cache (models/layers/paged_kv.py).

The truths: (1) attention over a sequence's pages, written token by token
and prompt by prompt in any interleaving with other sequences (and with
pages freed and reused between), equals softmax attention over that
sequence's keys alone, computed in numpy, whether it gathers the table's
whole width or reads only the pages in use (`paged_attention`: in blocks
of any size, with windows, soft caps, grouped heads, queries of very
different lengths, pads and a sequence holding no page; JAX's TPU kernel
in Pallas' interpret mode equal to it); (2) the free list: a released
sequence's pages are the next ones handed out, a page shared by a group
is freed with its last reader only, an allocation the pool cannot cover
allocates nothing and is reported; (3) a tiny Llama (and a Gemma 3,
whose local layers' windows are shorter than the sequences) decoded on
pages (prefill of left-padded prompts, the samples of a prompt sharing
its pages, pages released at EOS; a Gemma with soft-capped logits; reading
the pages in use or gathering the whole table) draws the tokens and
log-probs of `sampling.sample_decoder_only` with the same key, holding
the group's prompt pages once; (4) `engine.generate` on pages keeps the
engine's contract (each prompt's samples its row of the lockstep batch)
in a pool smaller than slots x budget, also where that pool runs short
and sequences are preempted and resumed (alone and in groups), and a
pool below one longest sequence is refused.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import engine
from jaxrlhf.models import gemma
from jaxrlhf.models import gemma3
from jaxrlhf.models import llama
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import paged_attention
from jaxrlhf.models.layers import paged_kv
from jaxrlhf.models.layers import rotary

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def reference_attention(query, keys, values):
  """numpy softmax(q k^T / sqrt(d)) v of one query [heads, d] over one
  sequence's keys and values [n, kv_heads, d] (grouped heads)."""
  groups = HEADS // KV_HEADS
  out = np.zeros((HEADS, HEAD_DIM))
  for h in range(HEADS):
    k, v = keys[:, h // groups], values[:, h // groups]
    logits = k @ query[h] / np.sqrt(HEAD_DIM)
    weights = np.exp(logits - logits.max())
    out[h] = (weights / weights.sum()) @ v
  return out


def test_attention_over_pages_equals_attention_over_each_sequence():
  rng = np.random.default_rng(0)
  page_size, max_pages, num_pages, seqs = 4, 6, 40, 5
  tables = paged_kv.init_tables(num_pages, page_size, seqs, max_pages)
  pools = [jnp.zeros((KV_HEADS, num_pages, page_size, HEAD_DIM))] * 2
  written = [[] for _ in range(seqs)]  # each sequence's (key, value) rows

  def write(tables, pools, rows, new_k, new_v, start, length):
    """rows' new tokens (new_k/new_v [len(rows), L, kv, d]) at start."""
    want = np.asarray(tables.lengths).copy()
    want[rows] = length
    tables = paged_kv.reserve(tables, want)
    index = paged_kv.PagedIndex(tables.page_table[np.asarray(rows, np.int32)],
                                jnp.asarray(start, jnp.int32), page_size)
    pools = [paged_kv.write_pages(p, index, x)
             for p, x in zip(pools, (new_k, new_v))]
    return tables, pools

  # Left-padded prompts of sequences 0..2 in one call (pads dropped).
  prompt_len = 7
  real = np.array([7, 2, 5])
  new_k = rng.normal(size=(3, prompt_len, KV_HEADS, HEAD_DIM))
  new_v = rng.normal(size=(3, prompt_len, KV_HEADS, HEAD_DIM))
  tables, pools = write(tables, pools, [0, 1, 2], new_k, new_v,
                        real - prompt_len, real)
  for b in range(3):
    for j in range(prompt_len - real[b], prompt_len):
      written[b].append((new_k[b, j], new_v[b, j]))
  # Then tokens one at a time, the sequences taking turns at random (3 and
  # 4 start empty), sequence 1 released and restarted half way.
  for step in range(40):
    rows = sorted(rng.choice(seqs, size=rng.integers(1, seqs + 1),
                             replace=False))
    rows = [r for r in rows if len(written[r]) < max_pages * page_size]
    if step == 20:
      tables = paged_kv.release(tables, np.arange(seqs) == 1)
      written[1] = []
    if not rows:
      continue
    k1 = rng.normal(size=(len(rows), 1, KV_HEADS, HEAD_DIM))
    v1 = rng.normal(size=(len(rows), 1, KV_HEADS, HEAD_DIM))
    start = np.array([len(written[r]) for r in rows])
    tables, pools = write(tables, pools, rows, k1, v1, start, start + 1)
    for i, r in enumerate(rows):
      written[r].append((k1[i, 0], v1[i, 0]))
  assert not bool(tables.exhausted)
  lengths = np.array([len(w) for w in written])
  np.testing.assert_array_equal(tables.lengths, lengths)

  # One query per sequence at its next position, through `attend` over
  # the gathered pages with the paged mask.
  query = rng.normal(size=(seqs, 1, HEADS, HEAD_DIM))
  index = paged_kv.PagedIndex(tables.page_table,
                              jnp.asarray(lengths - 1, jnp.int32), page_size)
  keys, values = (paged_kv.gather_pages(p, tables.page_table)
                  for p in pools)
  gathered = attentions.attend(jnp.asarray(query, jnp.float32), (keys,),
                               (values,), paged_kv.paged_mask(index, 1),
                               cache_layout=True)
  in_use = paged_attention.attend_pages(
      jnp.asarray(query, jnp.float32), *pools, index,
      scale=1 / np.sqrt(HEAD_DIM), pages_per_block=2)
  for got in (gathered, in_use):
    for s in range(seqs):
      k = np.stack([kv[0] for kv in written[s]])
      v = np.stack([kv[1] for kv in written[s]])
      np.testing.assert_allclose(got[s, 0],
                                 reference_attention(query[s, 0], k, v),
                                 rtol=1e-5, atol=1e-5)


def random_pages(rng, lengths, page_size=4, max_pages=8, num_pages=40,
                 dtype=jnp.float32):
  """Pools [kv_heads, num_pages, page_size, d] of random keys and values
  (every page, held or not: a read of a page not in use shows) and the
  tables of sequences of `lengths` (0: holding no page)."""
  tables = paged_kv.init_tables(num_pages, page_size, len(lengths),
                                max_pages)
  # Shuffle the free list: a sequence's pages scattered over the pool.
  tables = dataclasses.replace(
      tables, free=jnp.asarray(rng.permutation(num_pages), jnp.int32))
  tables = paged_kv.reserve(tables, jnp.asarray(lengths, jnp.int32))
  assert not bool(tables.exhausted)
  shape = (KV_HEADS, num_pages, page_size, HEAD_DIM)
  pools = [jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2)]
  return tables, pools


def reference_paged(query, pools, table, start, page_size, scale, window,
                    cap):
  """numpy attention of query [B, L, heads, d] (row b's token j at
  position start[b] + j) over its sequence's positions read one by one
  through its table ({(b, j): [heads, d]}); a pad (negative position) is
  left out, a row holding no page None."""
  k_pool, v_pool = (np.asarray(p, np.float64) for p in pools)
  groups = HEADS // KV_HEADS
  out = {}
  for b in range(query.shape[0]):
    for j in range(query.shape[1]):
      p = int(start[b]) + j
      if p < 0:
        continue
      keys = [i for i in range(p + 1) if window is None or p - i < window]
      pages = [int(table[b, i // page_size]) for i in keys]
      if max(pages) >= k_pool.shape[1]:
        out[b, j] = None
        continue
      slots = [i % page_size for i in keys]
      row = np.zeros((HEADS, HEAD_DIM))
      for h in range(HEADS):
        k = k_pool[h // groups, pages, slots]
        v = v_pool[h // groups, pages, slots]
        logits = k @ query[b, j, h] * scale
        if cap is not None:
          logits = np.tanh(logits / cap) * cap
        w = np.exp(logits - logits.max())
        row[h] = (w / w.sum()) @ v
      out[b, j] = row
  return out


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 1.5),
                                        (7, 2.0)])
@pytest.mark.parametrize("length", [1, 3])
def test_reading_pages_in_use_equals_the_gather(window, cap, length):
  """Sequences of 1, 31, 6, 17 and 0 positions (the last holding no page)
  in tables of 32: attend_pages, in blocks of 1, 3 and the default pages,
  equals numpy and the gather of the whole table on every real query
  (L queries per row, the last at the row's last held position; a row's
  earlier ones pads where its position is negative); the row holding no
  page reads zeros in both."""
  rng = np.random.default_rng(2)
  page_size, lengths = 4, np.array([1, 31, 6, 17, 0])
  tables, pools = random_pages(rng, lengths, page_size)
  start = np.maximum(lengths, 1) - length
  index = paged_kv.PagedIndex(tables.page_table, jnp.asarray(start,
                                                             jnp.int32),
                              page_size)
  query = rng.normal(size=(len(lengths), length, HEADS, HEAD_DIM))
  query = jnp.asarray(query, jnp.float32)
  scale = 0.3
  mask = paged_kv.paged_mask(index, length)
  if window is not None:
    mask &= paged_kv.paged_window_mask(index, length, window)
  gathered = attentions.attend(
      query, (paged_kv.gather_pages(pools[0], tables.page_table),),
      (paged_kv.gather_pages(pools[1], tables.page_table),), mask,
      scale=scale, logit_softcap=cap, cache_layout=True)
  want = reference_paged(np.asarray(query, np.float64), pools,
                         np.asarray(tables.page_table), start, page_size,
                         scale, window, cap)
  for per_block in (1, 3, None):
    got = paged_attention.attend_pages(query, *pools, index, scale=scale,
                                       logit_softcap=cap, window=window,
                                       pages_per_block=per_block)
    for (b, j), row in want.items():
      if row is None:
        np.testing.assert_array_equal(got[b, j], 0.0)
        np.testing.assert_array_equal(gathered[b, j], 0.0)
        continue
      np.testing.assert_allclose(got[b, j], row, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(got[b, j], gathered[b, j], rtol=1e-5,
                                 atol=1e-5)


def test_pages_past_the_longest_query_or_before_every_window_are_not_read():
  """Two sequences holding 32 positions each, queried at positions 11 and
  13 with a window of 4: every page outside columns 2 .. 3 (positions 8 ..
  15, the blocks from the earliest windowed key to the latest query) is
  NaN. Reading pages in use (one page a block) stays finite and exact; the
  gather of the whole table reads the NaNs."""
  rng = np.random.default_rng(6)
  tables, pools = random_pages(rng, [32, 32])
  table = np.asarray(tables.page_table)
  unread = np.concatenate([table[:, :2].ravel(), table[:, 4:].ravel()])
  pools = [p.at[:, unread].set(jnp.nan) for p in pools]
  start = np.array([11, 13])
  index = paged_kv.PagedIndex(tables.page_table,
                              jnp.asarray(start, jnp.int32), 4)
  query = jnp.asarray(rng.normal(size=(2, 1, HEADS, HEAD_DIM)), jnp.float32)
  got = paged_attention.attend_pages(query, *pools, index, scale=0.5,
                                     window=4, pages_per_block=1)
  want = reference_paged(np.asarray(query, np.float64), pools, table, start,
                         4, 0.5, 4, None)
  for (b, j), row in want.items():
    np.testing.assert_allclose(got[b, j], row, rtol=1e-5, atol=1e-5)
  mask = (paged_kv.paged_mask(index, 1)
          & paged_kv.paged_window_mask(index, 1, 4))
  gathered = attentions.attend(
      query, (paged_kv.gather_pages(pools[0], tables.page_table),),
      (paged_kv.gather_pages(pools[1], tables.page_table),), mask,
      scale=0.5, cache_layout=True)
  assert np.isnan(np.asarray(gathered)).all()


def test_a_traced_window_reads_as_a_static_one():
  """A scanned stack's window is a traced scalar (NO_WINDOW: none)."""
  rng = np.random.default_rng(3)
  tables, pools = random_pages(rng, [9, 30, 2])
  index = paged_kv.PagedIndex(tables.page_table,
                              jnp.array([8, 29, 1], jnp.int32), 4)
  query = jnp.asarray(rng.normal(size=(3, 1, HEADS, HEAD_DIM)), jnp.float32)
  run = jax.jit(lambda w: paged_attention.attend_pages(
      query, *pools, index, scale=0.5, window=w, pages_per_block=1))
  for window in (3, None):
    static = paged_attention.attend_pages(query, *pools, index, scale=0.5,
                                          window=window, pages_per_block=1)
    traced = run(jnp.int32(attentions.NO_WINDOW if window is None
                           else window))
    np.testing.assert_allclose(traced, static, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_tpu_kernel_interpreted_equals_reading_pages_in_use(cap):
  """JAX's Pallas TPU paged-attention kernel, in its interpret mode on
  this CPU, on bfloat16 pools (which it reads exactly) equals
  attend_pages, the row holding no page included (zeros)."""
  rng = np.random.default_rng(4)
  lengths = np.array([1, 31, 6, 0, 17])
  tables, pools = random_pages(rng, lengths, dtype=jnp.bfloat16)
  index = paged_kv.PagedIndex(
      tables.page_table, jnp.asarray(np.maximum(lengths, 1) - 1, jnp.int32),
      4, read="kernel")
  query = jnp.asarray(rng.normal(size=(5, 1, HEADS, HEAD_DIM)), jnp.float32)
  # (Called directly: `choose` keeps the kernel to head_dims of 128s, which
  # a TPU compiles, and this test's 8 interprets as well.)
  got = paged_attention.tpu_kernel(query, *pools, index, scale=0.4,
                                   logit_softcap=cap)
  want = paged_attention.attend_pages(query, *pools, index, scale=0.4,
                                      logit_softcap=cap)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[3], 0.0)


def test_auto_gathers_short_tables_and_reads_long_ones_in_use():
  """Off TPU, 'auto' is the gather up to GATHER_POSITIONS positions a row,
  the loop over pages in use beyond; 'kernel' only where asked for, and
  only for the calls it takes. Compiled for a TPU, 'auto' is the kernel
  for a bfloat16 pool's decode step with a head_dim of 128s (the kernel's
  block shapes: tests/test_plan.py compiles it for v5e chips)."""
  def index(max_pages, page_size=16, read="auto"):
    return paged_kv.PagedIndex(jnp.zeros((1, max_pages), jnp.int32),
                               jnp.zeros((1,), jnp.int32), page_size, read)

  def pool(dtype, head_dim=128):
    return jax.ShapeDtypeStruct((2, 8, 16, head_dim), dtype)
  short = paged_attention.GATHER_POSITIONS // 16
  choose = paged_attention.choose
  assert choose(index(short), 1, None, pool(jnp.bfloat16)) == "gather"
  assert choose(index(short + 1), 1, None, pool(jnp.bfloat16)) == "pages"
  assert choose(index(1, read="kernel"), 1, None,
                pool(jnp.float32)) == "kernel"
  # Calls the kernel does not take (a prefill, a window, a head_dim of
  # 64) read in the loop.
  assert choose(index(1, read="kernel"), 3, None, pool(jnp.float32)) == (
      "pages")
  assert choose(index(1, read="kernel"), 1, 4, pool(jnp.float32)) == "pages"
  assert choose(index(1, read="kernel"), 1, None,
                pool(jnp.float32, 64)) == "pages"
  with paged_attention.compiled_for("tpu"):
    assert paged_attention.platform() == "tpu"
    assert choose(index(short), 1, None, pool(jnp.bfloat16)) == "kernel"
    assert choose(index(short), 1, None, pool(jnp.float32)) == "gather"
    assert choose(index(short), 1, None, pool(jnp.bfloat16, 64)) == (
        "gather")
  assert paged_attention.platform() == jax.default_backend()


def test_a_bad_read_is_named():
  rng = np.random.default_rng(5)
  tables, pools = random_pages(rng, [3])
  query = jnp.zeros((1, 1, HEADS, HEAD_DIM))
  index = paged_kv.PagedIndex(tables.page_table, jnp.array([2], jnp.int32),
                              4, read="fast")
  with pytest.raises(ValueError, match="read='fast'"):
    paged_attention.attend(query, *pools, index, scale=1.0)


def test_released_pages_are_reused_and_counted():
  tables = paged_kv.init_tables(6, 4, 3, 6)
  tables = paged_kv.reserve(tables, jnp.array([9, 5, 0]))  # 3 + 2 pages
  assert int(tables.num_free) == 1
  first = set(np.asarray(tables.page_table[0, :3]).tolist())
  tables = paged_kv.release(tables, jnp.array([True, False, False]))
  assert int(tables.num_free) == 4
  np.testing.assert_array_equal(tables.page_table[0], 6)  # holds none
  # Sequence 2 grows to 16 positions: 4 pages, the 3 released among them.
  tables = paged_kv.reserve(tables, jnp.array([0, 5, 16]))
  got = set(np.asarray(tables.page_table[2, :4]).tolist())
  assert first <= got and len(got) == 4
  assert not got & set(np.asarray(tables.page_table[1, :2]).tolist())
  assert int(tables.num_free) == 0 and not bool(tables.exhausted)
  tables = paged_kv.release(tables, jnp.array([True, True, True]))
  assert int(tables.num_free) == 6
  np.testing.assert_array_equal(tables.refs, 0)
  assert sorted(np.asarray(tables.free).tolist()) == list(range(6))


def test_a_shared_prompt_is_read_by_each_sample():
  rng = np.random.default_rng(1)
  page_size, num_pages = 4, 12
  tables = paged_kv.init_tables(num_pages, page_size, 4, 5)
  pool = {"k": jnp.zeros((KV_HEADS, num_pages, page_size, HEAD_DIM))}
  prompt = rng.normal(size=(1, 10, KV_HEADS, HEAD_DIM)).astype(np.float32)
  tables = paged_kv.reserve(tables, jnp.array([10, 0, 0, 0]))  # 2.5 pages
  pool["k"] = paged_kv.write_pages(
      pool["k"], paged_kv.PagedIndex(tables.page_table[:1],
                                     jnp.zeros((1,), jnp.int32), page_size),
      prompt)
  tables, pool = paged_kv.fork(tables, pool, jnp.array([0, 0, 0]),
                               jnp.array([1, 2, 3]))
  table = np.asarray(tables.page_table)
  # The full pages in place, the partial one copied to a page per sample.
  for s in (1, 2, 3):
    np.testing.assert_array_equal(table[s, :2], table[0, :2])
  assert len({table[s, 2] for s in range(4)}) == 4
  assert int(tables.num_free) == num_pages - 3 - 3
  # Each sample appends its own token at position 10; every sample reads
  # the prompt, then its own token, and the prompt's pages are unchanged.
  tables = paged_kv.reserve(tables, jnp.array([10, 11, 11, 11]))
  mine = rng.normal(size=(3, 1, KV_HEADS, HEAD_DIM)).astype(np.float32)
  pool["k"] = paged_kv.write_pages(
      pool["k"], paged_kv.PagedIndex(tables.page_table[1:],
                                     jnp.full((3,), 10, jnp.int32),
                                     page_size), mine)
  read = np.asarray(jnp.swapaxes(
      paged_kv.gather_pages(pool["k"], tables.page_table), 1, 2))
  np.testing.assert_array_equal(read[0, :10], prompt[0])
  for i, s in enumerate((1, 2, 3)):
    np.testing.assert_array_equal(read[s, :10], prompt[0])
    np.testing.assert_array_equal(read[s, 10], mine[i, 0])
  assert np.all(read[0, 10] == 0)
  # The prompt released first: its full pages live on with the samples.
  tables = paged_kv.release(tables, jnp.array([True, False, False, False]))
  assert int(tables.num_free) == num_pages - 2 - 3
  tables = paged_kv.release(tables, jnp.array([False, True, True, False]))
  assert int(tables.num_free) == num_pages - 2 - 1
  tables = paged_kv.release(tables, jnp.array([False, False, False, True]))
  assert int(tables.num_free) == num_pages


def test_exhaustion_allocates_nothing_and_is_reported():
  tables = paged_kv.init_tables(4, 2, 2, 8)
  tables = paged_kv.reserve(tables, jnp.array([4, 0]))
  paged_kv.check_not_exhausted(tables)  # 2 pages used, 2 free
  full = paged_kv.reserve(tables, jnp.array([6, 4]))  # needs 3
  assert bool(full.exhausted)
  np.testing.assert_array_equal(full.page_table, tables.page_table)
  np.testing.assert_array_equal(full.lengths, tables.lengths)
  assert int(full.num_free) == 2
  with pytest.raises(RuntimeError, match="ran out"):
    paged_kv.check_not_exhausted(full)
  # A write to a page the sequence does not hold is dropped.
  pool = jnp.zeros((KV_HEADS, 4, 2, HEAD_DIM))
  index = paged_kv.PagedIndex(full.page_table[1:], jnp.array([0], jnp.int32),
                              2)
  out = paged_kv.write_pages(pool, index,
                             jnp.ones((1, 1, KV_HEADS, HEAD_DIM)))
  np.testing.assert_array_equal(out, pool)
  # A length past the table's max_pages x page_size is refused the same way.
  assert bool(paged_kv.reserve(tables, jnp.array([17, 0])).exhausted)


VOCAB = 32
EOS = 3
NEW = 8
PROMPTS = [[5, 9, 3, 2, 7], [7, 1, 2, 8, 4, 6], [11], [2, 3, 5, 7, 11]]


@functools.lru_cache(maxsize=None)
def tiny(scan_layers: bool, family: str = "llama"):
  """(model, params, tokens, mask [B, width] left-padded PROMPTS) of a tiny
  Llama, Gemma (a window of 4 on its local layers, attention logits capped
  at 1) or Gemma 3 (a window of 4 on its local layers)."""
  config, module = {"llama": (llama.LlamaConfig, llama.Llama),
                    "gemma": (gemma.GemmaConfig, gemma.Gemma),
                    "gemma3": (gemma3.Gemma3Config, gemma3.Gemma3)}[family]
  # Gemma's attention logits capped low enough to bite.
  extra = dict(attn_logit_softcap=1.0) if family == "gemma" else {}
  config = dataclasses.replace(
      config.preset("tiny", vocab_size=VOCAB, **extra),
      scan_layers=scan_layers)
  model = module(config)
  one = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(
      jax.jit(model.init)(jax.random.PRNGKey(3), one, one, one)["params"])
  # Larger weights: peakier next-token distributions (clear greedy margins).
  params = jax.tree.map(lambda x: x * 2.0, params)
  width = max(len(r) for r in PROMPTS)
  tokens = np.zeros((len(PROMPTS), width), np.int32)
  mask = np.zeros_like(tokens)
  for b, r in enumerate(PROMPTS):
    tokens[b, width - len(r):] = r
    mask[b, width - len(r):] = 1
  return model, params, tokens, mask


def paged_sample(model, params, tokens, mask, rng, num_samples, page_size,
                 num_pages, read="auto", **options):
  """`sample_decoder_only`'s loop on pages: the prompts (sequences 0 ..
  B - 1) prefilled, forked into their samples (B + i * k + j), the prompts
  released; each step reserves a position for the live samples and feeds
  their tokens; a sample releases its pages at its EOS; attention reads the
  pages as `read` says (`PagedIndex.read`). Returns (tokens,
  logprobs [B * k, NEW], the most pages held at once, final tables)."""
  batch, length = tokens.shape
  rows = batch * num_samples
  max_pages = paged_kv.pages_for(length + NEW, page_size)
  tables = paged_kv.init_tables(num_pages, page_size, batch + rows,
                                max_pages)
  pool = paged_kv.make_pool(model, params, num_pages, page_size)
  num_real = jnp.sum(mask, axis=-1).astype(jnp.int32)
  tables = paged_kv.reserve(
      tables, jnp.zeros((batch + rows,), jnp.int32).at[:batch].set(num_real))
  index = paged_kv.PagedIndex(tables.page_table[:batch], num_real - length,
                              page_size, read)
  logits, variables = model.apply(
      {"params": params, "cache": pool}, jnp.asarray(tokens),
      rotary.positions_from_mask(jnp.asarray(mask)), None, index,
      method=model.decode_step, mutable=["cache"])
  samples = batch + jnp.arange(rows)
  tables, pool = paged_kv.fork(
      tables, variables["cache"], jnp.repeat(jnp.arange(batch), num_samples),
      samples)
  tables = paged_kv.release(tables, jnp.arange(batch + rows) < batch)
  logits = jnp.repeat(logits, num_samples, axis=0)
  num_real = jnp.repeat(num_real, num_samples)

  @jax.jit
  def step(pool, tables, logits, done, rng, t):
    rng, key = jax.random.split(rng)
    token, logprob = sampling.choose_tokens(logits, key, **options)
    token = jnp.where(done, 0, token)
    logprob = jnp.where(done, 0.0, logprob)
    ended = ~done & (token == EOS)
    done = done | ended
    tables = paged_kv.release(
        tables, jnp.zeros((batch + rows,), bool).at[samples].set(ended))
    start = tables.lengths[samples]
    tables = paged_kv.reserve(
        tables, tables.lengths.at[samples].add(jnp.where(done, 0, 1)))
    index = paged_kv.PagedIndex(tables.page_table[samples], start, page_size,
                                read)
    logits, variables = model.apply(
        {"params": params, "cache": pool}, token[:, None],
        (num_real + t)[:, None], None, index, method=model.decode_step,
        mutable=["cache"])
    return variables["cache"], tables, logits, done, rng, token, logprob

  done = jnp.zeros((rows,), bool)
  drawn, drawn_logprobs, most = [], [], 0
  for t in range(NEW):
    pool, tables, logits, done, rng, token, logprob = step(
        pool, tables, logits, done, rng, jnp.int32(t))
    drawn.append(token)
    drawn_logprobs.append(logprob)
    most = max(most, num_pages - int(tables.num_free))
  return (np.stack(drawn, 1), np.stack(drawn_logprobs, 1), most, tables)


@pytest.mark.parametrize("name,options,num_samples,scan_layers,family,read", [
    ("greedy", dict(greedy=True), 1, False, "llama", "pages"),
    ("greedy, gathered", dict(greedy=True), 1, False, "llama", "gather"),
    ("sampled", dict(temperature=1.0), 3, False, "llama", "pages"),
    ("filtered", dict(temperature=0.7, top_k=8, top_p=0.9), 2, False,
     "llama", "pages"),
    ("sampled, scanned layers", dict(temperature=1.0), 3, True, "llama",
     "pages"),
    # Windows shorter than the sequences: per layer (unrolled) and looked up
    # with the scanned layer's traced index.
    ("gemma3 windows", dict(temperature=1.0), 2, False, "gemma3", "pages"),
    ("gemma3 windows, scanned", dict(greedy=True), 1, True, "gemma3",
     "pages"),
    ("gemma3 windows, gathered", dict(greedy=True), 1, False, "gemma3",
     "gather"),
    # Soft-capped attention logits and windows.
    ("gemma soft cap", dict(temperature=1.0), 2, False, "gemma", "pages")])
def test_on_pages_samples_as_the_lockstep_sampler(name, options, num_samples,
                                                  scan_layers, family, read):
  model, params, tokens, mask = tiny(scan_layers, family)
  rng = jax.random.PRNGKey(7)
  want = sampling.sample_decoder_only(
      model, params, tokens, mask, rng, NEW, eos_id=EOS,
      num_samples=num_samples, **options)
  full = dict(temperature=1.0, top_k=0, top_p=1.0, greedy=False)
  full.update(options)
  page_size, num_pages = 2, 64
  got, logprobs, most, tables = paged_sample(
      model, params, tokens, mask, rng, num_samples, page_size, num_pages,
      read, **full)
  np.testing.assert_array_equal(got, want.tokens)
  np.testing.assert_allclose(logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
  assert not bool(tables.exhausted)
  # Every page back once every sample is released.
  tables = paged_kv.release(tables, jnp.ones_like(tables.lengths, bool))
  assert int(tables.num_free) == num_pages
  # The prompts' full pages held once: each sample holds its own pages of
  # positions full x page_size .. real + NEW - 1 only (the loop reserves
  # the position of the token it feeds last), the group its prompt's full
  # pages once; repeated per sample they would take k times.
  bound = 0
  for real in mask.sum(1):
    full = real // page_size
    bound += full + num_samples * (
        paged_kv.pages_for(real + NEW, page_size) - full)
  assert most <= bound


ENGINE_PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11], [2, 3, 5, 7, 11],
                  [4, 4, 4], [9, 8], [6, 2, 10, 12], [13]]


@pytest.fixture(scope="module")
def engine_prompts():
  width = max(len(r) for r in ENGINE_PROMPTS)
  tokens = np.zeros((len(ENGINE_PROMPTS), width), np.int32)
  mask = np.zeros_like(tokens)
  for b, r in enumerate(ENGINE_PROMPTS):
    tokens[b, width - len(r):] = r
    mask[b, width - len(r):] = 1
  return tokens, mask


@pytest.mark.parametrize("options,read", [
    (dict(greedy=True), "pages"), (dict(greedy=True), "auto"),
    (dict(temperature=0.8, top_k=10), "pages")])
def test_engine_on_pages_samples_the_lockstep_batch(engine_prompts,
                                                    options, read):
  """engine.generate with pages: prompt i's tokens are row i of
  `sample_decoder_only`'s batch with the same key (the engine's
  contract), with a pool smaller than slots x budget: any
  3 live sequences hold at most 7 + 6 + 6 pages (the 3 longest prompts,
  6, 5 and 4 tokens, with 7 tokens fed), where 3 rows of P + NEW - 1 = 13
  positions take 3 x 7. Read as `read` says ('auto' gathers these short
  tables)."""
  model, params, _, _ = tiny(False)
  tokens, mask = engine_prompts
  key = jax.random.PRNGKey(0)
  page_size, slots = 2, 3
  width = tokens.shape[1] + NEW - 1
  got, stats = engine.generate(paged_attention.reading(model, read), params,
                               tokens, mask, key, slots,
                               NEW, eos_id=EOS, refill_size=2,
                               page_size=page_size, num_pages=19,
                               **options)
  want = sampling.sample_decoder_only(model, params, tokens, mask, key, NEW,
                                      eos_id=EOS, **options)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-4,
                             atol=1e-5)
  assert int(stats.useful_slot_steps) == int(np.sum(got.mask))
  assert not bool(stats.pages_exhausted)
  assert 0 < int(stats.pages_peak) <= 19 < slots * -(-width // page_size)


@pytest.mark.parametrize("group", [1, 2])
def test_engine_on_a_small_pool_preempts_and_samples_the_same(
    engine_prompts, group):
  """A pool of `least_pages` (one longest sequence: 7 pages of 2 positions
  for 6 + 8 - 1; with groups of 2 sharing prompts, as many) under 4 slots
  that want up to 4 x 7: sequences are preempted (the youngest, resumed
  later from their prompt and tokens so far) and every row's tokens are
  those of the pool for all (itself the lockstep batch: the test above);
  one page fewer is refused up front, naming the least pool."""
  model, params, _, _ = tiny(False)
  tokens, mask = engine_prompts
  rows = np.repeat(tokens, group, axis=0), np.repeat(mask, group, axis=0)
  key = jax.random.PRNGKey(2)
  run = lambda **o: engine.generate(
      model, params, *rows, key, 4, NEW, eos_id=EOS, temperature=0.9,
      refill_size=2, page_size=2, group_size=group, **o)
  full, full_stats = run()
  least = engine.least_pages(tokens.shape[1], NEW, 2, group)
  assert least == 7
  small, small_stats = run(num_pages=least)
  np.testing.assert_array_equal(small.tokens, full.tokens)
  np.testing.assert_array_equal(small.mask, full.mask)
  np.testing.assert_allclose(small.logprobs, full.logprobs, rtol=1e-4,
                             atol=1e-5)
  assert int(full_stats.preemptions) == 0
  assert int(small_stats.preemptions) > 0
  assert not bool(small_stats.pages_exhausted)
  assert int(small_stats.pages_peak) <= least < int(full_stats.pages_peak)
  # Each resumption is a prefill of its own.
  assert (int(small_stats.prefills) - int(small_stats.preemptions)
          >= int(full_stats.prefills))
  with pytest.raises(ValueError, match=f"at least {least} pages"):
    run(num_pages=least - 1)


def test_engine_groups_share_their_prompts_pages(engine_prompts):
  """group_size k: each prompt's k samples (its rows repeated) prefilled
  once and its full pages shared (`paged_kv.fork`). The samples are those
  of the same rows decoded one prompt copy each (each row the lockstep
  batch's);
  the pool holds fewer pages at its peak and the prefills take fewer
  rows."""
  model, params, _, _ = tiny(False)
  tokens, mask = engine_prompts
  k = 3
  rows = np.repeat(tokens[:4], k, axis=0), np.repeat(mask[:4], k, axis=0)
  key = jax.random.PRNGKey(1)
  run = lambda **o: engine.generate(
      model, params, *rows, key, 6, NEW, eos_id=EOS, temperature=0.9,
      refill_size=3, page_size=2, **o)
  alone, alone_stats = run()
  grouped, grouped_stats = run(group_size=k)
  np.testing.assert_array_equal(grouped.tokens, alone.tokens)
  np.testing.assert_allclose(grouped.logprobs, alone.logprobs, rtol=1e-4,
                             atol=1e-5)
  assert not bool(grouped_stats.pages_exhausted)
  assert int(grouped_stats.pages_peak) < int(alone_stats.pages_peak)
  with pytest.raises(ValueError, match="needs page_size"):
    engine.generate(model, params, *rows, key, 6, NEW, group_size=k)
  with pytest.raises(ValueError, match="must divide"):
    engine.generate(model, params, *rows, key, 4, NEW, page_size=2,
                    group_size=k)
