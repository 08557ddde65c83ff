"""Hugging Face checkpoints (config.json + safetensors) in and out.

  config, params = load_hf_checkpoint("/path/to/hf_model")
  logits = model_for_config(config).apply({"params": params}, ...)
  export_hf_checkpoint(config, params, "/path/to/out")   # transformers loads it

Families: `LlamaForCausalLM` <-> `llama.Llama`, `GPTNeoXForCausalLM` <->
`gpt_neox.GPTNeoX`, `T5ForConditionalGeneration` <-> `t5.T5` (t5x's parameter
layout; T5 1.1 / FLAN-T5 gated-GELU and T5 1.0 ReLU with tied embeddings).
Only numpy and `safetensors.numpy` are used: no torch.

Each family is a pure name/shape mapping between the HF tensor names (torch
`Linear` weights are [out, in]) and our parameter tree ([in, out] kernels,
attention kernels split per head), plus a translation of the config. Reading
checks every tensor against the names and shapes the config implies and
fails with one error naming every missing, unexpected or mis-shaped tensor.
Both `config.json` conventions are read: transformers 4.x (`rope_theta`,
`rope_scaling`, `rotary_pct`, `rotary_emb_base`, `tie_word_embeddings` as
T5's logit-scaling switch) and 5.x (`rope_parameters`,
`scale_decoder_outputs`). Exports use the 4.x keys, which 5.x also reads.
"""

import dataclasses
import functools
import json
import pathlib
import re
from typing import Any, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import numpy as safetensors_np

from jaxrlhf.models import gpt_neox
from jaxrlhf.models import layers
from jaxrlhf.models import llama

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

LLAMA = "LlamaForCausalLM"
GPT_NEOX = "GPTNeoXForCausalLM"
T5 = "T5ForConditionalGeneration"
SUPPORTED_ARCHITECTURES = (LLAMA, GPT_NEOX, T5)
_MODEL_TYPES = {"llama": LLAMA, "gpt_neox": GPT_NEOX, "t5": T5}

# HF T5 `feed_forward_proj` <-> t5x `mlp_activations`. Plain "gelu" is left
# out on purpose: HF's is the exact erf GELU, t5x's the tanh approximation.
_T5_ACTIVATIONS = {
    "relu": ("relu",),
    "gated-gelu": ("gelu", "linear"),
    "gated-relu": ("relu", "linear"),
    "gated-silu": ("silu", "linear"),
}

# Non-parameter buffers some checkpoints carry, and T5 tensors that are tied
# copies of `shared.weight` (or an unused cross-attention bias table).
_IGNORED = {
    LLAMA: (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
            r"model\.rotary_emb\.inv_freq"),
    GPT_NEOX: (r"gpt_neox\.layers\.\d+\.attention\.rotary_emb\.inv_freq",
               r"gpt_neox\.layers\.\d+\.attention\.(masked_)?bias",
               r"gpt_neox\.rotary_emb\.inv_freq"),
    T5: (r"(encoder|decoder)\.embed_tokens\.weight",
         r"decoder\.block\.0\.layer\.1\.EncDecAttention\."
         r"relative_attention_bias\.weight"),
}


class HFCheckpointError(ValueError):
  """A checkpoint that does not match what its config (or ours) implies."""


# ----------------------------------------------------------------------------
# Files.

def read_safetensors(path) -> Dict[str, np.ndarray]:
  """All tensors of `path/model.safetensors`, or of the shards listed in
  `path/model.safetensors.index.json`, as numpy arrays in their stored dtype."""
  path = pathlib.Path(path)
  if (path / SINGLE_FILE).is_file():
    return dict(safetensors_np.load_file(path / SINGLE_FILE))
  if (path / INDEX_FILE).is_file():
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
      if not (path / shard).is_file():
        raise HFCheckpointError(
            f"{path / INDEX_FILE} lists shard {shard!r}, which is not in "
            f"{path}: copy every shard of the checkpoint.")
      shard_tensors = safetensors_np.load_file(path / shard)
      for name, shard_of_name in weight_map.items():
        if shard_of_name == shard:
          if name not in shard_tensors:
            raise HFCheckpointError(
                f"{path / INDEX_FILE} puts {name!r} in {shard}, which lacks it.")
          tensors[name] = shard_tensors[name]
    return tensors
  hint = ""
  if any(path.glob("*.bin")):
    hint = (" Only safetensors are read: re-save the model with "
            "`save_pretrained(dir, safe_serialization=True)`.")
  raise HFCheckpointError(
      f"No {SINGLE_FILE} or {INDEX_FILE} in {path}.{hint}")


def read_hf_config(path) -> Dict[str, Any]:
  config_path = pathlib.Path(path) / CONFIG_FILE
  if not config_path.is_file():
    raise HFCheckpointError(f"No {CONFIG_FILE} in {path}: a Hugging Face "
                            "checkpoint directory holds config.json and the "
                            "safetensors files.")
  return json.loads(config_path.read_text())


