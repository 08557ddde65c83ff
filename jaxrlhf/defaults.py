"""The config every experiment starts from, and its validation.

An experiment file under `configs/` calls `base_config()` and changes what it
needs. The config is built from declared groups (`jaxrlhf.config_schema`):
the groups every run shares are declared here, each algorithm's own groups
beside the algorithm (`jaxrlhf/algorithms/`), and the registry puts them
together, so every field is documented, typed and range-checked where it is
declared. `docs/config.md` is rendered from the same declarations
(`python -m jaxrlhf.docs`).
"""

import importlib.util

import ml_collections

from jaxrlhf import algorithms
from jaxrlhf import config_files
from jaxrlhf import config_schema
from jaxrlhf import sharding
from jaxrlhf import sharding_rules
from jaxrlhf.algorithms import lora_state
from jaxrlhf.algorithms import optimizers
from jaxrlhf.data import file_layouts
from jaxrlhf.data import names
from jaxrlhf.eval import judges
from jaxrlhf.eval import pass_at_k
from jaxrlhf.models import registry
from jaxrlhf.models.layers import decoders

F = config_schema.Field
G = config_schema.Group

ALGORITHM = F("algorithm", "sft",
              "Which algorithm trains (jaxrlhf/algorithms/; docs/config.md "
              "lists them with a line each).", choices=algorithms.NAMES)
TOP = [
    ALGORITHM,
    F("seed", 0, "Seeds parameter initialisation, dropout and data "
      "shuffling (a JAX PRNG key holds 32 bits: a larger seed would be "
      "truncated to another run's).", bounds="[0, 4294967295]"),
]

