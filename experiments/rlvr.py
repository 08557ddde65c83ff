r"""RL with verifiable rewards, in miniature: the GRPO family, REINFORCE++,
RLOO and PPO on exact-answer sums.

  python experiments/rlvr.py --workdir=/tmp/rlvr --out=experiments/results/rlvr

A smaller run (one seed, two algorithms, fewer steps):

  python experiments/rlvr.py --workdir=/tmp/rlvr_small --out=/tmp/rlvr_small/out \
      --seeds=0 --algorithms=grpo,dapo --steps=20

The task is the built-in verifiable task `synthetic_arithmetic`
(jaxrlhf/data/synthetic_arithmetic.py): "add: 47 + 385" -> "units first:
234 #### 432", operands of 1 to 2 digits, a fifth of the demonstrations
wrong (so that SFT leaves headroom), and an exact gold reward (1 when the
number after the last "####" is the sum, else 0). Nothing here needs a
reward model:

  1. SFT: the quickstart's tiny T5 (2 + 2 layers, width 64), from scratch,
     `--sft_steps` steps of 32 demonstrations (600: about one pass over the
     20,000 training sums);
  2. from that SFT checkpoint, every algorithm below, once per seed
     (config.seed: the rollouts' samples, the prompt order and PPO's value
     head), `--steps` steps of 16 prompts x 4 responses each, sampled at
     temperature 1 (DAPO's and DeepSeekMath's), at most 16 tokens;
     the score is the gold reward (weight 1) plus a format reward (weight
     0.1: the completion contains "#### <integer>", rewards.format's
     default pattern), so that the format term's share of the score is
     logged (reward/format_share):
       grpo          GRPO (DeepSeekMath): group-normalised advantages, a k3
                     KL term in the loss (beta 0.04), clip 0.2, the
                     sequence-mean reduction;
       dr_grpo       Dr. GRPO: advantages not divided by the group std, the
                     constant-length reduction;
       dapo          DAPO: clip-higher (0.2 / 0.28), token mean, no KL,
                     dynamic sampling (groups whose rewards all agree are
                     dropped and more prompts drawn, up to 3 rounds) and
                     the soft overlong penalty (weight 1; L_max 16 tokens,
                     L_cache 4);
       gspo          GSPO: one importance ratio per response (the geometric
                     mean of its token ratios) clipped to [1 - 3e-4,
                     1 + 4e-4], the sequence-mean reduction;
       cispo         CISPO: the importance weight clipped at 5 and stopped,
                     on a REINFORCE token loss, token mean;
       reinforce_pp  REINFORCE++: token-level KL in the reward (k1, beta
                     0.05), returns normalised over the whole batch, PPO's
                     clipped token loss, no critic;
       rloo          RLOO: each response's baseline is the mean KL-penalised
                     reward of the other three responses to its prompt;
       ppo           PPO (the N+ implementation details' settings) with
                     its value network started from the policy (there is no
                     reward model to start it from).
     The GRPO family (DAPO, GSPO, CISPO are settings of `grpo`:
     jaxrlhf/algorithms/online/grpo.py) and REINFORCE++ make 2 optimizer updates
     per rollout batch (online.num_minibatches 2), so that their ratios
     move off 1 and their clipping matters; RLOO and PPO keep their
     defaults of 4 epochs of one minibatch. Everything else is each
     algorithm's default; the learning rate is the quickstart pipeline's
     online one (Adafactor, 1e-3, constant);
  3. each run is judged on the first `--eval_prompts` prompts of the task's
     "test" split (sums that no stage trains on): its greedy decodes'
     gold reward (pass@1), the mean gold reward of `--k` samples per prompt
     at temperature 1, KL(pi || SFT) on those samples (k1, per response),
     their mean length and EOS rate; from training, the format reward's
     mean share of the score, the decode steps of each rollout
     (online.stop_when_done stops decoding once every response has ended;
     the steps it saved against always decoding 16 tokens) and the wall
     minutes of the run. The SFT row is the SFT policy judged the same way.

Writes `results.json` (every seed's figures, their mean and standard
error) and `README.md` (generated from results.json alone) into --out.
Every run resumes and its figures are kept in the workdir, so an
interrupted command continues where it stopped. XLA compilations are kept
in <workdir>/xla_cache (JAX's persistent compilation cache: the seeds of an
algorithm compile once; the numbers are those of a fresh compilation).
"""