def _architecture(hf_config) -> str:
  archs = hf_config.get("architectures") or []
  if not archs and hf_config.get("model_type") in _MODEL_TYPES:
    archs = [_MODEL_TYPES[hf_config["model_type"]]]
  for arch in archs:
    if arch in SUPPORTED_ARCHITECTURES:
      return arch
  raise HFCheckpointError(
      f"Unsupported architecture {archs or hf_config.get('model_type')!r} "
      f"in config.json; supported: {list(SUPPORTED_ARCHITECTURES)}.")


def _get(hf_config, key, default=dataclasses.MISSING):
  if key in hf_config and hf_config[key] is not None:
    return hf_config[key]
  if default is dataclasses.MISSING:
    raise HFCheckpointError(f"config.json lacks the required key {key!r}.")
  return default


def _unsupported(arch, what):
  raise HFCheckpointError(f"{arch}: {what} is not supported by jaxrlhf's "
                          "model of this family.")


# ----------------------------------------------------------------------------
# Config translation.

def _rope_parameters(hf_config):
  """(theta, rope dict) from 4.x (rope_theta/rope_scaling) or 5.x
  (rope_parameters) keys."""
  rope = dict(hf_config.get("rope_parameters") or {})
  rope.update(hf_config.get("rope_scaling") or {})
  return rope


