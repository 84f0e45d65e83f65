"""The GPU check, in one call: what CPU tests cannot show, measured on one CUDA GPU with `vllm`.

    python -m tools.gpu_check [out_dir=$OUT] [hidden_size=1024 num_hidden_layers=12] \\
        [prompts=64 max_tokens=256]

Needs requirements-gpu.txt installed and no network (the models are random Qwen3s built by tiny.py,
larger than the CPU one so the numbers mean something). The seven checks, in order (docs/gpu.md says
what each guards): 1. bf16 log-prob agreement after update_weights, then sampling on the V2 model
runner; 2. weight-update time; 3. sleep / wake_up at levels 2 and 1; 4. rollout.generate against
LLM.generate; 5. the barrier-free loop against a per-turn barrier (bench/rollout.py); 6. the RL
cycle with rl.py's own functions on a Qwen3-4B shape, each phase beside machinery/plan.py's number
(only_cycle=true runs it alone); 7. the RL step's rollout phase against LLM.generate (bench/rl.py)
on a Qwen3-1.7B shape, target >= 0.95x. Results: a Markdown block for GPU_CHECK.md, out_dir/
gpu_check.json, then a one-screen verdict; exit code 1 if a check failed. Under coverage
(docs/coverage.md) it runs the CUDA branches no CPU test runs. Not yet run on any GPU; without one
it exits at once with a message.
"""
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import torch
import vllm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from machinery import plan
import rl
import rollout
import tiny
from bench import rl as rl_bench
from bench import rollout as rollout_bench
from machinery.config import load_config
from machinery.distributed import init_distributed
from machinery.engine import Engine
from machinery.prompts import render_prompt
from machinery.checkpoint import load_policy
from machinery.training import TrainSample


@dataclasses.dataclass
class GPUCheckConfig:
    out_dir: str = os.environ.get("OUT", "out/gpu_check")
    # the model: tiny.py's Qwen3 layout at ~200M parameters (random weights; only agreement and
    # speed are measured)
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 128
    # engine
    gpu_memory_utilization: float = 0.4
    enforce_eager: bool = False       # CUDA graphs on, as in training; true starts faster
    # throughput
    prompts: int = 64
    max_tokens: int = 256
    # barrier benchmark
    bench_trajectories: int = 64
    tool_latency_s: float = 0.3
    # 6. the RL cycle on one GPU (rl.py's own functions), against machinery/plan.py: a Qwen3-shaped
    # model with random weights, Qwen3-4B's shape by default, which with its fp32 master weights and
    # AdamW (16 bytes a parameter, ~64 GB) and a colocated engine is about what one H200 holds
    # (python rl.py ... mode=plan shows the sum for other shapes)
    only_cycle: bool = False          # skip checks 1-5
    cycle_hidden_size: int = 2560
    cycle_intermediate_size: int = 9728
    cycle_num_hidden_layers: int = 36
    cycle_num_attention_heads: int = 32
    cycle_num_key_value_heads: int = 8
    cycle_vocab_size: int = 151936
    cycle_micro_batch_tokens: int = 20480     # the paper's (stage1.yaml)
    cycle_logprob_chunk_tokens: int = 1024
    cycle_gpu_memory_utilization: float = 0.3
    cycle_prompts: int = 16
    cycle_max_tokens: int = 256               # rollout length (random weights: the text is noise,
                                              # the memory is real)
    cycle_rounds: int = 2
    # 7. the rollout phase inside rl.py's steps (bench/rl.py), Qwen3-1.7B's shape
    step_bench_steps: int = 2

    def validate(self):
        if self.prompts < 1 or self.max_tokens < 1 or self.bench_trajectories < 1:
            raise ValueError("prompts, max_tokens and bench_trajectories must be >= 1")


def gpu_memory_used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def trainer_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(response_ids, device="cuda")[:, None])[:, 0].cpu()


# Qwen3-1.7B's shape (its config.json), for the in-step rollout benchmark
QWEN3_1P7B_SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8)


