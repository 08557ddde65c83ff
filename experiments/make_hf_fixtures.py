"""Makes the tiny Hugging Face parity fixtures under tests/fixtures/hf/.

Each fixture is a randomly initialised `transformers` model saved with
`save_pretrained` (config.json + model.safetensors, float32), and beside it
`expected.npz`: fixed inputs and the float32 logits transformers computes for
them. The tests load the checkpoint with `jaxrlhf.models.hf_io` (no torch) and
compare logits, which checks the name/shape mapping, every transpose and
reshape, and the numerics (rotary pairing, norms, activations, masking).

Needs torch and transformers (not dependencies of the library):

  pip install torch==2.13.0 transformers
  python experiments/make_hf_fixtures.py [--out tests/fixtures/hf]

Weights are drawn with larger scales than HF's 0.02 initialiser, norms and
biases away from 1 and 0, so that every tensor changes the logits visibly.
"""

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 64
SEED = 1234


def _randomise(model: torch.nn.Module, seed: int):
  """Overwrites every parameter: matrices ~ N(0, 1/fan_in), norm scales
  ~ 1 + N(0, 0.2), biases ~ N(0, 0.1), embeddings ~ N(0, 1)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      shape = param.shape
      noise = torch.randn(shape, generator=gen, dtype=torch.float32)
      if "relative_attention_bias" in name:
        param.copy_(noise)
      elif ("embed" in name or "shared" in name) and "embed_out" not in name:
        param.copy_(noise)
      elif param.ndim == 2:
        param.copy_(noise / np.sqrt(shape[1]))
      elif name.endswith("bias"):
        param.copy_(0.1 * noise)
      else:  # norm scales
        param.copy_(1.0 + 0.2 * noise)


def _decoder_inputs(rng):
  """3 rows of 8: full, left-padded by 3, right-padded by 2."""
  batch, length = 3, 8
  tokens = rng.integers(2, VOCAB, size=(batch, length)).astype(np.int32)
  mask = np.ones((batch, length), np.int32)
  mask[1, :3] = 0
  mask[2, -2:] = 0
  tokens = np.where(mask == 1, tokens, 0).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)
  return tokens, positions, mask


def _save_decoder_fixture(model, out: pathlib.Path, rng):
  tokens, positions, mask = _decoder_inputs(rng)
  model.eval()
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(tokens).long(),
                   attention_mask=torch.from_numpy(mask).long(),
                   position_ids=torch.from_numpy(positions).long()).logits
  logits = logits.float().numpy()
  # Pad rows of a left-padded batch are undefined (and may be NaN); zero them.
  logits = np.where(mask[..., None] == 1, logits, 0.0).astype(np.float32)
  model.save_pretrained(out, safe_serialization=True)
  np.savez(out / "expected.npz", tokens=tokens, positions=positions,
           attention_mask=mask, logits=logits)


def make_llama_gqa(out, rng):
  """GQA (4 query / 2 kv heads), untied, Llama 3.1 rope scaling with a short
  original context so that all three frequency bands occur."""
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=128,
      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16},
      tie_word_embeddings=False, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(config)
  _randomise(model, SEED)
  _save_decoder_fixture(model, out, rng)


def make_llama_tied(out, rng):
  """Tied embeddings (Llama 3.2 style), head_dim (16) != hidden / heads (8)."""
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
      max_position_embeddings=64, tie_word_embeddings=True,
      attn_implementation="eager")
  model = transformers.LlamaForCausalLM(config)
  _randomise(model, SEED + 1)
  _save_decoder_fixture(model, out, rng)


def make_pythia(out, rng):
  """Pythia-like: parallel residual, rotary on 25% of each head (4 of 16)."""
  config = transformers.GPTNeoXConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
      rotary_emb_base=10000, use_parallel_residual=True,
      max_position_embeddings=64, layer_norm_eps=1e-5, hidden_act="gelu",
      tie_word_embeddings=False, attn_implementation="eager")
  model = transformers.GPTNeoXForCausalLM(config)
  _randomise(model, SEED + 2)
  _save_decoder_fixture(model, out, rng)


def make_neox_sequential(out, rng):
  """Sequential residual, rotary on half of each head."""
  config = transformers.GPTNeoXConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
      num_hidden_layers=1, num_attention_heads=4, rotary_pct=0.5,
      rotary_emb_base=1000, use_parallel_residual=False,
      max_position_embeddings=64, layer_norm_eps=1e-5, hidden_act="gelu",
      tie_word_embeddings=False, attn_implementation="eager")
  model = transformers.GPTNeoXForCausalLM(config)
  _randomise(model, SEED + 3)
  _save_decoder_fixture(model, out, rng)


def make_neox_odd_rotary(out, rng):
  """rotary_pct 0.25 of 12-wide heads: an odd rotary dimension (3), of which
  transformers rotates 4 channels with frequencies theta ** (-2i / 3)."""
  config = transformers.GPTNeoXConfig(
      vocab_size=VOCAB, hidden_size=24, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
      rotary_emb_base=10000, use_parallel_residual=True,
      max_position_embeddings=64, layer_norm_eps=1e-5, hidden_act="gelu",
      tie_word_embeddings=False, attn_implementation="eager")
  model = transformers.GPTNeoXForCausalLM(config)
  _randomise(model, SEED + 6)
  _save_decoder_fixture(model, out, rng)


def _t5_inputs(rng):
  """Right-padded encoder inputs ending in EOS (1) and decoder targets, with
  t5x's decoder inputs (targets shifted right, starting with 0)."""
  enc_lengths, dec_lengths = [9, 5], [6, 3]
  enc = np.zeros((2, 9), np.int32)
  dec_target = np.zeros((2, 6), np.int32)
  for i, (le, ld) in enumerate(zip(enc_lengths, dec_lengths)):
    enc[i, :le - 1] = rng.integers(2, VOCAB, size=le - 1)
    enc[i, le - 1] = 1
    dec_target[i, :ld - 1] = rng.integers(2, VOCAB, size=ld - 1)
    dec_target[i, ld - 1] = 1
  dec_input = np.zeros_like(dec_target)
  dec_input[:, 1:] = dec_target[:, :-1]
  return enc, dec_input, dec_target