def _llama_config_from_hf(hf):
  if _get(hf, "hidden_act", "silu") != "silu":
    _unsupported(LLAMA, f"hidden_act={hf['hidden_act']!r} (only 'silu')")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      _unsupported(LLAMA, f"{key}=true (projection biases)")
  num_heads = _get(hf, "num_attention_heads")
  hidden = _get(hf, "hidden_size")
  rope = _rope_parameters(hf)
  theta = float(_get(hf, "rope_theta", rope.get("rope_theta", 10000.0)))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    scaling = None
  elif rope_type == "llama3":
    scaling = layers.RopeScaling(
        kind="llama3", factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_length=int(rope["original_max_position_embeddings"]))
  elif rope_type == "linear":
    scaling = layers.RopeScaling(kind="linear", factor=float(rope["factor"]))
  else:
    _unsupported(LLAMA, f"rope type {rope_type!r} (default, llama3, linear)")
  return llama.LlamaConfig(
      vocab_size=_get(hf, "vocab_size"),
      emb_dim=hidden,
      num_heads=num_heads,
      num_kv_heads=_get(hf, "num_key_value_heads", num_heads),
      num_layers=_get(hf, "num_hidden_layers"),
      head_dim=_get(hf, "head_dim", hidden // num_heads),
      mlp_dim=_get(hf, "intermediate_size"),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_epsilon=float(_get(hf, "rms_norm_eps", 1e-6)),
      tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
      max_length=_get(hf, "max_position_embeddings", 2048))


def _neox_config_from_hf(hf):
  rope = _rope_parameters(hf)
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    _unsupported(GPT_NEOX, f"rope scaling {rope}")
  if not _get(hf, "attention_bias", True):
    _unsupported(GPT_NEOX, "attention_bias=false")
  if _get(hf, "tie_word_embeddings", False):
    _unsupported(GPT_NEOX, "tie_word_embeddings=true")
  act = _get(hf, "hidden_act", "gelu")
  if act not in layers.ACTIVATIONS:
    _unsupported(GPT_NEOX, f"hidden_act={act!r} (choose from "
                 f"{sorted(layers.ACTIVATIONS)})")
  return gpt_neox.GPTNeoXConfig(
      vocab_size=_get(hf, "vocab_size"),
      emb_dim=_get(hf, "hidden_size"),
      num_heads=_get(hf, "num_attention_heads"),
      num_layers=_get(hf, "num_hidden_layers"),
      mlp_dim=_get(hf, "intermediate_size"),
      rotary_pct=float(_get(hf, "rotary_pct",
                            rope.get("partial_rotary_factor", 0.25))),
      rope_theta=float(_get(hf, "rotary_emb_base",
                            rope.get("rope_theta", 10000.0))),
      use_parallel_residual=bool(_get(hf, "use_parallel_residual", True)),
      norm_epsilon=float(_get(hf, "layer_norm_eps", 1e-5)),
      mlp_activation=act,
      max_length=_get(hf, "max_position_embeddings", 2048))


def _t5_module():
  try:
    from jaxrlhf.models import t5  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise HFCheckpointError("T5 checkpoints need jaxrlhf.models.t5, which "
                            f"failed to import: {e}") from e
  return t5


def _t5_scales_logits(hf) -> bool:
  # 4.x: tie_word_embeddings (default true) both ties and scales by
  # d_model**-0.5; 5.x always ties and keeps the scaling switch separately.
  if "scale_decoder_outputs" in hf:
    return bool(hf["scale_decoder_outputs"])
  return bool(_get(hf, "tie_word_embeddings", True))


def _t5_config_from_hf(hf):
  proj = _get(hf, "feed_forward_proj", "relu")
  if proj not in _T5_ACTIVATIONS:
    _unsupported(T5, f"feed_forward_proj={proj!r} (choose from "
                 f"{sorted(_T5_ACTIVATIONS)})")
  eps = float(_get(hf, "layer_norm_epsilon", 1e-6))
  if eps != 1e-6:
    _unsupported(T5, f"layer_norm_epsilon={eps} (t5x fixes 1e-6)")
  num_layers = _get(hf, "num_layers")
  return _t5_module().T5Config(
      vocab_size=_get(hf, "vocab_size"),
      emb_dim=_get(hf, "d_model"),
      num_heads=_get(hf, "num_heads"),
      num_encoder_layers=num_layers,
      num_decoder_layers=_get(hf, "num_decoder_layers", num_layers),
      head_dim=_get(hf, "d_kv"),
      mlp_dim=_get(hf, "d_ff"),
      mlp_activations=_T5_ACTIVATIONS[proj],
      logits_via_embedding=_t5_scales_logits(hf),
      relpos_num_buckets=_get(hf, "relative_attention_num_buckets", 32),
      relpos_max_distance=_get(hf, "relative_attention_max_distance", 128),
      dtype="float32")


def config_from_hf(hf_config: Dict[str, Any], **overrides):
  """Our model config from a parsed HF config.json, with fields overridden
  (e.g. dtype='bfloat16', scan_layers=True)."""
  arch = _architecture(hf_config)
  config = {LLAMA: _llama_config_from_hf, GPT_NEOX: _neox_config_from_hf,
            T5: _t5_config_from_hf}[arch](hf_config)
  return _replace(config, overrides)


def _replace(config, overrides):
  fields = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"{type(config).__name__} has no field(s) {unknown}; "
                     f"fields: {sorted(fields)}.")
  return dataclasses.replace(config, **overrides)


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def config_to_hf(config, dtype: str = "float32") -> Dict[str, Any]:
  """The HF config.json dict for our model config (transformers 4.x keys,
  which 5.x also reads)."""
  if isinstance(config, llama.LlamaConfig):
    hf = {
        "architectures": [LLAMA], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.emb_dim,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_length,
        "attention_bias": False, "mlp_bias": False,
    }
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "llama3":
      hf["rope_scaling"] = {
          "rope_type": "llama3", "factor": scaling.factor,
          "low_freq_factor": scaling.low_freq_factor,
          "high_freq_factor": scaling.high_freq_factor,
          "original_max_position_embeddings": scaling.original_max_length}
    elif scaling is not None:
      hf["rope_scaling"] = {"rope_type": "linear", "factor": scaling.factor}
  elif isinstance(config, gpt_neox.GPTNeoXConfig):
    hf = {
        "architectures": [GPT_NEOX], "model_type": "gpt_neox",
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
    }
  elif _is_t5_config(config):
    activations = tuple(config.mlp_activations)
    proj = {v: k for k, v in _T5_ACTIVATIONS.items()}.get(activations)
    if proj is None:
      raise HFCheckpointError(
          f"T5 mlp_activations={activations} has no HF feed_forward_proj; "
          f"exportable: {sorted(_T5_ACTIVATIONS.values())}.")
    hf = {
        "architectures": [T5], "model_type": "t5",
        "vocab_size": config.vocab_size, "d_model": config.emb_dim,
        "d_kv": config.head_dim, "d_ff": config.mlp_dim,
        "num_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relpos_num_buckets,
        "relative_attention_max_distance": config.relpos_max_distance,
        "feed_forward_proj": proj, "layer_norm_epsilon": 1e-6,
        "dropout_rate": 0.0, "is_encoder_decoder": True,
        # 4.x reads the logit scaling from tie_word_embeddings, 5.x from
        # scale_decoder_outputs.
        "tie_word_embeddings": bool(config.logits_via_embedding),
        "scale_decoder_outputs": bool(config.logits_via_embedding),
        "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
    }
  else:
    raise HFCheckpointError(
        f"No Hugging Face export for config type {type(config).__name__}.")
  hf["torch_dtype"] = dtype
  return hf


def _is_t5_config(config) -> bool:
  return type(config).__name__ == "T5Config" and hasattr(
      config, "num_encoder_layers")


def model_for_config(config) -> nn.Module:
  """The Flax module a config describes (Llama, GPTNeoX or T5)."""
  if isinstance(config, llama.LlamaConfig):
    return llama.Llama(config)
  if isinstance(config, gpt_neox.GPTNeoXConfig):
    return gpt_neox.GPTNeoX(config)
  if _is_t5_config(config):
    return _t5_module().T5(config)
  raise TypeError(f"No model for config type {type(config).__name__}.")


# ----------------------------------------------------------------------------
# Name/shape mappings. Each family has:
#   _<family>_hf_shapes(config) -> {hf name: shape} (what the file must hold)
#   _<family>_from_hf(config, tensors) -> params (unrolled, t5x layout)
#   _<family>_to_hf(config, params) -> {hf name: array}

