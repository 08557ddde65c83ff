"""The config of online RL and its checks.

Every online algorithm (`online.Online`) reads the `online` group: how
responses are sampled (temperature, length, group size, rollout parts), the
reward model and the EOS trick, the KL penalty and its controller, and how
the updates use each rollout (epochs, minibatches, clipping); and the
`rewards` group (`reward_sources`). `check_rows` refuses, from the config
alone, batch splits a run could not make.
"""

from typing import Optional, Tuple

from jaxrlhf import config_schema
from jaxrlhf.agents import environments
from jaxrlhf.agents import tool_calls
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.algorithms import update as update_lib
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.rl import importance_sampling
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import reductions

F = config_schema.Field

# "Table 7" is the PPO hyper-parameter table of "The N+ implementation
# details of RLHF with PPO" (Huang et al. 2024).
ONLINE = config_schema.Group(
    "online",
    "Online RL (the online algorithms of docs/config.md's table): every "
    "train step samples responses to train.batch_size prompts of data.task "
    "from the policy, scores them with the rewards of config.rewards and "
    "updates the policy; init.policy_checkpoint is the policy's start and "
    "the frozen reference.", [
        F("reward_model_checkpoint", "",
          "A jaxrlhf reward_model workdir: its latest params/reward scores "
          "rollouts (and initialises PPO's value network, detail 22). Its "
          "vocabulary must be the policy's. Required while "
          "rewards.reward_model.weight is not 0.", path=True,
          read_when=reward_sources.uses_reward_model),
        F("temperature", 0.7,
          "Sampling temperature of rollouts (Table 7: 0.7); the log-probs of "
          "PPO ratios and of the KL penalty are computed at the same "
          "temperature.", bounds=">0"),
        F("max_new_tokens", None,
          "Tokens sampled per response, a fixed number as in detail 23 (then "
          "cut after the first EOS); unset = data.targets_length.",
          type=int, bounds=">0"),
        F("stop_when_done", True,
          "Stop sampling once every response of a rollout (part) has ended "
          "(a while loop over decode steps) instead of always drawing "
          "max_new_tokens: the responses are the same, since the steps "
          "after every EOS only write padding (detail 23's fixed length is "
          "kept in the response tensors' shape), so only the time changes; "
          "metrics log decode_steps. False = a fixed-length scan."),
        F("cache_segments", None,
          "The decode steps run in this many segments (near-equal runs of "
          "steps, each compiled as its own loop), the KV cache held in a "
          "chunk per segment, so that a step reads the cache written so "
          "far instead of the whole cache: the same responses, less of the "
          "cache read in long generations, but more and smaller attention "
          "products per step (a step of segment s reads s + 1 chunks). "
          "Measured on an H100 (Llama 3.2 1B shape, bf16, 2048 new "
          "tokens): 2 segments 1.11-1.14x the tokens/s, 4 segments 0.93x; "
          "on a CPU the extra products cost more than the reads saved "
          "(experiments/results/gpu/README.md, "
          "experiments/results/sampling/README.md); "
          "experiments/bench_sampling.py --segments=N measures both on "
          "your accelerator. 1 = every step reads the whole cache; unset = "
          "2 on a GPU when max_new_tokens >= 2048, else 1 "
          "(sampling.default_cache_segments).",
          type=int, bounds=">0"),
        F("engine", "auto",
          "How responses are decoded: 'lockstep' (sampling.py: every row "
          "of a rollout part in one batch, each step waiting for the "
          "longest); 'continuous' (jaxrlhf/models/engine.py: engine_slots "
          "decode slots, each taking the next pending response when its "
          "own ends, so that no slot waits; on 2 CPU cores 16 slots for 64 "
          "responses gave 1.30x lockstep's tokens/s on short responses and "
          "11x on log-normal lengths up to 4,096, "
          "experiments/results/engine/); 'auto' (the default): "
          "'continuous' on pages (online.engine_page_size, unset 16) where "
          "it decodes the run's policy (decoder-only, one cache segment), "
          "else 'lockstep' (T5, online.cache_segments > 1). Both draw the "
          "same samples from the same key: token t of response i is row i "
          "of the lockstep sampler's draw t over the rollout part "
          "(models/row_draws.py), so the choice changes the speed, not the "
          "run (up to float rounding: the engine's products run in "
          "batches of its slots, so a log-prob differs in its last bits, "
          "and a token where two candidates tie to that rounding can "
          "differ). With online.environment or online.tools, episodes on "
          "slots (jaxrlhf/agents/continuous.py): a turn that ends frees "
          "its slot while its environment steps in a thread pool and the "
          "others decode, and its answer is prefilled onto the episode's "
          "own pages (of online.engine_page_size positions; unset 16) in "
          "a free slot, each turn drawing as the lockstep loop draws it "
          "(experiments/bench_agents.py measures both). Continuous: "
          "decoder-only policies, no cache_segments; a mixture-of-experts "
          "policy on pages, its routes recorded for router_replay as "
          "lockstep's are; single-turn responses are also "
          "decoded on online.sampler_devices, one or more steps ahead "
          "(tests/eight_devices.py). The slots' default was measured on "
          "CPU, where a step costs in proportion to its rows; on an "
          "accelerator a decode step of 16 rows costs about one of 64, so "
          "measure engine_slots there (experiments/bench_engine.py).",
          choices=("auto", "lockstep", "continuous")),
        F("engine_slots", None,
          "engine 'continuous' (or 'auto' resolved to it): the decode "
          "slots (the responses decoded at once; with episodes, the "
          "turns); unset = a quarter of a "
          "rollout part's responses (episodes: of the step's episodes on "
          "this process), at least 1, the setting measured.", type=int,
          bounds=">0"),
        F("engine_page_size", None,
          "engine 'continuous': unset = each slot a contiguous KV cache of "
          "prompt + max_new_tokens - 1 positions (engine 'auto' and "
          "episodes: pages of 16); an int = the slots' "
          "caches as pages of this many positions in one pool "
          "(jaxrlhf/models/layers/paged_kv.py; engine.generate's page_size "
          "and its default pool), so that a sequence holds the pages of its "
          "own length and attention reads the pages in use, or a short "
          "table whole (models/layers/paged_attention.py); a prompt's "
          "samples_per_prompt responses share its prefill and its pages "
          "when they divide engine_slots (unset: they do). The same "
          "responses; python -m jaxrlhf.plan counts the pool.", type=int,
          bounds=">0"),
        F("engine_pages", None,
          "engine 'continuous' on pages (online.engine_page_size, "
          "episodes, or engine 'auto' resolved to it): the pool's pages. "
          "Unset = enough for every slot's longest sequence "
          "(single-turn: slots x the pages of prompt + "
          "max_new_tokens - 1; episodes: the step's episodes x the pages "
          "of the longest episode), so that nothing is ever preempted. "
          "Fewer: the pool follows the real lengths, and when a sequence "
          "needs a page and none is free the most recently admitted one "
          "is preempted (its pages freed, it waits again and is prefilled "
          "with its tokens so far when a slot and pages free up, before "
          "any new prompt), drawing the same tokens as without "
          "preemption (single-turn: engine/preemptions counts them; "
          "episodes: one waiting "
          "on its environment goes first, its whole conversation "
          "prefilled again when answered; episode/preemptions). A pool "
          "too small for one longest sequence is an error naming the "
          "least. python -m jaxrlhf.plan counts the pool.", type=int,
          bounds=">0"),
        F("eos_trick", True,
          "The EOS trick (detail 23): a response with no EOS scores "
          "missing_eos_penalty instead of the reward model's output (which "
          "is only valid at an EOS, detail 13). False keeps the score at the "
          "last token."),
        F("missing_eos_penalty", -1.0,
          "The score of a response without EOS under the EOS trick.",
          bounds=config_schema.ANY_NUMBER),
        F("kl_coef", 0.05,
          "beta of the KL(pi || reference) penalty folded into the reward "
          "(PPO per token; RLOO and REINFORCE per sequence); Table 7: 0.05. "
          "GRPO puts its KL in the loss instead, with grpo.kl_coef. 0 "
          "skips the reference's forward pass on the samples and the 'kl' "
          "metric, and the run keeps no copy of the reference (evaluation "
          "loads the starting policy when it runs).",
          bounds=">=0"),
        F("kl_estimator", "k1",
          "Per-token KL estimator of the penalty: 'k1' (log ratio), 'k2', "
          "'k3' (jaxrlhf/rl/kl.py). It shapes the reward of ppo, rloo and "
          "reinforce; GRPO's loss always uses k3, so for grpo and "
          "rejection_sampling it only changes the logged rlhf_reward.",
          choices=kl_lib.KL_ESTIMATORS),
        F("adaptive_kl", False,
          "Adaptive KL coefficient (Ziegler et al. 2019): beta moves towards "
          "keeping the mean per-response KL at kl_target, by at most 20% of "
          "(responses per step / kl_horizon) per step. The coefficient is "
          "part of the checkpointed train state and must start above 0. "
          "With grpo it adapts grpo.kl_coef (the loss's KL weight); "
          "rejection_sampling has no KL term and ignores it."),
        F("kl_target", 6.0, "The adaptive controller's target KL.",
          bounds=">0"),
        F("kl_horizon", 10000, "The adaptive controller's horizon.",
          bounds=">0"),
        F("samples_per_prompt", None,
          "Responses per prompt (the group size k of RLOO/GRPO, N of "
          "rejection sampling); unset = the algorithm's default (1 for ppo "
          "and reinforce, 4 for rloo and grpo, 8 for rejection_sampling). A "
          "step trains on batch_size * k responses.", type=int, bounds=">0"),
        F("num_epochs", None,
          "Passes over each rollout batch; each pass reshuffles the "
          "rollouts. Unset = 4 for ppo (Table 7: K = 4) and rloo (as TRL's "
          "RLOO), 1 for the others.", type=int, bounds=">0"),
        F("num_minibatches", 1,
          "Minibatches (optimizer updates) per pass (Table 7: 1).",
          bounds=">0"),
        F("rollout_microbatches", 1,
          "Parts a step's rollout is sampled and scored in, one after "
          "another (each holds batch_size / this many prompts): the "
          "rollout's activations and KV caches shrink by about this factor "
          "(train.num_microbatches splits only the updates). The responses "
          "differ from an unsplit rollout's (each part draws its own random "
          "numbers) but are drawn from the same policy.", bounds=">0"),
        F("clip_eps", 0.2,
          "Policy ratio clipping epsilon (Table 7: 0.2); GRPO's lower "
          "epsilon.", bounds=">0"),
        F("pg_reduction", "sequence_sum",
          "RLOO and REINFORCE: how per-token losses become one scalar "
          "(jaxrlhf/rl/reductions.py); 'sequence_sum' treats the response as "
          "one action (RLHF book 11.1.3).",
          choices=reductions.LOSS_REDUCTIONS),
        F("long_prompts", "cut_paragraph",
          "Prompts longer than data.inputs_length: 'cut_paragraph' drops "
          "trailing paragraphs (from the last newline) until the prompt fits "
          "(detail 2; a prompt with no newline left is an error naming it); "
          "'raise' stops at start-up naming the first one.",
          choices=prompts_lib.LONG_PROMPT_POLICIES),
        F("off_policy_steps", 0,
          "Generation overlapped with training (jaxrlhf/algorithms/"
          "online/overlap.py), the staleness bound k: 1 samples step t+1's "
          "responses with step t's parameters while step t's update runs "
          "(one-step off-policy, corrected by off_policy_correction); k > 1 "
          "keeps a queue of the next k steps' rollouts, step t training on "
          "responses of step t-k's parameters (asynchronous RL with bounded "
          "staleness; the first k steps' of the run's first step's); 0 "
          "samples each step's responses with the parameters it updates "
          "(on-policy). Episodes (online.environment, online.tools) are "
          "played ahead on the host once the update is dispatched.",
          bounds=">=0"),
        F("partial_rollouts", False,
          "Episodes played ahead (online.off_policy_steps >= 1, "
          "online.environment or online.tools, on the continuous engine) "
          "go on with the parameters of the update that runs beside them "
          "as soon as it is done, taken between two decode chunks "
          "(agents/continuous.py: the episodes' caches recomputed with "
          "them), so their later tokens come from the newer policy (AReaL's "
          "and PipelineRL's in-flight weight updates); the plays after it "
          "(dynamic sampling's further rounds) start from them. Each token "
          "keeps the log-prob of the policy that drew it, and the update "
          "takes those as its old policy (so the gap/ metrics compare the "
          "sampler with itself). Where the handover falls depends on when "
          "the update ends, so such a run is not repeatable; "
          "episode/param_updates counts the plays that took them."),
        F("sampler_devices", 0,
          "Devices that only sample (each process gives an equal share of "
          "its own), on a mesh of their own with mesh.shape's axes; the rest "
          "train, and the parameters move to the sampler once per step. 0 = "
          "sample on the training devices. With off_policy_steps=1 the two "
          "halves work at the same time.", bounds=">=0"),
        F("off_policy_correction", "sampling",
          "How an off-policy update corrects for the lag: 'sampling' (the "
          "ratios of ppo/grpo/rloo/reinforce take the sampling policy's "
          "log-probs as the old policy: the importance ratio pi / "
          "pi_sample, truncated by their clip); 'decoupled' (the ratios' old "
          "policy is the one the update starts from, re-scored on the "
          "training devices, and each token's advantage is weighted by "
          "min(pi_start / pi_sample, importance_weight_cap): the decoupled "
          "objective of AReaL, verl's truncated importance sampling).",
          choices=("sampling", "decoupled")),
        F("importance_correction", None,
          "What the update does about the gap between the policy that "
          "sampled a token and the one it starts from (the sampler's own "
          "log-probs against the trainer's scoring; with "
          "off_policy_correction=decoupled, the re-scored start policy "
          "against the sampling one): 'none'; 'token_tis' / 'sequence_tis' "
          "(each token's or sequence's advantage weighted by its truncated "
          "ratio, min(ratio, importance_weight_cap)); 'token_mask' / "
          "'sequence_mask' (tokens or sequences whose ratio leaves "
          "[importance_ratio_low, importance_ratio_high] dropped from the "
          "loss); 'icepop' (IcePop's two-sided token masking); "
          "'geometric_mean' (the geometric mean of a sequence's token "
          "ratios as its weight, truncated at the cap). Unset = token_tis "
          "under the decoupled correction, else none. The gap itself is "
          "logged every step (gap/k1, gap/k3, gap/ratio_*).",
          type=str, choices=importance_sampling.CORRECTIONS),
        F("importance_weight_cap", 2.0,
          "The cap of a truncated importance weight (importance_correction "
          "token_tis, sequence_tis, geometric_mean).", bounds=">0"),
        F("importance_ratio_low", 0.5,
          "The lower end of the band of ratios kept by importance_correction "
          "token_mask, sequence_mask and icepop.", bounds=">0"),
        F("importance_ratio_high", 2.0,
          "The upper end of that band.", bounds=">0"),
        F("router_replay", True,
          "Mixture-of-experts policies (qwen3_moe, mixtral): the sampler "
          "records the experts it routed each token to, and the rollout's "
          "scoring and the updates route those tokens to the same experts, "
          "weighted by the trained router's probabilities of them (so the "
          "router still learns): Rollout Routing Replay (R3), which keeps "
          "the trainer's log-probs of the sampled tokens from drifting from "
          "the sampler's where the two would route differently; "
          "multi-turn episodes record the experts of every id they feed "
          "(opening, turns, answers). Dense policies ignore it."),
        F("router_replay_gap", False,
          "With router_replay, also score each rollout without replaying "
          "and log that gap to the sampler too (gap/unreplayed/k1, k3): "
          "what replay closes, for one more forward pass of the policy per "
          "step."),
        F("prompt_suffix", "",
          "A prompt ending that cutting keeps (e.g. '\\n\\nTL;DR:'; a long "
          "prompt that does not end with it is an error naming it); '' = "
          "none (cut at the last newline)."),
        # Agents: multi-turn episodes (jaxrlhf/agents/,
        # jaxrlhf/algorithms/online/episode_step.py).
        F("environment", "",
          "'pkg.module:make_env': every response becomes an episode against "
          "make_env(row), an object with reset() -> opening messages and "
          "step(assistant message) -> (messages, reward, done), and an "
          "optional tools attribute (jaxrlhf/agents/environments.py). '' = "
          "single-turn responses. Decoder-only policies with a chat "
          "template."),
        F("tools", "",
          "'pkg.module:fn,pkg.module:fn2': tools offered to the model "
          "without an environment: the prompt opens the episode, each call "
          "runs and its result comes back as a tool message, and the "
          "episode ends when the model answers without a call; "
          "config.rewards scores that answer. Plain functions with type "
          "hints and a docstring (jaxrlhf/agents/tools.py)."),
        F("tool_call_style", "qwen",
          "How tool calls are read from the model's turns: the format of "
          "its family's chat template (jaxrlhf/agents/tool_calls.py).",
          choices=tool_calls.STYLES),
        F("tool_call_pattern", "",
          "tool_call_style 'regex': a regular expression with the named "
          "groups 'name' and 'arguments' (a JSON object)."),
        F("max_turns", 8,
          "An episode's most model turns.", bounds=">0"),
        F("max_episode_tokens", None,
          "An episode's most tokens after its opening, the model's and its "
          "environment's together (the rollout's response length); an "
          "episode that would pass it ends, overflowed. Unset = max_turns "
          "x max_new_tokens (max_new_tokens bounds each turn).",
          type=int, bounds=">0"),
        F("overflow_reward", 0.0,
          "Added to the return of an episode that overflowed: a turn that "
          "reached max_new_tokens without its end, or a conversation past "
          "max_episode_tokens.", bounds=config_schema.ANY_NUMBER),
        F("failed_call_reward", 0.0,
          "Added to an episode's return per failed tool call (bad JSON, an "
          "unknown tool, arguments that do not fit its schema); the model "
          "reads the error as the tool's reply either way.",
          bounds=config_schema.ANY_NUMBER),
        F("env_timeout_s", 60.0,
          "Seconds an environment's reset() or step() may take (all "
          "episodes' at once, in threads); a call that takes longer is a "
          "failed episode (rewards.on_bad_row). 0 = no limit.",
          bounds=">=0"),
        F("turn_discount", 1.0,
          "The weight of step i's environment reward in an episode's "
          "return is turn_discount ** i.", bounds=">0"),
        F("extend_kv_cache", True,
          "Between turns, extend the KV cache with the environment's "
          "tokens (the earlier turns are not recomputed); False prefills "
          "the whole conversation again every turn (the same episodes; "
          "experiments/bench_agents.py measures both)."),
    ])


