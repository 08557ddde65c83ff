"""What a model family is: one value that everything model-specific hangs on.

A family (`Family`) is a Flax module, its dataclass config, its size
presets, how `config.model` becomes that config, where its layer stacks are
(for the scanned/unrolled relayout), and optionally its Hugging Face
mapping (`HFMapping`: config.json and tensor names both ways). Each family's
module (`t5.py`, `llama.py`, `qwen2.py`, `gemma3.py`, ...; one per
family) ends with its `FAMILY`, and `jaxrlhf/models/registry.py`
registers them in one tuple; `config.model.arch`'s choices, `build_model`,
`from_pretrained`, `export_hf`, sampling and scoring look families up
there, never by class name.

`DecoderConfig` is what every rotary decoder-only family's config shares
(a family's config subclasses it and adds its own fields; `GroupedQueryConfig`
adds grouped-query heads and rotary scaling, `LayerTypesConfig` layers that
attend through a sliding window, as Hugging Face's `layer_types` say), and
`decoder_from_run_config` turns `config.model` into any of them. The
helpers below are what the families' HF mappings share.
"""

import ast
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import rotary

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
      `logits_from_hidden`, `decode_step`: see `decoders.CausalLM`).
    presets: {size name: config}; `config.model.size` picks one.
    from_run_config: (config.model ConfigDict, vocab_size) -> config: the
      preset `size` with the fields that are set overriding it; a field
      the family does not have is a ValueError naming `config.model.<field>`.
    layer_stacks: (config) -> ((parameter scope, layer count), ...): where
      `layers_{i}` (or scanned `layers`) live.
    hf: its Hugging Face format, or None.
    t5x: its parameters are t5x's (T5X checkpoints load into it).
    attention_impls: the `attention_impl` values its config takes.
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
  attention_impls: Tuple[str, ...] = attentions.ATTENTION_IMPLS

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


def check_dtype(value, field="dtype"):
  """Refuses a `value` that is not a dtype name, naming `field`."""
  try:
    jnp.dtype(value)
  except TypeError as e:
    raise ValueError(f"{field}={value!r} is not a dtype name (e.g. 'float32', "
                     "'bfloat16').") from e


# ----------------------------------------------------------------------------
# The shared config of the decoder-only families.

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """What every rotary decoder-only family's config has (t5x-style names).

  A family's config subclasses it (or `GroupedQueryConfig`), adds its own
  fields (and their defaults), and extends `check` for what its
  architecture requires; the shared decoder stack (`decoders.DecoderOnly`),
  `decoder_from_run_config` and the KV-cache sampler read these fields.
  """
  vocab_size: int = 32000
  emb_dim: int = 4096
  num_heads: int = 32
  num_layers: int = 32
  mlp_dim: int = 11008
  rope_theta: float = 10000.0
  norm_epsilon: float = 1e-5
  # True: the output layer is the token embedding transposed.
  tie_embeddings: bool = False
  # The context length the model was trained for (HF max_position_embeddings);
  # informational, nothing is cut at this length.
  max_length: int = 4096
  # Compute dtype; parameters are always float32.
  dtype: Any = "float32"
  # nn.scan over layers: one compiled layer body, parameters stacked with a
  # leading 'layers' axis (faster compiles of deep models).
  scan_layers: bool = False
  remat_policy: str = "none"
  # 'xla' (einsum + float32 softmax) or 'dot_product'
  # (jax.nn.dot_product_attention); see attentions.attend.
  attention_impl: str = "xla"
  # Generation ids of the checkpoint's tokenizer (HF config.json), carried
  # so that an export stops where the import did; None = not set.
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None

  # The positive integer fields `check` checks.
  _POSITIVE = ("vocab_size", "emb_dim", "num_heads", "num_layers", "mlp_dim",
               "max_length")

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuses an impossible combination, naming the config class and the
    field; a family's override calls this one too."""
    name = type(self).__name__
    for field in self._POSITIVE:
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}.{field} must be a positive integer, got "
                         f"{value!r}.")
    checks.check_choice(name, "attention_impl", self.attention_impl,
                        attentions.ATTENTION_IMPLS)
    checks.check_choice(name, "remat_policy", self.remat_policy,
                        decoders.REMAT_POLICIES)
    check_dtype(self.dtype, f"{name}.dtype")


