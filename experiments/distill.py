r"""Teachers and judges, in miniature: distillation of a smaller student
from an RLVR-trained teacher, and a trained judge as GRPO's reward.

  python experiments/distill.py --workdir=/tmp/distill_mini \
      --out=experiments/results/distill

A smaller run (one seed, two methods, fewer steps, no judge part):

  python experiments/distill.py --workdir=/tmp/distill_small \
      --out=/tmp/distill_small/out --seeds=0 --methods=distill,grpo \
      --steps=20 --judge_steps=0

Part A, distillation, on `synthetic_arithmetic` as experiments/rlvr.py sets
it up (its SFT config, its GRPO run and its greedy evaluation are imported
from there):

  1. the teacher: rlvr.py's recipe, the tiny T5 (width 64, 2 + 2 layers)
     SFT'd from scratch for `--teacher_sft_steps` steps, then rlvr.py's
     `grpo` (gold + 0.1 format reward, 16 prompts x 4 responses) for
     `--teacher_steps` steps (seed 0);
  2. the student: a smaller T5 (STUDENT: width 32, 2 encoder + 2 decoder
     layers, 2 heads of 16, MLP 64; with 1 + 1 layers it reached a greedy
     pass@1 of only 0.04 to 0.05 after 300 to 600 SFT steps) SFT'd from
     scratch on the same demonstrations for `--student_sft_steps` steps;
  3. from that student SFT, each method below once per seed, `--steps`
     steps; every step trains on 64 responses (16 prompts x 4 samples at
     temperature 1, at most 16 tokens; sft_teacher: 64 examples):
       sft_teacher   SFT on the teacher's greedy completions of the first
                     `--teacher_sample_prompts` training prompts (a JSONL
                     file task; sequence-level KD);
       gkd_b0/05/1   GKD, the generalised JSD at gkd.beta 0 / 0.5 / 1 on
                     the student's samples in a share gkd.lmbda 0.5 of
                     steps, else on the dataset's demonstrations;
       distill       on-policy distillation, the teacher's per-token
                     reverse KL as the advantage (distill.mode 'advantage');
       grpo          rlvr.py's grpo: gold + 0.1 format reward, no teacher;
       grpo_distill  the same plus distill.teacher_checkpoint (the
                     teacher's per-token term added to GRPO's advantages);
  4. each student is judged by rlvr.py's greedy evaluation (pass@1 on the
     first `--eval_prompts` test sums) and by its KL to the teacher on
     held-out prompts: one step of `distill` from the student on the first
     `--kl_prompts` test sums (data.train_split 'test'; the step's
     `distill/reverse_kl` is computed on the rollout before any update:
     the per-token mean of log pi_student - log pi_teacher of the student's
     own samples at temperature 1, the k1 estimate of the per-token KL).

Part B, the judge, on the quickstart task `synthetic_summarize`
(configs/quickstart.py):

  1. the quickstart pipeline's stages sft, data and reward_model (its SFT
     policy; 4 SFT samples for each of `--judge_data_prompts` training
     prompts labelled by the gold reward; the Bradley-Terry reward model);
  2. a judge: a tiny T5 SFT'd from scratch for `--judge_sft_steps` steps
     on judging examples made from those labelled samples: input
     JUDGE_TEMPLATE with the prompt and the sample, target the first
     choice word ("red", good) when the sample's gold reward is above the
     training samples' median, else the second ("blue"); its accuracy is
     its greedy verdict against the label on the judging examples of the
     held-out (validation) samples (while this was set up: 400 steps from
     scratch scored 0.611 there, no better than always answering "blue",
     0.615; 1,000 steps from the quickstart SFT policy 0.675);
  3. GRPO from the quickstart SFT policy (the quickstart pipeline's grpo
     stage: Dr. GRPO, kl 0.1) for `--judge_steps` steps on (i) the gold
     reward, (ii) the reward model, (iii) the judge (rewards.judge with
     JUDGE_TEMPLATE and JUDGE_CHOICES: p(red) / (p(red) + p(blue))), once
     per seed; each judged by the gold reward of its samples on the
     quickstart's held-out prompts (its final evaluation).

Writes `results.json` (every seed's figures, their mean and standard error)
and `README.md` (generated from results.json alone) into --out. Every run
resumes and its figures are kept in the workdir, as rlvr.py's do.
"""

import argparse
import contextlib
import copy
import io
import json
import os
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import rlvr  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = rlvr.REPO
TASK = rlvr.TASK
# The student: a smaller T5 than the teacher's tiny preset.
STUDENT = {"model.emb_dim": 32, "model.num_heads": 2, "model.head_dim": 16,
           "model.mlp_dim": 64, "model.num_encoder_layers": 2,
           "model.num_decoder_layers": 2}
STUDENT_TEXT = ("t5: width 32, 2 encoder + 2 decoder layers, 2 heads of 16, "
                "MLP 64")
TEACHER_TEXT = ("t5 tiny: width 64, 2 encoder + 2 decoder layers, 4 heads of "
                "16, MLP 128")
