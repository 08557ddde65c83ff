"""The model families, registered once.

  build_model(config.model, task_vocab_size) -> (module, model_config)

`FAMILIES` is the one list of model families: `config.model.arch` takes
their names, and loading, export, sampling and scoring look a family up
here (`family_of`). A family is one module (its network, config, presets
and Hugging Face mapping) ending in a `family.Family` value; to add one,
write its module and add its name to `MODULES` below.
"""

import functools
import importlib
from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from jaxrlhf.models import family
from jaxrlhf.models import fused_attention
from jaxrlhf.models import t5
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders

# The modules of the model families, one line each, in the order of
# `config.model.arch`'s choices; each ends with its `FAMILY`.
MODULES = (
    "t5",
    "llama",
    "gpt_neox",
    "t5x_decoder_only",
    "gemma",
    "gemma3",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "mixtral",
)

FAMILIES: Dict[str, family.Family] = {
    f.name: f for f in (
        importlib.import_module(f"jaxrlhf.models.{name}").FAMILY
        for name in MODULES)}

ARCHITECTURES = tuple(FAMILIES)
# config.model.attention_impl: "auto" (the fastest exact kernel the family
# and the hardware have, `attention_for`) or one of the kernels.
AUTO_ATTENTION = "auto"
ATTENTION_CHOICES = (AUTO_ATTENTION,) + attentions.ATTENTION_IMPLS
# config.model.mlp's values (T5 and t5x's decoder-only model).
MLP_TYPES = tuple(t5.MLP_ACTIVATIONS)


def get_family(name: str) -> family.Family:
  """The registered family `name` (a `config.model.arch` value)."""
  if name not in FAMILIES:
    raise ValueError(f"config.model.arch: {name!r} is not supported; choose "
                     f"one of {ARCHITECTURES}.")
  return FAMILIES[name]


def family_of(config_or_module) -> family.Family:
  """The family of a model config or module: the one whose config class is
  the config's own class (a config derived from another family's is its
  own family, not that one's)."""
  config = getattr(config_or_module, "config", config_or_module)
  for candidate in FAMILIES.values():
    if type(config) is candidate.config_cls:  # pylint: disable=unidiomatic-typecheck
      return candidate
  raise TypeError(f"No model family for {type(config).__name__}; registered "
                  f"configs: {[f.config_cls.__name__ for f in FAMILIES.values()]}.")


def module_for_config(config):
  """The Flax module a model config describes."""
  return family_of(config).module(config)


def _abstract_params(module):
  args = family.init_args(module, family_of(module).kind)
  # Shapes only: no logical-axis rules, so that the activations' sharding
  # constraints do not meet a mesh the caller may have entered.
  with nn.logical_axis_rules(()):
    return jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), *args))["params"]


_cached_abstract_params = functools.lru_cache(maxsize=64)(_abstract_params)


def abstract_params(module):
  """The module's parameter tree as ShapeDtypeStructs, boxed with their
  logical axis names (`jax.eval_shape` of its init: no compute; cached per
  module, since tracing a deep unscanned model takes a while)."""
  try:
    hash(module)
  except TypeError:  # e.g. a config with a list-valued field
    return _abstract_params(module)
  return _cached_abstract_params(module)