MODEL = G("model", "The policy's model (and the reward model's, unless it "
          "comes from a run with its own).", [
              F("arch", "t5",
                "Model family (jaxrlhf/models/; every algorithm runs on "
                "each): " + "; ".join(
                    f"'{name}': {f.summary}"
                    for name, f in registry.FAMILIES.items()),
                choices=registry.ARCHITECTURES),
              F("size", "tiny",
                "Size preset of the family: " + "; ".join(
                    f"{name}: {', '.join(f.presets)}"
                    for name, f in registry.FAMILIES.items()) + "."),
              F("vocab_size", None,
                "Output vocabulary size; unset = the task vocabulary's size "
                "rounded up to a multiple of 128 (t5x pads 32100 to 32128 "
                "the same way).", type=int, bounds=">0"),
              F("emb_dim", None, "Overrides the preset's model width.",
                type=int, bounds=">0"),
              F("num_heads", None, "Overrides the preset's attention heads.",
                type=int, bounds=">0"),
              F("num_kv_heads", None,
                "Overrides the preset's key/value heads (grouped-query "
                "attention of the decoder-only families; unset with "
                "num_heads set: one per query head when the preset has "
                "one per query head).", type=int, bounds=">0"),
              F("num_encoder_layers", None,
                "Overrides the preset's encoder depth (T5).", type=int,
                bounds=">0"),
              F("num_decoder_layers", None,
                "Overrides the preset's decoder depth (the depth of a "
                "decoder-only model).", type=int, bounds=">0"),
              F("head_dim", None, "Overrides the preset's head width.",
                type=int, bounds=">0"),
              F("mlp_dim", None, "Overrides the preset's MLP width.",
                type=int, bounds=">0"),
              F("family_fields", "",
                "Any other field of the family's config, for a "
                "from-scratch run, as 'field=value,...' (e.g. "
                "'rope_theta=1000000.0,qkv_bias=True'; values are Python "
                "literals); the fields are the family config's "
                "(jaxrlhf/models/<family>.py); '' = the preset's."),
              F("mlp", "gated-gelu",
                "'gated-gelu' (T5 1.1) or 'relu' (T5 1.0); T5 and "
                "t5x_decoder_only.", choices=registry.MLP_TYPES),
              F("logits_via_embedding", False,
                "Tie the output layer to the token embedding (T5 1.0 "
                "style); T5 and t5x_decoder_only."),
              F("dtype", "float32",
                "Compute dtype; parameters are always float32.",
                choices=("float32", "bfloat16")),
              F("dropout_rate", 0.0, "Dropout (T5 and t5x_decoder_only).",
                bounds="[0, 1)"),
              F("remat_policy", "none",
                "Per-layer rematerialisation in the backward pass: 'none', "
                "'full', or a jax.checkpoint_policies name.",
                choices=decoders.REMAT_POLICIES, resumable=True),
              F("scan_layers", False,
                "Run each layer stack as one nn.scan (one compiled layer "
                "body: faster compiles of deep models; the same numbers). "
                "The parameters are then stacked under 'layers', so a "
                "checkpoint the run starts from must have the same "
                "layout."),
              F("attention_impl", registry.AUTO_ATTENTION,
                "'auto': the fastest exact kernel the family has on the "
                "devices the run uses (`models.attention_for`): 'splash' "
                "for the decoder-only families on TPU; 'dot_product_cudnn' "
                "for them on GPUs of compute capability 9.0+ when the "
                "model computes in bfloat16 or float16, its head size is a "
                "multiple of 8 up to 256 and it has no attention soft cap "
                "(`models.cudnn_takes`); else 'xla'. "
                "'xla' (einsums, float32 softmax) or 'dot_product' "
                "(jax.nn.dot_product_attention, so fused kernels can be "
                "used; T5 passes its relative-position bias to it). The "
                "decoder-only families also take the fused kernels, which "
                "never build the [length, length] mask and read packing's "
                "segment ids: 'splash' (Pallas splash attention on TPU, "
                "causal and sliding windows, Gemma's soft cap; interpreted "
                "elsewhere, slowly) and 'dot_product_cudnn' (cuDNN flash "
                "attention, GPU, half precision; packed rows need sm90+, "
                "where unpacked rows take cuDNN's packed layout too and "
                "their real tokens must be contiguous, as the trainers' "
                "rows are, else the step's loss is NaN and the run stops "
                "as at any non-finite step). T5 "
                "takes neither: no fused kernel takes its bias. "
                "t5x_decoder_only has 'xla' only. The "
                "kernels compute the same numbers, so a run may resume "
                "with another.",
                choices=registry.ATTENTION_CHOICES, resumable=True),
          ])

INIT = G("init", "Where the networks start.", [
    F("policy_checkpoint", "",
      "Where the policy starts: a T5X checkpoint (checkpoint_N or its "
      "model directory), a Hugging Face model directory, or a jaxrlhf "
      "workdir whose latest checkpoint's policy is used (e.g. an SFT "
      "run's). '' = random initialisation, which only sft, reward_model "
      "and reward_model_ranking accept: every other algorithm (the DPO "
      "family, ORPO, SimPO, KTO, BCO, DRO-V and the online ones) starts "
      "from a trained policy, its reference too, and refuses ''.",
      path=True),
])

def _check_completion_limit(c) -> None:
  limit = c.data.files.max_completion_tokens
  config_schema.require(
      limit is None or limit <= c.data.targets_length,
      "data.files.max_completion_tokens",
      f"{limit} is more than data.targets_length ({c.data.targets_length}), "
      "the longest completion a batch holds.")


def _check_held_out_files(c) -> None:
  files = c.data.files
  for split in ("validation", "test"):
    count = files[f"holdout_{split}_prompts"]
    if count:
      config_schema.require(
          bool(files.train) and not files[split],
          f"data.files.holdout_{split}_prompts",
          f"{count} prompts of data.files.train are to be held out as the "
          f"{split!r} split, " + (
              "but data.files.train is not set." if not files.train else
              f"which data.files.{split} already is; set one of the two."))


