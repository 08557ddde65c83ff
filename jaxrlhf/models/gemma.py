"""Gemma 2 decoder-only transformer (Gemma Team, 2024: "Gemma 2: Improving
Open Language Models at a Practical Size").

What sets it apart from Llama, all from the shared blocks of
`jaxrlhf.models.layers` but the norm:
- RMSNorm with a zero-initialised offset scale, x_hat * (1 + w), the product
  taken in float32 before the cast (`GemmaRMSNorm`);
- four norms per layer: before and after attention, before and after the
  MLP (the "post" norms normalise each sub-layer's output before the
  residual add);
- GeGLU MLP (tanh-approximated GELU gate);
- embeddings multiplied by sqrt(emb_dim); the output layer tied to them;
- attention logits scaled by query_pre_attn_scalar ** -0.5 (not
  head_dim ** -0.5) and soft-capped, cap * tanh(x / cap), as are the output
  logits;
- local (sliding-window) and global attention alternating, the first layer
  local.

Layers come in (local, global) pairs: one block of the layer stack is a
pair (`GemmaPair`, parameters `layers_i/local/...` and `layers_i/global/...`),
so that `scan_layers` scans identical blocks; the model therefore needs an
even number of layers (every published Gemma 2 has one). Numerics follow
Hugging Face's `Gemma2ForCausalLM` (`FAMILY.hf` maps its checkpoints).

Call signature (common to the decoder-only families):

  logits = Gemma(config).apply({'params': params}, tokens, positions,
                               attention_mask)
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
from jaxrlhf.models import llama

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """Hyper-parameters of a Gemma 2 model (t5x-style field names)."""
  vocab_size: int = 256000
  emb_dim: int = 2304
  num_heads: int = 8
  num_kv_heads: int = 4
  num_layers: int = 26
  head_dim: int = 256
  mlp_dim: int = 9216
  rope_theta: float = 10000.0
  norm_epsilon: float = 1e-6
  # Attention logits are multiplied by query_pre_attn_scalar ** -0.5.
  query_pre_attn_scalar: float = 256.0
  # Soft caps (cap * tanh(x / cap)) of the attention and output logits.
  attn_logit_softcap: Optional[float] = 50.0
  final_logit_softcap: Optional[float] = 30.0
  # Keys a local layer's queries see: fewer than this many positions back.
  sliding_window: int = 4096
  max_length: int = 8192
  dtype: Any = "float32"
  scan_layers: bool = False
  remat_policy: str = "none"
  # Only 'xla' soft-caps attention logits; the fused kernels need
  # attn_logit_softcap None.
  attention_impl: str = "xla"
  # Gemma ties its output layer; the field exists for the shared decoder.
  tie_embeddings: bool = True
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"GemmaConfig: num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.num_layers % 2:
      raise ValueError(
          f"GemmaConfig: num_layers={self.num_layers} must be even (layers "
          "come in local/global pairs).")
    if not self.tie_embeddings:
      raise ValueError("GemmaConfig: tie_embeddings=False is not a Gemma "
                       "model (its output layer is the embedding).")
    if self.attention_impl != "xla" and self.attn_logit_softcap is not None:
      raise ValueError(
          f"GemmaConfig: attention_impl={self.attention_impl!r} cannot "
          "soft-cap attention logits (attn_logit_softcap); use 'xla'.")
    checks.check_choice("GemmaConfig", "attention_impl",
                        self.attention_impl, layers.ATTENTION_IMPLS)
    checks.check_choice("GemmaConfig", "remat_policy",
                        self.remat_policy, layers.REMAT_POLICIES)
    layers.check_dtype(self.dtype, "GemmaConfig.dtype")

  @classmethod
  def preset(cls, name: str, **overrides) -> "GemmaConfig":
    """A published size by name (see GEMMA_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of google/gemma-2-*.
GEMMA_PRESETS = {
    "tiny": GemmaConfig(vocab_size=128, emb_dim=32, num_heads=4,
                        num_kv_heads=2, num_layers=2, head_dim=8, mlp_dim=64,
                        query_pre_attn_scalar=8.0, sliding_window=4,
                        max_length=512),
    "gemma2-2b": GemmaConfig(emb_dim=2304, num_heads=8, num_kv_heads=4,
                             num_layers=26, head_dim=256, mlp_dim=9216,
                             query_pre_attn_scalar=256.0),
    "gemma2-9b": GemmaConfig(emb_dim=3584, num_heads=16, num_kv_heads=8,
                             num_layers=42, head_dim=256, mlp_dim=14336,
                             query_pre_attn_scalar=256.0),
    "gemma2-27b": GemmaConfig(emb_dim=4608, num_heads=32, num_kv_heads=16,
                              num_layers=46, head_dim=128, mlp_dim=36864,
                              query_pre_attn_scalar=144.0),
}


class GemmaRMSNorm(nn.Module):
  """x / sqrt(mean(x^2) + eps) * (1 + scale), in float32, then cast; the
  scale starts at 0 (Hugging Face's Gemma2RMSNorm)."""
  epsilon: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.with_logical_partitioning(
        nn.initializers.zeros, ("embed",)), (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1.0 + scale)).astype(self.dtype)


