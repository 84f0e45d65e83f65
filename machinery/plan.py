"""`rl.py CONFIG mode=plan [world_size=16 plan_mfu=0.3 ...]`: will the config fit, how long will a
step take, what does a fault cost? Per rank, every phase's memory and bytes, a step's seconds, then
checkpoints, faults and the rollout tail: arithmetic on the model's config.json following what rl.py
does on a GPU (docs/gpu.md explains each figure). tests/test_plan.py checks every memory and byte
term against the real code on CPU within TOLERANCE; GPU-only terms are estimates, the time's rates
assumptions, printed as such.
"""
import dataclasses
import itertools
import json
import math
from pathlib import Path

from machinery.config import REPO, ConfigError, load_config
from machinery.engine import kv_bytes_per_token, trajectories_that_fit
from machinery.tail import rollout_tails

GiB = 2**30
# Memory as the driver reports it (torch.cuda.mem_get_info's total), not the marketing number.
GPUS = {"H100-80GB": 81559 * 2**20, "H200": 143771 * 2**20, "MI300X": 196592 * 2**20}
# Dense bf16 matmul peak and HBM bandwidth per GPU (data sheets; the H200 is the H100's chip with
# more, faster memory): the bandwidth is decoding's roofline, printed to judge plan_decode_tok_s by
PEAK_BF16_FLOPS = {"H100-80GB": 989e12, "H200": 989e12, "MI300X": 1307e12}
HBM_BYTES_PER_S = {"H100-80GB": 3.35e12, "H200": 4.8e12, "MI300X": 5.3e12}
# Estimates of what a CPU cannot measure (tools/gpu_check.py records the real ones)
CUDA_CONTEXT = 1 * GiB           # CUDA/HIP context, cuBLAS/NCCL workspaces: outside every tensor
CUDA_GRAPHS = 1 * GiB            # vLLM's graph pool, captured after the KV cache is sized
ENGINE_BATCH_TOKENS = 16384      # vLLM's max_num_batched_tokens on GPUs >= 70 GiB (arg_utils)
ENGINE_MAX_SEQS = 1024           # ... and max_num_seqs, which caps K
KV_BLOCK = 16                    # vLLM's default block size (the KV cache's unit, in tokens)
SYNC_BUCKET = 64 * 2**20         # distributed.WEIGHT_SYNC_BUCKET_BYTES
META_BYTES = 24                  # one (length, owner, index) entry of the balance: three int64
# How far a memory term may be from a measurement (tests/test_plan.py checks each within it): a
# phase closer than this to the GPU's memory fits on paper only
TOLERANCE = 0.20
# The waits are simulated or assumed: the collective timeout should be this many times the longest
TIMEOUT_MARGIN = 2
# What a rank can wait for in one collective: the rollout tail (machinery/tail.py, the longest of
# its cases), one trajectory at the budget alone, a save, a restart's reload, an engine's start, an
# HF export
WAITS = ("tail", "trajectory", "save", "reload", "engine", "export")
WEEK = 7 * 86400


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
    attention_bias: bool = False

    @classmethod
    def from_config(cls, path):
        path = Path(path)
        try:
            c = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read the model's config.json ({e})") from None
        try:
            return cls(hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                       layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
                       kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                       head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                       vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                       qk_norm=c.get("model_type") == "qwen3",
                       attention_bias=bool(c.get("attention_bias", False)))
        except KeyError as e:
            raise ConfigError(f"{path}: no {e.args[0]!r}; expected a decoder-only Hugging Face "
                              "config.json") from None

    def layer_tensors(self):  # (name, shape) as the HF model names them
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
               ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q))]
        if self.attention_bias:
            out += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                    ("self_attn.v_proj.bias", (kv,))]
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", (self.head_dim,)),
                    ("self_attn.k_norm.weight", (self.head_dim,))]
        return out + [("mlp.gate_proj.weight", (self.intermediate, h)),
                      ("mlp.up_proj.weight", (self.intermediate, h)),
                      ("mlp.down_proj.weight", (h, self.intermediate)),
                      ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]

    def root_tensors(self):  # the root FSDP unit: what is not in a decoder layer
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden)),
               ("model.norm.weight", (self.hidden,))]
        return out if self.tied else out + [("lm_head.weight", (self.vocab, self.hidden))]

    def tensors(self):
        layers = [(f"model.layers.{i}.{n}", s)
                  for i in range(self.layers) for n, s in self.layer_tensors()]
        return self.root_tensors()[:1] + layers + self.root_tensors()[1:]

    def numel(self, tensors=None):
        return sum(math.prod(s) for _, s in (self.tensors() if tensors is None else tensors))


