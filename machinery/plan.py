"""`rl.py CONFIG mode=plan [world_size=16 plan_mfu=0.3 ...]`: will the config fit, how long will a
step take, what does a fault cost? Arithmetic on the model's config.json (docs/gpu.md explains each
figure); tests/test_plan.py checks each memory and byte term against the real code on CPU."""
import dataclasses
import itertools
import json
import math
from pathlib import Path

from machinery.config import (REPO, ConfigError, NonNegativeFloat, NonNegativeInt, PositiveFloat,
                              PositiveFraction, PositiveInt, load_config)
from machinery.engine import kv_bytes_per_token, trajectories_that_fit

GiB = 2**30
# Memory as the driver reports it (torch.cuda.mem_get_info's total), not the marketing number.
GPUS = {"H100-80GB": 81559 * 2**20, "H200": 143771 * 2**20, "MI300X": 196592 * 2**20}
# Dense bf16 matmul peak per GPU (data sheets; the H200 is the H100's chip with more memory)
PEAK_BF16_FLOPS = {"H100-80GB": 989e12, "H200": 989e12, "MI300X": 1307e12}
# Estimates of what a CPU cannot measure (tools/gpu_check.py records the real ones)
CUDA_CONTEXT = 1 * GiB           # CUDA/HIP context, cuBLAS/NCCL workspaces: outside every tensor
ENGINE_BATCH_TOKENS = 16384      # vLLM's max_num_batched_tokens on GPUs >= 70 GiB (arg_utils)
ENGINE_MAX_SEQS = 1024           # ... and max_num_seqs, which caps K
TOLERANCE = 0.20  # a memory term's error bound (tests/test_plan.py): estimates count this higher


@dataclasses.dataclass
class ModelShape:
    """The dimensions that memory depends on (Qwen3 / Qwen2 / Llama decoder layout)."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = True          # Qwen3 normalises q and k per head; Qwen2 and Llama do not

    @classmethod
    def from_config(cls, path):
        c = json.loads(Path(path).read_text())
        return cls(hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
                   kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                   head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   qk_norm=c.get("model_type") == "qwen3")

    def layer_shapes(self):  # a decoder layer's tensors: q, k, v, o, norms, the MLP (no biases)
        h, q, kv, d, i = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim,
                          self.head_dim, self.intermediate)
        return ([(q, h), (kv, h), (kv, h), (h, q)] + [(d,), (d,)] * self.qk_norm
                + [(i, h), (i, h), (h, i), (h,), (h,)])

    def root_shapes(self):  # the root FSDP unit: embeddings and an untied lm_head, final norm
        return [(self.vocab, self.hidden)] * (2 - self.tied) + [(self.hidden,)]

    def shapes(self):
        return self.root_shapes() + self.layer_shapes() * self.layers

    def numel(self, shapes=None):
        return sum(math.prod(s) for s in (self.shapes() if shapes is None else shapes))


def shard_numel(shape, world):  # FSDP2 shards dim 0: ceil(dim0 / world) rows a rank
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def padded_numel(shapes, world):
    return sum(shard_numel(s, world) * world for s in shapes)


def saved_per_token_layer(m, c):
    """Bytes autograd saves per token for one decoder layer, c = compute dtype bytes."""
    # HF's RMSNorm computes in fp32: fp32 input, fp32 rsqrt, the normalised tensor in compute dtype
    def norm(width, count=1):
        return count * (4 * width + 4 + c * width)

    h, d, heads, kv = m.hidden, m.head_dim, m.heads, m.kv_heads
    attention = (norm(h) + c * h  # input norm, and its output (q/k/v projections' input)
                 + (norm(d, heads) + norm(d, kv) if m.qk_norm else c * d * (heads + kv))
                 # SDPA: q, k, v (GQA: kv heads), out, fp32 logsumexp
                 + c * d * (2 * heads + 2 * kv) + 4 * heads)
    mlp = norm(h) + c * h + 4 * c * m.intermediate  # post norm; gate, up, silu(gate), silu * up
    return attention + mlp


def trunk_saved_bytes(m, tokens, c, checkpointing):
    """Saved for backward: each layer's activations (or input, checkpointing), ids, RoPE, norm."""
    per_layer = c * m.hidden if checkpointing else saved_per_token_layer(m, c)
    shared = 8 + 2 * c * m.head_dim + 4 * m.hidden + 4 + 2 * c * m.hidden
    return tokens * (m.layers * per_layer + shared)


