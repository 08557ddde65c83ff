"""Loading a language model's parameters from a checkpoint into a run.

`load_lm_params(path, target)` accepts
  - a T5X checkpoint (a `checkpoint_N` directory or a model directory with
    them): read with jaxrlhf.models.t5x_checkpoint straight into the target's
    shardings, each device reading only its chunks;
  - a Hugging Face folder (config.json + safetensors, e.g. Pythia for the
    TL;DR SFT run): read on the host, its token rows exchanged as the run's
    vocabulary exchanges ids (`token_swap`: Pythia's EOS 0 and padding 1,
    see `jaxrlhf.data.hf_tokenizer`), and each device given its slice;
  - a jaxrlhf workdir (or its `checkpoints/` directory, or one step of it):
    the policy ("params/policy") of its latest checkpoint.
`load_network_params(path, target, network)` reads another trained network
of a jaxrlhf workdir, e.g. "reward" of a reward-model run (online RL's
reward model and PPO's value network); `run_config(path)` is the resolved
config that run wrote. A LoRA run's workdir (`config.lora.rank` > 0) holds
adapters and names its base (`lora.BASE_RECORD`): its networks load as
merged weights, the base read from where the record says and checked
against the record's checksum.
The loaded tree must have the target's structure and shapes; a mismatch is
an error naming the parameter.
"""

import os
from typing import Any, Optional

import jax
import numpy as np

from jaxrlhf import checkpoint_files
from jaxrlhf.models import hf_io
from jaxrlhf.models import loading
from jaxrlhf.models import lora
from jaxrlhf.models import t5x_checkpoint
from jaxrlhf.models import token_rows


def _is_t5x(path: str) -> bool:
  if os.path.isfile(os.path.join(path, "checkpoint")):
    return True
  return os.path.isdir(path) and any(
      d.startswith("checkpoint_") for d in os.listdir(path))


def _state_item_dir(path: str) -> str:
  try:
    return str(checkpoint_files.state_item_dir(path))
  except checkpoint_files.NoCheckpointError:
    raise ValueError(
        f"{path!r} is neither a T5X checkpoint, a Hugging Face folder nor a "
        "jaxrlhf workdir with checkpoints; point it at one of those.") from None


def resolve_checkpoint(path: str) -> str:
  """The directory `load_lm_params(path, ...)` reads: for a T5X model
  directory or a jaxrlhf workdir, its latest step (which moves on as the run
  that writes it goes on)."""
  path = os.fspath(path)
  if _is_t5x(path):
    return t5x_checkpoint.find_t5x_checkpoint(path)
  if is_hf(path):
    return path
  return _state_item_dir(path)


def _check_same_tree(loaded, target, path):
  flat_l = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
  flat_t = dict(jax.tree_util.tree_flatten_with_path(target)[0])
  missing = sorted(jax.tree_util.keystr(k) for k in flat_t if k not in flat_l)
  if missing:
    raise ValueError(f"Checkpoint {path!r} lacks parameters {missing[:5]} "
                     f"({len(missing)} in all): it is not this model.")
  for k, t in flat_t.items():
    if tuple(flat_l[k].shape) != tuple(t.shape):
      raise ValueError(
          f"Checkpoint {path!r}: parameter {jax.tree_util.keystr(k)} has "
          f"shape {tuple(flat_l[k].shape)}, the model expects "
          f"{tuple(t.shape)}. Set config.model to the checkpoint's "
          "architecture and size; a different vocabulary axis means "
          "another vocabulary size (config.model.vocab_size, or the data's "
          "vocabulary when it is unset).")


def is_hf(path: str) -> bool:
  """Whether `path` is a Hugging Face model folder."""
  try:
    return loading.checkpoint_kind(path) == loading.HF
  except loading.PretrainedError:
    return False


def _load_hf(path: str, target: Any, module, token_swap) -> Any:
  """A Hugging Face folder's parameters for `module`, token rows exchanged
  by `token_swap`, shaped and sharded like `target`."""
  if module is None:
    raise ValueError(f"{path!r} is a Hugging Face folder; loading it needs "
                     "the run's model (module=).")
  _, host = hf_io.load_hf_checkpoint(path)  # t5x's unscanned layout
  host = loading.relayout_params(host, module.config)
  host = token_rows.swap_token_rows(module, host, token_swap)
  return _place(host, target, path)


def _place(host: Any, target: Any, path: str) -> Any:
  """Host arrays as jax.Arrays shaped and sharded like `target`."""
  _check_same_tree(host, target, path)
  return jax.tree.map(
      lambda x, t: jax.make_array_from_callback(
          t.shape, t.sharding,
          lambda index, x=x, t=t: np.asarray(x[index], t.dtype)),
      host, target)


