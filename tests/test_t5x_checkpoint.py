"""Tests of the T5X checkpoint reader.

Truths used:
- the fixtures written by t5x itself and their config.json tables;
- flax.serialization + tensorstore (what t5x reads with) on the same files;
- tiny checkpoints this file writes itself, from known numpy arrays, with
  msgpack/flax.serialization + zstandard/gzip (cross-checked with tensorstore);
- a subprocess with 8 host devices for the sharded read
  (tests/t5x_checkpoint_sharded_check.py).
"""

import functools
import gzip
import itertools
import json
import logging
import math
import os
import pathlib
import subprocess
import sys

import flax.serialization
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
import zstandard

from jaxrlhf.models import t5x_checkpoint as t5x_ckpt

FIXTURES = pathlib.Path(__file__).resolve().parent / 'fixtures'
FIXTURE_NAMES = ('encdec', 'encdec_bf16', 'encdec_gzip', 'decoder_only')
# From the fixtures' README: leaves of `state` (param_states plus the step),
# tensorstore arrays and inline msgpack leaves.
README_STATE_LEAVES = {'encdec': 209, 'decoder_only': 85}
README_STORAGE = {'encdec': (66, 195), 'decoder_only': (27, 79)}


def _config(name):
  model = 'decoder_only' if name == 'decoder_only' else 'encdec'
  with open(FIXTURES / 't5x' / model / 'config.json') as f:
    return json.load(f)


def _leaf_table(name):
  model = 'decoder_only' if name == 'decoder_only' else 'encdec'
  return _config(name)[f'checkpoint_leaves_{model}_checkpoint_3']


def _checkpoint_dir(name):
  return FIXTURES / 't5x' / name / 'checkpoint_3'


def _flatten(tree, prefix=''):
  """{'a/b/c': leaf}; a dict with 'driver' and 'kvstore' is a leaf."""
  if isinstance(tree, dict) and not {'driver', 'kvstore'} <= set(tree):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, f'{prefix}{key}/'))
    return out
  return {prefix[:-1]: tree}


@functools.lru_cache(maxsize=None)
def _read(name, **kwargs):
  return t5x_ckpt.read_t5x_checkpoint(
      _checkpoint_dir(name), with_optimizer_state=True, **kwargs)


def _assert_bit_equal(actual, expected, what):
  assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert actual.tobytes() == expected.tobytes(), what


# ------------------------------------------------------------- fixtures


@pytest.mark.parametrize('name', FIXTURE_NAMES)
def test_params_names_shapes_dtypes_and_step_match_config(name):
  out = _read(name)
  expected = _config(name)['params']
  params = _flatten(out['params'])
  assert sorted(params) == sorted(expected)
  want_dtype = ml_dtypes.bfloat16 if name == 'encdec_bf16' else np.float32
  for key, info in expected.items():
    assert params[key].shape == tuple(info['shape']), key
    assert params[key].dtype == want_dtype, key
    assert isinstance(params[key], np.ndarray)
  assert out['step'] == 3
  assert isinstance(out['step'], int)


@pytest.mark.parametrize('name', FIXTURE_NAMES)
def test_param_shapes_helper_matches_config(name):
  shapes = t5x_ckpt.t5x_param_shapes(_checkpoint_dir(name),
                                     with_optimizer_state=True)
  expected = _config(name)['params']
  flat = _flatten(shapes['params'])
  assert {k: tuple(v.shape) for k, v in flat.items()} == {
      k: tuple(v['shape']) for k, v in expected.items()}
  assert shapes['step'] == 3
  table = _leaf_table(name)
  for key, info in _flatten(shapes['optimizer_state']).items():
    assert tuple(info.shape) == tuple(table[f'state/param_states/{key}']
                                      ['shape']), key


