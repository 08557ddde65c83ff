"""The benchmark scripts run, on the smallest shapes, and print figures that
agree with each other (they are not imported by anything else, so only
running them keeps them from rotting)."""

import re
import subprocess
import sys

from conftest import REPO, quiet_env


def _run(script, *args):
  out = subprocess.run(
      [sys.executable, str(REPO / "experiments" / script), *args],
      capture_output=True, text=True, env=quiet_env(), timeout=900,
      cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _number(text):
  return float(text.replace(",", ""))


def test_ppo_iteration_benchmark_t5_with_microbatches():
  # One encoder and one decoder layer: the four networks' steps compile in
  # half the time, and the parts, their token counts and the micro-batch
  # loop are the same as with the preset's two.
  out = _run("bench_ppo_iteration.py", "--steps=1", "--batch_size=4",
             "--inputs_length=8", "--targets_length=4", "--vocab_size=128",
             "--epochs=2", "--minibatches=2", "--num_microbatches=2",
             "--num_layers=1")
  rows = {m[1]: (_number(m[2]), _number(m[4])) for m in re.finditer(
      r"^(rollout|scoring|update|step)\s+([\d.]+)\s+([\d.]+%)?\s*([\d,]+)",
      out, re.M)}
  assert set(rows) == {"rollout", "scoring", "update", "step"}, out
  for name, tokens in (("rollout", 16), ("scoring", 16), ("update", 32),
                       ("step", 16)):
    ms, per_s = rows[name]
    assert ms > 0
    assert abs(per_s - tokens / (ms / 1e3)) <= 0.05 * per_s + 1, (name, out)


def test_sampling_benchmark_prints_tokens_per_second():
  out = _run("bench_sampling.py", "--size=tiny", "--batches=2,4", "--prompt=4",
             "--new=3", "--vocab_size=128", "--repeats=1",
             "--no_transformers", "--separate", "--dtype=bfloat16")
  rows = re.findall(r"^(t5|llama)\s+(\d+)\s+([\d,]+)\s+-\s+-\s+-\s+"
                    r"([\d,]+)\s+([\d.]+)$", out, re.M)
  assert [(f, int(b)) for f, b, *_ in rows] == [
      ("t5", 2), ("t5", 4), ("llama", 2), ("llama", 4)], out
  # Ours with the projections joined, then apart, and the speed-up between.
  for _, _, joined, apart, speedup in rows:
    assert _number(joined) > 0 and _number(apart) > 0
    assert _close(float(speedup), _number(joined) / _number(apart), 0.011,
                  0.006), (joined, apart, speedup)
  assert "3 new tokens, greedy, EOS disabled" in out


def _bench_common():
  sys.path.insert(0, str(REPO / "experiments"))
  try:
    import bench_common  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  return bench_common


def test_kernel_profile_busy_time_and_kinds():
  """The busy time is the union of the kernels' intervals (overlapping and
  nested ones counted once, gaps not at all), and kernel names fall into
  the kinds by what they compute."""
  bc = _bench_common()
  ops = [("a", 0, 10), ("b", 5, 10), ("c", 7, 2), ("d", 20, 5),
         ("e", 24, 1), ("f", 40, 0)]
  assert bc._busy(ops) == 15 + 5  # pylint: disable=protected-access
  assert bc._busy([]) == 0  # pylint: disable=protected-access
  kinds = {
      "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "matmul",
      "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
      "gemm_fusion_dot_3": "matmul",
      "dot.99": "matmul",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma": "attention",
      "flash_fwd_kernel": "attention",
      "loop_dynamic_update_slice_fusion": "copy",
      "Memcpy DtoH": "copy",
      "input_reduce_fusion_3": "reduction",
      "loop_multiply_fusion": "other",
      "doting_fusion": "other",
  }
  assert {name: bc._kernel_kind(name) for name in kinds} == kinds  # pylint: disable=protected-access
  # A traced kernel named after an instruction of the compiled program: its
  # result shape and the JAX operation of its metadata.
  hlo = ('  %loop_select_fusion.2 = bf16[8,32,512,512]{3,2,1,0} fusion(%a, '
         '%b), kind=kLoop, calls=%fc, metadata={op_name="jit(step)/attn/'
         'select_n" stack_frame_id=3}\n'
         '  ROOT %t = (f32[2]{0}, s32[]) tuple(%x, %y)\n')
  origin = bc._hlo_origin  # pylint: disable=protected-access
  assert origin(hlo, "loop_select_fusion.2") == (
      "bf16[8,32,512,512]{3,2,1,0} <- jit(step)/attn/select_n")
  assert origin(hlo, "t") == "(f32[2]{0}, s32[])"
  assert origin(hlo, "loop_select_fusion") == ""
  assert origin(hlo, "loop_select_fusion_2") == origin(
      hlo, "loop_select_fusion.2")  # a GPU trace's name for it


# --- experiments/gpu_benchmarks.sh ------------------------------------------------

GPU_BENCHMARKS = ("sft", "dpo", "sft_fused", "dpo_fused", "sft_fused_x4",
                  "dpo_fused_x4", "attention", "decode_matmul", "sampling",
                  "sampling_long", "rollout", "engine", "agents",
                  "online_step")


def _close(a, b, rel, absolute):
  return abs(a - b) <= rel * max(abs(a), abs(b)) + absolute


def _check_online_step(text):
  """bench_online_step.py's tables: each part's share is its seconds over
  the step's, tokens/s its response tokens over its seconds, the wait on
  the host the step less the fused step, assemble without the KL timed
  beside it; stopping early runs fewer decode steps than the budget, and
  both settings draw the same responses."""
  assert "!!" not in text, text
  settings = re.findall(
      r"^stop_when_done (on|off): (\d+) of (\d+) decode steps run .*?"
      r"responses mean ([\d.]+) tokens(.*?)(?=^stop_when_done|\Z)",
      text, re.M | re.S)
  assert [s[0] for s in settings] == ["on", "off"], text
  steps = {name: int(run) for name, run, _, _, _ in settings}
  assert steps["off"] == 8 and 1 <= steps["on"] <= 8, steps
  for name, _, _, mean, table in settings:
    rows = {m[1]: [_number(x) for x in m.groups()[1:5] if x]
            for m in re.finditer(
                r"^(sampling|host rewards|assemble|updates|step \(split, "
                r"host\)|fused \(no host\)|waiting on host) +([\d.-]+) +"
                r"([\d.-]+) +([\d.-]+)%(?: +([\d,]+))?", table, re.M)}
    assert len(rows) == 7, (name, table)
    step = rows["step (split, host)"][0]
    # Seconds are printed to 4 decimals, the mean length to 1; 2 prompts x
    # 2 samples.
    tokens = [(float(mean) + d) * 4 for d in (-0.05, 0.05)]
    for part in ("sampling", "host rewards", "assemble", "updates",
                 "fused (no host)"):
      seconds, _, share, per_s = rows[part]
      assert seconds > 0, (part, table)
      assert _close(seconds, share * step / 100, 1e-3, 1e-4), (part, table)
      assert (tokens[0] / (seconds + 5e-5) - 1 <= per_s
              <= tokens[1] / max(seconds - 5e-5, 1e-9) + 1), (part, table)
    wait = rows["waiting on host"]
    assert _close(wait[0], step - rows["fused (no host)"][0], 0, 2e-4), table
    # GRPO's default KL coefficient: assemble is also timed without the
    # reference's pass, and the ratio is the two assembles' seconds.
    no_kl = re.search(r"^assemble, no KL +([\d.]+) .*?; ([\d.]+)x as fast",
                      table, re.M)
    assert no_kl, table
    # (From the unrounded seconds: the printed ones carry 4 decimals, the
    # ratio 2.)
    assembled, skipped = rows["assemble"][0], float(no_kl[1])
    assert ((assembled - 5e-5) / (skipped + 5e-5) - 0.005
            <= float(no_kl[2])
            <= (assembled + 5e-5) / max(skipped - 5e-5, 1e-9) + 0.005), table


def test_gpu_benchmarks_smoke_run(tmp_path):
  """`experiments/gpu_benchmarks.sh --smoke`: every benchmark of the GPU
  script runs at tiny sizes on the CPU, writes its file with its figures,
  and the summary says each one succeeded and repeats its figures."""
  out = tmp_path / "gpu"
  run = subprocess.run(
      ["bash", str(REPO / "experiments" / "gpu_benchmarks.sh"), "--smoke",
       "--out", str(out)],
      capture_output=True, text=True, timeout=1500, cwd=REPO,
      env=quiet_env(PYTHON=sys.executable))
  summary_path = out / "summary.txt"
  summary = summary_path.read_text() if summary_path.exists() else ""
  assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:],
                               summary)
  assert sorted(p.name for p in out.iterdir()) == sorted(
      [f"{name}.txt" for name in GPU_BENCHMARKS] + ["summary.txt"])
  text = {name: (out / f"{name}.txt").read_text() for name in GPU_BENCHMARKS}
  for name in GPU_BENCHMARKS:
    assert re.search(rf"^{name}: ok, \d+ s$", summary, re.M), summary
    assert text[name].startswith("$ "), text[name][:200]  # the command
    assert text[name].rstrip().endswith("ok"), text[name][-500:]
  assert re.search(r"^jax [\d.]+: 1 x cpu", summary, re.M), summary
  assert re.search(r"^total: \d+ s$", summary, re.M), summary

  # SFT: 2 x 8 target tokens per step; DPO: a chosen and a rejected each.
  for name, target_tokens in (("sft", 16), ("dpo", 32), ("sft_fused", 16),
                              ("dpo_fused", 32), ("sft_fused_x4", 64),
                              ("dpo_fused_x4", 128)):
    m = re.search(r"step time: ([\d.]+) ms \| [\d.]+ steps/s \| ([\d,]+) "
                  r"target tokens/s", text[name])
    assert m, text[name]
    per_s = _number(m[2])
    assert _close(per_s, target_tokens / (_number(m[1]) / 1e3), 0.01, 1)
    assert re.search(r"^FLOPs/step: [\d.]+ GFLOP", text[name], re.M)
    assert m[0] in summary
    # The optimizer update timed alone, and the step less it.
    u = re.search(r"^optimizer update alone: ([\d.]+) ms \((\d+)% of the "
                  r"step\); the step less it: (-?[\d.]+) ms", text[name], re.M)
    assert u and u[0] in summary, text[name]
    assert float(u[1]) > 0 and _close(float(u[1]) + float(u[3]),
                                      _number(m[1]), 0, 0.011), u[0]
  # Their kernels, traced (bench_common.kernel_profile).
  for name, unit in (("sft", "step"), ("dpo", "step"),
                     ("sft_fused", "step"), ("dpo_fused", "step"),
                     ("sft_fused_x4", "step"), ("dpo_fused_x4", "step"),
                     ("sampling", "decode step")):
    m = re.search(rf"kernels: ([\d.,]+) per {unit} \((\d+) distinct\); "
                  rf"device busy ([\d.]+) ms of ([\d.]+) ms wall", text[name])
    assert m, text[name]
    assert float(m[3]) <= float(m[4]) and int(m[2]) >= 1, m[0]
    assert m[0] in summary
  assert "attention xla)" in text["sft"], text["sft"]
  # The top kernels' shapes and the JAX operations they came from.
  assert re.search(r"^ {30}f32\[[\d,]+\]\S* <- .*(jit\(step\)|dot_general)",
                   text["sft"], re.M), text["sft"]
  for name in ("sft_fused", "dpo_fused", "sft_fused_x4", "dpo_fused_x4"):
    assert "attention dot_product)" in text[name], text[name]
  assert "attention xla)" in text["dpo"], text["dpo"]
  # Attention's paths: each row kind's einsums, and on the CPU the dense
  # mask's arguments through XLA, within the einsums' rounding.
  checked = re.findall(r"^(right-padded|padded both sides|packed \(3 "
                       r"examples\)) +(einsums|cuDNN, [^\d]+?) +([\d.]+) +"
                       r"([\d.e+-]+)$", text["attention"], re.M)
  assert len(checked) == 5 and "FAILED" not in text["attention"], text[
      "attention"]
  # The decode step's products: each path at each batch, checked against
  # float32 matmuls, timed, with its kernels.
  products = re.findall(r"^ +(\d+) (separate|fused|lm_head) +(\d) +([\d.]+) +"
                        r"(\d+) +- +([\d.]+) +([\d.e+-]+)$",
                        text["decode_matmul"], re.M)
  assert [(b, p, n) for b, p, n, *_ in products] == [
      (b, p, n) for b in ("2", "4") for p, n in (
          ("separate", "7"), ("fused", "4"), ("lm_head", "1"))], (
              text["decode_matmul"])
  assert all(float(us) > 0 and float(wall) > 0 and float(error) < 2e-2
             for *_, us, _, wall, error in products), text["decode_matmul"]
  assert len(re.findall(r"kernels: [\d.]+ per layer", text["decode_matmul"])
             ) == 6, text["decode_matmul"]
  rows = re.findall(r"^llama\s+(\d+)\s+([\d,]+)\s", text["sampling"], re.M)
  assert [int(b) for b, _ in rows] == [2, 4], text["sampling"]
  assert all(_number(rate) > 0 for _, rate in rows)
  # The long generation: the whole cache read at every step, then in 2
  # segments, and the ratio of the two (whether their tokens agree is
  # tests/test_kv_cache.py's to check, on models with clear margins).
  assert "40 new tokens" in text["sampling_long"], text["sampling_long"]
  long_rows = re.findall(r"^llama\s+2\s+([\d,]+)\s+-\s+-\s+-\s+([\d,]+)"
                         r"\s+([\d.]+)(?:  \(tokens differ.*\))?$",
                         text["sampling_long"], re.M)
  assert len(long_rows) == 1, text["sampling_long"]
  whole, segmented, ratio = long_rows[0]
  assert _close(float(ratio), _number(segmented) / _number(whole), 0.011,
                0.006), long_rows
  _check_online_step(text["online_step"])
  assert "waiting on host" in summary
  variants = {m[1]: int(m[2]) for m in re.finditer(
      r"^llama\s+(repeated|shared|shared\+stop)\s+[\d.]+\s+[\d.]+\s+[\d,]+"
      r"\s+[\d.]+x\s+(\d+)", text["rollout"], re.M)}
  assert variants.keys() == {"repeated", "shared", "shared+stop"}, (
      text["rollout"])
  assert variants["repeated"] == variants["shared"] == 8
  assert 1 <= variants["shared+stop"] <= 8
  assert "!!" not in text["rollout"]


