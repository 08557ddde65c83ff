r"""Ahead-of-time plans of the committed configs on their TPU slices, and of
the headline run's memory options (`jaxrlhf.plan`).

  pip install -e ".[tpu-plan]"
  python experiments/plan_configs.py --out=experiments/results/plans
  python experiments/plan_configs.py --out=experiments/results/plans/options \
      --only=dro_t5xl --options=all

Writes `<name>.json` per config (the plan as `python -m jaxrlhf.plan
--config=... --topology=...` prints it) and, with --options, one JSON per
variant of the chosen configs (`OPTIONS`: sharding rules x scanned layers x
remat policy x micro-batches), then `plans.md`: a table of everything in
--out. Every
plan is a compilation of the real train step for the slice's chips on
this CPU host; one process plans them all, one after the other.
"""

import argparse
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (config file[:argument], TPU slice). The paper configs run on the
# slice their mesh names; the TL;DR pipeline's (mesh (-1, 1): every chip
# data-parallel) is planned for 8 chips, the paper's 8 GPUs.
CONFIGS = {
    "dro_t5xl": ("configs/dro_t5xl.py", "v5e:4x8"),
    "dro_t5l": ("configs/dro_t5l.py", "v5e:4x4"),
    "kto": ("configs/kto.py", "v5e:4x4"),
    "kto_xl": ("configs/kto.py:xl", "v5e:4x8"),
    "dpo": ("configs/dpo.py", "v5e:4x4"),
    "ipo": ("configs/ipo.py", "v5e:4x4"),
    "slic": ("configs/slic.py", "v5e:4x4"),
    "reward_model": ("configs/reward_model.py", "v5e:4x4"),
    "ppo_t5xl": ("configs/ppo_t5xl.py", "v5e:4x8"),
    "tldr_pythia_sft": ("configs/tldr_pythia_sft.py", "v5e:2x4"),
    "tldr_pythia_rm": ("configs/tldr_pythia_rm.py", "v5e:2x4"),
    "tldr_pythia_dpo": ("configs/tldr_pythia_dpo.py", "v5e:2x4"),
    "tldr_pythia_ppo": ("configs/tldr_pythia_ppo.py", "v5e:2x4"),
    # GRPO (DAPO's settings) on GSM8K from Qwen2.5-1.5B: 128 questions x 16
    # responses of 512 tokens per step.
    "grpo_gsm8k": ("configs/grpo_gsm8k.py", "v5e:4x4"),
    # The same recipe for 7-8B models, full fine-tuning beside LoRA (rank 16
    # on every projection), each on the smallest slice that holds it.
    "grpo_gsm8k_llama3.1_8b": ("configs/grpo_gsm8k.py:llama3.1-8b",
                               "v5e:4x8"),
    "grpo_gsm8k_qwen2.5_7b": ("configs/grpo_gsm8k.py:qwen2.5-7b", "v5e:4x8"),
    "grpo_gsm8k_lora_llama3.1_8b": ("configs/grpo_gsm8k_lora.py:llama3.1-8b",
                                    "v5e:2x2"),
    "grpo_gsm8k_lora_qwen2.5_7b": ("configs/grpo_gsm8k_lora.py:qwen2.5-7b",
                                   "v5e:2x2"),
    # The mixture of experts Qwen3-30B-A3B (128 experts, 8 per token):
    # full fine-tuning (mesh 32x4) and LoRA.
    "grpo_gsm8k_qwen3_30b_a3b": ("configs/grpo_gsm8k.py:qwen3-30b-a3b",
                                 "v5e:8x16"),
    "grpo_gsm8k_lora_qwen3_30b_a3b": (
        "configs/grpo_gsm8k_lora.py:qwen3-30b-a3b", "v5e:2x4"),
    # On-policy distillation: a Qwen2.5-1.5B student, a frozen 7B teacher
    # sharded beside it on the same chips.
    "distill_gsm8k": ("configs/distill_gsm8k.py", "v5e:4x4"),
    # DRO-V on T5-XL with LoRA adapters for the policy and the value network.
    "dro_t5xl_lora": ("configs/dro_t5xl.py:lora", "v5e:2x2"),
}

