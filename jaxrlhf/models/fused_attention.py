"""Fused self-attention kernels for the decoder-only families' causal
attention within segments (`layers.CausalSegments`).

'splash' is Pallas's splash attention (jax.experimental.pallas.ops.tpu.
splash_attention), a TPU flash-attention kernel: the [length, length]
logits are never formed, blocks that the causal (or sliding-window) mask
hides are skipped, and packing's segment ids, Gemma's logit soft cap and
grouped key/value heads are the kernel's own arguments. Off a TPU (the
tests on CPU) the same kernel runs in Pallas's interpret mode:
`jax.lax.platform_dependent` picks the compiled kernel when the step is
lowered for a TPU and the interpreter otherwise, so the plan of a TPU slice
made on a CPU host compiles the real kernel.

The kernel wants lengths in blocks of 128: a sequence is padded up to the
next multiple, every pad its own segment, and cut back. It takes no
arbitrary bias, so T5's relative-position attention cannot use it (T5Config
says so). Under a mesh the kernel runs per shard (`jax.shard_map` over the
batch and head axes that the logical axis rules give), since XLA cannot
partition a Pallas call itself.

'dot_product_cudnn' with packing's segment ids calls cuDNN's flash
attention in its packed layout: each row's runs of equal segment ids are
sequences given by their offsets and lengths (`cudnn_segment_args`), with
its causal mask and sliding window, so no [length, length] mask or bias is
built either. That layout needs a Hopper (sm90) GPU or later. There,
unpacked rows (the attention mask's one segment) use it too, as three
runs: padding, the real tokens, padding (`cudnn_unpacked`); older GPUs get
the dense mask, which reaches cuDNN as a [batch, 1, length, length] bias
whose gradient it also computes. (Choosing between the two per row with
`lax.cond` costs a GPU a host synchronisation per layer: measured on an
H100, the step was as slow as with the bias.)
"""

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning

Array = jax.Array

# Splash attention's lanes: lengths are padded to a multiple of this, and
# its blocks are multiples of it.
LANES = 128


def padded_length(length: int) -> int:
  return -(-length // LANES) * LANES


def block_size(length: int) -> int:
  """The largest of 512, 256, 128 dividing `length` (a multiple of 128)."""
  return next(b for b in (512, 256, 128) if length % b == 0)


def kernel_segment_ids(segment_ids: Array) -> Array:
  """Segment ids where every pad (id 0) is a segment of its own, so that a
  pad attends to itself only and nothing attends to a pad: int32 [..., L],
  real ids kept (> 0), pad t -> -1 - t."""
  ids = jnp.asarray(segment_ids).astype(jnp.int32)
  slots = jnp.arange(ids.shape[-1], dtype=jnp.int32)
  return jnp.where(ids > 0, ids, -1 - slots)


def _splash_kernel(length: int, heads: int, window: Optional[int],
                   logit_softcap: Optional[float], interpret: bool):
  # Imported here: the module needs nothing of Pallas unless 'splash' runs.
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top
  block = block_size(length)
  sizes = splash.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block,
      block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
      block_q_dq=block, block_kv_dq=block)
  shape = (length, length)
  # A window w lets query q see keys q - w + 1 .. q.
  mask = (splash.CausalMask(shape) if window is None
          else splash.LocalMask(shape, window_size=(window - 1, 0), offset=0))
  # Made afresh in each trace: the kernel holds its masks' block tables as
  # arrays of the trace (constants of the step), so it cannot outlive it.
  return splash.make_splash_mha_single_device(
      splash.MultiHeadMask([mask] * heads), block_sizes=sizes,
      attn_logits_soft_cap=logit_softcap, interpret=interpret)


