"""Models: T5 encoder-decoder (and, in later modules, decoder-only families)."""

import ml_collections

from jaxrlhf.models import t5

_T5_FIELDS = ("emb_dim", "num_heads", "num_encoder_layers",
              "num_decoder_layers", "head_dim", "mlp_dim")


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """Rounds up so the vocab dimension shards evenly (t5x: 32100 -> 32128)."""
  return -(-vocab_size // multiple) * multiple


def build_model(model_cfg: ml_collections.ConfigDict, task_vocab_size: int):
  """The Flax module and its dataclass config from `config.model`."""
  if model_cfg.arch != "t5":
    raise ValueError(f"config.model.arch: {model_cfg.arch!r} is not supported.")
  vocab_size = model_cfg.vocab_size or padded_vocab_size(task_vocab_size)
  if vocab_size < task_vocab_size:
    raise ValueError(f"config.model.vocab_size {vocab_size} is smaller than the "
                     f"task vocabulary ({task_vocab_size}).")
  overrides = {f: model_cfg[f] for f in _T5_FIELDS if model_cfg[f] is not None}
  config = t5.t5_config(
      model_cfg.size, vocab_size=vocab_size,
      mlp_activations=(("gelu", "linear") if model_cfg.mlp == "gated-gelu"
                       else ("relu",)),
      logits_via_embedding=model_cfg.logits_via_embedding,
      dtype=model_cfg.dtype, dropout_rate=model_cfg.dropout_rate,
      remat_policy=model_cfg.remat_policy, **overrides)
  return t5.T5(config), config
