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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models import family
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import normalizations
from jaxrlhf.models.layers import rotary

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig(family.DecoderConfig):
  """Hyper-parameters of a GPT-NeoX-style model: the shared fields of
  `family.DecoderConfig` (Pythia 1B's values as defaults; one key/value
  head per query head, each emb_dim / num_heads wide) and its own."""
  vocab_size: int = 50304
  emb_dim: int = 2048
  num_heads: int = 8
  num_layers: int = 16
  mlp_dim: int = 8192
  max_length: int = 2048
  # Fraction of each head's channels that are rotated (Pythia: 0.25).
  rotary_pct: float = 0.25
  use_parallel_residual: bool = True
  # HF hidden_act: 'gelu' is the exact erf form Pythia uses.
  mlp_activation: str = "gelu"

  def check(self):
    if self.emb_dim % self.num_heads:
      raise ValueError(f"GPTNeoXConfig: emb_dim={self.emb_dim} must be a "
                       f"multiple of num_heads={self.num_heads}.")
    super().check()
    if rotary.rotated_channels(self.rotary_dim) > self.head_dim:
      raise ValueError(
          f"GPTNeoXConfig: rotary_pct={self.rotary_pct} of head_dim="
          f"{self.head_dim} rotates {rotary.rotated_channels(self.rotary_dim)}"
          " channels, more than a head has.")
    if self.tie_embeddings:
      raise ValueError("GPTNeoXConfig: tie_embeddings=True is not a GPT-NeoX "
                       "model (its embed_out is separate).")
    checks.check_choice("GPTNeoXConfig", "mlp_activation",
                        self.mlp_activation, linears.ACTIVATIONS)

  @property
  def head_dim(self) -> int:
    return self.emb_dim // self.num_heads

  @property
  def rotary_dim(self) -> int:
    # int() truncation as HF's `int(head_size * rotary_pct)`; an odd value
    # is kept (see rotary.rope_inverse_frequencies).
    return int(self.head_dim * self.rotary_pct)

  @classmethod
  def preset(cls, name: str, **overrides) -> "GPTNeoXConfig":
    """A published size by name (see PYTHIA_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)


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
    norm = functools.partial(normalizations.LayerNorm, cfg.norm_epsilon, dtype)
    h = norm(name="pre_self_attention_layer_norm")(x)
    attn = attentions.Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
        head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
        rope_theta=cfg.rope_theta, qkv_bias=True, out_bias=True,
        dtype=dtype,
        attention_impl=cfg.attention_impl,
        name="self_attention")(h, positions, mask, cache_index)
    mlp = linears.Mlp(cfg.mlp_dim, (cfg.mlp_activation,), use_bias=True,
                      dtype=dtype, name="mlp")
    if cfg.use_parallel_residual:
      x = x + attn + mlp(norm(name="pre_mlp_layer_norm")(x))
    else:
      x = x + attn
      x = x + mlp(norm(name="pre_mlp_layer_norm")(x))
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class GPTNeoX(decoders.CausalLM):
  """GPT-NeoX-style causal LM; parameters under 'decoder' (t5x layout)."""
  config: GPTNeoXConfig
  block_cls = GPTNeoXBlock

  def final_norm(self):
    return functools.partial(normalizations.LayerNorm, self.config.norm_epsilon,
                             jnp.dtype(self.config.dtype))


def from_run_config(model_cfg, vocab_size: int) -> GPTNeoXConfig:
  """`config.model` (arch 'gpt_neox') -> GPTNeoXConfig. A `head_dim` equal
  to emb_dim / num_heads (what the family computes) is accepted."""
  head_dim = model_cfg.get("head_dim")
  if head_dim is not None:
    preset = FAMILY.presets.get(model_cfg.size)
    emb = model_cfg.get("emb_dim") or getattr(preset, "emb_dim", 0)
    heads = model_cfg.get("num_heads") or getattr(preset, "num_heads", 0)
    if heads and emb == head_dim * heads:
      model_cfg = model_cfg.copy_and_resolve_references()
      with model_cfg.unlocked():
        model_cfg.head_dim = None
  return family.decoder_from_run_config(FAMILY, model_cfg, vocab_size, {
      "mlp": ("gated-gelu", "has a fixed GELU MLP; leave config.model.mlp "
                 "at its default."),
      "logits_via_embedding": (False, "never ties its output layer."),
      "dropout_rate": (0.0, "has no dropout."),
      "head_dim": (None, "splits emb_dim evenly over its heads (head_dim = "
                   "emb_dim / num_heads); unset it."),
      "num_kv_heads": (None, "has one key/value head per query head.")})


# ----------------------------------------------------------------------------
# Hugging Face's GPTNeoXForCausalLM.

HF_ARCHITECTURE = "GPTNeoXForCausalLM"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)


def config_from_hf(hf) -> GPTNeoXConfig:
  get = functools.partial(family.hf_get, hf)
  rope = family.rope_parameters(hf)
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    _unsupported(f"rope scaling {rope}")
  if not get("attention_bias", True):
    _unsupported("attention_bias=false")
  if get("tie_word_embeddings", False):
    _unsupported("tie_word_embeddings=true")
  act = get("hidden_act", "gelu")
  if act not in linears.ACTIVATIONS:
    _unsupported(f"hidden_act={act!r} (choose from "
                 f"{sorted(linears.ACTIVATIONS)})")
  return GPTNeoXConfig(
      vocab_size=get("vocab_size"), emb_dim=get("hidden_size"),
      num_heads=get("num_attention_heads"),
      num_layers=get("num_hidden_layers"), mlp_dim=get("intermediate_size"),
      rotary_pct=float(get("rotary_pct",
                           rope.get("partial_rotary_factor", 0.25))),
      rope_theta=float(get("rotary_emb_base",
                           rope.get("rope_theta", 10000.0))),
      use_parallel_residual=bool(get("use_parallel_residual", True)),
      norm_epsilon=float(get("layer_norm_eps", 1e-5)), mlp_activation=act,
      max_length=get("max_position_embeddings", 2048),
      **family.special_token_ids(hf))


def config_to_hf(config: GPTNeoXConfig):
  return {
      "architectures": [HF_ARCHITECTURE], "model_type": "gpt_neox",
      "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "rotary_pct": config.rotary_pct, "rotary_emb_base": config.rope_theta,
      "use_parallel_residual": config.use_parallel_residual,
      "layer_norm_eps": config.norm_epsilon,
      "hidden_act": config.mlp_activation,
      "max_position_embeddings": config.max_length,
      "tie_word_embeddings": False, "attention_bias": True,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
  }


def tensor_shapes(cfg, tensors):
  del tensors
  d, f = cfg.emb_dim, cfg.mlp_dim
  shapes = {"gpt_neox.embed_in.weight": (cfg.vocab_size, d),
            "gpt_neox.final_layer_norm.weight": (d,),
            "gpt_neox.final_layer_norm.bias": (d,),
            "embed_out.weight": (cfg.vocab_size, d)}
  for i in range(cfg.num_layers):
    p = f"gpt_neox.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (d,), p + "input_layernorm.bias": (d,),
        p + "post_attention_layernorm.weight": (d,),
        p + "post_attention_layernorm.bias": (d,),
        p + "attention.query_key_value.weight": (3 * d, d),
        p + "attention.query_key_value.bias": (3 * d,),
        p + "attention.dense.weight": (d, d), p + "attention.dense.bias": (d,),
        p + "mlp.dense_h_to_4h.weight": (f, d),
        p + "mlp.dense_h_to_4h.bias": (f,),
        p + "mlp.dense_4h_to_h.weight": (d, f),
        p + "mlp.dense_4h_to_h.bias": (d,),
    })
  return shapes


def from_hf(cfg, t):
  d, n, h = cfg.emb_dim, cfg.num_heads, cfg.head_dim
  linear = family.torch_linear
  dec = {"token_embedder": {"embedding": t["gpt_neox.embed_in.weight"]},
         "decoder_norm": {"scale": t["gpt_neox.final_layer_norm.weight"],
                          "bias": t["gpt_neox.final_layer_norm.bias"]},
         "logits_dense": {"kernel": linear(t["embed_out.weight"])}}
  for i in range(cfg.num_layers):
    p = f"gpt_neox.layers.{i}."
    # The fused projection's output index is head * 3h + {q,k,v} * h + channel
    # (HF views it as [..., heads, 3 * head_size] and chunks the last axis).
    qkv = linear(t[p + "attention.query_key_value.weight"]).reshape(d, n, 3, h)
    qkv_bias = t[p + "attention.query_key_value.bias"].reshape(n, 3, h)
    attn = {name: {"kernel": np.ascontiguousarray(qkv[:, :, j]),
                   "bias": np.ascontiguousarray(qkv_bias[:, j])}
            for j, name in enumerate(("query", "key", "value"))}
    attn["out"] = {
        "kernel": linear(t[p + "attention.dense.weight"]).reshape(n, h, d),
        "bias": t[p + "attention.dense.bias"]}
    dec[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {
            "scale": t[p + "input_layernorm.weight"],
            "bias": t[p + "input_layernorm.bias"]},
        "pre_mlp_layer_norm": {
            "scale": t[p + "post_attention_layernorm.weight"],
            "bias": t[p + "post_attention_layernorm.bias"]},
        "self_attention": attn,
        "mlp": {"wi": {"kernel": linear(t[p + "mlp.dense_h_to_4h.weight"]),
                       "bias": t[p + "mlp.dense_h_to_4h.bias"]},
                "wo": {"kernel": linear(t[p + "mlp.dense_4h_to_h.weight"]),
                       "bias": t[p + "mlp.dense_4h_to_h.bias"]}},
    }
  return {"decoder": dec}


def to_hf(cfg, params):
  dec, d, linear = params["decoder"], cfg.emb_dim, family.torch_linear
  t = {"gpt_neox.embed_in.weight": dec["token_embedder"]["embedding"],
       "gpt_neox.final_layer_norm.weight": dec["decoder_norm"]["scale"],
       "gpt_neox.final_layer_norm.bias": dec["decoder_norm"]["bias"],
       "embed_out.weight": linear(dec["logits_dense"]["kernel"])}
  for i in range(cfg.num_layers):
    p, layer = f"gpt_neox.layers.{i}.", dec[f"layers_{i}"]
    attn, mlp = layer["self_attention"], layer["mlp"]
    qkv = np.stack([attn[k]["kernel"] for k in ("query", "key", "value")],
                   axis=2)  # [d, heads, 3, head_dim]
    qkv_bias = np.stack([attn[k]["bias"] for k in ("query", "key", "value")],
                        axis=1)  # [heads, 3, head_dim]
    attention_norm = layer["pre_self_attention_layer_norm"]
    mlp_norm = layer["pre_mlp_layer_norm"]
    t.update({
        p + "input_layernorm.weight": attention_norm["scale"],
        p + "input_layernorm.bias": attention_norm["bias"],
        p + "post_attention_layernorm.weight": mlp_norm["scale"],
        p + "post_attention_layernorm.bias": mlp_norm["bias"],
        p + "attention.query_key_value.weight": linear(qkv.reshape(d, -1)),
        p + "attention.query_key_value.bias": qkv_bias.reshape(-1),
        p + "attention.dense.weight": linear(attn["out"]["kernel"]
                                             .reshape(-1, d)),
        p + "attention.dense.bias": attn["out"]["bias"],
        p + "mlp.dense_h_to_4h.weight": linear(mlp["wi"]["kernel"]),
        p + "mlp.dense_h_to_4h.bias": mlp["wi"]["bias"],
        p + "mlp.dense_4h_to_h.weight": linear(mlp["wo"]["kernel"]),
        p + "mlp.dense_4h_to_h.bias": mlp["wo"]["bias"],
    })
  return t


FAMILY = family.Family(
    name="gpt_neox",
    summary="GPT-NeoX / Pythia decoder-only (LayerNorm, partial rotary, "
    "parallel residual); HF GPTNeoXForCausalLM.",
    config_cls=GPTNeoXConfig, module_cls=GPTNeoX, kind=family.DECODER_ONLY,
    presets=PYTHIA_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),),
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="gpt_neox",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=tensor_shapes, from_hf=from_hf, to_hf=to_hf,
        ignored=(r"gpt_neox\.layers\.\d+\.attention\.rotary_emb\.inv_freq",
                 r"gpt_neox\.layers\.\d+\.attention\.(masked_)?bias",
                 r"gpt_neox\.rotary_emb\.inv_freq")))