def _check_packing(c) -> None:
  if not c.data.pack:
    return
  algorithm = algorithms.get(c.algorithm)
  config_schema.require(
      getattr(algorithm.training, "packs", False), "data.pack",
      f"{c.algorithm!r} does not read packed rows (packing serves sft, "
      "dpo, simpo, orpo and dro_v; KTO's KL baseline pairs each prompt "
      "with another example's completion, which changes the rows' "
      "lengths); set it to 0.")
  config_schema.require(
      c.reference_logprobs.mode == "in_step", "data.pack",
      "packed rows need reference_logprobs.mode 'in_step' (precomputed "
      "reference log-probs are stored per unpacked example); set it to 0.")


FILES = G("files", "Alignment data from files on disk: when "
          "data.files.train is set, a seqio task named data.task is "
          "registered from these files at start-up.", [
              F("train", "",
                "Path or glob of training files (JSONL or Parquet; local or "
                "any tf.io.gfile path such as gs://). config.data.task names "
                "the task these files become; it must not be an already "
                "registered task such as the default.", path=True),
              F("validation", "",
                "Held-out files, the 'validation' split: SFT and the reward "
                "models evaluate on it (data.eval_split), algorithms that "
                "train on pairs report their implicit reward's accuracy on "
                "it, and with eval.task '' (and eval.judge 'reward_model' or "
                "'function': files have no gold reward) the policy "
                "algorithms are judged on its distinct prompts.",
                path=True),
              F("test", "",
                "Held-out files, the 'test' split (e.g. for "
                "eval.test_split).", path=True),
              F("holdout_validation_prompts", 0,
                "Hold this many distinct prompts of the training files out "
                "as the 'validation' split (every row of such a prompt; "
                "chosen by a hash of the seed and the prompt), for data "
                "with no held-out files such as UltraFeedback; 0 = none.",
                bounds=">=0"),
              F("holdout_test_prompts", 0,
                "The same for the 'test' split (disjoint from "
                "'validation').", bounds=">=0"),
              F("layout", "columns",
                "'columns' (with column_mapping; for SFT and online RL, "
                "names other than prompt and completion there are extra "
                "columns handed to reward functions, e.g. "
                "'prompt=question,completion=solution,answer=final'), "
                "'ultrafeedback', 'hh_rlhf', 'tldr' (the TL;DR comparisons), "
                "'tldr_sft' (the TL;DR SFT data: SFT trains on it, online RL "
                "samples its prompts), 'gsm8k' (question; the worked answer "
                "as completion; the number after '####' as column 'answer'), "
                "'math' (MATH: problem; solution; its last \\boxed{} as "
                "column 'answer', and 'level' and 'type'), 'messages' "
                "(conversations, lists of {role, content} messages, rendered "
                "with the checkpoint's chat template: {'messages': [...]} "
                "for SFT, one example per assistant message, the "
                "conversation before it the prompt; {'prompt': [...], "
                "'chosen': [reply], 'rejected': [reply]} or two whole "
                "conversations {'chosen', 'rejected'} for pairs; prompts "
                "end with the template's generation prompt).",
                choices=file_layouts.LAYOUTS),
              F("column_mapping", "",
                "Layouts 'columns' and 'messages': kind field (or 'messages', "
                "the conversation column) -> file column, as "
                "'prompt=question,completion=answer,reward=score' ('' = the "
                "fields' own names)."),
              F("vocabulary", "",
                "The policy's vocabulary: a SentencePiece model, or a Hugging "
                "Face tokenizer.json (any name ending in .json; a "
                "tokenizer_config.json beside it is read, and when its "
                "padding is not id 0, ids 0 and the padding trade places "
                "so that padding is 0 and EOS is not: jaxrlhf.data."
                "hf_tokenizer). '' = the built-in synthetic task's "
                "vocabulary.", path=True),
              F("chat_template", "",
                "Layout 'messages': a Jinja chat template file to render "
                "conversations with, as transformers' apply_chat_template "
                "does. '' = the vocabulary's own: chat_template.jinja beside "
                "data.files.vocabulary, else the chat_template of the "
                "tokenizer_config.json beside it.", path=True),
              F("chat_template_kwargs", "",
                "Layout 'messages': extra variables of the chat template, "
                "a JSON object, e.g. '{\"enable_thinking\": false}' for "
                "Qwen 3 ('' = none)."),
              F("normalize_rewards", True,
                "Normalise trajectory rewards to mean 0, variance 1 over the "
                "training files (the DRO paper does this for "
                "UltraFeedback)."),
              F("on_bad_row", "raise",
                "'raise': a malformed row stops the run naming file and row; "
                "'skip_and_report': it is counted, reported, and skipped.",
                choices=names.ON_BAD_ROW),
              F("max_completion_tokens", None,
                "Longest completion (EOS included) a row may have; longer "
                "ones are bad rows. Unset = data.targets_length.", type=int,
                bounds=">0"),
          ], checks=(_check_completion_limit, _check_held_out_files))

