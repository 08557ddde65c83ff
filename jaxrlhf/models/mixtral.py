"""Mixtral decoder-only transformer (Jiang et al., 2024: "Mixtral of
Experts"): Mistral's layer (`mistral.py`: Llama's, with a sliding window on
every layer when configured; none in Mixtral 8x7B) whose MLP is a mixture
of experts on every layer (`moe_decoder.MoeBlock`): each token's router
picks 2 of 8 experts, their softmax weights renormalised to sum to 1
(always, in Mixtral), each expert a SwiGLU MLP of `mlp_dim`.

Numerics follow Hugging Face's `MixtralForCausalLM` (transformers 5.24),
whose checkpoints `FAMILY.hf` maps: the router's softmax in float32, the
published tensor names `block_sparse_moe.gate.weight` and
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down), which
transformers 5 writes too (its fused in-memory `mlp.experts.gate_up_proj` /
`down_proj` are read as well).
"""

import dataclasses
from typing import Optional

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models import moe_decoder


@dataclasses.dataclass(frozen=True)
class MixtralConfig(moe_decoder.MoeConfig):
  """Hyper-parameters of a Mixtral model: the fields of
  `moe_decoder.MoeConfig` with Mixtral 8x7B's values as defaults; every
  layer has experts, `mlp_dim` wide, their weights renormalised (the MoE
  fields Mixtral does not have keep their defaults)."""
  vocab_size: int = 32000
  emb_dim: int = 4096
  num_heads: int = 32
  num_kv_heads: int = 8
  num_layers: int = 32
  head_dim: int = 128
  mlp_dim: int = 14336
  rope_theta: float = 1_000_000.0
  norm_epsilon: float = 1e-5
  max_length: int = 32768
  sliding_window: Optional[int] = None
  num_experts: int = 8
  num_experts_per_tok: int = 2
  router_aux_loss_coef: float = 0.02

  def check(self):
    super().check()
    fixed = {"layer_types": None, "moe_mlp_dim": None, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": ()}
    for field, value in fixed.items():
      if getattr(self, field) != value:
        raise ValueError(
            f"MixtralConfig.{field} must be {value!r} (Mixtral's window is "
            "on every layer or none, and every layer has experts of mlp_dim "
            "with renormalised weights); use qwen3_moe for such variants.")

  @classmethod
  def preset(cls, name: str, **overrides) -> "MixtralConfig":
    """A published size by name (see MIXTRAL_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of mistralai/Mixtral-8x7B-v0.1.
MIXTRAL_PRESETS = {
    # For tests: 4 experts, top 2, and a window of 4.
    "tiny": MixtralConfig(vocab_size=128, emb_dim=32, num_heads=4,
                          num_kv_heads=2, num_layers=2, head_dim=8,
                          mlp_dim=32, num_experts=4, sliding_window=4,
                          max_length=512),
    "mixtral-8x7b": MixtralConfig(),
}


class Mixtral(moe_decoder.MoeCausalLM):
  """Mixtral causal LM (`moe_decoder.MoeBlock`: Llama's attention, the
  window the config's); parameters under 'decoder' (t5x layout)."""
  config: MixtralConfig


def from_run_config(model_cfg, vocab_size: int) -> MixtralConfig:
  """`config.model` (arch 'mixtral') -> MixtralConfig."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        llama.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's MixtralForCausalLM.

HF_ARCHITECTURE = "MixtralForCausalLM"
NAMES = moe_decoder.ExpertNames(block="block_sparse_moe", gate="w1", up="w3",
                                down="w2")


def config_from_hf(hf) -> MixtralConfig:
  if hf.get("router_jitter_noise"):
    # transformers multiplies the training inputs of the router by noise.
    family.unsupported(HF_ARCHITECTURE, "router_jitter_noise > 0")
  window = hf.get("sliding_window")
  return MixtralConfig(
      sliding_window=None if window is None else family.hf_int(
          hf, "sliding_window"),
      **moe_decoder.hf_moe_fields(hf, HF_ARCHITECTURE),
      **llama.hf_config_fields(hf, HF_ARCHITECTURE))


def config_to_hf(config: MixtralConfig):
  return {**llama.hf_config_dict(config, HF_ARCHITECTURE, "mixtral"),
          "sliding_window": config.sliding_window,
          "num_local_experts": config.num_experts,
          "num_experts_per_tok": config.num_experts_per_tok,
          "router_aux_loss_coef": config.router_aux_loss_coef,
          "router_jitter_noise": 0.0}


FAMILY = family.Family(
    name="mixtral",
    summary="Mixtral decoder-only (Mistral's layer, top-2 of 8 experts on "
    "every layer); HF MixtralForCausalLM.",
    config_cls=MixtralConfig, module_cls=Mixtral, kind=family.DECODER_ONLY,
    presets=MIXTRAL_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=moe_decoder.hf_mapping(
        HF_ARCHITECTURE, "mixtral", NAMES, config_from_hf=config_from_hf,
        config_to_hf=config_to_hf))
