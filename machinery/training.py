"""Packing trajectories into micro-batches and the trainer's log-probs at the sampling temperature,
chunked through the output projection so no [tokens, vocab] fp32 tensor is kept."""
import dataclasses

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from machinery.config import ConfigError


@dataclasses.dataclass
class TrainSample:
    """What the trainer needs of a rollout.Trajectory, under its field names: not the Trajectory,
    whose texts would make the token balance move ~1.5x the bytes between ranks."""
    prompt_ids: list[int]
    response_ids: list[int]  # model and tool tokens after the prompt
    loss_mask: list[int]     # per response token: 1 = written by the model, 0 = tool output
    advantage: float         # Eq. 7, shared by all tokens of the trajectory
    engine_logprobs: list[float] | None = None  # per response token, as the engine sampled it
    # per response token, the trainer's, pre-update; None: the update's own forward gives them
    # (one optimizer step per RL step, rl.train_step), which fills them in for the sync guard
    old_logprobs: list[float] | None = None
    problem_index: int = 0
    sample_index: int = 0

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)


def micro_batches(samples, cfg):
    """This rank's samples in micro-batches under the token and size caps, longest first."""
    batches, current = [], []
    for sample in sorted(samples, key=len, reverse=True):  # stable: equal lengths keep their order
        if len(sample) > cfg.micro_batch_tokens:
            raise ConfigError(f"micro_batch_tokens={cfg.micro_batch_tokens}: needs {len(sample)}")
        # padded size if this sample joins: longest first, current[0] is the longest
        grown = len(current[0] if current else sample) * (len(current) + 1)
        full = cfg.micro_batch_size and len(current) >= cfg.micro_batch_size
        if current and (grown > cfg.micro_batch_tokens or full):
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches


def equal_micro_batches(samples, cfg):
    """micro_batches, as many on every rank (FSDP2's collectives run in each forward and backward):
    a rank with fewer runs empty ones, which add a zero gradient."""
    batches = micro_batches(samples, cfg)
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [[]] * (int(count) - len(batches))


def collate(batch, pad_id, device):
    """(input_ids, old log-probs, mask, advantages, engine log-probs or None) over the target
    positions 0..L-2: response token j of P prompt tokens is predicted at P + j - 1. Right padding
    needs no attention mask: under causal attention no real token sees it."""
    if not batch:  # the empty micro-batch of equal_micro_batches
        zeros = torch.zeros(1, 1, device=device)
        return torch.full((1, 2), pad_id, device=device), zeros, zeros.bool(), zeros[:, 0], None

    length = max(len(s) for s in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    # mask: 0 on the prompt, on padding and on tool output (loss_mask 0, never trained, as the
    # release's response_mask)
    mask = torch.zeros(len(batch), length - 1)
    old = torch.zeros(len(batch), length - 1)
    # a step's samples all have engine log-probs or none
    engine = torch.zeros(len(batch), length - 1) if batch[0].engine_logprobs is not None else None
    for row, s in enumerate(batch):
        input_ids[row, :len(s)] = torch.tensor(s.prompt_ids + s.response_ids)
        at = slice(len(s.prompt_ids) - 1, len(s) - 1)
        mask[row, at] = torch.tensor(s.loss_mask, dtype=torch.float)
        if s.old_logprobs is not None:
            old[row, at] = torch.tensor(s.old_logprobs)
        if engine is not None:
            engine[row, at] = torch.tensor(s.engine_logprobs)

    advantages = torch.tensor([s.advantage for s in batch])
    return (input_ids.to(device), old.to(device), mask.bool().to(device), advantages.to(device),
            None if engine is None else engine.to(device))


def token_logprobs(model, input_ids, temperature, chunk_tokens=0, with_entropy=False):
    """log pi(token t+1 | tokens <= t) at every position at the sampling temperature (the engine's
    "processed" log-probs). The fp32 log-softmax of [tokens, V] is 12.4 GB at 20,480 tokens of
    Qwen3: chunk_tokens > 0 projects that many tokens at a time, each chunk recomputed in backward;
    with_entropy: also each position's entropy, detached, for logging (no entropy term, §2.2.1)."""
    targets = input_ids[:, 1:]

    if not chunk_tokens:
        logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]
        rows = [head_logprobs(row_logits, row_targets, temperature, with_entropy)
                for row_logits, row_targets in zip(logits, targets)]
    else:
        hidden = last_hidden_states(model, input_ids)[:, :-1]
        hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        head = model.get_output_embeddings()
        rows = []
        for start in range(0, len(flat_targets), chunk_tokens):
            piece = (hidden[start:start + chunk_tokens], flat_targets[start:start + chunk_tokens],
                     temperature, with_entropy, head)
            rows.append(checkpoint(head_logprobs, *piece, use_reentrant=False)
                        if torch.is_grad_enabled() else head_logprobs(*piece))

    join = torch.cat if chunk_tokens else torch.stack  # chunks of flat positions, or rows
    parts = zip(*rows) if with_entropy else [rows]
    out = [join(list(part)).view(targets.shape) for part in parts]
    return tuple(out) if with_entropy else out[0]  # (log-probs, entropies) or log-probs


def head_logprobs(logits, targets, temperature, with_entropy=False, head=None):
    """log_softmax(logits / T) at the targets in fp32; with_entropy: and its entropy, detached;
    head: `logits` are hidden states, projected here (inside a chunk's checkpoint)."""
    logits = (logits if head is None else head(logits)).float() / temperature
    normalizer = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - normalizer
    if not with_entropy:
        return logp
    with torch.no_grad():  # H = logsumexp(z) - sum softmax(z) z, one [tokens, V] temporary
        probs = (logits - normalizer[:, None]).exp_()
        entropy = normalizer - torch.linalg.vecdot(probs, logits)
    return logp, entropy


def last_hidden_states(model, input_ids):
    """The decoder's final hidden states, [B, T, hidden], no logits. Through the whole model's
    forward: under FSDP2 the root's forward gathers the output projection the chunks use."""
    captured = []
    hook = model.get_decoder().register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state))
    no_position = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=no_position)
    finally:
        hook.remove()
    return captured[0]