def shard_numel(shape, world):
    """Elements one rank holds of a tensor FSDP2 shards on dim 0: ceil(dim0 / world) rows."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def padded_numel(tensors, world):
    return sum(shard_numel(s, world) * world for _, s in tensors)


# -----------------------------------------------------------------------------
# memory per rank and phase

def saved_per_token_layer(m, c):
    """Bytes autograd saves per token for one decoder layer, c = compute dtype bytes (checked with
    saved_tensors_hooks on the real layer in tests/test_plan.py)."""
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
    """Saved for backward by the decoder for `tokens` tokens: every layer's activations, or with
    checkpointing each layer's input only; plus the ids, RoPE's cos/sin and the final norm."""
    per_layer = c * m.hidden if checkpointing else saved_per_token_layer(m, c)
    shared = 8 + 2 * c * m.head_dim + 4 * m.hidden + 4 + 2 * c * m.hidden
    return tokens * (m.layers * per_layer + shared)


def logprob_bytes(m, tokens, chunk):
    """Peak of the log-prob head over forward and backward, `chunk` tokens at a time (0: all): per
    token and vocabulary entry, the fp32 logits saved for the log-softmax and three fp32
    temporaries of its gradient, 16 bytes in fp32 and bf16 compute alike (measured)."""
    return 16 * min(tokens, chunk or tokens) * m.vocab


def trainer_memory(m, world, tokens, chunk, checkpointing, c=2, prefetch=2):
    """Per-rank bytes of the trainer: resident state and the peak of one micro-batch of `tokens`.
    c: compute bytes (2 = bf16 on GPU, 4 = fp32 on CPU); prefetch: decoder layers gathered at once
    (2 on GPU, where FSDP2 gathers the next layer while one computes; 1 on CPU, with no streams)."""
    master = 4 * sum(shard_numel(s, world) for _, s in m.tensors())
    layer_numel, root_numel = m.numel(m.layer_tensors()), m.numel(m.root_tensors())
    gathered_root = c * root_numel  # the root stays gathered through forward and backward
    gathered_layers = c * prefetch * layer_numel
    saved = trunk_saved_bytes(m, tokens, c, checkpointing)
    recompute = tokens * saved_per_token_layer(m, c) if checkpointing else 0
    # backward of a decoder layer (measured on CPU): its gathered parameters, their gradients, the
    # layer recomputed, and its activations' gradients, about a quarter of its saved tensors
    layer_backward = (gathered_layers + c * layer_numel + recompute
                      + tokens * saved_per_token_layer(m, c) // 4)
    resident = 4 * master  # master + fp32 grads + two AdamW moments
    head_grad = c * m.vocab * m.hidden  # the output projection's gradient until the root's reduce

    candidates = {
        # chunked, the projection's gradient already exists from the chunks before
        "log-prob head backward": (resident + gathered_root + saved
                                   + logprob_bytes(m, tokens, chunk)
                                   + (head_grad if chunk and chunk < tokens else 0)),
        "decoder layer backward": resident + gathered_root + head_grad + saved + layer_backward,
        # the root's reduce-scatter at the end: its compute-dtype gradients and their fp32 copy
        "root reduce-scatter": resident + gathered_root + (c + 4) * root_numel,
    }
    phase = max(candidates, key=candidates.get)
    return dict(master=master, grads=master, adam=2 * master, resident_rollout=3 * master,
                resident_train=resident, gathered_root=gathered_root,
                gathered_layers=gathered_layers, saved=saved,
                saved_no_checkpointing=trunk_saved_bytes(m, tokens, c, False),
                saved_checkpointing=trunk_saved_bytes(m, tokens, c, True), recompute=recompute,
                logprob=logprob_bytes(m, tokens, chunk),
                logprob_unchunked=logprob_bytes(m, tokens, tokens),
                peak=candidates[phase], peak_phase=phase, candidates=candidates)


def max_concurrency(kv_cache_bytes, m, context_len, tp=1, c=2, max_seqs=ENGINE_MAX_SEQS,
                    block=KV_BLOCK):  # K of §3.2 as the engine counts it
    per_token = kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, c, tp)
    return trajectories_that_fit(max(0, kv_cache_bytes) // (block * per_token), block, context_len,
                                 max_seqs)


def engine_memory(m, rollout, gpu_bytes, c=2):
    """vLLM's share at gpu_memory_utilization: its weights, its profile run's activations (estimate:
    ENGINE_BATCH_TOKENS through the widest layer, and fp32 logits of ENGINE_MAX_SEQS sequences,
    twice for processed log-probs), the context, the KV cache left, and K."""
    tp = rollout.tensor_parallel_size
    weights = c * m.numel() // tp
    activations = (ENGINE_BATCH_TOKENS * c * (3 * m.intermediate + 4 * m.hidden) // tp
                   + 2 * 4 * ENGINE_MAX_SEQS * m.vocab)
    budget = int(rollout.gpu_memory_utilization * gpu_bytes)
    kv_cache = budget - weights - activations - CUDA_CONTEXT
    return dict(budget=budget, weights=weights, activations=activations, kv_cache=kv_cache,
                K=max_concurrency(kv_cache, m, rollout.context_len, tp, c),
                graphs=0 if rollout.enforce_eager else CUDA_GRAPHS,
                host_when_asleep=weights if rollout.sleep_level == 1 else 0)


# -----------------------------------------------------------------------------
# bytes received per rank and step (logical volume: (W-1)/W of each gathered tensor)

def pickled_trajectory_bytes(prompt_tokens, response_tokens, vocab):
    """A TrainSample pickled: token ids (3 bytes below 65536, 5 above; uniform ids), the loss mask
    (2 bytes per 0/1), the engine's log-probs (9 per float), the object's ~200 bytes."""
    id_bytes = 3 + 2 * max(0, vocab - 65536) / vocab
    return int(200 + (prompt_tokens + response_tokens) * id_bytes + response_tokens * (2 + 9))


def balance_received(world, most_per_rank, arrived, vocab):
    """machinery.distributed.balance_by_tokens: the counts, every other rank's keys padded to the
    most any rank holds, the payload sizes, and the trajectories that arrive, as (prompt tokens,
    response tokens)."""
    if world == 1:
        return 0
    keys = (world - 1) * (8 + META_BYTES * most_per_rank + 8)
    return keys + sum(pickled_trajectory_bytes(p, r, vocab) for p, r in arrived)


def fsdp_bytes_per_micro_batch(m, world, c=2, reduce_c=4):
    """FSDP2 per micro-batch: forward all-gathers every unit, backward re-gathers the layers
    (resharded after forward; the root is not), gradients reduce-scattered in reduce_c bytes
    (MixedPrecisionPolicy's reduce_dtype: fp32 in model.build_model)."""
    share = (world - 1) / world
    everything = padded_numel(m.tensors(), world)
    layers = everything - padded_numel(m.root_tensors(), world)
    return dict(forward_all_gather=int(c * everything * share),
                backward_all_gather=int(c * layers * share),
                reduce_scatter=int(reduce_c * everything * share))


def bytes_moved(m, cfg, world, c=2):
    """What one rank receives in one step. The balance's payload is an upper bound: every trajectory
    a rank trains on came from elsewhere (the step logs the real count)."""
    r = cfg.rollout
    engine_c = 4 if r.dtype == "float32" else 2  # the sync casts to the engine's dtype
    share = (world - 1) / world
    kept_total = cfg.prompts_per_step * cfg.group_size
    kept_per_rank = math.ceil(kept_total / world)
    micro_batches = math.ceil(kept_per_rank / max(1, cfg.micro_batch_tokens // r.context_len))
    everything = padded_numel(m.tensors(), world)
    fsdp = fsdp_bytes_per_micro_batch(m, world, c)
    keys = balance_received(world, kept_per_rank, [], m.vocab)
    full = [(r.max_prompt_tokens, r.max_response_tokens)] * kept_per_rank
    return dict(weight_sync=int(engine_c * everything * share),
                # forward only, and only with mini_batches > 1 (rl.rl_step)
                old_logprobs=micro_batches * fsdp["forward_all_gather"] * (cfg.mini_batches > 1),
                train=micro_batches * sum(fsdp.values()), micro_batches=micro_batches,
                balance_meta=keys, kept_per_rank=kept_per_rank,
                balance_payload_max=balance_received(world, kept_per_rank, full, m.vocab) - keys)


# -----------------------------------------------------------------------------
# the plan: every phase on every GPU, and what to change

def resolve_model_config(cfg):
    """config.json for cfg.model: plan_model_config; the model directory's own; or the shape file
    shipped for a hub id (configs/models/<name>.json)."""
    if getattr(cfg, "plan_model_config", ""):
        path = Path(cfg.plan_model_config)
        path = path if path.is_absolute() else REPO / path
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"plan_model_config={cfg.plan_model_config}: no such file")
        return path
    local = Path(cfg.model) if Path(cfg.model).is_absolute() else REPO / cfg.model
    shipped = REPO / "configs" / "models" / f"{Path(cfg.model).name}.json"
    for path in (local / "config.json", shipped):
        if path.is_file():
            return path
    raise ConfigError(f"model={cfg.model}: no config.json there nor in configs/models/; pass "
                      "plan_model_config=PATH (a config.json)")


def plan(cfg, m, world, gpu_bytes):
    """Every phase's per-rank bytes on a GPU of `gpu_bytes`, which do not fit, what to change."""
    train = trainer_memory(m, world, cfg.micro_batch_tokens, cfg.logprob_chunk_tokens,
                           cfg.activation_checkpointing)
    engine = engine_memory(m, cfg.rollout, gpu_bytes)

    phases = {
        # vLLM checks at start that util x GPU is free; only the fp32 master shard exists then
        "engine start": train["master"] + CUDA_CONTEXT + engine["budget"],
        # gradients are freed after optimizer.step(): master and AdamW moments stay
        "rollout": train["resident_rollout"] + CUDA_CONTEXT + engine["budget"] + engine["graphs"],
        # engine weights awake, KV cache asleep, one bucket of full bf16 tensors (or the largest)
        "weight sync": (train["resident_rollout"] + CUDA_CONTEXT + engine["weights"]
                        + engine["graphs"]
                        + max(SYNC_BUCKET, 2 * max(math.prod(s) for _, s in m.tensors()))),
        "training": train["peak"] + CUDA_CONTEXT + engine["graphs"],  # the engine asleep
    }

    # a phase fits on paper only if it would fit with every estimate in it (all but the engine's
    # exact budget) TOLERANCE higher: those phases, and the ones that do not fit, name a change
    exact = {"engine start": engine["budget"], "rollout": engine["budget"]}
    tight = [name for name, size in phases.items()
             if size + TOLERANCE * (size - exact.get(name, 0)) > gpu_bytes]
    advice = [f"{name}: " + what_to_change(cfg, m, world, gpu_bytes, name,
                                           phases[name] - exact.get(name, 0)) for name in tight]
    if engine["K"] < 1:
        advice.append(f"rollout: the KV cache holds no full trajectory of "
                      f"{cfg.rollout.context_len} tokens; raise rollout.tensor_parallel_size to "
                      f"{2 * cfg.rollout.tensor_parallel_size} or rollout.gpu_memory_utilization")

    return dict(train=train, engine=engine, phases=phases, tight=tight, advice=advice,
                bytes=bytes_moved(m, cfg, world),
                fits={k: v <= gpu_bytes for k, v in phases.items()})


def what_to_change(cfg, m, world, gpu_bytes, phase, estimated):
    """The change that gives `phase` (`estimated` bytes of it estimates) TOLERANCE of room."""
    more = f"more ranks (world_size={2 * world})"
    if phase == "training":
        smaller = max(cfg.rollout.context_len, cfg.micro_batch_tokens // 2)
        first = ("activation_checkpointing=true" if not cfg.activation_checkpointing
                 else f"micro_batch_tokens={smaller}")
        return f"{first}, or {more}"
    if phase in ("engine start", "rollout"):
        room = math.floor(100 * (gpu_bytes - (1 + TOLERANCE) * estimated) / gpu_bytes) / 100
        k = engine_memory(m, dataclasses.replace(cfg.rollout, gpu_memory_utilization=room),
                          gpu_bytes)["K"]
        return f"rollout.gpu_memory_utilization={room:.2f} (K = {k}), or {more}"
    return more


def fit_verdict(p, gpu_bytes):
    """(fits / fits only inside the tolerance / does not fit, what to change) of one plan()."""
    bad = [phase for phase, ok in p["fits"].items() if not ok] + ["K"] * (p["engine"]["K"] < 1)
    if bad:
        return f"does not fit: {', '.join(bad)}", p["advice"]
    if not p["tight"]:
        return "fits", []
    return ("fits only inside the plan's own tolerance (its terms are checked within "
            f"{TOLERANCE:.0%}): " + ", ".join(
                f"{phase} {p['phases'][phase] / GiB:.2f} of {gpu_bytes / GiB:.2f} GiB "
                f"({1 - p['phases'][phase] / gpu_bytes:.1%} left)" for phase in p["tight"]),
            p["advice"])


def launch_note(cfg, world, gpus=GPUS):
    """What rl.py prints at start when torchrun's world is not the config's world_size (the plan's
    assumption, no requirement): the step time and fit at the real size ("" when they agree)."""
    if not cfg.world_size or cfg.world_size == world:
        return ""
    line = (f"world_size={cfg.world_size} is the plan's assumption (mode=plan), not a "
            f"requirement: this launch has {world} rank{'s' if world > 1 else ''}")
    try:
        m = ModelShape.from_config(resolve_model_config(cfg))
    except ConfigError:
        return line + " (no config.json to plan it by)"
    steps = [step_time(cfg, m, n, PlanAssumptions(), gpus)["gpus"] for n in (world, cfg.world_size)]
    minutes = lambda s: " / ".join(f"{s[name]['step'] / 60:.0f}" for name in gpus)  # noqa: E731
    lines = [f"{line}, where by the plan a step takes {minutes(steps[0])} minutes on "
             f"{' / '.join(gpus)} ({minutes(steps[1])} at {cfg.world_size})"]
    for name, size in gpus.items():
        verdict, advice = fit_verdict(plan(cfg, m, world, size), size)
        if verdict != "fits":
            lines.append(f"  {name} at {world} ranks: {verdict}; change " + "; or ".join(advice))
    lines.append(f"  the whole plan: python rl.py CONFIG mode=plan world_size={world}")
    return "\n".join(lines)


def table_row(label, values, fmt="12.1f"):  # a label, then one value per GPU
    return f"  {label:58s}" + "".join(f"{v:{fmt}}" for v in values)


def format_plan(cfg, m, world, config_path, gpus=GPUS):
    r = cfg.rollout
    plans = {name: plan(cfg, m, world, size) for name, size in gpus.items()}
    first = next(iter(plans.values()))
    t, b = first["train"], first["bytes"]
    lines = [f"plan for {cfg.model} ({m.numel() / 1e9:.2f}B parameters, shapes from {config_path}) "
             f"on {world} ranks, micro_batch_tokens={cfg.micro_batch_tokens}, "
             f"logprob_chunk_tokens={cfg.logprob_chunk_tokens}, "
             f"activation_checkpointing={cfg.activation_checkpointing}, context {r.context_len}, "
             f"gpu_memory_utilization={r.gpu_memory_utilization}, "
             f"tensor_parallel_size={r.tensor_parallel_size}",
             "GiB per rank (bf16 compute, fp32 master weights and AdamW, FSDP2 over all ranks):"]

    rows = [("trainer: fp32 master weights (shard)", "master"),
            ("trainer: fp32 gradients (shard)", "grads"),
            ("trainer: AdamW moments (shard)", "adam"),
            ("trainer: gathered root, bf16 (embeddings, lm_head)", "gathered_root"),
            ("trainer: gathered decoder layers, bf16 (with prefetch)", "gathered_layers"),
            ("activations saved, checkpointing on", "saved_checkpointing"),
            ("activations saved, checkpointing off", "saved_no_checkpointing"),
            ("one layer recomputed in backward", "recompute"),
            (f"log-prob head, chunks of {cfg.logprob_chunk_tokens} tokens", "logprob"),
            ("log-prob head, the whole micro-batch at once", "logprob_unchunked"),
            (f"training peak ({t['peak_phase']})", "peak")]
    lines += [f"  {label:58s}{t[key] / GiB:7.2f}" for label, key in rows]

    lines.append(f"  {'':58s}" + "".join(f"{name:>12s}" for name in gpus))
    for label, key in [("engine budget (gpu_memory_utilization x GPU)", "budget"),
                       ("engine weights, bf16", "weights"),
                       ("engine profile activations (estimate)", "activations"),
                       ("engine KV cache", "kv_cache")]:
        lines.append(table_row(label, [p["engine"][key] / GiB for p in plans.values()], "12.2f"))
    lines.append(table_row("K: full-length trajectories in the KV cache at once",
                           [p["engine"]["K"] for p in plans.values()], "12d"))
    for phase in first["phases"]:
        lines.append(f"  {'phase: ' + phase:58s}" + "".join(
            f"{p['phases'][phase] / GiB:9.2f} {'ok' if p['fits'][phase] else 'NO'}"
            for p in plans.values()))

    lines += [table_row("GPU memory", [size / GiB for size in gpus.values()], "12.2f"),
              f"host RAM per rank while the engine sleeps (level {r.sleep_level}): "
              f"{first['engine']['host_when_asleep'] / GiB:7.2f} GiB",
              f"GiB received per rank per step ({b['kept_per_rank']} kept trajectories per rank, "
              f"{b['micro_batches']} micro-batches at full length): weight sync (bf16 shards) "
              f"{b['weight_sync'] / GiB:.2f}, FSDP old log-probs {b['old_logprobs'] / GiB:.2f} "
              f"and update {b['train'] / GiB:.2f}, the balance's keys "
              f"{b['balance_meta'] / GiB:.4f} and trajectories {b['balance_payload_max'] / GiB:.4f}"
              " at most"]

    for name, size in gpus.items():
        verdict, advice = fit_verdict(plans[name], size)
        lines.append(f"{name}: {verdict}" + "".join(f"\n    change {a}" for a in advice))
    lines.append("Estimates, not measured: the CUDA context (1 GiB), vLLM's profile activations "
                 "and CUDA graphs (1 GiB); the rest is checked against the CPU run in "
                 "tests/test_plan.py (within 20%).")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# a step's seconds, and a stage's faults: formulas of the config and of stated assumptions

@dataclasses.dataclass
class PlanAssumptions:
    """mode=plan's assumptions, overridable on rl.py's command line (`plan_mfu=0.3`); not in
    rl.RLConfig, so a run's saved config holds the method alone. Stated, not measured."""
    plan_decode_tok_s: float = 40.0   # tokens/s of ONE sequence while K share a GPU
    plan_mfu: float = 0.35            # share of the dense bf16 peak the trainer's matmuls reach
    plan_nvlink_gb_s: float = 450.0   # GB/s per GPU per direction within a node (NVLink 4)
    plan_network_gb_s: float = 50.0   # GB/s per GPU between nodes: a 400 Gb/s NIC each
    plan_gpus_per_node: int = 8
    plan_prompt_tokens: int = 0       # mean prompt tokens; 0 = rollout.max_prompt_tokens
    plan_response_tokens: int = 0     # mean response tokens; 0 = rollout.max_response_tokens
    plan_start_step: int = 0          # the step this run starts from (stage 2: 300)
    plan_fs_write_gb_s: float = 5.0   # GB/s the shared filesystem takes from all ranks' saves
    plan_fs_read_gb_s: float = 5.0    # GB/s a restart reads the shards and the model at
    plan_engine_start_s: float = 180.0  # launch to the engine's first token, the reload apart
    # Job-stopping faults a week of an RL job on 8 nodes, all causes (GPUs, nodes, engines, tool
    # sandboxes, host RAM, filesystems, the network), scaled by the job's nodes (docs/gpu.md)
    plan_faults_per_week: float = 2.0
    # a fault's detection: a hang is seen when the heartbeat lapses (a crash in seconds)
    plan_detect_s: float = 300.0
    # torchrun's stop, Slurm's hold of a requeued job, the new attempt's start to its preflight:
    # measured end to end on a local Slurm (.ci/slurm, docs/gpu.md#slurm)
    plan_requeue_s: float = 180.0
    # the run lease's expiry, which a requeue onto another host for rank 0 waits out
    plan_lease_s: float = 300.0

    def validate(self):
        may_be_zero = ("plan_prompt_tokens", "plan_response_tokens", "plan_start_step",
                       "plan_engine_start_s", "plan_detect_s", "plan_requeue_s", "plan_lease_s")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            positive = f.name not in may_be_zero
            if not (value > 0 if positive else value >= 0):
                raise ConfigError(f"{f.name}={value}: must be {'>' if positive else '>='} 0")
        if self.plan_mfu > 1:
            raise ConfigError(f"plan_mfu={self.plan_mfu}: must be in (0, 1], a share of the peak")


def split_plan_args(argv, config_class):
    """rl.py's command line -> (its own arguments, mode=plan's assumptions): a plan_* key that
    config_class does not have is an assumption, parsed by load_assumptions."""
    own = {f.name for f in dataclasses.fields(config_class)}

    def is_assumption(arg):
        key = arg.split("=", 1)[0]
        return "=" in arg and key.startswith("plan_") and key not in own

    return [a for a in argv if not is_assumption(a)], [a for a in argv if is_assumption(a)]


def load_assumptions(cfg, plan_args):
    if plan_args and cfg.mode != "plan":
        raise ConfigError(f"{plan_args[0]}: an assumption of mode=plan; add mode=plan")
    a = load_config(PlanAssumptions, list(plan_args))
    if a.plan_start_step >= cfg.steps:
        raise ConfigError(f"plan_start_step={a.plan_start_step}: must be below steps={cfg.steps}")
    return a


def link_seconds(received, world, a):
    """Seconds to receive `received` bytes over `world` ranks: the node's own GPUs' part over
    NVLink, the rest over the network (a ring is bound by its slowest hop: about the same)."""
    if world == 1:
        return 0.0
    intra = received * (min(a.plan_gpus_per_node, world) - 1) / (world - 1)
    return intra / (a.plan_nvlink_gb_s * 1e9) + (received - intra) / (a.plan_network_gb_s * 1e9)


def step_time(cfg, m, world, a, gpus=GPUS):
    """Seconds of each term of one step on each GPU (docs/gpu.md, how long a step takes): decode, n
    rollouts per engine of R tokens, K at once, at plan_decode_tok_s each; training FLOPs (2 N T old
    log-probs with mini_batches > 1, 6 N T update, 2 N' T recomputed) at plan_mfu; FSDP and the
    weight sync over link_seconds, FSDP overlapping compute (FSDP2 prefetches)."""
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
    rerun_layers = m.layers * (m.numel(m.layer_tensors()) - m.hidden * m.intermediate)
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
    sync_bytes = bytes_moved(m, cfg, world)["weight_sync"]

    out = dict(prompt=prompt, response=response, engines=engines, rollouts=rollouts, kept=kept,
               micro_batches=micro_batches, tokens=tokens, multiply=multiply,
               recomputed=recomputed, flops=flops, all_gather_bytes=all_gather,
               reduce_scatter_bytes=micro_batches * fsdp["reduce_scatter"], fsdp_s=fsdp_s,
               sync_bytes=sync_bytes, sync_s=link_seconds(sync_bytes, world, a), gpus={})
    for name, gpu_bytes in gpus.items():
        k = engine_memory(m, r, gpu_bytes)["K"]  # each trajectory admitted at its full budget
        running = min(k, rollouts, r.max_concurrency or k)
        kv_read = (running * kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, 2,
                                                r.tensor_parallel_size) * (prompt + response / 2))
        t = dict(K=k, decode_tok_s_engine=running * a.plan_decode_tok_s,
                 roofline_tok_s=HBM_BYTES_PER_S[name] / (2 * m.numel() // r.tensor_parallel_size
                                                         + kv_read),
                 # never less than the longest response alone: the last to finish
                 decode=(max(rollouts * response / running, r.max_response_tokens)
                         / a.plan_decode_tok_s if running else math.inf),
                 **{term: f / (PEAK_BF16_FLOPS[name] * a.plan_mfu) for term, f in flops.items()})
        t["compute"] = t["old_logprobs"] + t["update"] + t["recompute"]
        t["step"] = t["decode"] + max(t["compute"], sum(fsdp_s.values())) + out["sync_s"]
        t["step_no_overlap"] = t["decode"] + t["compute"] + sum(fsdp_s.values()) + out["sync_s"]
        out["gpus"][name] = t
    return out


def format_step_time(cfg, m, world, a, gpus=GPUS):
    s = step_time(cfg, m, world, a, gpus)
    cols, fsdp = list(s["gpus"].values()), s["fsdp_s"]
    steps = cfg.steps - a.plan_start_step

    def row(label, key, fmt="12.0f"):  # key: a term of each GPU, or one number for all
        return table_row(label, [t[key] if isinstance(key, str) else key for t in cols], fmt)

    assumed = [f"{f.name}={getattr(a, f.name)}" for f in dataclasses.fields(a)]
    lines = ["seconds per step (estimates from stated assumptions, none measured; override any as "
             "key=value; docs/gpu.md says where each comes from):"]
    lines += ["  " + "  ".join(assumed[i:i + 5]) for i in range(0, len(assumed), 5)]
    lines += [f"  per engine ({s['engines']} of tensor_parallel_size="
              f"{cfg.rollout.tensor_parallel_size}): n = {s['rollouts']} rollouts of R = "
              f"{s['response']} response tokens; per rank: T = {s['kept']} kept x "
              f"{s['prompt'] + s['response']} tokens = "
              f"{s['tokens'] / 1e6:.2f}M trained in {s['micro_batches']} micro-batches; "
              f"N = {s['multiply'] / 1e9:.2f}B parameters that multiply (all but the input "
              f"embedding), N' = {s['recomputed'] / 1e9:.2f}B of them recomputed in backward",
              f"  {'':58s}" + "".join(f"{name:>12s}" for name in s["gpus"]),
              table_row("GPU peak, dense bf16 TFLOPs (data sheets)",
                        [PEAK_BF16_FLOPS[name] / 1e12 for name in s["gpus"]], "12.0f"),
              row("decode tokens/s per engine: min(K, n) x plan_decode_tok_s",
                  "decode_tok_s_engine"),
              row("  HBM roofline tokens/s per sequence at that K", "roofline_tok_s"),
              row("rollout decode per engine: n R / (its tokens/s above)", "decode"),
              row("old log-probs: 2 N T / (GPU peak x plan_mfu), mini_batches > 1 only",
                  "old_logprobs"),
              row("update: 6 N T / (GPU peak x plan_mfu)", "update"),
              row("recompute in backward: 2 N' T / (GPU peak x plan_mfu)", "recompute"),
              row(f"FSDP all-gathers, bf16 ({s['all_gather_bytes'] / 2**40:.2f} TiB)",
                  fsdp["all_gather"]),
              row(f"FSDP reduce-scatters, fp32 ({s['reduce_scatter_bytes'] / 2**40:.2f} TiB)",
                  fsdp["reduce_scatter"]),
              row("  the same in bf16 (reduce_dtype, model.build_model)",
                  fsdp["reduce_scatter"] / 2),
              row(f"weight sync ({s['sync_bytes'] / GiB:.2f} GiB of bf16 shards)", s["sync_s"],
                  "12.1f"),
              row("step: decode + max(training compute, FSDP) + sync", "step"),
              table_row("  minutes", [t["step"] / 60 for t in cols]),
              table_row("  minutes if FSDP does not overlap compute",
                        [t["step_no_overlap"] / 60 for t in cols]),
              table_row(f"stage: {steps} steps ({a.plan_start_step} -> {cfg.steps}), days",
                        [steps * t["step"] / 86400 for t in cols], "12.2f"),
              "Not counted: prefill (a prompt's 2G samples share its prefix cache), the tool "
              "calls' wall time, engine sleep/wake, the optimizer step, checkpoints, "
              "evaluation, waiting for the slowest engine (below: the rollout tail)."]
    return "\n".join(lines)


def checkpoint_bytes(m, world):
    """One DCP checkpoint: fp32 master weights and AdamW's two moments, 12 bytes a parameter, each
    rank its shard (rank 0 holds the most); a tied embedding is written twice, its moments once.
    DCP adds ~2 KB per tensor, the trainer state a few KB per rank."""
    tied = m.vocab * m.hidden if m.tied else 0
    return dict(total=12 * m.numel() + 4 * tied,
                per_rank=12 * sum(shard_numel(shape, world) for _, shape in m.tensors())
                + (4 * shard_numel((m.vocab, m.hidden), world) if m.tied else 0))


def rank0_host_bytes(m):
    """Rank 0's host RAM: at start it alone loads the model in fp32 and broadcasts it; an HF export
    gathers the fp32 state to its CPU and makes the bf16 copy beside it."""
    return dict(start=4 * m.numel(), export=6 * m.numel())


def restart_seconds(m, world, a):
    """A fault's cost before the next step, each part in seconds: detection, the stop and requeue,
    the lease, rank 0 reading the bf16 model and broadcasting it in fp32, every rank reading its
    shard, and the engine's start."""
    model = 2 * m.numel() / (a.plan_fs_read_gb_s * 1e9) + link_seconds(4 * m.numel(), world, a)
    parts = dict(detect=a.plan_detect_s, requeue=a.plan_requeue_s, lease=a.plan_lease_s,
                 model=model, checkpoint=checkpoint_bytes(m, world)["total"]
                 / (a.plan_fs_read_gb_s * 1e9), engine=a.plan_engine_start_s)
    return dict(parts, total=sum(parts.values()))


def lost_share(save_every, step_s, save_s, restart_s, mtbf_s):
    """The expected share of a run's time lost to faults and to guarding against them, to first
    order (Young 1974, Daly 2006): a save every save_every steps, and per fault (one every mtbf_s)
    the restart plus half an interval redone on average."""
    interval = save_every * step_s + save_s
    return save_s / interval + (interval / 2 + restart_s) / mtbf_s


def recommended_save_every(step_s, save_s, restart_s, mtbf_s):
    """Young/Daly's cadence in steps: lost_share is least at an interval of sqrt(2 x save x MTBF);
    the whole number of steps nearest it that loses least."""
    optimum = (math.sqrt(2 * save_s * mtbf_s) - save_s) / step_s
    return min({max(1, math.floor(optimum)), max(1, math.ceil(optimum))},
               key=lambda k: lost_share(k, step_s, save_s, restart_s, mtbf_s))


def restarts_for(expected_faults, certainty=0.99):
    """torchrun's --max-restarts that covers a Poisson count of faults with `certainty`."""
    def cdf(k):
        return sum(expected_faults**i / math.factorial(i) for i in range(k + 1)) * math.exp(
            -expected_faults)

    return next(k for k in itertools.count() if cdf(k) >= certainty)


def cluster_needs(cfg, m, world, a, rollouts_class, gpus=GPUS):
    """format_cluster's figures; the tail simulated with `rollouts_class`'s admission rule."""
    r, s = cfg.rollout, step_time(cfg, m, world, a, gpus)
    ckpt = checkpoint_bytes(m, world)
    write_s = ckpt["total"] / (a.plan_fs_write_gb_s * 1e9)
    restart = restart_seconds(m, world, a)
    nodes = math.ceil(world / a.plan_gpus_per_node)
    mtbf = WEEK / (a.plan_faults_per_week * nodes / 8)
    engines_per_node = max(1, min(a.plan_gpus_per_node, world) // r.tensor_parallel_size)
    steps = cfg.steps - a.plan_start_step
    per_gpu = {}
    for name, t in s["gpus"].items():
        k = min(t["K"], r.max_concurrency or t["K"])
        tails = (rollout_tails(rollouts_class, s["engines"], k, cfg.prompts_per_step,
                               cfg.rollouts_per_prompt, s["response"], a.plan_decode_tok_s,
                               engines_per_node) if k > 0 else None)
        # a rank waits in one collective at a time: what it waits there for, at most
        waits = dict(tail=max(c["tail"] for c in tails.values()) if tails else math.inf,
                     trajectory=r.max_response_tokens / a.plan_decode_tok_s, save=write_s,
                     reload=restart["model"] + restart["checkpoint"], engine=restart["engine"],
                     export=2 * m.numel() / (a.plan_fs_write_gb_s * 1e9))
        def lost(every, t=t):
            return lost_share(every, t["step"], write_s, restart["total"], mtbf)

        every = recommended_save_every(t["step"], write_s, restart["total"], mtbf)
        faults = steps * t["step"] / mtbf
        per_gpu[name] = dict(
            tails=tails, waits=waits, longest_wait=max(waits.values()),
            longest=max(waits, key=waits.get),
            within_timeout=TIMEOUT_MARGIN * max(waits.values()) <= 60 * cfg.collective_timeout_min,
            faults=faults, max_restarts=restarts_for(faults), save_every=every,
            lost=lost(every), lost_config=lost(cfg.save_every),
            days=steps * t["step"] / 86400, days_with_faults=steps * t["step"] / 86400
            / (1 - lost(cfg.save_every)))
    # one cadence for a config that may run on any of these GPUs: the least worst-case loss
    worst = {k: max(lost_share(k, t["step"], write_s, restart["total"], mtbf)
                    for t in s["gpus"].values())
             for k in range(1, max(g["save_every"] for g in per_gpu.values()) + 1)}
    return dict(step=s, checkpoint=ckpt, write_s=write_s, restart=restart, mtbf=mtbf, nodes=nodes,
                disk=(cfg.keep_checkpoints + 1) * ckpt["total"], export=2 * m.numel(),
                host=rank0_host_bytes(m), engines_per_node=engines_per_node, gpus=per_gpu,
                save_every=min(worst, key=worst.get),
                max_restarts=max(g["max_restarts"] for g in per_gpu.values()))


def format_cluster(cfg, m, world, a, rollouts_class, gpus=GPUS):
    c = cluster_needs(cfg, m, world, a, rollouts_class, gpus)
    ckpt, cols, r, restart = c["checkpoint"], list(c["gpus"].values()), cfg.rollout, c["restart"]

    def row(label, value, fmt="12.1f"):
        return table_row(label, [value(t) for t in cols], fmt)

    lines = [f"what a cluster run needs ({world} ranks = {c['nodes']} node(s); "
             f"{c['step']['engines']} engines of tensor_parallel_size={r.tensor_parallel_size}, "
             f"{c['engines_per_node']} per node):",
             f"  checkpoint (fp32 master weights + AdamW's two moments, 12 bytes x "
             f"{m.numel() / 1e9:.2f}B): {ckpt['total'] / GiB:.2f} GiB in all, "
             f"{ckpt['per_rank'] / GiB:.2f} GiB per rank; its write at plan_fs_write_gb_s="
             f"{a.plan_fs_write_gb_s}: {c['write_s']:.0f} s",
             f"  disk: keep_checkpoints={cfg.keep_checkpoints} + the one being written = "
             f"{c['disk'] / GiB:.2f} GiB, plus {c['export'] / GiB:.2f} GiB per hf_step_N export",
             f"  rank 0's host RAM: {c['host']['start'] / GiB:.2f} GiB at start (the model in "
             f"fp32), {c['host']['export'] / GiB:.2f} GiB at an HF export (fp32 + bf16)",
             "  a fault's restart, minutes: " + ", ".join(
                 f"{label} {restart[key] / 60:.1f}" for key, label in [
                     ("detect", "detection"), ("requeue", "stop and requeue"),
                     ("lease", "the lease"), ("model", "the model"),
                     ("checkpoint", "the shards"), ("engine", "the engine")])
             + f": {restart['total'] / 60:.1f}",
             f"  faults: plan_faults_per_week={a.plan_faults_per_week} on 8 nodes, so one every "
             f"{c['mtbf'] / 86400:.1f} days on {c['nodes']}",
             f"  {'':58s}" + "".join(f"{name:>12s}" for name in c["gpus"]),
             row(f"faults expected in the stage ({cfg.steps - a.plan_start_step} steps)",
                 lambda t: t["faults"], "12.2f"),
             row("  --max-restarts covering them 99 times in 100", lambda t: t["max_restarts"],
                 "12d"),
             row("save_every by Young/Daly: sqrt(2 x save x MTBF) / step",
                 lambda t: t["save_every"], "12d"),
             row("  time lost at it, %: saves, redone steps, restarts", lambda t: 100 * t["lost"],
                 "12.2f"),
             row(f"  time lost at save_every={cfg.save_every} (this config), %",
                 lambda t: 100 * t["lost_config"], "12.2f"),
             row("stage, days: without faults", lambda t: t["days"], "12.2f"),
             row(f"  with faults, at save_every={cfg.save_every}",
                 lambda t: t["days_with_faults"], "12.2f"),
             f"  for every GPU above: save_every={c['save_every']} (the least loss on the worst),"
             f" --max-restarts={c['max_restarts']}"
             + ("" if c["save_every"] == cfg.save_every else
                f" (this config has save_every={cfg.save_every})"),
             row("the longest wait in one collective, minutes", lambda t: t["longest_wait"] / 60),
             table_row(f"  which ({', '.join(WAITS)})", [t["longest"] for t in cols], ">12s")]
    timeout = cfg.collective_timeout_min
    label = f"{TIMEOUT_MARGIN} x the longest within collective_timeout_min={timeout}"
    lines.append(f"  {label:58s}" + "".join(f"{'ok' if t['within_timeout'] else 'NO':>12s}"
                                           for t in cols))
    for name, t in c["gpus"].items():
        if not t["within_timeout"]:
            lines.append(f"WARNING: {name}: a rank can wait {t['longest_wait'] / 60:.0f} minutes "
                         f"at one collective (simulated or assumed, not measured); set "
                         f"collective_timeout_min="
                         f"{math.ceil(TIMEOUT_MARGIN * t['longest_wait'] / 60)} or more")
    return "\n".join(lines)


def print_plan(cfg, world, rollouts_class, plan_args=()):
    """rl.py mode=plan; rollouts_class: rollout.Rollouts, whose admission rule the tail simulates."""
    assumptions = load_assumptions(cfg, plan_args)
    tp = cfg.rollout.tensor_parallel_size
    if world % tp or assumptions.plan_gpus_per_node % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {world} ranks "
                          f"and the {assumptions.plan_gpus_per_node} GPUs per node "
                          "(plan_gpus_per_node): an engine would straddle two nodes")
    path = resolve_model_config(cfg)
    shape = ModelShape.from_config(path)
    print(format_plan(cfg, shape, world,
                      path.relative_to(REPO) if path.is_relative_to(REPO) else path))
    print(format_step_time(cfg, shape, world, assumptions))
    print(format_cluster(cfg, shape, world, assumptions, rollouts_class))
