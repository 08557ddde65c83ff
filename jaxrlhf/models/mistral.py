"""Mistral decoder-only transformer (Jiang et al., 2023: "Mistral 7B").

Llama's layer (`llama.py`) with a sliding window on every layer: a query
sees the keys fewer than `sliding_window` positions back (4096 in Mistral
7B v0.1; v0.2 and v0.3 have none and a rotary base of 1,000,000). Numerics
follow Hugging Face's `MistralForCausalLM`, whose checkpoints `FAMILY.hf`
maps; like it, the window is on every layer or on none (`layer_types` is
not a Mistral option).
"""

import dataclasses
from typing import Optional

from jaxrlhf.models import family
from jaxrlhf.models import llama


@dataclasses.dataclass(frozen=True)
class MistralConfig(family.LayerTypesConfig):
  """Hyper-parameters of a Mistral model: the shared fields of
  `family.LayerTypesConfig`, with Mistral 7B v0.1's values as defaults."""
  vocab_size: int = 32000
  emb_dim: int = 4096
  num_heads: int = 32
  num_kv_heads: int = 8
  num_layers: int = 32
  head_dim: int = 128
  mlp_dim: int = 14336
  max_length: int = 32768
  sliding_window: Optional[int] = 4096

  def check(self):
    super().check()
    if self.layer_types is not None:
      raise ValueError(
          "MistralConfig: layer_types must be None (the window is on every "
          "layer, or on none with sliding_window=None).")

  @classmethod
  def preset(cls, name: str, **overrides) -> "MistralConfig":
    """A published size by name (see MISTRAL_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of mistralai/Mistral-7B-*.
MISTRAL_PRESETS = {
    "tiny": MistralConfig(vocab_size=128, emb_dim=32, num_heads=4,
                          num_kv_heads=2, num_layers=2, head_dim=8,
                          mlp_dim=64, sliding_window=4, max_length=512),
    "mistral-7b": MistralConfig(),
    "mistral-7b-v0.3": MistralConfig(vocab_size=32768, rope_theta=1e6,
                                     sliding_window=None),
}


class Mistral(llama.Llama):
  """Mistral causal LM (Llama's block; the window is the config's);
  parameters under 'decoder' (t5x layout)."""
  config: MistralConfig


def from_run_config(model_cfg, vocab_size: int) -> MistralConfig:
  """`config.model` (arch 'mistral') -> MistralConfig."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        llama.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's MistralForCausalLM.

HF_ARCHITECTURE = "MistralForCausalLM"


def config_from_hf(hf) -> MistralConfig:
  # transformers' MistralModel ignores layer_types (its window is on every
  # layer), and so do we.
  window = hf.get("sliding_window")
  return MistralConfig(
      sliding_window=None if window is None else family.hf_int(
          hf, "sliding_window"),
      **llama.hf_config_fields(hf, HF_ARCHITECTURE))


def config_to_hf(config: MistralConfig):
  return {**llama.hf_config_dict(config, HF_ARCHITECTURE, "mistral"),
          "sliding_window": config.sliding_window}


FAMILY = family.Family(
    name="mistral",
    summary="Mistral decoder-only (Llama's layer with a sliding window on "
    "every layer); HF MistralForCausalLM.",
    config_cls=MistralConfig, module_cls=Mistral, kind=family.DECODER_ONLY,
    presets=MISTRAL_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="mistral",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=llama.tensor_shapes, from_hf=llama.from_hf,
        to_hf=llama.to_hf, reconcile=llama.reconcile,
        ignored=llama.HF_IGNORED))
