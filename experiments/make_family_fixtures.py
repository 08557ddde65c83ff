"""Makes the parity fixtures of the Qwen2, Qwen3, Gemma 3, Mistral,
Qwen3-MoE and Mixtral families, and of Llama 3's rotary scaling, under
tests/fixtures/hf/.

Each is a randomly initialised `transformers` model built from a config
(no download), saved with `save_pretrained`, with `expected.npz` (the
float32 logits transformers computes for fixed left- and right-padded
inputs) and `generate.npz` (its greedy `generate` through its KV cache: 6
prompt positions and 8 new tokens, past every sliding window here, with an
EOS that stops a row), made by the same code as the other families'
fixtures (make_hf_fixtures.py, make_hf_generate_fixtures.py). Where there
is a window, the script checks that transformers generates otherwise when
the window is too wide to matter. The mixture-of-experts fixtures also
have `router.npz`: each MoE layer's router logits and transformers'
load-balancing loss (`aux_loss`, unscaled) for the inputs of expected.npz,
and the smallest gap between a token's k-th and (k+1)-th router logit (so
that no routing is a near tie). What each one exercises is in its
function's docstring; tests/test_hf_families.py and
tests/test_moe_families.py check them without torch, and load our export
of each back into transformers when torch is installed.

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


def qwen3_moe():
  """Qwen3-MoE-like: Qwen3's attention (q/k norms, head_dim 16 with hidden /
  heads = 8), 4 experts of width 16, top 2 with the weights left as the
  softmax gave them (norm_topk_prob false; Qwen3-30B-A3B's true is
  Mixtral's case), and 3 layers of which the middle one has a dense MLP of
  48 (mlp_only_layers), untied."""
  return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      max_position_embeddings=64, tie_word_embeddings=False,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager"))


def mixtral():
  """Mixtral-like: 4 experts of width 24 on every layer, top 2 with the
  weights renormalised, a sliding window (3) on every layer, grouped-query
  attention, untied."""
  return transformers.MixtralForCausalLM(transformers.MixtralConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
      num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
      rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      max_position_embeddings=64, tie_word_embeddings=False,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager"))


FIXTURES = {"qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3,
            "mistral": mistral, "llama3_rope": llama3_rope,
            "qwen3_moe": qwen3_moe, "mixtral": mixtral}
MOE = ("qwen3_moe", "mixtral")
# The embedding's scale after `_randomise` (N(0, 1)): at full scale it
# dominates the residual stream, and a tied output layer then repeats the
# input token; these scales give greedy generations that vary from step to
# step with top-1 margins far above float noise (`min_gap`).
EMBEDDING_SCALE = {"qwen2": 0.1, "qwen3": 0.3, "gemma3": 0.05,
                   "mistral": 0.3, "llama3_rope": 0.3, "qwen3_moe": 0.1,
                   "mixtral": 0.3}


def randomise_experts(model, seed: int):
  """The experts' fused [experts, out, in] tensors (transformers 5's
  in-memory layout), which `_randomise` takes for norm scales: ~ N(0,
  1/fan_in) as every other matrix."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if param.ndim == 3 and ".experts." in name:
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        param.copy_(noise / np.sqrt(param.shape[-1]))


def save_router(model, out: pathlib.Path):
  """router.npz: transformers' router logits of each MoE layer (float32
  [layers, batch, length, experts]) and its load-balancing loss over the
  real tokens, for expected.npz's inputs."""
  e = np.load(out / "expected.npz")
  with torch.no_grad():
    result = model(input_ids=torch.from_numpy(e["tokens"]).long(),
                   attention_mask=torch.from_numpy(e["attention_mask"]).long(),
                   position_ids=torch.from_numpy(e["positions"]).long(),
                   output_router_logits=True)
  batch, length = e["tokens"].shape
  logits = np.stack([r.float().numpy().reshape(batch, length, -1)
                     for r in result.router_logits])
  k = model.config.num_experts_per_tok
  real = logits[:, e["attention_mask"] == 1]
  top = np.sort(real, axis=-1)[..., ::-1]
  min_gap = float((top[..., k - 1] - top[..., k]).min())
  assert min_gap > 1e-3, min_gap  # no near tie decides an expert
  np.savez(out / "router.npz", router_logits=logits.astype(np.float32),
           aux_loss=np.float32(result.aux_loss.item()),
           min_gap=np.float32(min_gap))
  print(f"{out.name}: {len(logits)} MoE layers, aux loss "
        f"{result.aux_loss.item():.4f}, min router gap {min_gap:.4f}")


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
  if name in MOE:
    randomise_experts(model, seed + 5)
  with torch.no_grad():
    model.model.embed_tokens.weight.mul_(EMBEDDING_SCALE[name])
  out = root / name
  out.mkdir(parents=True, exist_ok=True)
  make_hf_fixtures._save_decoder_fixture(  # pylint: disable=protected-access
      model, out, np.random.default_rng(seed))
  if name in MOE:
    save_router(model, out)
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