def test_gpu_benchmarks_only_runs_the_named_ones(tmp_path):
  """`--only NAMES` runs those benchmarks alone (a lent machine's time split
  over calls), and an unknown name is refused with the list before
  anything runs."""
  script = str(REPO / "experiments" / "gpu_benchmarks.sh")
  bad = subprocess.run(["bash", script, "--smoke", "--only", "sft,rollouts",
                        "--out", str(tmp_path / "bad")],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
  assert bad.returncode == 2, (bad.stdout, bad.stderr)
  assert "rollouts" in bad.stderr and all(
      name in bad.stderr for name in GPU_BENCHMARKS), bad.stderr
  assert not (tmp_path / "bad" / "summary.txt").exists()
  out = tmp_path / "gpu"
  run = subprocess.run(
      ["bash", script, "--smoke", "--only", "rollout", "--out", str(out)],
      capture_output=True, text=True, timeout=600, cwd=REPO,
      env=quiet_env(PYTHON=sys.executable))
  assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
  assert sorted(p.name for p in out.iterdir()) == ["rollout.txt",
                                                  "summary.txt"]
  summary = (out / "summary.txt").read_text()
  assert summary.startswith("gpu_benchmarks.sh --smoke --only rollout on ")
  assert re.findall(r"^(\w+): ok, \d+ s$", summary, re.M) == ["rollout"]


def test_agents_benchmark_smallest(tmp_path):
  path = tmp_path / "agents.json"
  out = _run("bench_agents.py", "--episodes=2", "--turns=2",
             "--turn_tokens=8", "--repeats=1", f"--json={path}")
  import json  # pylint: disable=g-import-not-at-top
  got = json.loads(path.read_text())
  assert "same tokens: True" in out and got["same_tokens"], out
  # One long turn draws the whole budget for every episode.
  assert got["single_turn"]["tokens"] == 2 * got["budget_tokens"]
  for name in ("single_turn", "extend_cache", "re_prefill"):
    run = got[name]
    assert _close(run["tokens_per_s"], run["tokens"] / run["seconds"],
                  1e-9, 0), name
  assert got["extend_cache"]["tokens"] == got["re_prefill"]["tokens"]
  assert got["extend_cache"]["prefills"] <= got["re_prefill"]["prefills"]
  assert 0 < got["env_wait"]["env_share"] <= 1
