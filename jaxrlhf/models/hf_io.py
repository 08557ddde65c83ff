"""Hugging Face checkpoints (config.json + safetensors) in and out.

  config, params = load_hf_checkpoint("/path/to/hf_model")
  logits = registry.module_for_config(config).apply({"params": params}, ...)
  export_hf_checkpoint(config, params, "/path/to/out")   # transformers loads it

This module is the part every family shares: reading and writing
safetensors (single files and sharded indexes), finding the family of a
config.json (`family_for_hf_config`), checking every tensor against the
names and shapes the config implies (one error naming every missing,
unexpected or mis-shaped tensor), and writing config.json and
generation_config.json. What differs between families, the tensor names and
the config translation, is each family's `HFMapping` (`Family.hf`, in its
own module: `llama.py`, `gpt_neox.py`, `t5.py`, ...). Both config.json
conventions are read, transformers 4.x's and 5.x's; exports use the 4.x
keys, which 5.x also reads. Only numpy and `safetensors.numpy` are used: no
torch.
"""

import dataclasses
import json
import pathlib
import re
from typing import Any, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from safetensors import numpy as safetensors_np

from jaxrlhf.models import family as family_lib
from jaxrlhf.models import registry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

HFCheckpointError = family_lib.HFCheckpointError

# ----------------------------------------------------------------------------
# Files.

def read_safetensors(path) -> Dict[str, np.ndarray]:
  """All tensors of `path/model.safetensors`, or of the shards listed in
  `path/model.safetensors.index.json`, as numpy arrays in their stored dtype."""
  path = pathlib.Path(path)
  if (path / SINGLE_FILE).is_file():
    return dict(safetensors_np.load_file(path / SINGLE_FILE))
  if (path / INDEX_FILE).is_file():
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
      if not (path / shard).is_file():
        raise HFCheckpointError(
            f"{path / INDEX_FILE} lists shard {shard!r}, which is not in "
            f"{path}: copy every shard of the checkpoint.")
      shard_tensors = safetensors_np.load_file(path / shard)
      for name, shard_of_name in weight_map.items():
        if shard_of_name == shard:
          if name not in shard_tensors:
            raise HFCheckpointError(
                f"{path / INDEX_FILE} puts {name!r} in {shard}, which lacks it.")
          tensors[name] = shard_tensors[name]
    return tensors
  hint = ""
  if any(path.glob("*.bin")):
    hint = (" Only safetensors are read: re-save the model with "
            "`save_pretrained(dir, safe_serialization=True)`.")
  raise HFCheckpointError(
      f"No {SINGLE_FILE} or {INDEX_FILE} in {path}.{hint}")


def read_hf_config(path) -> Dict[str, Any]:
  config_path = pathlib.Path(path) / CONFIG_FILE
  if not config_path.is_file():
    raise HFCheckpointError(f"No {CONFIG_FILE} in {path}: a Hugging Face "
                            "checkpoint directory holds config.json and the "
                            "safetensors files.")
  return json.loads(config_path.read_text())


def _mappings():
  return [f for f in registry.FAMILIES.values() if f.hf is not None]


def family_for_hf_config(hf_config) -> family_lib.Family:
  """The registered family of a parsed config.json (by `architectures`, or
  `model_type` when that is absent)."""
  archs = hf_config.get("architectures") or []
  for candidate in _mappings():
    if candidate.hf.architecture in archs or (
        not archs and hf_config.get("model_type") == candidate.hf.model_type):
      return candidate
  raise HFCheckpointError(
      f"Unsupported architecture {archs or hf_config.get('model_type')!r} "
      "in config.json; supported: "
      f"{[f.hf.architecture for f in _mappings()]}.")


def _hf_family(config) -> family_lib.Family:
  chosen = registry.family_of(config)
  if chosen.hf is None:
    raise HFCheckpointError(
        f"transformers has no model for the {chosen.name} family; keep it as "
        "a T5X or orbax checkpoint.")
  return chosen


def config_from_hf(hf_config: Dict[str, Any], **overrides):
  """Our model config from a parsed HF config.json, with fields overridden
  (e.g. dtype='bfloat16', scan_layers=True)."""
  config = family_for_hf_config(hf_config).hf.config_from_hf(hf_config)
  return family_lib.replace_fields(config, overrides)


