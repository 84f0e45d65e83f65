"""What the end-to-end tests of rl.py, tools/replay.py and tools/filter_solved.py share: a policy
small enough to train in seconds that still calls the tool and answers, and rl.py's command for it
(conftest.py's sft_policy and saved_run fixtures build on these)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import tiny

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Four problems with small numbers: a 0.2M-parameter model memorises their transcripts in 120 SFT
# steps (~35 s of CPU) and then samples right and wrong answers at temperature 1, so RL groups have
# mixed rewards and really train.
MEMO_PROBLEMS = [{"id": f"memo-{i}", "problem": f"Compute {a} * {b} + {c}.",
                  "answer": str(a * b + c)}
                 for i, (a, b, c) in enumerate([(3, 4, 5), (6, 7, 8), (2, 9, 1), (5, 5, 5)])]


def run(cmd, **kw):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    return proc


def train_sft_policy(work):
    """A small policy that calls the tool and answers, sometimes right: tiny.py's architecture at
    hidden 64 x 2 layers, after sft.py on transcripts of MEMO_PROBLEMS (run through the real
    executor)."""
    model = tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(work / "model"), hidden_size=64,
                                                  intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=1, num_key_value_heads=1,
                                                  pretrain_steps=0))
    rows = tiny.make_sft_transcripts(MEMO_PROBLEMS * 40, error_fraction=0.0, seed=0)
    (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run([PYTHON, "sft.py", "configs/sft_tiny.yaml", f"model={model}", f"data={work / 'sft.jsonl'}",
         f"out_dir={work / 'run'}", "global_batch_size=8", "epochs=6", "lr=1e-2", "save_every=0",
         "train_threads=1"],
        timeout=900)
    return work / "run" / "final"


def rl_command(policy, data, out_dir):
    return [PYTHON, "rl.py", "configs/tiny.yaml", f"model={policy}", f"train_data={data}",
            "eval_data=", f"out_dir={out_dir}", "steps=2", "prompts_per_step=4", "save_every=1",
            "rollout.max_response_tokens=200", "train_threads=1"]
