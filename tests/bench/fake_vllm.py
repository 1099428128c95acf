"""A stand-in for vLLM 0.25's offline API (vllm.LLM, SamplingParams, TokensPrompt), enough for bench/peer_vllm.py
to run on a machine without a GPU: the argument names and result fields are those of vLLM 0.25.0's source
(vllm/entrypoints/llm.py, vllm/outputs.py). Generation sleeps in proportion to the work and counts cached
tokens as vLLM's prefix cache does (full 16-token blocks, never the whole prompt)."""

FAKE_MODULE = """
import time
from types import SimpleNamespace

__version__ = "0.25.0-fake"
BLOCK = 16


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.cached = set()
        scheduler = SimpleNamespace(max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 16384))
        cache = SimpleNamespace(block_size=BLOCK)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=scheduler, cache_config=cache))

    def generate(self, prompts, params, use_tqdm=True):
        outputs, work = [], 0
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            hit = 0
            for end in range(BLOCK, len(ids), BLOCK):  # the last token is always computed
                if tuple(ids[:end]) not in self.cached:
                    break
                hit = end
            for end in range(BLOCK, len(ids) + 1, BLOCK):
                self.cached.add(tuple(ids[:end]))
            work += len(ids) - hit
            tokens = list(range(params.max_tokens))
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)], num_cached_tokens=hit))
        time.sleep(2e-6 * work + 0.02 * params.max_tokens)  # a decode step well above timer noise
        return outputs
"""
