"""Sampling throughput: our KV-cache sampler against transformers' generate.

For each family (T5 and Llama by default) one randomly initialised model of
about 60M parameters (T5 1.1 small's dimensions; a Llama of the same width
and depth) is sampled greedily, EOS disabled, from prompts of --prompt
tokens for --new tokens at each batch size, and the same weights, exported
with `hf_io.export_hf_checkpoint`, are run through `transformers.generate` (greedy, KV cache,
the same lengths, every row forced to the full length) in the same process
on the same threads. It prints tokens/s of both and their ratio, and on an
accelerator the fraction of the memory-bandwidth bound: every decode step
must read all parameters and the KV cache written so far, so a step cannot
take less than (parameter bytes + mean KV-cache bytes) / HBM bandwidth.

  python experiments/bench_sampling.py                       # CPU, both
  python experiments/bench_sampling.py --families=t5 --batches=32 --threads=2
  python experiments/bench_sampling.py --no_transformers     # ours only
  python experiments/bench_sampling.py --separate  # + projections unjoined
  python experiments/bench_sampling.py --new=1024 --segments=4  # + in chunks

Needs torch and transformers for the comparison (`pip install
torch==2.13.0 transformers`); without them (or with --no_transformers) only
our figures are printed. --threads pins both to the same number of CPU
threads (XLA's CPU client and torch's intra-op pool).
"""

import argparse
import os
import sys
import tempfile
import time

# Thread pinning must precede the first JAX and torch imports.
_ARGS = None


def _parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--families", default="t5,llama")
  p.add_argument("--batches", default="8,32,64")
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--vocab_size", type=int, default=32128)
  p.add_argument("--size", default="small", choices=("tiny", "small",
                                                      "large"),
                 help="small: about 60M parameters (T5 1.1 small's "
                 "dimensions); large: about 0.8-1B (T5 1.1 large, a Llama "
                 "3.2 1B-shaped model); tiny: a smoke test")
  p.add_argument("--dtype", default="float32",
                 help="compute dtype of ours and transformers' weights")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--threads", type=int, default=0,
                 help="CPU threads for both (0: all cores)")
  p.add_argument("--no_transformers", action="store_true")
  p.add_argument("--separate", action="store_true",
                 help="also time ours with each layer's projections read "
                 "apart (fuse_projections=False) and print the joined "
                 "ones' speed-up over it (they join where the weights are "
                 "cast: --dtype=bfloat16; with float32 both are the same "
                 "program)")
  p.add_argument("--segments", type=int, default=0,
                 help="also time ours with the decode steps in this many "
                 "segments, each step reading the KV cache written so far "
                 "(sampling's cache_segments; ours reads the whole cache "
                 "at every step), and print its speed-up (0: not)")
  p.add_argument("--profile", action="store_true",
                 help="trace one more call of our sampler at the largest "
                 "batch and print its kernels per decode step "
                 "(bench_common.kernel_profile)")
  p.add_argument("--hbm_gbps", type=float, default=0.0,
                 help="memory bandwidth in GB/s for the bound (0: from the "
                 "device kind)")
  return p.parse_args()


if __name__ == "__main__":
  _ARGS = _parse()
  if _ARGS.threads:
    os.sched_setaffinity(0, set(range(_ARGS.threads)))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=true "
                               f"intra_op_parallelism_threads={_ARGS.threads}")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_common  # noqa: E402
from jaxrlhf import console  # noqa: E402
from jaxrlhf.models import hf_io  # noqa: E402
from jaxrlhf.models import llama  # noqa: E402
from jaxrlhf.models import registry  # noqa: E402
from jaxrlhf.models import sampling  # noqa: E402
from jaxrlhf.models import t5  # noqa: E402

