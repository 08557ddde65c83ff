r"""The DRO paper's comparisons and ablations, in miniature.

  pip install matplotlib   # for the plots only; not a library dependency
  python experiments/dro_paper.py --workdir=/tmp/dro_paper \
      --out=experiments/results/dro_paper
  python experiments/dro_paper.py --workdir=/tmp/dro_paper \
      --labels=reward_model \
      --out=experiments/results/dro_paper/reward_model_labels
  python experiments/dro_paper.py --workdir=/tmp/dro_graded \
      --task=synthetic_summarize_graded \
      --out=experiments/results/dro_paper/graded_task

"Offline Regularised Reinforcement Learning for Large Language Models
Alignment" (Richemond et al. 2024) trains DRO-V and KTO on UltraFeedback
single trajectories (prompt, completion, reward) and judges the policies
side by side. Here the task is the built-in synthetic summarisation task,
whose gold reward is a program, with the quickstart's tiny T5:

  1. the quickstart's SFT and data stages run once: 2,000 training prompts
     x 4 SFT samples, each scored by the gold reward, normalised to mean 0
     and variance 1 over the dataset (the paper's section 4);
  2. every variant below trains from the SFT policy on those trajectories,
     once per seed (the seed changes the data order, the value head's
     initialisation and the evaluation samples; SFT and the data are shared,
     as the paper's SFT checkpoint and dataset are):
       dro_v            tau 1, two networks, one value per prompt, policy and
                        value learning rate L (the paper's defaults);
       kto_tau_*        KTO with tau (its beta) 0.1, 1, 5; desirable = reward
                        above the batch mean (the paper's KTO baseline);
       dro_v_tau_*      DRO-V with tau 0.1 and 5 (Figure 4);
       dro_v_lr_x*      policy and value learning rate L x 0.1, 0.5, 5
                        (Figure 3, top; the paper's 1e-5, 5e-5, 5e-4 around
                        its 1e-4);
       dro_v_vlr_x*     the value's learning rate alone (Figure 3, bottom);
       dro_v_single_*   one network (the policy's logits as the value,
                        dro.value_source=policy_logits) and/or one value per
                        batch (Figure 5);
  3. checkpoint selection as the paper's: every `--select_every` steps each
     run samples one completion (temperature 1) for each of
     `--select_prompts` prompts of the task's "validation" split and keeps
     the checkpoint that wins most against SFT's samples there
     (checkpoint.best_metric eval/win_rate, <run>/best); the best tau of
     each method is also picked by that validation win rate;
  4. each chosen checkpoint samples one completion (temperature 1) for each
     of `--eval_prompts` prompts of the task's "test" split, which no stage
     has seen and nothing was selected on; the gold reward decides each
     side-by-side comparison (ties count 1/2). A win rate is the mean over
     seeds; its +- is the standard error over seeds (the paper: over 5
     folds of 1,000 prompts); "s.e. per run" is the binomial standard
     error over prompts.

With `--labels=reward_model` the trajectories' rewards are instead the
scores of the quickstart pipeline's reward model (trained on Bradley-Terry
pairs of the same SFT samples; its head centred on the SFT demonstrations),
normalised the same way, while the gold reward still judges: the training
signal then differs from the judge, as UltraFeedback's ratings differ from
the paper's PaLM 2 judge. Only the variants of Figures 1-2 and 4 run.

With `--task=synthetic_summarize_graded` every stage runs on the graded
task instead, whose prompts come in three difficulty levels the prompt
shows (jaxrlhf/data/synthetic.py), and only Figure 5's variants run: the
parameter-sharing ablation, where a value per prompt has something to
learn (with either --labels).

Trajectories whose completion ends exactly at the last slot are kept (the
pipeline's own stages skip them, as its committed table was made). The
script writes `results.md` / `results.json` (every figure of its README)
and `dro_paper.png` into --out. Every stage and run resumes, and every
evaluation is cached in the workdir, so an interrupted run continues.
"""