DATA = G("data", "What the run reads.", [
    F("task", "synthetic_summarize",
      "A seqio task or mixture name; the built-in ones are registered by "
      "jaxrlhf.data.tasks, and any task registered before training works."),
    F("train_split", "train", "The split training reads."),
    F("eval_split", "validation", "The split SFT and the reward models "
      "evaluate on."),
    F("inputs_length", 16,
      "Prompt length in tokens as the model reads it: a T5 encoder's input, "
      "with the EOS the tasks append to a prompt (as t5x counts it); a "
      "decoder-only model's prompt, which leaves that EOS out (prompts of "
      "64 tokens and completions of 64: inputs_length 64, targets_length "
      "64, sequences of 128).", bounds=">0"),
    F("targets_length", 16, "Completion length in tokens, EOS included.",
      bounds=">0"),
    F("task_modules", (), "Modules to import before looking up the task "
      "(they register tasks)."),
    F("pack", 0,
      "Training batches: 0 lays out one example per row; k > 0 packs up to "
      "k whole examples into each row (first-fit, segment ids keep "
      "attention within an example, positions restart), so less of a "
      "batch is padding; train.batch_size then counts rows, and the loss "
      "is the same mean over a batch's examples (or SFT's target tokens) "
      "as unpacked. For sft, dpo, simpo, orpo and dro_v with "
      "reference_logprobs.mode 'in_step'; evaluation reads unpacked "
      "rows.", bounds=">=0"),
    FILES,
], checks=(_check_packing,))


def _check_wandb(c) -> None:
  # Refused before anything is written, not at the first metrics row.
  config_schema.require(
      not c.train.wandb or importlib.util.find_spec("wandb") is not None,
      "train.wandb",
      "the wandb package is not installed: pip install -e .[wandb] (or "
      "--config.train.wandb=False).")


