"""Llama-style decoder-only transformer (Llama 2/3, TinyLlama and kin).

Pre-norm RMSNorm blocks, rotary position embeddings (theta and Llama 3.1
context-extension scaling configurable), grouped-query attention, SwiGLU MLP,
no biases, tied or untied output embedding. Numerics follow Hugging Face's
`LlamaForCausalLM`, so its checkpoints load through `jaxrlhf.models.hf_io`.

The families that are Llama but for their attention (Qwen2's q/k/v biases,
Qwen3's q/k norms, Mistral's sliding window) reuse this module's block
(`LlamaBlock.attention_options`), model and Hugging Face tensor mapping
(`tensor_shapes`, `from_hf`, `to_hf` with the layer's options).

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
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import family
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import normalizations
from jaxrlhf.models.layers import rotary

Array = jax.Array
RopeScaling = rotary.RopeScaling


@dataclasses.dataclass(frozen=True)
class LlamaConfig(family.GroupedQueryConfig):
  """Hyper-parameters of a Llama-style model: the shared fields of
  `family.GroupedQueryConfig` (its rotary scaling among them)."""

  @classmethod
  def preset(cls, name: str, **overrides) -> "LlamaConfig":
    """A published size by name (see LLAMA_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


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
  """x + attn(norm(x)), then + mlp(norm(.)); returns (x, None) for nn.scan.

  `config` is any `family.GroupedQueryConfig`: each layer attends as its
  `layer_attention()` says (its rotary and window; `layer` is the layer's
  index when they differ). A family that is Llama but for its attention
  subclasses the block and overrides `attention_options`; one that is Llama
  but for its MLP, `feed_forward`."""
  config: Any

  def attention_options(self) -> Dict[str, Any]:
    """Further `attentions.Attention` fields of the family (biases, q/k
    norms)."""
    return {}

  def feed_forward(self, h: Array, layer) -> Array:
    """The layer's MLP (scope 'mlp') of its normalised input h [batch,
    length, embed]; `layer` is the layer's index (None when the layers are
    not indexed). SwiGLU here; `moe_decoder.MoeBlock` routes to experts."""
    del layer  # every layer's MLP is alike
    cfg = self.config
    return linears.Mlp(cfg.mlp_dim, ("silu", "linear"), use_bias=False,
                       dtype=jnp.dtype(cfg.dtype), name="mlp")(h)

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index=None, layer=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h = normalizations.RMSNorm(cfg.norm_epsilon, dtype,
                               name="pre_self_attention_layer_norm")(x)
    h = attentions.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.head_dim,
        layer_kinds=cfg.layer_attention(), dtype=dtype,
        attention_impl=cfg.attention_impl, name="self_attention",
        **self.attention_options())(h, positions, mask, cache_index, layer)
    x = x + h
    h = normalizations.RMSNorm(cfg.norm_epsilon, dtype,
                               name="pre_mlp_layer_norm")(x)
    x = x + self.feed_forward(h, layer)
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class Llama(decoders.CausalLM):
  """Llama-style causal LM; parameters under 'decoder' (t5x layout)."""
  config: LlamaConfig
  block_cls = LlamaBlock

  def final_norm(self):
    return functools.partial(normalizations.RMSNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))

  def decoder_options(self):
    # Layer indices only where the layers attend differently.
    return {"index_layers": self.config.layers_differ()}


# The config.model fields a Llama-like family refuses
# (`family.decoder_from_run_config`).
RUN_CONFIG_REFUSED = {
    "mlp": ("gated-gelu", "has a fixed SwiGLU MLP; leave config.model.mlp "
            "at its default."),
    "logits_via_embedding": (False, "ties per preset (tie_embeddings)."),
    "dropout_rate": (0.0, "has no dropout.")}


def from_run_config(model_cfg, vocab_size: int) -> LlamaConfig:
  """`config.model` (arch 'llama') -> LlamaConfig."""
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size,
                                        RUN_CONFIG_REFUSED)


# ----------------------------------------------------------------------------
# Hugging Face's LlamaForCausalLM.

HF_ARCHITECTURE = "LlamaForCausalLM"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)


def config_from_hf(hf) -> LlamaConfig:
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      _unsupported(f"{key}=true (projection biases)")
  return LlamaConfig(**hf_config_fields(hf, HF_ARCHITECTURE))


