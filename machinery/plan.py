"""Will this RL config fit, and how long will a step take? The memory of every phase of one rl.py
step, per rank, the bytes it moves, and an estimate of its seconds, from the model's config.json
alone (no weights are loaded, nothing is allocated).

    python rl.py configs/stage1.yaml mode=plan                # the config's world size
    python rl.py configs/stage1.yaml mode=plan world_size=16  # another GPU count
    python rl.py configs/stage1.yaml mode=plan plan_mfu=0.3 plan_decode_tok_s=25
                                                              # other time assumptions
    python rl.py configs/qwen3_1p7b_1gpu.yaml mode=plan plan_model_config=path/to/config.json
    python -m bench.scale                                     # chunked vs unchunked log-probs;
                                                              # balance bytes

The plan is arithmetic on the model's shapes, written to follow what rl.py does on a GPU:
  trainer   FSDP2 over all ranks, one unit per decoder layer plus the root (embeddings, final norm,
            lm_head), fp32 master weights, fp32 gradients, AdamW's two fp32 moments, bf16 compute
            (MixedPrecisionPolicy), so a layer is all-gathered in bf16 when it runs and the root
            stays gathered for the whole forward/backward;
  saved     what autograd keeps for backward per token, counted op by op for the HF Qwen3 decoder
            layer (two RMSNorms that save an fp32 copy, q/k norms, SDPA's q/k/v/out/logsumexp,
            SwiGLU's four I-wide tensors); with activation checkpointing only each layer's input is
            kept, and one layer is recomputed at a time;
  log-probs the output projection and log-softmax per chunk of `logprob_chunk_tokens` tokens,
            recomputed in backward (rl.py), so the [tokens x vocab] working set is a chunk's, not
            the micro-batch's;
  engine    vLLM colocated, asleep while training (rollout.sleep_level): at wake it takes
            gpu_memory_utilization of the GPU for weights + its profiled activations + KV cache;
            K = the trajectories that fit the KV cache at full length at once
            (machinery.engine.Engine.max_concurrency);
  bytes     what each rank must receive (the logical volume; ring collectives send about as much):
            the weight sync gathers bf16 shards, FSDP gathers layers and reduce-scatters fp32
            gradients per micro-batch, and the balance gathers (length, owner, index) and moves only
            the trajectories that change rank;
  time      each term a formula of the config and of stated assumptions (PlanAssumptions, printed
            with the estimate): decode from K and a per-sequence decode rate, training FLOPs at an
            MFU, bytes over links.
The CPU check (tests/test_plan.py) runs the real code in 1 and 2 processes and compares these
numbers with what it measures: tensor bytes, the peak of torch's FSDPMemTracker and the bytes seen
in every c10d collective (CommMeter below). GPU terms that a CPU cannot show (CUDA context, vLLM's
profile run, CUDA graphs) are estimates, named as such. The time's FLOP counts are checked against
torch's FlopCounterMode; its rates are assumptions, printed as such.
"""
import dataclasses
import json
import math
import sys
import weakref
from pathlib import Path

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from machinery.config import REPO, ConfigError, load_config
from machinery.engine import kv_bytes_per_token, trajectories_that_fit
from machinery.tail import rollout_tails

GiB = 2**30
# Memory as the driver reports it (torch.cuda.mem_get_info's total), not the marketing number.
GPUS = {
    "H100-80GB": 81559 * 2**20,
    "H200": 143771 * 2**20,
    "MI300X": 196592 * 2**20,
}
# Estimates for what a CPU cannot measure (not measured here; tools/gpu_check.py records
# the real ones):
CUDA_CONTEXT = 1 * GiB           # CUDA/HIP context, cuBLAS/NCCL workspaces: outside
                                 # every PyTorch tensor
CUDA_GRAPHS = 1 * GiB            # vLLM's graph pool, captured after the KV cache is sized (not
                                 # inside the budget)
ENGINE_BATCH_TOKENS = 16384      # vLLM's max_num_batched_tokens for LLM() on GPUs >= 70 GiB
                                 # (arg_utils defaults)
ENGINE_MAX_SEQS = 1024           # ... and max_num_seqs, which caps K
KV_BLOCK = 16                    # vLLM's default block size: the KV cache is allocated
                                 # in blocks of 16 tokens
SYNC_BUCKET = 64 * 2**20         # distributed.WEIGHT_SYNC_BUCKET_BYTES: full tensors gathered
                                 # together by the weight sync
META_BYTES = 24                  # one (length, owner, index) entry of the balance's
                                 # gather: three int64
# How far the plan's memory terms may be from a measurement (tests/test_plan.py checks each within
# it): a phase closer than this to the GPU's memory fits on paper only
TOLERANCE = 0.20