def _t(w):
  """torch Linear weight [out, in] <-> kernel [in, out]."""
  return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def _llama_hf_shapes(cfg, with_lm_head):
  d, h = cfg.emb_dim, cfg.head_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d),
            "model.norm.weight": (d,)}
  if with_lm_head:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (cfg.num_heads * h, d),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * h, d),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * h, d),
        p + "self_attn.o_proj.weight": (d, cfg.num_heads * h),
        p + "mlp.gate_proj.weight": (cfg.mlp_dim, d),
        p + "mlp.up_proj.weight": (cfg.mlp_dim, d),
        p + "mlp.down_proj.weight": (d, cfg.mlp_dim),
    })
  return shapes


def _llama_from_hf(cfg, t):
  d, h = cfg.emb_dim, cfg.head_dim
  dec = {"token_embedder": {"embedding": t["model.embed_tokens.weight"]},
         "decoder_norm": {"scale": t["model.norm.weight"]}}
  if not cfg.tie_embeddings:
    dec["logits_dense"] = {"kernel": _t(t["lm_head.weight"])}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    dec[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {
            "scale": t[p + "input_layernorm.weight"]},
        "self_attention": {
            "query": {"kernel": _t(t[p + "self_attn.q_proj.weight"]).reshape(
                d, cfg.num_heads, h)},
            "key": {"kernel": _t(t[p + "self_attn.k_proj.weight"]).reshape(
                d, cfg.num_kv_heads, h)},
            "value": {"kernel": _t(t[p + "self_attn.v_proj.weight"]).reshape(
                d, cfg.num_kv_heads, h)},
            "out": {"kernel": _t(t[p + "self_attn.o_proj.weight"]).reshape(
                cfg.num_heads, h, d)},
        },
        "pre_mlp_layer_norm": {"scale": t[p + "post_attention_layernorm.weight"]},
        "mlp": {"wi_0": {"kernel": _t(t[p + "mlp.gate_proj.weight"])},
                "wi_1": {"kernel": _t(t[p + "mlp.up_proj.weight"])},
                "wo": {"kernel": _t(t[p + "mlp.down_proj.weight"])}},
    }
  return {"decoder": dec}


def _llama_to_hf(cfg, params):
  dec = params["decoder"]
  d = cfg.emb_dim
  t = {"model.embed_tokens.weight": dec["token_embedder"]["embedding"],
       "model.norm.weight": dec["decoder_norm"]["scale"]}
  if not cfg.tie_embeddings:
    t["lm_head.weight"] = _t(dec["logits_dense"]["kernel"])
  for i in range(cfg.num_layers):
    p, layer = f"model.layers.{i}.", dec[f"layers_{i}"]
    attn, mlp = layer["self_attention"], layer["mlp"]
    t.update({
        p + "input_layernorm.weight":
            layer["pre_self_attention_layer_norm"]["scale"],
        p + "post_attention_layernorm.weight":
            layer["pre_mlp_layer_norm"]["scale"],
        p + "self_attn.q_proj.weight": _t(attn["query"]["kernel"].reshape(d, -1)),
        p + "self_attn.k_proj.weight": _t(attn["key"]["kernel"].reshape(d, -1)),
        p + "self_attn.v_proj.weight": _t(attn["value"]["kernel"].reshape(d, -1)),
        p + "self_attn.o_proj.weight": _t(attn["out"]["kernel"].reshape(-1, d)),
        p + "mlp.gate_proj.weight": _t(mlp["wi_0"]["kernel"]),
        p + "mlp.up_proj.weight": _t(mlp["wi_1"]["kernel"]),
        p + "mlp.down_proj.weight": _t(mlp["wo"]["kernel"]),
    })
  return t


def _neox_hf_shapes(cfg):
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
        p + "mlp.dense_h_to_4h.weight": (f, d), p + "mlp.dense_h_to_4h.bias": (f,),
        p + "mlp.dense_4h_to_h.weight": (d, f), p + "mlp.dense_4h_to_h.bias": (d,),
    })
  return shapes


def _neox_from_hf(cfg, t):
  d, n, h = cfg.emb_dim, cfg.num_heads, cfg.head_dim
  dec = {"token_embedder": {"embedding": t["gpt_neox.embed_in.weight"]},
         "decoder_norm": {"scale": t["gpt_neox.final_layer_norm.weight"],
                          "bias": t["gpt_neox.final_layer_norm.bias"]},
         "logits_dense": {"kernel": _t(t["embed_out.weight"])}}
  for i in range(cfg.num_layers):
    p = f"gpt_neox.layers.{i}."
    # The fused projection's output index is head * 3h + {q,k,v} * h + channel
    # (HF views it as [..., heads, 3 * head_size] and chunks the last axis).
    qkv = _t(t[p + "attention.query_key_value.weight"]).reshape(d, n, 3, h)
    qkv_bias = t[p + "attention.query_key_value.bias"].reshape(n, 3, h)
    attn = {name: {"kernel": np.ascontiguousarray(qkv[:, :, j]),
                   "bias": np.ascontiguousarray(qkv_bias[:, j])}
            for j, name in enumerate(("query", "key", "value"))}
    attn["out"] = {"kernel": _t(t[p + "attention.dense.weight"]).reshape(n, h, d),
                   "bias": t[p + "attention.dense.bias"]}
    dec[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {
            "scale": t[p + "input_layernorm.weight"],
            "bias": t[p + "input_layernorm.bias"]},
        "pre_mlp_layer_norm": {
            "scale": t[p + "post_attention_layernorm.weight"],
            "bias": t[p + "post_attention_layernorm.bias"]},
        "self_attention": attn,
        "mlp": {"wi": {"kernel": _t(t[p + "mlp.dense_h_to_4h.weight"]),
                       "bias": t[p + "mlp.dense_h_to_4h.bias"]},
                "wo": {"kernel": _t(t[p + "mlp.dense_4h_to_h.weight"]),
                       "bias": t[p + "mlp.dense_4h_to_h.bias"]}},
    }
  return {"decoder": dec}