@dataclasses.dataclass(frozen=True)
class GroupedQueryConfig(DecoderConfig):
  """A `DecoderConfig` whose heads are set on their own: grouped-query
  attention's key/value heads and a head width that need not be emb_dim /
  num_heads (Llama, Gemma, Qwen, Mistral), and rotary context-extension
  scaling. `layer_attention()` is how each layer attends (here all alike;
  `LayerTypesConfig` lets them differ)."""
  # Key/value heads of grouped-query attention; num_heads % num_kv_heads == 0.
  num_kv_heads: int = 32
  head_dim: int = 128
  # Rescaled rotary frequencies (Llama 3.1's 'llama3', 'linear'); None: none.
  rope_scaling: Optional[rotary.RopeScaling] = None

  _POSITIVE = DecoderConfig._POSITIVE + ("num_kv_heads", "head_dim")

  def layer_attention(self) -> Tuple[attentions.LayerAttention, ...]:
    """One `attentions.LayerAttention` per layer (`Attention.layer_kinds`)."""
    return (attentions.LayerAttention(self.rope_theta, self.rope_scaling),
            ) * self.num_layers

  def layers_differ(self) -> bool:
    """Whether the layers attend differently (then each layer is given its
    index: `decoders.DecoderOnly`'s index_layers)."""
    return len(set(self.layer_attention())) > 1

  def check(self) -> None:
    super().check()
    name = type(self).__name__
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"{name}: num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"{name}: head_dim={self.head_dim} must be even "
                       "(rotary embeddings rotate channel pairs).")


@dataclasses.dataclass(frozen=True)
class LayerTypesConfig(GroupedQueryConfig):
  """A `GroupedQueryConfig` whose layers may attend differently, as Hugging
  Face's `layer_types` say: a 'sliding_attention' layer's queries see the
  keys fewer than `sliding_window` positions back, a 'full_attention'
  layer's every earlier key. The sliding layers may have a rotary of their
  own (`sliding_layer_rope`: Gemma 3's local layers).

  `layer_types` None is the family's pattern (`default_layer_types`: every
  layer sliding when there is a window, else every layer full; Gemma's
  families override it), so that a preset keeps its pattern at any depth.
  The pattern is a value of the config, not of the parameter layout: every
  layer is `layers_i` (one body when scanned), whatever the pattern.
  """
  sliding_window: Optional[int] = None
  layer_types: Optional[Tuple[str, ...]] = None

  def __post_init__(self):
    if isinstance(self.layer_types, list):  # as parsed from JSON
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    super().__post_init__()

  def default_layer_types(self) -> Tuple[str, ...]:
    """The family's pattern for `num_layers` layers."""
    kind = (attentions.SLIDING_ATTENTION if self.sliding_window is not None
            else attentions.FULL_ATTENTION)
    return (kind,) * self.num_layers

  @property
  def attention_types(self) -> Tuple[str, ...]:
    """Each layer's type: `layer_types`, else the family's pattern."""
    if self.layer_types is None:
      return self.default_layer_types()
    return self.layer_types

  def with_layer_types(self, types: Optional[Sequence[str]]):
    """This config with `types` as its layers' types: None (the family's
    pattern) when they are that pattern, so that a config read from a file
    that lists them equals the preset."""
    config = dataclasses.replace(self, layer_types=None)
    if types is None or tuple(types) == config.default_layer_types():
      return config
    return dataclasses.replace(self, layer_types=tuple(types))

  def sliding_layer_rope(self) -> Tuple[float, Optional[rotary.RopeScaling]]:
    """(rotary base, scaling) of the sliding layers: the full layers' here;
    Gemma 3's local layers have their own."""
    return self.rope_theta, self.rope_scaling

  def layer_attention(self) -> Tuple[attentions.LayerAttention, ...]:
    full = attentions.LayerAttention(self.rope_theta, self.rope_scaling)
    local = attentions.LayerAttention(*self.sliding_layer_rope(),
                                      sliding_window=self.sliding_window)
    return tuple(local if t == attentions.SLIDING_ATTENTION else full
                 for t in self.attention_types)

  def check(self) -> None:
    super().check()
    name = type(self).__name__
    types = self.attention_types
    if len(types) != self.num_layers:
      raise ValueError(
          f"{name}.layer_types has {len(types)} entries for num_layers="
          f"{self.num_layers}: give one per layer, or None for the family's "
          "pattern.")
    for t in types:
      checks.check_choice(name, "layer_types", t, attentions.LAYER_TYPES)
    window = self.sliding_window
    if window is not None and (not isinstance(window, (int, np.integer))
                               or window <= 0):
      raise ValueError(f"{name}.sliding_window must be a positive integer or "
                       f"None, got {window!r}.")
    if window is None and attentions.SLIDING_ATTENTION in types:
      raise ValueError(f"{name}: layer_types has sliding_attention layers "
                       "but sliding_window is None.")


# ----------------------------------------------------------------------------
# config.model -> a family's config.

