#!/usr/bin/env bash
# The benchmarks a machine with one GPU runs, as one command, in about 15
# minutes (issue 24, item 6; on an H100: SFT 88 s, DPO 89 s, SFT with
# cuDNN's attention 56 s, DPO with it 80 s, both at 4x the rows 60 and 79
# s, the attention paths about 70 s, the decode step's products about 45
# s, sampling 146 s, sampling at 1024 new tokens about 100 s (at 2048:
# 90 s for batch 64 alone), rollout 30 s, the online step 187 s; more than one
# lent session's device time: split it over calls with --only, TensorFlow
# installed between):
#
#   experiments/gpu_benchmarks.sh                 # on the GPU
#   experiments/gpu_benchmarks.sh --out DIR       # the files elsewhere
#   experiments/gpu_benchmarks.sh --smoke         # the same, tiny, on the CPU
#   experiments/gpu_benchmarks.sh --only sft,dpo  # some of them (names below)
#
# Writes one file per benchmark (the command, then its whole output) and
# summary.txt (the machine and the versions, then each benchmark's status,
# seconds and figure lines) into experiments/results/gpu/ (--out: another
# folder; a lent machine hands back at most 8 files a call, so split the
# run with --only there):
#
#   sft.txt          experiments/bench_sft_step.py: our SFT step's time,
#                    tokens/s, FLOPs and MFU against the GPU's bf16 peak,
#                    its kernels (3 more steps traced: kernels per step, the
#                    GPU's busy share, time by kind, the top ones), and
#                    TRL's SFTTrainer step on the same model and batch beside
#                    it when torch and trl import (in its own process, in
#                    turn with ours); a Llama with TinyLlama-1.1B's layer
#                    shapes (width 2048, MLP 5632, 32 heads, 4 KV heads,
#                    vocabulary 32000), 8 of its 22 layers (0.48B
#                    parameters: the per-layer matrix shapes decide MFU; 8
#                    layers keep compiling inside the time), bf16, AdamW,
#                    batch 8 x (256 prompt + 256 target tokens); the
#                    optimizer update timed alone too (its share of the
#                    step, and the MFU of the rest);
#   dpo.txt          the same for DPO (batch 4 pairs: 8 sequences, and the
#                    reference's forward pass in the step);
#   sft_fused.txt    our SFT step alone with cuDNN's flash attention
#                    (model.attention_impl='dot_product_cudnn', which
#                    'auto' picks on an H100; sft and dpo run XLA's
#                    einsums, 'xla');
#   dpo_fused.txt    the same for DPO;
#   sft_fused_x4.txt, dpo_fused_x4.txt
#                    the same at 4x the rows (16,384 tokens an update,
#                    still fewer than most runs use): the optimizer update,
#                    whose cost does not grow with the batch, takes a 4x
#                    smaller share of the step;
#   attention.txt    experiments/bench_attention.py: causal attention's
#                    paths (the einsums, cuDNN with the dense mask, cuDNN's
#                    packed layout, which 'dot_product_cudnn' runs) checked
#                    against the einsums in float32 (outputs and gradients)
#                    and timed, on right-padded, two-side-padded and packed
#                    rows of the train steps' attention shape;
#   decode_matmul.txt
#                    experiments/bench_decode_matmul.py: the matrix
#                    products of a decode step alone at batch 64 and 128
#                    (a layer's seven, the same fused into four, the output
#                    layer) against the HBM bandwidth;
#   sampling.txt     experiments/bench_sampling.py: greedy decoding tokens/s
#                    of a Llama 3.2 1B-shaped model in bf16 at batch 64 and
#                    128 (prompt 64, 128 new tokens), its share of the HBM
#                    bound, transformers' generate beside it, ours with
#                    each layer's projections read apart beside it (the
#                    joined weights' speed-up, sampling.fuse_projections),
#                    and the kernels of one traced call at batch 128 (per
#                    decode step);
#   sampling_long.txt
#                    the same model at batch 64 and 128 for 1024 new
#                    tokens, every step reading the whole KV cache, and
#                    the cache read in 2 segments (each step reading the
#                    chunks written so far: sampling's cache_segments)
#                    beside it: whether the default's 2 segments, measured
#                    to pay at 2048 tokens (sampling.LONG_GENERATION),
#                    pay at 1024 too;
#   rollout.txt      experiments/bench_rollout.py: the same sampling with
#                    the prompts repeated, the prefill shared, and stopping
#                    when every row is done;
#   engine.txt       experiments/bench_engine.py: the same workload through
#                    the continuous-batching engine's slots (refill sizes
#                    1, 16, 64) beside the lockstep sampler: tokens/s and
#                    the slots' utilisation;
#   agents.txt       experiments/bench_agents.py: multi-turn episodes of a
#                    Llama of about 21M parameters (width 512, 8 layers,
#                    the Qwen fixture's vocabulary of 405 ids; 64 episodes x
#                    4 turns of at most 128 tokens) against one turn of the
#                    same total length (tokens/s), the KV cache extended
#                    between turns against re-prefilled, and the share of
#                    the time spent waiting on environments;
#   online_step.txt  experiments/bench_online_step.py: a GRPO step's time
#                    split (sampling, host rewards, scoring with and
#                    without the reference, updates, the wait on the
#                    host), stop_when_done on and off; Llama of about 60M
#                    parameters, 32 prompts x 8 samples, at most 256 new
#                    tokens.
#
# Each benchmark runs under `timeout` (its own cap, cut to what is left of
# the whole budget, --budget seconds: 900 on the GPU), and a failure, a
# timeout or a skip is recorded in summary.txt and the next one runs. The
# exit status is 0 when every benchmark succeeded, else 1.
#
# --smoke runs the same commands at tiny sizes on the CPU (JAX_PLATFORMS=cpu)
# into a new temporary folder (or --out), so that the script works the first
# time it meets a GPU (tests/test_benchmarks.py); without TRL's and
# transformers' sides (--no_trl, --no_transformers), which cost more CPU than
# everything else there (about 80 CPU seconds without them, 125 with), unless
# --baselines is given too. On the GPU they run whenever they import.
#
# Needs: jaxrlhf importable (the script puts the repository first on
# PYTHONPATH) with its dependencies; bench_sft_step.py and
# bench_online_step.py build trainers, which need seqio and TensorFlow
# (TensorFlow's CPU build will do; tensorflow_text too for the online step);
# bench_sampling.py and bench_rollout.py need only JAX, Flax and
# ml_collections (and torch + transformers for the comparison). $PYTHON
# (default python3) runs them.