import argparse
import copy
import json
import math
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TASK = "synthetic_arithmetic"
PROMPT_TOKENS = 12
RESPONSE_TOKENS = 16
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 4
GOLD_WEIGHT = 1.0
FORMAT_WEIGHT = 0.1
ONLINE_LEARNING_RATE = 1e-3
# The off-policy updates of the clipped-ratio algorithms (module docstring).
CLIPPED_MINIBATCHES = {"online.num_minibatches": 2}

# name -> (config.algorithm, overrides, one line for the README).
ALGORITHMS = {
    "grpo": ("grpo", dict(CLIPPED_MINIBATCHES),
             "GRPO: group mean/std advantages, k3 KL in the loss (beta "
             "0.04), clip 0.2, sequence mean"),
    "dr_grpo": ("grpo", dict(CLIPPED_MINIBATCHES, **{
        "grpo.scale_by_std": False, "grpo.reduction": "constant_length"}),
                "Dr. GRPO: no std scaling, constant-length reduction"),
    "dapo": ("grpo", dict(CLIPPED_MINIBATCHES, **{
        "grpo.clip_eps_high": 0.28, "grpo.reduction": "token_mean",
        "grpo.kl_coef": 0.0, "grpo.dynamic_sampling": True,
        "rewards.overlong.weight": 1.0}),
             "DAPO: clip-higher 0.28, token mean, no KL, dynamic sampling "
             "(<= 3 rounds), soft overlong penalty (L_max 16, L_cache 4)"),
    "gspo": ("grpo", dict(CLIPPED_MINIBATCHES, **{
        "grpo.ratio_level": "sequence", "online.clip_eps": 3e-4,
        "grpo.clip_eps_high": 4e-4, "grpo.reduction": "sequence_mean"}),
             "GSPO: sequence-level ratio clipped to [1-3e-4, 1+4e-4], "
             "sequence mean"),
    "cispo": ("grpo", dict(CLIPPED_MINIBATCHES, **{
        "grpo.objective": "cispo", "grpo.clip_eps_high": 5.0,
        "grpo.reduction": "token_mean"}),
              "CISPO: stopped importance weight capped at 5 on a REINFORCE "
              "token loss, token mean"),
    "reinforce_pp": ("reinforce_pp", dict(CLIPPED_MINIBATCHES),
                     "REINFORCE++: token KL in the reward (beta 0.05), "
                     "batch-normalised returns, clipped token loss"),
    "rloo": ("rloo", {}, "RLOO: leave-one-out baseline on the KL-penalised "
             "reward (beta 0.05), 4 epochs"),
    "ppo": ("ppo", {}, "PPO: GAE, clipped policy and value losses, KL in "
            "the reward (beta 0.05), 4 epochs, value network from the "
            "policy"),
}


def base_config(sft_steps: int):
  """The quickstart config on the arithmetic task: the SFT stage."""
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.load_config_file(REPO / "configs" / "quickstart.py")
  defaults.apply_overrides(config, {
      "pipeline.stages": "",
      "data.task": TASK,
      "data.inputs_length": PROMPT_TOKENS,
      "data.targets_length": RESPONSE_TOKENS,
      "train.num_steps": sft_steps,
      "train.log_every": 100,
      "checkpoint.every_steps": 0,
      "eval.batch_size": 256,
  })
  return config


