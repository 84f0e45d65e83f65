"""The GPU check of rollout.py, in one call: what CPU tests cannot show, measured on one CUDA GPU with `vllm`.

    python gpu_check.py [out_dir=$OUT] [hidden_size=1024 num_hidden_layers=12] [prompts=64 max_tokens=256]

Needs requirements-gpu.txt installed and no network (the model is a random Qwen3 built by tiny.py, larger than the
CPU one so the numbers mean something). It checks and times, in this order:
  1. log-prob agreement in bf16: after an optimizer step and update_weights, engine log-probs of fixed tokens vs the
     trainer's (HF, bf16) and vs an fp32 reference of the same weights; bf16 cannot match to 1e-5 like fp32 on CPU,
     so the numbers are reported and only a gross mismatch (mean |diff| > 0.05) fails;
  2. the time of one weight update, the whole state dict at once and lazily (one tensor gathered at a time);
  3. sleep / wake_up: GPU memory freed by sleep, and that generation and log-probs are intact after waking;
  4. throughput: rollout.generate (no tool, n=1) vs vLLM's own LLM.generate on the same prompts and lengths;
  5. the barrier-free loop vs a per-turn barrier with tool calls (rollout.bench's scripted trajectories).
Results: printed as a Markdown block for GPU_CHECK.md and written to out_dir/gpu_check.json. Exit code 1 if a
check failed. STATUS: written on a CPU-only machine and not yet run on a GPU; GPU_CHECK.md records the first run.
"""
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from common import load_config


@dataclasses.dataclass
class GPUCheckConfig:
    out_dir: str = os.environ.get("OUT", "out/gpu_check")
    # the model: tiny.py's Qwen3 layout at ~200M parameters (random weights; only agreement and speed are measured)
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

    def validate(self):
        if self.prompts < 1 or self.max_tokens < 1 or self.bench_trajectories < 1:
            raise ValueError("prompts, max_tokens and bench_trajectories must be >= 1")


def gpu_memory_used_gib():
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def trainer_logprobs(model, prompt_ids, response_ids):
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids, device="cuda")[:, None])[:, 0].cpu()