TRAIN = G("train", "The training run.", [
    F("num_steps", 600, "Train steps (a resumed run may extend them; with a "
      "decaying optimizer.schedule that changes the remaining learning "
      "rates).", bounds=">0", resumable=True),
    F("batch_size", 32, "Global batch size (examples per optimizer step, "
      "over all processes; prompts per step for online algorithms).",
      bounds=">0"),
    F("num_microbatches", 1,
      "Gradient accumulation: the batch is split into this many "
      "micro-batches (online algorithms: each online.num_minibatches "
      "minibatch is; online.rollout_microbatches splits the rollout).",
      bounds=">0"),
    F("z_loss", 0.0, "Weight of the z-loss (log Z)^2 that keeps the "
      "softmax normaliser near 0 (SFT).", bounds=">=0"),
    F("log_every", 50, "Console and metrics.jsonl every N steps.",
      bounds=">0", resumable=True),
    F("wandb", False,
      "Also log every metrics.jsonl row to Weights & Biases, at the same "
      "steps (plotted against the scalar 'step'), from the process that "
      "writes metrics; needs pip install -e .[wandb]. The wandb run is named "
      "after the workdir's last directory, records the config, keeps its "
      "files under <workdir>/wandb/ unless WANDB_DIR is set, and a resumed "
      "run is a new wandb run from the step it resumes at.",
      resumable=True),
    F("wandb_project", "jaxrlhf", "train.wandb: the wandb project.",
      resumable=True),
    F("wandb_entity", "",
      "train.wandb: the wandb entity (user or team); '' = your default.",
      resumable=True),
    F("wandb_mode", "online",
      "train.wandb: 'online' (uploads as it runs; needs wandb login or "
      "WANDB_API_KEY), 'offline' (writes the run's files only; wandb sync "
      "uploads them later) or 'disabled' (logs nothing).",
      choices=("online", "offline", "disabled"), resumable=True),
    F("lost_process_timeout_s", 60,
      "Runs of several processes: one not heard from for this many seconds "
      "is lost (died, preempted), and the others stop with one line naming "
      "it rather than wait for it forever in a collective; "
      "jax.distributed's own heartbeat timeout is set to twice this.",
      bounds=">0", resumable=True),
], checks=(_check_wandb,))

OPTIMIZER = G("optimizer", "The optimizer of the trained networks (of the "
              "policy, where a network has its own learning rate).", [
                  F("name", "adafactor",
                    "'adafactor' (the DRO paper's), 'adamw' (the PPO "
                    "paper's) or 'sgd' (plain gradient descent).",
                    choices=optimizers.NAMES),
                  F("learning_rate", 1e-3, "Peak learning rate (a "
                    "resumed run may lower it, e.g. after a non-finite "
                    "step).", bounds=">0", resumable=True),
                  F("warmup_steps", 0,
                    "Linear warm-up steps from 0 to learning_rate.",
                    bounds=">=0"),
                  F("schedule", "constant",
                    "After warm-up: 'constant', 'cosine' (to 0 at "
                    "train.num_steps), 'linear'.",
                    choices=optimizers.SCHEDULES),
                  F("decay_rate", 0.8,
                    "Adafactor's second-moment decay exponent (DRO paper: "
                    "0.8).", bounds="(0, 1]"),
                  F("multiply_by_parameter_scale", True,
                    "Adafactor: scale updates by parameter RMS (T5 "
                    "practice)."),
                  F("b1", 0.9, "AdamW's beta1.", bounds="[0, 1)"),
                  F("b2", 0.999, "AdamW's beta2.", bounds="[0, 1)"),
                  F("eps", 1e-5, "AdamW's eps (PPO paper: 1e-5).",
                    bounds=">0"),
                  F("weight_decay", 0.0, "AdamW's decoupled weight decay.",
                    bounds=">=0"),
                  F("grad_clip_norm", 1.0,
                    "Clip gradients to this global norm; 0 disables.",
                    bounds=">=0", resumable=True),
              ])

def _check_best_metric(c) -> None:
  metric = c.checkpoint.best_metric
  if not metric:
    return
  config_schema.require(
      metric.startswith("eval/"), "checkpoint.best_metric",
      f"{metric!r} is not an evaluation metric; name one of the eval/... "
      "metrics (e.g. 'eval/win_rate').")
  config_schema.require(
      c.eval.every_steps > 0, "checkpoint.best_metric",
      f"{metric!r} picks among periodic evaluations, but eval.every_steps is "
      "0; set it (the DRO paper: every 2,000 steps).")


# Which way checkpoint.best_metric improves (jaxrlhf/train/best.py).
BEST_MODES = ("max", "min")