def test_gzip_copy_is_bit_identical_to_zstd():
  zstd_read, gzip_read = _read('encdec'), _read('encdec_gzip')
  for part in ('params', 'optimizer_state'):
    zstd_flat, gzip_flat = (_flatten(zstd_read[part]),
                            _flatten(gzip_read[part]))
    assert sorted(zstd_flat) == sorted(gzip_flat)
    for key in zstd_flat:
      _assert_bit_equal(gzip_flat[key], zstd_flat[key], key)


def test_bf16_params_are_f32_params_rounded_and_state_unchanged():
  f32, bf16 = _read('encdec'), _read('encdec_bf16')
  f32_params, bf16_params = _flatten(f32['params']), _flatten(bf16['params'])
  max_diff = 0.0
  for key, value in f32_params.items():
    _assert_bit_equal(bf16_params[key], value.astype(ml_dtypes.bfloat16), key)
    max_diff = max(max_diff, float(np.max(np.abs(
        bf16_params[key].astype(np.float32) - value))))
  # The README's observed rounding error, as a sanity bound on the truth.
  assert 0 < max_diff <= 0.0079
  f32_state, bf16_state = (_flatten(f32['optimizer_state']),
                           _flatten(bf16['optimizer_state']))
  for key, value in f32_state.items():
    _assert_bit_equal(bf16_state[key], value, key)


def test_restore_dtype_casts_params_only():
  bf16 = _read('encdec_bf16')
  upcast = _read('encdec_bf16', restore_dtype=np.float32)
  for key, value in _flatten(bf16['params']).items():
    _assert_bit_equal(_flatten(upcast['params'])[key],
                      value.astype(np.float32), key)
  state_dtypes = {v.dtype for v in _flatten(upcast['optimizer_state']).values()}
  assert state_dtypes == {np.dtype(np.float32)}
  downcast = t5x_ckpt.read_t5x_checkpoint(_checkpoint_dir('encdec'),
                                          restore_dtype='bfloat16')
  for key, value in _flatten(downcast['params']).items():
    _assert_bit_equal(value, _flatten(bf16['params'])[key], key)


@pytest.mark.parametrize('name', FIXTURE_NAMES)
def test_optimizer_state_matches_leaf_table(name):
  out = _read(name)
  table = _leaf_table(name)
  model = 'decoder_only' if name == 'decoder_only' else 'encdec'
  state = {f'state/param_states/{k}': v
           for k, v in _flatten(out['optimizer_state']).items()}
  # The README counts the step among the state leaves.
  assert len(state) + 1 == README_STATE_LEAVES[model]
  assert set(state) | {'state/step'} == {
      k for k in table if k.startswith('state/')}
  for key, value in state.items():
    info = table[key]
    assert value.shape == tuple(info['shape']), key
    stored_dtype = info.get('dtype') or np.dtype(info['zarr_dtype']).name
    assert value.dtype == np.dtype(stored_dtype), key
  n_zarr = sum(1 for v in table.values() if v['stored'].startswith('zarr/'))
  assert (n_zarr, len(table) - n_zarr) == README_STORAGE[model]


@pytest.mark.parametrize('name', ('encdec', 'decoder_only'))
def test_factored_second_moments_are_consistent(name):
  """Adafactor factors v of 2-D params whose dims are >= 32 (the config).

  v_row and v_col are decayed means of the same grad^2 over columns and over
  rows, so their means agree; unfactored params keep a full-shape v.
  """
  out = _read(name)
  min_dim = _config(name)['optimizer']['min_dim_size_to_factor']
  params = _flatten(out['params'])
  state = _flatten(out['optimizer_state'])
  n_factored = 0
  for key, param in params.items():
    v_row, v_col = state[f'{key}/v_row'], state[f'{key}/v_col']
    v, m = state[f'{key}/v'], state[f'{key}/m']
    assert m.shape == (1,)  # no momentum: a placeholder
    if param.ndim == 2 and min(param.shape) >= min_dim:
      n_factored += 1
      assert sorted(v_row.shape + v_col.shape) == sorted(param.shape), key
      assert v.shape == (1,)
      assert np.all(v_row > 0) and np.all(v_col > 0), key
      np.testing.assert_allclose(v_row.mean(), v_col.mean(), rtol=1e-5,
                                 err_msg=key)
    else:
      assert v.shape == param.shape, key
      assert v_row.shape == v_col.shape == (1,), key
      assert np.all(v > 0), key
  assert n_factored == sum(1 for p in params.values() if p.ndim == 2 and
                           min(p.shape) >= min_dim) > 10