TEACHER_SAMPLES_TASK = "distill_teacher_samples"
JUDGE_TASK = "distill_judging_examples"
JUDGE_TEMPLATE = "{prompt} gold {response} moon"
JUDGE_CHOICES = "red,blue"
JUDGE_INPUTS_LENGTH = 40
GRPO_SAMPLES = 4  # part B's GRPO group size (grpo's default)
RESPONSES_PER_STEP = rlvr.PROMPTS_PER_STEP * rlvr.SAMPLES_PER_PROMPT

GKD = {"gkd.lmbda": 0.5}
# name -> (config.algorithm or "sft", overrides, teacher forward passes per
# step (jaxrlhf/algorithms/online/iteration.py scores the rollout with the
# teacher; GKD's loss mode runs it again over the vocabulary), one line for
# the README).
METHODS = {
    "sft_teacher": ("sft", {}, 0,
                    "SFT on the teacher's greedy completions of training "
                    "prompts (made once, before training)"),
    "gkd_b0": ("gkd", dict(GKD, **{"gkd.beta": 0.0}), 2,
               "GKD, beta 0 (forward KL(teacher‖student)), lambda 0.5"),
    "gkd_b05": ("gkd", dict(GKD, **{"gkd.beta": 0.5}), 2,
                "GKD, beta 0.5 (the JSD), lambda 0.5"),
    "gkd_b1": ("gkd", dict(GKD, **{"gkd.beta": 1.0}), 2,
               "GKD, beta 1 (reverse KL(student‖teacher)), lambda 0.5"),
    "distill": ("distill", {"distill.mode": "advantage"}, 1,
                "on-policy distillation: -(log pi_student - log "
                "pi_teacher) per sampled token as the advantage"),
    "grpo": ("grpo", dict(rlvr.CLIPPED_MINIBATCHES), 0,
             "rlvr.py's GRPO on gold + 0.1 format reward"),
    "grpo_distill": ("grpo", dict(rlvr.CLIPPED_MINIBATCHES), 1,
                     "rlvr.py's GRPO plus the teacher's per-token term in "
                     "its advantages (distill.teacher_checkpoint, coef 1)"),
}
JUDGE_REWARDS = {
    "gold": ({"rewards.reward_model.weight": 0.0,
              "rewards.gold_reward.weight": 1.0}, "the gold reward"),
    "reward_model": ({}, "the quickstart's reward model"),
    "judge": ({"rewards.reward_model.weight": 0.0,
               "rewards.judge.weight": 1.0,
               "rewards.judge.template": JUDGE_TEMPLATE,
               "rewards.judge.choices": JUDGE_CHOICES},
              "the judge, p(red) / (p(red) + p(blue))"),
}


def _dump_jsonl(rows, path):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)


def _file_task(task, train, validation, vocabulary=""):
  """The config fields of a JSONL file task of (prompt, completion) rows."""
  return {"data.task": task, "data.files.train": train,
          "data.files.validation": validation,
          "data.files.layout": "columns", "data.files.column_mapping": "",
          "data.files.vocabulary": vocabulary,
          "data.files.on_bad_row": "skip_and_report"}


def _sample(config, policy_dir, prompts, batch=256):
  """Greedy completions (text) of the policy in `policy_dir` for prompt
  texts, through `jaxrlhf.api`."""
  from jaxrlhf import api  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  run = api.Run(offline_pipeline.stage_config(
      config, "sft", **{"init.policy_checkpoint": policy_dir}),
                evaluate=False)
  state = run.init()
  out = []
  for i in range(0, len(prompts), batch):
    out += run.sample(state, prompts[i:i + batch], greedy=True)
  return out


# --- part A: distillation -----------------------------------------------------


def student_config(sft_steps):
  """rlvr.py's SFT config with the student's smaller model."""
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = rlvr.base_config(sft_steps)
  defaults.apply_overrides(config, STUDENT)
  return config