def check_online(c) -> None:
  """What every online algorithm that trains on rewards needs: rewards to
  train on (`reward_sources.check_rewards`), and `check_sampling`."""
  reward_sources.check_rewards(c)
  check_sampling(c)


def check_sampling(c) -> None:
  """What every online algorithm needs: deterministic log-probs, a valid
  off-policy setup and importance band, and episodes that can run."""
  config_schema.require(
      c.model.dropout_rate == 0, "model.dropout_rate",
      f"{c.model.dropout_rate}: online RL needs deterministic log-probs (PPO "
      "details, detail 7: with dropout the ratios are not 1 before the first "
      "update); set it to 0.")
  check_off_policy(c)
  teacher.check_distill(c)
  o = c.online
  config_schema.require(
      o.importance_ratio_low < o.importance_ratio_high,
      "online.importance_ratio_low",
      f"{o.importance_ratio_low} is not below online.importance_ratio_high "
      f"({o.importance_ratio_high}): the band of kept ratios would be "
      "empty.")
  check_episodes(c)
  check_engine(c)


# The continuous engine's page size where online.engine_page_size is unset
# and it decodes on pages (engine 'auto', episodes).
DEFAULT_PAGE_SIZE = 16


def _engine_limits(c):
  """(holds, field, why) for each setting the continuous engine does not
  decode yet: where one fails, engine 'auto' decodes in lockstep."""
  o = c.online
  return (
      (not registry.get_family(c.model.arch).encoder_decoder, "model.arch",
       f"{c.model.arch!r} is an encoder-decoder"),
      (o.cache_segments in (None, 1), "online.cache_segments",
       f"{o.cache_segments} (segments)"))