def model_config(family: str, vocab_size: int, dtype: str, size: str):
  """T5 1.1 at `size`, and a Llama of about its size.

  The T5 ties its output layer to the embedding (T5 1.0 style): transformers
  5 ties every T5's, untied checkpoints included in some versions, and the
  comparison must run one model on both sides (the cost is the same).
  """
  if family == "t5":
    return t5.t5_config(size, vocab_size=vocab_size, dtype=dtype,
                        logits_via_embedding=True)
  if family != "llama":
    raise ValueError(f"--families: {family!r} is not t5 or llama.")
  if size == "tiny":
    return llama.LlamaConfig.preset("tiny", vocab_size=vocab_size,
                                    dtype=dtype)
  if size == "small":
    return llama.LlamaConfig(vocab_size=vocab_size, emb_dim=512, num_heads=8,
                             num_kv_heads=8, num_layers=8, head_dim=64,
                             mlp_dim=1024, max_length=1024, dtype=dtype)
  return llama.LlamaConfig.preset("llama3.2-1b", vocab_size=vocab_size,
                                  rope_scaling=None, dtype=dtype)


def init_params(config, seed=0):
  module = registry.module_for_config(config)
  abstract = registry.abstract_params(module)
  rng = np.random.default_rng(seed)

  def draw(a):
    a = a.unbox() if hasattr(a, "unbox") else a
    fan_in = a.shape[0] if len(a.shape) > 1 else 1
    return jnp.asarray(rng.normal(size=a.shape) / np.sqrt(fan_in),
                       jnp.float32)
  return module, jax.tree.map(draw, abstract,
                              is_leaf=lambda x: hasattr(x, "unbox"))


def prompts(family, batch, length, vocab, seed=1):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, size=(batch, length)).astype(np.int32)
  if family == "t5":
    tokens[:, -1] = 1  # encoder inputs end in EOS
  return tokens


def ours(family, module, params, tokens, new, repeats, **options):
  """(seconds per call, tokens, the call, its compiled program's text) of
  our greedy sampler, EOS disabled (an id no model emits); `options`: the
  sampler's (fuse_projections, cache_segments)."""
  never = -1
  options.setdefault("cache_segments", 1)  # the whole cache, whatever the
  # default for long generations (sampling.default_cache_segments)
  if family == "t5":
    sample = lambda p, x: sampling.sample_encoder_decoder(
        module, p, x, jax.random.PRNGKey(0), new, greedy=True,
        eos_id=never, **options).tokens
  else:
    mask = np.ones_like(tokens)
    sample = lambda p, x: sampling.sample_decoder_only(
        module, p, x, mask, jax.random.PRNGKey(0), new, greedy=True,
        eos_id=never, **options).tokens
  # Compiled here, so that a profile can name each kernel's JAX operation.
  compiled = jax.jit(sample).lower(params, tokens).compile()
  run = lambda: compiled(params, tokens)
  jax.block_until_ready(run())
  start = time.perf_counter()
  for _ in range(repeats):
    out = run()
  jax.block_until_ready(out)
  return ((time.perf_counter() - start) / repeats, np.asarray(out), run,
          compiled.as_text())


def theirs(family, path, tokens, new, repeats, dtype):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cls = (transformers.T5ForConditionalGeneration if family == "t5"
         else transformers.AutoModelForCausalLM)
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = cls.from_pretrained(path, dtype=torch_dtype).to(device).eval()
  ids = torch.from_numpy(tokens).long().to(device)
  kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                max_new_tokens=new, min_new_tokens=new, do_sample=False,
                num_beams=1, use_cache=True, eos_token_id=None,
                pad_token_id=0)

  def run():
    with torch.no_grad():
      out = model.generate(**kwargs)
    if device == "cuda":
      torch.cuda.synchronize()
    return out
  run()
  start = time.perf_counter()
  for _ in range(repeats):
    out = run()
  seconds = (time.perf_counter() - start) / repeats
  out = out.cpu().numpy()
  return seconds, (out[:, 1:] if family == "t5" else out[:, tokens.shape[1]:])


def bandwidth_bound(config, params, batch, prompt, new, gbps):
  """Seconds a decode of `new` tokens takes at least when every step reads
  all parameters and the KV cache written so far."""
  itemsize = jnp.dtype(config.dtype).itemsize
  param_bytes = sum(x.size for x in jax.tree.leaves(params)) * itemsize
  if isinstance(config, t5.T5Config):
    layers, kv_heads = config.num_decoder_layers, config.num_heads
    # Self-attention cache grows to `new`; cross-attention holds `prompt`.
    mean_positions = new / 2 + prompt
  else:
    layers, kv_heads = config.num_layers, config.num_kv_heads
    mean_positions = prompt + new / 2
  kv_bytes = (2 * layers * batch * kv_heads * config.head_dim
              * mean_positions * itemsize)
  return new * (param_bytes + kv_bytes) / (gbps * 1e9)


