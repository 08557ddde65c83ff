"""Qwen2 / Qwen2.5 decoder-only transformer (Qwen Team, 2024: "Qwen2.5
Technical Report").

Llama's layer (`llama.py`: RMSNorm, rotary, grouped-query attention,
SwiGLU) with biases on the query, key and value projections (none on the
output projection or the MLP), a rotary base of 1,000,000, and the output
layer tied to the embedding in the small sizes. Hugging Face's
`use_sliding_window` (a window on the layers from `max_window_layers` on;
off in every published checkpoint) is read as the config's `layer_types`.
Numerics follow Hugging Face's `Qwen2ForCausalLM`, whose checkpoints
`FAMILY.hf` maps.
"""

import dataclasses
import functools
from typing import Any, Dict

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models.layers import attentions


@dataclasses.dataclass(frozen=True)
class Qwen2Config(family.LayerTypesConfig):
  """Hyper-parameters of a Qwen2 / Qwen2.5 model: the shared fields of
  `family.LayerTypesConfig`, with Qwen2.5 0.5B's values as defaults."""
  vocab_size: int = 151936
  emb_dim: int = 896
  num_heads: int = 14
  num_kv_heads: int = 2
  num_layers: int = 24
  head_dim: int = 64
  mlp_dim: int = 4864
  rope_theta: float = 1_000_000.0
  norm_epsilon: float = 1e-6
  tie_embeddings: bool = True
  max_length: int = 32768

  @classmethod
  def preset(cls, name: str, **overrides) -> "Qwen2Config":
    """A published size by name (see QWEN2_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of Qwen/Qwen2.5-*.
QWEN2_PRESETS = {
    "tiny": Qwen2Config(vocab_size=128, emb_dim=32, num_heads=4,
                        num_kv_heads=2, num_layers=2, head_dim=8, mlp_dim=64,
                        max_length=512),
    "qwen2.5-0.5b": Qwen2Config(),
    "qwen2.5-1.5b": Qwen2Config(emb_dim=1536, num_heads=12, num_kv_heads=2,
                                num_layers=28, head_dim=128, mlp_dim=8960,
                                max_length=131072),
    "qwen2.5-3b": Qwen2Config(emb_dim=2048, num_heads=16, num_kv_heads=2,
                              num_layers=36, head_dim=128, mlp_dim=11008),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, emb_dim=3584, num_heads=28,
                              num_kv_heads=4, num_layers=28, head_dim=128,
                              mlp_dim=18944, tie_embeddings=False,
                              max_length=131072),
}


class Qwen2Block(llama.LlamaBlock):
  """Llama's layer with q/k/v biases."""

  def attention_options(self):
    return {"qkv_bias": True}


class Qwen2(llama.Llama):
  """Qwen2 causal LM; parameters under 'decoder' (t5x layout)."""
  config: Qwen2Config
  block_cls = Qwen2Block


def from_run_config(model_cfg, vocab_size: int) -> Qwen2Config:
  """`config.model` (arch 'qwen2') -> Qwen2Config."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        llama.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's Qwen2ForCausalLM.

HF_ARCHITECTURE = "Qwen2ForCausalLM"


def hf_window(hf, num_layers: int) -> Dict[str, Any]:
  """{sliding_window, layer_types} of a Qwen config.json (Qwen2's and
  Qwen3's convention): a window only with use_sliding_window, on the
  layers from max_window_layers on unless `layer_types` says otherwise."""
  if not hf.get("use_sliding_window"):
    window = None
  else:
    window = family.hf_int(hf, "sliding_window")
  types = hf.get("layer_types")
  if types is None:
    first = family.hf_int(hf, "max_window_layers", num_layers)
    types = [attentions.SLIDING_ATTENTION if window is not None and i >= first
             else attentions.FULL_ATTENTION for i in range(num_layers)]
  return {"sliding_window": window, "layer_types": types}


def hf_window_dict(config) -> Dict[str, Any]:
  """config.json's window keys of a Qwen config (`hf_window`'s inverse;
  `layer_types` decides, max_window_layers is for older readers)."""
  types = config.attention_types
  sliding = [i for i, t in enumerate(types)
             if t == attentions.SLIDING_ATTENTION]
  if not sliding:
    return {"use_sliding_window": False, "sliding_window": None,
            "layer_types": list(types)}
  return {"use_sliding_window": True, "sliding_window": config.sliding_window,
          "max_window_layers": sliding[0], "layer_types": list(types)}


def config_from_hf(hf, config_cls=Qwen2Config, architecture=HF_ARCHITECTURE):
  """A Qwen2 (or, with its class and name, Qwen3) config.json as our
  config."""
  fields = llama.hf_config_fields(hf, architecture)
  window = hf_window(hf, fields["num_layers"])
  config = config_cls(sliding_window=window["sliding_window"], **fields)
  return config.with_layer_types(window["layer_types"])


def config_to_hf(config: Qwen2Config):
  return {**llama.hf_config_dict(config, HF_ARCHITECTURE, "qwen2"),
          **hf_window_dict(config)}


_LAYER = {"qkv_bias": True}

FAMILY = family.Family(
    name="qwen2",
    summary="Qwen2 / Qwen2.5 decoder-only (Llama's layer with q/k/v "
    "biases); HF Qwen2ForCausalLM.",
    config_cls=Qwen2Config, module_cls=Qwen2, kind=family.DECODER_ONLY,
    presets=QWEN2_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="qwen2",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=functools.partial(llama.tensor_shapes, **_LAYER),
        from_hf=functools.partial(llama.from_hf, **_LAYER),
        to_hf=functools.partial(llama.to_hf, **_LAYER),
        reconcile=llama.reconcile, ignored=llama.HF_IGNORED))
