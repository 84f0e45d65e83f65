"""Chunked log-probs, as machinery/plan.py accounts for them, as ratios against a baseline of the
same run (counts, not timings: the machine's load does not enter):

    python -m bench.scale          # ~1 minute on 2 CPU cores, ~2 GiB

The peak bytes of live tensors (tests/instruments.py's PeakMemory) of
machinery.training.token_logprobs forward + backward on a one-layer Qwen3 model with the
151,936-token vocabulary, all at once (the baseline) against chunks; beside each, the plan's.
"""
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from machinery import plan
from machinery.training import token_logprobs
from tests.instruments import peak_memory

TOKENS, VOCAB, CHUNKS = 512, 151936, (256, 128, 64)


def bench_logprobs():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
        dtype=torch.float32)
    shape = plan.ModelShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2,
                            head_dim=64, vocab=VOCAB, tied=False)
    input_ids = torch.randint(0, VOCAB, (1, TOKENS + 1))
    print(f"log-probs of {TOKENS} tokens, vocabulary {VOCAB}: peak above the model and its "
          "gradients (from a micro-batch before)\n"
          f"  {'logprob_chunk_tokens':>22s} {'measured MiB':>13s} {'vs all at once':>15s} "
          f"{'plan MiB':>9s}")
    baseline = None
    for chunk in (0, *CHUNKS):
        def step():  # gradients accumulate into the ones a micro-batch before made
            token_logprobs(model, input_ids, 1.0, chunk).sum().backward()

        model.zero_grad(set_to_none=True)
        step()
        peak, start, _ = peak_memory(step, model)
        baseline = baseline or peak - start
        # the plan's head term, and a chunk's output-projection gradient added to .grad meanwhile
        planned = (plan.trainer_memory(shape, 1, TOKENS, chunk, False, c=4)["logprob_head"]
                   + (4 * VOCAB * shape.hidden if chunk and chunk < TOKENS else 0))
        print(f"  {chunk or 'all at once':>22} {(peak - start) / 2**20:13.1f} "
              f"{(peak - start) / baseline:15.3f} {planned / 2**20:9.1f}")


if __name__ == "__main__":
    bench_logprobs()