def _neox_to_hf(cfg, params):
  dec = params["decoder"]
  d = cfg.emb_dim
  t = {"gpt_neox.embed_in.weight": dec["token_embedder"]["embedding"],
       "gpt_neox.final_layer_norm.weight": dec["decoder_norm"]["scale"],
       "gpt_neox.final_layer_norm.bias": dec["decoder_norm"]["bias"],
       "embed_out.weight": _t(dec["logits_dense"]["kernel"])}
  for i in range(cfg.num_layers):
    p, layer = f"gpt_neox.layers.{i}.", dec[f"layers_{i}"]
    attn, mlp = layer["self_attention"], layer["mlp"]
    qkv = np.stack([attn[k]["kernel"] for k in ("query", "key", "value")],
                   axis=2)  # [d, heads, 3, head_dim]
    qkv_bias = np.stack([attn[k]["bias"] for k in ("query", "key", "value")],
                        axis=1)  # [heads, 3, head_dim]
    t.update({
        p + "input_layernorm.weight":
            layer["pre_self_attention_layer_norm"]["scale"],
        p + "input_layernorm.bias": layer["pre_self_attention_layer_norm"]["bias"],
        p + "post_attention_layernorm.weight":
            layer["pre_mlp_layer_norm"]["scale"],
        p + "post_attention_layernorm.bias": layer["pre_mlp_layer_norm"]["bias"],
        p + "attention.query_key_value.weight": _t(qkv.reshape(d, -1)),
        p + "attention.query_key_value.bias": qkv_bias.reshape(-1),
        p + "attention.dense.weight": _t(attn["out"]["kernel"].reshape(-1, d)),
        p + "attention.dense.bias": attn["out"]["bias"],
        p + "mlp.dense_h_to_4h.weight": _t(mlp["wi"]["kernel"]),
        p + "mlp.dense_h_to_4h.bias": mlp["wi"]["bias"],
        p + "mlp.dense_4h_to_h.weight": _t(mlp["wo"]["kernel"]),
        p + "mlp.dense_4h_to_h.bias": mlp["wo"]["bias"],
    })
  return t


def _t5_mlp_names(cfg):
  acts = tuple(cfg.mlp_activations)
  return ["wi"] if len(acts) == 1 else [f"wi_{i}" for i in range(len(acts))]


