"""Llama-style decoder-only transformer (Llama 2/3, TinyLlama and kin).

Pre-norm RMSNorm blocks, rotary position embeddings (theta and Llama 3.1
context-extension scaling configurable), grouped-query attention, SwiGLU MLP,
no biases, tied or untied output embedding. Numerics follow Hugging Face's
`LlamaForCausalLM`, so its checkpoints load through `jaxrlhf.models.hf_io`.

Call signature (common to the decoder-only families):

  logits = Llama(config).apply({'params': params}, tokens, positions,
                               attention_mask)

with tokens/positions int32 [batch, length], attention_mask [batch, length]
(1 = real token, 0 = pad) and float32 logits [batch, length, vocab].
`Llama.hidden_states` returns the final normalised states [batch, length,
embed] for value and reward heads.
"""

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models import family
from jaxrlhf.models import layers

Array = jax.Array
RopeScaling = layers.RopeScaling


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyper-parameters of a Llama-style model (t5x-style field names)."""
  vocab_size: int = 32000
  emb_dim: int = 4096
  num_heads: int = 32
  # Key/value heads of grouped-query attention; num_heads % num_kv_heads == 0.
  num_kv_heads: int = 32
  num_layers: int = 32
  head_dim: int = 128
  mlp_dim: int = 11008
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_epsilon: float = 1e-5
  # True: the output layer is the token embedding transposed (Llama 3.2 1B/3B).
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
  # (jax.nn.dot_product_attention); see layers.attend.
  attention_impl: str = "xla"
  # Generation ids of the checkpoint's tokenizer (HF config.json), carried
  # so that an export stops where the import did; None = not set.
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even "
                       "(rotary embeddings rotate channel pairs).")
    checks.check_choice("LlamaConfig", "attention_impl",
                        self.attention_impl, layers.ATTENTION_IMPLS)
    checks.check_choice("LlamaConfig", "remat_policy",
                        self.remat_policy, layers.REMAT_POLICIES)
    layers.check_dtype(self.dtype, "LlamaConfig.dtype")

  @classmethod
  def preset(cls, name: str, **overrides) -> "LlamaConfig":
    """A published size by name (see LLAMA_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


def _llama3_scaling(factor):
  return RopeScaling(kind="llama3", factor=factor, low_freq_factor=1.0,
                     high_freq_factor=4.0, original_max_length=8192)


# Dimensions from the published config.json of each model.
LLAMA_PRESETS = {
    # For tests and synthetic tasks: grouped-query (2 query heads per kv head).
    "tiny": LlamaConfig(vocab_size=128, emb_dim=32, num_heads=4,
                        num_kv_heads=2, num_layers=2, head_dim=8, mlp_dim=64,
                        max_length=512),
    "tinyllama-1.1b": LlamaConfig(vocab_size=32000, emb_dim=2048, num_heads=32,
                                  num_kv_heads=4, num_layers=22, head_dim=64,
                                  mlp_dim=5632, max_length=2048),
    "llama2-7b": LlamaConfig(vocab_size=32000, emb_dim=4096, num_heads=32,
                             num_kv_heads=32, num_layers=32, head_dim=128,
                             mlp_dim=11008, max_length=4096),
    "llama2-13b": LlamaConfig(vocab_size=32000, emb_dim=5120, num_heads=40,
                              num_kv_heads=40, num_layers=40, head_dim=128,
                              mlp_dim=13824, max_length=4096),
    "llama2-70b": LlamaConfig(vocab_size=32000, emb_dim=8192, num_heads=64,
                              num_kv_heads=8, num_layers=80, head_dim=128,
                              mlp_dim=28672, max_length=4096),
    "llama3-8b": LlamaConfig(vocab_size=128256, emb_dim=4096, num_heads=32,
                             num_kv_heads=8, num_layers=32, head_dim=128,
                             mlp_dim=14336, rope_theta=500000.0,
                             max_length=8192),
    "llama3-70b": LlamaConfig(vocab_size=128256, emb_dim=8192, num_heads=64,
                              num_kv_heads=8, num_layers=80, head_dim=128,
                              mlp_dim=28672, rope_theta=500000.0,
                              max_length=8192),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, emb_dim=4096, num_heads=32,
                               num_kv_heads=8, num_layers=32, head_dim=128,
                               mlp_dim=14336, rope_theta=500000.0,
                               rope_scaling=_llama3_scaling(8.0),
                               max_length=131072),
    "llama3.2-1b": LlamaConfig(vocab_size=128256, emb_dim=2048, num_heads=32,
                               num_kv_heads=8, num_layers=16, head_dim=64,
                               mlp_dim=8192, rope_theta=500000.0,
                               rope_scaling=_llama3_scaling(32.0),
                               tie_embeddings=True, max_length=131072),
    "llama3.2-3b": LlamaConfig(vocab_size=128256, emb_dim=3072, num_heads=24,
                               num_kv_heads=8, num_layers=28, head_dim=128,
                               mlp_dim=8192, rope_theta=500000.0,
                               rope_scaling=_llama3_scaling(32.0),
                               tie_embeddings=True, max_length=131072),
}


