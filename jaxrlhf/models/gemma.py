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
- local (sliding-window) and global layers, as the config's `layer_types`
  say: by default alternating, the first layer local.

Each layer is `layers_i` whatever its type (the type is a value of the
config, `family.LayerTypesConfig`: the shared attention looks up the
layer's window by its index), so any number of layers and any pattern load
from Hugging Face and `scan_layers` scans one layer body. Numerics follow
Hugging Face's `Gemma2ForCausalLM` (`FAMILY.hf` maps its checkpoints).
Gemma 3 (`gemma3.py`) is this model with q/k norms and its own rotary
bases and pattern.

Call signature (common to the decoder-only families):

  logits = Gemma(config).apply({'params': params}, tokens, positions,
                               attention_mask)
"""

import dataclasses
import functools
from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GemmaConfig(family.LayerTypesConfig):
  """Hyper-parameters of a Gemma 2 model: the shared fields of
  `family.LayerTypesConfig` (with Gemma 2 2B's values as defaults) and its
  own."""
  vocab_size: int = 256000
  emb_dim: int = 2304
  num_heads: int = 8
  num_kv_heads: int = 4
  num_layers: int = 26
  head_dim: int = 256
  mlp_dim: int = 9216
  norm_epsilon: float = 1e-6
  max_length: int = 8192
  # Gemma ties its output layer; the field exists for the shared decoder.
  tie_embeddings: bool = True
  # Attention logits are multiplied by query_pre_attn_scalar ** -0.5 (an
  # integer: transformers 5 refuses a config.json whose value is a float).
  query_pre_attn_scalar: int = 256
  # Soft caps (cap * tanh(x / cap)) of the attention and output logits.
  attn_logit_softcap: Optional[float] = 50.0
  final_logit_softcap: Optional[float] = 30.0
  # Keys a local layer's queries see: fewer than this many positions back.
  sliding_window: Optional[int] = 4096

  def default_layer_types(self):
    """Local and global layers alternating, the first local."""
    return tuple(attentions.SLIDING_ATTENTION if i % 2 == 0
                 else attentions.FULL_ATTENTION for i in range(self.num_layers))

  def check(self):
    super().check()
    name = type(self).__name__
    scalar = self.query_pre_attn_scalar
    if (not isinstance(scalar, (int, np.integer)) or isinstance(scalar, bool)
        or scalar <= 0):
      raise ValueError(f"{name}.query_pre_attn_scalar must be a positive "
                       f"integer, got {scalar!r}.")
    if not self.tie_embeddings:
      raise ValueError(f"{name}: tie_embeddings=False is not a Gemma "
                       "model (its output layer is the embedding).")
    if (self.attention_impl not in attentions.SOFTCAP_IMPLS
        and self.attn_logit_softcap is not None):
      raise ValueError(
          f"{name}: attention_impl={self.attention_impl!r} cannot "
          "soft-cap attention logits (attn_logit_softcap); use one of "
          f"{list(attentions.SOFTCAP_IMPLS)}.")

  @classmethod
  def preset(cls, name: str, **overrides) -> "GemmaConfig":
    """A published size by name (see GEMMA_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of google/gemma-2-*.
GEMMA_PRESETS = {
    "tiny": GemmaConfig(vocab_size=128, emb_dim=32, num_heads=4,
                        num_kv_heads=2, num_layers=2, head_dim=8, mlp_dim=64,
                        query_pre_attn_scalar=8, sliding_window=4,
                        max_length=512),
    "gemma2-2b": GemmaConfig(emb_dim=2304, num_heads=8, num_kv_heads=4,
                             num_layers=26, head_dim=256, mlp_dim=9216,
                             query_pre_attn_scalar=256),
    "gemma2-9b": GemmaConfig(emb_dim=3584, num_heads=16, num_kv_heads=8,
                             num_layers=42, head_dim=256, mlp_dim=14336,
                             query_pre_attn_scalar=256),
    "gemma2-27b": GemmaConfig(emb_dim=4608, num_heads=32, num_kv_heads=16,
                              num_layers=46, head_dim=128, mlp_dim=36864,
                              query_pre_attn_scalar=144),
}


class GemmaRMSNorm(nn.Module):
  """x / sqrt(mean(x^2) + eps) * (1 + scale), in float32, then cast; the
  scale starts at 0 (Hugging Face's Gemma2RMSNorm). `axis_name` is the
  scale's logical axis ("kv" for Gemma 3's norms of each head)."""
  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.with_logical_partitioning(
        nn.initializers.zeros, (self.axis_name,)), (x.shape[-1],),
                       jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (normed * (1.0 + scale)).astype(self.dtype)


class GemmaLayer(nn.Module):
  """One layer: normed attention, normed again, residual; the same for the
  MLP. Returns (x, None) for the layer stack; `layer` is its index (its
  type, window and rotary: `family.LayerTypesConfig.layer_attention`).
  Gemma 3's layer overrides `attention_options` (q/k norms)."""
  config: Any

  def attention_options(self) -> Dict[str, Any]:
    """Further `attentions.Attention` fields of the family."""
    return {}

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None, layer=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = functools.partial(GemmaRMSNorm, cfg.norm_epsilon, dtype)
    h = norm(name="pre_self_attention_layer_norm")(x)
    h = attentions.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.head_dim,
        layer_kinds=cfg.layer_attention(), dtype=dtype,
        attention_impl=cfg.attention_impl,
        query_scale=cfg.query_pre_attn_scalar ** -0.5,
        logit_softcap=cfg.attn_logit_softcap, name="self_attention",
        **self.attention_options())(h, positions, mask, cache_index, layer)
    x = x + norm(name="post_self_attention_layer_norm")(h)
    h = norm(name="pre_mlp_layer_norm")(x)
    h = linears.Mlp(cfg.mlp_dim, ("gelu_pytorch_tanh", "linear"),
                    use_bias=False, dtype=dtype, name="mlp")(h)
    x = x + norm(name="post_mlp_layer_norm")(h)
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class Gemma(decoders.CausalLM):
  """Gemma 2 causal LM; parameters under 'decoder' (t5x layout)."""
  config: GemmaConfig
  block_cls = GemmaLayer

  def final_norm(self):
    return functools.partial(GemmaRMSNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))

  def decoder_options(self):
    return {"index_layers": self.config.layers_differ(),
            "embedding_multiplier": float(np.sqrt(self.config.emb_dim)),
            "final_logit_softcap": self.config.final_logit_softcap}


# The config.model fields a Gemma refuses (`family.decoder_from_run_config`).
RUN_CONFIG_REFUSED = {
    "mlp": ("gated-gelu", "has a GeGLU MLP (config.model.mlp's default)."),
    "logits_via_embedding": (False, "always ties its output layer; leave "
                             "config.model.logits_via_embedding at its "
                             "default."),
    "dropout_rate": (0.0, "has no dropout.")}


def from_run_config(model_cfg, vocab_size: int) -> GemmaConfig:
  """`config.model` (arch 'gemma') -> GemmaConfig."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's Gemma2ForCausalLM.

HF_ARCHITECTURE = "Gemma2ForCausalLM"


def hf_config_fields(hf, architecture: str) -> Dict[str, Any]:
  """The `GemmaConfig` fields (but the rotary and the layer types) of a
  Gemma 2 or 3 config.json."""
  get = functools.partial(family.hf_get, hf)
  act = get("hidden_activation", get("hidden_act", "gelu_pytorch_tanh"))
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    family.unsupported(architecture,
                       f"hidden_activation={act!r} (only the tanh GELU)")
  if hf.get("attention_bias"):
    family.unsupported(architecture, "attention_bias=true")
  if not get("tie_word_embeddings", True):
    family.unsupported(architecture, "tie_word_embeddings=false")
  num_heads = get("num_attention_heads")
  return dict(
      vocab_size=get("vocab_size"), emb_dim=get("hidden_size"),
      num_heads=num_heads,
      num_kv_heads=get("num_key_value_heads", num_heads),
      num_layers=get("num_hidden_layers"), head_dim=get("head_dim"),
      mlp_dim=get("intermediate_size"),
      norm_epsilon=float(get("rms_norm_eps", 1e-6)),
      query_pre_attn_scalar=family.hf_int(hf, "query_pre_attn_scalar"),
      attn_logit_softcap=hf.get("attn_logit_softcapping"),
      final_logit_softcap=hf.get("final_logit_softcapping"),
      sliding_window=family.hf_int(hf, "sliding_window"),
      max_length=get("max_position_embeddings", 8192),
      **family.special_token_ids(hf))


def hf_config_dict(config, architecture: str, model_type: str
                   ) -> Dict[str, Any]:
  """config.json of a Gemma 2 or 3 config (`hf_config_fields`' inverse,
  with the layer types); a family adds its rotary keys."""
  return {
      "architectures": [architecture], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": config.norm_epsilon,
      "query_pre_attn_scalar": int(config.query_pre_attn_scalar),
      "attn_logit_softcapping": config.attn_logit_softcap,
      "final_logit_softcapping": config.final_logit_softcap,
      "sliding_window": config.sliding_window,
      "layer_types": list(config.attention_types),
      "max_position_embeddings": config.max_length,
      "tie_word_embeddings": True, "attention_bias": False,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }


def config_from_hf(hf) -> GemmaConfig:
  rope = family.rope_parameters(hf)
  config = GemmaConfig(
      rope_theta=float(family.hf_get(hf, "rope_theta",
                                     rope.get("rope_theta", 10000.0))),
      rope_scaling=family.rope_scaling_from_hf(rope, HF_ARCHITECTURE),
      **hf_config_fields(hf, HF_ARCHITECTURE))
  # transformers' Gemma2Config defaults to our pattern when it has none.
  return config.with_layer_types(hf.get("layer_types"))


def config_to_hf(config: GemmaConfig):
  return {**hf_config_dict(config, HF_ARCHITECTURE, "gemma2"),
          "rope_theta": config.rope_theta,
          "rope_scaling": family.rope_scaling_to_hf(config.rope_scaling)}


# The norms of a Gemma layer, ours -> HF's; its attention and MLP have
# Llama's names (`llama.tensor_shapes` and the rest map the layers).
NORMS = {"pre_self_attention_layer_norm": "input_layernorm",
         "post_self_attention_layer_norm": "post_attention_layernorm",
         "pre_mlp_layer_norm": "pre_feedforward_layernorm",
         "post_mlp_layer_norm": "post_feedforward_layernorm"}


def tied_output_reconcile(architecture: str):
  """`HFMapping.reconcile` of a Gemma: a file's lm_head.weight must be the
  embedding (transformers ties it; a different one is another model)."""
  def reconcile(config, tensors):
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(
        head, tensors["model.embed_tokens.weight"]):
      family.unsupported(architecture, "an lm_head.weight that differs from "
                         "the embedding")
    return config, tensors
  return reconcile


FAMILY = family.Family(
    name="gemma",
    summary="Gemma 2 decoder-only (RMSNorm with 1 + scale, GeGLU, sqrt(d) "
    "embeddings, soft-capped logits, local/global attention); HF "
    "Gemma2ForCausalLM.",
    config_cls=GemmaConfig, module_cls=Gemma, kind=family.DECODER_ONLY,
    presets=GEMMA_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="gemma2",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=functools.partial(llama.tensor_shapes, norms=NORMS),
        from_hf=functools.partial(llama.from_hf, norms=NORMS),
        to_hf=functools.partial(llama.to_hf, norms=NORMS),
        reconcile=tied_output_reconcile(HF_ARCHITECTURE)))