def _independent_read(checkpoint_dir):
  """flax msgpack + tensorstore, the way t5x reads: {'target/...': array}."""
  with open(checkpoint_dir / 'checkpoint', 'rb') as f:
    contents = flax.serialization.msgpack_restore(f.read())
  flat = _flatten(contents['optimizer'])
  out, n_tensorstore = {}, 0
  for key, leaf in flat.items():
    if isinstance(leaf, dict):
      spec = dict(leaf)
      spec['kvstore'] = {'driver': 'file', 'path': str(
          checkpoint_dir / leaf['kvstore']['path'])}
      out[key] = ts.open(spec, open=True).result().read().result()
      n_tensorstore += 1
    else:
      out[key] = np.asarray(leaf)
  return out, n_tensorstore


@pytest.mark.parametrize('name', FIXTURE_NAMES)
def test_matches_flax_msgpack_plus_tensorstore(name):
  truth, n_tensorstore = _independent_read(_checkpoint_dir(name))
  model = 'decoder_only' if name == 'decoder_only' else 'encdec'
  assert n_tensorstore == README_STORAGE[model][0]
  out = _read(name)
  ours = {f'target/{k}': v for k, v in _flatten(out['params']).items()}
  ours.update({f'state/param_states/{k}': v
               for k, v in _flatten(out['optimizer_state']).items()})
  assert sorted(list(ours) + ['state/step']) == sorted(truth)
  for key, value in ours.items():
    _assert_bit_equal(value, truth[key], key)
  assert out['step'] == int(truth['state/step'])


def test_model_directory_picks_largest_step(tmp_path, caplog):
  model_dir = tmp_path / 'model'
  model_dir.mkdir()
  for step in (1, 12, 2):
    _write_small_checkpoint(model_dir / f'checkpoint_{step}', step)
  # Not checkpoints: a temporary dir and one without its msgpack file.
  _write_small_checkpoint(model_dir / 'checkpoint_40.tmp-1700000000', 40)
  (model_dir / 'checkpoint_30').mkdir()
  (model_dir / 'checkpoint_3').symlink_to(_checkpoint_dir('encdec'))
  with caplog.at_level(logging.INFO):
    out = t5x_ckpt.read_t5x_checkpoint(model_dir)
  assert out['step'] == 12
  np.testing.assert_array_equal(out['params']['w'], np.full((2,), 12.0))
  assert any('checkpoint_12' in r.getMessage() for r in caplog.records)
  # The msgpack file itself, and a symlinked checkpoint directory.
  assert t5x_ckpt.read_t5x_checkpoint(
      model_dir / 'checkpoint_2' / 'checkpoint')['step'] == 2
  linked = t5x_ckpt.read_t5x_checkpoint(model_dir / 'checkpoint_3')
  _assert_bit_equal(linked['params']['token_embedder']['embedding'],
                    _read('encdec')['params']['token_embedder']['embedding'],
                    'embedding')


# ------------------------------------------- tiny checkpoints written here


def _compress(data, compressor):
  if compressor is None:
    return data
  if compressor['id'] == 'zstd':
    return zstandard.ZstdCompressor(level=compressor['level']).compress(data)
  if compressor['id'] == 'gzip':
    return gzip.compress(data, compresslevel=compressor['level'])
  raise ValueError(compressor)


ZSTD = {'id': 'zstd', 'level': 1}
GZIP = {'id': 'gzip', 'level': 1}


