"""Reads T5X checkpoints directly from their on-disk format, without t5x.

A T5X checkpoint directory `checkpoint_<step>/` holds

- a file `checkpoint`: a msgpack document in flax's serialization format,
  `{'version': 3, 'optimizer': {'target': <params>, 'state': {'step': ...,
  'param_states': <optimizer state>}}}`. Each leaf is either an inline array
  (msgpack extension type 1, or type 3 for a numpy scalar) or a tensorstore
  spec dict pointing at a zarr array;
- one zarr v2 directory per tensorstore leaf, named after the tree path with
  "/" replaced by "." (e.g. `target.encoder.layers_0.attention.query.kernel`),
  holding a `.zarray` JSON file and compressed chunk files ("0.1", ...).

This module reads both with numpy, msgpack, zstandard/gzip and ml_dtypes only.
With `shardings`, every parameter is assembled per device shard with
`jax.make_array_from_callback`, and a shard reads only the zarr chunks that
overlap it: a host of a pod mesh never holds a whole large array.

Typical use:

  ckpt = read_t5x_checkpoint('/ckpts/t5_xl', restore_dtype=jnp.float32)
  ckpt['params']['encoder']['layers_0']['attention']['query']['kernel']
  ckpt['step']
"""

import bz2
import collections.abc
import concurrent.futures
import dataclasses
import gzip
import itertools
import json
import math
import os
import re
import zlib
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from absl import logging
import jax
import ml_dtypes
import msgpack
import numpy as np
import zstandard

CHECKPOINT_FILENAME = 'checkpoint'
# t5x writes version 3; version 2 differs only in storing bfloat16 as uint16.
# Versions 0 and 1 predate t5x's public releases and t5x itself rejects them.
_MIN_VERSION = 2
_CHECKPOINT_DIR_RE = re.compile(r'^checkpoint_(\d+)$')
# flax.serialization stores arrays above its msgpack size limit as a dict
# {'__msgpack_chunked_array__': True, 'shape': {'0': d0, ...},
#  'chunks': {'0': flat_part0, '1': flat_part1, ...}}.
_FLAX_CHUNKED_ARRAY_KEY = '__msgpack_chunked_array__'
# flax's msgpack extension type codes.
_EXT_NDARRAY = 1
_EXT_NATIVE_COMPLEX = 2
_EXT_NPSCALAR = 3
_SUPPORTED_COMPRESSORS = ('zstd', 'gzip', 'zlib', 'bz2')
_DEFAULT_MAX_WORKERS = 8

PathTuple = tuple[str, ...]
ShardingCallable = Callable[[PathTuple, tuple[int, ...], np.dtype],
                            Optional[jax.sharding.Sharding]]
Shardings = Union[jax.sharding.Sharding, ShardingCallable,
                  Mapping[str, Any], None]


# ---------------------------------------------------------------- locating


