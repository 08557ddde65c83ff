r"""Agents in miniature: a tool a tiny model needs, and a game it plays
over several turns.

  python experiments/agents.py --workdir=/tmp/agents \
      --out=experiments/results/agents

Both tasks use a tiny Qwen2-shaped decoder (width 64, 2 layers, from
scratch) with the Qwen 2.5 chat template and tokenizer of
tests/fixtures/tokenizers/chat_qwen, trained through `python -m
jaxrlhf.main`:

1. multiply: "What is 123 times 456?" (two 3-digit factors). SFT on
   --sft_rows tool-using conversations (layout "messages" with a "tools"
   column: the `multiply` schema of tests/agent_envs.py, so the prompt
   shows the tool as the episodes of online RL show it): the assistant
   calls `multiply` in Qwen's <tool_call> format, the tool replies, the
   assistant says the number. Then GRPO with the stateless tool loop
   (`online.tools=agent_envs:multiply`, up to 3 turns) and the reward
   `exact_answer` below (1 when the final answer is the row's product).
   Held out: 32 products no stage trains on, greedy; "with tools" is the
   held-out episodes' pass@1 (eval/pass@1), "without" the same checkpoint
   with `online.max_turns=1` (its first message is its answer: a tool call
   gets no reply), tool calls per episode (eval/episode/tool_calls) and
   failed calls per training episode (episode/failed_calls).
2. guess: tests/agent_envs.py's guess-the-number (1 to 9, "higher" /
   "lower" after a wrong guess, reward 1 when guessed). SFT on transcripts
   whose guesses are uniform among the numbers still possible, then GRPO
   on episodes of up to 4 turns, against GRPO from the same SFT checkpoint
   with single-turn episodes (max_turns=1: one guess). Held out: solve
   rate (eval/pass@1) and turns per greedy episode.

Writes results.json and README.md (from results.json alone) into --out.
"""

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "chat_qwen"
MODEL = {"model.arch": "qwen2", "model.size": "tiny", "model.emb_dim": 64,
         "model.num_heads": 2, "model.head_dim": 32, "model.mlp_dim": 128,
         "model.num_decoder_layers": 2, "pipeline.stages": "",
         "train.log_every": 10,
         "data.files.vocabulary": str(TOKENIZER / "tokenizer.json")}


def exact_answer(prompts, completions, answer, **unused):
  """1.0 when the completion (stripped) is the row's answer, else 0.0."""
  del prompts, unused
  return [float(c.strip() == str(a).strip())
          for c, a in zip(completions, answer)]


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _call(a, b):
  return {"role": "assistant", "content": "", "tool_calls": [{
      "type": "function", "function": {"name": "multiply",
                                       "arguments": {"a": a, "b": b}}}]}


def multiply_data(root, sft_rows, seed):
  """(sft file, rl file, test file) of 3-digit products."""
  import agent_envs  # pylint: disable=g-import-not-at-top
  from jaxrlhf.agents import tools as tools_lib  # pylint: disable=g-import-not-at-top
  schemas = tools_lib.tool_schemas([agent_envs.multiply])
  rng = random.Random(seed)
  pairs = set()
  while len(pairs) < sft_rows + 256 + 32:
    pairs.add((rng.randint(100, 999), rng.randint(100, 999)))
  pairs = sorted(pairs)
  rng.shuffle(pairs)
  test, rl, sft = pairs[:32], pairs[32:288], pairs[288:]
  question = lambda a, b: f"What is {a} times {b}?"
  sft_rows_ = [{"messages": [
      {"role": "user", "content": question(a, b)}, _call(a, b),
      {"role": "tool", "content": str(a * b)},
      {"role": "assistant", "content": str(a * b)}], "tools": schemas}
               for a, b in sft]
  prompts = lambda ps: [{"prompt": question(a, b), "answer": str(a * b)}
                        for a, b in ps]
  return (_write(root / "mult_sft.jsonl", sft_rows_),
          _write(root / "mult_rl.jsonl", prompts(rl)),
          _write(root / "mult_test.jsonl", prompts(test)))


