"""The offline pipeline on a task with a gold reward, end to end.

  SFT -> sample completions from the SFT policy -> label them with the gold
  reward (Bradley-Terry pairs with annotator noise; single trajectories with
  normalised rewards) -> reward model (its head bias then set so that the
  SFT demonstrations score mean 0, PPO detail 15) -> DPO, KTO and DRO-V
  from the SFT policy -> a table of win rates against SFT judged by the
  gold reward.

Online stages run after the reward model and optimise against it: PPO,
RLOO, GRPO, REINFORCE and rejection sampling from the SFT policy, and
best-of-N of the SFT policy as a baseline that trains nothing. They read the
task's prompts, so they need no labelled data.

Each stage is an ordinary run of `jaxrlhf.train.loop.train` in its own
sub-directory of the workdir (`sft/`, `reward_model/`, `dpo/`, ...), with the
stage's config derived from the pipeline's; the labelled data are JSONL
files under `data/`, read back through the same file sources and seqio tasks
as real data. Every stage resumes, so re-running the command after an
interruption continues where it stopped. The table is printed and written to
`<workdir>/results.json`.
"""

import copy
import json
import os
from typing import Dict, List

import jax
import ml_collections

from jaxrlhf import algorithms
from jaxrlhf import console
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import rejection_sampling
from jaxrlhf.data import synthetic_feedback
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.train import loop

PAIRS_TASK = "offline_pipeline_pairs"
TRAJECTORY_TASK = "offline_pipeline_trajectories"
# The kinds of labelled data the data stage writes.
DATA_KINDS = ("pairs", "trajectory")
# Policy stages, from the registry: offline policy algorithms on the data
# stage's pairs or trajectories (stage name = algorithm -> its data kind),
# then the online ones, which score samples with the reward_model stage's
# model.
POLICY_STAGES = {
    a.name: a.data for a in algorithms.REGISTRY.values()
    if a.pipeline_stage and a.networks.reference and not a.online
    and a.data in DATA_KINDS}
ONLINE_STAGES = tuple(a.name for a in algorithms.REGISTRY.values()
                      if a.pipeline_stage and a.online)
# Settings of online stages on top of the pipeline's config. With the
# pipeline's noisy reward model, GRPO as published (advantages divided by the
# group std, per-response mean of token losses, beta 0.04) lengthens
# responses and loses gold reward: the length bias Liu et al. 2025 describe.
# The grpo stage runs their Dr. GRPO fix, with a stronger KL term.
ONLINE_STAGE_SETTINGS = {
    "grpo": {"grpo.scale_by_std": False, "grpo.reduction": "constant_length",
             "grpo.kl_coef": 0.1},
}
BEST_OF_N = "best_of_n"
ALL_STAGES = (("sft", "data", "reward_model") + tuple(POLICY_STAGES)
              + ONLINE_STAGES + (BEST_OF_N,))
TABLE_METHODS = tuple(POLICY_STAGES) + ONLINE_STAGES + (BEST_OF_N,)


def stages_of(config) -> List[str]:
  stages = [s.strip() for s in config.pipeline.stages.split(",") if s.strip()]
  for s in stages:
    if s not in ALL_STAGES:
      raise ValueError(f"config.pipeline.stages: unknown stage {s!r}; "
                       f"choose from {ALL_STAGES}.")
  return stages


def stage_config(config, algorithm: str, **changes) -> ml_collections.ConfigDict:
  """The pipeline's config turned into one stage's run config."""
  c = copy.deepcopy(config)
  defaults.apply_overrides(c, {"pipeline.stages": "", "algorithm": algorithm,
                               **changes})
  return c


# --- data -----------------------------------------------------------------------


def data_paths(workdir):
  """{kind: {split: path}} of the labelled data files in a pipeline workdir."""
  d = os.path.join(workdir, "data")
  return {kind: {split: os.path.join(d, f"{kind}_{split}.jsonl")
                 for split in ("train", "validation")}
          for kind in ("pairs", "trajectory")}