CHECKPOINT = G("checkpoint", "Checkpoints in <workdir>/checkpoints.", [
    F("every_steps", 200,
      "Save every N steps (and always at the end); 0 = only at the end.",
      bounds=">=0", resumable=True),
    F("keep", 2, "How many recent checkpoints to keep (an older one is "
      "deleted only once a newer one is complete).", bounds=">0",
      resumable=True),
    F("best_metric", "",
      "Keep, besides the latest checkpoints, the one whose evaluation scored "
      "best on this eval/... metric (e.g. 'eval/win_rate': the DRO paper "
      "keeps the checkpoint that wins most against SFT), in <workdir>/best "
      "(a checkpoint other runs can start from; jaxrlhf/train/best.py); '' = "
      "off."),
    F("best_mode", "max", "Whether higher ('max') or lower ('min') "
      "best_metric is better.", choices=BEST_MODES),
], checks=(_check_best_metric,))

def _check_folds(c) -> None:
  e = c.eval
  config_schema.require(
      e.num_examples % e.num_folds == 0, "eval.num_folds",
      f"{e.num_folds} folds do not split eval.num_examples ({e.num_examples}) "
      "evenly; use a divisor of it.")


def _check_held_out_rewards(c) -> None:
  # The one reader of the k values (it refuses a bad one naming the field).
  pass_at_k.parse_ks(c.eval.pass_k, c.eval.samples_per_prompt)
  config_schema.require(
      not (c.eval.only and c.pipeline.stages), "eval.only",
      "evaluates one run's policy, and config.pipeline.stages runs a "
      "pipeline of runs; add --config.pipeline.stages= (empty) and name the "
      "stage's algorithm (--config.algorithm=...).")


EVAL = G("eval", "Evaluation before, during and after training.", [
    F("every_steps", 0,
      "Evaluate every N steps (and before and after training); 0 = only "
      "then.", bounds=">=0", resumable=True),
    F("num_examples", 128,
      "Held-out examples (prompts; distinct prompts of a task of pairs or "
      "trajectories) to evaluate on.", bounds=">0"),
    F("batch_size", 64, "Examples per evaluation forward pass or sampling "
      "call.", bounds=">0", resumable=True),
    F("task", "",
      "Policy algorithms: the task whose eval.split prompts and gold reward "
      "judge the policy against its reference ('' = data.task)."),
    F("split", "validation", "The split of eval.task."),
    F("num_samples", 1, "Policy samples per prompt.", bounds=">0"),
    F("temperature", 1.0,
      "The sampling temperature (eval/kl is then the KL between policy and "
      "reference both sampled at that temperature; 0 if they agree).",
      bounds=">0"),
    F("judge", "gold_reward",
      "Policy algorithms: what decides each side-by-side comparison with the "
      "reference (jaxrlhf/eval/judges.py): 'gold_reward' (eval.task's gold "
      "reward), 'reward_model' (the reward model of eval.judge_checkpoint; "
      "a completion without EOS loses), 'function' (eval.judge_function, "
      "e.g. an LLM judge as the papers use).", choices=judges.JUDGES),
    F("judge_checkpoint", "",
      "eval.judge 'reward_model': a reward_model run's workdir (its "
      "vocabulary must be the policy's).", path=True,
      read_when=lambda c: c.eval.judge == "reward_model"),
    F("judge_function", "",
      "eval.judge 'function': the import path 'package.module:function' of "
      "judge(prompts, first, second) -> P(first better) per prompt, in "
      "[0, 1]; the policy's completion is first on even prompts, second on "
      "odd ones."),
    F("num_folds", 1,
      "Split the held-out prompts into this many equal folds and report the "
      "spread of the fold win rates (eval/win_rate_fold_std and _stderr; "
      "the DRO paper: 5 folds of 1,000 test prompts); 1 = no folds.",
      bounds=">0"),
    F("test_split", "",
      "Policy algorithms: after training, judge the chosen policy (the best "
      "checkpoint by checkpoint.best_metric, else the final one) once more "
      "on this split of eval.task, logged as test/... metrics; '' = none."),
    F("with_rewards", "auto",
      "Online algorithms: also score the policy's completions of the first "
      "eval.num_examples prompts of eval.task's eval.split with the run's "
      "own host rewards (config.rewards: math_answer, format, code, "
      "functions, gold_reward; jaxrlhf/eval/pass_at_k.py): eval/pass@1 "
      "(greedy), eval/mean@n and eval/pass@k, and each reward's mean "
      "(eval/reward/<name>). 'auto' = when the run has host rewards, "
      "nothing else judges the policy (eval.judge 'gold_reward' on a task "
      "without one, such as a file task) and the split exists; 'on' = "
      "always (the split must exist); 'off' = never.",
      choices=("auto", "on", "off"), resumable=True),
    F("samples_per_prompt", 4,
      "eval.with_rewards: n, the completions per prompt sampled at "
      "eval.temperature for eval/mean@n and eval/pass@k; 0 = the greedy "
      "completion's eval/pass@1 alone.", bounds=">=0", resumable=True),
    F("pass_k", "",
      "eval.with_rewards: the k values of eval/pass@k, comma-separated, "
      "each in [2, eval.samples_per_prompt] (Chen et al. 2021's unbiased "
      "estimator from the n samples; k = n: any of them passes); '' = "
      "samples_per_prompt alone.", resumable=True),
    F("pass_threshold", 1.0,
      "eval.with_rewards: a completion passes when the weighted sum of the "
      "run's host rewards (a reward that does not apply counting 0) is at "
      "least this: with math_answer (0/1) at weight 1, when its answer is "
      "right (a format reward at weight 0.1 beside it cannot pass a wrong "
      "one).", bounds=config_schema.ANY_NUMBER, resumable=True),
    F("only", False,
      "Evaluate and stop, training nothing: the workdir's newest "
      "checkpoint, else (a fresh workdir) the policy the run starts from "
      "(init.policy_checkpoint: a Hugging Face folder or another run's "
      "workdir), logged at its step in metrics.jsonl; no checkpoint or "
      "config.json is written.", resumable=True),
], checks=(_check_folds, _check_held_out_rewards))