def decoding(c) -> Tuple[str, Optional[int]]:
  """(engine, page size) a run of config `c` decodes with:
  online.engine, 'auto' resolved ('continuous' unless one of
  `_engine_limits` fails, then 'lockstep'), and the continuous engine's
  page size (online.engine_page_size; unset: DEFAULT_PAGE_SIZE under
  'auto' and for episodes, None, a contiguous cache, for single-turn
  responses under 'continuous'; None in lockstep)."""
  o = c.online
  engine = o.engine
  if engine == "auto":
    engine = ("continuous" if all(ok for ok, _, _ in _engine_limits(c))
              else "lockstep")
  if engine != "continuous":
    return engine, None
  if o.engine == "auto" or environments.episodic(o):
    return engine, o.engine_page_size or DEFAULT_PAGE_SIZE
  return engine, o.engine_page_size


def check_engine(c) -> None:
  """engine 'continuous' decodes single-turn responses or episodes of a
  decoder-only policy, reading the whole cache; its page settings need
  it."""
  o = c.online
  if o.engine == "continuous":
    for ok, field, why in _engine_limits(c):
      config_schema.require(
          ok, field, f"{why}: online.engine='continuous' does not support "
          "it yet; set online.engine='lockstep' (or 'auto').")
  engine, page_size = decoding(c)
  config_schema.require(
      engine == "continuous" or o.engine_page_size is None,
      "online.engine_page_size", f"{o.engine_page_size} pages the "
      f"continuous engine's cache only, and this run decodes in lockstep "
      f"(online.engine={o.engine!r}); unset it, or set "
      "online.engine='continuous' where it decodes the policy.")
  config_schema.require(
      o.engine_pages is None or page_size is not None,
      "online.engine_pages", f"{o.engine_pages} pages the continuous "
      "engine's pool only; set online.engine='continuous' with "
      "online.engine_page_size (or episodes), or 'auto' where it decodes "
      "the policy, or unset it.")
  if engine != "continuous":
    return
  arch = registry.get_family(c.model.arch)
  config_schema.require(
      not issubclass(arch.module_cls, moe_decoder.MoeCausalLM) or page_size,
      "online.engine_page_size", f"unset with a mixture-of-experts policy "
      f"({c.model.arch!r}): the continuous engine's contiguous cache "
      "decodes each slot under vmap, which the experts' grouped matmul "
      "(ragged_dot) does not take; set online.engine_page_size (e.g. 16).")