def make_data(config, workdir: str, sft_workdir: str) -> None:
  """Samples completions from the SFT policy and labels them (once)."""
  done = os.path.join(workdir, "data", "DONE")
  if os.path.exists(done):
    return
  p = config.pipeline
  c = stage_config(config, "sft", **{"init.policy_checkpoint": sft_workdir})
  os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
  gold = tasks.gold_reward_for(c.data.task)
  with sharding.activate(c) as mesh:
    trainer = algorithms.build(c, mesh)
    params = trainer.view(trainer.init_state()).params["policy"]
    for split, num_prompts in (("train", p.num_prompts),
                               ("validation", p.num_eval_prompts)):
      # Held-out pairs come from the end of the validation split, away from
      # the prompts that judge the policies.
      features, texts = _prompts(c, trainer, split, num_prompts)
      prompts = [t["inputs"] for t in texts]
      completions = [[] for _ in prompts]
      for k in range(p.samples_per_prompt):
        s = evaluation.sample(trainer, params, features, greedy=False,
                              temperature=p.sampling_temperature,
                              seed=1000 + k)
        # A completion that never ended fills the whole length; the file
        # source reports and skips it as too long for an EOS.
        for i, text in enumerate(evaluation.completion_texts(
            trainer.vocabulary, s)):
          completions[i].append(text)
      paths = data_paths(workdir)
      n_pairs = synthetic_feedback.write_synthetic_feedback(
          paths["pairs"][split], "pairs", prompts, completions, gold,
          beta=p.annotator_beta, seed=config.seed)
      n_traj = synthetic_feedback.write_synthetic_feedback(
          paths["trajectory"][split], "trajectory", prompts, completions, gold)
      console.log(
          f"data: {split}: {len(prompts)} prompts x {p.samples_per_prompt} "
          f"SFT samples -> {n_pairs} pairs, {n_traj} trajectories")
  with open(done, "w") as f:
    f.write("ok\n")


def _prompts(config, trainer, split, num_prompts):
  import seqio
  from jaxrlhf.data import pipeline
  features, texts = pipeline.eval_examples(
      config.data.task, "train" if split == "train" else "validation",
      trainer.feature_lengths, seqio.EncDecFeatureConverter(pack=False),
      num_prompts if split == "train" else
      num_prompts + config.eval.num_examples)
  tokens = features["encoder_input_tokens"]
  if split != "train":  # skip the prompts that judge the policies
    tokens, texts = tokens[config.eval.num_examples:], texts[
        config.eval.num_examples:]
  return tokens, texts


def data_task_settings(config, workdir: str, kind: str) -> Dict[str, object]:
  """The config fields that make a stage read the labelled data of `kind`
  ("pairs" or "trajectory") as its file task, so that the stage's
  config.json says exactly what it read.

  A sampled completion that never ended fills all data.targets_length
  tokens; so does one whose EOS fell on the last slot, which the limit one
  token short of that length also skips (as the committed quickstart table
  was made).
  """
  paths = data_paths(workdir)[kind]
  return {
      "data.task": PAIRS_TASK if kind == "pairs" else TRAJECTORY_TASK,
      "data.files.train": paths["train"],
      "data.files.validation": paths["validation"],
      "data.files.layout": "columns",
      "data.files.column_mapping": "",
      "data.files.vocabulary": "",
      "data.files.normalize_rewards": kind == "trajectory",
      "data.files.on_bad_row": "skip_and_report",
      "data.files.max_completion_tokens": config.data.targets_length - 1,
  }


# --- the pipeline ----------------------------------------------------------------