def load_lm_params(path: str, target: Any, *, module=None,
                   token_swap=None) -> Any:
  """Parameters from `path` shaped and sharded like `target` (jax.Arrays).

  `module` (the run's model) and `token_swap` (the vocabulary's, or None)
  are what a Hugging Face folder needs; the other checkpoints hold the
  run's own ids already."""
  path = os.fspath(path)
  shardings = jax.tree.map(lambda x: x.sharding, target)
  if is_hf(path):
    return _load_hf(path, target, module, token_swap)
  if _is_t5x(path):
    shapes = t5x_checkpoint.t5x_param_shapes(path)["params"]
    if module is not None and loading.is_scanned(shapes, module.config) != (
        bool(getattr(module.config, "scan_layers", False))):
      # The run scans its layers and the checkpoint does not (t5x's usual
      # layout), or the reverse: read on the host, restack, place.
      host = t5x_checkpoint.read_t5x_checkpoint(
          path, restore_dtype=np.float32)["params"]
      return _place(loading.relayout_params(host, module.config), target,
                    path)
    _check_same_tree(shapes, target, path)
    loaded = t5x_checkpoint.read_t5x_checkpoint(
        path, restore_dtype=np.float32, shardings=shardings)["params"]
    return jax.tree.map(lambda x, t: x.astype(t.dtype), loaded, target)
  return load_network_params(path, target, "policy", module=module,
                             token_swap=token_swap)


def load_network_params(path: str, target: Any, network: str, *,
                        module=None, token_swap=None) -> Any:
  """`params/<network>` of a jaxrlhf workdir's latest checkpoint, shaped and
  sharded like `target` (jax.Arrays); for a LoRA run's workdir, its base
  with the adapters merged in (`module` and `token_swap`: what its base
  needs when that is a Hugging Face folder, see `load_lm_params`)."""
  path = os.fspath(path)
  shardings = jax.tree.map(lambda x: x.sharding, target)
  state = checkpoint_files.restore_state_as_numpy(_state_item_dir(path))
  if "params" not in state or network not in state["params"]:
    have = sorted(state.get("params", {}))
    raise ValueError(f"Checkpoint {path!r} has no params/{network} network "
                     f"(it has {have}).")
  loaded = state["params"][network]
  spec = lora.LoraSpec.from_config((run_config(path) or {}).get("lora")
                                   or {})
  if spec is not None:
    return _merged_lora_network(path, loaded, target, spec, module,
                                token_swap)
  _check_same_tree(loaded, target, path)
  return jax.tree.map(
      lambda x, t, s: jax.device_put(np.asarray(x, t.dtype), s),
      loaded, target, shardings)


def _merged_lora_network(path: str, loaded: Any, target: Any,
                         spec: "lora.LoraSpec", module, token_swap) -> Any:
  """A LoRA run's network (its adapters `loaded`, a policy's or a
  backbone's with a head) merged into its base, shaped like `target`."""
  record = lora.read_base_record(_state_item_dir(path))
  if record is None:
    raise ValueError(f"{path!r} is a LoRA run's workdir, but it has no "
                     f"{lora.BASE_RECORD} naming the base of its adapters.")
  base_path = record.get("checkpoint") or ""
  if not base_path:
    raise ValueError(
        f"{path!r} is a LoRA run whose base was a fresh initialisation "
        f"(seed {record.get('random_init_seed')}), which its checkpoints do "
        "not hold; start LoRA runs that others load from a checkpoint "
        "(init.policy_checkpoint).")
  with_head = isinstance(loaded, dict) and set(loaded) == {"backbone", "head"}
  lm_target = target["backbone"] if with_head else target
  adapters = loaded["backbone"] if with_head else loaded
  # Its base as that run read it: token rows exchanged as its vocabulary
  # exchanged them (the same vocabulary as this run's, which is checked).
  swap = record.get("token_swap")
  base = load_lm_params(base_path, lm_target, module=module,
                        token_swap=tuple(swap) if swap else token_swap)
  lora.check_base(base, record, repr(path))
  shardings = jax.tree.map(lambda x: x.sharding, lm_target)
  mesh = getattr(jax.tree.leaves(shardings)[0], "mesh", None)
  adapters = jax.device_put(adapters, None if mesh is None else (
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  merged = jax.jit(lambda b, a: lora.merged(b, a, spec),
                   out_shardings=shardings)(base, adapters)
  if not with_head:
    return merged
  return {"backbone": merged, "head": jax.tree.map(
      lambda x, t: jax.device_put(np.asarray(x, t.dtype), t.sharding),
      loaded["head"], target["head"])}


def run_config(path: str) -> Optional[dict]:
  """The config.json of the jaxrlhf run at `path` (see
  `checkpoint_files.run_config`); None if there is none."""
  return checkpoint_files.run_config(path)
