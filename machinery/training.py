"""Packing trajectories into micro-batches and the trainer's log-probs at the sampling temperature,
chunked through the output projection so no [tokens, vocab] fp32 tensor is kept."""
import dataclasses

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from machinery.config import ConfigError


@dataclasses.dataclass
class TrainSample:
    """What the trainer needs of a selected rollout.Trajectory, under the same field names: tokens,
    mask, advantage and log-probs. Not the Trajectory itself: with its texts and tool calls the
    token balance would pickle and move about 1.5x the bytes between ranks."""
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
    """This rank's samples in micro-batches under the token and size caps, longest first (little
    padding each)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(samples[i])
        if length > cfg.micro_batch_tokens:
            raise ConfigError(f"a trajectory of {length} tokens does not fit micro_batch_tokens="
                              f"{cfg.micro_batch_tokens}; raise it to at least "
                              "max_prompt_tokens + max_response_tokens")
        grown = max(longest, length) * (len(current) + 1)  # padded size if this sample joins
        full = cfg.micro_batch_size and len(current) >= cfg.micro_batch_size
        if current and (grown > cfg.micro_batch_tokens or full):
            batches.append(current)
            current, longest = [], 0
        current.append(samples[i])
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def equalize_micro_batches(batches):
    """FSDP2 runs collectives inside every forward and backward, so all ranks must run the same
    number of them: a rank with fewer micro-batches runs empty ones (one padding token, nothing
    masked in, zero gradient)."""
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [[]] * (int(count) - len(batches))


def equal_micro_batches(samples, cfg):
    """micro_batches, as many on every rank (equalize_micro_batches): what a step iterates."""
    return equalize_micro_batches(micro_batches(samples, cfg))


def collate(batch, pad_id, device):
    """Padded tensors over the *target* positions 0..L-2 (position t predicts token t+1): response
    token j sits at P + j (P prompt tokens) and is predicted at P + j - 1. Right padding needs no
    attention mask: under causal attention no real token sees the padding after it.
    Returns input_ids, old log-probs, mask, advantages, and the engine's log-probs (None when no
    sample of the batch has them)."""
    if not batch:  # the empty micro-batch of equalize_micro_batches
        zeros = torch.zeros(1, 1, device=device)
        return torch.full((1, 2), pad_id, device=device), zeros, zeros.bool(), zeros[:, 0], None
    sampled = [s.engine_logprobs is not None for s in batch]
    forwarded = [s.old_logprobs is not None for s in batch]
    if not (all(sampled) or not any(sampled)) or not (all(forwarded) or not any(forwarded)):
        raise ValueError("collate: a batch mixes samples with and without engine (or old) "
                         "log-probs")
    length = max(len(s) for s in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    # mask: 0 on the prompt, on padding and on tool output (loss_mask 0, never trained, as the
    # release's response_mask)
    mask = torch.zeros(len(batch), length - 1)
    old = torch.zeros(len(batch), length - 1)
    engine = torch.zeros(len(batch), length - 1) if all(sampled) else None
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
    """log pi(token t+1 | tokens <= t) for every position at the sampling temperature:
    softmax(logits / T) is the policy that sampled and what the engine reports ("processed"
    log-probs, machinery.engine.Engine), so ratio and guard agree. Memory: the logits are
    [tokens, V], V = 151,936 for Qwen3, and their fp32 log-softmax is what backward would keep:
    12.4 GB at a 20,480-token micro-batch, plus the bf16 logits and their gradients. With
    chunk_tokens > 0 the output projection runs on the last hidden states chunk_tokens at a time,
    each chunk recomputed in backward: at most one [chunk, V] logits exists at once, the maths
    unchanged (tests/test_rl.py checks values and gradients). chunk_tokens=0: the model's own
    logits, one row at a time (without gradients, enough to avoid [B, T, V] in fp32).
    with_entropy: also the policy's entropy at every position, [B, T], detached, computed from
    the same chunk of logits (so never from a whole batch's), for logging only: the paper has no
    entropy term (§2.2.1)."""
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
            piece = (head, hidden[start:start + chunk_tokens],
                     flat_targets[start:start + chunk_tokens], temperature, with_entropy)
            rows.append(checkpoint(projected_logprobs, *piece, use_reentrant=False)
                        if torch.is_grad_enabled() else projected_logprobs(*piece))
    join = torch.cat if chunk_tokens else torch.stack  # chunks of flat positions, or rows
    if not with_entropy:
        return join(rows).view(targets.shape)
    return (join([logp for logp, _ in rows]).view(targets.shape),
            join([entropy for _, entropy in rows]).view(targets.shape))


def head_logprobs(logits, targets, temperature, with_entropy=False):
    """log_softmax(logits / T) at the target tokens, in fp32; with_entropy: and the entropy of
    softmax(logits / T) at each position, detached."""
    logits = logits.float() / temperature
    normalizer = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - normalizer
    if not with_entropy:
        return logp
    with torch.no_grad():  # H = logsumexp(z) - sum softmax(z) z, one [tokens, V] temporary
        probs = (logits - normalizer[:, None]).exp_()
        entropy = normalizer - torch.linalg.vecdot(probs, logits)
    return logp, entropy


def projected_logprobs(head, hidden, targets, temperature, with_entropy=False):
    return head_logprobs(head(hidden), targets, temperature, with_entropy)


def last_hidden_states(model, input_ids):
    """The decoder's final (normed) hidden states, [B, T, hidden], and no logits
    (logits_to_keep = no position). Via the whole model's forward, not the decoder's alone: under
    FSDP2 the root's forward gathers the embedding and the output projection, which stays gathered
    for the chunks and backward (the root is not resharded after forward)."""
    captured = []
    hook = model.get_decoder().register_forward_hook(
        lambda module, args, out: captured.append(out.last_hidden_state))
    no_position = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=no_position)
    finally:
        hook.remove()
    return captured[0]
