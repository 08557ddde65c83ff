r"""Multi-turn agent episodes: tokens/s against one long turn, the share of
time spent waiting on environments, and what extending the KV cache saves.

  python experiments/bench_agents.py                # CPU, tiny Llama
  python experiments/bench_agents.py --episodes=32 --turns=8 --json=out.json

One randomly initialised tiny Llama (bench_sampling.py's preset) with the
vocabulary of tests/fixtures/tokenizers/chat_qwen (Qwen 2.5's template)
plays `--episodes` (B) episodes of `--turns` (N) turns against an
environment that answers every turn with the same short user message and
never ends the episode (it ends at N turns). To stand in for a trained
policy, the model's end-of-turn logit is set at every step so that it is
drawn with probability `--eos_prob` at temperature 1 (bench_rollout.py's
`ending_at_rate`): turn lengths are geometric, capped at `--turn_tokens`.

  single-turn  `sampling.sample_decoder_only` on the same openings with
               max_new_tokens = the episode budget (N * (turn_tokens +
               the environment's block)), the end-of-turn id never drawn
               (the plain model): B * budget tokens;
  multi-turn   `run_episodes` with `TurnPolicy(extend_cache=True)`: tokens
               are every conversation's ids after its opening (the model's
               and the environment's);
  re-prefill   the same episodes with `extend_cache=False` (checked to
               draw the same tokens);
  env wait     the multi-turn run with an environment whose step sleeps
               `--env_sleep_ms`: `env_seconds / total` (steps of all
               episodes in parallel threads);
  continuous   the same slow environment, the episodes on `--slots` decode
               slots (`agents.continuous`, each count of slots in turn,
               chunks returning on a turn's end, then chunks of
               `--chunk_steps`): a turn that ends frees its slot while its
               environment sleeps and the other slots decode; tokens/s,
               slot occupancy (the lockstep's: its model tokens / decode
               steps x B), the time
               the device waited on environments and the time hidden
               behind decoding, and the wall time against the lockstep
               run of section env wait (the same episodes, drawn as the
               lockstep loop draws them: `same_tokens_as_lockstep`); with
               `--engine_pages`, a pool of that many pages (of 16
               positions) instead of every episode at its longest:
               episodes are preempted and prefilled again when it runs
               short (the count reported; the episodes checked to be the
               unpreempted ones of the first continuous run).

Each figure is the fastest of `--repeats` runs after a first, compiling one
(reported apart as compile seconds: the first run less the fastest).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_rollout  # noqa: E402
import bench_sampling  # noqa: E402
from jaxrlhf import console  # noqa: E402
from jaxrlhf.agents import continuous  # noqa: E402
from jaxrlhf.agents import episodes  # noqa: E402
from jaxrlhf.agents import policies  # noqa: E402
from jaxrlhf.data import chat_templates  # noqa: E402
from jaxrlhf.data import hf_tokenizer  # noqa: E402
from jaxrlhf.models import sampling  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "tests",
                         "fixtures", "tokenizers", "chat_qwen",
                         "tokenizer.json")


def _parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--episodes", type=int, default=8, help="B")
  p.add_argument("--turns", type=int, default=4, help="N, turns an episode")
  p.add_argument("--turn_tokens", type=int, default=32,
                 help="a turn's most tokens (max_turn_tokens)")
  p.add_argument("--eos_prob", type=float, default=0.15,
                 help="probability that a step ends a turn")
  p.add_argument("--env_sleep_ms", type=float, default=5.0,
                 help="how long the slow environment's step sleeps")
  p.add_argument("--slots", default="2,8",
                 help="comma-separated decode slots of the continuous "
                 "engine's runs")
  p.add_argument("--chunk_steps", type=int, default=8,
                 help="the continuous runs' chunk when they do not return "
                 "on a turn's end")
  p.add_argument("--engine_pages", type=int, default=0,
                 help="the continuous runs' pool (0: every episode at its "
                 "longest; fewer preempts)")
  p.add_argument("--size", default="tiny", choices=("tiny", "small"))
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default="", help="where to write the figures")
  return p.parse_args()


class FixedReply:
  """Opens with the row's prompt; answers every turn with the same short
  user message after sleeping `sleep_s`; never done."""

  def __init__(self, row, sleep_s):
    self.row, self.sleep_s = row, sleep_s

  def reset(self):
    return [{"role": "user", "content": self.row["prompt"]}]

  def step(self, message):
    del message
    if self.sleep_s:
      time.sleep(self.sleep_s)
    return [{"role": "user", "content": "go on"}], 0.0, False


def timed(fn, repeats):
  """(seconds of the first call, of the fastest of `repeats` after it, the
  fastest's output)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  best, out = None, None
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    if best is None or seconds < best:
      best, out = seconds, result
  return first, best, out


def main(args):
  console.silence_library_noise(python_loggers=True)
  vocabulary = hf_tokenizer.HFTokenizerVocabulary(TOKENIZER)
  end_id = int(vocabulary.eos_id)
  renderer = episodes.Renderer(chat_templates.for_vocabulary(vocabulary),
                               vocabulary)
  config = bench_sampling.model_config("llama", vocabulary.vocab_size,
                                       "float32", args.size)
  plain, params = bench_sampling.init_params(config)
  module = bench_rollout.ending_at_rate(plain, end_id, args.eos_prob)
  B, N = args.episodes, args.turns
  rows = [{"prompt": f"Tell me about the number {i}."} for i in range(B)]
  reply = renderer.block(
      [{"role": "user", "content": rows[0]["prompt"]}],
      [{"role": "user", "content": "go on"}])
  budget = N * (args.turn_tokens + len(reply))
  openings = [renderer.opening([{"role": "user", "content": r["prompt"]}])
              for r in rows]
  width_in = max(len(o) for o in openings)
  limits = episodes.Limits(max_turns=N, max_episode_tokens=budget,
                           max_turn_tokens=args.turn_tokens,
                           max_opening_tokens=width_in)
  key = jax.random.PRNGKey(0)
  print(f"device: {jax.devices()[0].device_kind}; {args.size} Llama "
        f"({config.num_layers} layers, emb {config.emb_dim}), vocab "
        f"{vocabulary.vocab_size}, float32; {B} episodes x {N} turns, turns "
        f"of at most {args.turn_tokens} tokens ending with probability "
        f"{args.eos_prob} per step, the environment's block {len(reply)} "
        f"tokens; budget {budget} tokens after a {width_in}-token opening")

  def play(extend_cache, sleep_s):
    def run():
      policy = policies.TurnPolicy(
          module, params, end_id=end_id, temperature=1.0,
          width=width_in + budget + args.turn_tokens,
          turn_tokens=args.turn_tokens, extend_cache=extend_cache)
      played, stats = episodes.run_episodes(
          lambda row: FixedReply(row, sleep_s), rows, policy, renderer,
          episodes.Parser("qwen"), limits, key)
      return played, stats, policy.prefills
    return run

  figures = {"device": jax.devices()[0].device_kind, "size": args.size,
             "layers": config.num_layers, "emb_dim": config.emb_dim,
             "episodes": B, "turns": N, "turn_tokens": args.turn_tokens,
             "eos_prob": args.eos_prob, "env_block_tokens": len(reply),
             "budget_tokens": budget, "opening_tokens": width_in,
             "repeats": args.repeats}

  # 1. One long turn of the episode's budget on the same openings.
  tokens = np.zeros((B, width_in), np.int32)
  mask = np.zeros_like(tokens)
  for b, o in enumerate(openings):
    tokens[b, width_in - len(o):], mask[b, width_in - len(o):] = o, 1
  single = jax.jit(lambda p, x, m, r: sampling.sample_decoder_only(
      plain, p, x, m, r, max_new_tokens=budget, temperature=1.0,
      eos_id=end_id))
  first, seconds, _ = timed(lambda: single(params, tokens, mask, key),
                            args.repeats)
  single_tokens = B * budget
  figures["single_turn"] = {"seconds": seconds, "compile_seconds":
                            first - seconds, "tokens": single_tokens,
                            "tokens_per_s": single_tokens / seconds}
  print(f"single-turn  {seconds:8.3f} s  {single_tokens / seconds:9,.0f} "
        f"tok/s  ({single_tokens} tokens; compile {first - seconds:.1f} s)")

  # 1 and 3. Multi-turn, the cache extended, then re-prefilled.
  runs = {}
  for name, extend in (("extend_cache", True), ("re_prefill", False)):
    first, seconds, (played, stats, prefills) = timed(play(extend, 0.0),
                                                      args.repeats)
    runs[name] = played
    n_tokens = sum(len(e.tokens) for e in played)
    n_model = sum(sum(e.is_model) for e in played)
    figures[name] = {
        "seconds": seconds, "compile_seconds": first - seconds,
        "tokens": n_tokens, "model_tokens": n_model,
        "tokens_per_s": n_tokens / seconds,
        "model_tokens_per_s": n_model / seconds, "prefills": prefills,
        "decode_steps": stats["decode_steps"],
        "turns": sum(e.turns for e in played),
        "overflowed": sum(e.overflow for e in played)}
    print(f"multi-turn {name:12} {seconds:8.3f} s  "
          f"{n_tokens / seconds:9,.0f} tok/s  ({n_tokens} tokens, "
          f"{n_model} the model's: {n_model / seconds:,.0f}/s; "
          f"{prefills} prefills, {int(stats['decode_steps'])} decode "
          f"steps; compile {first - seconds:.1f} s)")
  same = all(a.tokens == b.tokens for a, b in zip(runs["extend_cache"],
                                                    runs["re_prefill"]))
  figures["same_tokens"] = same
  ext, pre = figures["extend_cache"], figures["re_prefill"]
  figures["multi_over_single_tokens_per_s"] = (
      ext["tokens_per_s"] / figures["single_turn"]["tokens_per_s"])
  figures["re_prefill_over_extend_seconds"] = pre["seconds"] / ext["seconds"]
  print(f"multi-turn (extended) / single-turn tokens/s: "
        f"{figures['multi_over_single_tokens_per_s']:.2f}; re-prefill / "
        f"extend wall time: {figures['re_prefill_over_extend_seconds']:.2f}x"
        f", prefills {pre['prefills']} vs {ext['prefills']}; same tokens: "
        f"{same}")

  # 2. Waiting on a slow environment.
  sleep_s = args.env_sleep_ms / 1e3
  first, seconds, (played, stats, _) = timed(play(True, sleep_s),
                                             args.repeats)
  share = stats["env_seconds"] / seconds
  figures["env_wait"] = {"sleep_ms": args.env_sleep_ms, "seconds": seconds,
                         "env_seconds": stats["env_seconds"],
                         "env_share": share,
                         "env_calls": sum(e.turns for e in played)}
  print(f"env wait ({args.env_sleep_ms:g} ms a step, {B} in parallel): "
        f"{stats['env_seconds']:.3f} of {seconds:.3f} s = {share:.1%}")
  lockstep = figures["env_wait"]
  lockstep_tokens = [e.tokens for e in played]
  lockstep["tokens"] = sum(len(e.tokens) for e in played)
  lockstep["tokens_per_s"] = lockstep["tokens"] / seconds
  lockstep["slot_occupancy"] = (sum(sum(e.is_model) for e in played)
                                / (stats["decode_steps"] * B))
  print(f"lockstep     {seconds:8.3f} s  {lockstep['tokens_per_s']:9,.0f} "
        f"tok/s  occupancy {lockstep['slot_occupancy']:.2f}  env wait "
        f"{stats['env_seconds']:.3f} s")

  # 4. The same slow environment on decode slots.
  figures["continuous"] = {}
  runs = [(int(x), True) for x in args.slots.split(",") if x]
  runs += [(slots, False) for slots, _ in runs]
  roomy = None  # the episodes on a pool for every one (--engine_pages)
  for slots, on_end in runs:
    def run(slots=slots, on_end=on_end):
      engine = continuous.EpisodeEngine(
          module, params, end_id=end_id, temperature=1.0, num_slots=slots,
          max_length=width_in + budget, turn_tokens=args.turn_tokens,
          return_on_end=on_end,
          chunk_steps=None if on_end else args.chunk_steps,
          num_pages=args.engine_pages or None)
      return continuous.run_episodes(
          lambda row: FixedReply(row, sleep_s), rows, engine, renderer,
          episodes.Parser("qwen"), limits, key)
    first, seconds, (played, stats) = timed(run, args.repeats)
    n_tokens = sum(len(e.tokens) for e in played)
    name = f"{slots}_slots" + ("" if on_end else
                                f"_chunks_of_{args.chunk_steps}")
    figures["continuous"][name] = {
        "seconds": seconds, "compile_seconds": first - seconds,
        "tokens": n_tokens, "tokens_per_s": n_tokens / seconds,
        "slot_occupancy": stats["slot_occupancy"],
        "env_wait_seconds": stats["env_seconds"],
        "env_hidden_seconds": stats["env_hidden_seconds"],
        "decode_steps": stats["decode_steps"],
        "preemptions": stats["preemptions"],
        "tokens_per_s_over_lockstep": (n_tokens / seconds
                                       / lockstep["tokens_per_s"]),
        "seconds_over_lockstep": seconds / lockstep["seconds"],
        "same_tokens_as_lockstep": ([e.tokens for e in played]
                                    == lockstep_tokens)}
    f = figures["continuous"][name]
    print(f"continuous {name:18} {seconds:8.3f} s  "
          f"{f['tokens_per_s']:9,.0f} tok/s "
          f"({f['tokens_per_s_over_lockstep']:.2f}x lockstep)  occupancy "
          f"{f['slot_occupancy']:.2f}  env wait "
          f"{f['env_wait_seconds']:.3f} s, hidden "
          f"{f['env_hidden_seconds']:.3f} s; wall "
          f"{f['seconds_over_lockstep']:.2f}x lockstep; compile "
          f"{first - seconds:.1f} s; {int(stats['preemptions'])} "
          f"preemptions; same tokens as lockstep: "
          f"{f['same_tokens_as_lockstep']}")
    if args.engine_pages:
      if roomy is None:
        engine = continuous.EpisodeEngine(
            module, params, end_id=end_id, temperature=1.0,
            num_slots=slots, max_length=width_in + budget,
            turn_tokens=args.turn_tokens)
        roomy = [e.tokens for e in continuous.run_episodes(
            lambda row: FixedReply(row, 0.0), rows, engine, renderer,
            episodes.Parser("qwen"), limits, key)[0]]
      f["same_tokens_as_unpreempted"] = roomy == [e.tokens for e in played]
      print(f"  same episodes as on a pool for all: "
            f"{f['same_tokens_as_unpreempted']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(figures, f, indent=2)
      f.write("\n")
  sys.stdout.flush()


if __name__ == "__main__":
  main(_parse())