def _write_zarr(directory, array, chunks, compressor, fill_value=None):
  """Zarr v2 as t5x/tensorstore write it: edge chunks padded to full size."""
  os.makedirs(directory)
  zarr_dtype = ('bfloat16' if array.dtype == ml_dtypes.bfloat16
                else array.dtype.str)
  with open(os.path.join(directory, '.zarray'), 'w') as f:
    json.dump({'chunks': list(chunks), 'compressor': compressor,
               'dimension_separator': '.', 'dtype': zarr_dtype,
               'fill_value': fill_value, 'filters': None, 'order': 'C',
               'shape': list(array.shape), 'zarr_format': 2}, f)
  grid = [range(math.ceil(n / c)) for n, c in zip(array.shape, chunks)]
  for cell in itertools.product(*grid):
    padded = np.zeros(chunks, array.dtype)
    source = tuple(slice(k * c, min((k + 1) * c, n))
                   for k, c, n in zip(cell, chunks, array.shape))
    padded[tuple(slice(0, s.stop - s.start) for s in source)] = array[source]
    key = '.'.join(map(str, cell)) if cell else '0'
    with open(os.path.join(directory, key), 'wb') as f:
      f.write(_compress(padded.tobytes(), compressor))


def _spec(directory_name, array, chunks, compressor, style='file'):
  spec = {'driver': 'zarr', 'dtype': array.dtype.name,
          'metadata': {'chunks': list(chunks), 'compressor': compressor,
                       'shape': list(array.shape)}}
  if style in ('file', 'gfile'):
    spec['kvstore'] = {'driver': style, 'path': directory_name + '/'}
  elif style == 'gcs':
    spec['kvstore'] = {'bucket': 't5x-dummy-bucket', 'driver': 'gcs',
                       'path': directory_name}
  elif style == 'legacy':
    # Path at the top level: tensorstore < 0.1.14, and t5x's own writer for
    # gs:// directories.
    spec['kvstore'] = {'bucket': 't5x-dummy-bucket', 'driver': 'gcs'}
    spec['path'] = directory_name
  elif style == 'legacy_no_kvstore':
    spec['path'] = directory_name
  return spec


def _write_small_checkpoint(directory, step):
  directory.mkdir(parents=True)
  contents = {'version': 3, 'optimizer': {
      'target': {'w': np.full((2,), float(step), np.float32)},
      'state': {'step': np.asarray(step, np.int32), 'param_states': {}}}}
  (directory / 'checkpoint').write_bytes(
      flax.serialization.msgpack_serialize(contents))


# name -> (array, chunks, compressor, spec style); None chunks = inline.
def _tiny_arrays():
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return {
      'target/edge/kernel': (normal(5, 7), (2, 3), ZSTD, 'file'),
      'target/grid/kernel': (normal(8, 12), (3, 5), ZSTD, 'file'),
      'target/grid/embedding': (normal(8, 12), (8, 4), GZIP, 'file'),
      'target/gfile_int/table': (
          rng.integers(-9, 9, (3, 5)).astype(np.int32), (2, 2), GZIP,
          'gfile'),
      'target/gcs_bf16/scale': (
          normal(4).astype(ml_dtypes.bfloat16), (3,), ZSTD, 'gcs'),
      'target/legacy/kernel': (normal(2, 3), (2, 3), None, 'legacy'),
      'target/legacy/bias': (normal(3), (3,), GZIP, 'legacy_no_kvstore'),
      'target/scalar_zarr/value': (
          np.asarray(-1.25, np.float32), (), GZIP, 'file'),
      'target/inline/kernel': (normal(2, 3), None, None, None),
      # 280 bytes: above the MAX_CHUNK_SIZE the writer patches in, so flax
      # stores it as a chunked array.
      'target/big_inline/embedding': (normal(10, 7), None, None, None),
      'state/param_states/edge/kernel/v_row': (normal(5), None, None, None),
      'state/param_states/edge/kernel/v_col': (normal(7), None, None, None),
      'state/param_states/edge/kernel/v': (
          np.zeros((1,), np.float32), None, None, None),
      'state/param_states/grid/kernel/v': (
          normal(8, 12), (4, 12), ZSTD, 'file'),
  }