import argparse
import copy
import json
import os
import pathlib
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
# The paper's numbers (T5-L; Figures 1 and 3-5) beside ours.
PAPER = {
    "dro_v": 0.789, "kto": 0.675, "dro_v_vs_kto": 0.634,
    "kto_tau_0.1": 0.635, "kto_tau_1": 0.619, "kto_tau_5": 0.675,
    "dro_v_tau_0.1": 0.705, "dro_v_tau_5": 0.766,
    "dro_v_lr_x0.1": 0.737, "dro_v_lr_x0.5": 0.787, "dro_v_lr_x5": 0.784,
    "dro_v_vlr_x0.1": 0.768, "dro_v_vlr_x0.5": 0.780, "dro_v_vlr_x5": 0.791,
    # Figure 5 (10,000 steps).
    "dro_v_double_net": 0.766, "dro_v_single_value": 0.721,
    "dro_v_single_net_single_value": 0.576, "dro_v_single_net": 0.555,
    "dro_v_vs_single_value": 0.549,
}
MULTIPLIERS = (0.1, 0.5, 5)
TAUS = (0.1, 1, 5)
GRADED_TASK = "synthetic_summarize_graded"
# What --task=synthetic_summarize_graded runs: Figure 5.
SHARING_VARIANTS = ("dro_v", "dro_v_single_value", "dro_v_single_net",
                    "dro_v_single_net_single_value")


def variants(learning_rate: float):
  """name -> (algorithm, config overrides on top of the DRO-V defaults)."""
  out = {"dro_v": ("dro_v", {})}
  for tau in TAUS:
    out[f"kto_tau_{tau:g}"] = ("kto", {"kto.beta": float(tau)})
    if tau != 1:
      out[f"dro_v_tau_{tau:g}"] = ("dro_v", {"dro.tau": float(tau)})
  for m in MULTIPLIERS:
    out[f"dro_v_lr_x{m:g}"] = ("dro_v", {
        "optimizer.learning_rate": learning_rate * m,
        "dro.value_learning_rate": learning_rate * m})
    out[f"dro_v_vlr_x{m:g}"] = ("dro_v", {
        "dro.value_learning_rate": learning_rate * m})
  out["dro_v_single_value"] = ("dro_v", {"dro.single_value_per_batch": True})
  out["dro_v_single_net"] = ("dro_v", {"dro.value_source": "policy_logits"})
  out["dro_v_single_net_single_value"] = ("dro_v", {
      "dro.value_source": "policy_logits",
      "dro.single_value_per_batch": True})
  return out