def replays_routes(config, module) -> bool:
  """Whether a run of `config` with policy `module` replays the sampler's
  routing (`online.router_replay` on a mixture-of-experts policy)."""
  return sampling.records_routes(module, config.online.router_replay)


def check_episodes(c) -> None:
  """Episodes: one way to make them, and a pattern for the regex
  style."""
  o = c.online
  config_schema.require(
      not (o.environment and o.tools), "online.tools",
      "set with online.environment: an environment offers its own tools "
      "(its tools attribute); set one of them.")
  config_schema.require(
      o.tool_call_style != "regex" or bool(o.tool_call_pattern),
      "online.tool_call_pattern",
      "tool_call_style 'regex' reads calls with a pattern; give one with "
      "the named groups 'name' and 'arguments'.")


def check_off_policy(c) -> None:
  """Partial rollouts work on episodes played ahead by the continuous
  engine."""
  o = c.online
  config_schema.require(
      not o.partial_rollouts or (
          o.off_policy_steps and environments.episodic(o)
          and decoding(c)[0] == "continuous"),
      "online.partial_rollouts", "True needs episodes (online.environment "
      "or online.tools) played ahead (online.off_policy_steps >= 1) on the "
      "continuous engine (online.engine 'auto' or 'continuous'): it hands "
      "new parameters over between the episode engine's decode chunks, "
      "and single-turn responses decode in one compiled loop.")


