"""torchrun checks of the colocated engine: FSDP2 trainer + one in-process vLLM engine per rank
(external_launcher); run by tests/test_rollout.py.

    torchrun --nproc_per_node=2 tests/dist_rollout.py MODEL_DIR      # weight sync + claiming
    torchrun --nproc_per_node=2 tests/dist_rollout.py MODEL_DIR tp   # one engine over both ranks

Each rank checks where its engine sits (check_colocation), takes an optimizer step, pushes the
full state dict into its engine and checks the engine's log-probs against the trainer's, on fixed
tokens and on sampled ones; every problem is claimed by one rank, regrouped whole, and balanced
onto one rank. In tp mode the leader drives the loop and the follower replays its engine calls.
Exits non-zero on any failure; prints one summary line per rank.
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
from bench.rollout import scripted_policy
from executor import Executor
from machinery.distributed import balance_by_tokens, init_distributed, regroup
from machinery.engine import Engine
from machinery.prompts import render_prompt
from machinery.exits import end_process_group, leave


def say(line):
    """One write(2) per line: the ranks share a pipe, where print()'s pieces interleave."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def worker_placement(worker):
    """Run inside vLLM's worker by collective_rpc (in-process here: the callable is not pickled)."""
    return worker.rank, worker.local_rank, str(worker.device)


def check_colocation(engine, default_group, default_store, tp_size):
    """docs/gpu.md, "Colocation under torchrun": the worker is this rank on its device, vLLM's
    world group torchrun's (the process group and store already up), its TP group this engine's
    ranks, the engine core in this process; a shared-memory broadcaster only for >1 rank."""
    # vLLM after rollout.Engine set VLLM_ENABLE_V1_MULTIPROCESSING, as rollout.py imports it
    from vllm.distributed import parallel_state

    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    assert dist.group.WORLD is default_group, rank
    assert dist.distributed_c10d._get_default_store() is default_store, rank
    world = parallel_state.get_world_group()
    assert (world.ranks, world.rank_in_group, world.local_rank) == (
        list(range(dist.get_world_size())), rank, local_rank), (rank, world.ranks)
    first = rank - rank % tp_size
    tp = parallel_state.get_tp_group()
    assert tp.ranks == list(range(first, first + tp_size)), (rank, tp.ranks)
    assert (tp.mq_broadcaster is not None) == (tp_size > 1), (rank, tp.mq_broadcaster)
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    placement = engine.llm.collective_rpc(worker_placement)
    assert placement == [(rank, local_rank, device)], (rank, placement)
    parallel = engine.engine.vllm_config.parallel_config
    assert (parallel.distributed_executor_backend, parallel.world_size) == (
        "external_launcher", tp_size), (rank, parallel.distributed_executor_backend)
    assert type(engine.engine.engine_core).__name__ == "InprocClient", type(
        engine.engine.engine_core)
    return placement[0]


# fp32 on both sides; measured max |diff| is ~1e-6 (docs/design.md, the CPU stack: <= 4.8e-7)
TOLERANCE = 1e-4


