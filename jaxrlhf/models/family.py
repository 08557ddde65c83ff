"""What a model family is: one value that everything model-specific hangs on.

A family (`Family`) is a Flax module, its dataclass config, its size
presets, how `config.model` becomes that config, where its layer stacks are
(for the scanned/unrolled relayout), and optionally its Hugging Face
mapping (`HFMapping`: config.json and tensor names both ways). Each family's
module (`t5.py`, `llama.py`, `gpt_neox.py`, `t5x_decoder_only.py`,
`gemma.py`) ends with its `FAMILY`, and `jaxrlhf/models/__init__.py`
registers them in one tuple; `config.model.arch`'s choices, `build_model`,
`from_pretrained`, `export_hf`, sampling and scoring look families up
there, never by class name.

The helpers below are what the families' HF mappings share.
"""

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ENCODER_DECODER = "encoder_decoder"
DECODER_ONLY = "decoder_only"

Params = Any
Shapes = Dict[str, Tuple[int, ...]]


class HFCheckpointError(ValueError):
  """A checkpoint that does not match what its config (or ours) implies."""


@dataclasses.dataclass(frozen=True)
class HFMapping:
  """A family's Hugging Face checkpoint format.

  Attributes:
    architecture: the `architectures` entry of its config.json
      ("LlamaForCausalLM").
    model_type: its `model_type` ("llama").
    config_from_hf: (parsed config.json) -> our config; unsupported options
      raise HFCheckpointError (`unsupported`).
    config_to_hf: (our config) -> config.json dict (transformers 4.x keys,
      which 5.x also reads), generation fields (eos/bos/pad ids) included.
    tensor_shapes: (config, tensors in the file) -> {HF name: shape} the
      file must hold (the file decides some things, such as a separate
      output matrix of a model whose config says tied).
    from_hf: (config, {HF name: float32 array}) -> params in the unrolled
      (`layers_{i}`) layout.
    to_hf: (config, unrolled params) -> {HF name: array}.
    reconcile: optional (config, tensors) -> (config, tensors) run before
      the shapes are checked: how the file's output layer fits the config.
    ignored: regular expressions of tensor names that are not parameters
      (rotary buffers, tied copies) and may be in the file.
  """
  architecture: str
  model_type: str
  config_from_hf: Callable[[Dict[str, Any]], Any]
  config_to_hf: Callable[[Any], Dict[str, Any]]
  tensor_shapes: Callable[[Any, Mapping[str, Any]], Shapes]
  from_hf: Callable[[Any, Dict[str, np.ndarray]], Params]
  to_hf: Callable[[Any, Params], Dict[str, np.ndarray]]
  reconcile: Optional[Callable[[Any, Dict[str, np.ndarray]],
                               Tuple[Any, Dict[str, np.ndarray]]]] = None
  ignored: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family, as the registry holds it.

  Attributes:
    name: its `config.model.arch` value.
    summary: one line for the docs.
    config_cls: the dataclass config of its module.
    module_cls: the Flax module; `module_cls(config)` is the model.
    kind: ENCODER_DECODER (`encode`/`decode`, T5's call signature) or
      DECODER_ONLY (`hidden_states(tokens, positions, attention_mask)`,
      `logits_from_hidden`, `decode_step`: see `layers.CausalLM`).
    presets: {size name: config}; `config.model.size` picks one.
    from_run_config: (config.model ConfigDict, vocab_size) -> config: the
      preset `size` with the fields that are set overriding it; a field
      the family does not have is a ValueError naming `config.model.<field>`.
    layer_stacks: (config) -> ((parameter scope, layer count), ...): where
      `layers_{i}` (or scanned `layers`) live.
    hf: its Hugging Face format, or None.
    t5x: its parameters are t5x's (T5X checkpoints load into it).
  """
  name: str
  summary: str
  config_cls: type
  module_cls: type
  kind: str
  presets: Mapping[str, Any]
  from_run_config: Callable[[Any, int], Any]
  layer_stacks: Callable[[Any], Sequence[Tuple[str, int]]]
  hf: Optional[HFMapping] = None
  t5x: bool = False

  def preset(self, size: str, **overrides):
    """The preset `size` with fields overridden."""
    if size not in self.presets:
      raise ValueError(f"Unknown {self.name} preset {size!r} "
                       f"(config.model.size); choose one of "
                       f"{sorted(self.presets)}.")
    return replace_fields(self.presets[size], overrides)

  def module(self, config) -> nn.Module:
    return self.module_cls(config)

  @property
  def encoder_decoder(self) -> bool:
    return self.kind == ENCODER_DECODER


def replace_fields(config, overrides: Mapping[str, Any]):
  """`dataclasses.replace`, with unknown fields named in the error."""
  if not overrides:
    return config
  fields = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"{type(config).__name__} has no field(s) {unknown}; "
                     f"its fields: {sorted(fields)}.")
  return dataclasses.replace(config, **overrides)


# ----------------------------------------------------------------------------
# config.model -> a family's config.

# config.model's dimension fields and the decoder-only config fields they
# set (an encoder-decoder family maps them itself).
DECODER_ONLY_DIMENSIONS = {"emb_dim": "emb_dim", "num_heads": "num_heads",
                           "num_decoder_layers": "num_layers",
                           "head_dim": "head_dim", "mlp_dim": "mlp_dim"}
# Speed options every family's config has (read only when the run config
# has them set).
SPEED_FIELDS = ("scan_layers", "attention_impl", "remat_policy", "dtype")


def set_fields(model_cfg, names: Mapping[str, str]) -> Dict[str, Any]:
  """{family field: value} of the `config.model` fields in `names` (run
  field -> family field) that are set (not None)."""
  out = {}
  for run_field, field in names.items():
    value = model_cfg.get(run_field)
    if value is not None:
      out[field] = value
  return out


def refuse_fields(model_cfg, family: str,
                  fields: Mapping[str, Tuple[Any, str]]) -> None:
  """A ValueError naming the first `config.model` field of `fields`
  ({field: (the only value family `family` takes, why)}) set to another
  value."""
  for field, (allowed, why) in fields.items():
    value = model_cfg.get(field)
    if value is not None and value != allowed:
      raise ValueError(f"config.model.{field}: arch {family!r} {why}")


def decoder_only_overrides(model_cfg, vocab_size: int) -> Dict[str, Any]:
  """The decoder-only config fields `config.model` sets: the dimensions
  that are set, the vocabulary and the speed options."""
  if model_cfg.get("num_encoder_layers") is not None:
    raise ValueError(f"config.model.num_encoder_layers: arch "
                     f"{model_cfg.arch!r} is decoder-only; set "
                     "num_decoder_layers for its depth.")
  overrides = set_fields(model_cfg, DECODER_ONLY_DIMENSIONS)
  overrides.update(set_fields(model_cfg, {f: f for f in SPEED_FIELDS}))
  overrides["vocab_size"] = vocab_size
  return overrides


# ----------------------------------------------------------------------------
# Abstract parameters of a module.

def init_args(module: nn.Module, kind: str):
  """Smallest inputs `module.init` accepts (only the shapes matter)."""
  one = jnp.ones((1, 1), jnp.int32)
  if kind == ENCODER_DECODER:
    return (one, one)
  return (one, jnp.zeros((1, 1), jnp.int32), one)


def flat_paths(tree) -> Dict[str, Any]:
  """{"a/b/c": leaf} of a nested parameter dict."""
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# ----------------------------------------------------------------------------
# What the HF mappings share.

def hf_get(hf_config, key, default=dataclasses.MISSING):
  """`hf_config[key]` (None counts as absent), else `default`, else an
  error naming the missing key."""
  if key in hf_config and hf_config[key] is not None:
    return hf_config[key]
  if default is dataclasses.MISSING:
    raise HFCheckpointError(f"config.json lacks the required key {key!r}.")
  return default


def unsupported(architecture: str, what: str):
  raise HFCheckpointError(f"{architecture}: {what} is not supported by "
                          "jaxrlhf's model of this family.")


def rope_parameters(hf_config) -> Dict[str, Any]:
  """The rotary options of transformers 4.x (`rope_scaling`) and 5.x
  (`rope_parameters`) config.json files, merged."""
  rope = dict(hf_config.get("rope_parameters") or {})
  rope.update(hf_config.get("rope_scaling") or {})
  return rope


def special_token_ids(hf_config) -> Dict[str, Any]:
  """The generation-relevant token ids of a config.json ({} for those it
  does not set), so that an export carries what the import read."""
  return {key: hf_config[key] for key in ("bos_token_id", "eos_token_id",
                                          "pad_token_id")
          if hf_config.get(key) is not None}


def torch_linear(w):
  """A torch Linear weight [out, in] <-> our kernel [in, out]."""
  return np.ascontiguousarray(np.swapaxes(w, -1, -2))