def hf_config_fields(hf, architecture: str, tie_default: bool = False
                     ) -> Dict[str, Any]:
  """The `family.GroupedQueryConfig` fields of a Llama-like config.json
  (dimensions, rotary, norm epsilon, tying, generation ids)."""
  get = functools.partial(family.hf_get, hf)
  if get("hidden_act", "silu") != "silu":
    family.unsupported(architecture,
                       f"hidden_act={hf['hidden_act']!r} (only 'silu')")
  num_heads = get("num_attention_heads")
  hidden = get("hidden_size")
  rope = family.rope_parameters(hf)
  return dict(
      vocab_size=get("vocab_size"), emb_dim=hidden, num_heads=num_heads,
      num_kv_heads=get("num_key_value_heads", num_heads),
      num_layers=get("num_hidden_layers"),
      head_dim=get("head_dim", hidden // num_heads),
      mlp_dim=get("intermediate_size"),
      rope_theta=float(get("rope_theta", rope.get("rope_theta", 10000.0))),
      rope_scaling=family.rope_scaling_from_hf(rope, architecture),
      norm_epsilon=float(get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(get("tie_word_embeddings", tie_default)),
      max_length=get("max_position_embeddings", 2048),
      **family.special_token_ids(hf))


def hf_config_dict(config, architecture: str, model_type: str
                   ) -> Dict[str, Any]:
  """config.json of a Llama-like config (`hf_config_fields`' inverse); a
  family adds its own keys."""
  return {
      "architectures": [architecture], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "hidden_act": "silu",
      "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rope_theta,
      "rope_scaling": family.rope_scaling_to_hf(config.rope_scaling),
      "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": config.max_length,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }


def config_to_hf(config: LlamaConfig):
  return {**hf_config_dict(config, HF_ARCHITECTURE, "llama"),
          "attention_bias": False, "mlp_bias": False}


def reconcile(config, tensors):
  """As transformers does, a separate output matrix that differs from the
  embedding unties a config that says tied."""
  head = tensors.get("lm_head.weight")
  if config.tie_embeddings and head is not None and not np.array_equal(
      head, tensors.get("model.embed_tokens.weight")):
    config = dataclasses.replace(config, tie_embeddings=False)
  return config, tensors


# The attention and MLP of a layer: the same names in every Llama-like HF
# checkpoint (Gemma's, Qwen's and Mistral's too). Ours -> HF's, under
# model.layers.{i}.
_ATTENTION = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}
_QK_NORMS = {"query_norm": "q_norm", "key_norm": "k_norm"}
_MLP = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
# The norms of a Llama layer.
NORMS = {"pre_self_attention_layer_norm": "input_layernorm",
         "pre_mlp_layer_norm": "post_attention_layernorm"}


def hf_layer_shapes(cfg, prefix: str, norms, *, qkv_bias: bool = False,
                    qk_norm: bool = False, mlp: bool = True) -> family.Shapes:
  """{HF name: shape} of one layer under `prefix` ("model.layers.3."):
  attention (with q/k/v biases, with q/k norms), MLP (unless `mlp` is
  False: a family that maps its own) and the norms named in `norms` ({ours:
  HF's})."""
  d, h = cfg.emb_dim, cfg.head_dim
  heads = {"query": cfg.num_heads, "key": cfg.num_kv_heads,
           "value": cfg.num_kv_heads}
  shapes = {prefix + f"{hf}.weight": (d,) for hf in norms.values()}
  for ours, hf in _ATTENTION.items():
    shapes[prefix + f"self_attn.{hf}.weight"] = (heads[ours] * h, d)
    if qkv_bias:
      shapes[prefix + f"self_attn.{hf}.bias"] = (heads[ours] * h,)
  if qk_norm:
    shapes.update({prefix + f"self_attn.{hf}.weight": (h,)
                   for hf in _QK_NORMS.values()})
  shapes[prefix + "self_attn.o_proj.weight"] = (d, cfg.num_heads * h)
  if mlp:
    shapes.update({prefix + f"mlp.{hf}.weight": (
        (d, cfg.mlp_dim) if ours == "wo" else (cfg.mlp_dim, d))
                   for ours, hf in _MLP.items()})
  return shapes


def hf_layer_from(cfg, t, prefix: str, norms, *, qkv_bias: bool = False,
                  qk_norm: bool = False, mlp: bool = True):
  """Our parameters of one layer from HF tensors `t` under `prefix`."""
  d, h, linear = cfg.emb_dim, cfg.head_dim, family.torch_linear
  heads = {"query": cfg.num_heads, "key": cfg.num_kv_heads,
           "value": cfg.num_kv_heads}
  layer = {ours: {"scale": t[prefix + f"{hf}.weight"]}
           for ours, hf in norms.items()}
  attn = {}
  for ours, hf in _ATTENTION.items():
    name = prefix + f"self_attn.{hf}."
    attn[ours] = {"kernel": linear(t[name + "weight"]).reshape(
        d, heads[ours], h)}
    if qkv_bias:
      attn[ours]["bias"] = t[name + "bias"].reshape(heads[ours], h)
  if qk_norm:
    attn.update({ours: {"scale": t[prefix + f"self_attn.{hf}.weight"]}
                 for ours, hf in _QK_NORMS.items()})
  attn["out"] = {"kernel": linear(
      t[prefix + "self_attn.o_proj.weight"]).reshape(cfg.num_heads, h, d)}
  layer["self_attention"] = attn
  if mlp:
    layer["mlp"] = {ours: {"kernel": linear(t[prefix + f"mlp.{hf}.weight"])}
                    for ours, hf in _MLP.items()}
  return layer


def hf_layer_to(cfg, layer, prefix: str, norms, *, qkv_bias: bool = False,
                qk_norm: bool = False, mlp: bool = True):
  """HF tensors of one layer of ours under `prefix` (`hf_layer_from`'s
  inverse)."""
  d, linear = cfg.emb_dim, family.torch_linear
  attn = layer["self_attention"]
  t = {prefix + f"{hf}.weight": layer[ours]["scale"]
       for ours, hf in norms.items()}
  for ours, hf in _ATTENTION.items():
    name = prefix + f"self_attn.{hf}."
    t[name + "weight"] = linear(attn[ours]["kernel"].reshape(d, -1))
    if qkv_bias:
      t[name + "bias"] = attn[ours]["bias"].reshape(-1)
  if qk_norm:
    t.update({prefix + f"self_attn.{hf}.weight": attn[ours]["scale"]
              for ours, hf in _QK_NORMS.items()})
  t[prefix + "self_attn.o_proj.weight"] = linear(
      attn["out"]["kernel"].reshape(-1, d))
  if mlp:
    t.update({prefix + f"mlp.{hf}.weight": linear(
        layer["mlp"][ours]["kernel"]) for ours, hf in _MLP.items()})
  return t


# The whole model. A Llama-like family passes its layer's norms and options
# (functools.partial(tensor_shapes, qkv_bias=True) for Qwen2).

def tensor_shapes(cfg, tensors, norms=NORMS, **options):
  d = cfg.emb_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d),
            "model.norm.weight": (d,)}
  if not cfg.tie_embeddings or "lm_head.weight" in tensors:
    # A tied model's file may carry an equal copy of the embedding.
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    shapes.update(hf_layer_shapes(cfg, f"model.layers.{i}.", norms,
                                  **options))
  return shapes