class GemmaLayer(nn.Module):
  """One layer: normed attention, normed again, residual; the same for the
  MLP."""
  config: GemmaConfig
  sliding_window: Optional[int] = None

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None) -> Array:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = functools.partial(GemmaRMSNorm, cfg.norm_epsilon, dtype)
    h = norm(name="pre_self_attention_layer_norm")(x)
    h = layers.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta, use_bias=False, dtype=dtype,
        attention_impl=cfg.attention_impl,
        query_scale=cfg.query_pre_attn_scalar ** -0.5,
        logit_softcap=cfg.attn_logit_softcap,
        sliding_window=self.sliding_window,
        name="self_attention")(h, positions, mask, cache_index)
    x = x + norm(name="post_self_attention_layer_norm")(h)
    h = norm(name="pre_mlp_layer_norm")(x)
    h = layers.Mlp(cfg.mlp_dim, ("gelu_pytorch_tanh", "linear"),
                   use_bias=False, dtype=dtype, name="mlp")(h)
    x = x + norm(name="post_mlp_layer_norm")(h)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class GemmaPair(nn.Module):
  """A local (sliding-window) layer, then a global one; returns (x, None)
  for the layer stack."""
  config: GemmaConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None):
    x = GemmaLayer(self.config, self.config.sliding_window, name="local")(
        x, positions, mask, cache_index)
    x = GemmaLayer(self.config, None, name="global")(
        x, positions, mask, cache_index)
    return x, None


class Gemma(layers.CausalLM):
  """Gemma 2 causal LM; parameters under 'decoder' (t5x layout)."""
  config: GemmaConfig
  block_cls = GemmaPair

  def final_norm(self):
    return functools.partial(GemmaRMSNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))

  def decoder_options(self):
    return {"num_blocks": self.config.num_layers // 2,
            "embedding_multiplier": float(np.sqrt(self.config.emb_dim)),
            "final_logit_softcap": self.config.final_logit_softcap}


def from_run_config(model_cfg, vocab_size: int) -> GemmaConfig:
  """`config.model` (arch 'gemma') -> GemmaConfig."""
  family.refuse_fields(model_cfg, "gemma", {
      "mlp": ("gated-gelu", "has a GeGLU MLP (config.model.mlp's default)."),
      "logits_via_embedding": (False, "always ties its output layer; leave "
                               "config.model.logits_via_embedding at its "
                               "default."),
      "dropout_rate": (0.0, "has no dropout.")})
  return FAMILY.preset(model_cfg.size,
                       **family.decoder_only_overrides(model_cfg, vocab_size))


# ----------------------------------------------------------------------------
# Hugging Face's Gemma2ForCausalLM.

HF_ARCHITECTURE = "Gemma2ForCausalLM"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)
# HF layer i -> our pair i // 2, its local (even i) or global (odd i) layer.
_SIDES = ("local", "global")


