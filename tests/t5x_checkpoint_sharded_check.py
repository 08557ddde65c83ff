"""Sharded T5X reads on 8 host devices; run by test_t5x_checkpoint.py.

Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts,
hence a subprocess. Argument: a JSON object with the checkpoint paths and,
as independent truth for the chunk grids, the chunk shapes each array was
written with. Every chunk read and every shard callback is recorded, and each
shard must have read exactly the chunks that overlap it (computed here by
brute force over the chunk grid), each distinct shard once.
"""

import itertools
import json
import math
import os
import sys

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxrlhf.models import t5x_checkpoint

assert 'device_count=8' in os.environ.get('XLA_FLAGS', ''), 'needs 8 devices'
assert jax.device_count() == 8, jax.devices()

CHUNK_READS = []  # (array name, chunk index), in order
SHARD_CALLS = []  # one dict per shard callback

_original_read_chunk = t5x_checkpoint._read_chunk
_original_make_array = jax.make_array_from_callback


def _recording_read_chunk(array, chunk_index):
  CHUNK_READS.append((array.name, tuple(chunk_index)))
  return _original_read_chunk(array, chunk_index)


def _recording_make_array(shape, sharding, data_callback, dtype=None):
  def callback(index):
    first = len(CHUNK_READS)
    data = data_callback(index)
    SHARD_CALLS.append({'shape': tuple(shape), 'index': index,
                        'reads': CHUNK_READS[first:]})
    return data
  return _original_make_array(shape, sharding, callback, dtype=dtype)


t5x_checkpoint._read_chunk = _recording_read_chunk
jax.make_array_from_callback = _recording_make_array


def brute_force_overlap(shape, chunks, index):
  """Chunks whose box intersects the index box, by testing every chunk."""
  bounds = [(s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, shape)]
  grid = [range(math.ceil(n / c)) for n, c in zip(shape, chunks)]
  return {cell for cell in itertools.product(*grid)
          if all(k * c < hi and (k + 1) * c > lo
                 for k, c, (lo, hi) in zip(cell, chunks, bounds))}


def flatten(tree, prefix=()):
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(flatten(value, prefix + (key,)))
    return out
  return {prefix: tree}


def index_key(index, shape):
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def check_sharded_read(label, path, chunk_table, shardings, **kwargs):
  """Reads with shardings and checks values, shardings and chunk reads."""
  reference = flatten(t5x_checkpoint.read_t5x_checkpoint(path, **kwargs)
                      ['params'])
  CHUNK_READS.clear()
  SHARD_CALLS.clear()
  sharded = flatten(t5x_checkpoint.read_t5x_checkpoint(
      path, shardings=shardings, **kwargs)['params'])
  requested = {}
  for key, value in reference.items():
    if isinstance(shardings, jax.sharding.Sharding):
      requested[key] = shardings
    elif isinstance(shardings, dict):
      requested[key] = flatten(shardings)[key]
    else:
      requested[key] = shardings(key, value.shape, value.dtype)
  n_sharded = 0
  for key, expected_value in reference.items():
    actual = sharded[key]
    want = requested[key]
    if want is None:
      assert isinstance(actual, np.ndarray), (label, key)
      np.testing.assert_array_equal(actual, expected_value)
      continue
    n_sharded += 1
    assert isinstance(actual, jax.Array), (label, key, type(actual))
    assert actual.sharding == want, (label, key, actual.sharding, want)
    assert actual.dtype == expected_value.dtype, (label, key)
    host = np.asarray(actual)
    assert host.tobytes() == expected_value.tobytes(), (label, key)
    for shard in actual.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data),
                                    expected_value[shard.index])

  # Chunk reads, per leaf: group the recorded shard callbacks.
  reads_by_leaf = {}
  for call in SHARD_CALLS:
    names = {name for name, _ in call['reads']}
    assert len(names) <= 1, (label, names)
    if not names:
      continue  # a replica of a shard already read, or an inline leaf
    name = names.pop()
    chunks = chunk_table[name]
    expected = brute_force_overlap(call['shape'], chunks, call['index'])
    got = [cell for _, cell in call['reads']]
    assert len(got) == len(set(got)), (label, name, 'chunk read twice', got)
    assert set(got) == expected, (label, name, call['index'], got, expected)
    per_index = reads_by_leaf.setdefault(name, {})
    key = index_key(call['index'], call['shape'])
    assert key not in per_index, (label, name, 'shard read twice', key)
    per_index[key] = set(got)
  partial = 0
  for name, per_index in reads_by_leaf.items():
    grid_size = math.prod(math.ceil(n / c) for n, c in zip(
        reference[tuple(name.split('/')[1:])].shape, chunk_table[name]))
    partial += sum(len(cells) < grid_size for cells in per_index.values())
  stored = [k for k in reference if 'target/' + '/'.join(k) in chunk_table]
  print(f'{label}: {n_sharded} sharded params, {len(SHARD_CALLS)} shard '
        f'callbacks, {len(CHUNK_READS)} chunk reads, {partial} shard reads '
        f'that touched only part of their array; {len(stored)} zarr params')
  return sharded, partial


