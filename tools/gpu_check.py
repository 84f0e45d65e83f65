"""The GPU check, in one call: what CPU tests cannot show, measured on one CUDA GPU with `vllm`.

    python -m tools.gpu_check [out_dir=$OUT] [only_cycle=true] [enforce_eager=true]

Needs requirements-gpu.txt and no network (random Qwen3 models built by tiny.py). The six checks
and what each guards are in docs/gpu.md; results go to out_dir/gpu_check.json, a one-screen verdict
to stdout; exit code 1 if a check failed.
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

import rl
import rollout
import tiny
from bench import rl as rl_bench
from bench import rollout as rollout_bench
from machinery import plan
from machinery.checkpoint import load_policy
from machinery.config import load_config
from machinery.distributed import init_distributed
from machinery.engine import Engine
from machinery.prompts import render_prompt
from machinery.training import TrainSample

# The RL cycle's model: Qwen3-4B's shape, whose fp32 master weights and AdamW (~64 GB) and a
# colocated engine are about what one H200 holds; the in-step rollout benchmark's: Qwen3-1.7B's
QWEN3_4B_SHAPE = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8)
QWEN3_1P7B_SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8)


@dataclasses.dataclass
class GPUCheckConfig:
    out_dir: str = os.environ.get("OUT", "out/gpu_check")
    enforce_eager: bool = False       # CUDA graphs on, as in training; true starts faster
    only_cycle: bool = False          # 5. the RL cycle alone


def gpu_memory_used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def trainer_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(response_ids, device="cuda")[:, None])[:, 0].cpu()


def cycle_model(out, shape, name):
    """A Qwen3 of `shape`, random bf16 weights and the tiny tokenizer: a Hugging Face directory."""
    model_dir = out / name
    if (model_dir / "config.json").is_file():
        return model_dir
    tokenizer = tiny.build_tokenizer(tiny.TinyConfig())
    config = Qwen3Config(vocab_size=151936, **shape, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=32768, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    torch.cuda.empty_cache()
    return model_dir


def rl_cycle(cfg, out, results):
    """5: rollout (random weights write noise; the memory is real), sleep, old log-probs, a training
    step, wake + sync (rl.sync_weights), twice, then rollout. Per phase: its seconds, the device's
    used memory (vLLM's sleep pool is outside PyTorch's counters) and PyTorch's peak."""
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device())
    model_dir = cycle_model(out, QWEN3_4B_SHAPE, "cycle-model")
    context = 20480 // 2  # the paper's micro-batch (stage1.yaml): 2 trajectories, 2 micro-batches
    rl_cfg = load_config(rl.RLConfig, [
        f"model={model_dir}", "micro_batch_tokens=20480",
        "logprob_chunk_tokens=1024", "activation_checkpointing=true", "rollout.dtype=bfloat16",
        "rollout.gpu_memory_utilization=0.3", "rollout.max_prompt_tokens=1024",
        f"rollout.max_response_tokens={context - 1024}", "rollout.use_tool=false",
        f"rollout.enforce_eager={cfg.enforce_eager}"])
    shape = plan.ModelShape.from_config(model_dir / "config.json")
    total = torch.cuda.mem_get_info()[1]
    planned, phases = plan.plan(rl_cfg, shape, 1, total), []

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
    problems = [row["problem"] for row in tiny.make_arithmetic_problems(16, seed=2)]
    plain = dataclasses.replace(rl_cfg.rollout, max_response_tokens=256)
    ids = torch.randint(0, shape.vocab, (4, context), generator=torch.Generator().manual_seed(0))
    samples = [TrainSample(row[:1024].tolist(), row[1024:].tolist(), [1] * (context - 1024),
                           advantage=(-1.0) ** i) for i, row in enumerate(ids)]
    for round_ in range(2):
        engine.cfg = plain
        measure(f"{round_}: rollout",
                lambda: rollout.generate(engine, None, tokenizer, problems, 2, plain, seed=round_))
        engine.cfg = rl_cfg.rollout
        measure(f"{round_}: sleep", engine.sleep)
        measure(f"{round_}: old log-probs",
                lambda: rl.recompute_logprobs(model, samples, rl_cfg, 0, device))
        measure(f"{round_}: train step", lambda: rl.train_step(
            model, optimizer, samples, rl_cfg, round_, 0, device))
        measure(f"{round_}: wake + weight sync",
                lambda: rl.sync_weights(engine, model, torch.bfloat16))
    engine.cfg = plain
    measure("last: rollout",
            lambda: rollout.generate(engine, None, tokenizer, problems, 2, plain, seed=99))
    results["rl_cycle"] = dict(
        K=engine.max_concurrency(), phases=phases, gpu_total_gib=total / 2**30,
        params_B=shape.numel() / 1e9, plan_training_peak_gib=planned["train"]["peak"] / 2**30,
        plan_phases_gib={k: v / 2**30 for k, v in planned["phases"].items()},
        plan_K=planned["engine"]["K"], plan_fits=planned["fits"])
    engine.close()