def main(args):
  console.silence_library_noise(python_loggers=True)
  device = jax.devices()[0]
  gbps = bench_common.hbm_gbps(args.hbm_gbps)
  have_torch = not args.no_transformers
  if have_torch:
    try:
      import torch  # pylint: disable=g-import-not-at-top
      import transformers  # pylint: disable=g-import-not-at-top
      transformers.logging.set_verbosity_error()
      transformers.utils.logging.disable_progress_bar()
      if args.threads:
        torch.set_num_threads(args.threads)
    except ImportError:
      print("transformers or torch is not installed: our figures only.")
      have_torch = False
  print(f"device: {device.device_kind} ({device.platform}); {args.size} "
        f"models; prompt "
        f"{args.prompt}, {args.new} new tokens, greedy, EOS disabled, "
        f"{args.dtype}; threads {args.threads or os.cpu_count()}")
  header = (f"{'family':8} {'batch':>5} {'ours tok/s':>11} "
            f"{'transformers':>13} {'ratio':>6} {'HBM bound':>10}")
  if args.separate:
    header += f" {'separate':>9} {'joined x':>9}"
  if args.segments:
    header += f" {f'{args.segments} segments':>11} {'segments x':>10}"
  print(header)
  print("-" * len(header))
  for family in args.families.split(","):
    config = model_config(family, args.vocab_size, args.dtype, args.size)
    module, params = init_params(config)
    path = None
    if have_torch:
      path = tempfile.mkdtemp(prefix=f"bench_sampling_{family}_")
      hf_io.export_hf_checkpoint(config, params, path)
    for batch in (int(b) for b in args.batches.split(",")):
      tokens = prompts(family, batch, args.prompt, args.vocab_size)
      seconds, out, run, hlo = ours(family, module, params, tokens,
                                    args.new, args.repeats)
      rate = batch * args.new / seconds
      row = f"{family:8} {batch:>5} {rate:>11,.0f} "
      if path:
        their_seconds, their_out = theirs(family, path, tokens, args.new,
                                          args.repeats, args.dtype)
        their_rate = batch * args.new / their_seconds
        same = float(np.mean(their_out[:, :8] == out[:, :8]))
        row += f"{their_rate:>13,.0f} {rate / their_rate:>6.2f}"
        if same < 1.0 and args.dtype == "float32":
          row += f"  (first 8 tokens agree on {same:.0%})"
      else:
        row += f"{'-':>13} {'-':>6}"
      if gbps:
        bound = bandwidth_bound(config, params, batch, args.prompt, args.new,
                                gbps)
        row += f" {bound / seconds:>9.0%}"
      elif args.separate or args.segments:
        row += f" {'-':>10}"
      if args.separate:
        # The projections read one by one: fuse_projections' gain.
        sep_seconds, _, _, _ = ours(family, module, params, tokens,
                                    args.new, args.repeats,
                                    fuse_projections=False)
        row += (f" {batch * args.new / sep_seconds:>9,.0f}"
                f" {sep_seconds / seconds:>9.2f}")
      if args.segments:
        # The cache read in chunks as it is written: the segments' gain.
        seg_seconds, seg_out, _, _ = ours(family, module, params, tokens,
                                          args.new, args.repeats,
                                          cache_segments=args.segments)
        row += (f" {batch * args.new / seg_seconds:>11,.0f}"
                f" {seconds / seg_seconds:>10.2f}")
        if args.dtype == "float32" and not np.array_equal(seg_out, out):
          row += "  (tokens differ from the whole cache's)"
      print(row)
    if args.profile:
      # The last batch's call again, traced: its prefill and `new` decode
      # steps, counted per decode step.
      lines = bench_common.kernel_profile(
          lambda n: [jax.block_until_ready(run()) for _ in range(n)], 1,
          "decode step", units_per_call=args.new, hlo=hlo)
      print(f"{family} at batch {batch}, one call traced:")
      print("\n".join("  " + line for line in lines))
  sys.stdout.flush()


if __name__ == "__main__":
  main(_ARGS)
