r"""Packing (config.data.pack): how much of a batch is padding, unpacked and
packed, and the train step's tokens per second both ways.

  python experiments/bench_packing.py                  # everything below
  python experiments/bench_packing.py --no_steps       # padding shares only
  python experiments/bench_packing.py --pack=8 --steps=20 --out=packing.json

Padding shares (the token slots of a batch's sequences that hold padding,
`feature_converters.padding_share`, over --batches training batches) of:

- the quickstart's data: its SFT task `synthetic_summarize` at its lengths
  (16 + 16), laid out for T5 and for decoder-only models, and preference
  pairs and trajectories of its prompts (the `ideal` and `targets`
  completions labelled by the gold reward, as its data stage labels SFT
  samples);
- a length-skewed file: trajectories whose prompt and completion lengths are
  log-normal (medians 12 and 6 words, a tail to the 128 + 64 limits), the
  shape of real preference data, where a batch padded to the longest
  example is mostly padding.

Then the train step (the trainer's own, jitted, on this machine's devices)
on real batches of the skewed file, unpacked and packed at the same rows and
lengths, timed in alternating rounds (medians): seconds per step,
completion tokens (loss weights) per second and examples per second, for
SFT of a small Llama and DRO-V of a small T5. A
packed step costs about what an unpacked one does (same shapes) and holds
several examples per row, so tokens per second rise with the examples per
row.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

WORDS = ("cat", "dog", "owl", "lime", "blue", "red", "elm", "fig", "moon")


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--pack", type=int, default=8,
                 help="examples per packed row (config.data.pack)")
  p.add_argument("--batches", type=int, default=8,
                 help="batches whose padding is counted")
  p.add_argument("--batch_size", type=int, default=16, help="rows per batch")
  p.add_argument("--steps", type=int, default=5,
                 help="train steps per timed round")
  p.add_argument("--rounds", type=int, default=3,
                 help="timed rounds, unpacked and packed in turn (medians)")
  p.add_argument("--no_steps", action="store_true",
                 help="padding shares only")
  p.add_argument("--out", default="", help="also write the figures here")
  return p.parse_args(argv)


def skewed_file(path: str, count: int = 2048, seed: int = 0) -> str:
  """Trajectories with log-normal prompt and completion lengths."""
  rng = np.random.default_rng(seed)
  with open(path, "w") as f:
    for _ in range(count):
      n_prompt = int(min(126, max(1, rng.lognormal(math.log(12), 0.8))))
      n_completion = int(min(60, max(1, rng.lognormal(math.log(6), 0.9))))
      row = {"prompt": "summarize: " + " ".join(rng.choice(WORDS, n_prompt)),
             "completion": " ".join(rng.choice(WORDS, n_completion)),
             "reward": float(rng.normal())}
      f.write(json.dumps(row) + "\n")
  return path


def quickstart_files(directory: str):
  """Pairs and trajectories of the quickstart task's training prompts."""
  from jaxrlhf.data import synthetic  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import synthetic_feedback  # pylint: disable=g-import-not-at-top
  examples = synthetic.make_examples("train", 2048)
  out = {}
  for kind in ("pairs", "trajectory"):
    out[kind] = os.path.join(directory, f"quickstart_{kind}.jsonl")
    synthetic_feedback.write_synthetic_feedback(
        out[kind], kind, [e["inputs"] for e in examples],
        [[e["ideal"], e["targets"]] for e in examples], synthetic.gold_reward)
  return out


def _register(name, path, kind):
  from jaxrlhf.data import alignment_data  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  alignment_data.register_file_task(
      name, path, kind=kind, vocabulary=tasks.synthetic_vocabulary(),
      overwrite=True)


def padding_shares(args, files):
  from jaxrlhf.data import feature_converters as fc  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  quick = {"inputs": 16, "targets": 16}
  cases = []
  for arch in ("encoder_decoder", "decoder_only"):
    cases.append((f"quickstart sft ({arch})", "synthetic_summarize", quick,
                  fc.sft_feature_converter(arch)))
  for kind in ("pairs", "trajectory"):
    _register(f"bench_packing_quickstart_{kind}", files[kind], kind)
    fields = {"pairs": ("chosen", "rejected"),
              "trajectory": ("completion",)}[kind]
    cases.append((f"quickstart {kind} (encoder_decoder)",
                   f"bench_packing_quickstart_{kind}",
                   {"prompt": 16, **{f: 16 for f in fields}},
                   fc.feature_converter_for(kind, "encoder_decoder")))
  _register("bench_packing_skewed", files["skewed"], "trajectory")
  skewed = {"prompt": 128, "completion": 64}
  for arch in ("encoder_decoder", "decoder_only"):
    cases.append((f"skewed trajectory ({arch})", "bench_packing_skewed",
                  skewed, fc.feature_converter_for("trajectory", arch)))
  rows = []
  for name, task, lengths, converter in cases:
    shares, examples = {}, {}
    for pack in (0, args.pack):
      it = pipeline.BatchIterator(task, "train", lengths, converter,
                                  args.batch_size, seed=0, pack=pack)
      batches = [next(it) for _ in range(args.batches)]
      shares[pack] = float(np.mean([fc.padding_share(b) for b in batches]))
      examples[pack] = float(np.mean([
          b[fc.EXAMPLE_MASK].sum() if pack else args.batch_size
          for b in batches]) / args.batch_size)
    rows.append({"data": name, "unpacked": shares[0],
                 "packed": shares[args.pack],
                 "examples_per_row": examples[args.pack]})
    print(f"{name:42s} padding {shares[0]:6.1%} -> {shares[args.pack]:6.1%}"
          f"   ({examples[args.pack]:.2f} examples per packed row)",
          flush=True)
  return rows