def find_t5x_checkpoint(path: Union[str, os.PathLike]) -> str:
  """Returns the `checkpoint_<step>` directory that `path` designates.

  Args:
    path: a `checkpoint_<step>` directory, the `checkpoint` msgpack file inside
      one, or a model directory holding several `checkpoint_<step>`
      directories (the largest step wins).

  Raises:
    FileNotFoundError: `path` does not exist or holds no T5X checkpoint.
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.exists(path):
    raise FileNotFoundError(f'T5X checkpoint path does not exist: {path}')
  if os.path.isfile(path):
    if os.path.basename(path) != CHECKPOINT_FILENAME:
      raise FileNotFoundError(
          f'{path} is a file but not a T5X `{CHECKPOINT_FILENAME}` msgpack '
          'file: pass a checkpoint_<step> directory or a model directory.')
    return os.path.dirname(path)
  if os.path.isfile(os.path.join(path, CHECKPOINT_FILENAME)):
    return path
  steps = {}
  for entry in os.listdir(path):
    match = _CHECKPOINT_DIR_RE.match(entry)
    if match and os.path.isfile(
        os.path.join(path, entry, CHECKPOINT_FILENAME)):
      steps[int(match.group(1))] = os.path.join(path, entry)
  if not steps:
    raise FileNotFoundError(
        f'No T5X checkpoint at {path}: expected the msgpack file '
        f'{os.path.join(path, CHECKPOINT_FILENAME)} (when {path} is a '
        'checkpoint_<step> directory) or subdirectories '
        f'checkpoint_<step>/{CHECKPOINT_FILENAME} (when it is a model '
        'directory). Was the checkpoint copied completely?')
  latest = max(steps)
  logging.info('T5X model directory %s holds steps %s; reading the latest, %s',
               path, sorted(steps), steps[latest])
  return steps[latest]


# ----------------------------------------------------------------- msgpack


def _dtype_from_name(name: str, where: str) -> np.dtype:
  """numpy dtype for a dtype name ('float32', 'bfloat16', '<f4', ...)."""
  if isinstance(name, bytes):
    name = name.decode('ascii')
  if isinstance(name, str) and hasattr(ml_dtypes, name.lstrip('<>|=')):
    # ml_dtypes types (bfloat16, float8_*, int4) have no byte-order prefix
    # in numpy and are stored little-endian by tensorstore.
    candidate = getattr(ml_dtypes, name.lstrip('<>|='))
    if isinstance(candidate, type):
      return np.dtype(candidate)
  try:
    dtype = np.dtype(name)
  except TypeError as e:
    raise ValueError(f'Unsupported dtype {name!r} for {where}.') from e
  if dtype.kind not in 'biufc':
    raise ValueError(
        f'Unsupported dtype {name!r} for {where}: only bool, integer, '
        'floating, complex and ml_dtypes (bfloat16, float8...) arrays can be '
        'read.')
  return dtype


class _InlineLeafError(ValueError):
  """An inline msgpack leaf that parses but that this reader cannot decode."""


def _ndarray_from_flax_bytes(payload: bytes) -> np.ndarray:
  """Decodes flax's ndarray extension: msgpack [shape, dtype name, bytes]."""
  shape, dtype_name, buffer = msgpack.unpackb(payload, raw=True)
  try:
    dtype = _dtype_from_name(dtype_name, 'an inline msgpack array')
  except ValueError as e:
    raise _InlineLeafError(str(e)) from e
  # A copy, so callers get an ordinary writable array.
  return np.frombuffer(buffer, dtype=dtype).reshape(shape).copy()


def _msgpack_ext_hook(code: int, payload: bytes) -> Any:
  if code == _EXT_NDARRAY:
    return _ndarray_from_flax_bytes(payload)
  if code == _EXT_NPSCALAR:
    # flax restores a numpy scalar here; a 0-d array keeps every leaf an array.
    return _ndarray_from_flax_bytes(payload).reshape(())
  if code == _EXT_NATIVE_COMPLEX:
    real, imag = msgpack.unpackb(payload)
    return complex(real, imag)
  raise _InlineLeafError(
      f'Unknown msgpack extension type {code}: flax writes only types 1 '
      '(ndarray), 2 (complex) and 3 (numpy scalar).')


def _restore_flax_chunked_arrays(tree: Any) -> Any:
  """Reassembles arrays that flax split into chunks (see flax.serialization)."""
  if not isinstance(tree, dict):
    return tree
  if _FLAX_CHUNKED_ARRAY_KEY in tree:
    shape = tuple(int(tree['shape'][str(i)]) for i in range(len(tree['shape'])))
    parts = [tree['chunks'][str(i)] for i in range(len(tree['chunks']))]
    return np.concatenate([np.asarray(p).reshape(-1) for p in parts]
                         ).reshape(shape)
  return {k: _restore_flax_chunked_arrays(v) for k, v in tree.items()}


