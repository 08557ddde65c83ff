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

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even "
                       "(rotary embeddings rotate channel pairs).")
    layers.check_choice(self.attention_impl, layers.ATTENTION_IMPLS,
                        "LlamaConfig.attention_impl")
    layers.check_choice(self.remat_policy, layers.REMAT_POLICIES,
                        "LlamaConfig.remat_policy")
    layers.check_dtype(self.dtype, "LlamaConfig.dtype")

  @classmethod
  def preset(cls, name: str, **overrides) -> "LlamaConfig":
    """A published size by name (see LLAMA_PRESETS), fields overridden."""
    if name not in LLAMA_PRESETS:
      raise ValueError(f"Unknown Llama preset {name!r}; choose one of "
                       f"{sorted(LLAMA_PRESETS)}.")
    return dataclasses.replace(LLAMA_PRESETS[name], **overrides)


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
