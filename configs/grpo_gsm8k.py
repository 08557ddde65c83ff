r"""GRPO on GSM8K with verifiable rewards, from a decoder-only Hugging Face
checkpoint (Qwen2.5-1.5B by default): the math verifier checks each
response's final answer against the row's reference answer, a small format
reward asks for the answer to be marked, and the GRPO settings are
DeepSeekMath's with DAPO's four changes. No reward model.

  python -m jaxrlhf.main --config=configs/grpo_gsm8k.py --workdir=/runs/grpo_gsm8k \
      --config.init.policy_checkpoint=/models/Qwen2.5-1.5B \
      --config.data.files.vocabulary=/models/Qwen2.5-1.5B/tokenizer.json \
      --config.data.files.train=/data/gsm8k/train-00000-of-00001.parquet

Other checkpoints: `--config=configs/grpo_gsm8k.py:qwen2.5-0.5b` (or
qwen2.5-3b, qwen2.5-7b, qwen3-1.7b, llama3.2-1b, llama3.2-3b, ... : the
size presets of the qwen2, qwen3 and llama families, docs/config.md; or the
mixture of experts qwen3-30b-a3b, family qwen3_moe), with
the paths pointed at that checkpoint.

The data: GSM8K rows {"question", "answer"} (openai/gsm8k, JSONL or
Parquet; layout "gsm8k"). The prompt is the question as it is, the "answer"
column the number after the solution's "####" (`jaxrlhf.answers`), which
the rewards see; the worked solutions are not trained on. A checkpoint's
HF folder holds config.json and model.safetensors (the tokenizer.json
beside them is the vocabulary). For an instruct checkpoint that should
read the question through its chat template, write the rows as
{"prompt": [{"role": "user", "content": question}], "completion":
[{"role": "assistant", "content": solution}], "answer": N} and set
--config.data.files.layout=messages --config.data.files.column_mapping=answer=answer.

The score of a response is, summed (each logged as reward/<name> with its
share of the score):
  math_answer  1 when its final answer (the last \boxed{}, else the number
               after "####", else its last number) equals the reference
               answer by math-verify, else 0 (weight 1);
  format       1 when it marks an answer, a \boxed{...} or "#### <number>"
               (weight 0.1, small: it must not pay for a wrong answer);
  overlong     DAPO's soft overlong penalty, 0 up to 384 response tokens,
               falling to -1 at the 512 sampled (weight 1).

GRPO (jaxrlhf/algorithms/online/grpo.py): 16 responses per question sampled at
temperature 1 (DAPO; DeepSeekMath samples 64), advantages normalised by
their group's mean and std (DeepSeekMath), and DAPO's changes: clip-higher
(epsilon 0.2 below, 0.28 above), the token-level mean loss, no KL term
(so the step skips the reference's forward pass and the run holds no
copy of the reference; DeepSeekMath's is beta 0.04:
--config.grpo.kl_coef=0.04), dynamic sampling (groups whose 16
rewards all agree carry no gradient: they are dropped and more questions
sampled, up to 3 rounds), and the overlong penalty above. 128 questions
per step in 4 minibatch updates of 512 responses (DAPO: mini-batches of
512 responses), AdamW at a constant 1e-6 after 10 warm-up steps (both
papers: 1e-6), gradients clipped to norm 1, 200 steps (about 3.4 passes
over GSM8K's 7,473 training questions before dynamic sampling draws
more). DeepSeekMath's original GRPO instead:
--config.grpo.clip_eps_high=0.2 --config.grpo.reduction=sequence_mean
--config.grpo.kl_coef=0.04 --config.grpo.dynamic_sampling=False
--config.rewards.overlong.weight=0.

Held-out accuracy: give the run GSM8K's test questions as its "test"
split, --config.data.files.test=/data/gsm8k/test-00000-of-00001.parquet
--config.eval.split=test, and the policy is scored before and after
training (and every eval.every_steps steps) on the first eval.num_examples
of them (128; all 1,319: --config.eval.num_examples=1319) by the run's own
rewards (eval.with_rewards; jaxrlhf/eval/pass_at_k.py): eval/pass@1, the
share whose greedy response passes (math_answer + 0.1 x format >=
eval.pass_threshold, 1: a right answer), eval/mean@4 and eval/pass@4 from 4
responses per question sampled at eval.temperature 1
(eval.samples_per_prompt, eval.pass_k: e.g. 16 and "4,16" for the unbiased
pass@4 of Chen et al. 2021), and eval/reward/math_answer, the greedy
responses' accuracy (reward/math_answer is the training one). A saved
checkpoint, without training: the same command with
--config.eval.only=True (the workdir's newest checkpoint), or with a fresh
--workdir and --config.init.policy_checkpoint=<a run's workdir or a Hugging
Face folder>.

How the step is laid out on the chips (fully sharded parameters, scanned
layers, micro-batches, rollout parts) changes no number. It is meant for a
v5e 4x4 slice: its plan (`python -m jaxrlhf.plan
--config=configs/grpo_gsm8k.py --topology=v5e:4x4`;
experiments/results/plans/grpo_gsm8k.json and the README there) needs 7.7
GiB of a chip's 16, with splash attention (model.attention_impl 'auto' on
TPU) and the rollout's log-probs formed a chunk of positions at a time.
The 7-8B sizes are planned for a v5e 4x8 slice (grpo_gsm8k_<size>.json
there); configs/grpo_gsm8k_lora.py trains them with LoRA on fewer chips.
The mixture of experts qwen3-30b-a3b (8 of 128 experts a token, the
experts fully sharded as every other weight) is planned for a v5e 8x16
slice (128 chips, mesh 32x4: 32 data-parallel groups of 4 chips, the
rollout in 4 parts of 32 prompts, 16 micro-batches): 13.44 GiB a chip
(experiments/results/plans/grpo_gsm8k_qwen3_30b_a3b.json; the README
there has the other slices and meshes tried); LoRA
(configs/grpo_gsm8k_lora.py) fits a v5e 2x4 slice.
"""