def online_config(config, name: str, sft_dir: str, seed: int, steps: int,
                  eval_prompts: int, k: int):
  """The run config of algorithm `name` (ALGORITHMS) from the SFT policy."""
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  algorithm, overrides, _ = ALGORITHMS[name]
  return offline_pipeline.stage_config(config, algorithm, **{
      "seed": seed,
      "init.policy_checkpoint": sft_dir,
      "train.num_steps": steps,
      "train.batch_size": PROMPTS_PER_STEP,
      "train.log_every": max(steps // 5, 1),
      "optimizer.learning_rate": ONLINE_LEARNING_RATE,
      "optimizer.warmup_steps": 0,
      "online.samples_per_prompt": SAMPLES_PER_PROMPT,
      "online.temperature": 1.0,
      "online.stop_when_done": True,
      # Rewards from programs only: no reward model.
      "rewards.reward_model.weight": 0.0,
      "rewards.gold_reward.weight": GOLD_WEIGHT,
      "rewards.format.weight": FORMAT_WEIGHT,
      # Judged before and after training on held-out test sums.
      "eval.task": TASK,
      "eval.split": "test",
      "eval.num_examples": eval_prompts,
      "eval.num_samples": k,
      "eval.temperature": 1.0,
      "eval.every_steps": 0,
      **overrides,
  })


def greedy_eval(config, policy_dir: str, eval_prompts: int):
  """The gold reward of greedy decodes (pass@1), their length and EOS rate,
  of the policy in `policy_dir`'s latest checkpoint, on the first
  `eval_prompts` test sums: the SFT algorithm's evaluation through
  `jaxrlhf.api`."""
  from jaxrlhf import api  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  c = offline_pipeline.stage_config(config, "sft", **{
      "init.policy_checkpoint": policy_dir,
      "data.eval_split": "test",
      "eval.num_examples": eval_prompts})
  run = api.Run(c)
  m = run.evaluate(run.init())
  return {"greedy_pass_at_1": m["eval/gold_reward"],
          "greedy_length": m["eval/length"],
          "greedy_eos_rate": m["eval/eos_rate"]}


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def run_figures(rows, greedy, minutes):
  """One online run's figures from its metrics.jsonl rows."""
  train = [r for r in rows if "score" in r]
  evals = [r for r in rows if "eval/gold_reward" in r]
  first, last = evals[0], evals[-1]
  mean = lambda key: sum(r[key] for r in train) / len(train)
  out = {
      "steps": last["step"],
      "sampled_mean_at_k": last["eval/gold_reward"],
      "sft_sampled_mean_at_k": first["eval/reference_gold_reward"],
      "win_rate_vs_sft": last["eval/win_rate"],
      "kl_to_sft": last["eval/kl"],
      "length": last["eval/length"],
      "eos_rate": last["eval/eos_rate"],
      "train_gold_reward_first10": sum(
          r["reward/gold_reward"] for r in train[:10]) / len(train[:10]),
      "train_gold_reward_last10": sum(
          r["reward/gold_reward"] for r in train[-10:]) / len(train[-10:]),
      "format_reward": mean("reward/format"),
      "format_share": mean("reward/format_share"),
      "train_response_length": mean("response_length"),
      "minutes": minutes,
      **greedy,
  }
  if all("decode_steps" in r for r in train):
    # A rollout of `rounds` rounds (dynamic sampling) could decode
    # rounds x max_new_tokens steps; stop_when_done decoded decode_steps.
    budget = [RESPONSE_TOKENS * r.get("dynamic_sampling/rounds", 1)
              for r in train]
    done = [r["decode_steps"] for r in train]
    out["decode_steps"] = sum(done) / len(done)
    out["decode_steps_budget"] = sum(budget) / len(budget)
    out["decode_steps_saved_fraction"] = 1 - sum(done) / sum(budget)
  if any("dynamic_sampling/rounds" in r for r in train):
    out["dynamic_sampling_rounds"] = mean("dynamic_sampling/rounds")
    out["dynamic_sampling_dropped_fraction"] = mean(
        "dynamic_sampling/dropped_fraction")
  if any("reward/overlong" in r for r in train):
    out["overlong_reward"] = mean("reward/overlong")
    out["overlong_share"] = mean("reward/overlong_share")
  return out


def mean_and_stderr(by_seed):
  """{"mean": ..., "stderr": ...} over the seeds' figure dicts (the sample
  standard deviation / sqrt(seeds); 0 for one seed)."""
  rows = list(by_seed.values())
  n = len(rows)
  mean, stderr = {}, {}
  for key in rows[0]:
    values = [r[key] for r in rows if key in r]
    mean[key] = sum(values) / len(values)
    var = (sum((v - mean[key]) ** 2 for v in values) / (len(values) - 1)
           if len(values) > 1 else 0.0)
    stderr[key] = math.sqrt(var / len(values))
  return {"mean": mean, "stderr": stderr, "seeds": n}


def cached(path, make):
  """The JSON at `path`, made once by make()."""
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  value = make()
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
  return value


# --- the README, from results.json alone ----------------------------------------


def _cell(r, key, digits):
  if key not in r["mean"]:
    return "-"
  m, s = r["mean"][key], r["stderr"][key]
  return (f"{m:.{digits}f} ± {s:.{digits}f}" if r["seeds"] > 1
          else f"{m:.{digits}f}")


def format_readme(results) -> str:
  s = results["setup"]
  sft = results["sft"]
  runs = results["runs"]
  seeds = ", ".join(str(x) for x in s["seeds"])
  lines = [
      "# RL with verifiable rewards, in miniature",
      "",
      "Generated by `experiments/rlvr.py` from `results.json` in this "
      "folder; every figure below is read from it. Made with:",
      "",
      "```",
      s["command"],
      "```",
      "",
      f"It took {s['minutes']:.0f} minutes ({s['machine']}). The task is "
      f"`{s['task']}` (sums of 1- and 2-digit numbers; a share "
      f"{s['demonstration_error_rate']:g} of the SFT demonstrations is "
      "wrong; the gold reward is 1 when the number after the last `####` "
      "is the sum). A tiny T5 "
      f"({s['model']}) is fine-tuned from scratch for {s['sft_steps']} "
      f"steps of {s['sft_batch_size']} demonstrations; every algorithm "
      f"then trains from that SFT checkpoint for {s['steps']} steps of "
      f"{s['prompts_per_step']} prompts x {s['samples_per_prompt']} "
      f"responses (temperature {s['rollout_temperature']:g}, at most "
      f"{s['max_new_tokens']} tokens) on the score "
      f"{s['gold_weight']:g} x gold reward + {s['format_weight']:g} x "
      f"format reward (`{s['format_pattern']}` found in the completion), "
      f"with no reward model, once per seed ({seeds}: config.seed, the "
      "rollouts' samples and the prompt order; SFT is shared). Learning "
      f"rate {s['learning_rate']:g} (Adafactor, constant).",
      "",
      "## Held-out accuracy",
      "",
      f"On the first {s['eval_prompts']} sums of the task's `test` split, "
      "which no stage trains on. Mean ± standard error over the seeds "
      "(`results.json` has each seed's figures).",
      "",
      f"| algorithm | greedy pass@1 | mean@{s['k']} (T = 1) | win rate vs "
      "SFT | KL(pi‖SFT) | length | format share | decode steps saved | "
      "minutes |",
      "|---|---|---|---|---|---|---|---|---|",
      f"| sft | {sft['greedy_pass_at_1']:.3f} | "
      f"{_cell(sft, 'sampled_mean_at_k', 3) if 'mean' in sft else '-'} | "
      f"0.5 | 0 | {sft.get('length', float('nan')):.2f} | - | - | "
      f"{sft['minutes']:.1f} |",
  ]
  for name, r in runs.items():
    lines.append(
        f"| {name} | {_cell(r, 'greedy_pass_at_1', 3)} | "
        f"{_cell(r, 'sampled_mean_at_k', 3)} | "
        f"{_cell(r, 'win_rate_vs_sft', 3)} | {_cell(r, 'kl_to_sft', 3)} | "
        f"{_cell(r, 'length', 2)} | {_cell(r, 'format_share', 3)} | "
        f"{_cell(r, 'decode_steps_saved_fraction', 2)} | "
        f"{_cell(r, 'minutes', 1)} |")
  lines += [
      "",
      f"- **greedy pass@1**: the gold reward of the greedy decode of each "
      f"prompt. **mean@{s['k']}**: the mean gold reward of {s['k']} samples "
      "per prompt at temperature 1; the sft row's is the runs' first "
      "evaluation (the SFT policy, sampled with each seed). "
      "**win rate vs SFT**: the gold reward decides each sample against an "
      "SFT sample (ties 1/2). **KL(pi‖SFT)**: per response, k1 on the "
      "policy's own samples at temperature 1. **length**: tokens of those "
      "samples, EOS included.",
      "- **format share**: the format term's share of the score's absolute "
      "size (`reward/format_share`, mean over the training steps: "
      "0.1 x format / (gold + 0.1 x format [+ |overlong|])).",
      f"- **decode steps saved**: `online.stop_when_done` ends a rollout's "
      f"decoding once every response has its EOS; the share of the "
      f"{s['max_new_tokens']} steps per sampling round (DAPO: per round of "
      "dynamic sampling) it did not run, over the training steps "
      "(`decode_steps` in metrics.jsonl). The responses are the same "
      "either way.",
      "- **minutes**: wall time of one run (training and its two "
      "evaluations, the greedy one not included), mean over the seeds; "
      "an algorithm's first seed includes compiling its step, the others "
      "read it from the compilation cache; the sft row is its training. "
      "The machine was shared with other jobs, so they are rough.",
      "",
      "## Training",
      "",
      "Gold reward of the rollouts (temperature 1) over the first and last "
      "10 steps, the format reward's mean over training, and what DAPO's "
      "additions did:",
      "",
      "| algorithm | gold, first 10 steps | gold, last 10 steps | format "
      "reward | response length | decode steps / budget |",
      "|---|---|---|---|---|---|",
  ]
  for name, r in runs.items():
    m = r["mean"]
    budget = (f"{m['decode_steps']:.2f} / {m['decode_steps_budget']:.1f}"
              if "decode_steps" in m else "-")
    lines.append(
        f"| {name} | {_cell(r, 'train_gold_reward_first10', 3)} | "
        f"{_cell(r, 'train_gold_reward_last10', 3)} | "
        f"{_cell(r, 'format_reward', 3)} | "
        f"{_cell(r, 'train_response_length', 2)} | {budget} |")
  if "dapo" in runs and "dynamic_sampling_rounds" in runs["dapo"]["mean"]:
    d = runs["dapo"]
    lines += [
        "",
        f"DAPO's dynamic sampling drew {_cell(d, 'dynamic_sampling_rounds', 2)}"
        f" rounds of {s['prompts_per_step']} prompts per step and dropped "
        f"{_cell(d, 'dynamic_sampling_dropped_fraction', 3)} of the groups "
        "it drew (all four responses equally rewarded); its overlong "
        f"penalty averaged {_cell(d, 'overlong_reward', 4)} per response "
        f"(share {_cell(d, 'overlong_share', 4)}).",
    ]
  lines += ["", "## Settings", ""]
  for name, r in runs.items():
    lines.append(f"- **{name}**: {r['description']}; overrides "
                 f"`{json.dumps(r['overrides'], sort_keys=True)}`.")
  lines += [
      "",
      "Settings shared by every run: " + ", ".join(
          f"`{k}={v}`" for k, v in sorted(s["shared_overrides"].items()))
      + ".",
      "",
  ]
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", default=str(REPO / "experiments" / "results"
                                      / "rlvr"))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                 help=f"comma-separated, of {', '.join(ALGORITHMS)}")
  p.add_argument("--steps", type=int, default=120,
                 help="online steps of every run")
  p.add_argument("--sft_steps", type=int, default=600)
  p.add_argument("--eval_prompts", type=int, default=512,
                 help="held-out test sums each policy is judged on")
  p.add_argument("--k", type=int, default=4,
                 help="samples per held-out prompt (mean@k)")
  args = p.parse_args()
  names = [a for a in args.algorithms.split(",") if a]
  unknown = sorted(set(names) - set(ALGORITHMS))
  if unknown:
    sys.exit(f"error: --algorithms: unknown {unknown}; choose from "
             f"{list(ALGORITHMS)}")
  seeds = [int(x) for x in args.seeds.split(",")]
  os.makedirs(args.workdir, exist_ok=True)
  # Before JAX is imported: one persistent compilation cache for every run.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(args.workdir, "xla_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  from jaxrlhf.data import synthetic_arithmetic  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  started = time.time()
  elapsed = lambda: (time.time() - started) / 60
  config = base_config(args.sft_steps)
  sft_dir = os.path.join(args.workdir, f"sft_{args.sft_steps}")

  def train_sft():
    print(f"=== sft: {args.sft_steps} steps ({elapsed():.1f} min)", flush=True)
    t = time.time()
    loop.train(copy.deepcopy(config), sft_dir)
    return {"minutes": (time.time() - t) / 60}

  sft = cached(os.path.join(sft_dir, "rlvr_time.json"), train_sft)
  sft.update(cached(os.path.join(sft_dir, f"rlvr_greedy_e{args.eval_prompts}.json"),
                    lambda: greedy_eval(config, sft_dir, args.eval_prompts)))
  print(f"sft: greedy pass@1 {sft['greedy_pass_at_1']:.3f} on "
        f"{args.eval_prompts} test sums ({elapsed():.1f} min)", flush=True)

  tag = f"sft{args.sft_steps}_s{args.steps}_e{args.eval_prompts}_k{args.k}"
  by_name = {}
  for name in names:
    for seed in seeds:
      run_dir = os.path.join(args.workdir, "runs", f"{name}_{tag}_seed{seed}")
      os.makedirs(run_dir, exist_ok=True)

      def train(name=name, seed=seed, run_dir=run_dir):
        print(f"=== {name}, seed {seed} ({elapsed():.1f} min)", flush=True)
        t = time.time()
        loop.train(copy.deepcopy(online_config(
            config, name, sft_dir, seed, args.steps, args.eval_prompts,
            args.k)), run_dir)
        return {"minutes": (time.time() - t) / 60}

      minutes = cached(os.path.join(run_dir, "rlvr_time.json"),
                       train)["minutes"]
      greedy = cached(os.path.join(run_dir, "rlvr_greedy.json"),
                      lambda run_dir=run_dir: greedy_eval(
                          config, run_dir, args.eval_prompts))
      figures = run_figures(read_metrics(run_dir), greedy, minutes)
      by_name.setdefault(name, {})[seed] = figures
      print(f"{name}, seed {seed}: greedy pass@1 "
            f"{figures['greedy_pass_at_1']:.3f}, mean@{args.k} "
            f"{figures['sampled_mean_at_k']:.3f} (SFT "
            f"{figures['sft_sampled_mean_at_k']:.3f}), KL "
            f"{figures['kl_to_sft']:.3f}, format share "
            f"{figures['format_share']:.3f}, {minutes:.1f} min "
            f"({elapsed():.1f} min in all)", flush=True)

  runs = {}
  for name, by_seed in by_name.items():
    _, overrides, description = ALGORITHMS[name]
    runs[name] = dict(mean_and_stderr(by_seed), description=description,
                      overrides=overrides,
                      algorithm=ALGORITHMS[name][0],
                      by_seed={str(s): f for s, f in by_seed.items()})
  # The SFT policy's first evaluation is the same for every algorithm of
  # a seed (the same policy and sampling seed): one value per seed.
  per_seed = {}
  for by_seed in by_name.values():
    for seed, f in by_seed.items():
      per_seed.setdefault(seed, []).append(f["sft_sampled_mean_at_k"])
  sft_sampled = [sum(v) / len(v) for v in per_seed.values()]
  sft_row = dict(sft)
  if sft_sampled:
    n = len(sft_sampled)
    m = sum(sft_sampled) / n
    sd = (math.sqrt(sum((v - m) ** 2 for v in sft_sampled) / (n - 1) / n)
          if n > 1 else 0.0)
    sft_row.update(mean={"sampled_mean_at_k": m},
                   stderr={"sampled_mean_at_k": sd}, seeds=n)
  sft_row["length"] = sft["greedy_length"]
  command = ("python experiments/rlvr.py --workdir=/tmp/rlvr --out="
             + os.path.relpath(os.path.abspath(args.out), REPO))
  defaults_of = {"--seeds": "0,1,2", "--algorithms": ",".join(ALGORITHMS),
                 "--steps": 120, "--sft_steps": 600, "--eval_prompts": 512,
                 "--k": 4}
  given = {"--seeds": args.seeds, "--algorithms": ",".join(names),
           "--steps": args.steps, "--sft_steps": args.sft_steps,
           "--eval_prompts": args.eval_prompts, "--k": args.k}
  for flag, value in given.items():
    if str(value) != str(defaults_of[flag]):
      command += f" {flag}={value}"
  model = config.model
  results = {
      "sft": sft_row,
      "runs": runs,
      "setup": {
          "command": command,
          "task": TASK,
          "demonstration_error_rate":
              synthetic_arithmetic.DEMONSTRATION_ERROR_RATE,
          "model": (f"t5 {model.size}: width 64, 2 encoder + 2 decoder "
                    "layers, 4 heads"),
          "sft_steps": args.sft_steps,
          "sft_batch_size": config.train.batch_size,
          "steps": args.steps,
          "prompts_per_step": PROMPTS_PER_STEP,
          "samples_per_prompt": SAMPLES_PER_PROMPT,
          "rollout_temperature": 1.0,
          "max_new_tokens": RESPONSE_TOKENS,
          "gold_weight": GOLD_WEIGHT,
          "format_weight": FORMAT_WEIGHT,
          "format_pattern": config.rewards.format.pattern,
          "learning_rate": ONLINE_LEARNING_RATE,
          "seeds": seeds,
          "eval_prompts": args.eval_prompts,
          "k": args.k,
          "shared_overrides": {
              k: v for k, v in flatten_overrides(online_config(
                  config, "grpo", "<sft>", 0, args.steps, args.eval_prompts,
                  args.k), config).items()
              if k not in ("seed", "algorithm", "init.policy_checkpoint",
                           "online.num_minibatches")},
          "minutes": round(elapsed(), 1),
          "machine": (f"{os.cpu_count()} CPU cores, shared with other jobs, "
                      f"JAX {jax.__version__} on "
                      f"{jax.devices()[0].platform.upper()}"),
      },
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2, sort_keys=True)
  readme = format_readme(results)
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write(readme)
  print(readme)
  print(f"Done in {elapsed():.1f} min; results in {args.out}")


def flatten_overrides(c, base, prefix=""):
  """The fields of config `c` that differ from `base`, as dotted paths."""
  out = {}
  for k, v in c.items():
    b = base.get(k) if hasattr(base, "get") else None
    if hasattr(v, "items"):
      out.update(flatten_overrides(v, b if b is not None else {},
                                   f"{prefix}{k}."))
    elif v != b:
      out[f"{prefix}{k}"] = v
  return out


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
