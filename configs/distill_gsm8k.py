r"""On-policy distillation on GSM8K: a Qwen2.5-1.5B student samples answers
to GSM8K's questions and a frozen Qwen2.5-7B teacher scores every sampled
token; the student's per-token advantage is the negative sampled reverse KL
to the teacher (Thinking Machines' on-policy distillation; the algorithm:
jaxrlhf/algorithms/online/teacher.py).

  python -m jaxrlhf.main --config=configs/distill_gsm8k.py --workdir=/runs/distill \
      --config.init.policy_checkpoint=/models/Qwen2.5-1.5B \
      --config.distill.teacher_checkpoint=/models/Qwen2.5-7B-Instruct \
      --config.data.files.vocabulary=/models/Qwen2.5-1.5B/tokenizer.json \
      --config.data.files.train=/data/gsm8k/train-00000-of-00001.parquet

The data, the lengths, the sharding and the held-out accuracy are
configs/grpo_gsm8k.py's (its docstring). Both models read the same
tokenizer (Qwen2.5's sizes share it; another vocabulary is refused at
start-up). No reward is needed: the teacher is the signal. To add it to
GRPO's verified rewards instead (the mix of the two signals):
--config.algorithm=grpo and this config's distill fields.

Per step: 128 questions x 4 answers of up to 512 tokens at temperature 1,
one update of a token mean over them (each token answers for itself), AdamW
at 1e-6. The teacher is a frozen network of the run, sharded over the same
chips by the same rules as the student; it reads each rollout once (the
log-probs of the sampled tokens, a chunk of positions at a time). Its plan
on a v5e 4x4 slice (`python -m jaxrlhf.plan --config=configs/distill_gsm8k.py
--topology=v5e:4x4`; experiments/results/plans/distill_gsm8k.json) sizes
the 7B teacher beside the 1.5B student, with the teacher's size read from
`distill.teacher_size` when its folder is not on the planning machine.

Other pairs: `--config=configs/distill_gsm8k.py:<student>,<teacher>` with
size presets of one family (e.g. qwen3-1.7b,qwen3-8b).
"""

import importlib.util
import os

from jaxrlhf import defaults


def _grpo_gsm8k():
  """configs/grpo_gsm8k.py, beside this file."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "grpo_gsm8k.py")
  spec = importlib.util.spec_from_file_location("grpo_gsm8k", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(sizes: str = "qwen2.5-1.5b,qwen2.5-7b"):
  student, _, teacher = sizes.partition(",")
  if not teacher:
    raise ValueError(
        f"configs/distill_gsm8k.py:{sizes}: give '<student>,<teacher>' size "
        "presets of one family (e.g. qwen2.5-1.5b,qwen2.5-7b).")
  c = _grpo_gsm8k().get_config(student)
  c.algorithm = "distill"
  local = f"/{defaults.PLACEHOLDER}"
  c.distill.teacher_checkpoint = f"{local}/{teacher}"
  c.distill.teacher_size = teacher
  c.distill.mode = "advantage"
  c.distill.coef = 1.0
  c.online.samples_per_prompt = 4
  c.online.num_minibatches = 1
  # (config.rewards stays the verifier's: distillation does not train on
  # it, and the held-out accuracy reads it.)
  return c