set -u

usage() { sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE=0
BASELINES=0
OUT=""
BUDGET_S=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --baselines) BASELINES=1 ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --budget) BUDGET_S="$2"; shift ;;
    --budget=*) BUDGET_S="${1#--budget=}" ;;
    --only) ONLY="$2"; shift ;;
    --only=*) ONLY="${1#--only=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_benchmarks.sh: unknown argument $1 (--smoke, --baselines, --out DIR, --budget S, --only NAMES)" >&2
       exit 2 ;;
  esac
  shift
done
BENCHMARKS="sft dpo sft_fused dpo_fused sft_fused_x4 dpo_fused_x4 attention decode_matmul sampling sampling_long rollout engine agents online_step"
for name in ${ONLY//,/ }; do
  case " $BENCHMARKS " in
    *" $name "*) ;;
    *) echo "gpu_benchmarks.sh: --only names $name; the benchmarks are: $BENCHMARKS" >&2
       exit 2 ;;
  esac
done

if [ "$SMOKE" = 1 ]; then
  OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_benchmarks_smoke.XXXXXX")}"
  BUDGET_S="${BUDGET_S:-900}"
  export JAX_PLATFORMS=cpu
else
  OUT="${OUT:-$REPO/experiments/results/gpu}"
  BUDGET_S="${BUDGET_S:-900}"
fi
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
cd "$REPO" || exit 2