def _load_checkpoint_file(checkpoint_dir: str) -> tuple[Any, Any]:
  """Parses `checkpoint_dir/checkpoint`; returns (target, state) trees."""
  file = os.path.join(checkpoint_dir, CHECKPOINT_FILENAME)
  expected = ("a msgpack map {'version': 3, 'optimizer': {'target': "
              "<parameters>, 'state': {'step': ..., 'param_states': ...}}} "
              'as written by t5x.checkpoints.Checkpointer')
  with open(file, 'rb') as f:
    raw = f.read()
  try:
    contents = msgpack.unpackb(raw, ext_hook=_msgpack_ext_hook, raw=False,
                               strict_map_key=False)
  except _InlineLeafError as e:
    raise ValueError(f'{file}: {e}') from e
  except (msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
          msgpack.exceptions.StackError, ValueError, UnicodeDecodeError) as e:
    raise ValueError(
        f'{file} is not a T5X checkpoint: it does not parse as msgpack '
        f'({type(e).__name__}: {e}); expected {expected}.') from e
  if not isinstance(contents, dict) or 'optimizer' not in contents:
    found = (sorted(map(str, contents)) if isinstance(contents, dict)
             else type(contents).__name__)
    raise ValueError(f'{file} is not a T5X checkpoint: found {found}; '
                     f'expected {expected}.')
  version = contents.get('version', 0)
  if not isinstance(version, int) or version < _MIN_VERSION:
    raise ValueError(
        f'{file} is a T5X checkpoint of version {version!r}; versions before '
        f'{_MIN_VERSION} are not supported (t5x itself rejects them).')
  optimizer = _restore_flax_chunked_arrays(contents['optimizer'])
  if (not isinstance(optimizer, dict) or
      not isinstance(optimizer.get('target'), dict) or
      not isinstance(optimizer.get('state'), dict) or
      'step' not in optimizer['state']):
    found = (sorted(map(str, optimizer)) if isinstance(optimizer, dict)
             else type(optimizer).__name__)
    raise ValueError(f"{file} is not a T5X checkpoint: 'optimizer' holds "
                     f'{found}; expected {expected}.')
  return optimizer['target'], optimizer['state']


def _is_tensorstore_spec(node: Any) -> bool:
  return (isinstance(node, dict) and 'driver' in node and
          ('kvstore' in node or 'path' in node))


def _iter_leaves(tree: Any, prefix: PathTuple = ()
                 ) -> Iterator[tuple[PathTuple, Any]]:
  """Yields (path, leaf) in key order; tensorstore specs count as leaves."""
  if isinstance(tree, dict) and not _is_tensorstore_spec(tree):
    for key in sorted(tree, key=str):
      yield from _iter_leaves(tree[key], prefix + (str(key),))
  else:
    yield prefix, tree


def _unflatten(flat: Mapping[PathTuple, Any], empty_dicts=()) -> dict:
  out = {}
  for path in empty_dicts:
    node = out
    for key in path:
      node = node.setdefault(key, {})
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def _empty_dict_paths(tree: Any, prefix: PathTuple = ()) -> list[PathTuple]:
  """Paths of empty subtrees, kept so the output mirrors the checkpoint."""
  if not isinstance(tree, dict) or _is_tensorstore_spec(tree):
    return []
  if not tree:
    return [prefix]
  return [p for k, v in tree.items()
          for p in _empty_dict_paths(v, prefix + (str(k),))]


# -------------------------------------------------------------------- zarr


@dataclasses.dataclass(frozen=True)
class ZarrArray:
  """A zarr v2 array of a T5X checkpoint, described by its `.zarray` file.

  Attributes:
    name: tree path in the checkpoint, e.g. 'target/encoder/.../kernel'.
    directory: absolute path of the zarr directory.
    shape: array shape.
    chunks: chunk shape (edge chunks are stored at this full size too).
    dtype: the stored dtype (may be big-endian; reads return native order).
    compressor: the numcodecs-style compressor dict, or None.
    order: 'C' or 'F', the element order inside a chunk.
    fill_value: value of chunks absent from disk; None means absent chunks
      are an error.
    dimension_separator: joins chunk indices into chunk file names.
  """
  name: str
  directory: str
  shape: tuple[int, ...]
  chunks: tuple[int, ...]
  dtype: np.dtype
  compressor: Optional[dict]
  order: str
  fill_value: Any
  dimension_separator: str

  @property
  def chunk_grid(self) -> tuple[int, ...]:
    """Number of chunks along each dimension."""
    return tuple(math.ceil(s / c) if c else 0
                 for s, c in zip(self.shape, self.chunks))

  def chunk_file(self, chunk_index: tuple[int, ...]) -> str:
    # Zarr names the single chunk of a 0-d array "0".
    key = (self.dimension_separator.join(map(str, chunk_index))
           if chunk_index else '0')
    return os.path.join(self.directory, key)


