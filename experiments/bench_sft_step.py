r"""Benchmark of the jitted, sharded SFT (or DPO) train step, beside TRL's.

  python experiments/bench_sft_step.py --size=small --batch_size=32 \
      --inputs_length=512 --targets_length=128 --dtype=bfloat16
  python experiments/bench_sft_step.py --arch=llama --size=tinyllama-1.1b \
      --dtype=bfloat16 --vocab_size=32000
  python experiments/bench_sft_step.py --arch=llama --optimizer=adamw \
      --batch_size=8 --algorithm=dpo --threads=1      # ours against TRL

Prints compile time, step time, steps/s, target tokens/s, the model's FLOPs
per step (the matmuls of the step's jaxpr, jaxrlhf.flops) against the
model FLOPs (6 x parameters x tokens plus attention), MFU against the given
peak (--peak_tflops; default: the device's data sheet), peak device memory
where the backend reports it, and the process's peak RSS. Random token
batches, so it measures the step and nothing else. Decoder-only models
train on the prompt and target as one sequence of inputs_length +
targets_length tokens, with the loss on the target; DPO scores a chosen and
a rejected target of each prompt, and its step runs the reference too.

For a decoder-only model with a Hugging Face export (Llama and kin) the
same step of TRL (its SFTTrainer or DPOTrainer, `trainer.train()` timed
from its step-begin to its step-end callback) runs beside ours on the same
weights (our random initialisation, exported with `hf_io`), the same
tokens, AdamW with our learning rate, betas, epsilon, weight decay and
clipping, our precision (float32; with --dtype=bfloat16, float32 weights
and bf16 autocast, which is what our bfloat16 means: float32 parameters,
bfloat16 compute), no gradient checkpointing, and for DPO the reference
forward in the step. Each side runs in its own process (so their peak RSS
are their own) and the two take turns: --rounds rounds of --steps steps of
ours, then of TRL's, after warm-up steps; the medians over rounds are
compared. --threads=N pins both to the first N cores with N threads (XLA's
intra-op pool, without Eigen's pool for N = 1; torch.set_num_threads).
Needs torch and TRL (`pip install -e .[hf]`, or `pip install torch==2.13.0
transformers trl`); without them, or with --no_trl, only our figures are
printed.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

_WORKER_TAG = "@@bench "
# This checkout, whose jaxrlhf the "ours" worker imports (installed or not).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  # The shape flags of bench_common (that module imports JAX, which must come
  # after the thread settings in the worker processes).
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import bench_common  # pylint: disable=g-import-not-at-top
  bench_common.add_shape_flags(p, optimizer="adafactor", steps=10)
  p.add_argument("--algorithm", default="sft", choices=("sft", "dpo"))
  p.add_argument("--rounds", type=int, default=3,
                 help="alternating rounds of --steps timed steps each")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps before the first round (after compiling)")
  p.add_argument("--threads", type=int, default=0,
                 help="pin each side to the first N cores with N threads "
                 "(0: as the libraries choose, all cores)")
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="per-device peak for MFU")
  p.add_argument("--profile", type=int, default=0,
                 help="after the timed rounds, trace this many more of our "
                 "steps and print their kernels (bench_common."
                 "kernel_profile)")
  p.add_argument("--no_trl", action="store_true",
                 help="our step only, even when TRL is installed")
  p.add_argument("--baseline", default="",
                 help="a directory holding another jaxrlhf package (e.g. a "
                 "worktree of an earlier commit): its step runs too, in turn "
                 "with ours, on the same weights and batch (before/after)")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  p.add_argument("--hf_dir", default="", help=argparse.SUPPRESS)
  p.add_argument("--trl_optimizer", default="{}", help=argparse.SUPPRESS)
  return p.parse_args(argv)


# --- what both sides share ------------------------------------------------------


def token_ids(args, vocab_size: int):
  """{'prompt': [b, Li], completion field: [b, Lt]} random ids (from 3: 0, 1
  and 2 are PAD, EOS and the word tokenizer's UNK); each completion ends
  with EOS (1), as the data's do."""
  rng = np.random.default_rng(0)
  b, li, lt = args.batch_size, args.inputs_length, args.targets_length
  high = max(4, min(vocab_size, 32000))
  out = {"prompt": rng.integers(3, high, (b, li), dtype=np.int32)}
  for field in completion_fields(args):
    c = rng.integers(3, high, (b, lt), dtype=np.int32)
    c[:, -1] = 1
    out[field] = c
  return out


def completion_fields(args):
  return ("chosen", "rejected") if args.algorithm == "dpo" else ("targets",)


def tokens_per_step(args):
  """(target tokens, all tokens) a train step learns from."""
  n = len(completion_fields(args)) * args.batch_size
  return n * args.targets_length, n * (args.inputs_length + args.targets_length)


def _rss():
  """(current, peak) resident set size of this process in bytes."""
  fields = {}
  with open("/proc/self/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmRSS", "VmHWM"):
        fields[key] = int(value.split()[0]) * 1024
  return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def _pin_threads(threads: int):
  """Before JAX or torch is imported: the first `threads` cores, and that
  many threads in XLA's and the OpenMP pools."""
  if not threads:
    return
  os.sched_setaffinity(0, set(range(threads)))
  eigen = "false" if threads == 1 else "true"
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") +
      f" --xla_cpu_multi_thread_eigen={eigen} "
      f"intra_op_parallelism_threads={threads}").strip()
  for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[key] = str(threads)