MESH = G("mesh", "The device mesh.", [
    F("shape", (-1, 1), "Mesh axis sizes; one of them may be -1 for 'all "
      "remaining devices'.", resumable=True),
    F("axis_names", ("data", "model"), "The mesh axes' names.",
      resumable=True),
])

SHARDING = G("sharding", "The sharding plan.", [
    F("logical_axis_rules", sharding_rules.STANDARD_RULES,
      "Logical axis name -> mesh axis (or tuple of axes, or None = "
      "replicate).", resumable=True),
])


def _check_pipeline_algorithm(c) -> None:
  # The stages pick their algorithms: another config.algorithm on a
  # pipeline's config (`--config.algorithm=grpo` on configs/quickstart.py)
  # asks for a run that would not happen.
  default = ALGORITHM.default
  config_schema.require(
      not c.pipeline.stages or c.algorithm == default, "algorithm",
      f"{c.algorithm!r} would not run: config.pipeline.stages "
      f"({c.pipeline.stages!r}) runs a pipeline whose stages pick their own "
      f"algorithms. To run {c.algorithm} alone, add "
      "--config.pipeline.stages= (empty); to run it as a stage, name it "
      f"there and leave config.algorithm at {default!r}.")


# Resumable: each stage's run is described by its own fields (the pipeline
# sets them); these only plan the stages.
PIPELINE = G("pipeline", "The pipeline of jaxrlhf.offline_pipeline "
             "(configs/quickstart.py runs it).", resumable=True, fields=[
                 F("stages", "",
                   "Comma-separated stages ('' = run config.algorithm "
                   "alone): sft, data, reward_model, then the offline policy "
                   "algorithms (dpo, kto, dro_v, ...) and the online ones "
                   "(ppo, rloo, grpo, ...) from the algorithm registry, and "
                   "best_of_n (an evaluation of the SFT policy). The SFT "
                   "stage trains for train.num_steps with "
                   "config.optimizer."),
                 F("num_prompts", 2000,
                   "Offline data: SFT samples for this many training "
                   "prompts.", bounds=">0"),
                 F("num_eval_prompts", 200,
                   "And held-out prompts for the reward model's evaluation "
                   "pairs.", bounds=">0"),
                 F("samples_per_prompt", 4, "SFT samples per prompt.",
                   bounds=">=2"),
                 F("sampling_temperature", 1.0,
                   "Their sampling temperature.", bounds=">0"),
                 F("annotator_beta", 10.0,
                   "Bradley-Terry annotator: P(a preferred) = "
                   "sigmoid(beta * (r_a - r_b)).", bounds=">0"),
                 F("reward_model_steps", 300,
                   "Steps of the reward model stage.", bounds=">0"),
                 F("reward_model_learning_rate", 1e-3,
                   "Its learning rate.", bounds=">0"),
                 F("policy_steps", 300,
                   "Steps of each offline policy stage.", bounds=">0"),
                 F("policy_learning_rate", 1e-3, "Their learning rate.",
                   bounds=">0"),
                 F("eval_samples_per_prompt", 2,
                   "eval.num_samples of the policy stages.", bounds=">0"),
                 F("online_steps", 100, "Steps of each online stage.",
                   bounds=">0"),
                 F("online_learning_rate", 1e-3, "Their learning rate.",
                   bounds=">0"),
                 F("best_of_n", 8,
                   "N of the best-of-N row (its KL is log N - (N - 1) / N).",
                   bounds=">0"),
             ], checks=(_check_pipeline_algorithm,))