def _t5_hf_shapes(cfg, with_lm_head):
  """HF names and shapes. HF keeps one relative-position table per stack, in
  block 0's self-attention, as [buckets, heads]."""
  d, inner, f = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  shapes = {"shared.weight": (cfg.vocab_size, d),
            "encoder.final_layer_norm.weight": (d,),
            "decoder.final_layer_norm.weight": (d,)}
  if with_lm_head:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  relpos = (cfg.relpos_num_buckets, cfg.num_heads)
  shapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = relpos
  shapes["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = relpos

  def attention(prefix):
    return {prefix + "q.weight": (inner, d), prefix + "k.weight": (inner, d),
            prefix + "v.weight": (inner, d), prefix + "o.weight": (d, inner)}

  def mlp(prefix):
    out = {prefix + f"{name}.weight": (f, d) for name in _t5_mlp_names(cfg)}
    out[prefix + "wo.weight"] = (d, f)
    return out

  for i in range(cfg.num_encoder_layers):
    p = f"encoder.block.{i}.layer."
    shapes.update(attention(p + "0.SelfAttention."))
    shapes.update(mlp(p + "1.DenseReluDense."))
    shapes[p + "0.layer_norm.weight"] = (d,)
    shapes[p + "1.layer_norm.weight"] = (d,)
  for i in range(cfg.num_decoder_layers):
    p = f"decoder.block.{i}.layer."
    shapes.update(attention(p + "0.SelfAttention."))
    shapes.update(attention(p + "1.EncDecAttention."))
    shapes.update(mlp(p + "2.DenseReluDense."))
    for j in range(3):
      shapes[p + f"{j}.layer_norm.weight"] = (d,)
  return shapes


_T5_ATTENTION = {"query": "q", "key": "k", "value": "v", "out": "o"}


def _t5_from_hf(cfg, t):
  """t5x layout; attention kernels stay 2-D [in, out] (joined heads)."""
  def attention(prefix):
    return {ours: {"kernel": _t(t[prefix + f"{hf}.weight"])}
            for ours, hf in _T5_ATTENTION.items()}

  def mlp(prefix):
    out = {name: {"kernel": _t(t[prefix + f"{name}.weight"])}
           for name in _t5_mlp_names(cfg)}
    out["wo"] = {"kernel": _t(t[prefix + "wo.weight"])}
    return out

  encoder = {
      "relpos_bias": {"rel_embedding": _t(t[
          "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"])},
      "encoder_norm": {"scale": t["encoder.final_layer_norm.weight"]}}
  for i in range(cfg.num_encoder_layers):
    p = f"encoder.block.{i}.layer."
    encoder[f"layers_{i}"] = {
        "pre_attention_layer_norm": {"scale": t[p + "0.layer_norm.weight"]},
        "attention": attention(p + "0.SelfAttention."),
        "pre_mlp_layer_norm": {"scale": t[p + "1.layer_norm.weight"]},
        "mlp": mlp(p + "1.DenseReluDense."),
    }
  decoder = {
      "relpos_bias": {"rel_embedding": _t(t[
          "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"])},
      "decoder_norm": {"scale": t["decoder.final_layer_norm.weight"]}}
  for i in range(cfg.num_decoder_layers):
    p = f"decoder.block.{i}.layer."
    decoder[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {"scale": t[p + "0.layer_norm.weight"]},
        "self_attention": attention(p + "0.SelfAttention."),
        "pre_cross_attention_layer_norm": {
            "scale": t[p + "1.layer_norm.weight"]},
        "encoder_decoder_attention": attention(p + "1.EncDecAttention."),
        "pre_mlp_layer_norm": {"scale": t[p + "2.layer_norm.weight"]},
        "mlp": mlp(p + "2.DenseReluDense."),
    }
  if not cfg.logits_via_embedding:
    decoder["logits_dense"] = {"kernel": _t(t["lm_head.weight"])}
  return {"token_embedder": {"embedding": t["shared.weight"]},
          "encoder": encoder, "decoder": decoder}


def _t5_to_hf(cfg, params):
  enc, dec = params["encoder"], params["decoder"]

  def attention(prefix, p):
    return {prefix + f"{hf}.weight": _t(p[ours]["kernel"])
            for ours, hf in _T5_ATTENTION.items()}

  def mlp(prefix, p):
    out = {prefix + f"{name}.weight": _t(p[name]["kernel"])
           for name in _t5_mlp_names(cfg)}
    out[prefix + "wo.weight"] = _t(p["wo"]["kernel"])
    return out

  t = {"shared.weight": params["token_embedder"]["embedding"],
       "encoder.final_layer_norm.weight": enc["encoder_norm"]["scale"],
       "decoder.final_layer_norm.weight": dec["decoder_norm"]["scale"],
       "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
           _t(enc["relpos_bias"]["rel_embedding"]),
       "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
           _t(dec["relpos_bias"]["rel_embedding"])}
  if not cfg.logits_via_embedding:
    t["lm_head.weight"] = _t(dec["logits_dense"]["kernel"])
  for i in range(cfg.num_encoder_layers):
    p, layer = f"encoder.block.{i}.layer.", enc[f"layers_{i}"]
    t.update(attention(p + "0.SelfAttention.", layer["attention"]))
    t.update(mlp(p + "1.DenseReluDense.", layer["mlp"]))
    t[p + "0.layer_norm.weight"] = layer["pre_attention_layer_norm"]["scale"]
    t[p + "1.layer_norm.weight"] = layer["pre_mlp_layer_norm"]["scale"]
  for i in range(cfg.num_decoder_layers):
    p, layer = f"decoder.block.{i}.layer.", dec[f"layers_{i}"]
    t.update(attention(p + "0.SelfAttention.", layer["self_attention"]))
    t.update(attention(p + "1.EncDecAttention.",
                       layer["encoder_decoder_attention"]))
    t.update(mlp(p + "2.DenseReluDense.", layer["mlp"]))
    t[p + "0.layer_norm.weight"] = layer["pre_self_attention_layer_norm"]["scale"]
    t[p + "1.layer_norm.weight"] = layer["pre_cross_attention_layer_norm"]["scale"]
    t[p + "2.layer_norm.weight"] = layer["pre_mlp_layer_norm"]["scale"]
  return t


# ----------------------------------------------------------------------------
# Checks.

def _check_tensors(arch, shapes, tensors, where):
  """Every name in `shapes` present with that shape, nothing else but the
  known ignorable buffers; one error listing every problem."""
  ignored = [re.compile(p) for p in _IGNORED[arch]]
  missing = sorted(n for n in shapes if n not in tensors)
  mismatched = sorted(
      f"{n}: expected {tuple(shapes[n])}, found {tuple(tensors[n].shape)}"
      for n in shapes if n in tensors
      and tuple(tensors[n].shape) != tuple(shapes[n]))
  unexpected = sorted(n for n in tensors if n not in shapes
                      and not any(p.fullmatch(n) for p in ignored))
  problems = []
  if missing:
    problems.append(f"missing weights ({len(missing)}): " + ", ".join(missing))
  if mismatched:
    problems.append("shape mismatch: " + "; ".join(mismatched))
  if unexpected:
    problems.append(
        f"unexpected weights ({len(unexpected)}), which this {arch} mapping "
        "does not use (a variant of the architecture we do not model?): "
        + ", ".join(unexpected))
  if problems:
    raise HFCheckpointError(f"{where} does not match its config.json: "
                            + " | ".join(problems))


def _flatten(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _dummy_inputs(config):
  one = jnp.ones((1, 1), jnp.int32)
  if _is_t5_config(config):
    return (one, one, one)
  return (one, jnp.zeros((1, 1), jnp.int32), one)


def _param_shapes(config):
  model = model_for_config(config)
  variables = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs(config)))
  params = nn.meta.unbox(variables["params"])
  return {k: tuple(v.shape) for k, v in _flatten(params).items()}