# config.model's dimension fields and the decoder-only config fields they
# set (an encoder-decoder family maps them itself).
DECODER_ONLY_DIMENSIONS = {"emb_dim": "emb_dim", "num_heads": "num_heads",
                           "num_kv_heads": "num_kv_heads",
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


def _split_top_level(text: str) -> Sequence[str]:
  """`text` split at the commas outside brackets and quotes (a tuple
  value keeps its commas)."""
  parts, depth, quote, start = [], 0, None, 0
  for i, char in enumerate(text):
    if quote:
      quote = None if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return parts + [text[start:]]


def parse_family_fields(text: str) -> Dict[str, Any]:
  """`config.model.family_fields` ("rope_theta=1e6,sliding_window=4096",
  "layer_types=('sliding_attention', 'full_attention')") as {field:
  value}; a value is a Python literal (number, bool, None, tuple) or else a
  string."""
  fields = {}
  for item in filter(None, (part.strip()
                            for part in _split_top_level(text))):
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
      raise ValueError(
          f"config.model.family_fields: {item!r} is not field=value; write "
          "e.g. 'rope_theta=1000000.0,sliding_window=4096'.")
    try:
      parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      parsed = value.strip()
    fields[name.strip()] = parsed
  return fields


def with_family_fields(config, model_cfg):
  """`config` with `config.model.family_fields` set on it: any field of the
  family's config dataclass, for a from-scratch run (its preset's value
  otherwise)."""
  fields = parse_family_fields(model_cfg.get("family_fields") or "")
  known = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(
        f"config.model.family_fields: {type(config).__name__} has no "
        f"field(s) {unknown}; its fields: {sorted(known)}.")
  return dataclasses.replace(config, **fields) if fields else config


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


def decoder_from_run_config(family, model_cfg, vocab_size: int,
                            refused: Mapping[str, Tuple[Any, str]]):
  """`config.model` -> a decoder-only family's config: the preset `size`,
  with the dimensions, speed options and vocabulary that are set, then
  `family_fields`. `refused`: {config.model field: (the only value the
  family takes, why)} (`refuse_fields`).

  A preset without grouped-query attention keeps one key/value head per
  query head when num_heads is changed and num_kv_heads is not.
  """
  refuse_fields(model_cfg, family.name, refused)
  overrides = decoder_only_overrides(model_cfg, vocab_size)
  preset = family.presets.get(model_cfg.size)
  if ("num_heads" in overrides and "num_kv_heads" not in overrides
      and getattr(preset, "num_kv_heads", None) == getattr(
          preset, "num_heads", 0)):
    overrides["num_kv_heads"] = overrides["num_heads"]
  return with_family_fields(family.preset(model_cfg.size, **overrides),
                            model_cfg)


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


def rope_scaling_from_hf(rope, architecture: str
                         ) -> Optional[rotary.RopeScaling]:
  """`rotary.RopeScaling` of a config.json's rotary options (as
  `rope_parameters` merges them); None for the default rotary."""
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return None
  if rope_type == "llama3":
    return rotary.RopeScaling(
        kind="llama3", factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_length=int(rope["original_max_position_embeddings"]))
  if rope_type == "linear":
    return rotary.RopeScaling(kind="linear", factor=float(rope["factor"]))
  unsupported(architecture, f"rope type {rope_type!r} (default, llama3, "
              "linear)")


def rope_scaling_to_hf(scaling: Optional[rotary.RopeScaling]
                       ) -> Optional[Dict[str, Any]]:
  """config.json's `rope_scaling` (transformers 4.x key) of a RopeScaling."""
  if scaling is None:
    return None
  if scaling.kind == "llama3":
    return {"rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_length}
  return {"rope_type": "linear", "factor": scaling.factor}


def hf_int(hf_config, key, default=dataclasses.MISSING) -> int:
  """An integer field of a config.json (a float such as 256.0 from an
  older writer is accepted when it is whole): transformers 5 validates the
  types of what it reads, so exports write such fields as ints."""
  value = hf_get(hf_config, key, default)
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise HFCheckpointError(f"config.json's {key!r} must be an integer, got "
                            f"{value!r}.")
  return int(value)


def special_token_ids(hf_config) -> Dict[str, Any]:
  """The generation-relevant token ids of a config.json ({} for those it
  does not set), so that an export carries what the import read."""
  return {key: hf_config[key] for key in ("bos_token_id", "eos_token_id",
                                          "pad_token_id")
          if hf_config.get(key) is not None}


def torch_linear(w):
  """A torch Linear weight [out, in] <-> our kernel [in, out]."""
  return np.ascontiguousarray(np.swapaxes(w, -1, -2))