def step_rates(args, files):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top

  cases = {
      "sft llama (emb 256, 4 layers), 128+64": (
          "sft", {"model.arch": "llama", "model.size": "tiny",
                  "model.emb_dim": 256, "model.num_heads": 4,
                  "model.num_kv_heads": 4, "model.head_dim": 64,
                  "model.mlp_dim": 512, "model.num_decoder_layers": 4}),
      "dro_v t5 (emb 256, 2+2 layers), 128+64": (
          "dro_v", {"model.arch": "t5", "model.size": "tiny",
                    "model.emb_dim": 256, "model.num_heads": 4,
                    "model.head_dim": 64, "model.mlp_dim": 512,
                    "model.num_encoder_layers": 2,
                    "model.num_decoder_layers": 2}),
  }
  rows = []
  for name, (algorithm, model) in cases.items():
    runs = {}
    for pack in (0, args.pack):
      c = defaults.base_config()
      defaults.apply_overrides(c, {
          "algorithm": algorithm,
          "data.task": f"bench_packing_{algorithm}_{pack}",
          "data.inputs_length": 128, "data.targets_length": 64,
          "train.batch_size": args.batch_size, "data.pack": pack,
          "optimizer.name": "adafactor", "pipeline.stages": "", **model})
      c.data.files.train = files["skewed"]
      defaults.validate(c)
      mesh = sharding.create_mesh((-1, 1), ("data", "model"))
      rules = sharding.as_rules(c.sharding.logical_axis_rules)
      algo = algorithms.get(algorithm)
      algo = dataclasses.replace(algo, networks=dataclasses.replace(
          algo.networks, checkpoints=lambda trainer: {}))
      with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        trainer = trainer_lib.Trainer(algo, c, mesh, None)
        state = trainer.init_state()
        batches = trainer.train_batches(0)
        host = [next(batches) for _ in range(args.steps)]
        device = [sharding.global_batch(b, mesh, rules) for b in host]
        state, metrics = trainer.train_step(state, device[0])  # compiles
        jax.block_until_ready(metrics)
      runs[pack] = {
          "trainer": trainer, "state": state, "batches": device,
          "mesh": mesh, "rules": rules,
          "tokens": sum(float(np.sum(v)) for b in host
                        for k, v in b.items() if k.endswith("loss_weights")),
          "examples": sum(float(b["example_mask"].sum()) if pack
                          else args.batch_size for b in host),
          "seconds": []}
    # Rounds in turn, so that a busy machine slows both alike.
    for _ in range(args.rounds):
      for run in runs.values():
        with jax.set_mesh(run["mesh"]), nn.logical_axis_rules(run["rules"]):
          state = run["state"]
          start = time.perf_counter()
          for b in run["batches"]:
            state, metrics = run["trainer"].train_step(state, b)
          jax.block_until_ready(metrics)
          run["seconds"].append(time.perf_counter() - start)
          run["state"] = state
    rates = {}
    for pack, run in runs.items():
      seconds = float(np.median(run["seconds"]))
      rates[pack] = {"step_s": seconds / args.steps,
                     "tokens_per_s": run["tokens"] / seconds,
                     "examples_per_s": run["examples"] / seconds}
    gain = rates[args.pack]["tokens_per_s"] / rates[0]["tokens_per_s"]
    rows.append({"step": name, "unpacked": rates[0],
                 "packed": rates[args.pack], "tokens_per_s_gain": gain})
    print(f"{name:42s} "
          f"step {rates[0]['step_s'] * 1e3:7.1f} -> "
          f"{rates[args.pack]['step_s'] * 1e3:7.1f} ms, completion tokens/s "
          f"{rates[0]['tokens_per_s']:8.0f} -> "
          f"{rates[args.pack]['tokens_per_s']:8.0f} (x{gain:.2f}), "
          f"examples/s {rates[0]['examples_per_s']:6.1f} -> "
          f"{rates[args.pack]['examples_per_s']:6.1f}", flush=True)
  return rows


def main(argv=None):
  args = _parse(argv)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  import jax  # pylint: disable=g-import-not-at-top
  directory = tempfile.mkdtemp(prefix="bench_packing_")
  files = quickstart_files(directory)
  files["skewed"] = skewed_file(os.path.join(directory, "skewed.jsonl"))
  d = jax.devices()[0]
  print(f"device: {d.device_kind} x{jax.device_count()} ({d.platform}); "
        f"pack={args.pack}, {args.batch_size} rows per batch")
  out = {"pack": args.pack, "batch_size": args.batch_size,
         "padding": padding_shares(args, files)}
  if not args.no_steps:
    out["steps"] = step_rates(args, files)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