def trainer_memory(m, world, tokens, chunk, checkpointing, c=2, prefetch=2):
    """Per-rank bytes of the trainer: resident state and the peak of one micro-batch. c: compute
    bytes; prefetch: decoder layers gathered at once (2 on GPU, 1 on CPU, which has no streams)."""
    master = 4 * sum(shard_numel(s, world) for s in m.shapes())
    layer_numel, root_numel = m.numel(m.layer_shapes()), m.numel(m.root_shapes())
    gathered_root = c * root_numel  # the root stays gathered through forward and backward
    saved = trunk_saved_bytes(m, tokens, c, checkpointing)
    recompute = tokens * saved_per_token_layer(m, c) if checkpointing else 0
    # backward of a decoder layer (measured on CPU): its gathered parameters, their gradients, the
    # layer recomputed, and its activations' gradients, about a quarter of its saved tensors
    layer_backward = (c * prefetch * layer_numel + c * layer_numel + recompute
                      + tokens * saved_per_token_layer(m, c) // 4)
    resident = 4 * master  # master + fp32 grads + two AdamW moments
    head_grad = c * m.vocab * m.hidden  # the output projection's gradient until the root's reduce
    # the log-prob head, `chunk` tokens at a time (0: all): fp32 logits and three fp32 temporaries
    # of their gradient per vocabulary entry, in bf16 compute too (measured)
    logprob_head = 16 * min(tokens, chunk or tokens) * m.vocab
    candidates = {
        # chunked, the projection's gradient already exists from the chunks before
        "log-prob head backward": (resident + gathered_root + saved + logprob_head
                                   + (head_grad if chunk and chunk < tokens else 0)),
        "decoder layer backward": resident + gathered_root + head_grad + saved + layer_backward,
        # the root's reduce-scatter at the end: its compute-dtype gradients and their fp32 copy
        "root reduce-scatter": resident + gathered_root + (c + 4) * root_numel,
    }

    phase = max(candidates, key=candidates.get)
    return dict(master=master, grads=master, adam=2 * master, resident_rollout=3 * master,
                resident_train=resident, peak=candidates[phase], peak_phase=phase,
                logprob_head=logprob_head)


def max_concurrency(kv_cache_bytes, m, context_len, tp=1, c=2, max_seqs=ENGINE_MAX_SEQS,
                    block=16):  # K of §3.2 as the engine counts it; 16: vLLM's block size
    per_token = kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, c, tp)
    return trajectories_that_fit(max(0, kv_cache_bytes) // (block * per_token), block, context_len,
                                 max_seqs)


def engine_memory(m, rollout, gpu_bytes, c=2):
    """vLLM's share at gpu_memory_utilization: weights, its profile run (estimate: the widest layer
    at ENGINE_BATCH_TOKENS, fp32 logits twice for ENGINE_MAX_SEQS), the KV cache left, and K."""
    tp = rollout.tensor_parallel_size
    weights = c * m.numel() // tp
    activations = (ENGINE_BATCH_TOKENS * c * (3 * m.intermediate + 4 * m.hidden) // tp
                   + 2 * 4 * ENGINE_MAX_SEQS * m.vocab)
    budget = int(rollout.gpu_memory_utilization * gpu_bytes)
    kv_cache = budget - weights - activations - CUDA_CONTEXT
    return dict(budget=budget, weights=weights, activations=activations, kv_cache=kv_cache,
                K=max_concurrency(kv_cache, m, rollout.context_len, tp, c),
                # vLLM's CUDA graph pool (estimate), captured after the KV cache is sized
                graphs=0 if rollout.enforce_eager else 1 * GiB)


