r"""Agents in miniature: a tool a tiny model needs, and a game it plays
over several turns.

  # each seed in its own process (in parallel), then the same command
  # with --seeds=0,1,2 gathers them (every finished run is reused):
  python experiments/agents.py --workdir=/tmp/agents --out=/tmp/o --seeds=0
  python experiments/agents.py --workdir=/tmp/agents \
      --out=experiments/results/agents --seeds=0,1,2

Both tasks use a tiny Qwen2-shaped decoder (width 64, 2 layers, from
scratch) with the Qwen 2.5 chat template and tokenizer of
tests/fixtures/tokenizers/chat_qwen (405 ids, nearly a token a character),
trained through `python -m jaxrlhf.main`:

1. multiply: "What is 123 times 456?" (two 3-digit factors whose product
   has 6 digits, so every question and every tool reply is as long and a
   digit is always copied from the same distance back). Tool SFT on
   --sft_rows tool-using conversations (layout "messages" with a "tools"
   column: the schema of `multiply` below, so the prompt shows the tool as
   online RL's episodes show it; the template's tool preamble makes the
   prompt 600 tokens): the assistant calls `multiply` in Qwen's
   <tool_call> format, the tool replies, the assistant says the number.
   Then GRPO with the stateless tool loop (`online.tools=agents:multiply`,
   up to 3 turns) and the reward `exact_answer` (1 when the final answer is
   the row's product). The baseline without tools is a model trained to
   answer directly: SFT on the same questions answered with the product,
   no tools shown, evaluated in one-turn episodes (`make_direct`). Held
   out: 32 products no stage trains on, greedy: pass@1 (eval/pass@1), tool
   calls and turns per episode, failed calls per GRPO training episode;
   and, for --decode_seed, the tool SFT model's first 8 held-out episodes
   decoded (the conversation, the parsed call, the tool's reply, the final
   answer, the product and the reward).
2. guess: tests/agent_envs.py's guess-the-number (1 to 9, "higher" /
   "lower" after a wrong guess, reward 1 when guessed). SFT on transcripts
   whose guesses are uniform among the numbers still possible, then GRPO
   on episodes of up to 4 turns, against GRPO from the same SFT checkpoint
   with single-turn episodes (max_turns=1: one guess) and against the best
   single-turn policy (every row's prompt is the same, so one guess: the
   held-out rows' most common number). Held out: solve rate (eval/pass@1)
   and turns per greedy episode.

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
         # The committed numbers were made in lockstep; the continuous
         # engine (the default) plays the same episodes up to float
         # rounding, which over a run can turn a tie into another token.
         "online.engine": "lockstep",
         "data.files.vocabulary": str(TOKENIZER / "tokenizer.json")}


def multiply(a: int, b: int) -> int:
  """Multiplies.

  Args:
    a: a factor.
    b: a factor.
  """
  return a * b


class _Direct:
  """One turn, no tools: the row's question, then the episode ends (the
  direct-answer model's episodes; `exact_answer` scores its answer)."""

  def __init__(self, row):
    self._question = row["prompt"]

  def reset(self):
    return [{"role": "user", "content": self._question}]

  def step(self, message):
    del message
    return [], 0.0, True