def guess_data(root, sft_rows, seed):
  """(sft file, rl file, test file) of guess-the-number."""
  rng = random.Random(seed + 1)
  rows = []
  for _ in range(sft_rows):
    secret, low, high = rng.randint(1, 9), 1, 9
    messages = [{"role": "user", "content": "Guess my number, 1 to 9."}]
    while True:
      guess = rng.randint(low, high)
      messages.append({"role": "assistant", "content": str(guess)})
      if guess == secret:
        break
      if guess < secret:
        low = guess + 1
      else:
        high = guess - 1
      messages.append({"role": "user",
                       "content": "higher" if guess < secret else "lower"})
    rows.append({"messages": messages})
  prompts = lambda n: [{"prompt": "guess", "answer": str(rng.randint(1, 9))}
                       for _ in range(n)]
  return (_write(root / "guess_sft.jsonl", rows),
          _write(root / "guess_rl.jsonl", prompts(256)),
          _write(root / "guess_test.jsonl", prompts(32)))


def run_main(workdir, overrides, log):
  """`python -m jaxrlhf.main` with `overrides`; its metrics.jsonl rows."""
  metrics = pathlib.Path(workdir) / "metrics.jsonl"
  if not (pathlib.Path(workdir) / "done").exists():
    args = [sys.executable, "-m", "jaxrlhf.main",
            "--config=configs/quickstart.py", f"--workdir={workdir}",
            *[f"--config.{k}={v}" for k, v in {**MODEL, **overrides}.items()]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "tests"), str(REPO / "experiments")]))
    start = time.time()
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True,
                            text=True)
    if result.returncode:
      raise SystemExit(f"{workdir} failed:\n{result.stderr[-4000:]}")
    log[str(workdir)] = round((time.time() - start) / 60, 2)
    (pathlib.Path(workdir) / "done").write_text(str(log[str(workdir)]))
  else:
    log[str(workdir)] = float((pathlib.Path(workdir) / "done").read_text())
  return [json.loads(line) for line in open(metrics)]


def _evals(rows):
  return [r for r in rows if "eval/pass@1" in r]