def fsdp_bytes_per_micro_batch(m, world, c=2):
    """FSDP2: forward gathers every unit, backward the layers again (the root stays gathered),
    gradients reduce-scattered in fp32 (model.build_model's reduce_dtype)."""
    share = (world - 1) / world
    everything = padded_numel(m.shapes(), world)
    layers = everything - padded_numel(m.root_shapes(), world)
    return dict(forward_all_gather=int(c * everything * share),
                backward_all_gather=int(c * layers * share),
                reduce_scatter=int(4 * everything * share))


def weight_sync_bytes(m, rollout, world):
    """What a rank receives in the weight sync: the others' shards, cast to the engine's dtype."""
    engine_c = 4 if rollout.dtype == "float32" else 2
    return int(engine_c * padded_numel(m.shapes(), world) * (world - 1) / world)


def resolve_model_config(cfg):
    """plan_model_config, else the model directory's config.json or configs/models/<name>.json."""
    if cfg.plan_model_config:
        path = REPO / cfg.plan_model_config  # an absolute path stays itself
        return path / "config.json" if path.is_dir() else path
    for path in (REPO / cfg.model / "config.json",
                 REPO / "configs" / "models" / f"{Path(cfg.model).name}.json"):
        if path.is_file():
            return path
    raise ConfigError(f"model={cfg.model}: no config.json; pass plan_model_config=PATH")


def plan(cfg, m, world, gpu_bytes):
    """Every phase's per-rank bytes on a GPU of `gpu_bytes`, which do not fit, what to change."""
    train = trainer_memory(m, world, cfg.micro_batch_tokens, cfg.logprob_chunk_tokens,
                           cfg.activation_checkpointing)
    engine = engine_memory(m, cfg.rollout, gpu_bytes)
    # vLLM's start (util x GPU free beside the master shard) fits wherever the rollout phase does
    phases = {
        # gradients are freed after optimizer.step(): master and AdamW moments stay
        "rollout": train["resident_rollout"] + CUDA_CONTEXT + engine["budget"] + engine["graphs"],
        # engine weights awake, KV cache asleep, one bucket of full bf16 tensors (or the largest;
        # 64 MiB: distributed.WEIGHT_SYNC_BUCKET_BYTES)
        "weight sync": (train["resident_rollout"] + CUDA_CONTEXT + engine["weights"]
                        + engine["graphs"] + max(64 * 2**20, 2 * max(map(math.prod, m.shapes())))),
        "training": train["peak"] + CUDA_CONTEXT + engine["graphs"],  # the engine asleep
    }

    exact = {"rollout": engine["budget"]}  # all else estimated
    estimated = {name: size - exact.get(name, 0) for name, size in phases.items()}
    fits = {name: size + TOLERANCE * estimated[name] <= gpu_bytes for name, size in phases.items()}
    advice = [f"{name}: " + what_to_change(cfg, m, world, gpu_bytes, name, estimated[name])
              for name in phases if not fits[name]]
    if engine["K"] < 1:
        advice.append(
            f"rollout: rollout.tensor_parallel_size={2 * cfg.rollout.tensor_parallel_size}")
    return dict(train=train, engine=engine, phases=phases, fits=fits, advice=advice)


def what_to_change(cfg, m, world, gpu_bytes, phase, estimated):
    """The change that gives `phase` (`estimated` bytes of it estimates) TOLERANCE of room."""
    more = f"more ranks (world_size={2 * world})"
    if phase == "training":
        first = ("activation_checkpointing=true" if not cfg.activation_checkpointing else
                 f"micro_batch_tokens={max(cfg.rollout.context_len, cfg.micro_batch_tokens // 2)}")
        return f"{first}, or {more}"
    if phase == "rollout":
        room = math.floor(100 * (gpu_bytes - (1 + TOLERANCE) * estimated) / gpu_bytes) / 100
        k = engine_memory(m, dataclasses.replace(cfg.rollout, gpu_memory_utilization=room),
                          gpu_bytes)["K"]
        return f"rollout.gpu_memory_utilization={room:.2f} (K = {k}), or {more}"
    return more