def main():
  args = json.loads(sys.argv[1])
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  named = lambda *spec: NamedSharding(mesh, P(*spec))

  # 1. encdec, a callable: kernels over 'model' like t5x's rules, the
  # embedding and the logits projection over both axes, the rest replicated.
  def encdec_sharding(path, shape, dtype):
    assert isinstance(path, tuple) and isinstance(shape, tuple), path
    layer = path[-2]
    if layer in ('query', 'key', 'value', 'wi_0', 'wi_1'):
      return named(None, 'model')
    if layer in ('out', 'wo'):
      return named('model', None)
    if layer == 'token_embedder':
      return named('model', 'data')
    if layer == 'logits_dense':
      return named('data', 'model')
    if layer == 'relpos_bias':
      return named('data', None)
    return named()

  chunks = {k: v for k, v in args['encdec_chunks'].items()}
  _, partial = check_sharded_read('encdec', args['encdec'], chunks,
                                  encdec_sharding)
  assert partial > 50, partial

  # 2. bfloat16 checkpoint upcast while sharding: the callable sees float32;
  # 1-D scales stay numpy (None).
  seen_dtypes = set()

  def upcast_sharding(path, shape, dtype):
    seen_dtypes.add(np.dtype(dtype))
    return named(None, 'model') if len(shape) == 2 else None

  sharded, _ = check_sharded_read('encdec_bf16', args['encdec_bf16'], chunks,
                                  upcast_sharding, restore_dtype=np.float32)
  assert seen_dtypes == {np.dtype(np.float32)}, seen_dtypes
  assert all(v.dtype == np.float32 for v in sharded.values())

  # 3. tiny checkpoint, a sharding tree: chunks that straddle shard borders,
  # edge chunks, inline arrays (flax-chunked too), a zarr scalar.
  tiny_chunks = args['tiny_chunks']
  tree = {
      'edge': {'kernel': None},  # 5 x 7 divides no mesh axis: stays numpy
      'grid': {'kernel': named('data', 'model'),
               'embedding': named('model', 'data')},
      'gfile_int': {'table': named()},
      'gcs_bf16': {'scale': named('data')},
      'legacy': {'kernel': named('model', None), 'bias': named()},
      'scalar_zarr': {'value': named()},
      'inline': {'kernel': named('model', None), 'scalar': named()},
      'big_inline': {'embedding': named('model', None)},
  }
  _, partial = check_sharded_read('tiny', args['tiny'], tiny_chunks, tree)
  assert partial >= 8, partial

  # 4. One Sharding for every parameter (replicated): one read per chunk.
  check_sharded_read('tiny replicated', args['tiny'], tiny_chunks, named())
  n_chunks = sum(math.prod(math.ceil(n / c) for n, c in zip(shape, ch))
                 for shape, ch in [((5, 7), (2, 3)), ((8, 12), (3, 5)),
                                   ((8, 12), (8, 4)), ((3, 5), (2, 2)),
                                   ((4,), (3,)), ((2, 3), (2, 3)),
                                   ((3,), (3,)), ((), ())])
  assert len(CHUNK_READS) == n_chunks, (len(CHUNK_READS), n_chunks)

  # 5. A sharding that does not divide the array names the parameter.
  try:
    t5x_checkpoint.read_t5x_checkpoint(
        args['tiny'], shardings=lambda path, shape, dtype: (
            named('data') if path[0] == 'edge' else None))
  except ValueError as e:
    assert 'target/edge/kernel' in str(e), e
  else:
    raise AssertionError('an indivisible sharding was accepted')
  print('ALL CHECKS PASSED')


if __name__ == '__main__':
  main()