# --- sizes: the GPU's, or the smoke test's ------------------------------------
if [ "$SMOKE" = 1 ]; then
  TRAIN_MODEL=(--arch=llama --size=tiny --vocab_size=128 --optimizer=adamw
               --inputs_length=8 --targets_length=8 --steps=1 --rounds=1
               --warmup=1 --profile=2)
  SFT_BATCH=(--batch_size=2)
  DPO_BATCH=(--batch_size=2)
  SFT_BATCH_X4=(--batch_size=8)
  DPO_BATCH_X4=(--batch_size=8)
  # cuDNN is the GPU's; the smoke test runs the same path through
  # jax.nn.dot_product_attention's XLA implementation.
  FUSED=(--attention_impl=dot_product --no_trl)
  SAMPLING=(--size=tiny --families=llama --batches=2,4 --prompt=4 --new=4 --separate --dtype=bfloat16
            --vocab_size=128 --repeats=1 --profile)
  SAMPLING_LONG=(--size=tiny --families=llama --batches=2 --prompt=4 --new=40
                 --segments=2 --vocab_size=128 --repeats=1 --no_transformers)
  ONLINE=(--arch=llama --size=tiny --vocab_size=128 --prompts=2 --group=2
          --prompt=8 --new=8 --eos_prob=0.3 --repeats=1)
  ROLLOUT=(--families=llama --size=tiny --vocab_size=128 --prompts=2
           --group=2 --prompt=4 --new=8 --eos_prob=0.3 --repeats=1)
  ENGINE=(--size=tiny --vocab_size=128 --prompts=2 --group=2 --prompt=4
          --new=8 --eos_prob=0.3 --slots=2 --refills=1,2 --repeats=1)
  if [ "$BASELINES" = 0 ]; then
    TRAIN_MODEL+=(--no_trl)
    SAMPLING+=(--no_transformers)
  fi
  ATTENTION=(--smoke)
  DECODE_MATMUL=(--smoke --profile)
  CAP_SFT=300 CAP_DPO=300 CAP_FUSED=200 CAP_SAMPLING=200 CAP_ONLINE=300
  CAP_ROLLOUT=200 CAP_ATTENTION=200 CAP_FUSED_DPO=200 CAP_FUSED_X4=200
  CAP_FUSED_DPO_X4=200 CAP_DECODE_MATMUL=100 CAP_SAMPLING_LONG=200
  CAP_ENGINE=200
  AGENTS=(--size=tiny --episodes=2 --turns=2 --turn_tokens=8 --repeats=1
          --env_sleep_ms=1)
  CAP_AGENTS=200
else
  TRAIN_MODEL=(--arch=llama --size=tinyllama-1.1b --num_layers=8
               --vocab_size=32000 --dtype=bfloat16 --optimizer=adamw
               --inputs_length=256 --targets_length=256 --steps=5 --rounds=2
               --warmup=2 --profile=3)
  SFT_BATCH=(--batch_size=8)
  DPO_BATCH=(--batch_size=4)
  SFT_BATCH_X4=(--batch_size=32)
  DPO_BATCH_X4=(--batch_size=16)
  FUSED=(--attention_impl=dot_product_cudnn --no_trl)
  SAMPLING=(--size=large --families=llama --batches=64,128 --prompt=64 --separate
            --new=128 --dtype=bfloat16 --repeats=2 --profile)
  SAMPLING_LONG=(--size=large --families=llama --batches=64,128 --prompt=64
                 --new=1024 --segments=2 --dtype=bfloat16 --repeats=1
                 --no_transformers)
  ONLINE=(--arch=llama --size=small --vocab_size=32128 --prompts=32 --group=8
          --prompt=64 --new=256 --eos_prob=0.05 --repeats=1)
  ROLLOUT=(--families=llama --size=small --vocab_size=32128 --prompts=32
           --group=8 --prompt=64 --new=256 --eos_prob=0.05 --repeats=3)
  ENGINE=(--size=small --vocab_size=32128 --prompts=32 --group=8 --prompt=64
          --new=256 --eos_prob=0.05 --slots=64 --refills=1,16,64 --repeats=3)
  ATTENTION=()
  DECODE_MATMUL=(--profile)
  CAP_SFT=125 CAP_DPO=130 CAP_FUSED=100 CAP_SAMPLING=200 CAP_ONLINE=210
  CAP_ROLLOUT=50 CAP_ATTENTION=90 CAP_FUSED_DPO=100 CAP_FUSED_X4=90
  CAP_FUSED_DPO_X4=120 CAP_DECODE_MATMUL=90 CAP_SAMPLING_LONG=150
  CAP_ENGINE=90
  AGENTS=(--size=small --episodes=64 --turns=4 --turn_tokens=128
          --eos_prob=0.02 --repeats=3)
  CAP_AGENTS=120