def config_from_hf(hf) -> GemmaConfig:
  get = functools.partial(family.hf_get, hf)
  act = get("hidden_activation", get("hidden_act", "gelu_pytorch_tanh"))
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    _unsupported(f"hidden_activation={act!r} (only the tanh GELU)")
  if hf.get("attention_bias"):
    _unsupported("attention_bias=true")
  if not get("tie_word_embeddings", True):
    _unsupported("tie_word_embeddings=false")
  num_layers = get("num_hidden_layers")
  alternating = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(num_layers)]
  if hf.get("layer_types") not in (None, alternating):
    _unsupported(f"layer_types={hf['layer_types']} (only local/global "
                 "alternating, local first)")
  rope = family.rope_parameters(hf)
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    _unsupported(f"rope scaling {rope}")
  num_heads = get("num_attention_heads")
  return GemmaConfig(
      vocab_size=get("vocab_size"), emb_dim=get("hidden_size"),
      num_heads=num_heads,
      num_kv_heads=get("num_key_value_heads", num_heads),
      num_layers=num_layers, head_dim=get("head_dim"),
      mlp_dim=get("intermediate_size"),
      rope_theta=float(get("rope_theta", rope.get("rope_theta", 10000.0))),
      norm_epsilon=float(get("rms_norm_eps", 1e-6)),
      query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
      attn_logit_softcap=hf.get("attn_logit_softcapping"),
      final_logit_softcap=hf.get("final_logit_softcapping"),
      sliding_window=get("sliding_window"),
      max_length=get("max_position_embeddings", 8192),
      **family.special_token_ids(hf))


def config_to_hf(config: GemmaConfig):
  return {
      "architectures": [HF_ARCHITECTURE], "model_type": "gemma2",
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rope_theta,
      "query_pre_attn_scalar": config.query_pre_attn_scalar,
      "attn_logit_softcapping": config.attn_logit_softcap,
      "final_logit_softcapping": config.final_logit_softcap,
      "sliding_window": config.sliding_window,
      "max_position_embeddings": config.max_length,
      "tie_word_embeddings": True, "attention_bias": False,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }


# The norms of a Gemma layer, ours -> HF's; its attention and MLP have
# Llama's names (`llama.hf_layer_*`).
_NORMS = {"pre_self_attention_layer_norm": "input_layernorm",
          "post_self_attention_layer_norm": "post_attention_layernorm",
          "pre_mlp_layer_norm": "pre_feedforward_layernorm",
          "post_mlp_layer_norm": "post_feedforward_layernorm"}


def tensor_shapes(cfg, tensors):
  d = cfg.emb_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d),
            "model.norm.weight": (d,)}
  if "lm_head.weight" in tensors:  # an (equal) copy of the embedding
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    shapes.update(llama.hf_layer_shapes(cfg, f"model.layers.{i}.", _NORMS))
  return shapes


def reconcile(config, tensors):
  head = tensors.get("lm_head.weight")
  if head is not None and not np.array_equal(
      head, tensors["model.embed_tokens.weight"]):
    _unsupported("an lm_head.weight that differs from the embedding")
  return config, tensors


def from_hf(cfg, t):
  dec = {"token_embedder": {"embedding": t["model.embed_tokens.weight"]},
         "decoder_norm": {"scale": t["model.norm.weight"]}}
  for i in range(cfg.num_layers):
    dec.setdefault(f"layers_{i // 2}", {})[_SIDES[i % 2]] = (
        llama.hf_layer_from(cfg, t, f"model.layers.{i}.", _NORMS))
  return {"decoder": dec}


def to_hf(cfg, params):
  dec = params["decoder"]
  t = {"model.embed_tokens.weight": dec["token_embedder"]["embedding"],
       "model.norm.weight": dec["decoder_norm"]["scale"]}
  for i in range(cfg.num_layers):
    t.update(llama.hf_layer_to(cfg, dec[f"layers_{i // 2}"][_SIDES[i % 2]],
                               f"model.layers.{i}.", _NORMS))
  return t


FAMILY = family.Family(
    name="gemma",
    summary="Gemma 2 decoder-only (RMSNorm with 1 + scale, GeGLU, sqrt(d) "
    "embeddings, soft-capped logits, local/global attention); HF "
    "Gemma2ForCausalLM.",
    config_cls=GemmaConfig, module_cls=Gemma, kind=family.DECODER_ONLY,
    presets=GEMMA_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers // 2),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="gemma2",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=tensor_shapes, from_hf=from_hf, to_hf=to_hf,
        reconcile=reconcile))
