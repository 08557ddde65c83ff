"""Models: T5 encoder-decoder and the decoder-only families.

  build_model(config.model, task_vocab_size) -> (module, model_config)
  from_pretrained(path, mesh=..., rules=...) -> (module, model_config, params)
  export_hf(module_or_config, params, path)

Architectures (`config.model.arch`, with a preset name in `config.model.size`):
"t5" (`t5.T5_PRESETS`), "llama" (`llama.LLAMA_PRESETS`), "gpt_neox"
(`gpt_neox.PYTHIA_PRESETS`), "t5x_decoder_only"
(`t5x_decoder_only.T5X_DECODER_ONLY_PRESETS`). Sampling with a KV cache is in
`jaxrlhf.models.sampling`, the scoring API in `jaxrlhf.models.scoring`.
"""

import ml_collections

from jaxrlhf.models import gpt_neox
from jaxrlhf.models import llama
from jaxrlhf.models import t5
from jaxrlhf.models import t5x_decoder_only

ARCHITECTURES = ("t5", "llama", "gpt_neox", "t5x_decoder_only")

_T5_FIELDS = ("emb_dim", "num_heads", "num_encoder_layers",
              "num_decoder_layers", "head_dim", "mlp_dim")
# Speed options that configs may carry (read only when present).
_OPTIONAL_FIELDS = ("scan_layers", "attention_impl")
_MLP_ACTIVATIONS = {"gated-gelu": ("gelu", "linear"), "relu": ("relu",)}
# config.model.mlp's values.
MLP_TYPES = tuple(_MLP_ACTIVATIONS)


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """Rounds up so the vocab dimension shards evenly (t5x: 32100 -> 32128)."""
  return -(-vocab_size // multiple) * multiple


def _optional(model_cfg):
  return {f: model_cfg[f] for f in _OPTIONAL_FIELDS
          if f in model_cfg and model_cfg[f] is not None}


def _decoder_only_config(model_cfg, vocab_size):
  """The decoder-only config of `config.model`: the preset `size`, with the
  dimensions that are set overriding it."""
  arch = model_cfg.arch
  if model_cfg.get("num_encoder_layers") is not None:
    raise ValueError(f"config.model.num_encoder_layers: arch {arch!r} is "
                     "decoder-only; set num_decoder_layers for its depth.")
  dims = {"emb_dim": model_cfg.get("emb_dim"),
          "num_heads": model_cfg.get("num_heads"),
          "num_layers": model_cfg.get("num_decoder_layers"),
          "head_dim": model_cfg.get("head_dim"),
          "mlp_dim": model_cfg.get("mlp_dim")}
  overrides = {k: v for k, v in dims.items() if v is not None}
  overrides.update(vocab_size=vocab_size, dtype=model_cfg.dtype,
                   remat_policy=model_cfg.remat_policy, **_optional(model_cfg))
  if arch == "llama":
    # config.model has no num_kv_heads: a preset without grouped-query
    # attention keeps one key/value head per query head.
    preset = llama.LLAMA_PRESETS.get(model_cfg.size)
    if ("num_heads" in overrides and preset is not None
        and preset.num_kv_heads == preset.num_heads):
      overrides["num_kv_heads"] = overrides["num_heads"]
    return llama.Llama, llama.LlamaConfig.preset(model_cfg.size, **overrides)
  if arch == "gpt_neox":
    head_dim = overrides.pop("head_dim", None)
    config = gpt_neox.GPTNeoXConfig.preset(model_cfg.size, **overrides)
    if head_dim is not None and head_dim != config.head_dim:
      raise ValueError(
          f"config.model.head_dim: GPT-NeoX's head_dim is emb_dim / "
          f"num_heads = {config.head_dim}, not {head_dim}; unset it.")
    return gpt_neox.GPTNeoX, config
  # t5x_decoder_only
  mlp = model_cfg.get("mlp", "gated-gelu")
  if mlp not in _MLP_ACTIVATIONS:
    raise ValueError(f"config.model.mlp: {mlp!r}; use 'gated-gelu' or 'relu'.")
  if overrides.pop("scan_layers", False):
    raise ValueError(f"config.model.scan_layers: arch {arch!r} has no scanned "
                     "layout (t5x's decoder-only checkpoints are unscanned).")
  if overrides.pop("attention_impl", "xla") != "xla":
    raise ValueError(f"config.model.attention_impl: arch {arch!r} only has "
                     "the 'xla' attention.")
  overrides.update(mlp_activations=_MLP_ACTIVATIONS[mlp],
                   logits_via_embedding=model_cfg.logits_via_embedding,
                   dropout_rate=model_cfg.get("dropout_rate", 0.0))
  return (t5x_decoder_only.T5xDecoderOnly,
          t5x_decoder_only.T5xDecoderOnlyConfig.preset(model_cfg.size,
                                                       **overrides))


def build_model(model_cfg: ml_collections.ConfigDict, task_vocab_size: int):
  """The Flax module and its dataclass config from `config.model`.

  `model_cfg.arch` picks the family and `model_cfg.size` its preset; the
  dimension fields that are set (emb_dim, num_heads, head_dim, mlp_dim,
  num_encoder_layers / num_decoder_layers — for decoder-only the depth is
  num_decoder_layers) override the preset. The vocabulary is
  `model_cfg.vocab_size`, or the task's rounded up to a multiple of 128.
  `mlp` and `logits_via_embedding` apply to T5 and t5x_decoder_only (Llama
  and GPT-NeoX have fixed MLPs; Llama ties per preset). `scan_layers` and
  `attention_impl` are read when the config has them.
  """
  if model_cfg.arch not in ARCHITECTURES:
    raise ValueError(f"config.model.arch: {model_cfg.arch!r} is not supported; "
                     f"choose one of {ARCHITECTURES}.")
  vocab_size = model_cfg.vocab_size or padded_vocab_size(task_vocab_size)
  if vocab_size < task_vocab_size:
    raise ValueError(f"config.model.vocab_size {vocab_size} is smaller than the "
                     f"task vocabulary ({task_vocab_size}).")
  if model_cfg.arch != "t5":
    module_cls, config = _decoder_only_config(model_cfg, vocab_size)
    return module_cls(config), config
  overrides = {f: model_cfg[f] for f in _T5_FIELDS if model_cfg[f] is not None}
  config = t5.t5_config(
      model_cfg.size, vocab_size=vocab_size,
      mlp_activations=_MLP_ACTIVATIONS[model_cfg.mlp],
      logits_via_embedding=model_cfg.logits_via_embedding,
      dtype=model_cfg.dtype, dropout_rate=model_cfg.dropout_rate,
      remat_policy=model_cfg.remat_policy, **overrides,
      **_optional(model_cfg))
  return t5.T5(config), config


def from_pretrained(path, **kwargs):
  """(module, model_config, params) from a Hugging Face folder, a T5X
  checkpoint or a jaxrlhf workdir / orbax checkpoint, placed on `mesh` by
  logical axis names. See `jaxrlhf.models.loading.from_pretrained`."""
  from jaxrlhf.models import loading  # pylint: disable=g-import-not-at-top
  return loading.from_pretrained(path, **kwargs)


def export_hf(module_or_config, params, path, **kwargs):
  """Writes config.json + safetensors for `transformers`. See
  `jaxrlhf.models.loading.export_hf`."""
  from jaxrlhf.models import loading  # pylint: disable=g-import-not-at-top
  return loading.export_hf(module_or_config, params, path, **kwargs)