# The groups every run shares; each algorithm adds its own
# (`algorithms.config_groups()`).
SHARED = TOP + [MODEL, INIT, DATA, TRAIN, OPTIMIZER, CHECKPOINT, EVAL, MESH,
                SHARDING, PIPELINE, lora_state.GROUP]


def groups():
  """Every declared field and group of the config, in order."""
  return SHARED + list(algorithms.config_groups())


def base_config() -> ml_collections.ConfigDict:
  """A config with every field at its documented default."""
  return config_schema.build(groups())


def apply_overrides(c: ml_collections.ConfigDict, overrides) -> None:
  """Sets fields by dotted path, {"train.num_steps": 10, ...}, in place."""
  for path, value in overrides.items():
    node = c
    *parents, leaf = path.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks every field against its declaration, every group's
  combinations, and the selected algorithm's own checks (with those of
  what it carries); the error names the offending field."""
  config_schema.check(c, groups())
  for check in algorithms.get(c.algorithm).all_checks:
    check(c)
  sharding.as_rules(c.sharding.logical_axis_rules)


# What the paper configs put where a user's own path goes, and a config
# file's config as --config gives it: declared in `config_files` (which the
# command line gives a config file before it imports the library), named here
# too because config files, scripts and notebooks read them from `defaults`.
PLACEHOLDER = config_files.PLACEHOLDER
load_config_file = config_files.load_config_file


def check_paths(c: ml_collections.ConfigDict) -> None:
  """Every set path field matches something readable; the error names the
  field (a placeholder, a missing file, or a remote path that cannot be
  reached, e.g. gs:// without network or credentials)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for field, declared in config_schema.path_fields(groups()):
    pattern = config_schema.get(c, field)
    if not pattern or (declared.read_when and not declared.read_when(c)):
      continue
    if PLACEHOLDER in pattern:
      raise ValueError(
          f"config.{field}: {pattern!r} is a placeholder of the config file; "
          f"point it at your copy, e.g. --config.{field}=/path/to/yours.")
    try:
      found = tf.io.gfile.glob(pattern)
    except Exception as e:  # pylint: disable=broad-except
      reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise ValueError(
          f"config.{field}: cannot read {pattern!r} "
          f"({type(e).__name__}: {reason}). Check the path, and for a remote "
          "path the network and credentials.") from None
    if not found:
      raise ValueError(f"config.{field}: nothing matches {pattern!r}.")