def from_hf(cfg, t, norms=NORMS, **options):
  dec = {"token_embedder": {"embedding": t["model.embed_tokens.weight"]},
         "decoder_norm": {"scale": t["model.norm.weight"]}}
  if not cfg.tie_embeddings:
    dec["logits_dense"] = {"kernel": family.torch_linear(t["lm_head.weight"])}
  for i in range(cfg.num_layers):
    dec[f"layers_{i}"] = hf_layer_from(cfg, t, f"model.layers.{i}.", norms,
                                       **options)
  return {"decoder": dec}


def to_hf(cfg, params, norms=NORMS, **options):
  dec = params["decoder"]
  t = {"model.embed_tokens.weight": dec["token_embedder"]["embedding"],
       "model.norm.weight": dec["decoder_norm"]["scale"]}
  if not cfg.tie_embeddings:
    t["lm_head.weight"] = family.torch_linear(dec["logits_dense"]["kernel"])
  for i in range(cfg.num_layers):
    t.update(hf_layer_to(cfg, dec[f"layers_{i}"], f"model.layers.{i}.",
                         norms, **options))
  return t


# Buffers some Llama-like files carry.
HF_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
              r"model\.rotary_emb\.inv_freq")


FAMILY = family.Family(
    name="llama",
    summary="Llama 2/3-style decoder-only (RMSNorm, rotary, grouped-query "
    "attention, SwiGLU); HF LlamaForCausalLM.",
    config_cls=LlamaConfig, module_cls=Llama, kind=family.DECODER_ONLY,
    presets=LLAMA_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="llama",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=tensor_shapes, from_hf=from_hf, to_hf=to_hf,
        reconcile=reconcile, ignored=HF_IGNORED))