TINY_INLINE_SCALAR = np.float32(2.5)  # flax writes numpy scalars as type 3
TINY_STEP = 7
TINY_FLAX_CHUNK_BYTES = 64


def _write_tiny_checkpoint(directory, monkeypatch):
  """Writes the tiny checkpoint with flax's own msgpack writer."""
  arrays = _tiny_arrays()
  directory.mkdir(parents=True)
  tree = {}
  for name, (array, chunks, compressor, style) in arrays.items():
    if chunks is None:
      leaf = array
    else:
      zarr_dir = name.replace('/', '.')
      _write_zarr(directory / zarr_dir, array, chunks, compressor)
      leaf = _spec(zarr_dir, array, chunks, compressor, style)
    node = tree
    *parents, last = name.split('/')
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = leaf
  tree['target']['inline']['scalar'] = TINY_INLINE_SCALAR
  tree['state']['step'] = np.asarray(TINY_STEP, np.int32)
  tree['state']['param_states']['untouched'] = {}
  monkeypatch.setattr(flax.serialization, 'MAX_CHUNK_SIZE',
                      TINY_FLAX_CHUNK_BYTES)
  raw = flax.serialization.msgpack_serialize(
      {'version': 3, 'optimizer': {'target': tree['target'],
                                   'state': tree['state']}})
  monkeypatch.undo()
  assert b'__msgpack_chunked_array__' in raw  # the chunked path is exercised
  (directory / 'checkpoint').write_bytes(raw)
  return arrays


@pytest.fixture
def tiny(tmp_path, monkeypatch):
  directory = tmp_path / 'checkpoint_7'
  arrays = _write_tiny_checkpoint(directory, monkeypatch)
  return directory, arrays


def test_tiny_writer_agrees_with_tensorstore(tiny):
  """The hand-written zarr arrays are what tensorstore reads back."""
  directory, arrays = tiny
  for name, (array, chunks, _, _) in arrays.items():
    if chunks is None:
      continue
    spec = {'driver': 'zarr', 'kvstore': {
        'driver': 'file', 'path': str(directory / name.replace('/', '.'))}}
    _assert_bit_equal(ts.open(spec).result().read().result(), array, name)


def test_tiny_checkpoint_edge_cases(tiny):
  directory, arrays = tiny
  out = t5x_ckpt.read_t5x_checkpoint(directory, with_optimizer_state=True)
  assert out['step'] == TINY_STEP
  ours = {f'target/{k}': v for k, v in _flatten(out['params']).items()}
  ours.update({f'state/param_states/{k}': v
               for k, v in _flatten(out['optimizer_state']).items()})
  for name, (array, *_) in arrays.items():
    _assert_bit_equal(ours.pop(name), array, name)
  scalar = ours.pop('target/inline/scalar')
  _assert_bit_equal(scalar, np.asarray(TINY_INLINE_SCALAR), 'type-3 scalar')
  assert not ours
  # An empty subtree (a parameter no optimizer touches) is kept.
  assert out['optimizer_state']['untouched'] == {}


def test_tiny_param_shapes(tiny):
  directory, arrays = tiny
  shapes = _flatten(t5x_ckpt.t5x_param_shapes(directory)['params'])
  for name, (array, *_) in arrays.items():
    if name.startswith('target/'):
      info = shapes[name[len('target/'):]]
      assert (tuple(info.shape), info.dtype) == (array.shape, array.dtype)