def fit_verdict(p, gpu_bytes):
    """"fits", or what does not (within TOLERANCE) and its GiB."""
    bad = [f"{phase} {p['phases'][phase] / GiB:.2f} of {gpu_bytes / GiB:.2f} GiB"
           for phase, ok in p["fits"].items() if not ok] + ["K = 0"] * (p["engine"]["K"] < 1)
    return f"does not fit within the plan's {TOLERANCE:.0%}: {', '.join(bad)}" if bad else "fits"


def launch_note(cfg, world, gpus=GPUS):
    """rl.py's note at start when torchrun's world is not world_size: what does not fit there."""
    if not cfg.world_size or cfg.world_size == world:
        return ""
    note = (f"world_size={cfg.world_size} is the plan's assumption, not a requirement: this launch "
            f"has {world} ranks; its plan: python rl.py CONFIG mode=plan world_size={world}")
    try:
        m = ModelShape.from_config(resolve_model_config(cfg))
    except ConfigError:
        return note
    return "\n".join([note] + [
        f"  {name} at {world} ranks: {verdict}; change " + "; or ".join(p["advice"])
        for name, gpu_bytes in gpus.items()
        if (verdict := fit_verdict(p := plan(cfg, m, world, gpu_bytes), gpu_bytes)) != "fits"])


@dataclasses.dataclass
class PlanAssumptions:
    """mode=plan's assumptions (`plan_mfu=0.3` on rl.py's command line), not in rl.RLConfig, so a
    run's saved config holds the method alone. Stated, not measured."""
    plan_decode_tok_s: PositiveFloat = 40.0   # tokens/s of ONE sequence while K share a GPU
    plan_mfu: PositiveFraction = 0.35  # share of the dense bf16 peak the trainer's matmuls reach
    plan_nvlink_gb_s: PositiveFloat = 450.0   # GB/s per GPU per direction within a node (NVLink 4)
    plan_network_gb_s: PositiveFloat = 50.0   # GB/s per GPU between nodes: a 400 Gb/s NIC each
    plan_gpus_per_node: PositiveInt = 8
    plan_prompt_tokens: NonNegativeInt = 0    # mean prompt tokens; 0 = rollout.max_prompt_tokens
    plan_response_tokens: NonNegativeInt = 0  # mean response tokens; 0 = its max_response_tokens
    plan_start_step: NonNegativeInt = 0       # the step this run starts from (stage 2: 300)
    plan_fs_write_gb_s: PositiveFloat = 5.0   # GB/s the shared filesystem takes from all saves
    plan_fs_read_gb_s: PositiveFloat = 5.0    # GB/s a restart reads the shards and the model at
    plan_engine_start_s: NonNegativeFloat = 180.0  # launch to the engine's first token
    plan_faults_per_week: PositiveFloat = 2.0  # job-stopping, all causes, 8 nodes (docs/gpu.md)
    plan_detect_s: NonNegativeFloat = 300.0    # a hang is seen when the heartbeat lapses
    plan_requeue_s: NonNegativeFloat = 180.0   # stop, Slurm's hold, restart (measured, .ci/slurm)
    plan_lease_s: NonNegativeFloat = 300.0     # the run lease a requeue onto another host waits out


def split_plan_args(argv, config_class):
    """rl.py's argv -> (its own, mode=plan's assumptions: plan_* keys config_class lacks)."""
    own = {f.name for f in dataclasses.fields(config_class)}
    assumptions = [arg for arg in argv if "=" in arg and arg.startswith("plan_")
                   and arg.split("=", 1)[0] not in own]
    return [arg for arg in argv if arg not in assumptions], assumptions


def load_assumptions(cfg, plan_args):
    if plan_args and cfg.mode != "plan":
        raise ConfigError(f"{plan_args[0]}: an assumption of mode=plan; add mode=plan")
    a = load_config(PlanAssumptions, list(plan_args))
    if a.plan_start_step >= cfg.steps:
        raise ConfigError(f"plan_start_step={a.plan_start_step}: must be below steps={cfg.steps}")
    return a