# -----------------------------------------------------------------------------
# the model: shapes from config.json

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

    def layer_tensors(self):
        """(name, shape) of one decoder layer's parameters, as the HF model names them."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
               ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q))]
        if self.attention_bias:
            out += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                    ("self_attn.v_proj.bias", (kv,))]
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", (self.head_dim,)),
                    ("self_attn.k_norm.weight", (self.head_dim,))]
        out += [("mlp.gate_proj.weight", (self.intermediate, h)),
                ("mlp.up_proj.weight", (self.intermediate, h)),
                ("mlp.down_proj.weight", (h, self.intermediate)), ("input_layernorm.weight", (h,)),
                ("post_attention_layernorm.weight", (h,))]
        return out

    def root_tensors(self):
        """The root FSDP unit's parameters: what is not in a decoder layer."""
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
    """Elements one rank holds of a tensor FSDP2 shards on dim 0: ceil(dim0 / world) rows (the
    padded shard)."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def padded_numel(tensors, world):
    return sum(shard_numel(s, world) * world for _, s in tensors)


# -----------------------------------------------------------------------------
# the trainer: per rank, per phase

def saved_per_token_layer(m, c):
    """Bytes autograd saves per token for one decoder layer without checkpointing; c = compute
    dtype bytes.

    HF's RMSNorm computes in fp32: it saves the fp32 input (in fp32 compute that is the input
    itself), the fp32 rsqrt and the normalised tensor in compute dtype, and the next matmul saves
    the norm's output. Counted with torch.autograd.graph.saved_tensors_hooks on the real layer
    (tests/test_plan.py checks it in fp32 and bf16).
    """
    def norm(width, count=1):  # fp32 input + fp32 rsqrt per row + normalised (compute dtype)
        return count * (4 * width + 4 + c * width)

    h, d, heads, kv = m.hidden, m.head_dim, m.heads, m.kv_heads
    attention = (norm(h) + c * h  # input norm, and its output (q/k/v projections' input)
                 + (norm(d, heads) + norm(d, kv) if m.qk_norm else c * d * (heads + kv))
                 # SDPA: q, k, v (GQA: kv heads), out, fp32 logsumexp
                 + c * d * (2 * heads + 2 * kv) + 4 * heads)
    mlp = norm(h) + c * h + 4 * c * m.intermediate  # post norm; gate, up, silu(gate), silu * up
    return attention + mlp


def trunk_saved_bytes(m, tokens, c, checkpointing):
    """Saved for backward by the whole decoder for `tokens` padded tokens: every layer's
    activations, or with checkpointing each layer's input only; plus the token ids, RoPE's cos/sin
    and the final norm."""
    per_layer = c * m.hidden if checkpointing else saved_per_token_layer(m, c)
    # ids, cos+sin, final norm and its output
    shared = 8 + 2 * c * m.head_dim + 4 * m.hidden + 4 + 2 * c * m.hidden
    return tokens * (m.layers * per_layer + shared)


def logprob_bytes(m, tokens, chunk):
    """Peak of the log-prob head (output projection + log-softmax at the temperature + gather)
    over forward and backward, for `tokens` tokens computed `chunk` at a time (chunk >= tokens:
    all at once).

    Per token and vocabulary entry at the peak, in backward: the fp32 logits saved for the
    log-softmax (4 bytes) and three fp32 temporaries of its gradient (12): 16 bytes, in fp32 and
    bf16 compute alike (measured)."""
    return 16 * min(tokens, chunk or tokens) * m.vocab


def trainer_memory(m, world, tokens, chunk, checkpointing, c=2, prefetch=2):
    """Per-rank bytes of the trainer: resident state and the peak of one micro-batch of `tokens`
    padded tokens.

    c: compute bytes (2 = bf16 on GPU, 4 = fp32 on CPU). prefetch: decoder layers gathered at once
    (2 on GPU: FSDP2 gathers the next layer while one computes; 1 on CPU, which has no streams to
    overlap them).
    """
    layer, root = m.layer_tensors(), m.root_tensors()
    master = 4 * sum(shard_numel(s, world) for _, s in m.tensors())
    head_numel = m.vocab * m.hidden  # lm_head, or the tied embedding's gradient
    layer_numel, root_numel = m.numel(layer), m.numel(root)
    gathered_root = c * root_numel  # the root stays gathered through fwd and bwd
    gathered_layers = c * prefetch * layer_numel
    saved = trunk_saved_bytes(m, tokens, c, checkpointing)
    recompute = tokens * saved_per_token_layer(m, c) if checkpointing else 0
    # backward of a decoder layer (measured on CPU): its gathered parameters, their compute-dtype
    # gradients, the layer recomputed (checkpointing), and its activations' gradients, about a
    # quarter of its saved tensors
    layer_backward = (gathered_layers + c * layer_numel + recompute
                      + tokens * saved_per_token_layer(m, c) // 4)
    resident = 4 * master  # master + fp32 grads + two AdamW moments
    # the output projection's gradient, from the head's backward to the root's reduce
    head_grad = c * head_numel
    candidates = {
        # the log-prob head's backward: every activation still saved, the head's working set at its
        # peak (chunked: the projection's gradient already exists from the chunks before)
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


# -----------------------------------------------------------------------------
# the engine: weights, KV cache and K

def max_concurrency(kv_cache_bytes, m, context_len, tp=1, c=2, max_seqs=ENGINE_MAX_SEQS,
                    block=KV_BLOCK):
    """K of §3.2 as the engine counts it (machinery.engine.trajectories_that_fit): whole blocks of
    KV cache, trajectories at full length."""
    per_token = kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, c, tp)
    return trajectories_that_fit(max(0, kv_cache_bytes) // (block * per_token), block, context_len,
                                 max_seqs)


def engine_memory(m, rollout, gpu_bytes, c=2):
    """vLLM's share at gpu_memory_utilization: its weights, its profile run's activations (estimate:
    a batch of ENGINE_BATCH_TOKENS through the widest layer, and the sampler's fp32 logits for
    ENGINE_MAX_SEQS sequences, twice for processed log-probs), the context, and the KV cache that is
    left; and the K that follows."""
    tp = rollout.tensor_parallel_size
    weights = c * m.numel() // tp
    activations = (ENGINE_BATCH_TOKENS * c * (3 * m.intermediate + 4 * m.hidden) // tp
                   + 2 * 4 * ENGINE_MAX_SEQS * m.vocab)
    budget = int(rollout.gpu_memory_utilization * gpu_bytes)
    kv_cache = budget - weights - activations - CUDA_CONTEXT
    k = max_concurrency(kv_cache, m, rollout.context_len, tp, c)
    return dict(budget=budget, weights=weights, activations=activations, kv_cache=kv_cache, K=k,
                kv_per_trajectory=kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, c, tp)
                * rollout.context_len,
                graphs=0 if rollout.enforce_eager else CUDA_GRAPHS,
                host_when_asleep=weights if rollout.sleep_level == 1 else 0)


# -----------------------------------------------------------------------------
# bytes moved per step, per rank

def pickled_trajectory_bytes(prompt_tokens, response_tokens, vocab):
    """A TrainSample pickled for the balance: token ids (3 bytes below 65536, 5 above; uniform ids
    assumed), the loss mask (2 bytes per 0/1) and the engine's log-probs (9 bytes per float), plus
    the object's own ~200 bytes."""
    id_bytes = 3 + 2 * max(0, vocab - 65536) / vocab
    return int(200 + (prompt_tokens + response_tokens) * id_bytes + response_tokens * (2 + 9))


def balance_received(world, most_per_rank, arrived, vocab):
    """Bytes one rank receives in machinery.distributed.balance_by_tokens: the counts (int64 per
    rank), the keys of every other rank padded to the most any rank holds (three int64 each), the
    payload sizes, and the pickled trajectories that arrive, given as (prompt tokens, response
    tokens)."""
    if world == 1:
        return 0
    keys = (world - 1) * (8 + META_BYTES * most_per_rank + 8)   # counts, keys, payload sizes
    return keys + sum(pickled_trajectory_bytes(p, r, vocab) for p, r in arrived)