def make_direct(row):
  return _Direct(row)


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
  """(tool sft file, direct sft file, rl file, test file) of 3-digit
  products of 6 digits (every question and every product the same length:
  a digit is copied from a fixed distance back)."""
  from jaxrlhf.agents import tools as tools_lib  # pylint: disable=g-import-not-at-top
  schemas = tools_lib.tool_schemas([multiply])
  rng = random.Random(seed)
  pairs = set()
  while len(pairs) < sft_rows + 256 + 32:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    if a * b >= 100000:
      pairs.add((a, b))
  pairs = sorted(pairs)
  rng.shuffle(pairs)
  test, rl, sft = pairs[:32], pairs[32:288], pairs[288:]
  question = lambda a, b: f"What is {a} times {b}?"
  sft_rows_ = [{"messages": [
      {"role": "user", "content": question(a, b)}, _call(a, b),
      {"role": "tool", "content": str(a * b)},
      {"role": "assistant", "content": str(a * b)}], "tools": schemas}
               for a, b in sft]
  direct = [{"messages": [{"role": "user", "content": question(a, b)},
                          {"role": "assistant", "content": str(a * b)}]}
            for a, b in sft]
  prompts = lambda ps: [{"prompt": question(a, b), "answer": str(a * b)}
                        for a, b in ps]
  return (_write(root / "mult_sft.jsonl", sft_rows_),
          _write(root / "mult_direct_sft.jsonl", direct),
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


def run_main(workdir, overrides, log, decode_to=None):
  """`python -m jaxrlhf.main` with `overrides`; its metrics.jsonl rows.
  `decode_to`: a file to write the first greedy held-out episodes into
  (`decode_main`)."""
  metrics = pathlib.Path(workdir) / "metrics.jsonl"
  if not (pathlib.Path(workdir) / "done").exists():
    how = ([__file__, "--decode_to", str(decode_to)] if decode_to
           else ["-m", "jaxrlhf.main"])
    args = [sys.executable, *how,
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


def decode_main(path, argv, n=8):
  """`jaxrlhf.main` with argv, writing its first greedy held-out episodes
  (n of them: the conversation, the model's tokens as text, the parsed
  messages, the final answer and the row's answer) into `path` as JSON."""
  from jaxrlhf import main as main_lib  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms.online import episode_step  # pylint: disable=g-import-not-at-top
  play = episode_step.play

  def recording_play(trainer, params, rows, key, temperature,
                     row_names=None, **options):
    played, info = play(trainer, params, rows, key, temperature, row_names,
                        **options)
    if temperature == 0.0 and not pathlib.Path(path).exists():
      renderer = episode_step.agent(trainer).renderer
      pathlib.Path(path).write_text(json.dumps([{
          "model_and_environment_tokens": renderer.turn_text(e.tokens),
          "messages": e.messages, "final_answer": e.final_text,
          "row_answer": row.get("answer"),
          "exact_answer": exact_answer(None, [e.final_text],
                                       [row.get("answer")])[0]}
                                                for e, row in
                                                zip(played[:n], rows)],
                                               indent=1) + "\n")
    return played, info

  episode_step.play = recording_play
  sys.argv = ["jaxrlhf.main", *argv]
  main_lib.run()


def _evals(rows):
  return [r for r in rows if "eval/pass@1" in r]


def _mean(rows, key):
  values = [r[key] for r in rows if key in r]
  return sum(values) / len(values) if values else None


def multiply_seed(base, seed, args, log):
  """The multiply task of one seed: its results.json entry."""
  sft, direct_sft, rl, test = multiply_data(base, args.sft_rows, seed)
  sft_dir, direct_dir = base / "mult_sft", base / "mult_direct_sft"
  sft_run = {"algorithm": "sft", "seed": seed,
             "data.files.layout": "messages", "train.batch_size": 8,
             "train.num_steps": args.mult_sft_steps,
             "optimizer.learning_rate": 3e-3, "optimizer.warmup_steps": 20}
  # The longest prompt (before the answer) is 713 tokens, the longest
  # reply (the call, nearly a token a character) 73.
  run_main(sft_dir, dict(sft_run, **{
      "data.task": "mult_sft", "data.files.train": sft,
      "data.inputs_length": 720, "data.targets_length": 80}), log)
  run_main(direct_dir, dict(sft_run, **{
      "data.task": "mult_direct_sft", "data.files.train": direct_sft,
      "data.inputs_length": 64, "data.targets_length": 8,
      "train.num_steps": args.direct_sft_steps}), log)
  eval_rl, tool_rl = multiply_rl(base, seed, rl, test)
  rows = run_main(base / "mult_grpo", dict(
      tool_rl, **{"train.num_steps": args.mult_rl_steps}), log)
  before, after = _evals(rows)[0], _evals(rows)[-1]
  decoded = None
  if seed == args.decode_seed:
    decoded = decode_tool_sft(base, tool_rl, log)
  # The direct-answer model: one turn, no tools offered (its episodes
  # are `make_direct`'s), read before its one training step.
  alone = _evals(run_main(base / "mult_direct_eval", dict(eval_rl, **{
      "init.policy_checkpoint": str(direct_dir),
      "data.inputs_length": 64, "data.targets_length": 8,
      "online.environment": "agents:make_direct", "online.max_turns": 1,
      "online.max_new_tokens": 8, "online.max_episode_tokens": 8,
      "train.num_steps": 1}), log))[0]
  return {
      "tool_sft_with_tools_pass@1": before["eval/pass@1"],
      "grpo_with_tools_pass@1": after["eval/pass@1"],
      "direct_sft_without_tools_pass@1": alone["eval/pass@1"],
      "tool_sft_tool_calls_per_episode": before["eval/episode/tool_calls"],
      "grpo_tool_calls_per_episode": after["eval/episode/tool_calls"],
      "tool_sft_turns_per_episode": before["eval/episode/turns"],
      "grpo_turns_per_episode": after["eval/episode/turns"],
      "grpo_train_tool_calls_per_episode": _mean(rows, "episode/tool_calls"),
      "grpo_train_failed_calls_per_episode": _mean(
          rows, "episode/failed_calls"),
      "tool_sft_final_token_accuracy": _last(base / "mult_sft",
                                             "token_accuracy"),
      "direct_sft_final_token_accuracy": _last(direct_dir, "token_accuracy"),
      **({"tool_sft_decoded_held_out_episodes": decoded} if decoded else {}),
  }


def multiply_rl(base, seed, rl, test):
  """(the held-out evaluation's overrides, GRPO's with the tool from the
  tool SFT checkpoint) of the multiply task."""
  eval_rl = {
      "algorithm": "grpo", "seed": seed, "data.task": "mult_rl",
      "data.files.train": rl, "data.files.test": test,
      "data.files.column_mapping": "prompt=prompt,answer=answer",
      "online.samples_per_prompt": 4, "online.temperature": 1.0,
      "train.batch_size": 8, "rewards.reward_model.weight": 0.0,
      "rewards.functions": "agents:exact_answer=1",
      "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 0,
      "eval.split": "test", "eval.num_examples": 32,
      "eval.batch_size": 32, "eval.samples_per_prompt": 0}
  tool_rl = dict(eval_rl, **{
      "init.policy_checkpoint": str(base / "mult_sft"),
      "data.inputs_length": 608, "data.targets_length": 80,
      "online.tools": "agents:multiply", "online.max_turns": 3,
      "online.max_new_tokens": 80, "online.max_episode_tokens": 192})
  return eval_rl, tool_rl


def decode_tool_sft(base, tool_rl, log):
  """What the tool SFT model does on held-out rows: its first 8 greedy
  episodes (`decode_main`), from a run of one step that is not used."""
  path = base / "mult_sft_decoded.json"
  run_main(base / "mult_sft_decode", dict(tool_rl, **{
      "train.num_steps": 1, "eval.num_examples": 8, "eval.batch_size": 8}),
           log, decode_to=path)
  return json.loads(path.read_text())


def guess_seed(base, seed, args, log):
  """The guess-the-number task of one seed: its results.json entry."""
  sft, rl, test = guess_data(base, args.sft_rows, seed)
  sft_dir = base / "guess_sft"
  run_main(sft_dir, {
      "algorithm": "sft", "seed": seed, "data.task": "guess_sft",
      "data.files.train": sft, "data.files.layout": "messages",
      "data.inputs_length": 256, "data.targets_length": 8,
      "train.batch_size": 16, "train.num_steps": args.guess_sft_steps,
      "optimizer.learning_rate": 3e-3, "optimizer.warmup_steps": 20}, log)
  game = {
      "algorithm": "grpo", "seed": seed, "data.task": "guess_rl",
      "init.policy_checkpoint": str(sft_dir), "data.files.train": rl,
      "data.files.test": test,
      "data.files.column_mapping": "prompt=prompt,answer=answer",
      "data.inputs_length": 64, "data.targets_length": 8,
      "online.environment": "agent_envs:make_guess",
      "online.max_new_tokens": 6, "online.max_episode_tokens": 96,
      "online.samples_per_prompt": 4, "online.temperature": 1.0,
      "train.batch_size": 8, "train.num_steps": args.guess_rl_steps,
      "rewards.reward_model.weight": 0.0,
      "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 0,
      "eval.split": "test", "eval.num_examples": 32,
      "eval.batch_size": 32, "eval.samples_per_prompt": 0}
  secrets = [json.loads(line)["answer"] for line in open(test)]
  multi = _evals(run_main(base / "guess_multi_turn", dict(
      game, **{"online.max_turns": 4}), log))
  single = _evals(run_main(base / "guess_single_turn", dict(
      game, **{"online.max_turns": 1}), log))
  return {
      "sft_4_turns_solved": multi[0]["eval/pass@1"],
      "grpo_4_turns_solved": multi[-1]["eval/pass@1"],
      "sft_4_turns_turns_per_episode": multi[0]["eval/episode/turns"],
      "grpo_4_turns_turns_per_episode": multi[-1]["eval/episode/turns"],
      "sft_1_turn_solved": single[0]["eval/pass@1"],
      "grpo_1_turn_solved": single[-1]["eval/pass@1"],
      # Every row's prompt is the same, so a single-turn policy guesses
      # one number (or draws from one distribution) for all rows: at best
      # the held-out rows' most common number.
      "best_single_turn_solved": max(secrets.count(g) for g in secrets)
                                 / len(secrets),
  }


def _last(workdir, key):
  rows = [json.loads(line) for line in open(pathlib.Path(workdir)
                                             / "metrics.jsonl")]
  return _mean([r for r in rows if key in r][-1:], key)


def summarize(results):
  """{task: {metric: {"mean", "per_seed"}}} over the seeds."""
  seeds = sorted(results["seeds"])
  out = {}
  for task in ("multiply", "guess"):
    done = [s for s in seeds if task in results["seeds"][s]]
    if not done:
      continue
    out[task] = {"seeds": done}
    for key in results["seeds"][done[0]][task]:
      values = [results["seeds"][s][task].get(key, []) for s in done]
      if any(isinstance(v, list) for v in values):
        continue  # the decoded episodes of one seed
      out[task][key] = {
          "mean": round(sum(values) / len(values), 4)
                  if None not in values else None,
          "per_seed": [None if v is None else round(v, 4) for v in values]}
  return out


def write_readme(results, path):
  """README.md from results.json alone."""
  s, settings = results["summary"], results["settings"]
  f = lambda m: ("" if m is None else f"{m['mean']:.3f} ("
                 + ", ".join(f"{v:.3f}" for v in m["per_seed"]) + ")")
  lines = [
      "# Agents in miniature", "", "Made by:", "", "```",
      results["command"], "```", "",
      "(each seed was run by its own process with `--seeds=N`; the command "
      "above gathered them, re-running nothing). Settings: "
      + ", ".join(f"{k} {v}" for k, v in settings.items()) + ". Wall "
      "minutes per run (3 seeds' runs shared 2 loaded CPU cores): "
      + ", ".join(f"{k} {v}" for k, v in results["minutes"].items())
      + f"; {results['run_minutes']} in all.", "",
      "Tiny Qwen2-shaped decoder (width 64, 2 layers, from scratch) with the "
      "Qwen 2.5 template (tests/fixtures/tokenizers/chat_qwen); 32 held-out "
      "rows per task and seed, greedy episodes. Each cell: the mean over "
      "the seeds, then the seeds' values in seed order.", ""]
  if "multiply" in s:
    m = s["multiply"]
    lines += [
        f"## multiply (seeds {m['seeds']}): 6-digit products of 3-digit "
        "numbers", "",
        "| | held-out pass@1 | tool calls / episode | turns / episode |",
        "|---|---|---|---|",
        "| tool SFT, with the `multiply` tool (up to 3 turns) | "
        f"{f(m['tool_sft_with_tools_pass@1'])} | "
        f"{f(m['tool_sft_tool_calls_per_episode'])} | "
        f"{f(m['tool_sft_turns_per_episode'])} |",
        f"| tool SFT then GRPO, with the tool | "
        f"{f(m['grpo_with_tools_pass@1'])} | "
        f"{f(m['grpo_tool_calls_per_episode'])} | "
        f"{f(m['grpo_turns_per_episode'])} |",
        "| direct-answer SFT, no tool (1 turn) | "
        f"{f(m['direct_sft_without_tools_pass@1'])} | | |", "",
        "GRPO's training episodes: "
        f"{f(m['grpo_train_tool_calls_per_episode'])} tool calls and "
        f"{f(m['grpo_train_failed_calls_per_episode'])} failed calls per "
        "episode (mean over logged steps). SFT token accuracy at the last "
        f"logged step: tool SFT {f(m['tool_sft_final_token_accuracy'])}, "
        f"direct SFT {f(m['direct_sft_final_token_accuracy'])}.", ""]
    for seed, r in results["seeds"].items():
      decoded = r.get("multiply", {}).get(
          "tool_sft_decoded_held_out_episodes")
      if not decoded:
        continue
      lines += [
          f"The tool SFT model's first {len(decoded)} greedy held-out "
          f"episodes (seed {seed}; results.json has the whole text):", "",
          "| question | its first turn, as written | the reply to it | "
          "final answer | "
          "product | exact_answer |", "|---|---|---|---|---|---|"]
      for e in decoded:
        ms = e["messages"]
        first = e["model_and_environment_tokens"].split("<|im_start|>")[0]
        reply = next((m["content"] for m in ms if m["role"] == "tool"), "")
        lines.append(f"| {ms[0]['content']} | {first.strip()!r} | {reply} | "
                     f"{e['final_answer'][:24]!r} | {e['row_answer']} | "
                     f"{e['exact_answer']:.0f} |")
      lines.append("")
  if "guess" in s:
    g = s["guess"]
    lines += [
        f"## guess the number (seeds {g['seeds']}): 1 to 9, higher/lower "
        "replies", "",
        "| | solved (held-out pass@1) | turns / episode |",
        "|---|---|---|",
        f"| SFT, up to 4 turns | {f(g['sft_4_turns_solved'])} | "
        f"{f(g['sft_4_turns_turns_per_episode'])} |",
        f"| SFT then GRPO, up to 4 turns | {f(g['grpo_4_turns_solved'])} | "
        f"{f(g['grpo_4_turns_turns_per_episode'])} |",
        f"| SFT, single turn | {f(g['sft_1_turn_solved'])} | 1 |",
        f"| SFT then GRPO, single turn (max_turns=1) | "
        f"{f(g['grpo_1_turn_solved'])} | 1 |",
        "| best single-turn policy (the held-out rows' most common "
        f"number, computed) | {f(g['best_single_turn_solved'])} | 1 |",
        "", "(In expectation over the rows any single guess solves 1/9 = "
        f"{results['expected_single_guess_solved']:.3f}.)", ""]
  path.write_text("\n".join(lines))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--tasks", default="guess,multiply")
  parser.add_argument("--sft_rows", type=int, default=400)
  parser.add_argument("--mult_sft_steps", type=int, default=400)
  parser.add_argument("--direct_sft_steps", type=int, default=400)
  parser.add_argument("--guess_sft_steps", type=int, default=300)
  parser.add_argument("--mult_rl_steps", type=int, default=10)
  parser.add_argument("--guess_rl_steps", type=int, default=20)
  parser.add_argument("--decode_seed", type=int, default=0,
                      help="the seed whose tool SFT episodes are decoded")
  args = parser.parse_args()
  root = pathlib.Path(args.workdir)
  root.mkdir(parents=True, exist_ok=True)
  log, results = {}, {"command": " ".join(["python", "experiments/agents.py"]
                                          + sys.argv[1:]), "seeds": {}}
  started = time.time()
  tasks = {"guess": guess_seed, "multiply": multiply_seed}
  for seed in [int(s) for s in args.seeds.split(",")]:
    base = root / f"seed{seed}"
    base.mkdir(exist_ok=True)
    results["seeds"][seed] = {
        task: tasks[task](base, seed, args, log)
        for task in args.tasks.split(",")}
  results["summary"] = summarize(results)
  results["expected_single_guess_solved"] = round(1 / 9, 4)
  results["minutes"] = {k.replace(str(root) + "/", ""): v
                        for k, v in log.items()}
  results["run_minutes"] = round(sum(log.values()), 2)
  results["total_minutes"] = round((time.time() - started) / 60, 2)
  results["settings"] = {k: getattr(args, k) for k in (
      "sft_rows", "mult_sft_steps", "direct_sft_steps", "guess_sft_steps",
      "mult_rl_steps", "guess_rl_steps")}
  outdir = pathlib.Path(args.out)
  outdir.mkdir(parents=True, exist_ok=True)
  (outdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  write_readme(results, outdir / "README.md")
  print(json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
  if sys.argv[1:2] == ["--decode_to"]:
    decode_main(sys.argv[2], sys.argv[3:])
  else:
    main()