def _spec_relative_path(spec: dict, name: str) -> str:
  """The array path stored in a tensorstore spec, whatever its kvstore."""
  kvstore = spec.get('kvstore')
  if isinstance(kvstore, str):
    # URL form, e.g. "gs://bucket/dir/name/" or "file:///abs/name/".
    match = re.fullmatch(r'([a-z0-9+]+)://(.*)', kvstore, re.DOTALL)
    if not match:
      return kvstore
    scheme, rest = match.groups()
    return rest.split('/', 1)[1] if scheme == 'gs' and '/' in rest else rest
  if isinstance(kvstore, dict) and kvstore.get('path'):
    # Whatever the driver (file, gfile, gcs with t5x's placeholder bucket
    # "t5x-dummy-bucket"), t5x resolves this path against the checkpoint
    # directory.
    return kvstore['path']
  if spec.get('path'):
    # tensorstore < 0.1.14 put the path at the top level of the spec; t5x's
    # gcs writer still does.
    return spec['path']
  raise ValueError(
      f'The tensorstore spec of {name} names no path (looked at '
      f"spec['kvstore']['path'] and spec['path']): {spec}")


def _resolve_array_directory(spec: dict, checkpoint_dir: str,
                             name: str) -> str:
  relative = _spec_relative_path(spec, name).rstrip('/')
  candidates = [os.path.join(checkpoint_dir, relative)]
  # Paths written absolute or bucket-relative elsewhere: the zarr directory
  # still sits next to the msgpack file under its own name.
  basename_candidate = os.path.join(checkpoint_dir, os.path.basename(relative))
  if basename_candidate not in candidates:
    candidates.append(basename_candidate)
  for candidate in candidates:
    if os.path.isfile(os.path.join(candidate, '.zarray')):
      return candidate
  raise FileNotFoundError(
      f'Array {name} of T5X checkpoint {checkpoint_dir} is missing: no zarr '
      f'metadata file .zarray in {" or ".join(candidates)} (spec path '
      f'{relative!r}). Was the checkpoint copied completely?')


def _decode_fill_value(fill_value: Any, dtype: np.dtype) -> Any:
  if fill_value is None:
    return None
  # Zarr v2 writes non-finite floats as JSON strings.
  special = {'NaN': np.nan, 'Infinity': np.inf, '-Infinity': -np.inf}
  if isinstance(fill_value, str) and fill_value in special:
    fill_value = special[fill_value]
  return np.asarray(fill_value).astype(dtype)


def open_zarr_array(spec: dict, checkpoint_dir: str, name: str) -> ZarrArray:
  """Opens the zarr array a tensorstore spec of a T5X checkpoint points at.

  Args:
    spec: the spec dict stored in the msgpack file.
    checkpoint_dir: the `checkpoint_<step>` directory relative paths start at.
    name: the leaf's tree path, used in error messages.

  Raises:
    FileNotFoundError: the zarr directory or its `.zarray` is missing.
    ValueError: a driver, compressor, filter or dtype this reader cannot read,
      or metadata that contradicts the spec.
  """
  driver = spec.get('driver')
  if driver != 'zarr':
    raise ValueError(f'Array {name} uses tensorstore driver {driver!r}; only '
                     "'zarr' (what t5x writes) is supported.")
  directory = _resolve_array_directory(spec, checkpoint_dir, name)
  where = f'array {name} ({directory})'
  with open(os.path.join(directory, '.zarray')) as f:
    try:
      meta = json.load(f)
    except ValueError as e:
      raise ValueError(f'Unreadable .zarray JSON in {where}: {e}') from e
  if meta.get('zarr_format') != 2:
    raise ValueError(f'Unsupported zarr_format {meta.get("zarr_format")!r} '
                     f'in {where}: only zarr v2 is supported.')
  dtype = _dtype_from_name(meta['dtype'], where)
  if dtype == np.uint16 and spec.get('dtype') == 'uint16':
    raise ValueError(
        f'{where} is stored as uint16, the T5X version-2 encoding of '
        'bfloat16, which t5x itself no longer reads: re-save the checkpoint '
        'with a current t5x so that it stores bfloat16.')
  spec_dtype = spec.get('dtype')
  if spec_dtype is not None and _dtype_from_name(spec_dtype, where) != (
      dtype.newbyteorder('=')):
    raise ValueError(f'{where}: the spec says dtype {spec_dtype!r} but '
                     f'.zarray says {meta["dtype"]!r}.')
  compressor = meta.get('compressor')
  if compressor is not None and compressor.get('id') not in (
      _SUPPORTED_COMPRESSORS):
    raise ValueError(
        f'Unsupported zarr compressor {compressor.get("id")!r} ({compressor}) '
        f'in {where}; supported: {", ".join(_SUPPORTED_COMPRESSORS)} or '
        'none. Re-save the array with one of them, e.g. with tensorstore.')
  if meta.get('filters'):
    raise ValueError(f'Unsupported zarr filters {meta["filters"]} in {where}: '
                     't5x writes none.')
  order = meta.get('order', 'C')
  if order not in ('C', 'F'):
    raise ValueError(f'Unsupported zarr order {order!r} in {where}.')
  shape = tuple(int(s) for s in meta['shape'])
  chunks = tuple(int(c) for c in meta['chunks'])
  if len(chunks) != len(shape):
    raise ValueError(f'{where}: chunks {list(chunks)} and shape '
                     f'{list(shape)} differ in rank.')
  spec_shape = spec.get('metadata', {}).get('shape')
  if spec_shape is not None and tuple(spec_shape) != shape:
    raise ValueError(f'{where}: the msgpack spec says shape {list(spec_shape)}'
                     f' but .zarray says {list(shape)}.')
  return ZarrArray(
      name=name, directory=directory, shape=shape, chunks=chunks, dtype=dtype,
      compressor=compressor, order=order,
      fill_value=_decode_fill_value(meta.get('fill_value'), dtype),
      dimension_separator=meta.get('dimension_separator', '.'))