def bytes_moved(m, cfg, world, c=2):
    """What one rank receives in one step (logical volume, (W-1)/W of each gathered tensor), and
    what the alternatives (gathering the fp32 weights, all-gathering every trajectory) would move,
    for comparison. The balance's payload is an upper bound: every trajectory this rank trains on
    came from another rank; dynamic claiming keeps the real number lower (the step logs the
    count)."""
    r = cfg.rollout
    engine_c = 4 if r.dtype == "float32" else 2  # the sync casts to the engine's dtype
    share = (world - 1) / world
    kept_total = cfg.prompts_per_step * cfg.group_size
    kept_per_rank = math.ceil(kept_total / world)
    # full-length trajectories per micro-batch
    per_micro = max(1, cfg.micro_batch_tokens // r.context_len)
    micro_batches = math.ceil(kept_per_rank / per_micro) * 1  # per optimizer pass, worst case
    everything = padded_numel(m.tensors(), world)
    fsdp = fsdp_bytes_per_micro_batch(m, world, c)
    trajectory = pickled_trajectory_bytes(r.max_prompt_tokens, r.max_response_tokens, m.vocab)
    return dict(
        weight_sync=int(engine_c * everything * share),
        weight_sync_fp32=int(4 * everything * share),
        # forward only: one all-gather per unit, and only with mini_batches > 1 (rl.rl_step)
        old_logprobs=micro_batches * fsdp["forward_all_gather"] * (cfg.mini_batches > 1),
        train=micro_batches * sum(fsdp.values()),
        micro_batches=micro_batches,
        balance_meta=balance_received(world, kept_per_rank, [], m.vocab),
        balance_payload_max=balance_received(world, kept_per_rank,
                                             [(r.max_prompt_tokens, r.max_response_tokens)]
                                             * kept_per_rank, m.vocab)
                            - balance_received(world, kept_per_rank, [], m.vocab),
        # for comparison: an all-gather of every trajectory
        balance_all_gather=int(trajectory * (kept_total - kept_total / world)),
        trajectory_pickled=trajectory, kept_per_rank=kept_per_rank)


def fsdp_bytes_per_micro_batch(m, world, c=2, reduce_c=4):
    """What one rank receives from FSDP2 in one micro-batch's forward and backward: forward
    all-gathers every unit in compute dtype, backward re-gathers the decoder layers (resharded after
    forward; the root is not), then the gradients are reduce-scattered in reduce_c bytes
    (MixedPrecisionPolicy's reduce_dtype: fp32 in model.build_model)."""
    share = (world - 1) / world
    everything = padded_numel(m.tensors(), world)
    layers = everything - padded_numel(m.root_tensors(), world)
    return dict(forward_all_gather=int(c * everything * share),
                backward_all_gather=int(c * layers * share),
                reduce_scatter=int(reduce_c * everything * share))


# -----------------------------------------------------------------------------
# the plan: every phase, on every GPU, and what to change

def resolve_model_config(cfg):
    """config.json for cfg.model: plan_model_config if given; the model directory's own; else the
    shape file shipped for a hub id (configs/models/<name>.json)."""
    if getattr(cfg, "plan_model_config", ""):
        path = Path(cfg.plan_model_config)
        path = path if path.is_absolute() else REPO / path
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"plan_model_config={cfg.plan_model_config}: no such file")
        return path
    local = Path(cfg.model) if Path(cfg.model).is_absolute() else REPO / cfg.model
    if (local / "config.json").is_file():
        return local / "config.json"
    shipped = REPO / "configs" / "models" / f"{Path(cfg.model).name}.json"
    if shipped.is_file():
        return shipped
    known = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.json"))
    raise ConfigError(f"model={cfg.model}: no config.json there and no "
                      f"configs/models/{Path(cfg.model).name}.json; pass plan_model_config=PATH "
                      f"(a config.json), or one of configs/models/: {', '.join(known)}")


def plan(cfg, m, world, gpu_bytes):
    """Every phase's per-rank bytes on a GPU of `gpu_bytes`, which phases do not fit, and what to
    change."""
    train = trainer_memory(m, world, cfg.micro_batch_tokens, cfg.logprob_chunk_tokens,
                           cfg.activation_checkpointing)
    engine = engine_memory(m, cfg.rollout, gpu_bytes)
    phases = {
        # vLLM checks at start that util x GPU is free; only the fp32 master shard exists then
        "engine start": train["master"] + CUDA_CONTEXT + engine["budget"],
        # rolling out: master + AdamW moments stay (gradients are freed after optimizer.step())
        "rollout": train["resident_rollout"] + CUDA_CONTEXT + engine["budget"] + engine["graphs"],
        # weight sync: engine weights awake, KV cache still asleep, one bucket of full bf16 tensors
        # (a tensor larger than a bucket, the embedding, goes alone)
        "weight sync": (train["resident_rollout"] + CUDA_CONTEXT + engine["weights"]
                        + engine["graphs"]
                        + max(SYNC_BUCKET, 2 * max(math.prod(s) for _, s in m.tensors()))),
        # training with the engine asleep (its graph pool stays)
        "training": train["peak"] + CUDA_CONTEXT + engine["graphs"],
    }
    advice = []
    if phases["training"] > gpu_bytes:
        if not cfg.activation_checkpointing:
            advice.append("training: activation_checkpointing=true")
        if train["logprob"] > gpu_bytes / 8:
            advice.append(f"training: logprob_chunk_tokens="
                          f"{max(256, cfg.logprob_chunk_tokens // 4)}")
        advice.append(f"training: more ranks (world_size={2 * world}), or micro_batch_tokens down "
                      f"to {cfg.rollout.context_len} (one full trajectory)")
    for name in ("engine start", "rollout", "weight sync"):
        if phases[name] > gpu_bytes:
            room = (gpu_bytes - (phases[name] - engine["budget"])) / gpu_bytes
            advice.append(f"{name}: rollout.gpu_memory_utilization={max(room, 0) - 0.02:.2f} "
                          f"(leaves {max(room, 0):.0%} of the GPU after the trainer's state), "
                          "or more ranks")
            break
    if engine["K"] < 1:
        advice.append(f"rollout: the KV cache holds no full trajectory of "
                      f"{cfg.rollout.context_len} tokens; raise rollout.tensor_parallel_size to "
                      f"{2 * cfg.rollout.tensor_parallel_size} or rollout.gpu_memory_utilization")
    return dict(train=train, engine=engine, phases=phases, advice=advice,
                bytes=bytes_moved(m, cfg, world),
                fits={k: v <= gpu_bytes for k, v in phases.items()},
                tight=tight_phases(cfg, m, world, gpu_bytes, phases, engine))