class LlamaBlock(nn.Module):
  """x + attn(norm(x)), then + mlp(norm(.)); returns (x, None) for nn.scan."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h = layers.RMSNorm(cfg.norm_epsilon, dtype,
                       name="pre_self_attention_layer_norm")(x)
    h = layers.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
        use_bias=False, dtype=dtype, attention_impl=cfg.attention_impl,
        name="self_attention")(h, positions, mask, cache_index)
    x = x + h
    h = layers.RMSNorm(cfg.norm_epsilon, dtype, name="pre_mlp_layer_norm")(x)
    h = layers.Mlp(cfg.mlp_dim, ("silu", "linear"), use_bias=False,
                   dtype=dtype, name="mlp")(h)
    x = x + h
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class Llama(layers.CausalLM):
  """Llama-style causal LM; parameters under 'decoder' (t5x layout)."""
  config: LlamaConfig
  block_cls = LlamaBlock

  def final_norm(self):
    return functools.partial(layers.RMSNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))


def from_run_config(model_cfg, vocab_size: int) -> LlamaConfig:
  """`config.model` (arch 'llama') -> LlamaConfig."""
  family.refuse_fields(model_cfg, "llama", {
      "mlp": ("gated-gelu", "has a fixed SwiGLU MLP; leave config.model.mlp "
                 "at its default."),
      "logits_via_embedding": (False, "ties per preset (tie_embeddings)."),
      "dropout_rate": (0.0, "has no dropout.")})
  overrides = family.decoder_only_overrides(model_cfg, vocab_size)
  # config.model has no num_kv_heads: a preset without grouped-query
  # attention keeps one key/value head per query head.
  preset = LLAMA_PRESETS.get(model_cfg.size)
  if ("num_heads" in overrides and preset is not None
      and preset.num_kv_heads == preset.num_heads):
    overrides["num_kv_heads"] = overrides["num_heads"]
  return FAMILY.preset(model_cfg.size, **overrides)


# ----------------------------------------------------------------------------
# Hugging Face's LlamaForCausalLM.

HF_ARCHITECTURE = "LlamaForCausalLM"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)


def config_from_hf(hf) -> LlamaConfig:
  get = functools.partial(family.hf_get, hf)
  if get("hidden_act", "silu") != "silu":
    _unsupported(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      _unsupported(f"{key}=true (projection biases)")
  num_heads = get("num_attention_heads")
  hidden = get("hidden_size")
  rope = family.rope_parameters(hf)
  theta = float(get("rope_theta", rope.get("rope_theta", 10000.0)))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    scaling = None
  elif rope_type == "llama3":
    scaling = layers.RopeScaling(
        kind="llama3", factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_length=int(rope["original_max_position_embeddings"]))
  elif rope_type == "linear":
    scaling = layers.RopeScaling(kind="linear", factor=float(rope["factor"]))
  else:
    _unsupported(f"rope type {rope_type!r} (default, llama3, linear)")
  return LlamaConfig(
      vocab_size=get("vocab_size"), emb_dim=hidden, num_heads=num_heads,
      num_kv_heads=get("num_key_value_heads", num_heads),
      num_layers=get("num_hidden_layers"),
      head_dim=get("head_dim", hidden // num_heads),
      mlp_dim=get("intermediate_size"), rope_theta=theta,
      rope_scaling=scaling, norm_epsilon=float(get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(get("tie_word_embeddings", False)),
      max_length=get("max_position_embeddings", 2048),
      **family.special_token_ids(hf))


def config_to_hf(config: LlamaConfig):
  hf = {
      "architectures": [HF_ARCHITECTURE], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "hidden_act": "silu",
      "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rope_theta,
      "rope_scaling": None,
      "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": config.max_length,
      "attention_bias": False, "mlp_bias": False,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }
  scaling = config.rope_scaling
  if scaling is not None and scaling.kind == "llama3":
    hf["rope_scaling"] = {
        "rope_type": "llama3", "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_length}
  elif scaling is not None:
    hf["rope_scaling"] = {"rope_type": "linear", "factor": scaling.factor}
  return hf


def reconcile(config, tensors):
  """As transformers does, a separate output matrix that differs from the
  embedding unties a config that says tied."""
  head = tensors.get("lm_head.weight")
  if config.tie_embeddings and head is not None and not np.array_equal(
      head, tensors.get("model.embed_tokens.weight")):
    config = dataclasses.replace(config, tie_embeddings=False)
  return config, tensors


# The attention and MLP of a layer: the same names in every Llama-like HF
# checkpoint (Gemma's too). Ours -> HF's, under model.layers.{i}.
_ATTENTION = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}
_MLP = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
# The norms of a Llama layer.
_NORMS = {"pre_self_attention_layer_norm": "input_layernorm",
          "pre_mlp_layer_norm": "post_attention_layernorm"}


def hf_layer_shapes(cfg, prefix: str, norms) -> family.Shapes:
  """{HF name: shape} of one layer under `prefix` ("model.layers.3."):
  attention, MLP and the norms named in `norms` ({ours: HF's})."""
  d, h = cfg.emb_dim, cfg.head_dim
  heads = {"query": cfg.num_heads, "key": cfg.num_kv_heads,
           "value": cfg.num_kv_heads}
  shapes = {prefix + f"{hf}.weight": (d,) for hf in norms.values()}
  shapes.update({prefix + f"self_attn.{hf}.weight": (heads[ours] * h, d)
                 for ours, hf in _ATTENTION.items()})
  shapes[prefix + "self_attn.o_proj.weight"] = (d, cfg.num_heads * h)
  shapes.update({prefix + f"mlp.{hf}.weight": (
      (d, cfg.mlp_dim) if ours == "wo" else (cfg.mlp_dim, d))
                 for ours, hf in _MLP.items()})
  return shapes


def hf_layer_from(cfg, t, prefix: str, norms):
  """Our parameters of one layer from HF tensors `t` under `prefix`."""
  d, h, linear = cfg.emb_dim, cfg.head_dim, family.torch_linear
  heads = {"query": cfg.num_heads, "key": cfg.num_kv_heads,
           "value": cfg.num_kv_heads}
  layer = {ours: {"scale": t[prefix + f"{hf}.weight"]}
           for ours, hf in norms.items()}
  layer["self_attention"] = {
      ours: {"kernel": linear(t[prefix + f"self_attn.{hf}.weight"]).reshape(
          d, heads[ours], h)} for ours, hf in _ATTENTION.items()}
  layer["self_attention"]["out"] = {"kernel": linear(
      t[prefix + "self_attn.o_proj.weight"]).reshape(cfg.num_heads, h, d)}
  layer["mlp"] = {ours: {"kernel": linear(t[prefix + f"mlp.{hf}.weight"])}
                  for ours, hf in _MLP.items()}
  return layer


def hf_layer_to(cfg, layer, prefix: str, norms):
  """HF tensors of one layer of ours under `prefix` (`hf_layer_from`'s
  inverse)."""
  d, linear = cfg.emb_dim, family.torch_linear
  attn = layer["self_attention"]
  t = {prefix + f"{hf}.weight": layer[ours]["scale"]
       for ours, hf in norms.items()}
  t.update({prefix + f"self_attn.{hf}.weight": linear(
      attn[ours]["kernel"].reshape(d, -1)) for ours, hf in _ATTENTION.items()})
  t[prefix + "self_attn.o_proj.weight"] = linear(
      attn["out"]["kernel"].reshape(-1, d))
  t.update({prefix + f"mlp.{hf}.weight": linear(layer["mlp"][ours]["kernel"])
            for ours, hf in _MLP.items()})
  return t


def tensor_shapes(cfg, tensors):
  d = cfg.emb_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d),
            "model.norm.weight": (d,)}
  if not cfg.tie_embeddings or "lm_head.weight" in tensors:
    # A tied model's file may carry an equal copy of the embedding.
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    shapes.update(hf_layer_shapes(cfg, f"model.layers.{i}.", _NORMS))
  return shapes