fi

SUMMARY="$OUT/summary.txt"
START=$(date +%s)
FAILED=0

# --- the machine ---------------------------------------------------------------
{
  echo "gpu_benchmarks.sh$([ "$SMOKE" = 1 ] && echo ' --smoke')$([ "$BASELINES" = 1 ] && echo ' --baselines')${ONLY:+ --only $ONLY} on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (with changes)')"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  fi
  timeout 120 "$PYTHON" - <<'EOF' 2>&1
import importlib.metadata, importlib.util, sys
print(f"python {sys.version.split()[0]} ({sys.executable})")
try:
  import jax
  d = jax.devices()
  print(f"jax {jax.__version__}: {len(d)} x {d[0].device_kind} ({d[0].platform})")
except Exception as e:  # pylint: disable=broad-except
  print(f"jax: {type(e).__name__}: {e}")
# Looked up, not imported (TensorFlow alone takes seconds to import).
found, missing = [], []
for module, dist in (("flax", "flax"), ("optax", "optax"),
                     ("ml_collections", "ml_collections"), ("seqio", "seqio"),
                     ("tensorflow", "tensorflow"),
                     ("math_verify", "math-verify"), ("torch", "torch"),
                     ("transformers", "transformers"), ("trl", "trl")):
  if importlib.util.find_spec(module) is None:
    missing.append(module)
    continue
  try:
    found.append(f"{module} {importlib.metadata.version(dist)}")
  except importlib.metadata.PackageNotFoundError:
    found.append(module)
print("packages: " + ", ".join(found))
if missing:
  print("not installed: " + ", ".join(missing) + (
      " (bench_sft_step.py and bench_online_step.py need seqio and "
      "TensorFlow)" if {"seqio", "tensorflow"} & set(missing) else ""))
EOF
  echo "budget: ${BUDGET_S} s; each benchmark: status, seconds, then its figures"
  echo
} > "$SUMMARY"
cat "$SUMMARY"

# run NAME CAP FIGURES [VAR=VALUE ...] -- COMMAND...: COMMAND's output into
# NAME.txt, under `timeout`; its status, seconds and the lines matching the
# regular expression FIGURES into the summary.
run() {
  local name="$1" cap="$2" figures="$3"
  shift 3
  local env_vars=()
  while [ "$1" != "--" ]; do env_vars+=("$1"); shift; done
  shift
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return
  fi
  local file="$OUT/$name.txt"
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 15 ]; then
    echo "$name: SKIPPED (${left} s of the ${BUDGET_S} s budget left)" | tee -a "$SUMMARY"
    echo "SKIPPED: the budget was spent" > "$file"
    FAILED=1
    return
  fi
  local t0=$(date +%s)
  {
    echo "\$ ${env_vars[*]:+${env_vars[*]} }$*"
    echo "(timeout ${limit} s)"
    env ${env_vars[@]+"${env_vars[@]}"} timeout -k 10 "$limit" "$@"
  } > "$file" 2>&1
  local rc=$?
  local seconds=$(( $(date +%s) - t0 ))
  local status="ok"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status="TIMEOUT after ${limit} s"
  elif [ "$rc" != 0 ]; then
    status="FAILED (exit status $rc)"
  fi
  echo "$status" >> "$file"
  {
    echo "$name: $status, ${seconds} s"
    grep -E "$figures" "$file" | sed 's/^/    /'
    if [ "$status" != ok ]; then
      echo "    last lines:"
      grep -v '^\(\$ \|(timeout\)' "$file" | tail -n 4 | sed 's/^/      /'
      FAILED=1
    fi
  } >> "$SUMMARY"
  [ "$status" = ok ] || FAILED=1
  echo "$name: $status, ${seconds} s"
}