def _decompress(data: bytes, compressor: Optional[dict], nbytes: int) -> bytes:
  if compressor is None:
    return data
  codec = compressor['id']
  if codec == 'zstd':
    # max_output_size matters only for frames written without their content
    # size (t5x's frames carry it).
    return zstandard.ZstdDecompressor().decompress(
        data, max_output_size=nbytes)
  if codec == 'gzip':
    return gzip.decompress(data)
  if codec == 'zlib':
    return zlib.decompress(data)
  if codec == 'bz2':
    return bz2.decompress(data)
  raise AssertionError(f'compressor {codec} passed validation')


def _read_chunk(array: ZarrArray, chunk_index: tuple[int, ...]) -> np.ndarray:
  """Reads one whole chunk, shaped `array.chunks`, in native byte order.

  Edge chunks come back at full chunk size, as zarr stores them; the caller
  crops. Every disk read of array data goes through this function.
  """
  file = array.chunk_file(chunk_index)
  nbytes = math.prod(array.chunks) * array.dtype.itemsize
  try:
    with open(file, 'rb') as f:
      stored = f.read()
  except FileNotFoundError:
    if array.fill_value is None:
      raise FileNotFoundError(
          f'Chunk file {file} of array {array.name} is missing (chunk '
          f'{list(chunk_index)} of grid {list(array.chunk_grid)}; the array '
          'declares no fill_value, so every chunk must be on disk). Was the '
          'checkpoint copied completely?') from None
    return np.full(array.chunks, array.fill_value, dtype=array.dtype)
  try:
    raw = _decompress(stored, array.compressor, nbytes)
  except (zstandard.ZstdError, OSError, EOFError, zlib.error) as e:
    raise ValueError(f'Cannot decompress chunk file {file} of array '
                     f'{array.name} with {array.compressor}: {e}') from e
  if len(raw) != nbytes:
    raise ValueError(
        f'Chunk file {file} of array {array.name} holds {len(raw)} bytes '
        f'after decompression; expected {nbytes} (chunk shape '
        f'{list(array.chunks)}, dtype {array.dtype}).')
  chunk = np.frombuffer(raw, dtype=array.dtype).reshape(
      array.chunks, order=array.order)
  if not array.dtype.isnative:
    chunk = chunk.astype(array.dtype.newbyteorder('='))
  return chunk


