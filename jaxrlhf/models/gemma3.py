"""Gemma 3 text decoder (Gemma Team, 2025: "Gemma 3 Technical Report").

Gemma 2 (`gemma.py`: its layer, norms, GeGLU MLP, sqrt(emb_dim) embeddings
and tied output) with
- an RMSNorm (1 + scale) over each head's channels of the queries and the
  keys before the rotation (q/k norms), in place of Gemma 2's soft-capped
  attention logits (no soft caps by default);
- five local (sliding-window) layers to one global layer: layer i is global
  when (i + 1) % 6 == 0 (Hugging Face's `sliding_window_pattern`, or its
  `layer_types`);
- a rotary base per layer type: 10,000 for the local layers, 1,000,000 for
  the global ones, whose frequencies alone are rescaled (linear, factor 8,
  in the 4B and larger models).

The presets are the text decoders of the published sizes (the 4B and 12B
checkpoints also hold a vision tower, which this family does not model).
Numerics follow Hugging Face's `Gemma3ForCausalLM`, whose checkpoints
`FAMILY.hf` maps.
"""

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp

from jaxrlhf.models import family
from jaxrlhf.models import gemma
from jaxrlhf.models import llama
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import rotary


@dataclasses.dataclass(frozen=True)
class Gemma3Config(gemma.GemmaConfig):
  """Hyper-parameters of a Gemma 3 text model: `gemma.GemmaConfig`'s
  (with Gemma 3 1B's values as defaults) and the local layers' rotary
  base."""
  vocab_size: int = 262144
  emb_dim: int = 1152
  num_heads: int = 4
  num_kv_heads: int = 1
  num_layers: int = 26
  head_dim: int = 256
  mlp_dim: int = 6912
  max_length: int = 32768
  # The global layers' rotary base (rope_scaling rescales them alone).
  rope_theta: float = 1_000_000.0
  # The local (sliding) layers' rotary base, never rescaled.
  local_rope_theta: float = 10_000.0
  query_pre_attn_scalar: int = 256
  attn_logit_softcap: Optional[float] = None
  final_logit_softcap: Optional[float] = None
  sliding_window: Optional[int] = 512

  # Every PATTERN-th layer is global, the others local.
  PATTERN = 6

  def default_layer_types(self):
    return tuple(attentions.FULL_ATTENTION if (i + 1) % self.PATTERN == 0
                 else attentions.SLIDING_ATTENTION
                 for i in range(self.num_layers))

  def sliding_layer_rope(self):
    return self.local_rope_theta, None

  @classmethod
  def preset(cls, name: str, **overrides) -> "Gemma3Config":
    """A published size by name (see GEMMA3_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


def _larger(**fields):
  # The 4B and larger text decoders: a longer window, a 262,208-row
  # vocabulary (image tokens included), global frequencies slowed 8 times.
  return Gemma3Config(
      vocab_size=262208, sliding_window=1024, max_length=131072,
      rope_scaling=rotary.RopeScaling(kind="linear", factor=8.0), **fields)


# Dimensions from the published config.json of google/gemma-3-* (the text
# config of the multimodal sizes).
GEMMA3_PRESETS = {
    # Seven layers: the five-to-one pattern and an odd count; a window of
    # 4 positions and distinct rotary bases of each layer type.
    "tiny": Gemma3Config(vocab_size=128, emb_dim=32, num_heads=4,
                         num_kv_heads=2, num_layers=7, head_dim=8, mlp_dim=64,
                         query_pre_attn_scalar=8, sliding_window=4,
                         max_length=512),
    "gemma3-1b": Gemma3Config(),
    "gemma3-4b": _larger(emb_dim=2560, num_heads=8, num_kv_heads=4,
                         num_layers=34, head_dim=256, mlp_dim=10240),
    "gemma3-12b": _larger(emb_dim=3840, num_heads=16, num_kv_heads=8,
                          num_layers=48, head_dim=256, mlp_dim=15360),
}


class Gemma3Layer(gemma.GemmaLayer):
  """A Gemma 2 layer with q/k norms (Gemma's 1 + scale RMSNorm over each
  head's channels, before the rotation)."""

  def attention_options(self):
    cfg = self.config
    return {"qk_norm": lambda name: gemma.GemmaRMSNorm(
        cfg.norm_epsilon, jnp.dtype(cfg.dtype), axis_name="kv", name=name)}


class Gemma3(gemma.Gemma):
  """Gemma 3 causal LM (text); parameters under 'decoder' (t5x layout)."""
  config: Gemma3Config
  block_cls = Gemma3Layer


def from_run_config(model_cfg, vocab_size: int) -> Gemma3Config:
  """`config.model` (arch 'gemma3') -> Gemma3Config."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        gemma.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's Gemma3ForCausalLM.

HF_ARCHITECTURE = "Gemma3ForCausalLM"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)


def config_from_hf(hf) -> Gemma3Config:
  if hf.get("use_bidirectional_attention"):
    _unsupported("use_bidirectional_attention=true")
  rope = hf.get("rope_parameters") or {}
  if rope.keys() & set(attentions.LAYER_TYPES):  # transformers 5: per type
    full = dict(rope.get(attentions.FULL_ATTENTION) or {})
    local = dict(rope.get(attentions.SLIDING_ATTENTION) or {})
  else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling
    full, local = family.rope_parameters(hf), {}
  if family.rope_scaling_from_hf(local, HF_ARCHITECTURE) is not None:
    _unsupported(f"rope scaling of the sliding layers ({local})")
  config = Gemma3Config(
      rope_theta=float(full.get("rope_theta", hf.get("rope_theta",
                                                     1_000_000.0))),
      local_rope_theta=float(local.get(
          "rope_theta", hf.get("rope_local_base_freq", 10_000.0))),
      rope_scaling=family.rope_scaling_from_hf(full, HF_ARCHITECTURE),
      **gemma.hf_config_fields(hf, HF_ARCHITECTURE))
  types = hf.get("layer_types")
  if types is None:  # what transformers makes of an older config.json
    pattern = family.hf_int(hf, "sliding_window_pattern", Gemma3Config.PATTERN)
    types = [attentions.FULL_ATTENTION if (i + 1) % pattern == 0
             else attentions.SLIDING_ATTENTION
             for i in range(config.num_layers)]
  return config.with_layer_types(types)


def config_to_hf(config: Gemma3Config):
  return {**gemma.hf_config_dict(config, HF_ARCHITECTURE, "gemma3_text"),
          "rope_theta": config.rope_theta,
          "rope_local_base_freq": config.local_rope_theta,
          "rope_scaling": family.rope_scaling_to_hf(config.rope_scaling),
          "use_bidirectional_attention": False}


_LAYER = {"norms": gemma.NORMS, "qk_norm": True}

FAMILY = family.Family(
    name="gemma3",
    summary="Gemma 3 text decoder-only (Gemma 2's layer with q/k norms, "
    "5 local : 1 global layers, a rotary base per layer type); HF "
    "Gemma3ForCausalLM.",
    config_cls=Gemma3Config, module_cls=Gemma3, kind=family.DECODER_ONLY,
    presets=GEMMA3_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="gemma3_text",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=functools.partial(llama.tensor_shapes, **_LAYER),
        from_hf=functools.partial(llama.from_hf, **_LAYER),
        to_hf=functools.partial(llama.to_hf, **_LAYER),
        reconcile=gemma.tied_output_reconcile(HF_ARCHITECTURE)))