def config_to_hf(config, dtype: str = "float32") -> Dict[str, Any]:
  """The HF config.json dict for our model config (transformers 4.x keys,
  which 5.x also reads)."""
  hf = _hf_family(config).hf.config_to_hf(config)
  hf["torch_dtype"] = dtype
  return hf


def generation_config(hf_config: Dict[str, Any]) -> Dict[str, Any]:
  """generation_config.json of an export: the token ids `generate` stops
  and pads with (transformers reads them from this file first)."""
  out = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id",
                                   "pad_token_id", "decoder_start_token_id")
         if hf_config.get(k) is not None}
  return out


# ----------------------------------------------------------------------------
# Checks.

def _check_tensors(mapping, shapes, tensors, where):
  """Every name in `shapes` present with that shape, nothing else but the
  known ignorable buffers; one error listing every problem."""
  ignored = [re.compile(p) for p in mapping.ignored]
  missing = sorted(n for n in shapes if n not in tensors)
  mismatched = sorted(
      f"{n}: expected {tuple(shapes[n])}, found {tuple(tensors[n].shape)}"
      for n in shapes if n in tensors
      and tuple(tensors[n].shape) != tuple(shapes[n]))
  unexpected = sorted(n for n in tensors if n not in shapes
                      and not any(p.fullmatch(n) for p in ignored))
  problems = []
  if missing:
    problems.append(f"missing weights ({len(missing)}): " + ", ".join(missing))
  if mismatched:
    problems.append("shape mismatch: " + "; ".join(mismatched))
  if unexpected:
    problems.append(
        f"unexpected weights ({len(unexpected)}), which this "
        f"{mapping.architecture} mapping does not use (a variant of the "
        "architecture we do not model?): " + ", ".join(unexpected))
  if problems:
    raise HFCheckpointError(f"{where} does not match its config.json: "
                            + " | ".join(problems))


def expected_param_shapes(config) -> Dict[str, Tuple[int, ...]]:
  """{'a/b/c': shape} of the model's parameters (no compute: eval_shape)."""
  return registry.param_shapes(config)


def check_params(config, params, where="params"):
  """Raises HFCheckpointError naming every missing, unexpected or mis-shaped
  parameter of `params` for the model `config` describes."""
  expected = expected_param_shapes(config)
  found = {k: tuple(np.shape(v))
           for k, v in family_lib.flat_paths(params).items()}
  missing = sorted(set(expected) - set(found))
  unexpected = sorted(set(found) - set(expected))
  mismatched = sorted(f"{k}: expected {expected[k]}, found {found[k]}"
                      for k in set(expected) & set(found)
                      if expected[k] != found[k])
  problems = []
  if missing:
    problems.append(f"missing parameters: {', '.join(missing)}")
  if unexpected:
    problems.append(f"unexpected parameters: {', '.join(unexpected)}")
  if mismatched:
    problems.append("shape mismatch: " + "; ".join(mismatched))
  if problems:
    raise HFCheckpointError(
        f"{where} do not fit {type(config).__name__}: " + " | ".join(problems))


# ----------------------------------------------------------------------------
# Import.

def from_hf_tensors(config, tensors: Dict[str, np.ndarray],
                    where: str = "checkpoint"):
  """(config, params) from HF-named tensors (as `read_safetensors` gives).

  params are float32 numpy arrays (unboxed), layers stacked when
  `config.scan_layers`. The returned config equals the given one except where
  the file decides the output layer (the family's `reconcile`: e.g. a
  separate output matrix that differs from the embedding unties it, as
  transformers does).
  """
  mapping = _hf_family(config).hf
  if mapping.reconcile is not None:
    config, tensors = mapping.reconcile(config, tensors)
  shapes = mapping.tensor_shapes(config, tensors)
  _check_tensors(mapping, shapes, tensors, where)
  as_f32 = {n: np.asarray(v, dtype=np.float32) for n, v in tensors.items()
            if n in shapes}
  params = registry.relayout_params(mapping.from_hf(config, as_f32), config)
  check_params(config, params, where=f"parameters mapped from {where}")
  return config, params