def _normalize_index(index: Any, shape: tuple[int, ...]
                     ) -> tuple[tuple[int, int], ...]:
  """[(start, stop)] per dimension for a tuple of unit-step slices."""
  if index is None:
    index = ()
  if not isinstance(index, tuple):
    index = (index,)
  if len(index) > len(shape):
    raise IndexError(f'Index {index} has more entries than shape {shape}.')
  index = index + (slice(None),) * (len(shape) - len(index))
  bounds = []
  for entry, size in zip(index, shape):
    if not isinstance(entry, slice):
      raise TypeError(f'Only slices can index a zarr region; got {index}.')
    start, stop, step = entry.indices(size)
    if step != 1:
      raise ValueError(f'Only unit-step slices are supported; got {index}.')
    bounds.append((start, max(start, stop)))
  return tuple(bounds)


def overlapping_chunks(array: ZarrArray, index: Any
                       ) -> list[tuple[int, ...]]:
  """Chunk indices of `array` that intersect the region `index` selects."""
  bounds = _normalize_index(index, array.shape)
  if any(stop <= start for start, stop in bounds):
    return []
  ranges = [range(start // chunk, -(-stop // chunk))
            for (start, stop), chunk in zip(bounds, array.chunks)]
  return list(itertools.product(*ranges))


def read_zarr_region(
    array: ZarrArray, index: Any = None,
    executor: Optional[concurrent.futures.Executor] = None) -> np.ndarray:
  """Reads `array[index]`, touching only the chunks that overlap it.

  Args:
    array: an opened zarr array.
    index: a tuple of unit-step slices (as jax passes to
      `make_array_from_callback`); None reads the whole array.
    executor: optional thread pool to decompress chunks in parallel.

  Returns:
    A native-byte-order array shaped like the region.
  """
  bounds = _normalize_index(index, array.shape)
  out = np.empty([stop - start for start, stop in bounds],
                 dtype=array.dtype.newbyteorder('='))
  chunk_indices = overlapping_chunks(array, index)
  if len(chunk_indices) > 1 and executor is not None:
    chunks = executor.map(lambda c: _read_chunk(array, c), chunk_indices)
  else:
    chunks = (_read_chunk(array, c) for c in chunk_indices)
  for chunk_index, chunk in zip(chunk_indices, chunks):
    out_slices, chunk_slices = [], []
    for (start, stop), c, size in zip(bounds, chunk_index, array.chunks):
      low, high = max(start, c * size), min(stop, (c + 1) * size)
      out_slices.append(slice(low - start, high - start))
      chunk_slices.append(slice(low - c * size, high - c * size))
    out[tuple(out_slices)] = chunk[tuple(chunk_slices)]
  return out


# ---------------------------------------------------------------- leaves


def _as_dtype(dtype: Any) -> np.dtype:
  if isinstance(dtype, str):
    return _dtype_from_name(dtype, 'restore_dtype')
  return np.dtype(dtype)


def _is_floating(dtype: np.dtype) -> bool:
  try:
    ml_dtypes.finfo(dtype)
    return True
  except ValueError:
    return False


@dataclasses.dataclass
class _Leaf:
  """One checkpoint leaf: an in-memory value or a zarr array on disk."""
  name: str
  value: Any = None
  zarr: Optional[ZarrArray] = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.zarr.shape if self.zarr else np.shape(self.value)

  @property
  def dtype(self) -> np.dtype:
    if self.zarr:
      return self.zarr.dtype.newbyteorder('=')
    return np.asarray(self.value).dtype

  def read(self, index: Any = None, executor=None) -> np.ndarray:
    if self.zarr:
      return read_zarr_region(self.zarr, index, executor)
    value = np.asarray(self.value)
    if index is None:
      return value
    bounds = _normalize_index(index, value.shape)
    return value[tuple(slice(start, stop) for start, stop in bounds)]


def _make_leaf(name: str, node: Any, checkpoint_dir: str) -> _Leaf:
  if _is_tensorstore_spec(node):
    return _Leaf(name, zarr=open_zarr_array(node, checkpoint_dir, name))
  if node is None or isinstance(node, (str, bytes)):
    return _Leaf(name, value=node)
  return _Leaf(name, value=np.asarray(node))


def _sharding_lookup(shardings: Shardings, params_paths: list[PathTuple]
                     ) -> Callable[[PathTuple, tuple, np.dtype], Any]:
  """Turns the `shardings` argument into a function of (path, shape, dtype)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return lambda path, shape, dtype: shardings
  if isinstance(shardings, collections.abc.Mapping):
    flat = {}

    def flatten(node, prefix):
      if isinstance(node, collections.abc.Mapping):
        for key, value in node.items():
          flatten(value, prefix + (str(key),))
      else:
        flat[prefix] = node

    flatten(shardings, ())
    missing = sorted(set(params_paths) - set(flat))
    extra = sorted(set(flat) - set(params_paths))
    if missing or extra:
      raise ValueError(
          'The shardings tree does not match the checkpoint parameters: '
          f'{len(missing)} parameters have no entry '
          f'{["/".join(p) for p in missing[:5]]} and {len(extra)} entries '
          f'name no parameter {["/".join(p) for p in extra[:5]]}. '
          'Give one Sharding (or None to keep a numpy array) per parameter, '
          'nested like read_t5x_checkpoint(...)["params"].')
    for path, value in flat.items():
      if value is not None and not isinstance(value, jax.sharding.Sharding):
        raise TypeError(f'shardings entry {"/".join(path)} is a '
                        f'{type(value).__name__}, not a jax Sharding or None.')
    return lambda path, shape, dtype: flat[path]
  if callable(shardings):
    return shardings
  raise TypeError(
      'shardings must be a jax.sharding.Sharding, a nested dict of them '
      'matching the parameters, or a callable (path, shape, dtype) -> '
      f'Sharding; got {type(shardings).__name__}.')


def _to_sharded_array(leaf: _Leaf, sharding: jax.sharding.Sharding,
                      dtype: np.dtype, executor) -> jax.Array:
  """Builds a global jax.Array, reading each distinct shard once."""
  shard_cache = {}

  def read_shard(index):
    key = _normalize_index(index, leaf.shape)
    if key not in shard_cache:
      shard_cache[key] = leaf.read(index, executor).astype(dtype, copy=False)
    return shard_cache[key]

  try:
    return jax.make_array_from_callback(leaf.shape, sharding, read_shard,
                                        dtype=dtype)
  except (ValueError, TypeError) as e:
    raise ValueError(f'Cannot build parameter {leaf.name} '
                     f'(shape {list(leaf.shape)}) with sharding {sharding}: '
                     f'{e}') from e


def _read_leaf(leaf: _Leaf, dtype: Optional[np.dtype], executor) -> Any:
  if leaf.value is None and leaf.zarr is None:
    return None
  if isinstance(leaf.value, (str, bytes)):
    return leaf.value
  value = leaf.read(None, executor)
  if dtype is not None:
    value = value.astype(dtype, copy=False)
  return value


def _load_leaves(path) -> tuple[str, dict, dict, Any]:
  checkpoint_dir = find_t5x_checkpoint(path)
  target, state = _load_checkpoint_file(checkpoint_dir)
  params = {p: _make_leaf('target/' + '/'.join(p), node, checkpoint_dir)
            for p, node in _iter_leaves(target)}
  return checkpoint_dir, params, state, target


def _state_leaves(state: dict, checkpoint_dir: str) -> dict:
  return {p: _make_leaf('state/param_states/' + '/'.join(p), node,
                        checkpoint_dir)
          for p, node in _iter_leaves(state.get('param_states', {}))}


def _read_step(state: dict, checkpoint_dir: str) -> int:
  step = _make_leaf('state/step', state['step'], checkpoint_dir)
  value = _read_leaf(step, None, None)
  if np.size(value) != 1:
    raise ValueError(f'state/step of {checkpoint_dir} has shape '
                     f'{np.shape(value)}; expected a scalar.')
  return int(np.asarray(value).reshape(()))


# ------------------------------------------------------------------ public


def t5x_param_shapes(path: Union[str, os.PathLike], *,
                     with_optimizer_state: bool = False) -> dict:
  """Names, shapes and dtypes of a T5X checkpoint, without reading arrays.

  Only the msgpack file and the small `.zarray` files are read.

  Args:
    path: as for `read_t5x_checkpoint`.
    with_optimizer_state: also describe the optimizer state.

  Returns:
    {'params': nested dict of jax.ShapeDtypeStruct (stored dtypes), 'step':
    int} and, when asked, 'optimizer_state' likewise.
  """
  checkpoint_dir, params, state, target = _load_leaves(path)

  def describe(leaf):
    if leaf.zarr is None and not isinstance(leaf.value, np.ndarray):
      return leaf.value  # None (a parameter no optimizer updates)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)

  out = {
      'params': _unflatten({p: describe(l) for p, l in params.items()},
                           _empty_dict_paths(target)),
      'step': _read_step(state, checkpoint_dir),
  }
  if with_optimizer_state:
    out['optimizer_state'] = _unflatten(
        {p: describe(l)
         for p, l in _state_leaves(state, checkpoint_dir).items()},
        _empty_dict_paths(state.get('param_states', {})))
  return out


def read_t5x_checkpoint(
    path: Union[str, os.PathLike], *,
    with_optimizer_state: bool = False,
    restore_dtype: Any = None,
    shardings: Shardings = None,
    max_workers: Optional[int] = None) -> dict:
  """Reads a T5X checkpoint (parameters, step, optionally optimizer state).

  Args:
    path: a `checkpoint_<step>` directory, its `checkpoint` file, or a model
      directory with several `checkpoint_<step>` (the largest step is read
      and logged).
    with_optimizer_state: also return the optimizer's `param_states` tree
      (for t5x's Adafactor: `v_row`, `v_col`, `v`, `m` per parameter).
    restore_dtype: cast floating parameters to this dtype (e.g. bfloat16
      checkpoints to float32). Optimizer state keeps its stored dtypes.
    shardings: None for host numpy arrays; otherwise parameters become
      global `jax.Array`s built with `jax.make_array_from_callback`, each
      device shard read from only the zarr chunks it overlaps. One of:
      - a `jax.sharding.Sharding` used for every parameter;
      - a nested dict of Shardings (or None for a numpy leaf) with exactly
        the keys of the returned 'params';
      - a callable `(path_tuple, shape, dtype) -> Sharding or None`, where
        path_tuple is e.g. ('encoder', 'layers_0', 'mlp', 'wi_0', 'kernel')
        and dtype is the dtype after `restore_dtype`.
      Optimizer state is always returned as numpy arrays.
    max_workers: threads decompressing the chunks of one array (default
      min(8, cpu count)).

  Returns:
    {'params': nested dict with t5x names, 'step': int} and, when asked,
    'optimizer_state': the nested param_states tree.

  Raises:
    FileNotFoundError: no checkpoint at `path`, or a zarr directory or chunk
      file is missing (the message names it).
    ValueError: the file is not a T5X checkpoint, or an array uses a dtype or
      compressor this reader does not support (the message names the array).
  """
  checkpoint_dir, params, state, target = _load_leaves(path)
  logging.info('Reading T5X checkpoint %s', checkpoint_dir)
  step = _read_step(state, checkpoint_dir)
  cast_to = None if restore_dtype is None else _as_dtype(restore_dtype)
  sharding_for = (None if shardings is None
                  else _sharding_lookup(shardings, list(params)))
  workers = max_workers or min(_DEFAULT_MAX_WORKERS, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers) as executor:
    out_params = {}
    for param_path, leaf in params.items():
      is_array = leaf.zarr is not None or isinstance(leaf.value, np.ndarray)
      if not is_array:
        out_params[param_path] = _read_leaf(leaf, None, executor)
        continue
      cast = (cast_to is not None and _is_floating(leaf.dtype) and
              cast_to != leaf.dtype)
      dtype = cast_to if cast else leaf.dtype
      sharding = (None if sharding_for is None
                  else sharding_for(param_path, leaf.shape, dtype))
      if sharding is None:
        out_params[param_path] = _read_leaf(leaf, dtype, executor)
      else:
        out_params[param_path] = _to_sharded_array(leaf, sharding, dtype,
                                                   executor)
    out = {'params': _unflatten(out_params, _empty_dict_paths(target)),
           'step': step}
    if with_optimizer_state:
      out['optimizer_state'] = _unflatten(
          {p: _read_leaf(leaf, None, executor)
           for p, leaf in _state_leaves(state, checkpoint_dir).items()},
          _empty_dict_paths(state.get('param_states', {})))
  return out