def _splash_local(query, key, value, ids, *, window, window_choices,
                  logit_softcap, interpret):
  """Splash attention of unsharded (or per-shard) arrays; see `splash`."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # pylint: disable=g-import-not-at-top
  batch, length, heads, _ = query.shape
  total = padded_length(length)
  pad = ((0, 0), (0, total - length), (0, 0), (0, 0))
  # [batch, heads, length, head_dim], the kernel's layout.
  q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (query, key,
                                                              value))
  ids = kernel_segment_ids(jnp.pad(ids, ((0, 0), (0, total - length))))

  def run(static_window):
    kernel = _splash_kernel(total, heads, static_window, logit_softcap,
                            interpret)
    def one(q, k, v, ids):
      return kernel(q, k, v, segment_ids=splash.SegmentIds(ids, ids))
    return jax.vmap(one)(q, k, v, ids)

  if window_choices is None:
    out = run(window)
  else:
    # A scanned layer's window is traced: one kernel per window the stack
    # has, the layer's picked by its index.
    table = jnp.asarray([NO_WINDOW if w is None else w
                         for w in window_choices], jnp.int32)
    index = jnp.argmax(table == window)
    out = jax.lax.switch(index, [functools.partial(run, w)
                                 for w in window_choices])
  return out.transpose(0, 2, 1, 3)[:, :length]


# A layer without a window in a table of windows (layers.NO_WINDOW).
NO_WINDOW = np.iinfo(np.int32).max


def splash(query: Array, key: Array, value: Array, segment_ids: Array, *,
           scale: float, window=None,
           window_choices: Optional[Sequence[Optional[int]]] = None,
           logit_softcap: Optional[float] = None) -> Array:
  """Causal attention within segments by Pallas splash attention.

  Args:
    query: [batch, length, heads, head_dim].
    key, value: [batch, length, kv_heads, head_dim]; heads % kv_heads == 0.
    segment_ids: int [batch, length]; query q sees key k <= q of its own
      segment; id 0 is padding, each pad a segment of its own.
    scale: the logits' multiplier (folded into the queries).
    window: None (all earlier keys of the segment), a Python int (keys
      fewer than `window` slots back), or a traced int32 (a scanned layer's)
      that is one of `window_choices` (None or layers.NO_WINDOW: none).
    logit_softcap: cap * tanh(logits / cap) before the mask (Gemma 2).
  Returns:
    [batch, length, heads, head_dim] in query's dtype.
  """
  if window_choices is None and not (window is None
                                     or isinstance(window, (int, np.integer))):
    raise ValueError("splash: a traced window needs window_choices, the "
                     "windows of the layer stack.")
  if window_choices is not None:
    window_choices = tuple(None if w in (None, NO_WINDOW) else int(w)
                           for w in window_choices)
    if len(set(window_choices)) == 1:
      window, window_choices = window_choices[0], None
  if window is not None and window_choices is None:
    window = int(window)
  dtype = query.dtype
  query = (query.astype(jnp.float32) * scale).astype(dtype)
  key, value = key.astype(dtype), value.astype(dtype)
  options = dict(window=window, window_choices=window_choices,
                 logit_softcap=logit_softcap)

  def on(interpret):
    return functools.partial(_sharded, interpret=interpret, **options)

  return jax.lax.platform_dependent(query, key, value, segment_ids,
                                    tpu=on(False), default=on(True))


def _sharded(query, key, value, ids, **options):
  """`_splash_local` per shard of the context mesh, if there is one."""
  mesh = jax.sharding.get_abstract_mesh()
  local = functools.partial(_splash_local, **options)
  if mesh.empty:
    return local(query, key, value, ids)
  spec = nn_partitioning.logical_to_mesh_axes(("batch", "length", "heads",
                                               "kv"))
  kv_spec = nn_partitioning.logical_to_mesh_axes(("batch", "length",
                                                  "kv_heads", "kv"))
  if spec[1] is not None or spec[3] is not None:
    raise ValueError(
        "attention_impl='splash' needs the 'length' and 'kv' axes unsharded "
        f"(the logical axis rules give {spec}).")
  heads, kv_heads = query.shape[2], key.shape[2]

  def divides(axes, size):
    axes = axes if isinstance(axes, tuple) else (axes,)
    return size % int(np.prod([mesh.shape[a] for a in axes if a])) == 0

  # An axis that does not split evenly (a batch of one when parameters are
  # initialised) is left whole.
  batch_axes = spec[0] if divides(spec[0], query.shape[0]) else None
  head_axes = spec[2] if divides(spec[2], heads) else None
  spec = jax.sharding.PartitionSpec(batch_axes, None, head_axes, None)
  if head_axes is not None and kv_heads != heads and (
      kv_spec[2] != head_axes or not divides(head_axes, kv_heads)):
    # Key/value heads replicated while query heads are split: give each
    # query head its own copy, so every shard holds the heads it reads.
    key = jnp.repeat(key, heads // kv_heads, axis=2)
    value = jnp.repeat(value, heads // kv_heads, axis=2)
  ids_spec = jax.sharding.PartitionSpec(batch_axes, None)
  return jax.shard_map(local, in_specs=(spec, spec, spec, ids_spec),
                       out_specs=spec, check_vma=False)(query, key, value,
                                                        ids)


# ----------------------------------------------------------------------------
# cuDNN's packed layout.

def cudnn_segment_args(segment_ids: Array, max_runs: int):
  """The packed layout of cuDNN's flash attention for rows of contiguous
  segments: each run of equal ids in a row (a packed example, or the
  padding after them) is one sequence.

  Args:
    segment_ids: int [batch, length], each id in one contiguous run.
    max_runs: static bound on the runs of a row (packed examples + 1).
  Returns:
    (seqlen [batch, max_runs], offsets [batch, max_runs + 1]) int32: run
    m of row b starts at offsets[b, m] and has seqlen[b, m] tokens; -1
    past a row's last run (cuDNN's convention).
  """
  ids = jnp.asarray(segment_ids).astype(jnp.int32)
  batch, length = ids.shape
  starts = jnp.concatenate([jnp.ones((batch, 1), bool),
                            ids[:, 1:] != ids[:, :-1]], axis=1)
  run = jnp.cumsum(starts, axis=1) - 1
  rows = jnp.arange(batch)[:, None]
  counts = jnp.zeros((batch, max_runs + 1), jnp.int32).at[rows, run].add(
      1, mode="drop")
  begin = jnp.cumsum(counts, axis=1) - counts
  used = counts > 0
  seqlen = jnp.where(used, counts, -1)[:, :max_runs]
  offsets = jnp.where(used, begin, -1)
  return seqlen, offsets


def cudnn(query: Array, key: Array, value: Array, segment_ids: Array, *,
          max_runs: int, scale: float, window: Optional[int] = None
          ) -> Array:
  """Causal attention within segments by cuDNN's flash attention in its
  packed layout (GPU, sm90 or later); shapes as `splash`, window a Python
  int or None."""
  # Private module: jax.nn.dot_product_attention has no segment ids.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention  # pylint: disable=g-import-not-at-top
  if window is not None and not isinstance(window, (int, np.integer)):
    raise ValueError("attention_impl='dot_product_cudnn' with segment ids "
                     "needs one sliding window per compiled layer; set "
                     "model.scan_layers=False for layers with different "
                     "windows.")
  seqlen, offsets = cudnn_segment_args(segment_ids, max_runs)
  return cudnn_attention.dot_product_attention(
      query, key, value, q_seqlen=seqlen, kv_seqlen=seqlen,
      q_offsets=offsets, kv_offsets=offsets, scale=scale,
      mask_type=cudnn_attention.MaskType.PADDING_CAUSAL,
      sliding_window_length=None if window is None else int(window),
      qkv_layout="BTNH").astype(query.dtype)


def packed_layout_available() -> bool:
  """Whether this process's devices are GPUs that take cuDNN's packed
  layout (compute capability 9.0, Hopper, or later)."""
  capability = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return float(capability) >= 9.0
  except (TypeError, ValueError):
    return False


def cudnn_unpacked(query: Array, key: Array, value: Array,
                   segment_ids: Array, *, scale: float,
                   window: Optional[int] = None) -> Array:
  """Causal attention over each row's real tokens (`segment_ids` the
  attention mask, 1 = real) by cuDNN's packed layout, without a dense mask:
  a row is at most three runs, padding, its real tokens, padding (right-
  padded training rows, a left-padded prompt followed by its response), so
  the real tokens attend as `CausalSegments` says and each run of padding
  attends causally within itself (outputs nothing reads). A row whose real
  tokens are not contiguous cannot be described so: its outputs are NaN
  (the step's loss is then non-finite, and the loop stops the run without
  applying it), never a silently different attention. Shapes as `splash`;
  `window` a Python int or None."""
  real = jnp.asarray(segment_ids) > 0
  starts = real & ~jnp.pad(real, ((0, 0), (1, 0)))[:, :-1]
  contiguous = jnp.sum(starts, axis=-1) <= 1
  # A per-row factor on the query: elementwise, so XLA can fuse it with
  # the rotary embedding that produces the query.
  poison = jnp.where(contiguous, 1.0, jnp.nan).astype(query.dtype)
  return cudnn(query * poison[:, None, None, None], key, value,
               real.astype(jnp.int32), max_runs=3, scale=scale,
               window=window)
