r"""The PPO implementation-details paper's observations, in miniature.

  pip install matplotlib   # for the plots only; not a library dependency
  python experiments/ppo_details.py --workdir=/tmp/ppo_details \
      --out=experiments/results/ppo_details

On the built-in synthetic summarisation task (a program is the gold
reward, so every effect is measured exactly) with a tiny T5, this runs the
quickstart's SFT -> data -> reward model stages once, then PPO variants from
the SFT policy against that reward model ("The N+ implementation details of
RLHF with PPO", Huang et al. 2024):

  ppo                   Table 7's details, scaled down (see configs below):
                        does the reward-model score rise, and the gold
                        reward with it (Figure 12)?
  ppo_reward_whitening  + reward whitening without shifting the mean
                        (detail 24): shorter responses (Figure 7)?
  eos_trick_on/off      responses of at most 5 tokens, so that many do not
                        end: with the EOS trick (detail 23) a response
                        without EOS scores -1; without it the reward model's
                        output at a non-EOS token (never trained, detail 13)
                        is the reward;
  overoptimisation      no KL penalty and three times the steps: the gold
                        reward against KL(pi || SFT) while the proxy (reward
                        model) score keeps rising (Gao et al. 2023).

Each run evaluates every `--eval_every` steps on 128 held-out prompts (2
samples each at temperature 1): gold reward, win rate against the SFT
policy, KL(pi || SFT), length, EOS rate and the reward model's score. The
script writes `results.md` / `results.json` (per run: each seed's figures,
their mean and standard error; and the reward model's held-out pair
accuracy) and four PNG plots (the first seed's) into --out. Every stage
resumes, so an interrupted run continues.
"""

import argparse
import copy
import json
import math
import os
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def runs(steps: int):
  """name -> (what it tests, config overrides)."""
  short = {"online.max_new_tokens": 5, "data.targets_length": 5}
  return {
      "ppo": ("Table 7 details: EOS trick, no reward whitening, "
              "advantage whitening, value from the RM, beta 0.05", {}),
      "ppo_reward_whitening": ("+ reward whitening (detail 24)",
                               {"ppo.whiten_rewards": True}),
      "eos_trick_on": ("5-token responses, EOS trick on (detail 23)", short),
      "eos_trick_off": ("5-token responses, EOS trick off",
                        dict(short, **{"online.eos_trick": False})),
      "overoptimisation": ("no KL penalty, 3x the steps",
                           {"online.kl_coef": 0.0,
                            "train.num_steps": 3 * steps}),
  }


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  train = [r for r in rows if "score" in r]
  evals = [r for r in rows if "eval/gold_reward" in r]
  return train, evals


def summarise_run(train, evals):
  """One run's figures: its last evaluation and its training statistics."""
  last = evals[-1]
  row = {
      "steps": last["step"],
      "gold_reward": last["eval/gold_reward"],
      "sft_gold_reward": evals[0]["eval/reference_gold_reward"],
      "win_rate_vs_sft": last["eval/win_rate"],
      "win_rate_stderr": last["eval/win_rate_stderr"],
      "reward_model_score": last["eval/reward_model_score"],
      "sft_reward_model_score": evals[0]["eval/reward_model_score"],
      "kl_to_sft": last["eval/kl"],
      "length": last["eval/length"],
      "eos_rate": last["eval/eos_rate"],
      "train_eos_rate_last10": sum(r["eos_rate"] for r in train[-10:]) / 10,
      "train_length_last10": sum(r["response_length"]
                                 for r in train[-10:]) / 10,
  }
  m = sum(r["token_reward_mean"] for r in train) / len(train)
  s = sum(r["token_reward_std"] for r in train) / len(train)
  # Mean-preserving reward whitening adds L * m * (1 - 1/s) to the return
  # of an L-token response (see jaxrlhf/algorithms/online/ppo.py).
  row.update(token_reward_mean=m, token_reward_std=s,
             whitening_bonus_per_token=m * (1 - 1 / s))
  return row


def summarise(all_runs, descriptions):
  """{run: {"description", "seeds": {seed: figures}, "mean": figures,
  "stderr": figures}}: the mean over seeds and its standard error (sample
  standard deviation / sqrt(seeds))."""
  table = {}
  for name, by_seed in all_runs.items():
    rows = {seed: summarise_run(*runs) for seed, runs in by_seed.items()}
    n = len(rows)
    mean, stderr = {}, {}
    for key in next(iter(rows.values())):
      values = [r[key] for r in rows.values()]
      mean[key] = sum(values) / n
      var = (sum((v - mean[key]) ** 2 for v in values) / (n - 1)
             if n > 1 else 0.0)
      stderr[key] = math.sqrt(var / n)
    table[name] = {"description": descriptions[name], "seeds": rows,
                   "mean": mean, "stderr": stderr}
  return table


