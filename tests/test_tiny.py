"""The tiny model and its locally trained tokenizer (tiny.py): an ordinary Hugging Face
directory."""
import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import rollout
import sft
from machinery.config import REPO, load_config
from tiny import (TOOL_TOKENS, build_tokenizer, random_model, make_arithmetic_problems,
                  make_sft_transcripts, pretrain_base_model, pretraining_documents, TinyConfig,
                  write_sft_transcripts)
from machinery.conversations import check_conversation
from machinery.prompts import render_prompt

CODE_TOOL = json.loads((REPO / "configs/templates/python_code_with_standard_io.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tokenizer_round_trips_text_math_and_code(tokenizer):
    texts = ["Compute 4821 * 37 - 905.", "Find $\\frac{\\sqrt{2}}{2}$ when $x^2+y^2=1$.",
             "print(sum(range(10)))\n", "ünïcødé → ∑ 😀", "  leading spaces\ttabs\n\nnewlines  ",
             '{"name": "f", "arguments": {"code": "x=1"}}']
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text


def test_rstar2_tokens_are_single_tokens_and_tool_tokens_survive_skip_special(tokenizer):
    for token in ["<|im_start|>", "<|im_end|>"] + TOOL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] == tokenizer.convert_tokens_to_ids(token), token
    text = "<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_digits_are_single_tokens(tokenizer):
    """The Qwen pre-tokenizer splits numbers into digits; the arithmetic task relies on it."""
    ids = tokenizer("905123", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in ids] == list("905123")


def test_chatml_template_renders_roles_tools_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\nT\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    text = tokenizer.apply_chat_template(messages[1:2], tools=[CODE_TOOL], tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou are provided with function "
                           'signatures within <tools></tools> XML tags:\n<tools>\n{"type": '
                           '"function", "function": {"name": "python_code_with_standard_io"')
    assert "}}}\n</tools><|im_end|>\n<|im_start|>user\nQ<|im_end|>\n" in text


def test_the_bpe_trained_on_the_templates_keeps_the_long_rstar2_prompt_short(tokenizer):
    # its text byte for byte: test_rollout.py
    assert len(render_prompt(tokenizer, "{Question}", rollout.RolloutConfig())) < 600


def test_model_directory_loads_with_auto_classes(tiny_model_dir, tokenizer):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert (config.model_type == "qwen3" and config.head_dim == 64
            and config.vocab_size >= len(tokenizer))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tokenizer("Compute 1 + 1.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()


def test_arithmetic_problems_are_seeded_correct_and_of_fixed_widths():
    """Every number has a fixed width, so each copied digit sits at a fixed distance."""
    rows = make_arithmetic_problems(3000, seed=0)
    assert rows[:50] == make_arithmetic_problems(50, seed=0) != make_arithmetic_problems(50, seed=4)
    shapes = set()
    for row in rows:
        assert str(eval(row["problem"][len("Compute "):-1])) == row["answer"]
        shapes.add(re.sub(r"\d", "9", row["problem"]))
        assert len(row["answer"]) == 6
    assert shapes == {"Compute 9999 * 99 + 999.", "Compute 9999 * 99 - 999.",
                      "Compute (9999 + 999) * 99."}


def test_pretraining_documents_are_worked_problems_without_the_system_prompt(tokenizer):
    row = {"id": "p", "problem": "Compute 2345 * 67 + 891.", "answer": str(2345 * 67 + 891)}
    clean, failed = (pretraining_documents([row], tokenizer, error_fraction=f)[0]
                     for f in (0.0, 1.0))
    for doc in (clean, failed):
        assert doc.startswith("<|im_start|>user\nCompute 2345 * 67 + 891.<|im_end|>\n"
                              "<|im_start|>assistant\n"
                              "<reason> I will compute 2345 * 67 + 891 with Python. </reason>\n"
                              "<tool_call>")
        assert "system" not in doc and "<tools>" not in doc
        assert doc.endswith("<|im_start|>assistant\n"
                            f"<reason> The result is {row['answer']}. </reason>\n"
                            f"<answer> \\boxed{{{row['answer']}}} </answer><|im_end|>\n")
    # an answer read from a failed call is part of the base model's text too, the number where a
    # clean call puts it
    assert clean.count("<tool_call>") == 1 and failed.count("<tool_call>") == 1
    assert ("Tool call success\nstdout: " in clean
            and "Tool call failure\nreason: \nstdout: " in failed)
    assert clean.split("stdout: ")[1] == failed.split("stdout: ")[1]


def test_pretraining_lowers_the_loss_and_is_reproducible(tmp_path):
    cfg = TinyConfig(out_dir=str(tmp_path), pretrain_steps=6, pretrain_batch_size=4, sft_data="")
    tokenizer = build_tokenizer(cfg)
    runs = [pretrain_base_model(random_model(cfg, tokenizer), tokenizer, cfg) for _ in range(2)]
    assert len(runs[0]) == 6 and runs[0][-1] < runs[0][0] - 0.5
    assert runs[0] == runs[1]


# the demo's SFT transcripts

def test_sft_transcripts_run_the_real_tool_and_end_in_the_boxed_answer():
    problems = make_arithmetic_problems(12, seed=5, split="sft")
    rows = make_sft_transcripts(problems, error_fraction=0.5, seed=0)
    # no timings: reruns are identical
    assert rows == make_sft_transcripts(problems, error_fraction=0.5, seed=0)
    failed = 0
    for row, problem in zip(rows, problems):
        check_conversation(row, problem["id"])
        messages = row["messages"]
        assert messages[0] == {"role": "user", "content": problem["problem"]}
        assert messages[-1]["content"].endswith("</reason>\n<answer> "
                                                f"\\boxed{{{problem['answer']}}} </answer>")
        assert len(messages) == 4  # one call, its result, the answer
        call = rollout.parse_tool_call(messages[1]["content"], "python_code_with_standard_io")
        expression = problem["problem"][8:-1]
        if call["code"] == f"print({expression})":
            # what the executor printed
            assert messages[2]["content"] == f"Tool call success\nstdout: {problem['answer']}\n"
        else:
            # printed, then the stray exit(1): the real sandbox reports a failure
            failed += 1
            assert call["code"] == f"print({expression})\nexit(1)"
            assert messages[2]["content"] == ("Tool call failure\nreason: \n"
                                              f"stdout: {problem['answer']}\n")
    assert 2 <= failed <= 10


def test_python_tiny_writes_transcripts_that_sft_tokenizes_within_its_length_limit(tiny_model_dir,
                                                                                   tmp_path):
    path = write_sft_transcripts(TinyConfig(sft_data=str(tmp_path / "sft.jsonl"), sft_examples=16,
                                            sft_error_fraction=0.5))
    cfg = load_config(sft.SFTConfig, [str(REPO / "configs/sft_tiny.yaml"),
                                      f"model={tiny_model_dir}", f"data={path}"])
    examples, dropped = sft.load_conversations(cfg, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert len(examples) == 16 and dropped == 0
    assert max(len(ids) for ids, _ in examples) < cfg.max_seq_len