_cached_param_shapes = functools.lru_cache(maxsize=64)(_param_shapes)


def expected_param_shapes(config) -> Dict[str, Tuple[int, ...]]:
  """{'a/b/c': shape} of the model's parameters (no compute: eval_shape;
  cached per config, since tracing a deep unscanned model takes a while)."""
  try:
    hash(config)
  except TypeError:  # e.g. a list-valued field
    return _param_shapes(config)
  return dict(_cached_param_shapes(config))


def check_params(config, params, where="params"):
  """Raises HFCheckpointError naming every missing, unexpected or mis-shaped
  parameter of `params` for the model `config` describes."""
  expected = expected_param_shapes(config)
  found = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  missing = sorted(set(expected) - set(found))
  unexpected = sorted(set(found) - set(expected))
  mismatched = sorted(f"{k}: expected {expected[k]}, found {found[k]}"
                      for k in set(expected) & set(found)
                      if expected[k] != found[k])
  problems = []
  if missing:
    problems.append(f"missing parameters: {', '.join(missing)}")
  if unexpected:
    problems.append(f"unexpected parameters: {', '.join(unexpected)}")
  if mismatched:
    problems.append("shape mismatch: " + "; ".join(mismatched))
  if problems:
    raise HFCheckpointError(
        f"{where} do not fit {type(config).__name__}: " + " | ".join(problems))


# ----------------------------------------------------------------------------
# Import.

def _resolve_output_layer(arch, config, tensors):
  """Reconciles the config's output-layer tying with what the file holds.

  As transformers does, a separate output matrix that differs from the
  embedding wins over a config that says tied; a tied config with an equal
  copy of the embedding is tied.
  """
  if arch == LLAMA:
    head = tensors.get("lm_head.weight")
    if config.tie_embeddings and head is not None and not np.array_equal(
        head, tensors.get("model.embed_tokens.weight")):
      config = dataclasses.replace(config, tie_embeddings=False)
    return config, tensors
  if arch == T5:
    head = tensors.get("lm_head.weight")
    shared = tensors.get("shared.weight")
    if shared is None:
      # Some exports keep only the encoder's copy of the shared embedding.
      shared = tensors.get("encoder.embed_tokens.weight")
      if shared is not None:
        tensors = dict(tensors, **{"shared.weight": shared})
    if config.logits_via_embedding:
      if head is not None and shared is not None and not np.array_equal(
          head, shared):
        # Scaled logits from a separate head: t5x has no such model, but
        # h * d**-0.5 @ W == h @ (W * d**-0.5), so fold the scale in.
        scale = np.float32(config.emb_dim ** -0.5)
        tensors = dict(tensors, **{"lm_head.weight": head * scale})
        config = dataclasses.replace(config, logits_via_embedding=False)
    elif head is None and shared is not None:
      # transformers 5 ties T5 1.1's lm_head to the embedding without scaling.
      tensors = dict(tensors, **{"lm_head.weight": shared})
  return config, tensors


def from_hf_tensors(config, tensors: Dict[str, np.ndarray],
                           where: str = "checkpoint"):
  """(config, params) from HF-named tensors (as `read_safetensors` gives).

  params are float32 numpy arrays (unboxed), layers stacked when
  `config.scan_layers`. The returned config equals the given one except where
  the file decides the output layer: a separate output matrix that differs
  from the embedding unties it (as transformers does).
  """
  if isinstance(config, llama.LlamaConfig):
    arch = LLAMA
  elif isinstance(config, gpt_neox.GPTNeoXConfig):
    arch = GPT_NEOX
  elif _is_t5_config(config):
    arch = T5
  else:
    raise TypeError(f"No HF mapping for config type {type(config).__name__}.")
  config, tensors = _resolve_output_layer(arch, config, tensors)
  if arch == LLAMA:
    shapes = _llama_hf_shapes(config, not config.tie_embeddings)
    if config.tie_embeddings and "lm_head.weight" in tensors:
      shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    from_hf = _llama_from_hf
  elif arch == GPT_NEOX:
    shapes, from_hf = _neox_hf_shapes(config), _neox_from_hf
  else:
    shapes = _t5_hf_shapes(config, not config.logits_via_embedding)
    if config.logits_via_embedding and "lm_head.weight" in tensors:
      shapes["lm_head.weight"] = shapes["shared.weight"]
    from_hf = _t5_from_hf
  _check_tensors(arch, shapes, tensors, where)
  as_f32 = {n: np.asarray(v, dtype=np.float32) for n, v in tensors.items()
            if n in shapes}
  params = from_hf(config, as_f32)
  if getattr(config, "scan_layers", False):
    params = layers.stack_layer_params(params, config.num_layers, "decoder")
  check_params(config, params, where=f"parameters mapped from {where}")
  return config, params