def tight_phases(cfg, m, world, gpu_bytes, phases, engine):
    """{phase: what to change} for the phases that fit only inside the plan's own TOLERANCE: with
    every estimate in them TOLERANCE higher (all but the engine's budget, which vLLM takes exactly:
    gpu_memory_utilization x the GPU) they would not fit."""
    exact = {"engine start": engine["budget"], "rollout": engine["budget"]}
    tight = {}
    for name, size in phases.items():
        estimated = size - exact.get(name, 0)
        if not size <= gpu_bytes < size + TOLERANCE * estimated:
            continue
        if name in exact:
            room = math.floor(100 * (gpu_bytes - (1 + TOLERANCE) * estimated) / gpu_bytes) / 100
            k = engine_memory(m, dataclasses.replace(cfg.rollout, gpu_memory_utilization=room),
                              gpu_bytes)["K"]
            tight[name] = (f"rollout.gpu_memory_utilization={room:.2f} (K = {k}), or more ranks "
                           f"(world_size={2 * world})")
        elif name == "training":
            smaller = max(cfg.rollout.context_len, cfg.micro_batch_tokens // 2)
            tight[name] = f"micro_batch_tokens={smaller}, or more ranks (world_size={2 * world})"
        else:
            tight[name] = f"more ranks (world_size={2 * world})"
    return tight


def fit_verdict(p, gpu_bytes):
    """(fits / fits only inside the tolerance / does not fit, what to change) of one plan()."""
    bad = [phase for phase, ok in p["fits"].items() if not ok]
    if bad or p["advice"]:
        return f"does not fit: {', '.join(bad) or 'K'}", p["advice"]
    if not p["tight"]:
        return "fits", []
    return ("fits only inside the plan's own tolerance (its terms are checked within "
            f"{TOLERANCE:.0%}): " + ", ".join(
                f"{phase} {p['phases'][phase] / GiB:.2f} of {gpu_bytes / GiB:.2f} GiB "
                f"({1 - p['phases'][phase] / gpu_bytes:.1%} left)" for phase in p["tight"]),
            [f"{phase}: {change}" for phase, change in p["tight"].items()])


def launch_note(cfg, world, gpus=GPUS):
    """What rl.py prints at start when torchrun's world is not the config's world_size, the
    plan's assumption and no requirement: the plan's step time and fit at the real world size
    ("" when they agree)."""
    if not cfg.world_size or cfg.world_size == world:
        return ""
    line = (f"world_size={cfg.world_size} is the plan's assumption (mode=plan), not a "
            f"requirement: this launch has {world} rank{'s' if world > 1 else ''}")
    try:
        m = ModelShape.from_config(resolve_model_config(cfg))
    except ConfigError:
        return line + " (no config.json to plan it by)"
    a = PlanAssumptions()
    steps = [step_time(cfg, m, n, a, gpus)["gpus"] for n in (world, cfg.world_size)]
    minutes = lambda s: " / ".join(f"{s[name]['step'] / 60:.0f}" for name in gpus)  # noqa: E731
    lines = [f"{line}, where by the plan a step takes {minutes(steps[0])} minutes on "
             f"{' / '.join(gpus)} ({minutes(steps[1])} at {cfg.world_size})"]
    for name, size in gpus.items():
        verdict, advice = fit_verdict(plan(cfg, m, world, size), size)
        if verdict != "fits":
            lines.append(f"  {name} at {world} ranks: {verdict}; change "
                         + "; or ".join(advice))
    lines.append(f"  the whole plan: python rl.py CONFIG mode=plan world_size={world}")
    return "\n".join(lines)


def format_plan(cfg, m, world, config_path, gpus=GPUS):
    gb = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
    r = cfg.rollout
    lines = [f"plan for {cfg.model} ({m.numel() / 1e9:.2f}B parameters, shapes from {config_path}) "
             f"on {world} ranks, micro_batch_tokens={cfg.micro_batch_tokens}, "
             f"logprob_chunk_tokens={cfg.logprob_chunk_tokens}, "
             f"activation_checkpointing={cfg.activation_checkpointing}, context {r.context_len}, "
             f"gpu_memory_utilization={r.gpu_memory_utilization}, "
             f"tensor_parallel_size={r.tensor_parallel_size}",
             "GiB per rank (bf16 compute, fp32 master weights and AdamW, FSDP2 over all ranks):"]
    plans = {name: plan(cfg, m, world, size) for name, size in gpus.items()}
    first = next(iter(plans.values()))
    t = first["train"]
    rows = [("trainer: fp32 master weights (shard)", t["master"]),
            ("trainer: fp32 gradients (shard)", t["grads"]),
            ("trainer: AdamW moments (shard)", t["adam"]),
            ("trainer: gathered root, bf16 (embeddings, lm_head)", t["gathered_root"]),
            ("trainer: gathered decoder layers, bf16 (with prefetch)", t["gathered_layers"]),
            ("activations saved, checkpointing on", t["saved_checkpointing"]),
            ("activations saved, checkpointing off", t["saved_no_checkpointing"]),
            ("one layer recomputed in backward", t["recompute"]),
            (f"log-prob head, chunks of {cfg.logprob_chunk_tokens} tokens", t["logprob"]),
            ("log-prob head, the whole micro-batch at once", t["logprob_unchunked"]),
            (f"training peak ({t['peak_phase']})", t["peak"])]
    lines += [f"  {name:58s}{gb(value)}" for name, value in rows]
    lines.append(f"  {'':58s}" + "".join(f"{name:>12s}" for name in gpus))
    engine_rows = [("engine budget (gpu_memory_utilization x GPU)", "budget"),
                   ("engine weights, bf16", "weights"),
                   ("engine profile activations (estimate)", "activations"),
                   ("engine KV cache", "kv_cache")]
    for label, key in engine_rows:
        lines.append(f"  {label:58s}"
                     + "".join(f"{p['engine'][key] / GiB:12.2f}" for p in plans.values()))
    lines.append(f"  {'K: full-length trajectories in the KV cache at once':58s}"
                 + "".join(f"{p['engine']['K']:12d}" for p in plans.values()))
    for phase in first["phases"]:
        lines.append(f"  {'phase: ' + phase:58s}" + "".join(
            f"{p['phases'][phase] / GiB:9.2f} {'ok' if p['fits'][phase] else 'NO'}"
            for p in plans.values()))
    lines.append(f"  {'GPU memory':58s}" + "".join(f"{size / GiB:12.2f}" for size in gpus.values()))
    b = first["bytes"]
    lines += [f"host RAM per rank while the engine sleeps (level {r.sleep_level}): "
              f"{gb(first['engine']['host_when_asleep'])} GiB",
              f"bytes received per rank per step (logical volume; {b['kept_per_rank']} kept "
              "trajectories per rank):",
              f"  weight sync (bf16 shards gathered)                        "
              f"{gb(b['weight_sync'])} GiB   "
              f"(gathered in fp32 instead: {gb(b['weight_sync_fp32']).strip()})",
              f"  old log-probs, FSDP all-gathers ({b['micro_batches']} micro-batches, worst case)"
              f"   {gb(b['old_logprobs'])} GiB",
              f"  update, FSDP all-gathers + fp32 reduce-scatters           {gb(b['train'])} GiB",
              f"  balance: (length, owner, index) of every trajectory       "
              f"{b['balance_meta'] / 2**20:7.2f} MiB",
              f"  balance: trajectories moved, at most                      "
              f"{b['balance_payload_max'] / 2**20:7.2f} MiB   (an all-gather of every "
              f"trajectory instead: {b['balance_all_gather'] / 2**20:.0f} MiB)"]
    for name, size in gpus.items():
        verdict, advice = fit_verdict(plans[name], size)
        lines.append(f"{name}: {verdict}" + "".join(f"\n    change {a}" for a in advice))
    lines.append("Estimates, not measured: the CUDA context (1 GiB), vLLM's profile activations "
                 "and CUDA graphs (1 GiB); the rest is checked against the CPU run in "
                 "tests/test_plan.py (within 20%).")
    return "\n".join(lines)


def print_plan(cfg, world, rollouts_class, plan_args=()):
    """rl.py mode=plan [plan_mfu=0.3 ...]: a step's memory and bytes, its time under the stated
    assumptions, then checkpoints, host RAM and the rollout tail (rollouts_class: rollout.py's
    Rollouts, whose admission rule the tail simulates)."""
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


# -----------------------------------------------------------------------------
# the time of a step: each term one formula of the config and of stated assumptions, none
# of them measured

# Dense bf16 matmul peak per GPU (data sheets, without sparsity; the H200 is the H100's chip with
# more, faster memory)
PEAK_BF16_FLOPS = {"H100-80GB": 989e12, "H200": 989e12, "MI300X": 1307e12}
# HBM bandwidth per GPU (data sheets): the roofline of decoding, printed beside
# plan_decode_tok_s to judge it by
HBM_BYTES_PER_S = {"H100-80GB": 3.35e12, "H200": 4.8e12, "MI300X": 5.3e12}


@dataclasses.dataclass
class PlanAssumptions:
    """What mode=plan's time estimate assumes, each overridable on rl.py's command line
    (`plan_mfu=0.3`). They live here, not in rl.RLConfig, so the config a run saves holds the method
    alone. Stated, not measured: replace each with a measurement of the target machine when there is
    one (tools/gpu_check.py, nccl-tests)."""
    # decode tokens/s of ONE sequence while K share a GPU (its rate is K times this): 53-71% of the
    # HBM roofline printed for stage 1's K on these GPUs (weights + K KV caches read per token)
    plan_decode_tok_s: float = 40.0
    # share of the GPU's dense bf16 peak the trainer's matmuls reach, recomputed forwards
    # counted as work
    plan_mfu: float = 0.35
    # GB/s per GPU per direction within a node: NVLink 4 on H100/H200 (900 GB/s both ways); MI300X's
    # Infinity Fabric is 7 links x 64 GB/s = 448
    plan_nvlink_gb_s: float = 450.0
    # GB/s per GPU between nodes: one 400 Gb/s NIC per GPU (nominal)
    plan_network_gb_s: float = 50.0
    plan_gpus_per_node: int = 8
    # mean prompt tokens per trajectory; 0 = rollout.max_prompt_tokens (worst case)
    plan_prompt_tokens: int = 0
    # mean response tokens; 0 = rollout.max_response_tokens (worst case)
    plan_response_tokens: int = 0
    # the step this run starts from (stage 2 continues stage 1's: 300)
    plan_start_step: int = 0
    # GB/s the shared filesystem takes from all ranks writing a checkpoint together
    plan_fs_write_gb_s: float = 5.0
    # GB/s a restart reads at: every rank its checkpoint shard, rank 0 the model
    plan_fs_read_gb_s: float = 5.0
    # seconds from a launch to the engine's first token, the reload apart: imports, vLLM's weight
    # load, compilation and CUDA-graph capture (tools/gpu_check.py records engine_start_s)
    plan_engine_start_s: float = 180.0
    # GPU-hours between a job's unexpected interruptions: Llama 3's pre-training saw 419 in 54 days
    # on 16,384 H100s ("The Llama 3 Herd of Models", arXiv 2407.21783, §3.3.4), 54 x 24 x 16384 /
    # 419; a run's mean time between failures is this over its GPUs
    plan_mtbf_gpu_hours: float = 50677.0

    def validate(self):
        for name in ("plan_decode_tok_s", "plan_nvlink_gb_s", "plan_network_gb_s",
                     "plan_gpus_per_node", "plan_fs_write_gb_s", "plan_fs_read_gb_s",
                     "plan_mtbf_gpu_hours"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")
        if not 0 < self.plan_mfu <= 1:
            raise ConfigError(f"plan_mfu={self.plan_mfu}: must be in (0, 1], a share of the GPU's "
                              "peak")
        for name in ("plan_prompt_tokens", "plan_response_tokens", "plan_start_step",
                     "plan_engine_start_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0 "
                                  "(0 = the config's own)")


def split_plan_args(argv, config_class):
    """rl.py's command line -> (its own arguments, mode=plan's assumptions): a plan_* key that
    config_class does not have (plan_model_config it has) is an assumption, parsed by
    load_assumptions, whose errors name the key."""
    own = {f.name for f in dataclasses.fields(config_class)}

    def is_assumption(arg):
        key = arg.split("=", 1)[0]
        return "=" in arg and key.startswith("plan_") and key not in own

    return [a for a in argv if not is_assumption(a)], [a for a in argv if is_assumption(a)]


def load_assumptions(cfg, plan_args):
    if plan_args and cfg.mode != "plan":
        raise ConfigError(f"{plan_args[0]}: an assumption of mode=plan's time estimate; "
                          "add mode=plan")
    a = load_config(PlanAssumptions, list(plan_args))
    if a.plan_start_step >= cfg.steps:
        raise ConfigError(f"plan_start_step={a.plan_start_step}: must be below steps={cfg.steps}")
    return a


def link_seconds(received, world, a):
    """Seconds to receive `received` bytes of a collective over `world` ranks: the part from the
    node's own GPUs over NVLink, the rest over the network, one after the other (a ring is bound by
    its slowest hop: about the same)."""
    if world == 1:
        return 0.0
    intra = received * (min(a.plan_gpus_per_node, world) - 1) / (world - 1)
    return intra / (a.plan_nvlink_gb_s * 1e9) + (received - intra) / (a.plan_network_gb_s * 1e9)


def step_time(cfg, m, world, a, gpus=GPUS):
    """Seconds of each term of one step on each GPU in `gpus` (a name of PEAK_BF16_FLOPS), and what
    they rest on.

    rollout decode  n rollouts per engine (world / tensor_parallel_size engines) of R response
                    tokens, K at once (the KV budget, as rollout.py sizes it), each at
                    plan_decode_tok_s; never less than the longest response alone (the last to
                    finish);
    training        FLOPs / (GPU peak x plan_mfu): 2 N T for the old log-probs (forward only;
                    only with mini_batches > 1: with one optimizer step the update's forward gives
                    them), 6 N T for the update, 2 N' T for what backward recomputes (the decoder
                    layers but their down projections under activation checkpointing, the lm_head
                    under chunked log-probs); N = parameters that multiply (all but the input
                    embedding), T = tokens trained per rank;
    FSDP            per micro-batch, forward all-gathers in each pass, backward's re-gathers and
                    the reduce-scatters (fsdp_bytes_per_micro_batch), over link_seconds; FSDP2
                    prefetches the next layer while one computes, so the training phase takes the
                    longer of compute and FSDP when they overlap;
    weight sync     the bf16 shards every rank gathers (bytes_moved), over link_seconds."""
    r = cfg.rollout
    prompt, response = (a.plan_prompt_tokens or r.max_prompt_tokens,
                        a.plan_response_tokens or r.max_response_tokens)
    engines = world // r.tensor_parallel_size  # a tensor-parallel group of ranks is one engine
    rollouts = math.ceil(cfg.prompts_per_step * cfg.rollouts_per_prompt / engines)
    kept = math.ceil(cfg.prompts_per_step * cfg.group_size / world)
    micro_batches = math.ceil(kept / max(1, cfg.micro_batch_tokens // (prompt + response)))
    tokens = kept * (prompt + response)
    head = m.vocab * m.hidden
    multiply = m.numel() - (0 if m.tied else head)          # an embedding lookup multiplies nothing
    # torch's non-reentrant checkpoint stops recomputing once backward has what it saved
    # (early_stop, torch/utils/checkpoint.py): a layer is rerun up to the down projection's input,
    # so that matmul is not
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
        engine = engine_memory(m, r, gpu_bytes)
        k = engine["K"]  # K as rollout.py admits trajectories: each at its full budget (§3.2)
        running = min(k, rollouts, r.max_concurrency or k)
        kv_read = (running * kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, 2,
                                                r.tensor_parallel_size)
                   * (prompt + response / 2))
        t = dict(K=k, decode_tok_s_engine=running * a.plan_decode_tok_s,
                 roofline_tok_s=HBM_BYTES_PER_S[name] / (engine["weights"] + kv_read),
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
    names, cols = list(s["gpus"]), list(s["gpus"].values())

    # value: a function of one GPU's terms, or one number for every GPU
    def row(label, value, fmt="12.0f"):
        return f"  {label:58s}" + "".join(f"{value(t) if callable(value) else value:{fmt}}"
                                          for t in cols)

    notes = {"plan_decode_tok_s": "decode tokens/s of one sequence while K share a GPU (assumed: a "
                                  "measured rate of this model at K on the GPU replaces it; "
                                  "tools/gpu_check.py's check 4 measures one)",
             "plan_mfu": "share of the GPU's dense bf16 peak the trainer reaches, recompute "
                         "counted (assumed)",
             "plan_nvlink_gb_s": "GB/s per GPU per direction within a node (NVLink 4; MI300X's "
                                 "Infinity Fabric 448)",
             "plan_network_gb_s": "GB/s per GPU between nodes: one 400 Gb/s NIC each (nominal; "
                                  "nccl-tests gives less)",
             "plan_gpus_per_node": f"{world} ranks = {math.ceil(world / a.plan_gpus_per_node)} "
                                   "node(s)",
             "plan_prompt_tokens": f"mean prompt tokens; 0 = max_prompt_tokens, the worst case "
                                   f"(now {s['prompt']})",
             "plan_response_tokens": f"mean response tokens; 0 = max_response_tokens, the worst "
                                     f"case (now {s['response']})",
             "plan_start_step": "the step this run starts from (continued from init_from: that "
                                "checkpoint's step)",
             "plan_fs_write_gb_s": "GB/s the shared filesystem takes from all ranks writing a "
                                   "checkpoint (assumed; measure it with the cluster's own tools)",
             "plan_fs_read_gb_s": "GB/s a restart reads the checkpoint and the model at (assumed)",
             "plan_engine_start_s": "seconds from a launch to the engine's first token, the reload "
                                    "apart (assumed; tools/gpu_check.py records engine_start_s)",
             "plan_mtbf_gpu_hours": f"GPU-hours between interruptions (Llama 3: 419 in 54 days on "
                                    f"16,384 GPUs): one every "
                                    f"{a.plan_mtbf_gpu_hours / world / 24:.1f} days on {world}"}
    fsdp = s["fsdp_s"]
    steps = cfg.steps - a.plan_start_step
    lines = ["seconds per step (estimates from stated assumptions, none measured; override any as "
             "key=value):"]
    lines += [f"  {f.name + '=' + str(getattr(a, f.name)):28s}{notes[f.name]}"
              for f in dataclasses.fields(a)]
    lines += [f"  per engine ({s['engines']} of tensor_parallel_size="
              f"{cfg.rollout.tensor_parallel_size}): n = {s['rollouts']} rollouts of R = "
              f"{s['response']} response tokens; per rank: T = {s['kept']} kept x "
              f"{s['prompt'] + s['response']} tokens = "
              f"{s['tokens'] / 1e6:.2f}M trained in {s['micro_batches']} micro-batches; "
              f"N = {s['multiply'] / 1e9:.2f}B parameters that multiply (all but the input "
              f"embedding), N' = {s['recomputed'] / 1e9:.2f}B of them recomputed in backward",
              f"  {'':58s}" + "".join(f"{name:>12s}" for name in names),
              f"  {'GPU peak, dense bf16 TFLOPs (data sheets)':58s}"
              + "".join(f"{PEAK_BF16_FLOPS[name] / 1e12:12.0f}" for name in names),
              row("decode tokens/s per engine: min(K, n) x plan_decode_tok_s",
                  lambda t: t["decode_tok_s_engine"]),
              row("  HBM roofline tokens/s per sequence at that K", lambda t: t["roofline_tok_s"]),
              row("rollout decode per engine: n R / (its tokens/s above)", lambda t: t["decode"]),
              row("old log-probs: 2 N T / (GPU peak x plan_mfu), mini_batches > 1 only",
                  lambda t: t["old_logprobs"]),
              row("update: 6 N T / (GPU peak x plan_mfu)", lambda t: t["update"]),
              row("recompute in backward: 2 N' T / (GPU peak x plan_mfu)",
                  lambda t: t["recompute"]),
              row(f"FSDP all-gathers, bf16 ({s['all_gather_bytes'] / 2**40:.2f} TiB)",
                  fsdp["all_gather"]),
              row(f"FSDP reduce-scatters, fp32 ({s['reduce_scatter_bytes'] / 2**40:.2f} TiB)",
                  fsdp["reduce_scatter"]),
              row(f"weight sync ({s['sync_bytes'] / GiB:.2f} GiB of bf16 shards)", s["sync_s"],
                  "12.1f"),
              row("step: decode + max(training compute, FSDP) + sync", lambda t: t["step"]),
              row("  minutes", lambda t: t["step"] / 60, "12.1f"),
              row("  minutes if FSDP does not overlap compute",
                  lambda t: t["step_no_overlap"] / 60, "12.1f"),
              row(f"stage: {steps} steps ({a.plan_start_step} -> {cfg.steps}), days",
                  lambda t: steps * t["step"] / 86400, "12.2f"),
              f"  what would cut the FSDP seconds ({sum(fsdp.values()):.0f} now):",
              row("  reduce-scatter in bf16 (reduce_dtype, model.build_model)",
                  fsdp["all_gather"] + fsdp["reduce_scatter"] / 2)]
    # every FSDP collective runs once per micro-batch: fewer, larger ones cut them all
    for factor in (2, 4):
        bigger = dataclasses.replace(cfg, micro_batch_tokens=factor * cfg.micro_batch_tokens)
        t = step_time(bigger, m, world, a, gpus)
        peaks = [plan(bigger, m, world, size)["phases"]["training"] for size in gpus.values()]
        lines.append(row(f"  micro_batch_tokens={bigger.micro_batch_tokens} "
                         f"({t['micro_batches']} micro-batches)",
                         sum(t["fsdp_s"].values())))
        lines.append(f"  {'    its training phase, GiB per GPU':58s}" + "".join(
            f"{peak / GiB:9.2f} {'ok' if peak <= size else 'NO'}"
            for peak, size in zip(peaks, gpus.values())))
    lines.append("Not counted: prefill (a prompt's 2G samples share its prefix cache), the tool "
                 "calls' wall time, engine sleep/wake, the optimizer step, checkpoints, "
                 "evaluation, waiting for the slowest engine (below: the rollout tail).")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# what a cluster run needs besides memory and step time: checkpoints, host RAM, the rollout tail

def checkpoint_bytes(m, world):
    """One checkpoint of machinery.checkpoint.save_checkpoint: DCP writes the fp32 master weights
    and AdamW's two fp32 moments, 12 bytes a parameter, each rank its shard (FSDP2's ceil(dim0 /
    world) rows: rank 0 holds the most). A tied embedding is written twice (the model's state dict
    names it as lm_head too), its moments once. DCP adds about 2 KB per tensor, the trainer state
    (step, RNG) a few KB per rank."""
    tied = m.vocab * m.hidden if m.tied else 0
    return dict(total=12 * m.numel() + 4 * tied,
                per_rank=12 * sum(shard_numel(shape, world) for _, shape in m.tensors())
                + (4 * shard_numel((m.vocab, m.hidden), world) if m.tied else 0))


def rank0_host_bytes(m):
    """Rank 0's host RAM for the model (machinery.model): at start it alone loads the whole model
    in fp32 and broadcasts it (4 bytes a parameter); an HF export gathers the fp32 state dict to
    rank 0's CPU and makes its bf16 copy beside it (4 + 2)."""
    return dict(start=4 * m.numel(), export=6 * m.numel())


def restart_seconds(m, world, a):
    """What a restart costs before its first step (machinery.rl_run.start_rl_run), each part in
    seconds: rank 0 reads the model (bf16, 2 bytes a parameter) and broadcasts it in fp32
    (machinery.model.build_model), every rank reads its checkpoint shard
    (machinery.checkpoint.restore), and the engine starts."""
    model = 2 * m.numel() / (a.plan_fs_read_gb_s * 1e9) + link_seconds(4 * m.numel(), world, a)
    shards = checkpoint_bytes(m, world)["total"] / (a.plan_fs_read_gb_s * 1e9)
    return dict(model=model, checkpoint=shards, engine=a.plan_engine_start_s,
                total=model + shards + a.plan_engine_start_s)


def lost_share(save_every, step_s, save_s, restart_s, mtbf_s):
    """The expected share of a run's time lost to failures and to guarding against them, to first
    order (Young 1974, Daly 2006): a save every save_every steps, and per failure (one every
    mtbf_s) the restart plus half an interval of steps redone on average."""
    interval = save_every * step_s + save_s
    return save_s / interval + (interval / 2 + restart_s) / mtbf_s


def recommended_save_every(step_s, save_s, restart_s, mtbf_s):
    """Young/Daly's cadence in steps: lost_share is least at an interval of sqrt(2 x save x MTBF)
    (the save included); the whole number of steps nearest it that loses least."""
    optimum = (math.sqrt(2 * save_s * mtbf_s) - save_s) / step_s
    return min({max(1, math.floor(optimum)), max(1, math.ceil(optimum))},
               key=lambda k: lost_share(k, step_s, save_s, restart_s, mtbf_s))


# A single wait the plan simulates or assumes, never measures: the collective timeout should be at
# least this many times the longest
TIMEOUT_MARGIN = 2


def cluster_needs(cfg, m, world, a, rollouts_class, gpus=GPUS):
    """The figures of format_cluster: checkpoint bytes, seconds and disk, rank 0's host RAM, the
    restart, and per GPU the hours between checkpoints, the save cadence and the time it loses,
    the rollout phase and tail simulated with `rollouts_class`'s admission rule (machinery.tail;
    rl.py passes rollout.Rollouts), and the longest single wait at a collective."""
    r, s = cfg.rollout, step_time(cfg, m, world, a, gpus)
    ckpt = checkpoint_bytes(m, world)
    write_s = ckpt["total"] / (a.plan_fs_write_gb_s * 1e9)
    restart = restart_seconds(m, world, a)
    mtbf = a.plan_mtbf_gpu_hours * 3600 / world
    engines_per_node = max(1, min(a.plan_gpus_per_node, world) // r.tensor_parallel_size)
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
        longest = max(waits.values())
        every = recommended_save_every(t["step"], write_s, restart["total"], mtbf)
        per_gpu[name] = dict(
            hours_between=cfg.save_every * t["step"] / 3600, tails=tails, waits=waits,
            longest_wait=longest,
            within_timeout=TIMEOUT_MARGIN * longest <= 60 * cfg.collective_timeout_min,
            failures=(cfg.steps - a.plan_start_step) * t["step"] / mtbf, save_every=every,
            lost=lost_share(every, t["step"], write_s, restart["total"], mtbf),
            lost_config=lost_share(cfg.save_every, t["step"], write_s, restart["total"], mtbf))
    # one cadence for a config that may run on any of these GPUs: the least worst-case loss
    worst = {k: max(lost_share(k, t["step"], write_s, restart["total"], mtbf)
                    for t in s["gpus"].values())
             for k in range(1, max(g["save_every"] for g in per_gpu.values()) + 1)}
    return dict(step=s, checkpoint=ckpt, write_s=write_s, restart=restart, mtbf=mtbf,
                disk=(cfg.keep_checkpoints + 1) * ckpt["total"], export=2 * m.numel(),
                host=rank0_host_bytes(m), engines_per_node=engines_per_node, gpus=per_gpu,
                save_every=min(worst, key=worst.get))


def format_cluster(cfg, m, world, a, rollouts_class, gpus=GPUS):
    c = cluster_needs(cfg, m, world, a, rollouts_class, gpus)
    ckpt, cols, r, restart = c["checkpoint"], list(c["gpus"].values()), cfg.rollout, c["restart"]
    nodes = math.ceil(world / a.plan_gpus_per_node)

    def row(label, value, fmt="12.1f"):
        return f"  {label:58s}" + "".join(f"{value(t):{fmt}}" for t in cols)

    def minutes(case, key):
        return lambda t: t["tails"][case][key] / 60 if t["tails"] else math.inf

    lines = [f"what a cluster run needs ({world} ranks = {nodes} node(s); {c['step']['engines']} "
             f"engines of tensor_parallel_size={r.tensor_parallel_size}, "
             f"{c['engines_per_node']} per node):",
             f"  checkpoint (fp32 master weights + AdamW's two moments, 12 bytes x "
             f"{m.numel() / 1e9:.2f}B): {ckpt['total'] / GiB:.2f} GiB in all, "
             f"{ckpt['per_rank'] / GiB:.2f} GiB per rank",
             f"  its write at plan_fs_write_gb_s={a.plan_fs_write_gb_s}: {c['write_s']:.0f} s, "
             f"every save_every={cfg.save_every} steps",
             f"  disk: keep_checkpoints={cfg.keep_checkpoints} + the one being written = "
             f"{c['disk'] / GiB:.2f} GiB, plus {c['export'] / GiB:.2f} GiB per hf_step_N export "
             "(bf16)",
             f"  rank 0's host RAM: {c['host']['start'] / GiB:.2f} GiB at start (the whole model "
             f"in fp32), {c['host']['export'] / GiB:.2f} GiB at an HF export (fp32 + its bf16 "
             "copy)",
             f"  a restart: rank 0 reads and broadcasts the model {restart['model']:.0f} s, every "
             f"rank reads its shard {restart['checkpoint']:.0f} s (plan_fs_read_gb_s="
             f"{a.plan_fs_read_gb_s}), the engine starts {restart['engine']:.0f} s "
             f"(plan_engine_start_s): {restart['total'] / 60:.1f} minutes",
             f"  failures: plan_mtbf_gpu_hours={a.plan_mtbf_gpu_hours:.0f} / {world} GPUs = one "
             f"every {c['mtbf'] / 86400:.1f} days",
             f"  {'':58s}" + "".join(f"{name:>12s}" for name in c["gpus"]),
             row("hours of training between checkpoints (save_every x step)",
                 lambda t: t["hours_between"], "12.2f"),
             row(f"failures expected in the stage ({cfg.steps - a.plan_start_step} steps)",
                 lambda t: t["failures"], "12.2f"),
             row("save_every by Young/Daly: sqrt(2 x save x MTBF) / step",
                 lambda t: t["save_every"], "12d"),
             row("  time lost at it, %: saves, redone steps, restarts", lambda t: 100 * t["lost"],
                 "12.2f"),
             row(f"  time lost at save_every={cfg.save_every} (this config), %",
                 lambda t: 100 * t["lost_config"], "12.2f"),
             f"  one save_every for every GPU above, the least loss on the worst: "
             f"{c['save_every']}"
             + ("" if c["save_every"] == cfg.save_every else
                f" (this config has {cfg.save_every}: set save_every={c['save_every']})"),
             "  rollout phase, simulated with rollout.py's admission rule (machinery/tail.py), "
             "minutes:"]
    cases = {"full": f"every response at R = {c['step']['response']}",
             "spread": "lengths U[0.2, 1] x R",
             "slow node": "U[0.2, 1] x R, one node at half speed"}
    for case, label in cases.items():
        lines.append(row(f"  {label}: the slowest engine", minutes(case, "phase")))
        lines.append(row("    the fastest engine's wait for it (the tail)", minutes(case, "tail")))
        lines.append(row("    engines' time spent waiting, %",
                         lambda t, case=case: 100 * t["tails"][case]["idle"] if t["tails"]
                         else math.inf))
    waits = {"tail": "the rollout tail (the longest above)",
             "trajectory": "one trajectory at R alone (nothing left to claim)",
             "save": "a checkpoint save",
             "reload": "a restart's reload (model and shards)",
             "engine": "an engine's start (plan_engine_start_s)",
             "export": "an HF export (rank 0 writes the bf16 model)"}
    lines.append("  the longest single wait at a collective (a rank waits in one at a time), "
                 "minutes:")
    for key, label in waits.items():
        lines.append(row(f"  {label}", lambda t, key=key: t["waits"][key] / 60))
    timeout = cfg.collective_timeout_min
    label = f"{TIMEOUT_MARGIN} x the longest within collective_timeout_min={timeout}"
    lines.append(f"  {label:58s}"
                 + "".join(f"{'ok' if t['within_timeout'] else 'NO':>12s}" for t in cols))
    for name, t in c["gpus"].items():
        if not t["within_timeout"]:
            lines.append(f"WARNING: {name}: a rank can wait {t['longest_wait'] / 60:.0f} minutes "
                         f"at one collective, more than collective_timeout_min={timeout} / "
                         f"{TIMEOUT_MARGIN} (the waits are simulated or assumed, not measured); "
                         f"set collective_timeout_min="
                         f"{math.ceil(TIMEOUT_MARGIN * t['longest_wait'] / 60)} or more")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# measuring: the bytes in every collective (tests/test_plan.py, the benchmark, tools/gpu_check.py)

class CommMeter(TorchDispatchMode):
    """Counts, per collective, the bytes this rank receives: every c10d op goes through the
    dispatcher (FSDP2's all-gathers and reduce-scatters, full_tensor(), the object collectives' byte
    tensors), so a dispatch mode sees them all. Received = the logical volume: for an all-gather the
    output less this rank's input, for a reduce-scatter the input less this rank's output, for an
    all-reduce (W-1)/W of the tensor twice (ring), for a broadcast the tensor on every rank but the
    source."""

    def __init__(self):
        super().__init__()
        self.received, self.calls = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":  # DTensor's full_tensor() and redistributions
            name = func.__name__.split(".")[0]
            size = lambda t: t.numel() * t.element_size()  # noqa: E731
            received = {"all_gather_into_tensor": lambda: size(out) - size(args[0]),
                        "reduce_scatter_tensor": lambda: size(args[0]) - size(out)
                        }.get(name, lambda: 0)()
            self.received[name] = self.received.get(name, 0) + received
            self.calls[name] = self.calls.get(name, 0) + 1
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].rstrip("_")
            self.received[name] = self.received.get(name, 0) + self._received(name, args)
            self.calls[name] = self.calls.get(name, 0) + 1
        return out

    @staticmethod
    def _received(name, args):
        def nbytes(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(nbytes(y) for y in x) if isinstance(x, (list, tuple)) else 0

        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        group = ProcessGroup.unbox(group) if group is not None else None
        world = group.size() if group is not None else 1
        if world == 1:
            return 0
        if name in ("_allgather_base", "allgather", "allgather_into_tensor_coalesced"):
            # the object collectives gather byte tensors padded to the largest
            return nbytes(args[0]) - nbytes(args[1])
        if name in ("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"):
            return nbytes(args[1]) - nbytes(args[0])
        if name == "allreduce":
            return int(2 * nbytes(args[0]) * (world - 1) / world)
        if name == "broadcast":
            return 0 if group.rank() == args[2] else nbytes(args[0])
        # output, input, group, output split sizes (rows from each rank), input splits
        if name == "alltoall_base":
            out, splits = args[0], list(args[3])
            row = out[0].numel() * out.element_size() if out.dim() and len(out) else 0
            return ((sum(splits) - splits[group.rank()]) * row if splits
                    else nbytes(out) * (world - 1) // world)
        return nbytes(args[0])

    def total(self):
        return sum(self.received.values())


class PeakMemory(TorchDispatchMode):
    """The most bytes of live tensors while it is active: every storage an op creates or touches is
    followed by a weak reference until it dies, plus the storages of `tracked` (modules' parameters,
    buffers and gradients, optimizers' state, tensors) that exist before. Resizes are followed too
    (FSDP2 frees a gathered layer by resizing its storage to 0). A count of tensors, so it does not
    depend on what the process held before; the same design as torch.distributed._tools.mem_tracker,
    whose MemTracker refuses several forwards of one model (micro-batches). On a GPU,
    torch.cuda.max_memory_allocated measures the same thing (tools/gpu_check.py)."""

    def __init__(self, *tracked):
        super().__init__()
        self.sizes, self.current, self.peak = {}, 0, 0
        for obj in tracked:
            tensors = (list(obj.parameters()) + list(obj.buffers())
                       + [p.grad for p in obj.parameters()]
                       if isinstance(obj, torch.nn.Module) else
                       [t for state in obj.state.values() for t in state.values()]
                       if isinstance(obj, torch.optim.Optimizer) else [obj])
            for t in tensors:
                self._follow(t)
        self.start = self.current

    def _follow(self, t):
        if not isinstance(t, torch.Tensor):
            return
        for storage in get_untyped_storages(t):
            key = id(storage)
            if key in self.sizes:
                continue
            self.sizes[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)),
                               storage.nbytes())
            self._grow(storage.nbytes())

    def _free(self, key):
        self._grow(-self.sizes.pop(key)[1])

    def _grow(self, delta):
        self.current += delta
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns into ops on local shards, which are counted
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((out, args, kwargs)):
            self._follow(t)
        return out

    def __enter__(self):
        resize, meter = torch.UntypedStorage.resize_, self

        def resized(storage, size):
            resize(storage, size)
            entry = meter.sizes.get(id(storage))
            if entry is not None and entry[0]() is storage and entry[1] != storage.nbytes():
                meter.sizes[id(storage)] = (entry[0], storage.nbytes())
                meter._grow(storage.nbytes() - entry[1])

        self._resize, torch.UntypedStorage.resize_ = resize, resized
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def peak_memory(fn, *tracked):
    """(peak bytes of live tensors while fn() runs, bytes at its start, fn's result)."""
    meter = PeakMemory(*tracked)
    with meter:
        result = fn()
    return meter.peak, meter.start, result


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (local shards for DTensors)."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())



if __name__ == "__main__":
    sys.exit("machinery/plan.py: run `python rl.py CONFIG mode=plan` (the benchmark: python -m "
             "bench.scale)")