def trainer_logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def optimizer_step(model, optimizer, tokenizer):
    batch = torch.tensor([tokenizer.encode("Compute 12 * 34 + 5. <answer> \\boxed{413} </answer>")])
    loss = model(batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def main(model_dir):
    rank, world_size, _, _ = init_distributed()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    cfg = rollout.RolloutConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1,
                                max_prompt_tokens=448, max_response_tokens=32)
    default_group, default_store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    engine = Engine(model_dir, cfg, seed=rank)
    placement = check_colocation(engine, default_group, default_store, tp_size=1)
    prompt = render_prompt(tokenizer, "Compute 4821 * 37 - 905.", cfg)
    fixed = tokenizer.encode(" I will compute it with Python. </reason>\n"
                             "<answer> \\boxed{177472} </answer><|im_end|>",
                             add_special_tokens=False)

    # 1. an optimizer step moves the trainer away from the engine's weights
    optimizer_step(model, optimizer, tokenizer)
    def engine_gap():
        return (torch.tensor(engine.score([prompt], [fixed])[0])
                - trainer_logprobs(model, prompt, fixed)).abs().max()

    before = engine_gap()
    assert before > 1e-2, f"rank {rank}: the optimizer step did not change the log-probs ({before})"

    # 2. the full state dict on every rank (cpu_offload=False), into this rank's engine
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    engine.update_weights(state.items())
    after = engine_gap()
    assert after < TOLERANCE, f"rank {rank}: engine vs trainer after update_weights: {after}"

    # 3. the lazy path for big models: a generator gathering one DTensor at a time (collective,
    # same order on all ranks)
    optimizer_step(model, optimizer, tokenizer)
    engine.update_weights((name, tensor.full_tensor())
                          for name, tensor in model.state_dict().items())
    lazy = engine_gap()
    assert lazy < TOLERANCE, f"rank {rank}: engine vs trainer after a lazy update: {lazy}"

    # 4. rollouts: prompts claimed from the shared counter, sampled log-probs = the trainer's
    problems = [row["problem"] for row in __import__("tiny").make_arithmetic_problems(4, seed=3)]
    with Executor(workers=1, timeout_s=2.0) as executor:
        groups = rollout.generate(engine, executor, tokenizer, problems, 2, cfg, seed=0, step=0)
    mine = [g[0].problem_index for g in groups]
    claimed = [None] * world_size
    dist.all_gather_object(claimed, mine)
    every = sorted(i for part in claimed for i in part)
    assert every == list(range(len(problems))), f"rank {rank}: claims {claimed}"
    # FSDP's forward is collective: every rank scores every rank's trajectories, in one order
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [t for g in groups for t in g])
    gap = 0.0
    for traj in (t for part in everyone for t in part):
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        diff = (trainer_logprobs(model, traj.prompt_ids, traj.response_ids)
                - torch.tensor(traj.logprobs))[mask]
        gap = max(gap, diff.abs().max().item())
    assert gap < TOLERANCE, f"rank {rank}: sampled log-probs vs trainer: max |diff| {gap}"

    # 4b. more samples than K (one here): each claimed alone, then regrouped whole on one rank,
    # the same tokens; sample r of each on rank r: problem p's group whole on rank p % 2
    held = regroup([[rollout.Trajectory(p, rank, [])] for p in range(3)])
    assert [[(t.problem_index, t.sample_index) for t in g] for g in held] == [
        [(p, 0), (p, 1)] for p in range(3) if p % world_size == rank], f"rank {rank}: {held}"
    one_slot = dataclasses.replace(cfg, max_concurrency=1)
    with Executor(workers=1, timeout_s=2.0) as executor:
        split = rollout.generate(engine, executor, tokenizer, problems, 2, one_slot, seed=0, step=0)
    regrouped = [None] * world_size
    dist.all_gather_object(regrouped, [[(t.problem_index, t.sample_index, t.response_ids)
                                        for t in g] for g in split])
    whole = sorted((g[0][0], g) for part in regrouped for g in part)
    assert [p for p, _ in whole] == list(range(len(problems))), (rank, whole)
    sampled = {(t.problem_index, t.sample_index): t.response_ids
               for part in everyone for t in part}
    for p, g in whole:
        assert [s for _, s, _ in g] == [0, 1], f"rank {rank}: problem {p} has samples {g}"
        assert all(ids == sampled[p, s] for _, s, ids in g), f"rank {rank}: problem {p} tokens"

    # 5. the training split: every trajectory lands on exactly one rank
    share, _ = balance_by_tokens([t for g in groups for t in g])
    shares = [None] * world_size
    dist.all_gather_object(shares, [(t.problem_index, t.sample_index,
                                     len(t.prompt_ids) + len(t.response_ids)) for t in share])
    keys = sorted(k[:2] for part in shares for k in part)
    assert keys == [(p, s) for p in range(len(problems)) for s in range(2)], (rank, shares)
    loads = [sum(k[2] for k in part) for part in shares]

    say(f"rank {rank}: claimed {mine}, before {before:.3g}, after {after:.2g}, lazy {lazy:.2g}, "
        f"sampled gap {gap:.2g}, token loads {loads}, vLLM worker (rank, local rank, device) "
        f"{placement}")
    # under external_launcher this also ends torch.distributed (vLLM's shutdown destroys the group)
    engine.close()


def main_tensor_parallel(model_dir):
    rank, _, _, _ = init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = rollout.RolloutConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1,
                                max_prompt_tokens=448, max_response_tokens=128,
                                tensor_parallel_size=2)
    scripts, call_end = {}, tokenizer.convert_tokens_to_ids("</tool_call>")
    default_group, default_store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    engine = Engine(model_dir, cfg, seed=0, logits_processors=[scripted_policy(scripts, call_end)])
    placement = check_colocation(engine, default_group, default_store, tp_size=2)
    problem = "Compute 6 * 7."
    call = json.dumps({"name": "python_code_with_standard_io",
                       "arguments": {"code": "print(6 * 7)", "input": ""}})
    turns = [f"\n<tool_call>\n{call}\n</tool_call>",
             " 42 </reason><answer> \\boxed{42} </answer><|im_end|>"]
    scripts[tuple(render_prompt(tokenizer, problem, cfg))] = [
        tokenizer.encode(t, add_special_tokens=False) for t in turns]
    with Executor(workers=1, timeout_s=2.0) as executor:
        groups = rollout.generate(engine, executor, tokenizer,
                                  [problem, "Compute 1 + 2.", "Compute 3 + 4."], 2, cfg, seed=0)
    trajs = [t for g in groups for t in g]
    if rank == 0:
        assert sorted((t.problem_index, t.sample_index) for t in trajs) == [
            (p, s) for p in range(3) for s in range(2)]
        scripted = [t for t in trajs if t.problem_index == 0]
        assert all(t.finished and t.tool_calls[0]["status"] == "ok"
                   and "stdout: 42" in t.response_text
                   for t in scripted), [(t.stop_reason, t.response_text) for t in scripted]
    else:
        assert trajs == [], f"rank {rank}: a tensor-parallel follower returned trajectories"
    # synchronous calls take the leader's inputs on every rank of the group
    prompt = render_prompt(tokenizer, problem, cfg)
    scored = engine.score([prompt], [tokenizer.encode(" 42", add_special_tokens=False)]
                          if rank == 0 else [[7, 7]])
    both = [None, None]
    torch.distributed.all_gather_object(both, scored)
    assert both[0] == both[1], f"the two ranks of one engine scored differently: {both}"
    say(f"rank {rank}: tensor parallel, {len(trajs)} trajectories, score {scored}, vLLM worker "
        f"{placement}")
    engine.close()


if __name__ == "__main__":
    main_tensor_parallel(sys.argv[1]) if sys.argv[2:] == ["tp"] else main(sys.argv[1])
    # as the scripts end (machinery/exits.py): past the interpreter's teardown, where gloo's
    # worker threads can abort a rank after its work is done
    end_process_group()
    leave(0)