def load_hf_checkpoint(path, **config_overrides):
  """Reads a Hugging Face checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or sharded
      model-*.safetensors with model.safetensors.index.json).
    **config_overrides: fields of our config to set, e.g. dtype='bfloat16',
      scan_layers=True, remat_policy='full', attention_impl='dot_product'.
  Returns:
    (config, params): a LlamaConfig, GPTNeoXConfig or t5.T5Config, and the
    parameter dict (float32 numpy arrays; `jax.device_put` them with the
    shardings you want) for `model_for_config(config).apply({'params': ...})`.
  Raises:
    HFCheckpointError: unsupported architecture or options, missing or
      unexpected weights, shape mismatches; the message names each tensor.
  """
  path = pathlib.Path(path)
  config = config_from_hf(read_hf_config(path), **config_overrides)
  tensors = read_safetensors(path)
  return from_hf_tensors(config, tensors, where=str(path))


# ----------------------------------------------------------------------------
# Export.

def _to_numpy_tree(params):
  params = nn.meta.unbox(params)
  if isinstance(params, flax.core.FrozenDict):
    params = flax.core.unfreeze(params)
  if set(params) == {"params"}:
    params = params["params"]
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)


_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                  "float16": np.float16}


def to_hf_tensors(config, params) -> Dict[str, np.ndarray]:
  """HF-named float32 tensors for our (boxed or unboxed) parameters."""
  params = _to_numpy_tree(params)
  check_params(config, params)
  if getattr(config, "scan_layers", False):
    params = layers.unstack_layer_params(params, "decoder")
  if isinstance(config, llama.LlamaConfig):
    tensors = _llama_to_hf(config, params)
  elif isinstance(config, gpt_neox.GPTNeoXConfig):
    tensors = _neox_to_hf(config, params)
  elif _is_t5_config(config):
    tensors = _t5_to_hf(config, params)
  else:
    raise TypeError(f"No HF mapping for config type {type(config).__name__}.")
  return {n: np.ascontiguousarray(v) for n, v in tensors.items()}


def export_hf_checkpoint(config, params, path, *, dtype: str = "float32",
                         max_shard_bytes: Optional[int] = None,
                         overwrite: bool = False):
  """Writes config.json and safetensors that `transformers` loads.

  Args:
    config: our model config (LlamaConfig, GPTNeoXConfig or t5.T5Config).
    params: the model's parameters (boxed or not, numpy or jax arrays,
      scanned or unrolled as the config says).
    path: output directory (created).
    dtype: stored dtype: 'float32', 'bfloat16' or 'float16'.
    max_shard_bytes: if set and the tensors are larger, write
      model-0000i-of-0000n.safetensors shards and model.safetensors.index.json.
    overwrite: replace safetensors files already in `path` (else an error).
  """
  if dtype not in _EXPORT_DTYPES:
    raise ValueError(f"export dtype={dtype!r}; choose one of "
                     f"{sorted(_EXPORT_DTYPES)}.")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  existing = sorted(path.glob("model*.safetensors*"))
  if existing:
    if not overwrite:
      raise FileExistsError(
          f"{path} already holds {[p.name for p in existing]}; pass "
          "overwrite=True or choose an empty directory.")
    for p in existing:
      p.unlink()
  tensors = {n: v.astype(_EXPORT_DTYPES[dtype])
             for n, v in to_hf_tensors(config, params).items()}
  hf_config = config_to_hf(config, dtype=dtype)
  (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2,
                                             sort_keys=True) + "\n")
  metadata = {"format": "pt"}  # transformers refuses archives without it
  total = sum(v.nbytes for v in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    safetensors_np.save_file(tensors, path / SINGLE_FILE, metadata=metadata)
    return path
  shards, current, current_bytes = [], {}, 0
  for name in sorted(tensors):
    size = tensors[name].nbytes
    if current and current_bytes + size > max_shard_bytes:
      shards.append(current)
      current, current_bytes = {}, 0
    current[name] = tensors[name]
    current_bytes += size
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors_np.save_file(shard, path / filename, metadata=metadata)
    weight_map.update({name: filename for name in shard})
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True)
                                 + "\n")
  return path