def format_markdown(table):
  seeds = len(next(iter(table.values()))["seeds"])

  def cell(r, key, digits):
    return (f"{r['mean'][key]:.{digits}f} ± {r['stderr'][key]:.{digits}f}")

  lines = [
      f"Mean ± standard error over {seeds} seeds of the PPO runs (one SFT "
      "policy and reward model).",
      "",
      "| run | steps | SFT gold reward | gold reward | win rate vs SFT | "
      "SFT RM score | RM score | KL(pi‖SFT) | length | EOS rate | m(1-1/s) |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in table.items():
    m = r["mean"]
    lines.append(
        f"| {name} | {m['steps']:.0f} | {m['sft_gold_reward']:.3f} | "
        f"{cell(r, 'gold_reward', 3)} | {cell(r, 'win_rate_vs_sft', 3)} | "
        f"{m['sft_reward_model_score']:.2f} | "
        f"{cell(r, 'reward_model_score', 2)} | {cell(r, 'kl_to_sft', 2)} | "
        f"{cell(r, 'length', 2)} | {cell(r, 'eos_rate', 3)} | "
        f"{cell(r, 'whitening_bonus_per_token', 3)} |")
  lines.append("")
  lines.append("Gold reward, win rate, KL (k1 on the policy's samples), "
               "length (tokens, EOS included) and EOS rate: 128 held-out "
               "prompts x 2 samples at temperature 1, at the last step. "
               "SFT's numbers are its own samples under the same "
               "evaluation (for the 5-token runs, at 5 tokens). m and s: "
               "mean and std of the per-token rewards (KL penalty, score at "
               "the last token) over training; m(1-1/s) is the return per "
               "token that whitening them without shifting the mean adds "
               "(a length bonus when positive).")
  for name, r in table.items():
    lines.append(f"- **{name}**: {r['description']}.")
  return "\n".join(lines) + "\n"


def plot(all_runs, out):
  """The first seed's curves (`all_runs`: {run: (train rows, eval rows)})."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]

  def smooth(xs, ys, k=5):
    out_y = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1])
             for i in range(len(ys))]
    return xs, out_y

  # 1. PPO learning curves (Figure 12).
  train, evals = all_runs["ppo"]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  axes[0].plot(*smooth(*series(train, "score")), label="RM score (rollouts)")
  axes[0].plot(*smooth(*series(train, "rlhf_reward")),
               label="RLHF reward = score - beta KL")
  axes[0].plot(*series(evals, "eval/reward_model_score"), "o-",
               label="RM score (held-out)")
  axes[0].set_title("reward model score")
  axes[1].plot(*series(evals, "eval/gold_reward"), "o-", label="PPO")
  axes[1].axhline(evals[0]["eval/reference_gold_reward"], color="gray",
                  ls="--", label="SFT")
  axes[1].set_title("gold reward (held-out)")
  axes[2].plot(*smooth(*series(train, "kl")), label="rollouts (T = 0.7)")
  axes[2].plot(*series(evals, "eval/kl"), "o-", label="held-out (T = 1)")
  axes[2].set_title("KL(pi || SFT) per response")
  for ax in axes:
    ax.set_xlabel("PPO iteration")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "ppo_training.png"), dpi=110)
  plt.close(fig)

  # 2. EOS trick on vs off.
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  for name, label in (("eos_trick_on", "EOS trick on"),
                      ("eos_trick_off", "EOS trick off")):
    train, evals = all_runs[name]
    axes[0].plot(*smooth(*series(train, "eos_rate")), label=label)
    axes[1].plot(*smooth(*series(train, "raw_score")), label=label)
    axes[2].plot(*series(evals, "eval/gold_reward"), "o-", label=label)
  axes[0].set_title("rollouts ending with EOS (5 tokens)")
  axes[1].set_title("RM output at the last token")
  axes[2].set_title("gold reward (held-out, 5 tokens)")
  for ax in axes:
    ax.set_xlabel("PPO iteration")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "eos_trick.png"), dpi=110)
  plt.close(fig)

  # 3. Reward whitening (Figure 7): length, and gold reward against length.
  fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
  for name, label in (("ppo", "no reward whitening"),
                      ("ppo_reward_whitening", "reward whitening")):
    train, evals = all_runs[name]
    axes[0].plot(*smooth(*series(train, "response_length")), label=label)
    axes[1].plot([r["eval/length"] for r in evals],
                 [r["eval/gold_reward"] for r in evals], "o-", label=label)
  axes[0].set_title("response length (rollouts, tokens)")
  axes[0].set_xlabel("PPO iteration")
  axes[1].set_title("gold reward vs length (held-out)")
  axes[1].set_xlabel("mean length (tokens)")
  for ax in axes:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "reward_whitening.png"), dpi=110)
  plt.close(fig)

  # 4. Over-optimisation: gold and proxy against KL, in training order.
  train, evals = all_runs["overoptimisation"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  kl = [r["eval/kl"] for r in evals]
  steps = [r["step"] for r in evals]
  for ax, key, title in (
      (axes[0], "eval/gold_reward", "gold reward (held-out)"),
      (axes[1], "eval/reward_model_score", "reward model score (proxy)")):
    values = [r[key] for r in evals]
    ax.plot(kl, values, "-", color="lightgray", zorder=1)
    points = ax.scatter(kl, values, c=steps, cmap="viridis", zorder=2)
    ax.set_xlabel("KL(pi || SFT) per response (held-out)")
    ax.set_title(title)
  axes[0].axhline(evals[0]["eval/reference_gold_reward"], color="gray",
                  ls="--", label="SFT")
  axes[0].legend(fontsize=8)
  fig.colorbar(points, ax=axes, label="PPO iteration")
  fig.suptitle("over-optimisation: PPO without a KL penalty")
  fig.savefig(os.path.join(out, "overoptimisation.png"), dpi=110,
              bbox_inches="tight")
  plt.close(fig)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", default=str(REPO / "experiments" / "results"
                                      / "ppo_details"))
  p.add_argument("--steps", type=int, default=150,
                 help="PPO iterations per run (the over-optimisation run: 3x)")
  p.add_argument("--eval_every", type=int, default=25)
  p.add_argument("--only", default="", help="comma-separated runs")
  p.add_argument("--seeds", default="0,1,2",
                 help="comma-separated config.seed values of the PPO runs "
                 "(sampling, prompt order); SFT, data and the reward model "
                 "are made once")
  args = p.parse_args()

  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top

  started = time.time()
  config = defaults.load_config_file(REPO / "configs" / "quickstart.py")
  config.pipeline.stages = "sft,data,reward_model"
  config.eval.num_examples = 128
  config.pipeline.eval_samples_per_prompt = 2
  config.pipeline.online_steps = args.steps
  stages = offline_pipeline.run(config, args.workdir)
  sft_dir = os.path.join(args.workdir, "sft")
  rm_dir = os.path.join(args.workdir, "reward_model")

  all_runs, descriptions = {}, {}
  selected = [s for s in args.only.split(",") if s]
  seeds = [int(x) for x in args.seeds.split(",")]
  for seed in seeds:
    for name, (description, overrides) in runs(args.steps).items():
      if selected and name not in selected:
        continue
      c = offline_pipeline.online_stage_config(config, "ppo", sft_dir, rm_dir)
      defaults.apply_overrides(c, {"eval.every_steps": args.eval_every,
                                   "train.log_every": 10, "seed": seed,
                                   **overrides})
      workdir = os.path.join(args.workdir, f"seed{seed}", name)
      print(f"=== seed {seed}, {name}: {description}", flush=True)
      loop.train(copy.deepcopy(c), workdir)
      all_runs.setdefault(name, {})[seed] = read_metrics(workdir)
      descriptions[name] = description

  os.makedirs(args.out, exist_ok=True)
  table = summarise(all_runs, descriptions)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"runs": table,
               "reward_model_heldout_pair_accuracy":
                   stages["reward_model"]["eval/accuracy"],
               "reward_model_heldout_pairs": config.eval.num_examples},
              f, indent=2, sort_keys=True)
  markdown = format_markdown(table)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(markdown)
  print(markdown)
  if not selected:
    plot({name: by_seed[seeds[0]] for name, by_seed in all_runs.items()},
         args.out)
  print(f"Done in {(time.time() - started) / 60:.1f} min; results in "
        f"{args.out}")


if __name__ == "__main__":
  main()
