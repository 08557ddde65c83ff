"""Qwen3-MoE decoder-only transformer (Qwen Team, 2025: "Qwen3 Technical
Report"): Qwen3's attention (`qwen3.py`: q/k norms, wide heads, rotary
base 1,000,000) with a mixture of experts in place of the MLP
(`moe_decoder.MoeBlock`): each token's router picks its top k of
`num_experts` experts (8 of 128 in Qwen3-30B-A3B, their weights
renormalised: `norm_topk_prob`), on the layers `decoder_sparse_step` and
`mlp_only_layers` leave (every layer in the published models; the others
keep a dense MLP of `mlp_dim`).

Numerics follow Hugging Face's `Qwen3MoeForCausalLM` (transformers 5.24),
whose checkpoints `FAMILY.hf` maps: the router's softmax in float32, the
experts' tensors `mlp.experts.{e}.{gate,up,down}_proj.weight` beside the
router's `mlp.gate.weight` (transformers 5's fused `mlp.experts.gate_up_proj`
/ `down_proj` are read too). As there, a sliding window
(`use_sliding_window`) is on every layer or on none.
"""

import dataclasses
from typing import Optional

from jaxrlhf.models import family
from jaxrlhf.models import llama
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import qwen3


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(moe_decoder.MoeConfig):
  """Hyper-parameters of a Qwen3-MoE model: the fields of
  `moe_decoder.MoeConfig`, with Qwen3-30B-A3B's values as defaults
  (`mlp_dim` is the dense MLP's width, of the mlp_only_layers;
  `moe_mlp_dim` each expert's)."""
  vocab_size: int = 151936
  emb_dim: int = 2048
  num_heads: int = 32
  num_kv_heads: int = 4
  num_layers: int = 48
  head_dim: int = 128
  mlp_dim: int = 6144
  rope_theta: float = 1_000_000.0
  norm_epsilon: float = 1e-6
  tie_embeddings: bool = False
  max_length: int = 40960
  num_experts: int = 128
  num_experts_per_tok: int = 8
  moe_mlp_dim: Optional[int] = 768
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 0.001

  def check(self):
    super().check()
    if self.layer_types is not None:
      raise ValueError(
          "Qwen3MoeConfig: layer_types must be None (the window is on every "
          "layer, or on none with sliding_window=None).")

  @classmethod
  def preset(cls, name: str, **overrides) -> "Qwen3MoeConfig":
    """A published size by name (see QWEN3_MOE_PRESETS), fields
    overridden."""
    return FAMILY.preset(name, **overrides)


# Dimensions from the published config.json of Qwen/Qwen3-30B-A3B.
QWEN3_MOE_PRESETS = {
    # For tests: 4 experts, top 2; head_dim (16) is not emb_dim / num_heads.
    "tiny": Qwen3MoeConfig(vocab_size=128, emb_dim=32, num_heads=4,
                           num_kv_heads=2, num_layers=2, head_dim=16,
                           mlp_dim=64, moe_mlp_dim=32, num_experts=4,
                           num_experts_per_tok=2, max_length=512),
    "qwen3-30b-a3b": Qwen3MoeConfig(),
}


class Qwen3MoeBlock(moe_decoder.MoeBlock, qwen3.Qwen3Block):
  """Qwen3's attention (`qwen3.Qwen3Block`'s q/k norms) and the experts of
  `moe_decoder.MoeBlock`."""


class Qwen3Moe(moe_decoder.MoeCausalLM):
  """Qwen3-MoE causal LM; parameters under 'decoder' (t5x layout)."""
  config: Qwen3MoeConfig
  block_cls = Qwen3MoeBlock


def from_run_config(model_cfg, vocab_size: int) -> Qwen3MoeConfig:
  """`config.model` (arch 'qwen3_moe') -> Qwen3MoeConfig (the experts'
  fields through config.model.family_fields)."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        llama.RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's Qwen3MoeForCausalLM.

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
NAMES = moe_decoder.ExpertNames(block="mlp", gate="gate_proj", up="up_proj",
                                down="down_proj")


def config_from_hf(hf) -> Qwen3MoeConfig:
  if hf.get("attention_bias"):
    family.unsupported(HF_ARCHITECTURE, "attention_bias=true")
  window = (family.hf_int(hf, "sliding_window")
            if hf.get("use_sliding_window") else None)
  return Qwen3MoeConfig(
      moe_mlp_dim=family.hf_int(hf, "moe_intermediate_size"),
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      decoder_sparse_step=family.hf_int(hf, "decoder_sparse_step", 1),
      mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
      sliding_window=window,
      **moe_decoder.hf_moe_fields(hf, HF_ARCHITECTURE),
      **llama.hf_config_fields(hf, HF_ARCHITECTURE))


def config_to_hf(config: Qwen3MoeConfig):
  return {**llama.hf_config_dict(config, HF_ARCHITECTURE, "qwen3_moe"),
          "attention_bias": False,
          "use_sliding_window": config.sliding_window is not None,
          "sliding_window": config.sliding_window,
          "num_experts": config.num_experts,
          "num_experts_per_tok": config.num_experts_per_tok,
          "moe_intermediate_size": config.expert_mlp_dim,
          "norm_topk_prob": config.norm_topk_prob,
          "decoder_sparse_step": config.decoder_sparse_step,
          "mlp_only_layers": list(config.mlp_only_layers),
          "router_aux_loss_coef": config.router_aux_loss_coef}


FAMILY = family.Family(
    name="qwen3_moe",
    summary="Qwen3-MoE decoder-only (Qwen3's attention, top-k of many "
    "experts); HF Qwen3MoeForCausalLM.",
    config_cls=Qwen3MoeConfig, module_cls=Qwen3Moe, kind=family.DECODER_ONLY,
    presets=QWEN3_MOE_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=moe_decoder.hf_mapping(
        HF_ARCHITECTURE, "qwen3_moe", NAMES, config_from_hf=config_from_hf,
        config_to_hf=config_to_hf, qk_norm=True))