def _save_t5_fixture(model, out, rng):
  enc, dec_input, dec_target = _t5_inputs(rng)
  model.eval()
  with torch.no_grad():
    logits = model(
        input_ids=torch.from_numpy(enc).long(),
        attention_mask=torch.from_numpy(enc > 0).long(),
        decoder_input_ids=torch.from_numpy(dec_input).long(),
        decoder_attention_mask=torch.from_numpy(dec_target > 0).long(),
    ).logits.float().numpy()
  logits = np.where((dec_target > 0)[..., None], logits, 0.0).astype(np.float32)
  model.save_pretrained(out, safe_serialization=True)
  np.savez(out / "expected.npz", encoder_input_tokens=enc,
           decoder_input_tokens=dec_input, decoder_target_tokens=dec_target,
           logits=logits)


def make_t5_gated(out, rng):
  """T5 1.1 / FLAN-T5 style: gated-gelu, separate lm_head, no logit scaling,
  fewer decoder than encoder layers, few relative-position buckets so that
  the inputs reach the logarithmic buckets."""
  config = transformers.T5Config(
      vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2,
      num_decoder_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
      relative_attention_num_buckets=8, relative_attention_max_distance=16,
      dropout_rate=0.0, tie_word_embeddings=False,
      attn_implementation="eager")
  model = transformers.T5ForConditionalGeneration(config)
  # Recent transformers ties lm_head to the embedding even for T5 1.1
  # configs; real T5 1.1 checkpoints have a separate lm_head, so untie it.
  model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
  _randomise(model, SEED + 4)
  _save_t5_fixture(model, out, rng)


def make_t5_relu_tied(out, rng):
  """T5 1.0 style: ReLU MLP, tied embedding with d_model**-0.5 logit scale."""
  config = transformers.T5Config(
      vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=1,
      num_decoder_layers=2, num_heads=2, feed_forward_proj="relu",
      relative_attention_num_buckets=32, relative_attention_max_distance=128,
      dropout_rate=0.0, tie_word_embeddings=True,
      attn_implementation="eager")
  model = transformers.T5ForConditionalGeneration(config)
  _randomise(model, SEED + 5)
  _save_t5_fixture(model, out, rng)


def make_t5_tied(out, rng):
  """T5 1.1 as transformers 5 saves it: gated-gelu, no logit scaling, and
  the output layer tied to the embedding (the file has no lm_head)."""
  config = transformers.T5Config(
      vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=1,
      num_decoder_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
      relative_attention_num_buckets=8, relative_attention_max_distance=16,
      dropout_rate=0.0, tie_word_embeddings=False,
      attn_implementation="eager")
  model = transformers.T5ForConditionalGeneration(config)
  assert model.lm_head.weight is model.shared.weight  # tied by transformers
  _randomise(model, SEED + 7)
  _save_t5_fixture(model, out, rng)


# tests/fixtures/hf/README.md (the versions are this script's; each
# fixture's config.json names the transformers that wrote it).
README = """\
Tiny random Hugging Face checkpoints, built by transformers from a config
(no download), and what transformers computed for them: `expected.npz`
(float32 logits of fixed left- and right-padded inputs) and, for most,
`generate.npz` (greedy `generate` through its KV cache). Made by
transformers {transformers}, torch {torch} (see each config.json).

- experiments/make_hf_fixtures.py: llama_gqa, llama_tied, pythia,
  neox_sequential, neox_odd_rotary, t5_gated, t5_relu_tied, t5_tied;
  experiments/make_hf_generate_fixtures.py: their generate.npz.
- experiments/make_gemma_fixtures.py: gemma2 (alternating local/global
  layers), gemma2_odd (three layers in the pattern its config lists).
- experiments/make_family_fixtures.py: qwen2, qwen3, gemma3, mistral,
  llama3_rope (Llama 3's rotary scaling, every band).

Each script's docstring says what its fixtures exercise; `--only NAME`
remakes one and leaves the others' files as they are.
"""

FIXTURES = {
    "llama_gqa": make_llama_gqa,
    "llama_tied": make_llama_tied,
    "pythia": make_pythia,
    "neox_sequential": make_neox_sequential,
    "t5_gated": make_t5_gated,
    "t5_relu_tied": make_t5_relu_tied,
    "neox_odd_rotary": make_neox_odd_rotary,
    "t5_tied": make_t5_tied,
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "hf"))
  parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES),
                      help="make only these fixtures (the others' files stay "
                      "byte for byte as they are)")
  args = parser.parse_args()
  torch.manual_seed(SEED)
  root = pathlib.Path(args.out)
  for i, (name, make) in enumerate(FIXTURES.items()):
    if args.only and name not in args.only:
      continue
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    make(out, np.random.default_rng(SEED + i))
    print(f"wrote {out}")
  (root / "README.md").write_text(README.format(
      transformers=transformers.__version__, torch=torch.__version__))
  total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
  print(json.dumps({"total_bytes": total}))


if __name__ == "__main__":
  main()