def cycle_model(cfg, out, shape=None, name="cycle-model"):
    """A Qwen3-shaped model with random bf16 weights and the tiny tokenizer (ids past it are never
    needed), saved as a Hugging Face directory: what machinery.checkpoint.load_policy and the engine
    read. shape: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads and
    num_key_value_heads (default: the cycle_* keys)."""
    model_dir = out / name
    if (model_dir / "config.json").is_file():
        return model_dir
    shape = shape or dict(hidden_size=cfg.cycle_hidden_size,
                          intermediate_size=cfg.cycle_intermediate_size,
                          num_hidden_layers=cfg.cycle_num_hidden_layers,
                          num_attention_heads=cfg.cycle_num_attention_heads,
                          num_key_value_heads=cfg.cycle_num_key_value_heads)
    tokenizer = tiny.build_tokenizer(tiny.TinyConfig())
    config = Qwen3Config(vocab_size=cfg.cycle_vocab_size, **shape, head_dim=128,
                         tie_word_embeddings=True, max_position_embeddings=32768,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    return model_dir


def rl_cycle(cfg, out, results):
    """Rollout, sleep, old log-probs and a training step at micro_batch_tokens, wake + sync
    (rl.sync_weights, verl's order), rollout again, cycle_rounds times, with rl.py's own functions
    on one GPU. Per phase: the device's used memory at its end (mem_get_info: vLLM's sleep-mode pool
    is outside PyTorch's counters), PyTorch's peak allocated during it, and the plan's number for
    the phase."""
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    model_dir = cycle_model(cfg, out)
    context = cfg.cycle_micro_batch_tokens // 2
    rl_cfg = load_config(rl.RLConfig, [
        f"model={model_dir}", f"micro_batch_tokens={cfg.cycle_micro_batch_tokens}",
        f"logprob_chunk_tokens={cfg.cycle_logprob_chunk_tokens}",
        "activation_checkpointing=true", "rollout.dtype=bfloat16",
        f"rollout.gpu_memory_utilization={cfg.cycle_gpu_memory_utilization}",
        "rollout.max_prompt_tokens=1024", f"rollout.max_response_tokens={context - 1024}",
        "rollout.use_tool=false", f"rollout.enforce_eager={cfg.enforce_eager}"])
    shape = plan.ModelShape.from_config(model_dir / "config.json")
    total = torch.cuda.mem_get_info()[1]
    planned = plan.plan(rl_cfg, shape, 1, total)
    phases, record = [], {}

    def measure(name, fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        phases.append(dict(phase=name, seconds=time.perf_counter() - started,
                           device_used_gib=gpu_memory_used_gib(),
                           torch_peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30))
        return result

    model, optimizer = measure("load trainer (FSDP2, fp32 master)",
                               lambda: load_policy(rl_cfg, device, 0))
    engine = measure("engine start", lambda: Engine(model_dir, rl_cfg.rollout, seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    record["K"] = engine.max_concurrency()
    problems = [row["problem"] for row in tiny.make_arithmetic_problems(cfg.cycle_prompts, seed=2)]
    plain = dataclasses.replace(rl_cfg.rollout, max_response_tokens=cfg.cycle_max_tokens)
    generator = torch.Generator().manual_seed(0)
    # 2 micro-batches
    samples = [TrainSample(torch.randint(0, shape.vocab, (1024,), generator=generator).tolist(),
                           torch.randint(0, shape.vocab, (context - 1024,),
                                         generator=generator).tolist(),
                           [1] * (context - 1024), advantage=(-1.0) ** i) for i in range(4)]
    weight_dtype = torch.bfloat16
    for round_ in range(cfg.cycle_rounds):
        engine.cfg = plain
        measure(f"{round_}: rollout",
                lambda: rollout.generate(engine, None, tokenizer, problems, 2, plain, seed=round_))
        engine.cfg = rl_cfg.rollout
        measure(f"{round_}: sleep", engine.sleep)
        measure(f"{round_}: old log-probs",
                lambda: rl.recompute_logprobs(model, samples, rl_cfg, 0, device))
        metrics = measure(
            f"{round_}: train step ({cfg.cycle_micro_batch_tokens}-token micro-batches)",
            lambda: rl.train_step(model, optimizer, samples, rl_cfg, round_, 0, device))
        record[f"{round_}: micro_batches"] = metrics["num_micro_batches"]
        measure(f"{round_}: wake + weight sync",
                lambda: rl.sync_weights(engine, model, weight_dtype))
    engine.cfg = plain
    measure("last: rollout",
            lambda: rollout.generate(engine, None, tokenizer, problems, 2, plain, seed=99))
    gib = {k: v / 2**30 for k, v in planned["phases"].items()}
    record.update(phases=phases, gpu_total_gib=total / 2**30, params_B=shape.numel() / 1e9,
                  plan_phases_gib=gib, plan_training_peak_gib=planned["train"]["peak"] / 2**30,
                  plan_K=planned["engine"]["K"], plan_fits=planned["fits"])
    results["rl_cycle"] = record
    engine.close()


def step_bench_args(cfg, model_dir, train_data):
    """bench/rl.py's arguments: rl.py's 1-GPU config on the random model, tools off (random weights
    never call it), every group trained (all rewards are 0), CUDA graphs as configured."""
    return ["configs/qwen3_1p7b_1gpu.yaml", f"model={model_dir}", f"train_data={train_data}",
            "rollout.use_tool=false", "filter_all_equal=false", "rollout.max_response_tokens=1024",
            f"rollout.enforce_eager={cfg.enforce_eager}", f"bench_steps={cfg.step_bench_steps}"]


def step_bench(cfg, out, results):
    """7: the rollout phase inside rl.py's steps against plain LLM.generate (bench/rl.py)."""
    init_distributed()
    model_dir = cycle_model(cfg, out, QWEN3_1P7B_SHAPE, "step-bench-model")
    train_data = out / "step-bench-train.jsonl"
    train_data.write_text("".join(json.dumps(row) + "\n"
                                  for row in tiny.make_arithmetic_problems(512, seed=3)))
    bench_cfg, rl_args = rl_bench.split_args(step_bench_args(cfg, model_dir, train_data))
    run_dir = tempfile.mkdtemp(prefix="step-bench-run-", dir=out)  # resume=never: a fresh one
    rows = rl_bench.bench(bench_cfg, rl_bench.bench_rl_config(rl_args, run_dir))
    seconds = {mode: sum(r["seconds"] for r in rows if r["mode"] == mode)
               for mode in ("plain LLM.generate", "rl.py rollout phase")}
    results["rl_step_rollout"] = {
        "rollout_phase_over_plain": seconds["plain LLM.generate"] / seconds["rl.py rollout phase"],
        "plain_s": seconds["plain LLM.generate"], "rollout_phase_s": seconds["rl.py rollout phase"],
        "rows": rows}


def main(cfg):
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA (or ROCm) GPU here; it has not run on this machine. "
                 "The CPU path is covered by tests/test_rollout.py, tests/test_rl.py and "
                 "tests/test_plan.py")
    results, failures = {}, []
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "vllm": vllm.__version__, "hip": torch.version.hip}

    def check(name, fn):
        try:
            fn()
        except Exception:  # record and go on: one call should report every check it can
            failures.append(name)
            results[name] = {"error": traceback.format_exc(limit=4)}

    if not cfg.only_cycle:
        checks_1_to_5(cfg, out, results, check)
    check("rl_cycle", lambda: rl_cycle(cfg, out, results))
    if not cfg.only_cycle:
        check("rl_step_rollout", lambda: step_bench(cfg, out, results))
    results["failures"] = failures
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print("\n## gpu_check.py results\n```json\n" + json.dumps(results, indent=1) + "\n```")
    print("\n" + verdict(results))
    return 1 if failures else 0


def sampling(engine, trainer, prompt, results):
    """What machinery.engine.Engine asks of the model runner that CUDA runs (vLLM 0.33's V2 one; the
    CPU tests run V1): the sampled tokens' log-probs at temperature 0.6 are the trainer's
    log_softmax(logits / 0.6) ("processed_logprobs", vllm/v1/worker/gpu/sample/sampler.py), and a
    request's seed fixes its tokens (sample/states.py, gumbel.py): rerun alone, the same; in a batch
    of 16, reported (bf16 kernels may differ with the batch); another seed, others."""
    engine.update_weights(trainer.state_dict().items())
    ids = itertools.count()

    def sample(seed, others=0):
        requests = [f"sampling-{next(ids)}" for _ in range(1 + others)]
        for i, request in enumerate(requests):
            engine.add(request, prompt, 48, seed + 1000 * i, [], 0.6, 1.0)
        done = {}
        while engine.has_unfinished():
            done.update((request, (tokens, logprobs))
                        for request, tokens, logprobs in engine.step())
        return done[requests[0]]

    tokens, logprobs = sample(7)
    tempered = (torch.tensor(logprobs)
                - trainer_logprobs(trainer, prompt, tokens, temperature=0.6)).abs()
    untempered = (torch.tensor(logprobs) - trainer_logprobs(trainer, prompt, tokens)).abs()
    rerun, batched, other = sample(7)[0], sample(7, others=15)[0], sample(8)[0]
    results["sampling"] = {"tokens": len(tokens), "vs_trainer_at_0.6_mean": tempered.mean().item(),
                           "vs_trainer_at_0.6_max": tempered.max().item(),
                           "vs_trainer_at_1.0_mean": untempered.mean().item(),
                           "same_seed_same_tokens": rerun == tokens,
                           "same_seed_in_batch_of_16_same_tokens": batched == tokens,
                           "other_seed_other_tokens": other != tokens}
    if tempered.mean() > 0.05 or rerun != tokens or other == tokens:
        raise AssertionError(f"sampling: {results['sampling']}")


def brief(value):
    """A check's numbers on one line: its scalars, 3 significant digits (nested tables stay in the
    JSON)."""
    if not isinstance(value, dict):
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    return "  ".join(f"{k}={brief(v)}" for k, v in value.items()
                     if isinstance(v, (int, float, str, bool)))


def verdict(results):
    """One screen, printed last: PASS or FAIL per check with its numbers (the RL cycle's include the
    plan's) or its error's last line, and one row per phase of the RL cycle: time, device memory
    used, PyTorch's peak."""
    failures = results.get("failures", [])
    scalars = {k: v for k, v in results.items() if not isinstance(v, (dict, list))}
    lines = [f"gpu_check.py on {results.get('env', {}).get('gpu', '?')}: "
             f"{'FAIL (' + ', '.join(failures) + ')' if failures else 'PASS'}  "
             f"{brief(scalars)}".rstrip()]
    for name, value in results.items():
        if name in ("env", "failures") or not isinstance(value, dict):
            continue
        if name in failures:
            lines.append(f"FAIL {name}: {value['error'].strip().splitlines()[-1]}"[:160])
            continue
        lines.append(f"PASS {name}: {brief(value)}"[:160])
        for phase in value.get("phases", []):
            lines.append(f"     {phase['phase'][:44]:44} {phase['seconds']:7.1f} s  used "
                         f"{phase['device_used_gib']:6.1f} GiB  "
                         f"peak {phase['torch_peak_allocated_gib']:6.1f} GiB")
    return "\n".join(lines)


def checks_1_to_5(cfg, out, results, check):
    init_distributed()

    model_dir = tiny.build_tiny_model(tiny.TinyConfig(
        out_dir=str(out / "model"), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, pretrain_steps=0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rcfg = rollout.RolloutConfig(dtype="bfloat16",
                                 gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 enforce_eager=cfg.enforce_eager, max_prompt_tokens=512,
                                 max_response_tokens=1024)
    start = time.perf_counter()
    engine = Engine(model_dir, rcfg, seed=0)
    results["engine_start_s"] = time.perf_counter() - start
    results["max_concurrency_K"] = engine.max_concurrency()

    # 1-2. weight update and log-prob agreement in bf16
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompt = render_prompt(tokenizer, "Compute 4821 * 37 - 905.", rcfg)
    fixed = tokenizer.encode(" I will compute it. </reason>\n"
                             "<answer> \\boxed{177472} </answer><|im_end|>",
                             add_special_tokens=False)

    def weights_and_logprobs():
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        batch = torch.tensor([prompt + fixed], device="cuda")
        trainer(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = (torch.tensor(engine.score([prompt], [fixed])[0])
                  - trainer_logprobs(trainer, prompt, fixed)).abs()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.update_weights(trainer.state_dict().items())
        torch.cuda.synchronize()
        full_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.update_weights((name, tensor.detach().clone())
                              for name, tensor in trainer.state_dict().items())
        torch.cuda.synchronize()
        lazy_s = time.perf_counter() - start
        engine_lp = torch.tensor(engine.score([prompt], [fixed])[0])
        bf16 = (engine_lp - trainer_logprobs(trainer, prompt, fixed)).abs()
        fp32 = (engine_lp - trainer_logprobs(trainer.float(), prompt, fixed)).abs()
        trainer.bfloat16()
        results["weights"] = {"params_M": sum(p.numel() for p in trainer.parameters()) / 1e6,
                              "update_full_state_dict_s": full_s, "update_lazy_generator_s": lazy_s}
        results["logprobs_bf16"] = {"before_update_max": before.max().item(),
                                    "vs_trainer_bf16_max": bf16.max().item(),
                                    "vs_trainer_bf16_mean": bf16.mean().item(),
                                    "vs_fp32_reference_max": fp32.max().item(),
                                    "vs_fp32_reference_mean": fp32.mean().item(),
                                    "tokens": len(fixed)}
        if bf16.mean() > 0.05:
            raise AssertionError(f"engine vs trainer mean |diff| {bf16.mean():.3g} after "
                                 "update_weights")

    check("logprobs_bf16", weights_and_logprobs)
    check("sampling", lambda: sampling(engine, trainer, prompt, results))

    # 3. sleep / wake_up around a training step, at level 2 (the default: the weights are discarded,
    # so they are reloaded between waking the weights and the KV cache, rl.sync_weights' order) and
    # level 1 (kept in host RAM)
    def sleep_wake():
        engine.update_weights(trainer.state_dict().items())
        reference = engine.score([prompt], [fixed])[0]
        try:
            for level in (2, 1):
                engine.cfg = dataclasses.replace(rcfg, sleep_level=level)
                awake, rss = gpu_memory_used_gib(), psutil.Process().memory_info().rss
                start = time.perf_counter()
                engine.sleep()
                sleep_s, asleep = time.perf_counter() - start, gpu_memory_used_gib()
                host = (psutil.Process().memory_info().rss - rss) / 2**30
                start = time.perf_counter()
                engine.wake_up(tags=["weights"])
                if level == 2:
                    engine.update_weights(trainer.state_dict().items())
                engine.wake_up(tags=["kv_cache"])
                wake_s = time.perf_counter() - start
                drift = max(abs(a - b)
                            for a, b in zip(reference, engine.score([prompt], [fixed])[0]))
                results[f"sleep_wake_level{level}"] = {
                    "gpu_used_awake_gib": awake, "gpu_used_asleep_gib": asleep,
                    "host_rss_growth_asleep_gib": host, "sleep_s": sleep_s, "wake_s": wake_s,
                    "logprob_drift_after_wake": drift}
                if asleep > awake - 0.5 or drift > 1e-3:
                    raise AssertionError(f"level {level}: sleep freed {awake - asleep:.2f} GiB, "
                                         f"log-prob drift {drift:.3g}")
        finally:
            engine.cfg = rcfg  # whatever failed, the next checks sample at the config's level

    check("sleep_wake", sleep_wake)

    # 4. rollout loop vs plain LLM.generate, same prompts, no tool, the same number of tokens
    def throughput():
        plain_cfg = dataclasses.replace(rcfg, use_tool=False, max_response_tokens=cfg.max_tokens)
        problems = [row["problem"] for row in tiny.make_arithmetic_problems(cfg.prompts, seed=1)]
        prompts = [render_prompt(tokenizer, p, plain_cfg) for p in problems]
        engine.generate_plain(prompts[:4], 8)  # warm-up
        start = time.perf_counter()
        plain = engine.generate_plain(prompts, cfg.max_tokens)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        groups = rollout.generate(engine, None, tokenizer, problems, 1, plain_cfg, seed=0)
        loop_s = time.perf_counter() - start
        loop_tokens = sum(len(t.response_ids) for g in groups for t in g)
        plain_tokens = sum(map(len, plain))
        results["throughput"] = {"prompts": cfg.prompts,
                                 "plain_tokens_per_s": plain_tokens / plain_s,
                                 "rollout_tokens_per_s": loop_tokens / loop_s,
                                 "rollout_over_plain":
                                     (loop_tokens / loop_s) / (plain_tokens / plain_s),
                                 "rollout_tokens": loop_tokens, "plain_tokens": plain_tokens}

    check("throughput", throughput)
    del trainer
    torch.cuda.empty_cache()
    # frees the GPU for the benchmark's own engine (and ends torch.distributed; bench restarts it)
    engine.close()

    # 5. the barrier benchmark on the GPU
    def barrier_bench():
        bench_cfg = rollout_bench.BenchConfig(model=str(model_dir),
                                              trajectories=cfg.bench_trajectories,
                                              tool_latencies_s=[0.0, cfg.tool_latency_s], repeats=1,
                                              rollout=dataclasses.replace(rcfg))
        results["barrier_bench"] = rollout_bench.bench(bench_cfg)

    check("barrier_bench", barrier_bench)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = load_config(GPUCheckConfig, sys.argv[1:])
    except ValueError as e:
        sys.exit(f"gpu_check.py: {e}")
    sys.exit(main(config))