def step_bench_args(cfg, model_dir, train_data):
    """bench/rl.py's arguments: rl.py's 1-GPU config on the random model, tools off, all trained."""
    return ["configs/qwen3_1p7b_1gpu.yaml", f"model={model_dir}", f"train_data={train_data}",
            "rollout.use_tool=false", "filter_all_equal=false", "rollout.max_response_tokens=1024",
            f"rollout.enforce_eager={cfg.enforce_eager}", "bench_steps=2"]


def step_bench(cfg, out, results):
    """6: the rollout phase inside rl.py's steps against plain LLM.generate (bench/rl.py)."""
    init_distributed()
    model_dir = cycle_model(out, QWEN3_1P7B_SHAPE, "step-bench-model")
    train_data = out / "step-bench-train.jsonl"
    train_data.write_text("".join(json.dumps(row) + "\n"
                                  for row in tiny.make_arithmetic_problems(512, seed=3)))
    bench_cfg, rl_args = rl_bench.split_args(step_bench_args(cfg, model_dir, train_data))
    run_dir = tempfile.mkdtemp(prefix="step-bench-run-", dir=out)  # resume=never: a fresh one
    rows = rl_bench.bench(bench_cfg, rl_bench.bench_rl_config(rl_args, run_dir))
    plain, phase = (sum(r["seconds"] for r in rows if r["mode"] == mode)
                    for mode in ("plain LLM.generate", "rl.py rollout phase"))
    results["rl_step_rollout"] = {"rollout_phase_over_plain": plain / phase, "plain_s": plain,
                                  "rollout_phase_s": phase, "rows": rows}


def main(cfg):
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA (or ROCm) GPU here; the CPU path is tests/test_rollout.py, "
                 "tests/test_rl.py and tests/test_plan.py")
    out, failures = Path(cfg.out_dir), []
    out.mkdir(parents=True, exist_ok=True)
    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "vllm": vllm.__version__, "hip": torch.version.hip}}

    def check(name, fn):
        try:
            fn()
        except Exception:  # record and go on: one call should report every check it can
            failures.append(name)
            results[name] = {"error": traceback.format_exc(limit=4)}

    if not cfg.only_cycle:
        checks_1_to_4(cfg, out, results, check)
    check("rl_cycle", lambda: rl_cycle(cfg, out, results))
    if not cfg.only_cycle:
        check("rl_step_rollout", lambda: step_bench(cfg, out, results))
    results["failures"] = failures
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(verdict(results))
    return 1 if failures else 0


def sampling(engine, trainer, prompt, results):
    """On the model runner CUDA runs (vLLM 0.33's V2; CPU tests: V1): sampled log-probs at T = 0.6
    are the trainer's log_softmax(logits / 0.6), and a request's seed fixes its tokens."""
    engine.update_weights(trainer.state_dict().items())
    ids = itertools.count()

    def sample(seed):
        request = f"sampling-{next(ids)}"
        engine.add(request, prompt, 48, seed, [], 0.6, 1.0)
        done = {}
        while engine.has_unfinished():
            done.update((request, (tokens, logprobs))
                        for request, tokens, logprobs in engine.step())
        return done[request]

    tokens, logprobs = sample(7)
    tempered = (torch.tensor(logprobs)
                - trainer_logprobs(trainer, prompt, tokens, temperature=0.6)).abs()
    rerun, other = sample(7)[0], sample(8)[0]
    results["sampling"] = {"tokens": len(tokens), "vs_trainer_at_0.6_mean": tempered.mean().item(),
                           "vs_trainer_at_0.6_max": tempered.max().item(),
                           "same_seed_same_tokens": rerun == tokens,
                           "other_seed_other_tokens": other != tokens}
    if tempered.mean() > 0.05 or rerun != tokens or other == tokens:
        raise AssertionError(f"sampling: {results['sampling']}")


def brief(value):  # a check's scalars on one line, floats to 3 significant digits
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in value.items() if isinstance(v, (int, float, str, bool)))