# JAX takes 75% of the GPU's memory when it starts unless told otherwise;
# TRL's process (and transformers, in bench_sampling's) needs its share.
SHARED_GPU=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
TRAIN_FIGURES='^(model:|compile:|step time:|FLOPs/step:|optimizer update|model FLOPs|peak (device memory|RSS)|kernels:|  by kind:|TRL \(|  step time:|ratio ours|TRL comparison skipped)'

# The steps beside TRL's run XLA's einsums (their committed figures did;
# 'auto' picks cuDNN's kernel on an H100 now: the _fused runs measure it).
EINSUMS=(--attention_impl=xla)
run sft "$CAP_SFT" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=sft "${TRAIN_MODEL[@]}" "${SFT_BATCH[@]}" "${EINSUMS[@]}"
run dpo "$CAP_DPO" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=dpo "${TRAIN_MODEL[@]}" "${DPO_BATCH[@]}" "${EINSUMS[@]}"
run sft_fused "$CAP_FUSED" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=sft "${TRAIN_MODEL[@]}" "${SFT_BATCH[@]}" "${FUSED[@]}"
run dpo_fused "$CAP_FUSED_DPO" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=dpo "${TRAIN_MODEL[@]}" "${DPO_BATCH[@]}" "${FUSED[@]}"
run sft_fused_x4 "$CAP_FUSED_X4" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=sft "${TRAIN_MODEL[@]}" "${SFT_BATCH_X4[@]}" "${FUSED[@]}"
run dpo_fused_x4 "$CAP_FUSED_DPO_X4" "$TRAIN_FIGURES" "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sft_step.py --algorithm=dpo "${TRAIN_MODEL[@]}" "${DPO_BATCH_X4[@]}" "${FUSED[@]}"
run attention "$CAP_ATTENTION" '^(device:|rows|(right-padded|padded both|packed) )' -- \
  "$PYTHON" experiments/bench_attention.py "${ATTENTION[@]}"
run decode_matmul "$CAP_DECODE_MATMUL" '^(device:|batch|(  *64|  *128|  *[0-9]) +(separate|fused|lm_head) )' -- \
  "$PYTHON" experiments/bench_decode_matmul.py "${DECODE_MATMUL[@]}"
run sampling "$CAP_SAMPLING" '^(device:|family|(t5|llama) +[0-9]|  kernels:|    by kind:)' "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sampling.py "${SAMPLING[@]}"
run sampling_long "$CAP_SAMPLING_LONG" '^(device:|family|llama +[0-9])' "${SHARED_GPU[@]}" -- \
  "$PYTHON" experiments/bench_sampling.py "${SAMPLING_LONG[@]}"
run rollout "$CAP_ROLLOUT" '^(device:|(t5|llama) |  +responses:)' -- \
  "$PYTHON" experiments/bench_rollout.py "${ROLLOUT[@]}"
run engine "$CAP_ENGINE" '^(device:|variant|(lockstep|engine|paged) |  cache:)' -- \
  "$PYTHON" experiments/bench_engine.py "${ENGINE[@]}"
run agents "$CAP_AGENTS" '^(device:|single-turn|multi-turn|env wait)' -- \
  "$PYTHON" experiments/bench_agents.py "${AGENTS[@]}"
run online_step "$CAP_ONLINE" '^(device:|stop_when_done|sampling |host rewards |assemble(, no KL)? |updates |step \(split|fused|waiting on host)' -- \
  "$PYTHON" experiments/bench_online_step.py "${ONLINE[@]}"

echo "total: $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
echo "files: $OUT"
exit "$FAILED"