def load_hf_checkpoint(path, **config_overrides):
  """Reads a Hugging Face checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or sharded
      model-*.safetensors with model.safetensors.index.json).
    **config_overrides: fields of our config to set, e.g. dtype='bfloat16',
      scan_layers=True, remat_policy='full', attention_impl='dot_product'.
  Returns:
    (config, params): the family's config (LlamaConfig, Qwen2Config,
    GemmaConfig, GPTNeoXConfig, t5.T5Config, ...), and the
    parameter dict (float32 numpy arrays; `jax.device_put` them with the
    shardings you want) for
    `registry.module_for_config(config).apply({'params': ...})`.
  Raises:
    HFCheckpointError: unsupported architecture or options, missing or
      unexpected weights, shape mismatches; the message names each tensor.
  """
  path = pathlib.Path(path)
  config = config_from_hf(read_hf_config(path), **config_overrides)
  tensors = read_safetensors(path)
  return from_hf_tensors(config, tensors, where=str(path))


# ----------------------------------------------------------------------------
# Export.

def _to_numpy_tree(params):
  params = nn.meta.unbox(params)
  if isinstance(params, flax.core.FrozenDict):
    params = flax.core.unfreeze(params)
  if set(params) == {"params"}:
    params = params["params"]
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                  "float16": np.float16}


def to_hf_tensors(config, params) -> Dict[str, np.ndarray]:
  """HF-named float32 tensors for our (boxed or unboxed) parameters."""
  mapping = _hf_family(config).hf
  params = _to_numpy_tree(params)
  check_params(config, params)
  unrolled = dataclasses.replace(config, scan_layers=False) if getattr(
      config, "scan_layers", False) else config
  params = registry.relayout_params(params, unrolled)
  tensors = mapping.to_hf(config, params)
  return {n: np.ascontiguousarray(v) for n, v in tensors.items()}


def export_hf_checkpoint(config, params, path, *, dtype: str = "float32",
                         max_shard_bytes: Optional[int] = None,
                         overwrite: bool = False):
  """Writes config.json and safetensors that `transformers` loads.

  Args:
    config: our model config (of a family with a Hugging Face mapping).
    params: the model's parameters (boxed or not, numpy or jax arrays,
      scanned or unrolled as the config says).
    path: output directory (created).
    dtype: stored dtype: 'float32', 'bfloat16' or 'float16'.
    max_shard_bytes: if set and the tensors are larger, write
      model-0000i-of-0000n.safetensors shards and model.safetensors.index.json.
    overwrite: replace safetensors files already in `path` (else an error).
  """
  if dtype not in _EXPORT_DTYPES:
    raise ValueError(f"export dtype={dtype!r}; choose one of "
                     f"{sorted(_EXPORT_DTYPES)}.")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  existing = sorted(path.glob("model*.safetensors*"))
  if existing:
    if not overwrite:
      raise FileExistsError(
          f"{path} already holds {[p.name for p in existing]}; pass "
          "overwrite=True or choose an empty directory.")
    for p in existing:
      p.unlink()
  tensors = {n: v.astype(_EXPORT_DTYPES[dtype])
             for n, v in to_hf_tensors(config, params).items()}
  hf_config = config_to_hf(config, dtype=dtype)
  (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2,
                                             sort_keys=True) + "\n")
  (path / GENERATION_CONFIG_FILE).write_text(json.dumps(
      generation_config(hf_config), indent=2, sort_keys=True) + "\n")
  metadata = {"format": "pt"}  # transformers refuses archives without it
  total = sum(v.nbytes for v in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    safetensors_np.save_file(tensors, path / SINGLE_FILE, metadata=metadata)
    return path
  shards, current, current_bytes = [], {}, 0
  for name in sorted(tensors):
    size = tensors[name].nbytes
    if current and current_bytes + size > max_shard_bytes:
      shards.append(current)
      current, current_bytes = {}, 0
    current[name] = tensors[name]
    current_bytes += size
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors_np.save_file(shard, path / filename, metadata=metadata)
    weight_map.update({name: filename for name in shard})
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True)
                                 + "\n")
  return path