def run_config(config, algorithm, overrides, sft_dir, seed, data_settings,
               select_every, select_prompts):
  """One variant's run config; `data_settings` are the config.data fields
  of the trajectories it trains on (`offline_pipeline.data_task_settings`).
  Every `select_every` steps the policy is judged against SFT on
  `select_prompts` validation prompts, and the best is kept in <run>/best."""
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  p = config.pipeline
  rate = p.policy_learning_rate
  return offline_pipeline.stage_config(config, algorithm, **{
      **data_settings,
      "seed": seed,
      "train.num_steps": p.policy_steps,
      "init.policy_checkpoint": sft_dir,
      "optimizer.learning_rate": rate,
      "optimizer.warmup_steps": min(config.optimizer.warmup_steps,
                                    p.policy_steps // 4),
      # The paper's default: one learning rate for policy and value.
      "dro.value_learning_rate": rate,
      # Completions whose EOS falls on the last slot are whole completions.
      "data.files.max_completion_tokens": config.data.targets_length,
      # Checkpoint selection on the prompt task's validation split, judged
      # by its gold reward (the paper: every 2,000 steps, against SFT); this
      # script reports the chosen checkpoint on the test split itself.
      "eval.task": config.data.task,
      "eval.split": "validation",
      "eval.every_steps": select_every,
      "eval.num_examples": select_prompts,
      "eval.num_samples": 1,
      "eval.temperature": 1.0,
      "eval.batch_size": 256,
      "eval.judge": "gold_reward",
      "checkpoint.best_metric": "eval/win_rate",
      "checkpoint.every_steps": 0,
      **overrides,
  })


RM_TASK = "dro_paper_reward_model_trajectories"
# What --labels=reward_model runs: the comparisons of Figures 1-2 and 4.
REWARD_MODEL_VARIANTS = ("dro_v", "dro_v_tau_0.1", "dro_v_tau_5",
                         "kto_tau_0.1", "kto_tau_1", "kto_tau_5")


def relabel_with_reward_model(config, workdir: str):
  """The trajectory files again, each reward replaced by the pipeline reward
  model's score of the completion; registered as RM_TASK (normalised like
  the gold-labelled task). Returns the config.data fields of that task;
  the files are written once."""
  import jax  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import alignment_data  # pylint: disable=g-import-not-at-top
  from jaxrlhf.eval import evaluation  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import heads  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import pretrained  # pylint: disable=g-import-not-at-top
  gold_paths = offline_pipeline.data_paths(workdir)["trajectory"]
  paths = {split: path.replace(".jsonl", "_reward_model.jsonl")
           for split, path in gold_paths.items()}
  if not all(os.path.exists(p) for p in paths.values()):
    c = offline_pipeline.stage_config(
        config, "reward_model",
        **offline_pipeline.data_task_settings(config, workdir, "pairs"), **{
        "init.policy_checkpoint": os.path.join(workdir, "sft"),
        "eval.batch_size": 250})
    li, lt = c.data.inputs_length, c.data.targets_length
    with sharding.activate(c) as mesh:
      trainer = algorithms.build(c, mesh)
      params = pretrained.load_network_params(
          os.path.join(workdir, "reward_model"),
          trainer.init_state().params["reward"], "reward")
      score = jax.jit(lambda p, b: heads.sequence_rewards(
          trainer.lm, p, b, "completion"))
      eos = trainer.vocabulary.eos_id
      ids = lambda text, n: np.asarray(
          trainer.vocabulary.encode(text)[:n - 1] + [eos], np.int32)
      for split, gold_path in gold_paths.items():
        with open(gold_path) as f:
          rows = [json.loads(line) for line in f]
        ds = tf.data.Dataset.from_generator(
            lambda: ({"prompt": ids(r["prompt"], li),
                      "completion": ids(r["completion"], lt),
                      "reward": np.float32(0)} for r in rows),
            output_signature={
                "prompt": tf.TensorSpec([None], tf.int32),
                "completion": tf.TensorSpec([None], tf.int32),
                "reward": tf.TensorSpec([], tf.float32)})
        converted = list(alignment_data.feature_converter_for(
            "trajectory", "encoder_decoder")(
                ds, {"prompt": li, "completion": lt}).as_numpy_iterator())
        features = {k: np.stack([x[k] for x in converted])
                    for k in converted[0] if k != "reward"}
        scores = np.concatenate([
            evaluation.local_rows(score(params, b))
            for b in evaluation.global_batches(features, 250, mesh,
                                               trainer.rules)])[:len(rows)]
        tmp = paths[split] + ".tmp"
        with open(tmp, "w") as f:
          for r, reward in zip(rows, scores):
            f.write(json.dumps(dict(r, reward=float(reward))) + "\n")
        os.replace(tmp, paths[split])
        print(f"relabelled {len(rows)} {split} trajectories with the reward "
              f"model (score mean {scores.mean():.3f}, std "
              f"{scores.std():.3f})", flush=True)
  return dict(offline_pipeline.data_task_settings(config, workdir,
                                                  "trajectory"),
              **{"data.task": RM_TASK, "data.files.train": paths["train"],
                 "data.files.validation": paths["validation"]})


class Judge:
  """Samples policies on the test prompts and caches per-prompt outcomes."""

  def __init__(self, config, sft_dir, workdir, num_prompts):
    import seqio  # pylint: disable=g-import-not-at-top
    from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
    from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
    from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
    from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
    from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
    c = offline_pipeline.stage_config(config, "sft", **{
        "init.policy_checkpoint": sft_dir, "eval.batch_size": 250})
    self._context = lambda: sharding.activate(c)
    with self._context() as mesh:
      self.trainer = algorithms.build(c, mesh)
      self.sft_params = self.trainer.init_state().params["policy"]
    features, texts = pipeline.eval_examples(
        c.data.task, "test", self.trainer.feature_lengths,
        seqio.EncDecFeatureConverter(pack=False), num_prompts)
    if len(texts) < num_prompts:
      raise ValueError(f"The test split has {len(texts)} prompts; "
                       f"--eval_prompts asked for {num_prompts}.")
    self.tokens = features["encoder_input_tokens"]
    self.prompts = [t["inputs"] for t in texts]
    self.gold = tasks.gold_reward_for(c.data.task)
    self.cache = os.path.join(workdir, "judged")
    os.makedirs(self.cache, exist_ok=True)

  def _path(self, name: str, seed: int) -> str:
    return os.path.join(self.cache, f"{name}_seed{seed}.npz")

  def has(self, name: str, seed: int) -> bool:
    return os.path.exists(self._path(name, seed))

  def outcomes(self, name: str, run_dir, seed: int):
    """{gold, kl, length, eos} per test prompt for one policy sample."""
    from jaxrlhf.eval import evaluation  # pylint: disable=g-import-not-at-top
    from jaxrlhf.models import pretrained  # pylint: disable=g-import-not-at-top
    path = self._path(name, seed)
    if os.path.exists(path):
      with np.load(path) as f:
        return dict(f)
    with self._context():
      params = (self.sft_params if run_dir is None else
                pretrained.load_lm_params(run_dir, self.sft_params))
      s = evaluation.sample(self.trainer, params, self.tokens, greedy=False,
                            temperature=1.0, seed=7919 * seed + 1)
      texts = evaluation.completion_texts(self.trainer.vocabulary, s)
      out = {
          "gold": evaluation.gold_rewards(self.gold, self.prompts, texts,
                                          s.has_eos),
          # k1 on the policy's own samples: unbiased for KL(pi || SFT).
          "kl": np.sum(s.logprobs, -1) - evaluation.sequence_logprobs(
              self.trainer, self.sft_params, self.tokens, s),
          "length": np.sum(s.mask, -1).astype(np.float64),
          "eos": np.asarray(s.has_eos, np.float64),
      }
    tmp = path + ".tmp.npz"
    np.savez(tmp, **out)
    os.replace(tmp, path)
    return out


def normalised_rewards_by_prompt(trajectory_file: str):
  """Each prompt's rewards in a trajectory file, normalised to mean 0 and
  variance 1 over the file, as the training task normalises them."""
  by_prompt = {}
  with open(trajectory_file) as f:
    for line in f:
      row = json.loads(line)
      by_prompt.setdefault(row["prompt"], []).append(row["reward"])
  flat = np.concatenate([np.asarray(v, np.float64)
                         for v in by_prompt.values()])
  mean, std = flat.mean(), flat.std()
  return [(np.asarray(v, np.float64) - mean) / std
          for v in by_prompt.values()]


def optimum_kl(trajectory_file: str, tau: float) -> float:
  """KL(pi* || SFT) of DRO-V's regularised optimum pi* ∝ pi_SFT exp(r/tau)
  (the paper's equation 2) on the training data, averaged over prompts.

  Each prompt's SFT samples stand for pi_SFT, so pi* weights them by
  softmax(r/tau) and KL = sum_i w_i log(n w_i).
  """
  kls = []
  for values in normalised_rewards_by_prompt(trajectory_file):
    z = values / tau
    w = np.exp(z - z.max())
    w /= w.sum()
    kls.append(float(np.sum(w * np.log(np.maximum(w * len(w), 1e-300)))))
  return float(np.mean(kls))


def win_rate(a, b):
  """Side-by-side win rate of a over b per prompt (ties 1/2) and its
  binomial standard error."""
  won = (a > b) + 0.5 * (a == b)
  return float(np.mean(won)), float(np.std(won) / np.sqrt(len(won)))


def over_seeds(values):
  v = np.asarray(values, np.float64)
  se = float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
  return float(np.mean(v)), se


def chosen_checkpoint(run_dir: str) -> dict:
  """The checkpoint a run chose ({step, validation win rate}, from
  <run>/best/best.json) and its DRO-V value loss over the last 50 steps."""
  with open(os.path.join(run_dir, "best", "best.json")) as f:
    best = json.load(f)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    losses = [r["value_loss"] for r in map(json.loads, f)
              if "value_loss" in r]
  return {"step": best["step"], "validation_win_rate": best["value"],
          "final_value_loss": float(np.mean(losses[-50:])) if losses
                              else None}


def reward_variance(trajectory_file: str) -> dict:
  """How the training rewards (normalised over the file, as training sees
  them) vary: the mean variance among one prompt's samples, and the share
  of the whole variance that lies between prompts' means (what a value per
  prompt can explain and one value per batch cannot)."""
  groups = normalised_rewards_by_prompt(trajectory_file)
  counts = np.array([len(g) for g in groups], np.float64)
  means = np.array([g.mean() for g in groups])
  return {
      "within_prompt_mean_variance": float(np.mean([g.var() for g in groups
                                                    if len(g) > 1])),
      "between_prompt_share": float(np.sum(counts * means ** 2)
                                    / np.sum(counts)),
  }


def reward_model_agreement(gold_file: str, learned_file: str,
                           reward_model_dir: str) -> dict:
  """How well the reward model's scores (the learned labels) follow the gold
  reward on the training trajectories: their correlation, and the share of
  a prompt's sample pairs with different gold rewards that the scores order
  the same way; and its held-out pair accuracy (its run's last
  evaluation)."""
  read = lambda path: [json.loads(line) for line in open(path)]
  gold, learned = read(gold_file), read(learned_file)
  by_prompt = {}
  for g, l in zip(gold, learned):
    assert g["prompt"] == l["prompt"] and g["completion"] == l["completion"]
    by_prompt.setdefault(g["prompt"], []).append((g["reward"], l["reward"]))
  agree = total = 0
  for pairs in by_prompt.values():
    for i, (gi, li) in enumerate(pairs):
      for gj, lj in pairs[i + 1:]:
        if gi != gj:
          total += 1
          agree += (gi - gj) * (li - lj) > 0
  with open(os.path.join(reward_model_dir, "metrics.jsonl")) as f:
    accuracy = [r["eval/accuracy"] for r in map(json.loads, f)
                if "eval/accuracy" in r]
  return {
      "correlation_with_gold": float(np.corrcoef(
          [g["reward"] for g in gold], [l["reward"] for l in learned])[0, 1]),
      "same_order_as_gold_within_prompt": agree / total,
      "heldout_pair_accuracy": accuracy[-1],
  }


def summarise(judged, chosen, seeds, sft_by_seed):
  """Every variant against SFT, and the paper's head-to-head comparisons.
  The best tau of each method is the one whose chosen checkpoints won most
  on the validation prompts (mean over seeds)."""
  rows = {}

  def add(row_name, first, second_by_seed):
    wins, ses = zip(*(win_rate(judged[first][s]["gold"], second_by_seed(s))
                      for s in seeds))
    mean, se = over_seeds(wins)
    value_losses = [chosen[first][s]["final_value_loss"] for s in seeds]
    rows[row_name] = {
        "win_rate": mean, "win_rate_se_over_seeds": se,
        "win_rate_se_per_run": float(np.mean(ses)),
        "per_seed": list(wins),
        "validation_win_rate": float(np.mean(
            [chosen[first][s]["validation_win_rate"] for s in seeds])),
        "chosen_steps": [chosen[first][s]["step"] for s in seeds],
        "final_value_loss": (float(np.mean(value_losses))
                             if None not in value_losses else None),
        "gold_reward": float(np.mean([judged[first][s]["gold"].mean()
                                      for s in seeds])),
        "kl_to_sft": float(np.mean([judged[first][s]["kl"].mean()
                                    for s in seeds])),
        "length": float(np.mean([judged[first][s]["length"].mean()
                                 for s in seeds])),
        "paper": PAPER.get(row_name),
    }

  sft = lambda s: sft_by_seed[s]["gold"]
  for name in judged:
    add(name, name, sft)
  by_validation = lambda n: rows[n]["validation_win_rate"]
  kto_variants = [n for n in judged if n.startswith("kto_")]
  if kto_variants:
    kto_best = max(kto_variants, key=by_validation)
    dro_v_best = max((n for n in judged
                      if n == "dro_v" or n.startswith("dro_v_tau_")),
                     key=by_validation)
    add("dro_v_vs_kto", "dro_v", lambda s: judged[kto_best][s]["gold"])
    add("best_dro_v_vs_best_kto", dro_v_best,
        lambda s: judged[kto_best][s]["gold"])
    rows["kto"] = dict(rows[kto_best], paper=PAPER["kto"], variant=kto_best)
    rows["best_dro_v_vs_best_kto"]["variant"] = dro_v_best
  if "dro_v_single_value" in judged:
    add("dro_v_vs_single_value", "dro_v",
        lambda s: judged["dro_v_single_value"][s]["gold"])
    rows["dro_v_double_net"] = dict(rows["dro_v"],
                                    paper=PAPER["dro_v_double_net"])
  rows["sft"] = {
      "gold_reward": float(np.mean([sft_by_seed[s]["gold"].mean()
                                    for s in seeds])),
      "length": float(np.mean([sft_by_seed[s]["length"].mean()
                               for s in seeds])),
      "kl_to_sft": 0.0}
  return rows


def tau_of(variant: str) -> str:
  """"1" for dro_v (the default), else the variant name's tau suffix."""
  return "1" if variant == "dro_v" else variant.split("_")[-1]


# (title, rows, labels); {kto_tau} and {dro_tau} are the best taus.
SECTIONS = (
    ("Figures 1-2: DRO-V (tau 1), KTO (its best tau) and SFT",
     ("dro_v", "kto", "dro_v_vs_kto", "best_dro_v_vs_best_kto"),
     ("DRO-V vs SFT", "KTO (tau {kto_tau}) vs SFT",
      "DRO-V vs KTO (tau {kto_tau})",
      "DRO-V (tau {dro_tau}) vs KTO (tau {kto_tau})")),
    ("Figure 4: tau",
     ("dro_v_tau_0.1", "dro_v", "dro_v_tau_5", "kto_tau_0.1", "kto_tau_1",
      "kto_tau_5"),
     ("DRO-V tau 0.1 vs SFT", "DRO-V tau 1 vs SFT", "DRO-V tau 5 vs SFT",
      "KTO tau 0.1 vs SFT", "KTO tau 1 vs SFT", "KTO tau 5 vs SFT")),
    ("Figure 3: learning rates (L = policy and value rate of dro_v)",
     ("dro_v_lr_x0.1", "dro_v_lr_x0.5", "dro_v", "dro_v_lr_x5",
      "dro_v_vlr_x0.1", "dro_v_vlr_x0.5", "dro_v_vlr_x5"),
     ("joint 0.1 L vs SFT", "joint 0.5 L vs SFT", "joint L vs SFT",
      "joint 5 L vs SFT", "value only 0.1 L vs SFT",
      "value only 0.5 L vs SFT", "value only 5 L vs SFT")),
    ("Figure 5: parameter sharing",
     ("dro_v_single_value", "dro_v_single_net_single_value",
      "dro_v_single_net", "dro_v_double_net", "dro_v_vs_single_value"),
     ("double net, single value vs SFT", "single net, single value vs SFT",
      "single net, multiple values vs SFT",
      "double net, multiple values vs SFT",
      "double/multiple vs double/single")),
)


def format_markdown(rows, seeds, args):
  taus = ({"kto_tau": tau_of(rows["kto"]["variant"]),
           "dro_tau": tau_of(rows["best_dro_v_vs_best_kto"]["variant"])}
          if "kto" in rows else {})
  lines = []
  for title, names, labels in SECTIONS:
    if not all(n in rows for n in names):
      continue  # a section whose variants did not run
    lines += [f"### {title}", "",
              "| comparison | win rate (first over second) | s.e. per run | "
              "paper (T5-L) | validation win rate vs SFT | chosen steps | "
              "gold reward | KL(pi‖SFT) | length | value loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in zip(names, labels):
      r = rows[name]
      paper = f"{r['paper']:.1%}" if r.get("paper") else "-"
      value_loss = (f"{r['final_value_loss']:.3f}"
                    if r.get("final_value_loss") is not None else "-")
      lines.append(
          f"| {label.format(**taus)} | {r['win_rate']:.1%} ± "
          f"{r['win_rate_se_over_seeds']:.1%} | "
          f"{r['win_rate_se_per_run']:.1%} | {paper} | "
          f"{r['validation_win_rate']:.1%} | "
          f"{', '.join(map(str, r['chosen_steps']))} | "
          f"{r['gold_reward']:.3f} | {r['kl_to_sft']:.2f} | "
          f"{r['length']:.2f} | {value_loss} |")
    lines.append("")
  lines.append(
      f"SFT: gold reward {rows['sft']['gold_reward']:.3f}, length "
      f"{rows['sft']['length']:.2f}. Win rates: one sample per prompt on "
      f"{args.eval_prompts} test prompts, mean over seeds {list(seeds)} ± the "
      "standard error over seeds; 's.e. per run' is the binomial standard "
      "error over prompts of one run. Each run is represented by the "
      f"checkpoint (every {args.select_every} steps) that won most against "
      f"SFT on {args.select_prompts} validation prompts ('validation win "
      "rate', 'chosen steps' per seed); the best tau of each method is "
      "picked by that validation win rate. Gold reward, KL (k1, nats per "
      "response) and length (tokens, EOS included) are those of the first "
      "policy of the row, on its own test samples; 'value loss' is DRO-V's "
      "value loss over the last 50 training steps.")
  if "reward_model" in rows:
    rm = rows["reward_model"]
    lines += ["", f"The reward model (the training labels): held-out pair "
              f"accuracy {rm['heldout_pair_accuracy']:.1%}; on the training "
              f"trajectories it orders "
              f"{rm['same_order_as_gold_within_prompt']:.1%} of a prompt's "
              "differently-rewarded sample pairs as the gold reward does "
              f"(correlation {rm['correlation_with_gold']:.2f})."]
  variance = rows["reward_variance"]
  lines += ["", f"Training rewards (normalised): a prompt's samples vary by "
            f"{variance['within_prompt_mean_variance']:.3f} on average; "
            f"{variance['between_prompt_share']:.1%} of the variance lies "
            "between prompts' means."]
  kl = rows["optimum_kl"]
  if all(("dro_v" if t == 1 else f"dro_v_tau_{t:g}") in rows for t in TAUS):
    lines += ["", "KL(pi* || SFT) of DRO-V's regularised optimum on the "
              "training data (each prompt's SFT samples weighted by "
              "softmax(r / tau)) against the DRO-V policies' measured KL:",
              "", "| tau | optimum | DRO-V |", "|---|---|---|"]
    for tau in TAUS:
      name = "dro_v" if tau == 1 else f"dro_v_tau_{tau:g}"
      lines.append(f"| {tau:g} | {kl[f'{tau:g}']:.3f} | "
                   f"{rows[name]['kl_to_sft']:.3f} |")
  return "\n".join(lines) + "\n"


# (title, variants, bar labels) of each panel of the plot.
PANELS = (
    ("Figures 1-2", ("dro_v", "kto", "dro_v_vs_kto", "best_dro_v_vs_best_kto"),
     ("DRO-V vs SFT", "KTO vs SFT", "DRO-V vs KTO", "best DRO-V vs KTO")),
    ("Figure 4: tau (win rate vs SFT)",
     ("dro_v_tau_0.1", "dro_v", "dro_v_tau_5", "kto_tau_0.1", "kto_tau_1",
      "kto_tau_5"),
     ("DRO-V 0.1", "DRO-V 1", "DRO-V 5", "KTO 0.1", "KTO 1", "KTO 5")),
    ("Figure 3: learning rate (win rate vs SFT)",
     ("dro_v_lr_x0.1", "dro_v_lr_x0.5", "dro_v", "dro_v_lr_x5",
      "dro_v_vlr_x0.1", "dro_v_vlr_x0.5", "dro_v_vlr_x5"),
     ("joint 0.1L", "joint 0.5L", "joint L", "joint 5L", "V 0.1L", "V 0.5L",
      "V 5L")),
    ("Figure 5: networks/values (vs SFT)",
     ("dro_v_single_value", "dro_v_single_net_single_value",
      "dro_v_single_net", "dro_v_double_net"),
     ("double/single", "single/single", "single/multiple",
      "double/multiple")),
)


def plot(rows, out):
  """dro_paper.png: a panel per figure whose variants ran, the miniature's
  win rates (± s.e. over seeds) beside the paper's."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  panels = [p for p in PANELS if all(n in rows for n in p[1])]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.4),
                           squeeze=False)
  for ax, (title, names, labels) in zip(axes[0], panels):
    ours = [rows[n]["win_rate"] for n in names]
    err = [rows[n]["win_rate_se_over_seeds"] for n in names]
    paper = [rows[n].get("paper") or np.nan for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, ours, 0.4, yerr=err, capsize=3, label="miniature")
    ax.bar(x + 0.2, paper, 0.4, label="paper (T5-L)", alpha=0.6)
    ax.axhline(0.5, color="gray", ls="--", lw=1)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(min([0.3] + [v - 0.05 for v in ours]), 0.9)
    ax.set_title(title, fontsize=10)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "dro_paper.png"), dpi=110)
  plt.close(fig)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", default=str(REPO / "experiments" / "results"
                                      / "dro_paper"))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=300,
                 help="training steps of every variant")
  p.add_argument("--eval_prompts", type=int, default=1000,
                 help="test prompts each chosen checkpoint is judged on")
  p.add_argument("--select_every", type=int, default=100,
                 help="steps between the checkpoints a run chooses from")
  p.add_argument("--select_prompts", type=int, default=512,
                 help="validation prompts the choice is made on")
  p.add_argument("--only", default="",
                 help="comma-separated variants (no table or plot)")
  p.add_argument("--labels", default="gold",
                 choices=("gold", "reward_model"),
                 help="train on the gold reward (the judge itself), or on "
                      "the pipeline reward model's scores of the same "
                      "trajectories (on the plain task, Figures 1-2 and 4's "
                      "variants only)")
  p.add_argument("--task", default="synthetic_summarize",
                 choices=("synthetic_summarize", GRADED_TASK),
                 help="the prompts and gold reward; the graded task runs "
                      "Figure 5's variants only")
  args = p.parse_args()

  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top

  started = time.time()
  seeds = [int(s) for s in args.seeds.split(",")]
  config = defaults.load_config_file(REPO / "configs" / "quickstart.py")
  config.data.task = args.task
  learned = args.labels == "reward_model"
  config.pipeline.stages = "sft,data,reward_model" if learned else "sft,data"
  config.pipeline.policy_steps = args.steps
  offline_pipeline.run(config, args.workdir)
  sft_dir = os.path.join(args.workdir, "sft")
  if learned:
    data_settings = relabel_with_reward_model(config, args.workdir)
  else:
    data_settings = offline_pipeline.data_task_settings(config, args.workdir,
                                                        "trajectory")
  data_file = data_settings["data.files.train"]
  # Runs and their judged samples of each labelling apart.
  prefix = "rm_" if learned else ""
  judge = Judge(config, sft_dir, args.workdir, args.eval_prompts)

  all_variants = variants(config.pipeline.policy_learning_rate)
  if args.task == GRADED_TASK:
    all_variants = {n: all_variants[n] for n in SHARING_VARIANTS}
  elif learned:
    all_variants = {n: all_variants[n] for n in REWARD_MODEL_VARIANTS}
  selected = [s for s in args.only.split(",") if s]
  unknown = set(selected) - set(all_variants)
  if unknown:
    raise SystemExit(f"--only: unknown variants {sorted(unknown)}; choose "
                     f"from {sorted(all_variants)}.")
  judged, chosen = {}, {}
  for name, (algorithm, overrides) in all_variants.items():
    if selected and name not in selected:
      continue
    judged[name], chosen[name] = {}, {}
    for seed in seeds:
      run_dir = os.path.join(args.workdir, "runs",
                             f"{prefix}{name}_seed{seed}")
      # Judged only once its run has finished.
      if not judge.has(prefix + name, seed):
        print(f"=== {prefix}{name}, seed {seed} "
              f"({(time.time() - started) / 60:.1f} min)", flush=True)
        loop.train(copy.deepcopy(run_config(
            config, algorithm, overrides, sft_dir, seed, data_settings,
            args.select_every, args.select_prompts)), run_dir)
      chosen[name][seed] = chosen_checkpoint(run_dir)
      judged[name][seed] = judge.outcomes(
          prefix + name, os.path.join(run_dir, "best"), seed)
  if selected:
    return
  sft_by_seed = {s: judge.outcomes("sft", None, s) for s in seeds}
  rows = summarise(judged, chosen, seeds, sft_by_seed)
  rows["optimum_kl"] = {f"{tau:g}": optimum_kl(data_file, tau) for tau in TAUS}
  rows["reward_variance"] = reward_variance(data_file)
  if learned:
    rows["reward_model"] = reward_model_agreement(
        offline_pipeline.data_paths(args.workdir)["trajectory"]["train"],
        data_file, os.path.join(args.workdir, "reward_model"))
  rows["setup"] = {
      "task": args.task, "labels": args.labels, "seeds": seeds,
      "steps": args.steps, "select_every": args.select_every,
      "select_prompts": args.select_prompts,
      "eval_prompts": args.eval_prompts,
      "trajectories": sum(1 for _ in open(data_file)),
      "minutes": round((time.time() - started) / 60, 1)}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=2, sort_keys=True)
  markdown = format_markdown(rows, seeds, args)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(markdown)
  print(markdown)
  plot(rows, args.out)
  print(f"Done in {(time.time() - started) / 60:.1f} min; results in "
        f"{args.out}")


if __name__ == "__main__":
  main()
