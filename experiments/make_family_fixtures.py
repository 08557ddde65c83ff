"""Makes the parity fixtures of the Qwen2, Qwen3, Gemma 3 and Mistral
families, and of Llama 3's rotary scaling, under tests/fixtures/hf/.

Each is a randomly initialised `transformers` model built from a config
(no download), saved with `save_pretrained`, with `expected.npz` (the
float32 logits transformers computes for fixed left- and right-padded
inputs) and `generate.npz` (its greedy `generate` through its KV cache: 6
prompt positions and 8 new tokens, past every sliding window here, with an
EOS that stops a row), made by the same code as the other families'
fixtures (make_hf_fixtures.py, make_hf_generate_fixtures.py). Where there
is a window, the script checks that transformers generates otherwise when
the window is too wide to matter. What each
one exercises is in its function's docstring; tests/test_hf_families.py
checks them without torch, and loads our export of each back into
transformers when torch is installed.

Needs torch and transformers (not dependencies of the library):

  pip install torch==2.13.0 transformers
  python experiments/make_family_fixtures.py [--root tests/fixtures/hf] \
      [--only qwen2 ...]
"""

import argparse
import pathlib

import numpy as np
import torch
import transformers

import make_hf_fixtures
import make_hf_generate_fixtures

VOCAB = make_hf_fixtures.VOCAB
SEED = 3579


def qwen2():
  """Qwen2.5-like: q/k/v biases (none on o_proj), tied embeddings, rotary
  base 1e6, grouped-query attention."""
  return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                          "rope_theta": 1e6},
      max_position_embeddings=64, tie_word_embeddings=True,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager"))


def qwen3():
  """Qwen3-like: q/k norms, no biases, head_dim 16 with hidden / heads = 8,
  untied (as Qwen3 8B), and Qwen's sliding window on the layers from
  max_window_layers (1) on, shorter than the inputs."""
  return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      use_sliding_window=True, sliding_window=3, max_window_layers=1,
      max_position_embeddings=64, tie_word_embeddings=False,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager"))


def gemma3():
  """Gemma 3-like text model: 7 layers in transformers' default pattern
  (five local, one global, one local: an odd count), a window of 3, q/k
  norms, rotary bases 1e6 (global, linearly scaled by 4) and 1e4 (local),
  query_pre_attn_scalar 6, no soft caps."""
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
      head_dim=8, query_pre_attn_scalar=6, sliding_window=3,
      rope_parameters={
          "full_attention": {"rope_type": "linear", "factor": 4.0,
                             "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": 1e4}},
      max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=2,
      eos_token_id=1, pad_token_id=0, attn_implementation="eager"))
  assert model.config.layer_types[5] == "full_attention"
  return model


def mistral():
  """Mistral-like: a sliding window (3) on every layer, grouped-query
  attention, untied."""
  return transformers.MistralForCausalLM(transformers.MistralConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      sliding_window=3, rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "default", "rope_theta": 1e4},
      max_position_embeddings=64, tie_word_embeddings=False,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager"))


def llama3_rope():
  """Llama 3.2-like: tied, `rope_type: llama3` with an original context of
  64 so that 16-wide heads have a frequency in each of its three bands
  (kept: wavelength 6.3 < 64 / 4; interpolated: 32 between 16 and 64;
  slowed 32 times: 167 and longer)."""
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
      rms_norm_eps=1e-5, max_position_embeddings=256,
      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                       "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64},
      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
      attn_implementation="eager"))


FIXTURES = {"qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3,
            "mistral": mistral, "llama3_rope": llama3_rope}
# The embedding's scale after `_randomise` (N(0, 1)): at full scale it
# dominates the residual stream, and a tied output layer then repeats the
# input token; these scales give greedy generations that vary from step to
# step with top-1 margins far above float noise (`min_gap`).
EMBEDDING_SCALE = {"qwen2": 0.1, "qwen3": 0.3, "gemma3": 0.05,
                   "mistral": 0.3, "llama3_rope": 0.3}


def check_window_matters(name, root: pathlib.Path):
  """transformers' greedy generation of the fixture with a window too wide
  to matter is another than the stored one: the stored generation (and
  the logits) exercise the sliding window."""
  g = dict(np.load(root / name / "generate.npz"))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      root / name, attn_implementation="eager", sliding_window=64)
  model.eval()
  inputs = {"input_ids": torch.from_numpy(g["prompt_tokens"]).long(),
            "attention_mask": torch.from_numpy(
                g["prompt_attention_mask"]).long()}
  ids, _ = make_hf_generate_fixtures._generate(  # pylint: disable=protected-access
      model, inputs, int(g["eos_id"]), False)
  assert not np.array_equal(ids, g["generated"]), name


def make(name, root: pathlib.Path, seed: int):
  torch.manual_seed(seed)
  model = FIXTURES[name]()
  make_hf_fixtures._randomise(model, seed)  # pylint: disable=protected-access
  with torch.no_grad():
    model.model.embed_tokens.weight.mul_(EMBEDDING_SCALE[name])
  out = root / name
  out.mkdir(parents=True, exist_ok=True)
  make_hf_fixtures._save_decoder_fixture(  # pylint: disable=protected-access
      model, out, np.random.default_rng(seed))
  make_hf_generate_fixtures.make(name, root, np.random.default_rng(seed + 1))
  if getattr(model.config, "sliding_window", None) is not None:
    check_window_matters(name, root)
  print(f"wrote {out}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=str(make_hf_fixtures.REPO / "tests"
                                            / "fixtures" / "hf"))
  parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES))
  args = parser.parse_args()
  for i, name in enumerate(FIXTURES):
    if not args.only or name in args.only:
      make(name, pathlib.Path(args.root), SEED + 10 * i)


if __name__ == "__main__":
  main()