def param_shapes(config) -> Dict[str, Tuple[int, ...]]:
  """{"a/b/c": shape} of the parameters of the model `config` describes."""
  # The boxes' values, not `unbox` (which constrains them to the mesh and
  # rules the caller may have entered).
  params = jax.tree.map(
      lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
      abstract_params(module_for_config(config)),
      is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  return {k: tuple(v.shape) for k, v in family.flat_paths(params).items()}


def relayout_params(params, config):
  """Stacks or unstacks layer parameters (host numpy) to match
  `config.scan_layers`; a tree already in that layout is returned as is."""
  stacks = family_of(config).layer_stacks(config)
  want = bool(getattr(config, "scan_layers", False))
  if any("layers" in params.get(name, {}) for name, _ in stacks) == want:
    return params
  for name, count in stacks:
    if want:
      params = decoders.stack_layer_params(params, count, name)
    else:
      params = decoders.unstack_layer_params(params, name)
  return params


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """Rounds up so the vocab dimension shards evenly (t5x: 32100 -> 32128)."""
  return -(-vocab_size // multiple) * multiple


def planned_vocab_size(model_cfg: ml_collections.ConfigDict) -> int:
  """The vocabulary size a model gets without reading its vocabulary file:
  `model_cfg.vocab_size`, else its size preset's (T5 1.1: 32128, Pythia:
  50304, ...)."""
  if model_cfg.vocab_size:
    return model_cfg.vocab_size
  return get_family(model_cfg.arch).preset(model_cfg.size).vocab_size


def prompt_feature_length(model_cfg: ml_collections.ConfigDict,
                          inputs_length: int) -> int:
  """The task feature length of prompts of `inputs_length` tokens as the
  model reads them (`config.data.inputs_length`). Tasks append an EOS to
  every prompt: a T5 encoder reads it, so inputs_length counts it, as t5x
  counts its inputs; a decoder-only model's feature converter drops it, so
  the task holds one token more than the inputs_length the model reads."""
  return inputs_length + (0 if get_family(model_cfg.arch).encoder_decoder
                          else 1)


def attention_for(arch: str, platform: str, config=None) -> str:
  """The kernel `attention_impl='auto'` runs for family `arch` on
  `platform` (a JAX platform name), given the family's resolved `config`
  (its dataclass): Pallas splash attention on TPU where the family takes it
  (it never builds the [length, length] scores); cuDNN's flash attention on
  a GPU of compute capability 9.0 or later (Hopper) where the family takes
  it and cuDNN's conditions hold (`cudnn_takes`); else 'xla'."""
  impls = get_family(arch).attention_impls
  if platform == "tpu" and "splash" in impls:
    return "splash"
  if (platform == "gpu" and "dot_product_cudnn" in impls
      and config is not None and cudnn_takes(config)):
    return "dot_product_cudnn"
  return "xla"


def cudnn_takes(config) -> bool:
  """Whether cuDNN's flash attention runs the model of `config` (a decoder-
  only family's dataclass) on this process's GPUs, as `attention_impl=
  'auto'` needs to know before the step compiles (cuDNN itself checks only
  then, and fails the compile): half-precision compute, a head size that is
  a multiple of 8 and at most 256, no soft cap of the attention logits
  (cuDNN takes none), and a GPU that takes cuDNN's packed layout (compute
  capability 9.0+: the trainers' unpacked rows use it, so no [batch, 1,
  length, length] mask is built; `fused_attention.cudnn_unpacked`)."""
  head_dim = getattr(config, "head_dim", None)
  return (jnp.dtype(getattr(config, "dtype", "float32")) in (
              jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and head_dim is not None and head_dim % 8 == 0 and head_dim <= 256
          and getattr(config, "attn_logit_softcap", None) is None
          and fused_attention.packed_layout_available())


def build_model(model_cfg: ml_collections.ConfigDict, task_vocab_size: int,
                platform: Optional[str] = None):
  """The Flax module and its dataclass config from `config.model`.

  `model_cfg.arch` picks the family and `model_cfg.size` its preset; the
  fields that are set (the dimensions, the speed options, and the family's
  own such as `mlp`) override the preset (`Family.from_run_config`). The
  vocabulary is `model_cfg.vocab_size`, or the task's rounded up to a
  multiple of 128. `attention_impl='auto'` becomes the kernel for
  `platform`, the platform of the devices the model runs on (None: JAX's
  default backend).
  """
  chosen = get_family(model_cfg.arch)
  vocab_size = model_cfg.vocab_size or padded_vocab_size(task_vocab_size)
  if vocab_size < task_vocab_size:
    raise ValueError(f"config.model.vocab_size {vocab_size} is smaller than the "
                     f"task vocabulary ({task_vocab_size}).")
  if model_cfg.get("attention_impl") == AUTO_ATTENTION:
    # The kernel depends on the resolved dimensions and dtype: read them
    # off the config with the kernel every family takes, then choose.
    model_cfg = model_cfg.copy_and_resolve_references()
    model_cfg.attention_impl = "xla"
    model_cfg.attention_impl = attention_for(
        model_cfg.arch, platform or jax.default_backend(),
        chosen.from_run_config(model_cfg, vocab_size))
  config = chosen.from_run_config(model_cfg, vocab_size)
  return chosen.module(config), config