def main(cfg):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common
    import rollout
    import tiny

    if not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA GPU here; the CPU path is covered by tests/test_rollout.py")
    results, failures = {}, []
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import vllm

    results["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__}
    common.init_distributed()

    model_dir = tiny.build_tiny_model(tiny.TinyConfig(
        out_dir=str(out / "model"), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, pretrain_steps=0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rcfg = rollout.RolloutConfig(dtype="bfloat16", gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 enforce_eager=cfg.enforce_eager, max_prompt_tokens=512, max_response_tokens=1024)
    start = time.perf_counter()
    engine = rollout.Engine(model_dir, rcfg, seed=0)
    results["engine_start_s"] = time.perf_counter() - start
    results["max_concurrency_K"] = engine.max_concurrency()

    def check(name, fn):
        try:
            fn()
        except Exception:  # record and go on: one call should report every check it can
            failures.append(name)
            results[name] = {"error": traceback.format_exc(limit=4)}

    # 1-2. weight update and log-prob agreement in bf16
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompt = rollout.render_prompt(tokenizer, "Compute 4821 * 37 - 905.", rcfg)
    fixed = tokenizer.encode(" I will compute it. </reason>\n<answer> \\boxed{177472} </answer><|im_end|>",
                             add_special_tokens=False)

    def weights_and_logprobs():
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        batch = torch.tensor([prompt + fixed], device="cuda")
        trainer(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = (torch.tensor(engine.score([prompt], [fixed])[0]) - trainer_logprobs(trainer, prompt, fixed)).abs()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.update_weights(trainer.state_dict().items())
        torch.cuda.synchronize()
        full_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.update_weights((name, tensor.detach().clone()) for name, tensor in trainer.state_dict().items())
        torch.cuda.synchronize()
        lazy_s = time.perf_counter() - start
        engine_lp = torch.tensor(engine.score([prompt], [fixed])[0])
        bf16 = (engine_lp - trainer_logprobs(trainer, prompt, fixed)).abs()
        fp32 = (engine_lp - trainer_logprobs(trainer.float(), prompt, fixed)).abs()
        trainer.bfloat16()
        results["weights"] = {"params_M": sum(p.numel() for p in trainer.parameters()) / 1e6,
                              "update_full_state_dict_s": full_s, "update_lazy_generator_s": lazy_s}
        results["logprobs_bf16"] = {"before_update_max": before.max().item(), "vs_trainer_bf16_max": bf16.max().item(),
                                    "vs_trainer_bf16_mean": bf16.mean().item(), "vs_fp32_reference_max": fp32.max().item(),
                                    "vs_fp32_reference_mean": fp32.mean().item(), "tokens": len(fixed)}
        if bf16.mean() > 0.05:
            raise AssertionError(f"engine vs trainer mean |diff| {bf16.mean():.3g} after update_weights")

    check("logprobs_bf16", weights_and_logprobs)

    # 3. sleep / wake_up around a training step
    def sleep_wake():
        reference = engine.score([prompt], [fixed])[0]
        awake = gpu_memory_used_gib()
        start = time.perf_counter()
        engine.sleep()
        sleep_s, asleep = time.perf_counter() - start, gpu_memory_used_gib()
        start = time.perf_counter()
        engine.wake_up()
        wake_s = time.perf_counter() - start
        again = engine.score([prompt], [fixed])[0]
        drift = max(abs(a - b) for a, b in zip(reference, again))
        results["sleep_wake"] = {"gpu_used_awake_gib": awake, "gpu_used_asleep_gib": asleep, "sleep_s": sleep_s,
                                 "wake_s": wake_s, "logprob_drift_after_wake": drift}
        if asleep > awake - 0.5 or drift > 1e-3:
            raise AssertionError(f"sleep freed {awake - asleep:.2f} GiB, log-prob drift {drift:.3g}")

    check("sleep_wake", sleep_wake)

    # 4. rollout loop vs plain LLM.generate, same prompts, no tool, the same number of tokens
    def throughput():
        plain_cfg = dataclasses.replace(rcfg, use_tool=False, max_response_tokens=cfg.max_tokens)
        problems = [row["problem"] for row in tiny.make_arithmetic_problems(cfg.prompts, seed=1)]
        prompts = [rollout.render_prompt(tokenizer, p, plain_cfg) for p in problems]
        engine.generate_plain(prompts[:4], 8)  # warm-up
        start = time.perf_counter()
        plain = engine.generate_plain(prompts, cfg.max_tokens)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        groups = rollout.generate(engine, None, tokenizer, problems, 1, plain_cfg, seed=0)
        loop_s = time.perf_counter() - start
        loop_tokens = sum(len(t.response_ids) for g in groups for t in g)
        plain_tokens = sum(map(len, plain))
        results["throughput"] = {"prompts": cfg.prompts, "plain_tokens_per_s": plain_tokens / plain_s,
                                 "rollout_tokens_per_s": loop_tokens / loop_s,
                                 "rollout_over_plain": (loop_tokens / loop_s) / (plain_tokens / plain_s),
                                 "rollout_tokens": loop_tokens, "plain_tokens": plain_tokens}

    check("throughput", throughput)
    del trainer
    torch.cuda.empty_cache()
    engine.close()  # frees the GPU for the benchmark's own engine (and ends torch.distributed; bench restarts it)

    # 5. the barrier benchmark on the GPU
    def barrier_bench():
        bench_cfg = rollout.RolloutCLIConfig(mode="bench", model=str(model_dir), trajectories=cfg.bench_trajectories,
                                             tool_latencies_s=[0.0, cfg.tool_latency_s], repeats=1, rollout=dataclasses.replace(rcfg))
        results["barrier_bench"] = rollout.bench(bench_cfg)

    check("barrier_bench", barrier_bench)

    results["failures"] = failures
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print("\n## gpu_check.py results\n```json\n" + json.dumps(results, indent=1) + "\n```")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = load_config(GPUCheckConfig, sys.argv[1:])
    except ValueError as e:
        sys.exit(f"gpu_check.py: {e}")
    sys.exit(main(config))
