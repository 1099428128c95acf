"""Why vLLM's DeepSeek decode with dummy weights reads only 6 experts a layer whatever the batch (CPU, seconds).

vLLM draws every parameter uniform in (-1e-3, 1e-3). The residual stream is then the token's embedding, the gate's
bf16 logits come out ~1e-5, and vLLM 0.25's grouped top-k (fused_moe/router/grouped_topk_router.py) takes
torch.softmax of those bf16 logits, which returns bf16: all 64 probabilities round to exactly 2^-6, top-k sees a
64-way tie, and every token of a batch gets the same 6 experts. Our router scores in float32 and spreads the
tokens (bench/results/2026-12-02-h200-dsv2-decode: 50 of 64 experts hit at 16 rows). This prints both for a
batch drawn the same way; bench/peer_h200.sh VLLM_ROUTING=uniform_random gives vLLM random routing instead.

    python3 bench/probes/vllm_dummy_routing.py
"""

from __future__ import annotations

import argparse
import json

import torch


def draw(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.rand(*shape, generator=generator) * 2e-3 - 1e-3).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    hidden = draw(generator, args.tokens, args.hidden)  # the residual: the tokens' embeddings
    norm_weight = draw(generator, args.hidden)
    gate = draw(generator, args.experts, args.hidden)
    normed = (hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    logits = (normed * norm_weight) @ gate.T  # bf16, as vLLM's gate returns them
    scores_bf16 = torch.softmax(logits, dim=-1)
    scores_fp32 = torch.softmax(logits.float(), dim=-1)
    top_bf16 = torch.topk(scores_bf16, args.top_k).indices
    top_fp32 = torch.topk(scores_fp32, args.top_k).indices
    result = {
        "tokens": args.tokens,
        "logit_abs_max": float(logits.abs().max()),
        "distinct_bf16_scores_per_token_max": max(len(set(row.tolist())) for row in scores_bf16),
        "experts_hit_bf16_softmax": int(top_bf16.unique().numel()),
        "experts_hit_fp32_softmax": int(top_fp32.unique().numel()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