# The options compared for a config (--options): name -> (sharding rules,
# scanned layers, remat policy, micro-batches, mesh shape or None for the
# config's). Unrolled T5-XL steps take about 20 minutes each to compile on a
# host CPU, scanned ones 3 to 5.
OPTIONS = {
    "standard-unrolled-none": ("standard", False, "none", 1, None),
    "standard-unrolled-none-2micro": ("standard", False, "none", 2, None),
    "standard-unrolled-dots": ("standard", False, "dots_saveable", 1, None),
    "standard-unrolled-full": ("standard", False, "full", 1, None),
    "standard-scan-none": ("standard", True, "none", 1, None),
    "standard-scan-dots": ("standard", True, "dots_saveable", 1, None),
    "standard-scan-dots-2micro": ("standard", True, "dots_saveable", 2, None),
    "standard-scan-full": ("standard", True, "full", 1, None),
    "standard-scan-full-8x4": ("standard", True, "full", 1, (8, 4)),
    "standard-scan-full-2micro": ("standard", True, "full", 2, None),
    "fully_sharded-scan-dots": ("fully_sharded", True, "dots_saveable", 1,
                                None),
    "fully_sharded-scan-dots-2micro": ("fully_sharded", True,
                                       "dots_saveable", 2, None),
    "fully_sharded-scan-dots-2micro-8x4": ("fully_sharded", True,
                                           "dots_saveable", 2, (8, 4)),
    "fully_sharded-scan-full": ("fully_sharded", True, "full", 1, None),
}


def option_overrides(name: str):
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  rules, scan, remat, micro, mesh = OPTIONS[name]
  overrides = {"sharding.logical_axis_rules": {
                   "standard": sharding_rules.STANDARD_RULES,
                   "fully_sharded": sharding_rules.FULLY_SHARDED_RULES
               }[rules],
               "model.scan_layers": scan, "model.remat_policy": remat,
               "train.num_microbatches": micro}
  if mesh is not None:
    overrides["mesh.shape"] = mesh
  return overrides


def _load(spec: str):
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  path, _, arg = spec.partition(":")
  return defaults.load_config_file(REPO / path, arg or None)


def _summary_row(name: str, plan) -> str:
  m = plan["memory_gib_per_chip"]
  total = m.get("total")
  model = plan["model"]
  fits = {True: "yes", False: "**no**", None: "-"}[plan["fits"]]
  memory = (f"{total:.2f}" if total is not None else
            f"> {plan.get('chip', {}).get('hbm_gib', '?')} (temporaries "
            f"{m.get('temporaries', 0):.1f})")
  return (f"| {name} | {plan['algorithm']} | {model['arch']} "
          f"{model['size']} | {plan['topology']} | "
          f"{'x'.join(str(v) for v in plan['mesh'].values())} | "
          f"{model['remat_policy']} | {'yes' if model['scan_layers'] else 'no'} "
          f"| {plan['num_microbatches']} | {memory} | "
          f"{sum(plan['train_state_gib_per_chip'].values()):.2f} | {fits} | "
          f"{plan['flops_per_chip_per_step'] / 1e12:.2f} | "
          f"{plan.get('step_time_lower_bound_s', 0) * 1e3:.0f} | "
          f"{plan['compile_seconds']:.0f} |")


def write_table(out: pathlib.Path) -> None:
  rows = []
  for path in sorted(out.glob("*.json")):
    plan = json.loads(path.read_text())
    rows.append(_summary_row(path.stem, plan))
  header = (
      "| plan | algorithm | model | slice | mesh | remat | scanned | "
      "micro-batches | memory/chip GiB | state/chip GiB | fits with 2 GiB "
      "free | TFLOP/chip/step | step >= ms | compile s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  (out / "plans.md").write_text(header + "\n" + "\n".join(rows) + "\n")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--only", default="",
                 help="comma-separated names of CONFIGS (default: all)")
  p.add_argument("--options", default="",
                 help="'all' or comma-separated names of OPTIONS: plan "
                 "these variants of the chosen configs instead of the "
                 "configs as committed")
  p.add_argument("--skip_existing", action="store_true")
  args = p.parse_args()
  names = args.only.split(",") if args.only else list(CONFIGS)
  unknown = sorted(set(names) - set(CONFIGS))
  if unknown:
    sys.exit(f"error: --only: unknown {unknown}; choose from {list(CONFIGS)}")
  sys.path.insert(0, str(REPO))
  from jaxrlhf import plan as plan_lib  # pylint: disable=g-import-not-at-top
  plan_lib.prepare_platform("tpu")
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  devices = {}
  for name in names:
    spec, topology = CONFIGS[name]
    chosen = args.options.split(",") if args.options != "all" else OPTIONS
    variants = ({f"{name}.{k}": option_overrides(k) for k in chosen}
                if args.options else {name: {}})
    for label, overrides in variants.items():
      target = out / f"{label}.json"
      if args.skip_existing and target.exists():
        continue
      config = _load(spec)
      defaults.apply_overrides(config, overrides)
      if topology not in devices:
        devices[topology] = plan_lib.topology_devices(topology)
      try:
        plan = plan_lib.make_plan(config, devices[topology],
                                  topology=topology)
      except ValueError as e:
        print(f"{label}: {e}", flush=True)
        continue
      plan["config"] = spec
      if args.options:
        plan["option"] = label.split(".", 1)[1]
      target.write_text(json.dumps(plan, indent=1) + "\n")
      print(f"== {label}\n{plan_lib.describe(plan)}", flush=True)
  write_table(out)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