def test_handwritten_msgpack_extension_types(tmp_path):
  """Type 1 and type 3 leaves packed by hand, without flax."""
  def ext(code, array):
    return msgpack.ExtType(code, msgpack.packb(
        (list(array.shape), array.dtype.name, array.tobytes()),
        use_bin_type=True))
  weights = np.asarray([[1.5, -2.0]], ml_dtypes.bfloat16)
  contents = {'version': 3, 'optimizer': {
      'target': {'w': ext(1, weights), 'count': ext(3, np.asarray(
          -3, np.int64))},
      'state': {'step': ext(3, np.asarray(11, np.int32)),
                'param_states': {}}}}
  (tmp_path / 'checkpoint').write_bytes(msgpack.packb(contents,
                                                      use_bin_type=True))
  out = t5x_ckpt.read_t5x_checkpoint(tmp_path, restore_dtype=np.float32)
  _assert_bit_equal(out['params']['w'], np.asarray([[1.5, -2.0]], np.float32),
                    'w')
  # Integers are not cast by restore_dtype.
  _assert_bit_equal(out['params']['count'], np.asarray(-3, np.int64), 'count')
  assert out['step'] == 11


def test_fill_value_stands_in_for_absent_chunks(tmp_path):
  array = np.arange(12, dtype=np.float32).reshape(3, 4)
  _write_zarr(tmp_path / 'target.a', array, (2, 2), ZSTD, fill_value=-1.0)
  os.remove(tmp_path / 'target.a' / '1.1')
  contents = {'version': 3, 'optimizer': {
      'target': {'a': _spec('target.a', array, (2, 2), ZSTD)},
      'state': {'step': np.asarray(0, np.int32), 'param_states': {}}}}
  (tmp_path / 'checkpoint').write_bytes(
      flax.serialization.msgpack_serialize(contents))
  expected = array.copy()
  expected[2:, 2:] = -1.0
  _assert_bit_equal(t5x_ckpt.read_t5x_checkpoint(tmp_path)['params']['a'],
                    expected, 'a')


def test_step_stored_as_zarr_scalar(tmp_path):
  """Older t5x versions stored scalars such as the step in tensorstore."""
  step = np.asarray(123456, np.int32)
  _write_zarr(tmp_path / 'state.step', step, (), GZIP)
  contents = {'version': 3, 'optimizer': {
      'target': {'w': np.ones((2,), np.float32)},
      'state': {'step': _spec('state.step', step, (), GZIP),
                'param_states': {'w': {'v': None}}}}}
  (tmp_path / 'checkpoint').write_bytes(
      flax.serialization.msgpack_serialize(contents))
  out = t5x_ckpt.read_t5x_checkpoint(tmp_path, with_optimizer_state=True)
  assert out['step'] == 123456
  assert out['optimizer_state'] == {'w': {'v': None}}


# --------------------------------------------------------------- errors


def test_error_path_does_not_exist(tmp_path):
  with pytest.raises(FileNotFoundError, match='does not exist'):
    t5x_ckpt.read_t5x_checkpoint(tmp_path / 'nowhere')


def test_error_missing_checkpoint_file(tmp_path):
  (tmp_path / 'target.x').mkdir()
  with pytest.raises(FileNotFoundError) as info:
    t5x_ckpt.read_t5x_checkpoint(tmp_path)
  message = str(info.value)
  assert str(tmp_path / 'checkpoint') in message
  assert 'checkpoint_<step>' in message


@pytest.mark.parametrize('raw, found', [
    (msgpack.packb({'params': {'w': 1}}), "['params']"),
    (b'\xc1not msgpack', 'does not parse as msgpack'),
    (msgpack.packb({'version': 3, 'optimizer': {'params': {}}}),
     "'optimizer' holds ['params']"),
])
def test_error_not_a_t5x_checkpoint(tmp_path, raw, found):
  (tmp_path / 'checkpoint').write_bytes(raw)
  with pytest.raises(ValueError) as info:
    t5x_ckpt.read_t5x_checkpoint(tmp_path)
  message = str(info.value)
  assert str(tmp_path / 'checkpoint') in message
  assert 'is not a T5X checkpoint' in message
  assert found in message
  assert "'optimizer'" in message  # what was expected