def link_seconds(received, world, a):
    """Seconds to receive `received` bytes: the node's GPUs' share over NVLink, the rest over the
    network (a ring is bound by its slowest hop: about the same)."""
    if world == 1:
        return 0.0
    intra = received * (min(a.plan_gpus_per_node, world) - 1) / (world - 1)
    return intra / (a.plan_nvlink_gb_s * 1e9) + (received - intra) / (a.plan_network_gb_s * 1e9)


def step_time(cfg, m, world, a, gpus=GPUS):
    """Each term of a step's seconds per GPU (docs/gpu.md, how long a step takes); FSDP overlaps
    compute (FSDP2 prefetches)."""
    r = cfg.rollout
    prompt = a.plan_prompt_tokens or r.max_prompt_tokens
    response = a.plan_response_tokens or r.max_response_tokens
    engines = world // r.tensor_parallel_size  # a tensor-parallel group of ranks is one engine
    rollouts = math.ceil(cfg.prompts_per_step * cfg.rollouts_per_prompt / engines)
    kept = math.ceil(cfg.prompts_per_step * cfg.group_size / world)
    micro_batches = math.ceil(kept / max(1, cfg.micro_batch_tokens // (prompt + response)))
    tokens = kept * (prompt + response)
    head = m.vocab * m.hidden
    multiply = m.numel() - (0 if m.tied else head)  # an embedding lookup multiplies nothing
    # torch's non-reentrant checkpoint stops recomputing once backward has what it saved
    # (early_stop, torch/utils/checkpoint.py): a layer is rerun up to the down projection's input
    rerun_layers = m.layers * (m.numel(m.layer_shapes()) - m.hidden * m.intermediate)
    recomputed = ((rerun_layers if cfg.activation_checkpointing else 0)
                  + (head if cfg.logprob_chunk_tokens else 0))
    old_logprob_pass = cfg.mini_batches > 1  # rl.rl_step: else the update's forward gives them
    flops = dict(old_logprobs=2 * multiply * tokens * old_logprob_pass,
                 update=6 * multiply * tokens, recompute=2 * recomputed * tokens)
    fsdp = fsdp_bytes_per_micro_batch(m, world)
    all_gather = micro_batches * ((1 + old_logprob_pass) * fsdp["forward_all_gather"]
                                  + fsdp["backward_all_gather"])
    fsdp_s = dict(all_gather=link_seconds(all_gather, world, a),
                  reduce_scatter=link_seconds(micro_batches * fsdp["reduce_scatter"], world, a))
    sync_bytes = weight_sync_bytes(m, r, world)

    out = dict(prompt=prompt, response=response, engines=engines, rollouts=rollouts, kept=kept,
               micro_batches=micro_batches, tokens=tokens, multiply=multiply, flops=flops,
               recomputed=recomputed, all_gather_bytes=all_gather, fsdp_s=fsdp_s,
               reduce_scatter_bytes=micro_batches * fsdp["reduce_scatter"], sync_bytes=sync_bytes,
               sync_s=link_seconds(sync_bytes, world, a), gpus={})
    for name, gpu_bytes in gpus.items():
        k = engine_memory(m, r, gpu_bytes)["K"]  # each trajectory admitted at its full budget
        running = min(k, rollouts, r.max_concurrency or k)
        # never less than the longest response alone: the last to finish
        t = dict(K=k, decode=(max(rollouts * response / running, r.max_response_tokens)
                              / a.plan_decode_tok_s if running else math.inf),
                 **{term: f / (PEAK_BF16_FLOPS[name] * a.plan_mfu) for term, f in flops.items()})
        t["compute"] = t["old_logprobs"] + t["update"] + t["recompute"]
        t["step"] = t["decode"] + max(t["compute"], sum(fsdp_s.values())) + out["sync_s"]
        out["gpus"][name] = t
    return out


def checkpoint_bytes(m):
    """DCP's bytes: fp32 master and two AdamW moments, 12 a parameter (a tied embedding's weight
    twice)."""
    return 12 * m.numel() + 4 * (m.vocab * m.hidden if m.tied else 0)


def lost_share(save_every, step_s, save_s, restart_s, mtbf_s):
    """The share of a run's time lost to saves and faults, to first order (Young 1974, Daly 2006):
    per fault the restart and half an interval redone."""
    interval = save_every * step_s + save_s
    return save_s / interval + (interval / 2 + restart_s) / mtbf_s


def restarts_for(expected_faults, certainty=0.99):
    """torchrun's --max-restarts that covers a Poisson count of faults with `certainty`."""
    return next(k for k in itertools.count()
                if sum(expected_faults**i / math.factorial(i) for i in range(k + 1))
                * math.exp(-expected_faults) >= certainty)


def cluster_needs(cfg, m, world, a, gpus=GPUS):
    """Checkpoints, a restart's parts, faults and the save cadence."""
    s = step_time(cfg, m, world, a, gpus)
    ckpt = checkpoint_bytes(m)
    write_s = ckpt / (a.plan_fs_write_gb_s * 1e9)
    # rank 0 reads the bf16 model and broadcasts it in fp32, every rank reads its shard
    model = 2 * m.numel() / (a.plan_fs_read_gb_s * 1e9) + link_seconds(4 * m.numel(), world, a)
    restart = dict(detect=a.plan_detect_s, requeue=a.plan_requeue_s, lease=a.plan_lease_s,
                   model=model, checkpoint=ckpt / (a.plan_fs_read_gb_s * 1e9),
                   engine=a.plan_engine_start_s)
    restart["total"] = sum(restart.values())
    nodes = math.ceil(world / a.plan_gpus_per_node)
    mtbf = 7 * 86400 / (a.plan_faults_per_week * nodes / 8)
    steps = cfg.steps - a.plan_start_step

    per_gpu = {}
    for name, t in s["gpus"].items():
        lost = lost_share(cfg.save_every, t["step"], write_s, restart["total"], mtbf)
        faults = steps * t["step"] / mtbf
        per_gpu[name] = dict(faults=faults, max_restarts=restarts_for(faults), lost_config=lost,
                             days_with_faults=steps * t["step"] / 86400 / (1 - lost))

    # one cadence for a config that may run on any of these GPUs: the least worst-case loss (each
    # GPU's loss is convex in save_every, so is their maximum: its first dip is the least)
    def worst(k):
        return max(lost_share(k, t["step"], write_s, restart["total"], mtbf)
                   for t in s["gpus"].values())

    save_every = next(k for k in itertools.count(1) if worst(k + 1) >= worst(k))
    return dict(step=s, checkpoint=ckpt, write_s=write_s, restart=restart, mtbf=mtbf, nodes=nodes,
                gpus=per_gpu, save_every=save_every,
                max_restarts=max(g["max_restarts"] for g in per_gpu.values()))


def table_row(label, values, fmt="12.1f"):  # a label, then one value per GPU
    return f"  {label:58s}" + "".join(f"{v:{fmt}}" for v in values)


def format_plan(cfg, m, world, a, config_path, gpus=GPUS):
    r, steps, size = cfg.rollout, cfg.steps - a.plan_start_step, len(gpus)
    plans = [plan(cfg, m, world, gpu_bytes) for gpu_bytes in gpus.values()]
    t = plans[0]["train"]
    c = cluster_needs(cfg, m, world, a, gpus)
    s, ckpt, numel = c["step"], c["checkpoint"], m.numel()
    times, cluster = list(s["gpus"].values()), list(c["gpus"].values())
    header = f"  {'':58s}" + "".join(f"{name:>12s}" for name in gpus)
    assumed = [f"{f.name}={getattr(a, f.name)}" for f in dataclasses.fields(a)]

    lines = [f"plan for {cfg.model} ({numel / 1e9:.2f}B parameters, shapes from {config_path}) on "
             f"{world} ranks: GiB per rank (bf16 compute, fp32 master weights and AdamW, FSDP2)",
             header, table_row("trainer: fp32 master weights, gradients, AdamW (shards)",
                               [t["resident_train"] / GiB] * size, "12.2f"),
             table_row(f"training peak ({t['peak_phase']})", [t["peak"] / GiB] * size, "12.2f"),
             table_row("K: full-length trajectories in the KV cache at once",
                       [p["engine"]["K"] for p in plans], "12d")]
    lines += [table_row("phase: " + phase, [f"{p['phases'][phase] / GiB:9.2f} "
                                            f"{'ok' if p['fits'][phase] else 'NO'}" for p in plans],
                        ">12s") for phase in plans[0]["phases"]]
    lines += [table_row("GPU memory", [gpu_bytes / GiB for gpu_bytes in gpus.values()], "12.2f")]
    lines += [f"{name}: {fit_verdict(p, gpu_bytes)}"
              + "".join(f"\n    change {x}" for x in p["advice"])
              for (name, gpu_bytes), p in zip(gpus.items(), plans)]

    lines += ["seconds per step, estimated from these assumptions (key=value overrides them):"]
    lines += ["  " + "  ".join(assumed[i:i + 5]) for i in range(0, len(assumed), 5)]
    lines += [f"  per engine ({s['engines']} of TP {r.tensor_parallel_size}): n = {s['rollouts']} "
              f"rollouts of R = {s['response']} tokens; per rank: T = {s['kept']} x "
              f"{s['prompt'] + s['response']} tokens in {s['micro_batches']} micro-batches; N = "
              f"{s['multiply'] / 1e9:.2f}B, N' = {s['recomputed'] / 1e9:.2f}B recomputed", header]
    lines += [table_row(label, values) for label, values in [
        ("rollout decode per engine: n R / (min(K, n) x tok/s)", [g["decode"] for g in times]),
        ("training: 6 N T + 2 N' T (+ 2 N T if mini_batches > 1)", [g["compute"] for g in times]),
        (f"FSDP: {(s['all_gather_bytes'] + s['reduce_scatter_bytes']) / 2**40:.2f} TiB",
         [sum(s["fsdp_s"].values())] * size),
        (f"weight sync: {s['sync_bytes'] / GiB:.2f} GiB", [s["sync_s"]] * size),
        ("step, minutes: decode + max(training, FSDP) + sync", [g["step"] / 60 for g in times]),
        (f"stage: {steps} steps ({a.plan_start_step} -> {cfg.steps}), days",
         [steps * g["step"] / 86400 for g in times])]]

    lines += [f"what a cluster run needs ({c['nodes']} node(s)): checkpoint {ckpt / GiB:.2f} GiB, "
              f"written in {c['write_s']:.0f} s; disk "
              f"{(cfg.keep_checkpoints + 1) * ckpt / GiB:.2f} GiB (keep_checkpoints + 1), "
              f"plus {2 * numel / GiB:.2f} per HF export; rank 0's host RAM {4 * numel / GiB:.2f} "
              f"GiB at start, {6 * numel / GiB:.2f} at an export",
              "  a fault's restart, minutes: " + ", ".join(
                  f"{key} {seconds / 60:.1f}" for key, seconds in c["restart"].items())
              + f"; a fault every {c['mtbf'] / 86400:.1f} days", header]
    lines += [table_row(label, [g[key] for g in cluster], fmt) for label, key, fmt in [
        (f"faults expected in the stage ({steps} steps)", "faults", "12.2f"),
        ("  --max-restarts covering them 99 times in 100", "max_restarts", "12d"),
        (f"stage, days, with faults at save_every={cfg.save_every}", "days_with_faults", "12.2f")]]
    return "\n".join(lines + [
        f"  for every GPU above: save_every={c['save_every']} (Young/Daly, the least loss on the "
        f"worst), --max-restarts={c['max_restarts']}"])


def print_plan(cfg, world, plan_args=()):
    """rl.py mode=plan."""
    a = load_assumptions(cfg, plan_args)
    tp = cfg.rollout.tensor_parallel_size
    if world % tp or a.plan_gpus_per_node % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: must divide {world} ranks and "
                          f"plan_gpus_per_node={a.plan_gpus_per_node}")
    path = resolve_model_config(cfg)
    print(format_plan(cfg, ModelShape.from_config(path), world, a,
                      path.relative_to(REPO) if path.is_relative_to(REPO) else path))