def run(config, workdir: str) -> Dict[str, Dict[str, float]]:
  """Runs the configured stages; returns {method: results}."""
  stages = stages_of(config)
  loop.preflight(config, workdir)
  loop.check_workdir(workdir)
  # One pipeline at a time in a workdir (each stage's run also locks its own).
  with loop.workdir_lock(workdir):
    loop.write_run_config(workdir, config)
    return _run_stages(config, workdir, stages)


def _run_stages(config, workdir: str, stages) -> Dict[str, Dict[str, float]]:
  p = config.pipeline
  sft_dir = os.path.join(workdir, "sft")
  results: Dict[str, Dict[str, float]] = {}
  if "sft" in stages:
    console.log("=== stage sft ===")
    summary = loop.train(stage_config(config, "sft"), sft_dir)
    results["sft"] = summary
    console.log(loop.gold_reward_line(summary) or "")
  if "data" in stages:
    console.log("=== stage data ===")
    make_data(config, workdir, sft_dir)
  if "reward_model" in stages:
    console.log("=== stage reward_model ===")
    results["reward_model"] = loop.train(stage_config(
        config, "reward_model", **data_task_settings(config, workdir, "pairs"),
        **{
            "train.num_steps": p.reward_model_steps,
            "init.policy_checkpoint": sft_dir,
            "optimizer.learning_rate": p.reward_model_learning_rate,
            # PPO detail 15: the SFT demonstrations of the data's prompts
            # score mean 0, so the online stages see centred rewards.
            "reward_model.normalize_on_task": config.data.task,
            "reward_model.normalize_num_examples": p.num_prompts,
        }), os.path.join(workdir, "reward_model"))
  for stage, kind in POLICY_STAGES.items():
    if stage not in stages:
      continue
    console.log(f"=== stage {stage} ===")
    results[stage] = loop.train(stage_config(
        config, stage, **data_task_settings(config, workdir, kind), **{
            "train.num_steps": p.policy_steps,
            "init.policy_checkpoint": sft_dir,
            "optimizer.learning_rate": p.policy_learning_rate,
            "optimizer.warmup_steps": min(config.optimizer.warmup_steps,
                                          p.policy_steps // 4),
            "eval.task": config.data.task,
            "eval.num_samples": p.eval_samples_per_prompt,
        }), os.path.join(workdir, stage))
  rm_dir = os.path.join(workdir, "reward_model")
  for stage in ONLINE_STAGES:
    if stage not in stages:
      continue
    console.log(f"=== stage {stage} ===")
    results[stage] = loop.train(online_stage_config(config, stage, sft_dir,
                                                    rm_dir),
                                os.path.join(workdir, stage))
  if BEST_OF_N in stages:
    console.log(f"=== stage {BEST_OF_N} ===")
    results[BEST_OF_N] = best_of_n_stage(config, workdir, sft_dir, rm_dir)
  table = results_table(results)
  if table:
    if jax.process_index() == 0:
      with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(table, f, indent=2, sort_keys=True)
    console.log(format_table(
        table, config, results.get("sft", {}).get("eval/gold_reward")))
  return results


def online_stage_config(config, algorithm, sft_dir, rm_dir):
  p = config.pipeline
  return stage_config(config, algorithm, **{
      "train.num_steps": p.online_steps,
      "init.policy_checkpoint": sft_dir,
      "online.reward_model_checkpoint": rm_dir,
      "optimizer.learning_rate": p.online_learning_rate,
      "optimizer.warmup_steps": min(config.optimizer.warmup_steps,
                                    p.online_steps // 4),
      "eval.task": config.data.task,
      "eval.num_samples": p.eval_samples_per_prompt,
      **ONLINE_STAGE_SETTINGS.get(algorithm, {}),
  })


def best_of_n_stage(config, workdir, sft_dir, rm_dir) -> Dict[str, float]:
  """Best-of-N of the SFT policy by the reward model, judged like the
  trained policies (once; the result is kept in best_of_n/results.json)."""
  out_dir = os.path.join(workdir, BEST_OF_N)
  path = os.path.join(out_dir, "results.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  c = online_stage_config(config, "rejection_sampling", sft_dir, rm_dir)
  with sharding.activate(c) as mesh:
    trainer = algorithms.build(c, mesh)
    metrics = rejection_sampling.best_of_n_evaluation(
        trainer, trainer.init_state(), config.pipeline.best_of_n)
  metrics = {k: float(v) for k, v in metrics.items()}
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
      json.dump(metrics, f, indent=2, sort_keys=True)
  console.log(f"best-of-{config.pipeline.best_of_n}: gold reward "
                  f"{metrics['eval/gold_reward']:.4f}, win rate vs SFT "
                  f"{metrics['eval/win_rate']:.3f}")
  return metrics


def results_table(results) -> Dict[str, Dict[str, float]]:
  """One entry per policy method: win rate against SFT (with its standard
  error), mean gold reward, KL to the SFT reference and mean length."""
  table = {}
  reference = None
  for method in TABLE_METHODS:
    r = results.get(method)
    if not r or "eval/win_rate" not in r:
      continue
    reference = r.get("eval/reference_gold_reward", reference)
    table[method] = {
        "win_rate_vs_sft": r["eval/win_rate"],
        "win_rate_stderr": r["eval/win_rate_stderr"],
        "gold_reward": r["eval/gold_reward"],
        "kl_to_sft": r["eval/kl"],
        "mean_length": r["eval/length"],
    }
    if "eval/reward_model_score" in r:
      table[method]["reward_model_score"] = r["eval/reward_model_score"]
  if table and reference is not None:
    table["sft"] = {"win_rate_vs_sft": 0.5, "gold_reward": reference,
                    "kl_to_sft": 0.0}
  if "reward_model" in results and "eval/accuracy" in results["reward_model"]:
    table["reward_model"] = {
        "heldout_pair_accuracy": results["reward_model"]["eval/accuracy"]}
  return table


def format_table(table, config=None, sft_greedy_gold_reward=None) -> str:
  """The results table as printed; with the pipeline's `config`, a note
  says how the policies were sampled (and, with it, the SFT policy's greedy
  gold reward, which the sft stage prints and which is not the sft row's)."""
  lines = ["", "method              win rate vs SFT    gold reward   "
           "KL(pi||SFT)   length   RM score", "-" * 89]
  for method in ("sft",) + TABLE_METHODS:
    if method not in table:
      continue
    r = table[method]
    se = r.get("win_rate_stderr")
    win = f"{r['win_rate_vs_sft']:.3f}" + (f" +- {se:.3f}" if se else "")
    length = f"{r['mean_length']:.2f}" if "mean_length" in r else "-"
    score = (f"{r['reward_model_score']:.4f}" if "reward_model_score" in r
             else "-")
    name = method + ("*" if method == BEST_OF_N else "")
    lines.append(f"{name:<19} {win:<18} {r['gold_reward']:>11.4f} "
                 f"{r['kl_to_sft']:>13.4f}   {length:>6}   {score:>8}")
  if BEST_OF_N in table:
    lines.append("* best-of-N of the SFT policy by the reward model; its KL "
                 "is the analytic log N - (N - 1) / N.")
  if "reward_model" in table:
    lines.append("reward model: held-out pair accuracy "
                 f"{table['reward_model']['heldout_pair_accuracy']:.3f}")
  if config is not None and "sft" in table:
    e = config.eval
    note = (f"Gold reward, KL and length: {e.num_examples} held-out prompts x "
            f"{config.pipeline.eval_samples_per_prompt} samples at temperature "
            f"{e.temperature:g}; the sft row is the SFT policy sampled the "
            "same way")
    if sft_greedy_gold_reward is not None:
      note += (f" (its greedy decodes score {sft_greedy_gold_reward:.4f}, "
               "the sft stage's closing line)")
    lines.append(note + ".")
  return "\n".join(lines)