def test_error_old_version(tmp_path):
  (tmp_path / 'checkpoint').write_bytes(msgpack.packb(
      {'version': 1, 'optimizer': {'target': {}, 'state': {'step': 0}}}))
  with pytest.raises(ValueError, match='version 1'):
    t5x_ckpt.read_t5x_checkpoint(tmp_path)


def test_error_missing_chunk_file_is_named(tiny):
  directory, _ = tiny
  missing = directory / 'target.grid.kernel' / '2.1'
  os.remove(missing)
  with pytest.raises(FileNotFoundError) as info:
    t5x_ckpt.read_t5x_checkpoint(directory)
  assert str(missing) in str(info.value)
  assert 'target/grid/kernel' in str(info.value)


def test_error_missing_array_directory_is_named(tiny):
  directory, _ = tiny
  os.remove(directory / 'target.edge.kernel' / '.zarray')
  with pytest.raises(FileNotFoundError) as info:
    t5x_ckpt.read_t5x_checkpoint(directory)
  assert 'target/edge/kernel' in str(info.value)
  assert str(directory / 'target.edge.kernel') in str(info.value)


def _edit_zarray(path, **changes):
  meta = json.loads(path.read_text())
  meta.update(changes)
  path.write_text(json.dumps(meta))


@pytest.mark.parametrize('changes, named', [
    ({'compressor': {'id': 'blosc', 'cname': 'lz4', 'clevel': 5}}, 'blosc'),
    ({'dtype': '<M8[ns]'}, '<M8[ns]'),
    ({'dtype': '|O'}, '|O'),
])
def test_error_unsupported_compressor_or_dtype_is_named(tiny, changes, named):
  directory, _ = tiny
  _edit_zarray(directory / 'target.grid.kernel' / '.zarray', **changes)
  with pytest.raises(ValueError) as info:
    t5x_ckpt.read_t5x_checkpoint(directory)
  assert named in str(info.value)
  assert 'target/grid/kernel' in str(info.value)


def test_error_corrupt_chunk_is_named(tiny):
  directory, _ = tiny
  chunk = directory / 'target.grid.kernel' / '0.0'
  chunk.write_bytes(zstandard.ZstdCompressor().compress(b'\0' * 12))
  with pytest.raises(ValueError) as info:
    t5x_ckpt.read_t5x_checkpoint(directory)
  assert str(chunk) in str(info.value)


def test_error_shardings_tree_mismatch(tiny):
  directory, _ = tiny
  with pytest.raises(ValueError) as info:
    t5x_ckpt.read_t5x_checkpoint(directory, shardings={
        'edge': {'kernel': None}, 'no_such': {'kernel': None}})
  message = str(info.value)
  assert '10 parameters have no entry' in message
  assert 'big_inline/embedding' in message
  assert '1 entries name no parameter' in message
  assert 'no_such/kernel' in message


# ---------------------------------------------------- sharded (subprocess)


def test_sharded_read_touches_only_overlapping_chunks(tiny):
  directory, arrays = tiny
  tiny_chunks = {name: list(chunks) for name, (_, chunks, *_)
                 in arrays.items() if chunks is not None}
  args = json.dumps({
      'encdec': str(_checkpoint_dir('encdec')),
      'encdec_bf16': str(_checkpoint_dir('encdec_bf16')),
      'encdec_chunks': {k: v['chunks'] for k, v in _leaf_table(
          'encdec').items() if 'chunks' in v},
      'tiny': str(directory),
      'tiny_chunks': tiny_chunks,
  })
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu')
  script = pathlib.Path(__file__).with_name('t5x_checkpoint_sharded_check.py')
  result = subprocess.run([sys.executable, str(script), args], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert 'ALL CHECKS PASSED' in result.stdout, result.stdout