def _mean(rows, key):
  values = [r[key] for r in rows if key in r]
  return sum(values) / len(values) if values else None


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--sft_rows", type=int, default=400)
  parser.add_argument("--sft_steps", type=int, default=300)
  parser.add_argument("--rl_steps", type=int, default=20)
  args = parser.parse_args()
  root = pathlib.Path(args.workdir)
  root.mkdir(parents=True, exist_ok=True)
  log, results = {}, {"command": " ".join(["python", "experiments/agents.py"]
                                          + sys.argv[1:]), "seeds": {}}
  started = time.time()
  for seed in [int(s) for s in args.seeds.split(",")]:
    out = results["seeds"][seed] = {}
    base = root / f"seed{seed}"
    base.mkdir(exist_ok=True)
    # --- multiply -------------------------------------------------------
    sft, rl, test = multiply_data(base, args.sft_rows, seed)
    sft_dir = base / "mult_sft"
    run_main(sft_dir, {
        "algorithm": "sft", "seed": seed, "data.task": "mult_sft",
        "data.files.train": sft, "data.files.layout": "messages",
        "data.inputs_length": 768, "data.targets_length": 80,
        "train.batch_size": 16, "train.num_steps": args.sft_steps,
        "optimizer.learning_rate": 3e-3}, log)
    tool_rl = {
        "algorithm": "grpo", "seed": seed, "data.task": "mult_rl",
        "init.policy_checkpoint": str(sft_dir), "data.files.train": rl,
        "data.files.test": test,
        "data.files.column_mapping": "prompt=prompt,answer=answer",
        "data.inputs_length": 704, "data.targets_length": 80,
        "online.tools": "agent_envs:multiply", "online.max_turns": 3,
        "online.max_new_tokens": 80, "online.max_episode_tokens": 192,
        "online.samples_per_prompt": 4, "online.temperature": 1.0,
        "train.batch_size": 8, "rewards.reward_model.weight": 0.0,
        "rewards.functions": "agents:exact_answer=1",
        "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 0,
        "eval.split": "test", "eval.num_examples": 32,
        "eval.batch_size": 32, "eval.samples_per_prompt": 0}
    rows = run_main(base / "mult_grpo", dict(
        tool_rl, **{"train.num_steps": args.rl_steps}), log)
    before, after = _evals(rows)[0], _evals(rows)[-1]
    alone = _evals(run_main(base / "mult_single_turn", dict(
        tool_rl, **{"train.num_steps": 1, "online.max_turns": 1}), log))[0]
    out["multiply"] = {
        "sft_with_tools_pass@1": before["eval/pass@1"],
        "sft_without_tools_pass@1": alone["eval/pass@1"],
        "grpo_with_tools_pass@1": after["eval/pass@1"],
        "sft_tool_calls_per_episode": before["eval/episode/tool_calls"],
        "grpo_tool_calls_per_episode": after["eval/episode/tool_calls"],
        "sft_turns_per_episode": before["eval/episode/turns"],
        "grpo_turns_per_episode": after["eval/episode/turns"],
        "grpo_train_failed_calls_per_episode": _mean(
            rows, "episode/failed_calls"),
        "grpo_train_tool_calls_per_episode": _mean(rows, "episode/tool_calls"),
    }
    # --- guess the number -------------------------------------------------
    sft, rl, test = guess_data(base, args.sft_rows, seed)
    sft_dir = base / "guess_sft"
    run_main(sft_dir, {
        "algorithm": "sft", "seed": seed, "data.task": "guess_sft",
        "data.files.train": sft, "data.files.layout": "messages",
        "data.inputs_length": 256, "data.targets_length": 8,
        "train.batch_size": 16, "train.num_steps": args.sft_steps,
        "optimizer.learning_rate": 3e-3}, log)
    game = {
        "algorithm": "grpo", "seed": seed, "data.task": "guess_rl",
        "init.policy_checkpoint": str(sft_dir), "data.files.train": rl,
        "data.files.test": test,
        "data.files.column_mapping": "prompt=prompt,answer=answer",
        "data.inputs_length": 64, "data.targets_length": 8,
        "online.environment": "agent_envs:make_guess",
        "online.max_new_tokens": 6, "online.max_episode_tokens": 96,
        "online.samples_per_prompt": 4, "online.temperature": 1.0,
        "train.batch_size": 8, "train.num_steps": args.rl_steps,
        "rewards.reward_model.weight": 0.0,
        "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 0,
        "eval.split": "test", "eval.num_examples": 32,
        "eval.batch_size": 32, "eval.samples_per_prompt": 0}
    multi = _evals(run_main(base / "guess_multi_turn", dict(
        game, **{"online.max_turns": 4}), log))
    single = _evals(run_main(base / "guess_single_turn", dict(
        game, **{"online.max_turns": 1}), log))
    out["guess"] = {
        "sft_4_turns_solved": multi[0]["eval/pass@1"],
        "grpo_4_turns_solved": multi[-1]["eval/pass@1"],
        "grpo_4_turns_turns_per_episode": multi[-1]["eval/episode/turns"],
        "sft_1_turn_solved": single[0]["eval/pass@1"],
        "grpo_1_turn_solved": single[-1]["eval/pass@1"],
    }
  results["minutes"] = log
  results["total_minutes"] = round((time.time() - started) / 60, 2)
  results["settings"] = {k: getattr(args, k) for k in (
      "sft_rows", "sft_steps", "rl_steps")}
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  (outdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