class _Channel:
  """The worker's side of the parent's line protocol: tagged JSON lines on
  stdout, one command a line on stdin."""

  def __init__(self):
    self.out = os.fdopen(os.dup(1), "w", buffering=1)
    # Everything else the libraries print goes to stderr.
    os.dup2(2, 1)

  def send(self, **message):
    self.out.write(_WORKER_TAG + json.dumps(message) + "\n")
    self.out.flush()

  def command(self):
    line = sys.stdin.readline()
    return line.split() if line else ["quit"]


# --- our step -------------------------------------------------------------------


def _batch(trainer, ids, rules, mesh):
  """Features of the trainer's data kind for `ids`, on the mesh."""
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  spec = trainer.batch_spec()
  prompt = ids["prompt"]
  b = prompt.shape[0]
  fields = [f for f in ids if f != "prompt"]
  out = {}
  for field in fields:
    name = (lambda s: s) if field == "targets" else (
        lambda s, f=field: f"{f}_{s}")
    completion = ids[field]
    if trainer.lm.is_encoder_decoder:
      out[name("decoder_target_tokens")] = completion
      out[name("decoder_input_tokens")] = np.concatenate(
          [np.zeros((b, 1), np.int32), completion[:, :-1]], 1)
      out[name("decoder_loss_weights")] = np.ones_like(completion)
    else:
      tokens = np.concatenate([prompt, completion], 1)
      out[name("tokens")] = tokens
      out[name("loss_weights")] = np.concatenate(
          [np.zeros_like(prompt), np.ones_like(completion)], 1)
      out[name("positions")] = np.tile(
          np.arange(tokens.shape[1], dtype=np.int32), (b, 1))
      out[name("attention_mask")] = np.ones_like(tokens)
  for key, s in spec.items():
    if key in out:
      continue
    if key in ("encoder_input_tokens", "prompt_tokens"):
      value = np.zeros(s.shape, s.dtype)
      n = min(s.shape[1], prompt.shape[1])
      value[:, -n:] = prompt[:, :n]  # left-padded where longer
      if key == "encoder_input_tokens":
        value = np.concatenate([value[:, 1:], np.ones((b, 1), s.dtype)], 1)
    elif key == "prompt_attention_mask":
      value = (out.get("prompt_tokens", np.ones(s.shape)) > 0).astype(s.dtype)
    elif key == "prompt_positions":
      value = np.tile(np.arange(s.shape[1], dtype=s.dtype), (b, 1))
    elif key in ("confidence", "prompt_weight"):
      value = np.ones(s.shape, s.dtype)
    else:
      value = np.zeros(s.shape, s.dtype)
    out[key] = value
  for key, s in spec.items():
    if out[key].shape != tuple(s.shape):
      raise ValueError(f"bench batch {key}: {out[key].shape} != {s.shape}")
  return sharding.global_batch({k: out[k] for k in spec}, mesh, rules)