def method_config(config, name, student_dir, teacher_dir, seed, steps,
                  samples_task):
  """The run config of method `name` (METHODS) from the student SFT."""
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  algorithm, overrides, _, _ = METHODS[name]
  if algorithm == "sft":
    return offline_pipeline.stage_config(config, "sft", **{
        "seed": seed,
        "init.policy_checkpoint": student_dir,
        "train.num_steps": steps,
        "train.batch_size": RESPONSES_PER_STEP,
        "train.log_every": max(steps // 5, 1),
        "optimizer.learning_rate": rlvr.ONLINE_LEARNING_RATE,
        "optimizer.warmup_steps": 0,
        "eval.num_examples": 64,
        **samples_task})
  # rlvr.py's online run (its in-run evaluation cut to 64 test sums x 1
  # sample: the figures here are the greedy and KL evaluations).
  c = rlvr.online_config(config, "grpo", student_dir, seed, steps, 64, 1)
  changes = {"algorithm": algorithm,
             "online.num_minibatches": 1, **overrides}
  if name != "grpo":
    changes["distill.teacher_checkpoint"] = teacher_dir
  if algorithm in ("distill", "gkd"):
    # No rewards train them; the gold reward is still logged.
    changes["online.samples_per_prompt"] = rlvr.SAMPLES_PER_PROMPT
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  defaults.apply_overrides(c, changes)
  return c


def kl_probe(config, policy_dir, teacher_dir, kl_prompts, probe_dir):
  """The per-token KL(student‖teacher) on held-out prompts: one step of
  `distill` on the first `kl_prompts` test sums; its metrics row's
  distill/reverse_kl is measured on the rollout before the update."""
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  c = offline_pipeline.stage_config(config, "distill", **{
      "init.policy_checkpoint": policy_dir,
      "distill.teacher_checkpoint": teacher_dir,
      "data.train_split": "test",
      "train.num_steps": 1,
      "train.batch_size": kl_prompts,
      "train.log_every": 1,
      "online.samples_per_prompt": 1,
      "online.temperature": 1.0,
      "online.stop_when_done": True,
      "rewards.reward_model.weight": 0.0,
      "eval.task": TASK,
      "eval.split": "test",
      "eval.num_examples": 8,
      "eval.with_rewards": "off",
  })
  loop.train(c, probe_dir)
  rows = [r for r in rlvr.read_metrics(probe_dir)
          if "distill/reverse_kl" in r]
  return {"kl_to_teacher": rows[0]["distill/reverse_kl"],
          "kl_sample_length": rows[0].get("response_length")}


class _Tee(io.TextIOBase):
  """Writes to a stream and keeps a copy."""

  def __init__(self, stream):
    super().__init__()
    self.stream, self.copy = stream, io.StringIO()

  def write(self, text):
    self.copy.write(text)
    return self.stream.write(text)

  def flush(self):
    self.stream.flush()


def timed_train(config, workdir):
  """loop.train(config, workdir): {"minutes": its wall time,
  "seconds_per_step": the mean of the console's 1 / (steps/s) over its
  progress lines (the first step, which compiles, is not in them)}."""
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  t = time.time()
  tee = _Tee(sys.stdout)
  with contextlib.redirect_stdout(tee):
    loop.train(copy.deepcopy(config), workdir)
  rates = [float(x) for x in re.findall(r"\| ([0-9.]+) steps/s \|",
                                        tee.copy.getvalue())]
  out = {"minutes": (time.time() - t) / 60}
  if rates:
    out["seconds_per_step"] = sum(1 / r for r in rates) / len(rates)
  return out


def train_figures(rows, timing, steps):
  """One run's figures from its metrics.jsonl rows (training rows only)."""
  train = [r for r in rows if "loss" in r and "eval/gold_reward" not in r]
  out = dict(timing)
  last = train[-max(len(train) // 5, 1):]
  for key, name in (("distill/reverse_kl", "train_reverse_kl_last"),
                    ("reward/gold_reward", "train_gold_reward_last"),
                    ("distill/divergence", "train_divergence_last")):
    values = [r[key] for r in last if key in r]
    if values:
      out[name] = sum(values) / len(values)
  out["steps"] = steps
  return out


def part_a(args, seeds, names, elapsed):
  """The teacher, the student SFT and every method of METHODS: the
  "distillation" entry of results.json."""
  from jaxrlhf.data import synthetic_arithmetic  # pylint: disable=g-import-not-at-top
  w = args.workdir
  # 1. The teacher.
  teacher_config = rlvr.base_config(args.teacher_sft_steps)
  teacher_sft = os.path.join(w, f"teacher_sft_{args.teacher_sft_steps}")

  def timed(c, d, label):
    def make():
      print(f"=== {label} ({elapsed():.1f} min)", flush=True)
      return timed_train(c, d)
    os.makedirs(d, exist_ok=True)
    return rlvr.cached(os.path.join(d, "distill_time.json"), make)

  teacher = {"sft_minutes": timed(teacher_config, teacher_sft,
                                  "teacher sft")["minutes"]}
  teacher_dir = os.path.join(
      w, f"teacher_grpo_{args.teacher_sft_steps}_{args.teacher_steps}")
  teacher["grpo_minutes"] = timed(
      rlvr.online_config(teacher_config, "grpo", teacher_sft, 0,
                         args.teacher_steps, 64, 1),
      teacher_dir, "teacher grpo")["minutes"]
  e = args.eval_prompts
  for label, d in (("sft", teacher_sft), ("grpo", teacher_dir)):
    g = rlvr.cached(os.path.join(d, f"distill_greedy_e{e}.json"),
                    lambda d=d: rlvr.greedy_eval(teacher_config, d, e))
    teacher[f"{label}_greedy_pass_at_1"] = g["greedy_pass_at_1"]
  print(f"teacher: greedy pass@1 {teacher['grpo_greedy_pass_at_1']:.3f} "
        f"(its SFT {teacher['sft_greedy_pass_at_1']:.3f}) ({elapsed():.1f} "
        "min)", flush=True)

  # 2. The student SFT.
  config = student_config(args.student_sft_steps)
  student_dir = os.path.join(w, f"student_sft_{args.student_sft_steps}")
  student = {"minutes": timed(config, student_dir, "student sft")["minutes"]}
  student.update(rlvr.cached(
      os.path.join(student_dir, f"distill_greedy_e{e}.json"),
      lambda: rlvr.greedy_eval(config, student_dir, e)))
  student.update(rlvr.cached(
      os.path.join(student_dir, f"distill_kl_{args.kl_prompts}.json"),
      lambda: kl_probe(config, student_dir, teacher_dir, args.kl_prompts,
                       os.path.join(w, "kl_probes",
                                    f"student_sft_{args.student_sft_steps}"))))
  print(f"student sft: greedy pass@1 {student['greedy_pass_at_1']:.3f}, KL "
        f"to the teacher {student['kl_to_teacher']:.3f} ({elapsed():.1f} "
        "min)", flush=True)

  # The teacher's greedy completions of training prompts (sft_teacher).
  samples_task = {}
  if "sft_teacher" in names:
    n = args.teacher_sample_prompts
    samples_dir = os.path.join(w, f"teacher_samples_{n}")
    os.makedirs(samples_dir, exist_ok=True)

    def make_samples():
      t = time.time()
      examples = synthetic_arithmetic.make_examples("train", n + 64)
      prompts = [x["inputs"] for x in examples]
      completions = _sample(teacher_config, teacher_dir, prompts)
      gold = [synthetic_arithmetic.gold_reward(p, c)
              for p, c in zip(prompts, completions)]
      rows = [{"prompt": p, "completion": c}
              for p, c in zip(prompts, completions)]
      _dump_jsonl(rows[:n], os.path.join(samples_dir, "train.jsonl"))
      _dump_jsonl(rows[n:], os.path.join(samples_dir, "validation.jsonl"))
      return {"minutes": (time.time() - t) / 60,
              "gold_reward": sum(gold[:n]) / n}
    made = rlvr.cached(os.path.join(samples_dir, "made.json"), make_samples)
    teacher["samples_minutes"] = made["minutes"]
    teacher["samples_gold_reward"] = made["gold_reward"]
    samples_task = _file_task(
        TEACHER_SAMPLES_TASK, os.path.join(samples_dir, "train.jsonl"),
        os.path.join(samples_dir, "validation.jsonl"),
        synthetic_arithmetic.vocabulary().sentencepiece_model_file)

  # 3. The methods.
  tag = (f"t{args.teacher_sft_steps}_{args.teacher_steps}_"
         f"s{args.student_sft_steps}_{args.steps}")
  by_name = {}
  for name in names:
    for seed in seeds:
      run_dir = os.path.join(w, "runs", f"{name}_{tag}_seed{seed}")
      c = method_config(config, name, student_dir, teacher_dir, seed,
                        args.steps, samples_task)
      timing = timed(c, run_dir, f"{name}, seed {seed}")
      minutes = timing["minutes"]
      figures = train_figures(rlvr.read_metrics(run_dir), timing,
                              args.steps)
      figures.update(rlvr.cached(
          os.path.join(run_dir, f"distill_greedy_e{e}.json"),
          lambda run_dir=run_dir: rlvr.greedy_eval(config, run_dir, e)))
      figures.update(rlvr.cached(
          os.path.join(run_dir, f"distill_kl_{args.kl_prompts}.json"),
          lambda run_dir=run_dir, name=name, seed=seed: kl_probe(
              config, run_dir, teacher_dir, args.kl_prompts,
              os.path.join(w, "kl_probes", f"{name}_{tag}_seed{seed}"))))
      by_name.setdefault(name, {})[seed] = figures
      print(f"{name}, seed {seed}: greedy pass@1 "
            f"{figures['greedy_pass_at_1']:.3f}, KL to the teacher "
            f"{figures['kl_to_teacher']:.3f}, {minutes:.1f} min "
            f"({elapsed():.1f} min in all)", flush=True)
  runs = {}
  for name, by_seed in by_name.items():
    algorithm, overrides, forwards, description = METHODS[name]
    runs[name] = dict(rlvr.mean_and_stderr(by_seed), algorithm=algorithm,
                      overrides=overrides, description=description,
                      teacher_forwards_per_step=forwards,
                      by_seed={str(s): f for s, f in by_seed.items()})
  train_minutes = (teacher["sft_minutes"] + teacher["grpo_minutes"]
                   + teacher.get("samples_minutes", 0) + student["minutes"]
                   + sum(f["minutes"] for r in by_name.values()
                         for f in r.values()))
  return {"teacher": teacher, "student_sft": student, "runs": runs,
          "train_minutes": train_minutes,
          "shared_overrides": {
              k: v for k, v in rlvr.flatten_overrides(method_config(
                  config, "grpo", "<sft>", "<teacher>", 0, args.steps, {}),
                                                      config).items()
              if k not in ("seed", "algorithm", "init.policy_checkpoint",
                           "online.num_minibatches")}}


# --- part B: the judge --------------------------------------------------------


def quickstart_config(args):
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.load_config_file(REPO / "configs" / "quickstart.py")
  defaults.apply_overrides(config, {
      "pipeline.num_prompts": args.judge_data_prompts,
      "checkpoint.every_steps": 0})
  return config


def judging_rows(path, threshold=None):
  """Judging examples from a labelled trajectory file: (rows, rewards)."""
  with open(path) as f:
    data = [json.loads(line) for line in f]
  rewards = [d["reward"] for d in data]
  if threshold is None:
    threshold = statistics.median(rewards)
  good, bad = JUDGE_CHOICES.split(",")
  rows = [{"prompt": JUDGE_TEMPLATE.format(prompt=d["prompt"],
                                           response=d["completion"]),
           "completion": good if d["reward"] > threshold else bad}
          for d in data]
  return rows, threshold


def part_b(args, seeds, elapsed):
  """The quickstart's stages, the judge and GRPO on each reward of
  JUDGE_REWARDS: the "judge" entry of results.json."""
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  w = os.path.join(args.workdir, f"quickstart_{args.judge_data_prompts}")
  config = quickstart_config(args)
  stages = copy.deepcopy(config)
  defaults.apply_overrides(stages, {"pipeline.stages": "sft,data,reward_model"})

  def pipeline():
    print(f"=== quickstart sft, data, reward_model ({elapsed():.1f} min)",
          flush=True)
    t = time.time()
    out = offline_pipeline.run(stages, w)
    return {"minutes": (time.time() - t) / 60,
            "sft_gold_reward": out["sft"]["eval/gold_reward"],
            "reward_model_accuracy": out["reward_model"].get(
                "eval/accuracy")}
  os.makedirs(w, exist_ok=True)
  quick = rlvr.cached(os.path.join(w, "distill_pipeline.json"), pipeline)
  sft_dir, rm_dir = os.path.join(w, "sft"), os.path.join(w, "reward_model")
  paths = offline_pipeline.data_paths(w)["trajectory"]

  # The judge.
  judge_dir = os.path.join(w, f"judge_{args.judge_sft_steps}")
  os.makedirs(judge_dir, exist_ok=True)
  train_rows, threshold = judging_rows(paths["train"])
  held_rows, _ = judging_rows(paths["validation"], threshold)
  _dump_jsonl(train_rows, os.path.join(judge_dir, "train.jsonl"))
  _dump_jsonl(held_rows, os.path.join(judge_dir, "validation.jsonl"))
  judge_config = offline_pipeline.stage_config(config, "sft", **{
      "train.num_steps": args.judge_sft_steps,
      "train.log_every": 250,
      "data.inputs_length": JUDGE_INPUTS_LENGTH,
      "data.targets_length": 2,
      "eval.num_examples": 64,
      **_file_task(JUDGE_TASK, os.path.join(judge_dir, "train.jsonl"),
                   os.path.join(judge_dir, "validation.jsonl"))})

  def train_judge():
    print(f"=== judge sft ({elapsed():.1f} min)", flush=True)
    t = time.time()
    loop.train(copy.deepcopy(judge_config), judge_dir)
    verdicts = _sample(judge_config, judge_dir,
                       [r["prompt"] for r in held_rows])
    right = [v.strip() == r["completion"] for v, r in zip(verdicts, held_rows)]
    good = JUDGE_CHOICES.split(",")[0]
    return {"minutes": (time.time() - t) / 60,
            "heldout_accuracy": sum(right) / len(right),
            "heldout_examples": len(right),
            "heldout_good_share": sum(r["completion"] == good
                                      for r in held_rows) / len(held_rows),
            "train_examples": len(train_rows),
            "train_good_share": sum(r["completion"] == good
                                    for r in train_rows) / len(train_rows),
            "threshold": threshold}
  judge = rlvr.cached(os.path.join(judge_dir, "distill_judge.json"),
                      train_judge)
  print(f"judge: held-out accuracy {judge['heldout_accuracy']:.3f} "
        f"({elapsed():.1f} min)", flush=True)

  by_name = {}
  for name, (overrides, _) in JUDGE_REWARDS.items():
    for seed in seeds:
      judge_tag = f"_j{args.judge_sft_steps}" if name == "judge" else ""
      run_dir = os.path.join(w, "runs", f"grpo_{name}_{args.judge_steps}"
                             f"{judge_tag}_seed{seed}")
      c = offline_pipeline.online_stage_config(config, "grpo", sft_dir,
                                               rm_dir)
      defaults.apply_overrides(c, {
          "seed": seed, "train.num_steps": args.judge_steps,
          "train.log_every": max(args.judge_steps // 5, 1),
          "optimizer.warmup_steps": 0,
          "online.samples_per_prompt": GRPO_SAMPLES,
          **overrides,
          **({"rewards.judge.checkpoint": judge_dir}
             if name == "judge" else {})})

      def make(c=c, run_dir=run_dir, name=name, seed=seed):
        print(f"=== grpo on {name}, seed {seed} ({elapsed():.1f} min)",
              flush=True)
        t = time.time()
        loop.train(copy.deepcopy(c), run_dir)
        return {"minutes": (time.time() - t) / 60}
      os.makedirs(run_dir, exist_ok=True)
      minutes = rlvr.cached(os.path.join(run_dir, "distill_time.json"),
                            make)["minutes"]
      rows = rlvr.read_metrics(run_dir)
      evals = [r for r in rows if "eval/gold_reward" in r]
      train = [r for r in rows if "reward/gold_reward" in r
               or "score" in r]
      figures = {"heldout_gold_reward": evals[-1]["eval/gold_reward"],
                 "sft_heldout_gold_reward": evals[0]["eval/gold_reward"],
                 "win_rate_vs_sft": evals[-1]["eval/win_rate"],
                 "kl_to_sft": evals[-1]["eval/kl"],
                 "minutes": minutes}
      last = train[-max(len(train) // 5, 1):]
      for key in ("reward/judge", "reward/reward_model",
                  "reward/gold_reward"):
        values = [r[key] for r in last if key in r]
        if values:
          figures["train_" + key.split("/")[1] + "_last"] = (
              sum(values) / len(values))
      by_name.setdefault(name, {})[seed] = figures
      print(f"grpo on {name}, seed {seed}: held-out gold reward "
            f"{figures['heldout_gold_reward']:.3f} (SFT "
            f"{figures['sft_heldout_gold_reward']:.3f}), {minutes:.1f} min "
            f"({elapsed():.1f} min in all)", flush=True)
  runs = {name: dict(rlvr.mean_and_stderr(by_seed),
                     description=JUDGE_REWARDS[name][1],
                     overrides=JUDGE_REWARDS[name][0],
                     by_seed={str(s): f for s, f in by_seed.items()})
          for name, by_seed in by_name.items()}
  train_minutes = (quick["minutes"] + judge["minutes"]
                   + sum(f["minutes"] for r in by_name.values()
                         for f in r.values()))
  return {"pipeline": quick, "judge": judge, "runs": runs,
          "train_minutes": train_minutes,
          "eval_prompts": config.eval.num_examples,
          "eval_samples": config.pipeline.eval_samples_per_prompt,
          "steps": args.judge_steps,
          "prompts_per_step": config.train.batch_size,
          "grpo_settings": offline_pipeline.ONLINE_STAGE_SETTINGS["grpo"],
          "judge_sft_steps": args.judge_sft_steps,
          "judge_data_prompts": args.judge_data_prompts,
          "samples_per_prompt": GRPO_SAMPLES,
          "judge_data_samples_per_prompt": config.pipeline.samples_per_prompt,
          "judge_template": JUDGE_TEMPLATE, "judge_choices": JUDGE_CHOICES}


# --- the README, from results.json alone --------------------------------------


def format_readme(results) -> str:
  cell = rlvr._cell  # pylint: disable=protected-access
  s = results["setup"]
  a = results.get("distillation")
  b = results.get("judge")
  seeds = ", ".join(str(x) for x in s["seeds"])
  lines = [
      "# Teachers and judges, in miniature",
      "",
      "Generated by `experiments/distill.py` from `results.json` in this "
      "folder; every figure below is read from it. Made with:",
      "",
      "```",
      s["command"],
      "```",
      "",
      "The training runs' wall times add up to "
      + " and ".join(f"{part['train_minutes']:.0f} minutes ({label})"
                     for part, label in ((a, "distillation"), (b, "judge"))
                     if part)
      + " (the held-out greedy and KL evaluations not included); this "
      f"invocation took {s['minutes']:.0f} minutes, reading the runs it "
      f"found in its workdir ({s['machine']}). Mean ± "
      f"standard error over the seeds ({seeds}; `results.json` has each "
      "seed's figures). Steps, evaluation prompts and sample counts are "
      "cut to fit that budget; each is stated below.",
      "",
  ]
  if a:
    t, st = a["teacher"], a["student_sft"]
    lines += [
        "## Distillation on `synthetic_arithmetic`",
        "",
        f"The teacher: {s['teacher_model']}, SFT from scratch for "
        f"{s['teacher_sft_steps']} steps of {s['sft_batch_size']} "
        f"demonstrations (greedy pass@1 {t['sft_greedy_pass_at_1']:.3f}), "
        f"then `experiments/rlvr.py`'s grpo for {s['teacher_steps']} steps "
        f"(seed 0): greedy pass@1 **{t['grpo_greedy_pass_at_1']:.3f}**. "
        f"The student: {s['student_model']}, SFT from scratch for "
        f"{s['student_sft_steps']} steps of {s['sft_batch_size']} "
        f"demonstrations. Every method then trains that student for "
        f"{s['steps']} steps of {s['responses_per_step']} responses "
        f"({s['prompts_per_step']} prompts x {s['samples_per_prompt']} "
        "samples at temperature 1, at most "
        f"{s['max_new_tokens']} tokens; sft_teacher: "
        f"{s['responses_per_step']} examples), learning rate "
        f"{s['learning_rate']:g} (Adafactor, constant), once per seed.",
        "",
        f"Held out: greedy pass@1 on the first {s['eval_prompts']} sums of "
        f"the `test` split; KL to the teacher on the first "
        f"{s['kl_prompts']} test sums.",
        "",
        "| method | greedy pass@1 | KL(student‖teacher) per token | "
        "teacher forwards / step | s / step | minutes |",
        "|---|---|---|---|---|---|",
        f"| teacher | {t['grpo_greedy_pass_at_1']:.3f} | 0 | - | - | "
        f"{t['sft_minutes'] + t['grpo_minutes']:.1f} |",
        f"| student sft | {st['greedy_pass_at_1']:.3f} | "
        f"{st['kl_to_teacher']:.3f} | - | - | {st['minutes']:.1f} |",
    ]
    for name, r in a["runs"].items():
      lines.append(
          f"| {name} | {cell(r, 'greedy_pass_at_1', 3)} | "
          f"{cell(r, 'kl_to_teacher', 3)} | "
          f"{r['teacher_forwards_per_step']} | "
          f"{cell(r, 'seconds_per_step', 2)} | {cell(r, 'minutes', 1)} |")
    lines += [
        "",
        "- **greedy pass@1**: the gold reward of each test prompt's greedy "
        "decode (`experiments/rlvr.py`'s greedy_eval).",
        "- **KL(student‖teacher) per token**: one step of `distill` from "
        "the trained student on the held-out sums (data.train_split "
        "`test`), read before any update: its `distill/reverse_kl`, the "
        "mean over the student's own sampled tokens (temperature 1, one "
        "sample per prompt) of log pi_student - log pi_teacher (the k1 "
        "estimate; it can be negative on a finite sample).",
        "- **teacher forwards / step**: teacher forward passes over the "
        f"step's {s['responses_per_step']} responses: one scores their "
        "tokens (every method with a teacher; `distill/reverse_kl`), and "
        "GKD runs it once more in its loss over the vocabulary; "
        "sft_teacher's "
        f"teacher sampled its {s.get('teacher_sample_prompts', 0)} "
        "completions once before training"
        + (f", in {t['samples_minutes']:.2f} minutes, their gold reward "
           f"{t['samples_gold_reward']:.3f}" if "samples_minutes" in t
           else "") + ").",
        "- **s / step**: wall seconds per training step as the run logged "
        "them; **minutes**: wall time of a run (its compilation, its two "
        "in-run evaluations of 64 test sums, or sft_teacher's of 64 "
        "held-out teacher completions, training), the greedy and KL "
        "evaluations not included. The machine was shared with other "
        "jobs, so both are rough.",
        "",
        "From training (the last fifth of the steps): the rollouts' mean "
        "gold reward and the teacher's sampled per-token reverse KL on them "
        "(`distill/reverse_kl`, where the teacher scores the rollout: the "
        "mean of log pi_student - log pi_teacher over its tokens; GKD's "
        "steps on the dataset's completions count too, where the tokens "
        "are not the student's samples and it is no KL estimate), and "
        "the loss-mode divergence (`distill/divergence`, GKD: the "
        "generalised JSD at its beta, each beta's own scale):",
        "",
        "| method | gold reward (rollouts) | distill/reverse_kl | "
        "distill/divergence |",
        "|---|---|---|---|",
    ]
    for name, r in a["runs"].items():
      lines.append(
          f"| {name} | {cell(r, 'train_gold_reward_last', 3)} | "
          f"{cell(r, 'train_reverse_kl_last', 3)} | "
          f"{cell(r, 'train_divergence_last', 3)} |")
    lines += ["", "Methods:", ""]
    for name, r in a["runs"].items():
      overrides = json.dumps(r["overrides"], sort_keys=True)
      lines.append(f"- **{name}** (`{r['algorithm']}`): {r['description']}"
                   f"; overrides `{overrides}`.")
    lines += [
        "",
        "Settings shared by the online runs: " + ", ".join(
            f"`{k}={v}`" for k, v in sorted(a["shared_overrides"].items()))
        + "; distill and gkd train on the teacher alone (no reward is "
        "computed for them, hence their blank gold reward above).",
        "",
    ]
  if b:
    j, p = b["judge"], b["pipeline"]
    good, bad = b["judge_choices"].split(",")
    lines += [
        "## A trained judge as the reward on `synthetic_summarize`",
        "",
        "The quickstart pipeline's sft, data and reward_model stages "
        "(the SFT policy's greedy decodes' held-out gold reward "
        f"{p['sft_gold_reward']:.3f}; "
        f"{b['judge_data_samples_per_prompt']} SFT samples for each of "
        f"{b['judge_data_prompts']} training prompts, labelled by the gold "
        "reward; the reward model's held-out pair accuracy "
        + (f"{p['reward_model_accuracy']:.3f}" if p.get(
            "reward_model_accuracy") is not None else "-")
        + "). The judge: a tiny T5 SFT'd from scratch for "
        f"{b['judge_sft_steps']} steps on {j['train_examples']} judging "
        f"examples, input `{b['judge_template']}` with the prompt and a "
        f"sample, target `{good}` when the sample's gold reward is above "
        f"{j['threshold']:.3f} (the training samples' median; share "
        f"{j['train_good_share']:.2f}) else `{bad}`. On the "
        f"{j['heldout_examples']} judging examples of the held-out "
        f"samples (share `{good}` {j['heldout_good_share']:.2f}) its greedy "
        f"verdict matches the label **{j['heldout_accuracy']:.3f}** of the "
        f"time (always answering `{bad}` would score "
        f"{1 - j['heldout_good_share']:.3f}).",
        "",
        f"GRPO (the quickstart's grpo stage, "
        f"`{json.dumps(b['grpo_settings'], sort_keys=True)}`) from the "
        f"quickstart SFT policy for {b['steps']} steps of "
        f"{b['prompts_per_step']} prompts x {b['samples_per_prompt']} "
        "responses (temperature 1) on each reward, once "
        f"per seed; judged on the quickstart's first {b['eval_prompts']} "
        f"validation prompts, {b['eval_samples']} samples each at "
        "temperature 1 (the run's final evaluation):",
        "",
        "| reward | held-out gold reward | SFT's | win rate vs SFT | "
        "KL(pi‖SFT) | its reward (last fifth of steps) | minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in b["runs"].items():
      own = {"gold": "train_gold_reward_last",
             "reward_model": "train_reward_model_last",
             "judge": "train_judge_last"}[name]
      lines.append(
          f"| {name}: {r['description']} | "
          f"{cell(r, 'heldout_gold_reward', 3)} | "
          f"{cell(r, 'sft_heldout_gold_reward', 3)} | "
          f"{cell(r, 'win_rate_vs_sft', 3)} | {cell(r, 'kl_to_sft', 3)} | "
          f"{cell(r, own, 3)} | {cell(r, 'minutes', 1)} |")
    lines += [
        "",
        "- **held-out gold reward**: the mean gold reward of the trained "
        "policy's samples; **SFT's**: the same run's evaluation before "
        "training; **win rate vs SFT**: the gold reward decides each "
        "sample against an SFT sample (ties 1/2).",
        "",
    ]
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", default=str(REPO / "experiments" / "results"
                                      / "distill"))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--methods", default=",".join(METHODS),
                 help=f"comma-separated, of {', '.join(METHODS)} ('' = "
                 "no distillation part)")
  p.add_argument("--teacher_sft_steps", type=int, default=600)
  p.add_argument("--teacher_steps", type=int, default=120)
  p.add_argument("--student_sft_steps", type=int, default=600)
  p.add_argument("--steps", type=int, default=100,
                 help="student steps of every method")
  p.add_argument("--teacher_sample_prompts", type=int, default=2048)
  p.add_argument("--eval_prompts", type=int, default=512)
  p.add_argument("--kl_prompts", type=int, default=256)
  p.add_argument("--judge_data_prompts", type=int, default=1000)
  p.add_argument("--judge_sft_steps", type=int, default=1500)
  p.add_argument("--judge_steps", type=int, default=60,
                 help="GRPO steps of each judge-part run (0 = no judge part)")
  args = p.parse_args()
  names = [a for a in args.methods.split(",") if a]
  unknown = sorted(set(names) - set(METHODS))
  if unknown:
    sys.exit(f"error: --methods: unknown {unknown}; choose from "
             f"{list(METHODS)}")
  seeds = [int(x) for x in args.seeds.split(",")]
  os.makedirs(args.workdir, exist_ok=True)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(args.workdir, "xla_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  import jax  # pylint: disable=g-import-not-at-top

  started = time.time()
  elapsed = lambda: (time.time() - started) / 60
  results = {}
  if names:
    results["distillation"] = part_a(args, seeds, names, elapsed)
  if args.judge_steps:
    results["judge"] = part_b(args, seeds, elapsed)

  command = ("python experiments/distill.py --workdir=/tmp/distill_mini "
             "--out=" + os.path.relpath(os.path.abspath(args.out), REPO))
  for flag in ("seeds", "methods", "teacher_sft_steps", "teacher_steps",
               "student_sft_steps", "steps", "teacher_sample_prompts",
               "eval_prompts", "kl_prompts", "judge_data_prompts",
               "judge_sft_steps", "judge_steps"):
    value = getattr(args, flag)
    if str(value) != str(p.get_default(flag)):
      command += f" --{flag}={value}"
  config = rlvr.base_config(args.teacher_sft_steps)
  results["setup"] = {
      "command": command,
      "task": TASK,
      "teacher_model": TEACHER_TEXT,
      "student_model": STUDENT_TEXT,
      "teacher_sft_steps": args.teacher_sft_steps,
      "teacher_steps": args.teacher_steps,
      "student_sft_steps": args.student_sft_steps,
      "sft_batch_size": config.train.batch_size,
      "steps": args.steps,
      "prompts_per_step": rlvr.PROMPTS_PER_STEP,
      "samples_per_prompt": rlvr.SAMPLES_PER_PROMPT,
      "responses_per_step": RESPONSES_PER_STEP,
      "max_new_tokens": rlvr.RESPONSE_TOKENS,
      "learning_rate": rlvr.ONLINE_LEARNING_RATE,
      "teacher_sample_prompts": args.teacher_sample_prompts,
      "eval_prompts": args.eval_prompts,
      "kl_prompts": args.kl_prompts,
      "seeds": seeds,
      "minutes": round(elapsed(), 1),
      "machine": (f"{os.cpu_count()} CPU cores, shared with other jobs, "
                  f"JAX {jax.__version__} on "
                  f"{jax.devices()[0].platform.upper()}"),
  }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2, sort_keys=True)
  readme = format_readme(results)
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write(readme)
  print(readme)
  print(f"Done in {elapsed():.1f} min; results in {args.out}")


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
