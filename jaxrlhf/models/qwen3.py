"""Qwen3 dense decoder-only transformer (Qwen Team, 2025: "Qwen3 Technical
Report").

Llama's layer (`llama.py`) with an RMSNorm over each head's channels of the
queries and of the keys before the rotation (q/k norms), no biases, heads
wider than emb_dim / num_heads (head_dim 128 throughout), a rotary base of
1,000,000 and the output layer tied to the embedding up to 4B. The window
options are Qwen2's (`qwen2.hf_window`). Numerics follow Hugging Face's
`Qwen3ForCausalLM`, whose checkpoints `FAMILY.hf` maps.
"""

import dataclasses
import functools

import jax.numpy as jnp

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models import qwen2
from jaxrlhf.models.layers import normalizations


@dataclasses.dataclass(frozen=True)
class Qwen3Config(family.LayerTypesConfig):
  """Hyper-parameters of a Qwen3 dense model: the shared fields of
  `family.LayerTypesConfig`, with Qwen3 0.6B's values as defaults."""
  vocab_size: int = 151936
  emb_dim: int = 1024
  num_heads: int = 16
  num_kv_heads: int = 8
  num_layers: int = 28
  head_dim: int = 128
  mlp_dim: int = 3072
  rope_theta: float = 1_000_000.0
  norm_epsilon: float = 1e-6
  tie_embeddings: bool = True
  max_length: int = 40960

  @classmethod
  def preset(cls, name: str, **overrides) -> "Qwen3Config":
    """A published size by name (see QWEN3_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of Qwen/Qwen3-*.
QWEN3_PRESETS = {
    # head_dim (16) is not emb_dim / num_heads (8), as in every Qwen3.
    "tiny": Qwen3Config(vocab_size=128, emb_dim=32, num_heads=4,
                        num_kv_heads=2, num_layers=2, head_dim=16, mlp_dim=64,
                        max_length=512),
    "qwen3-0.6b": Qwen3Config(),
    "qwen3-1.7b": Qwen3Config(emb_dim=2048, num_heads=16, num_kv_heads=8,
                              num_layers=28, mlp_dim=6144),
    "qwen3-4b": Qwen3Config(emb_dim=2560, num_heads=32, num_kv_heads=8,
                            num_layers=36, mlp_dim=9728),
    "qwen3-8b": Qwen3Config(emb_dim=4096, num_heads=32, num_kv_heads=8,
                            num_layers=36, mlp_dim=12288,
                            tie_embeddings=False),
}


class Qwen3Block(llama.LlamaBlock):
  """Llama's layer with q/k norms (RMSNorm over each head's channels)."""

  def attention_options(self):
    cfg = self.config
    return {"qk_norm": lambda name: normalizations.RMSNorm(
        cfg.norm_epsilon, jnp.dtype(cfg.dtype), axis_name="kv", name=name)}


class Qwen3(llama.Llama):
  """Qwen3 causal LM; parameters under 'decoder' (t5x layout)."""
  config: Qwen3Config
  block_cls = Qwen3Block


def from_run_config(model_cfg, vocab_size: int) -> Qwen3Config:
  """`config.model` (arch 'qwen3') -> Qwen3Config."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        llama.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's Qwen3ForCausalLM.

HF_ARCHITECTURE = "Qwen3ForCausalLM"


def config_from_hf(hf) -> Qwen3Config:
  if hf.get("attention_bias"):
    family.unsupported(HF_ARCHITECTURE, "attention_bias=true")
  return qwen2.config_from_hf(hf, Qwen3Config, HF_ARCHITECTURE)


def config_to_hf(config: Qwen3Config):
  return {**llama.hf_config_dict(config, HF_ARCHITECTURE, "qwen3"),
          **qwen2.hf_window_dict(config), "attention_bias": False}


_LAYER = {"qk_norm": True}

FAMILY = family.Family(
    name="qwen3",
    summary="Qwen3 dense decoder-only (Llama's layer with q/k norms, wide "
    "heads); HF Qwen3ForCausalLM.",
    config_cls=Qwen3Config, module_cls=Qwen3, kind=family.DECODER_ONLY,
    presets=QWEN3_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="qwen3",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=functools.partial(llama.tensor_shapes, **_LAYER),
        from_hf=functools.partial(llama.from_hf, **_LAYER),
        to_hf=functools.partial(llama.to_hf, **_LAYER),
        reconcile=llama.reconcile, ignored=llama.HF_IGNORED))