def model_flops(cfg, n_params, args):
  """6 x matmul parameters x tokens plus attention (PaLM's MFU count, the
  whole square of scores) of a decoder-only step; DPO adds the reference's
  forward pass (a third of it). None for other architectures."""
  layers = getattr(cfg, "num_layers", None)
  if layers is None or not hasattr(cfg, "head_dim"):
    return None
  # The token embedding is a lookup: its matmul is the output layer only
  # when tied.
  matmul_params = n_params - (0 if cfg.tie_embeddings
                              else cfg.vocab_size * cfg.emb_dim)
  length = args.inputs_length + args.targets_length
  per_token = (6 * matmul_params
               + 12 * layers * length * cfg.num_heads * cfg.head_dim)
  _, tokens = tokens_per_step(args)
  flops = per_token * tokens
  if args.algorithm == "dpo":
    flops *= 4 / 3
  return flops


def ours_worker(args, channel):
  _pin_threads(args.threads)
  import jax  # pylint: disable=g-import-not-at-top
  jax.devices()
  rss_jax = _rss()[0]
  import bench_common  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  from jaxrlhf import flops as jaxrlhf_flops  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import hf_io  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  rss_imports = _rss()[0]

  # Our random initialisation (the SFT trainer's), also the checkpoint DPO
  # starts from (policy and reference) and TRL's weights.
  c = bench_common.config_from_flags(args, "sft")
  with sharding.activate(c) as mesh:
    trainer = algorithms.build(c, mesh, evaluate=False)
    state = trainer.init_state()
    if args.hf_dir and args.worker == "ours":
      hf_io.export_hf_checkpoint(trainer.model_config, state.params["policy"],
                                 args.hf_dir)
  if args.algorithm != "sft":
    del trainer, state
    c = bench_common.config_from_flags(
        args, args.algorithm, **{"init.policy_checkpoint": args.hf_dir})
  rules = sharding.as_rules(c.sharding.logical_axis_rules)
  with sharding.activate(c) as mesh:
    if args.algorithm != "sft":
      trainer = algorithms.build(c, mesh, evaluate=False)
      state = trainer.init_state()
    ids = token_ids(args, trainer.model_config.vocab_size)
    batch = _batch(trainer, ids, rules, mesh)
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    # Matmul FLOPs of the whole step (every device), layers and
    # micro-batches counted by their trip count (jaxrlhf.flops).
    flops = jaxrlhf_flops.function_flops(trainer.train_step, state, batch)
    state, m = compiled(state, batch)
    first_loss = float(m["loss"])
    for _ in range(args.warmup - 1):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    channel.send(
        ready=True, compile_s=compile_s, flops=flops,
        model_flops=model_flops(trainer.model_config, n_params, args),
        n_params=n_params, first_loss=first_loss,
        device=bench_common.device_line(mesh),
        attention=getattr(trainer.model_config, "attention_impl", "?"),
        peak_tflops=args.peak_tflops or bench_common.peak_tflops(),
        device_count=jax.device_count(), rss_jax=rss_jax,
        rss_imports=rss_imports, rss=_rss(),
        optimizer={k: c.optimizer[k] for k in (
            "learning_rate", "b1", "b2", "eps", "weight_decay",
            "grad_clip_norm")})
    while True:
      command = channel.command()
      if command[0] != "run":
        break
      n = int(command[1])
      t0, cpu0 = time.perf_counter(), time.process_time()
      for _ in range(n):
        state, m = compiled(state, batch)
      jax.block_until_ready(m)
      channel.send(seconds=(time.perf_counter() - t0) / n,
                   cpu_seconds=(time.process_time() - cpu0) / n, rss=_rss())
    # The step's peak, before the update's timing copies the state.
    memory = bench_common.peak_memory_line()
    update_s = _time_update(trainer, state, args.steps * args.rounds)
    profile = None
    if args.profile and args.worker == "ours":

      def run(n):
        nonlocal state
        for _ in range(n):
          state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
      profile = bench_common.kernel_profile(run, args.profile, "step",
                                            top=16, hlo=compiled.as_text())
    channel.send(done=True, rss=_rss(), update_seconds=update_s,
                 memory=memory, profile=profile)


