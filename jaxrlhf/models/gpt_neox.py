"""GPT-NeoX / Pythia-style decoder-only transformer.

LayerNorm with bias, partial rotary embeddings (the first `rotary_pct` of each
head's channels), biases on every projection, exact-erf GELU MLP, untied
output layer (HF's `embed_out`), and the parallel residual of GPT-J/NeoX:

  parallel:    x + attn(ln_1(x)) + mlp(ln_2(x))
  sequential:  h = x + attn(ln_1(x));  h + mlp(ln_2(h))

Numerics follow Hugging Face's `GPTNeoXForCausalLM`. The PPO implementation-
details paper ("The N+ implementation details of RLHF with PPO") trains
Pythia 1b, 2.8b and 6.9b; their presets are below.

Call signature (common to the decoder-only families):

  logits = GPTNeoX(config).apply({'params': params}, tokens, positions,
                                 attention_mask)
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import layers

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
  """Hyper-parameters of a GPT-NeoX-style model (t5x-style field names)."""
  vocab_size: int = 50304
  emb_dim: int = 2048
  num_heads: int = 8
  num_layers: int = 16
  mlp_dim: int = 8192
  # Fraction of each head's channels that are rotated (Pythia: 0.25).
  rotary_pct: float = 0.25
  rope_theta: float = 10000.0
  use_parallel_residual: bool = True
  norm_epsilon: float = 1e-5
  # HF hidden_act: 'gelu' is the exact erf form Pythia uses.
  mlp_activation: str = "gelu"
  max_length: int = 2048
  # Compute dtype; parameters are always float32.
  dtype: Any = "float32"
  scan_layers: bool = False
  remat_policy: str = "none"
  attention_impl: str = "xla"
  # GPT-NeoX never ties; the field exists for the shared decoder code.
  tie_embeddings: bool = False

  def __post_init__(self):
    if self.emb_dim % self.num_heads:
      raise ValueError(f"GPTNeoXConfig: emb_dim={self.emb_dim} must be a "
                       f"multiple of num_heads={self.num_heads}.")
    if self.rotary_dim % 2:
      raise ValueError(
          f"GPTNeoXConfig: rotary_pct={self.rotary_pct} of head_dim="
          f"{self.head_dim} gives an odd rotary dimension {self.rotary_dim}.")
    if self.tie_embeddings:
      raise ValueError("GPTNeoXConfig: tie_embeddings=True is not a GPT-NeoX "
                       "model (its embed_out is separate).")
    layers.check_choice(self.mlp_activation, layers.ACTIVATIONS,
                        "GPTNeoXConfig.mlp_activation")
    layers.check_choice(self.attention_impl, layers.ATTENTION_IMPLS,
                        "GPTNeoXConfig.attention_impl")
    layers.check_choice(self.remat_policy, layers.REMAT_POLICIES,
                        "GPTNeoXConfig.remat_policy")
    layers.check_dtype(self.dtype, "GPTNeoXConfig.dtype")

  @property
  def head_dim(self) -> int:
    return self.emb_dim // self.num_heads

  @property
  def rotary_dim(self) -> int:
    # int() truncation as HF's `int(head_size * rotary_pct)`.
    return int(self.head_dim * self.rotary_pct)

  @classmethod
  def preset(cls, name: str, **overrides) -> "GPTNeoXConfig":
    """A published size by name (see PYTHIA_PRESETS), fields overridden."""
    if name not in PYTHIA_PRESETS:
      raise ValueError(f"Unknown GPT-NeoX preset {name!r}; choose one of "
                       f"{sorted(PYTHIA_PRESETS)}.")
    return dataclasses.replace(PYTHIA_PRESETS[name], **overrides)


def _pythia(emb_dim, num_layers, num_heads, vocab_size=50304):
  return GPTNeoXConfig(vocab_size=vocab_size, emb_dim=emb_dim,
                       num_heads=num_heads, num_layers=num_layers,
                       mlp_dim=4 * emb_dim)


# Pythia suite dimensions (Biderman et al. 2023, Table 1; the config.json of
# each EleutherAI/pythia-* checkpoint).
PYTHIA_PRESETS = {
    "tiny": GPTNeoXConfig(vocab_size=128, emb_dim=32, num_heads=2,
                          num_layers=2, mlp_dim=128, max_length=512),
    "pythia-70m": _pythia(512, 6, 8),
    "pythia-160m": _pythia(768, 12, 12),
    "pythia-410m": _pythia(1024, 24, 16),
    "pythia-1b": _pythia(2048, 16, 8),
    "pythia-1.4b": _pythia(2048, 24, 16),
    "pythia-2.8b": _pythia(2560, 32, 32),
    "pythia-6.9b": _pythia(4096, 32, 32, vocab_size=50432),
    "pythia-12b": _pythia(5120, 36, 40, vocab_size=50688),
}


class GPTNeoXBlock(nn.Module):
  """One GPT-NeoX layer; returns (x, None) for nn.scan."""
  config: GPTNeoXConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = functools.partial(layers.LayerNorm, cfg.norm_epsilon, dtype)
    h = norm(name="pre_self_attention_layer_norm")(x)
    attn = layers.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
        rope_theta=cfg.rope_theta, use_bias=True, dtype=dtype,
        attention_impl=cfg.attention_impl,
        name="self_attention")(h, positions, mask, cache_index)
    mlp = layers.Mlp(cfg.mlp_dim, (cfg.mlp_activation,), use_bias=True,
                     dtype=dtype, name="mlp")
    if cfg.use_parallel_residual:
      x = x + attn + mlp(norm(name="pre_mlp_layer_norm")(x))
    else:
      x = x + attn
      x = x + mlp(norm(name="pre_mlp_layer_norm")(x))
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class GPTNeoX(layers.CausalLM):
  """GPT-NeoX-style causal LM; parameters under 'decoder' (t5x layout)."""
  config: GPTNeoXConfig
  block_cls = GPTNeoXBlock

  def final_norm(self):
    return functools.partial(layers.LayerNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))