def from_hf(cfg, t):
  dec = {"token_embedder": {"embedding": t["model.embed_tokens.weight"]},
         "decoder_norm": {"scale": t["model.norm.weight"]}}
  if not cfg.tie_embeddings:
    dec["logits_dense"] = {"kernel": family.torch_linear(t["lm_head.weight"])}
  for i in range(cfg.num_layers):
    dec[f"layers_{i}"] = hf_layer_from(cfg, t, f"model.layers.{i}.", _NORMS)
  return {"decoder": dec}


def to_hf(cfg, params):
  dec = params["decoder"]
  t = {"model.embed_tokens.weight": dec["token_embedder"]["embedding"],
       "model.norm.weight": dec["decoder_norm"]["scale"]}
  if not cfg.tie_embeddings:
    t["lm_head.weight"] = family.torch_linear(dec["logits_dense"]["kernel"])
  for i in range(cfg.num_layers):
    t.update(hf_layer_to(cfg, dec[f"layers_{i}"], f"model.layers.{i}.",
                         _NORMS))
  return t


FAMILY = family.Family(
    name="llama",
    summary="Llama 2/3-style decoder-only (RMSNorm, rotary, grouped-query "
    "attention, SwiGLU); HF LlamaForCausalLM.",
    config_cls=LlamaConfig, module_cls=Llama, kind=family.DECODER_ONLY,
    presets=LLAMA_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="llama",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=tensor_shapes, from_hf=from_hf, to_hf=to_hf,
        reconcile=reconcile,
        ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
                 r"model\.rotary_emb\.inv_freq")))