def _time_update(trainer, state, calls: int) -> float:
  """Seconds of the step's optimizer update alone (`update.guarded_update`:
  the gradient's norm, the optimizer, the non-finite guard) on copies of
  the state's parameters and optimizer state, with the parameters standing
  in for the gradient: the part of the step whose cost grows with the
  parameters, not the tokens. The copies are donated and threaded through
  the calls, as the train step donates its state. (Without that, each call
  writing new arrays, an H100 without preallocation timed the same update
  at 39.5 ms beside an 8-row step and 5.1 ms beside a 32-row one: the
  allocator's cost, not the update's.)"""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import update  # pylint: disable=g-import-not-at-top

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def apply(params, opt_state, grads):
    return update.guarded_update(params, opt_state, grads, jnp.float32(0.0),
                                 trainer.tx, {})[:2]

  params, opt_state = jax.tree.map(jnp.copy, (state.params, state.opt_state))
  for _ in range(2):  # compiles, then settles the allocator
    params, opt_state = apply(params, opt_state, state.params)
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  for _ in range(calls):
    params, opt_state = apply(params, opt_state, state.params)
  jax.block_until_ready((params, opt_state))
  return (time.perf_counter() - t0) / calls


# --- TRL's step -----------------------------------------------------------------


def _word_tokenizer(vocab_size):
  """A tokenizer whose token i is the word `w{i}` (0 PAD, 1 EOS, 2 UNK), so
  that TRL's own tokenisation of the texts gives our ids back."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({f"w{i}": i for i in range(3, vocab_size)})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab,
                                                         unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
      unk_token="<unk>")


def _text(ids):
  return " ".join("</s>" if i == 1 else f"w{i}" for i in ids)


# Our --dtype (the compute dtype; parameters stay float32) as TRL runs it.
TRL_PRECISION = {"float32": "float32",
                 "bfloat16": "bf16 autocast over float32 weights"}


def trl_worker(args, channel):
  _pin_threads(args.threads)
  import torch  # pylint: disable=g-import-not-at-top
  if args.threads:
    torch.set_num_threads(args.threads)
  import datasets  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  # transformers 5.2x renames its gradient-checkpointing flags and warns
  # at each use, its own included; TRL's configs still take the old name.
  warnings.filterwarnings("ignore", category=FutureWarning)
  datasets.disable_progress_bars()
  rss_imports = _rss()[0]

  config = json.load(open(os.path.join(args.hf_dir, "config.json")))
  ids = token_ids(args, config["vocab_size"])
  total_steps = max(1, args.warmup) + args.rounds * args.steps + 1
  rows = []
  for r in range(args.batch_size):
    row = {"prompt": _text(ids["prompt"][r])}
    for field in completion_fields(args):
      key = "completion" if field == "targets" else field
      row[key] = " " + _text(ids[field][r])
    rows.append(row)
  dataset = datasets.Dataset.from_list(rows * total_steps)
  opt = json.loads(args.trl_optimizer)
  common = dict(
      output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
      per_device_train_batch_size=args.batch_size, max_steps=total_steps,
      learning_rate=opt["learning_rate"], adam_beta1=opt["b1"],
      adam_beta2=opt["b2"], adam_epsilon=opt["eps"],
      weight_decay=opt["weight_decay"], max_grad_norm=opt["grad_clip_norm"],
      lr_scheduler_type="constant", bf16=args.dtype == "bfloat16",
      fp16=False,
      gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
      report_to="none", save_strategy="no", disable_tqdm=True,
      logging_steps=10**9, dataloader_num_workers=0,
      train_sampling_strategy="sequential",
      seed=0, model_init_kwargs={"dtype": torch.float32})
  tokenizer = _word_tokenizer(config["vocab_size"])
  if args.algorithm == "dpo":
    trainer = trl.DPOTrainer(
        model=args.hf_dir, args=trl.DPOConfig(**common, beta=0.1),
        train_dataset=dataset, processing_class=tokenizer)
  else:
    trainer = trl.SFTTrainer(
        model=args.hf_dir, args=trl.SFTConfig(**common),
        train_dataset=dataset, processing_class=tokenizer)

  # The batch TRL builds must hold our tokens, and its first loss ours.
  batch = next(iter(trainer.get_train_dataloader()))
  expected = np.concatenate(
      [np.concatenate([ids["prompt"], ids[f]], 1)
       for f in completion_fields(args)], 0)
  got = batch["input_ids"].cpu().numpy()
  if got.shape != expected.shape or not np.array_equal(got, expected):
    raise ValueError(f"TRL's batch differs from ours: {got.shape} "
                     f"{expected.shape}\n{got[:1, :8]}\n{expected[:1, :8]}")
  with torch.no_grad():
    first_loss = float(trainer.compute_loss(
        trainer.model, trainer._prepare_inputs(batch)))  # pylint: disable=protected-access

  class Pacer(transformers.TrainerCallback):
    """Times each step from its start to its end (the data loader's fetch
    comes before, logging after) and hands control back to the parent
    between rounds."""

    def __init__(self):
      self.todo = max(1, args.warmup)
      self.timed = False  # the warm-up steps are not reported
      self.round, self.cpu = [], []
      self.start = self.cpu_start = 0.0

    def on_step_begin(self, *unused, **unused_kw):
      self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, unused_args, unused_state, control, **unused_kw):
      self.round.append(time.perf_counter() - self.start)
      self.cpu.append(time.process_time() - self.cpu_start)
      self.todo -= 1
      if self.todo > 0:
        return control
      if self.timed:
        channel.send(seconds=sum(self.round) / len(self.round),
                     cpu_seconds=sum(self.cpu) / len(self.cpu), rss=_rss())
      self.timed, self.round, self.cpu = True, [], []
      command = channel.command()
      if command[0] == "run":
        self.todo = int(command[1])
      else:
        control.should_training_stop = True
      return control

  pacer = Pacer()
  trainer.add_callback(pacer)
  # With tqdm off, the Trainer prints each log (the run's summary at the
  # end) to stdout; the figures here are ours.
  trainer.remove_callback(transformers.PrinterCallback)
  channel.send(ready=True, first_loss=first_loss, rss_imports=rss_imports,
               rss=_rss(), versions=(
                   f"TRL {trl.__version__}, transformers "
                   f"{transformers.__version__}, torch {torch.__version__}"),
               trainer=type(trainer).__name__,
               optimizer=trainer.args.optim,
               precision=TRL_PRECISION[args.dtype],
               attention=trainer.model.config._attn_implementation)  # pylint: disable=protected-access
  trainer.train()
  channel.send(done=True, rss=_rss())


# --- the parent: both sides in turn -----------------------------------------------


class _Worker:

  def __init__(self, side, argv, env):
    self.side = side
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv,
         f"--worker={side}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env)

  def receive(self):
    while True:
      line = self.proc.stdout.readline()
      if not line:
        code = self.proc.wait()
        raise RuntimeError(f"the {self.side} worker exited ({code}) early; "
                           "its stderr is above.")
      if line.startswith(_WORKER_TAG):
        return json.loads(line[len(_WORKER_TAG):])

  def send(self, command):
    self.proc.stdin.write(command + "\n")
    self.proc.stdin.flush()

  def finish(self):
    self.send("quit")
    message = self.receive()
    self.proc.wait()
    return message


def _trl_importable():
  try:
    import importlib.util  # pylint: disable=g-import-not-at-top
    return all(importlib.util.find_spec(m) for m in ("torch", "trl"))
  except (ImportError, ValueError):
    return False


def _gb(n):
  return f"{n / 1e9:.2f} GB"


def main():
  args = _parse()
  if args.worker:
    channel = _Channel()
    if args.worker in ("ours", "baseline"):
      ours_worker(args, channel)
    else:
      trl_worker(args, channel)
    return
  decoder_only = args.arch != "t5"
  with_trl = not args.no_trl and decoder_only and _trl_importable()
  if with_trl and args.dtype not in TRL_PRECISION:
    sys.exit(f"--dtype={args.dtype}: TRL's side mirrors only "
             f"{', '.join(TRL_PRECISION)}; pass --no_trl for ours alone")
  if not args.no_trl and not with_trl:
    print("TRL comparison skipped: " + (
        "torch or trl is not installed (pip install -e .[hf])"
        if decoder_only else f"--arch={args.arch} is not decoder-only") + ".")
  argv = [a for a in sys.argv[1:] if not a.startswith("--hf_dir")]
  hf_dir = ""
  if with_trl or args.baseline or args.algorithm != "sft":
    hf_dir = tempfile.mkdtemp(prefix="bench_sft_step_hf_")
    argv.append(f"--hf_dir={hf_dir}")
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

  workers = {}
  try:
    _run(args, argv, env, with_trl, workers)
  finally:
    for worker in workers.values():
      if worker.proc.poll() is None:
        worker.proc.kill()


def _run(args, argv, env, with_trl, workers):
  """Starts the workers, takes the rounds in turn, prints the report."""
  workers["ours"] = _Worker("ours", argv, dict(env, PYTHONPATH=os.pathsep.join(
      [_REPO] + [p for p in [env.get("PYTHONPATH")] if p])))
  info = {"ours": workers["ours"].receive()}
  if args.baseline:
    base_env = dict(env, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(args.baseline)] +
        [p for p in [env.get("PYTHONPATH")] if p]))
    workers["baseline"] = _Worker("baseline", argv, base_env)
    info["baseline"] = workers["baseline"].receive()
  if with_trl:
    if args.optimizer != "adamw":
      print(f"note: ours runs {args.optimizer}, TRL AdamW (--optimizer=adamw "
            "for the same optimizer)")
    opt = info["ours"]["optimizer"]
    workers["trl"] = _Worker(
        "trl", argv + [f"--trl_optimizer={json.dumps(opt)}"], env)
    info["trl"] = workers["trl"].receive()
  times = {side: [] for side in workers}
  cpu = {side: [] for side in workers}
  for _ in range(args.rounds):
    for side, worker in workers.items():
      worker.send(f"run {args.steps}")
      message = worker.receive()
      times[side].append(message["seconds"])
      cpu[side].append(message["cpu_seconds"])
  final = {side: worker.finish() for side, worker in workers.items()}
  _report(args, info, final, times, cpu)


def _step_line(step_s, cpu_s, args):
  target_tokens, all_tokens = tokens_per_step(args)
  return (f"step time: {step_s * 1e3:.2f} ms | {1 / step_s:.2f} steps/s | "
          f"{target_tokens / step_s:,.0f} target tokens/s | "
          f"{all_tokens / step_s:,.0f} total tokens/s | CPU time "
          f"{cpu_s * 1e3:.0f} ms/step")


def _report(args, info, final, times, cpu):
  b, li, lt = args.batch_size, args.inputs_length, args.targets_length
  med = {side: (statistics.median(times[side]), statistics.median(cpu[side]))
         for side in times}
  ours = info["ours"]
  step_s, cpu_s = med["ours"]
  print(ours["device"])
  print(f"model: {args.arch} {args.size} ({ours['n_params'] / 1e6:.1f}M "
        f"params, {args.dtype}, attention {ours['attention']}); "
        f"{args.algorithm}; batch {b} x ({li} in, "
        f"{lt} out{' x 2' if args.algorithm == 'dpo' else ''}); optimizer "
        f"{args.optimizer}; threads {args.threads or os.cpu_count()}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
  print(f"compile: {ours['compile_s']:.1f} s")
  print(_step_line(step_s, cpu_s, args) + f"  (medians of "
        f"{len(times['ours'])} rounds of {args.steps} steps)")
  flops, model = ours["flops"], ours["model_flops"]
  if flops:
    achieved = flops / step_s / 1e12
    line = f"FLOPs/step: {flops / 1e9:.2f} GFLOP | {achieved:.3f} TFLOP/s"
    peak = ours["peak_tflops"]
    if peak:
      line += (f" | MFU {achieved / (peak * ours['device_count']):.1%} of "
               f"{peak} TFLOP/s per device")
    print(line)
    update_s = final["ours"]["update_seconds"]
    line = (f"optimizer update alone: {update_s * 1e3:.2f} ms ("
            f"{update_s / step_s:.0%} of the step); the step less it: "
            f"{(step_s - update_s) * 1e3:.2f} ms")
    if peak and step_s > update_s:
      rest = flops / (step_s - update_s) / 1e12
      line += f", MFU {rest / (peak * ours['device_count']):.1%}"
    print(line)
    if model:
      print(f"model FLOPs (6 x params x tokens + attention"
            f"{', + reference forward' if args.algorithm == 'dpo' else ''}): "
            f"{model / 1e9:.2f} GFLOP; the step's matmuls are "
            f"{flops / model:.2f}x that")
  if final["ours"].get("memory"):
    print(final["ours"]["memory"])
  print(f"peak RSS: {_gb(final['ours']['rss'][1])} (after importing jax "
        f"{_gb(ours['rss_jax'])}, jaxrlhf {_gb(ours['rss_imports'])})")
  print(f"first step's loss: {ours['first_loss']:.5f}")
  for line in final["ours"].get("profile") or ():
    print(line)
  for side in times:
    if side == "ours":
      continue
    other = info[side]
    side_s, side_cpu_s = med[side]
    if side == "trl":
      print(f"TRL ({other['versions']}; {other['trainer']}, optim "
            f"{other['optimizer']}, {other['precision']}, attention "
            f"{other['attention']}), the same model, batch and settings:")
      print(f"  peak RSS: {_gb(final[side]['rss'][1])} (after imports "
            f"{_gb(other['rss_imports'])})")
    else:
      print(f"baseline ({args.baseline}):")
      print(f"  compile: {other['compile_s']:.1f} s | FLOPs/step: "
            f"{other['flops'] / 1e9:.2f} GFLOP | peak RSS: "
            f"{_gb(final[side]['rss'][1])}")
    print("  " + _step_line(side_s, side_cpu_s, args))
    print(f"  first step's loss: {other['first_loss']:.5f}")
    per_round = [t / o for o, t in zip(times["ours"], times[side])]
    name = "TRL" if side == "trl" else "baseline"
    print(f"ratio ours / {name} tokens/s: {side_s / step_s:.2f}x (per "
          "round: " + ", ".join(f"{r:.2f}" for r in per_round) +
          f"); per CPU second: {side_cpu_s / cpu_s:.2f}x")
  print("step times (ms), " + " | ".join(
      f"{side}: " + ", ".join(f"{t * 1e3:.0f}" for t in times[side])
      for side in times))


if __name__ == "__main__":
  main()