from jaxrlhf import defaults
from jaxrlhf import presets
from jaxrlhf import sharding_rules

# Size preset prefix -> model family.
# (Qwen3's mixture-of-experts sizes first: "qwen3-" would take them.)
FAMILIES = (("qwen2.5-", "qwen2"), ("qwen3-30b-a3b", "qwen3_moe"),
            ("qwen3-", "qwen3"), ("llama", "llama"), ("tinyllama", "llama"))
# Prompt and response tokens: GSM8K questions fit 256 Qwen or Llama tokens;
# worked solutions take 100 to 300.
QUESTION_TOKENS = 256
RESPONSE_TOKENS = 512
# A marked final answer, as rewards.math_answer finds it.
ANSWER_MARKED = r"\\boxed\{.+\}|####\s*\$?\s*-?[\d,]*\d(\.\d+)?"


def get_config(size: str = "qwen2.5-1.5b"):
  arch = next((a for prefix, a in FAMILIES if size.startswith(prefix)), None)
  if arch is None:
    raise ValueError(
        f"configs/grpo_gsm8k.py:{size}: choose a size preset of the qwen2 "
        "(qwen2.5-...), qwen3 (qwen3-...), qwen3_moe (qwen3-30b-a3b) or "
        "llama (llama..., tinyllama...) family.")
  c = defaults.base_config()
  c.algorithm = "grpo"
  c.model.arch = arch
  c.model.size = size
  c.model.dtype = "bfloat16"
  c.model.dropout_rate = 0.0
  local = f"/{defaults.PLACEHOLDER}"
  # A local Hugging Face folder (config.json + model.safetensors) and its
  # tokenizer.
  c.init.policy_checkpoint = f"{local}/{size}"
  c.data.files.vocabulary = f"{local}/{size}/tokenizer.json"

  # GSM8K's training questions, with their reference answers.
  c.data.task = "gsm8k"
  c.data.files.layout = "gsm8k"
  c.data.files.train = f"{local}/gsm8k/train-00000-of-00001.parquet"
  c.data.files.on_bad_row = "skip_and_report"
  c.data.inputs_length = QUESTION_TOKENS
  # (The demonstrations' length limit; GRPO samples its own responses.)
  c.data.targets_length = RESPONSE_TOKENS
  c.data.files.max_completion_tokens = RESPONSE_TOKENS
  # A question does not survive losing a paragraph: one that is too long
  # stops the run at start-up, naming it.
  c.online.long_prompts = "raise"

  # The score: verified answer + marked answer + overlong penalty.
  c.rewards.reward_model.weight = 0.0
  c.rewards.math_answer.weight = 1.0
  c.rewards.math_answer.style = "auto"
  c.rewards.math_answer.answer_column = "answer"
  c.rewards.format.weight = 0.1
  c.rewards.format.pattern = ANSWER_MARKED
  c.rewards.format.match = "search"
  c.rewards.overlong.weight = 1.0
  c.rewards.overlong.max_length = RESPONSE_TOKENS
  c.rewards.overlong.cache_length = 128
  c.rewards.on_bad_row = "raise"

  # GRPO with DAPO's changes.
  c.online.samples_per_prompt = 16
  c.online.temperature = 1.0
  c.online.max_new_tokens = RESPONSE_TOKENS
  c.online.num_epochs = 1
  c.online.num_minibatches = 4
  c.online.clip_eps = 0.2
  c.online.stop_when_done = True
  # Decoded in lockstep. The continuous engine (online.engine 'auto', the
  # default) draws the same responses and its TPU kernel compiles for
  # these chips, but it has not yet run on a TPU, and the committed plans
  # (experiments/results/plans/) were made in lockstep;
  # --config.online.engine=auto decodes with it.
  c.online.engine = "lockstep"
  c.grpo.clip_eps_high = 0.28
  c.grpo.reduction = "token_mean"
  c.grpo.scale_by_std = True
  c.grpo.kl_coef = 0.0
  c.grpo.dynamic_sampling = True
  c.grpo.max_sampling_rounds = 3

  c.train.batch_size = 128
  c.train.num_steps = 200
  c.train.log_every = 1
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-6
  c.optimizer.warmup_steps = 10
  c.optimizer.schedule = "constant"
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.01
  c.optimizer.grad_clip_norm = 1.0
  c.checkpoint.every_steps = 20
  c.checkpoint.keep = 3
  # No in-run evaluation (module docstring).
  c.eval.every_steps = 0

  # Every chip data-parallel, the parameters and optimizer state split over
  # them; meant for a v5e 4x4 slice (module docstring).
  c.mesh.shape = (-1, 1)
  c.sharding.logical_axis_rules = sharding_rules.FULLY_SHARDED_RULES
  presets.scanned_layers(c)
  c.train.num_microbatches = 8
  c.online.rollout_microbatches = 4
  if arch == "qwen3_moe":
    # For a v5e 8x16 slice (128 chips, module docstring): 32 data-parallel
    # groups of 4 chips, each group splitting the attention heads and the
    # experts' mlp dimension; the rollout in 4 parts of 32 prompts and the
    # update in micro-batches of 32 responses, one a group.
    c.mesh.shape = (-1, 4)
    c.online.rollout_microbatches = 4
    c.train.num_microbatches = 16
  return c