def verdict(results):
    """One screen: PASS or FAIL per check with its numbers or its error's last line, and a row per
    phase of the RL cycle."""
    failures = results.get("failures", [])
    lines = [f"gpu_check.py on {results['env']['gpu']}: "
             f"{'FAIL (' + ', '.join(failures) + ')' if failures else 'PASS'}"]
    for name, value in results.items():
        if name in ("env", "failures") or not isinstance(value, dict):
            continue
        lines.append((f"FAIL {name}: {value['error'].strip().splitlines()[-1]}" if name in failures
                      else f"PASS {name}: {brief(value)}")[:160])
        lines += [f"     {phase['phase'][:44]:44} {phase['seconds']:7.1f} s  used "
                  f"{phase['device_used_gib']:6.1f} GiB  "
                  f"peak {phase['torch_peak_allocated_gib']:6.1f} GiB"
                  for phase in value.get("phases", []) if name not in failures]
    return "\n".join(lines)


def checks_1_to_4(cfg, out, results, check):
    init_distributed()

    # tiny.py's Qwen3 layout at ~200M parameters (random weights: agreement and speed)
    model_dir = tiny.build_tiny_model(tiny.TinyConfig(
        out_dir=str(out / "model"), hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, pretrain_steps=0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rcfg = rollout.RolloutConfig(dtype="bfloat16", enforce_eager=cfg.enforce_eager,
                                 gpu_memory_utilization=0.4, max_prompt_tokens=512,
                                 max_response_tokens=1024)
    engine = Engine(model_dir, rcfg, seed=0)  # its start is timed in the RL cycle (5)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompt = render_prompt(tokenizer, "Compute 4821 * 37 - 905.", rcfg)
    fixed = tokenizer.encode(" I will compute it. </reason>\n"
                             "<answer> \\boxed{177472} </answer><|im_end|>",
                             add_special_tokens=False)

    def weights_and_logprobs():  # 1-2: one training step, update_weights, bf16 agreement
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        batch = torch.tensor([prompt + fixed], device="cuda")
        trainer(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.update_weights(trainer.state_dict().items())  # timed in the RL cycle's weight sync
        bf16 = (torch.tensor(engine.score([prompt], [fixed])[0])
                - trainer_logprobs(trainer, prompt, fixed)).abs()
        results["logprobs_bf16"] = {"tokens": len(fixed), "vs_trainer_bf16_max": bf16.max().item(),
                                    "vs_trainer_bf16_mean": bf16.mean().item()}
        if bf16.mean() > 0.05:
            raise AssertionError(f"engine vs trainer mean |diff| {bf16.mean():.3g}")

    check("logprobs_bf16", weights_and_logprobs)
    check("sampling", lambda: sampling(engine, trainer, prompt, results))

    # 3. sleep / wake_up at level 2 (the weights discarded, so reloaded between waking the weights
    # and the KV cache, rl.sync_weights' order) and level 1 (kept in host RAM)
    def sleep_wake():
        engine.update_weights(trainer.state_dict().items())
        reference = engine.score([prompt], [fixed])[0]
        for level in (2, 1):  # the engine is closed after this check: its cfg need not go back
            engine.cfg = dataclasses.replace(rcfg, sleep_level=level)
            awake, rss = gpu_memory_used_gib(), psutil.Process().memory_info().rss
            engine.sleep()
            asleep = gpu_memory_used_gib()
            host = (psutil.Process().memory_info().rss - rss) / 2**30
            engine.wake_up(tags=["weights"])
            if level == 2:
                engine.update_weights(trainer.state_dict().items())
            engine.wake_up(tags=["kv_cache"])

            drift = max(abs(a - b) for a, b in zip(reference, engine.score([prompt], [fixed])[0]))
            results[f"sleep_wake_level{level}"] = {
                "gpu_used_awake_gib": awake, "gpu_used_asleep_gib": asleep,
                "host_rss_growth_asleep_gib": host, "logprob_drift_after_wake": drift}
            if asleep > awake - 0.5 or drift > 1e-3:
                raise AssertionError(f"level {level}: sleep freed {awake - asleep:.2f} GiB, "
                                     f"log-prob drift {drift:.3g}")

    check("sleep_wake", sleep_wake)

    del trainer
    torch.cuda.empty_cache()
    engine.close()  # frees the GPU for the benchmark's own engine

    check("barrier_bench", lambda: results.update(barrier_bench=rollout_bench.bench(
        rollout_bench.BenchConfig(model=str(model_dir), trajectories=64,
                                  tool_latencies_s=[0.0, 0.3], repeats=1,
                                  rollout=dataclasses.replace(rcfg)))))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = load_config(GPUCheckConfig, sys.argv[1:])
    except ValueError as e:
        sys.exit(f"gpu_check.py: {e}")
    sys.exit(main(config))