def check_groups_of_two(c) -> None:
  """RLOO and GRPO compare the responses to one prompt."""
  config_schema.require(
      c.online.samples_per_prompt is None or c.online.samples_per_prompt >= 2,
      "online.samples_per_prompt",
      f"{c.algorithm} compares the responses to one prompt; it needs at "
      "least 2.")


def importance_correction(config) -> str:
  """`online.importance_correction`, or its default when unset: token_tis
  for a decoupled off-policy step, else none."""
  o = config.online
  if o.importance_correction is not None:
    return o.importance_correction
  decoupled = o.off_policy_steps and o.off_policy_correction == "decoupled"
  return "token_tis" if decoupled else "none"


def resolve(value, default):
  """`value`, or `default` while it is unset (None)."""
  return default if value is None else value


def check_rows(algorithm, config, data_parallel: int) -> None:
  """The prompts split over the data shards, the rows of an update into
  minibatches and micro-batches (`update.check_split`): from the config
  alone, so that a run is refused before anything is written."""
  training = algorithm.training
  batch = config.train.batch_size
  samples = resolve(config.online.samples_per_prompt,
                     training.samples_per_prompt)
  minibatches = config.online.num_minibatches
  if batch % data_parallel:
    raise ValueError(
        f"config.train.batch_size: {batch} prompts per step cannot be split "
        f"over {data_parallel} data-parallel shards; use a multiple of "
        f"{data_parallel}.")
  total = batch * samples
  # An algorithm that selects rows refuses an impossible selection itself,
  # naming its own field.
  rows = (training.update_rows(config, batch, total) if training.update_rows
          else total)
  if rows % minibatches:
    raise ValueError(
        f"config.online.num_minibatches: {rows} responses per step "
        f"(train.batch_size {batch} x {samples} per prompt"
        f"{'' if rows == total else ', selected'}) do not split into "
        f"{minibatches} equal minibatches.")
  if rows != total and importance_correction(config) != "none":
    field = ("off_policy_correction"
             if config.online.importance_correction is None
             else "importance_correction")
    raise ValueError(
        f"config.online.{field}: {config.algorithm} trains on the responses "
        "it selects, with no advantages to weight; use "
        f"{'sampling' if field == 'off_policy_correction' else 'none'} (an "
        "off-policy step then trains on the selected samples as they "
        "are).")
  per_minibatch = rows // minibatches
  parts = config.online.rollout_microbatches
  if batch % parts or (batch // parts) % data_parallel:
    raise ValueError(
        f"config.online.rollout_microbatches: {batch} prompts per step "
        f"(train.batch_size) must split into {parts} equal parts, each a "
        f"multiple of the {data_parallel} data-parallel shards; use a "
        f"divisor of {batch // data_parallel}.")
  update_lib.check_split(
      per_minibatch, config.train.num_microbatches, data_parallel,
      what=(f"each minibatch update of {config.algorithm} "
            f"({per_minibatch} responses: {rows} per step / "
            f"online.num_minibatches {minibatches})"),
      field="online.num_minibatches / config.train.num_microbatches")


