"""Real, tiny MLX language models with random weights, for tests (no downloads).

The models are the mlx-lm architectures themselves, shrunk until a prefill of a
few dozen tokens takes milliseconds on a CPU, so codec tests can check the one
thing that matters: a restored cache makes the model produce the very same
logits and tokens as the cache it was saved from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path
from mlx_lm.models import lfm2, llama, qwen2

VOCAB = 1000

_M = TypeVar("_M", bound=nn.Module)


def _finish(model: _M, dtype: mx.Dtype) -> _M:
    # With default init the (tied) embedding dominates the residual stream and
    # greedy decoding just repeats the input token, which would make "same
    # tokens after restore" a toothless check. Louder projections make the
    # output depend on the attention over the cache.
    model.update(
        tree_map_with_path(
            lambda path, p: p * 4 if p.ndim == 2 and "embed" not in path else p,
            model.parameters(),
        )
    )
    # bf16 is what real caches hold; it exercises the codec's odd-format path.
    model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def tiny_llama(seed: int = 0, dtype: mx.Dtype = mx.bfloat16, layers: int = 4,
               kv_heads: int = 2) -> llama.Model:
    """A 4-layer llama (hidden 256, 4 heads, 2 kv heads, head dim 64) with random weights."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=layers,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
    )
    return _finish(llama.Model(args), dtype)


def tiny_lfm2(seed: int = 0, dtype: mx.Dtype = mx.bfloat16) -> lfm2.Model:
    """A 4-layer LFM2 hybrid: conv layers keep an ArraysCache, attention layers a KVCache."""
    mx.random.seed(seed)
    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=128,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=256,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    )
    return _finish(lfm2.Model(args), dtype)


def tiny_qwen2(seed: int = 0, dtype: mx.Dtype = mx.bfloat16, kv_heads: int = 2) -> qwen2.Model:
    """A 4-layer qwen2 with random weights. It has no cache layout of its own,
    so ``max_kv_size`` gives mlx-lm's RotatingKVCache (which keeps 4 tokens)."""
    mx.random.seed(seed)
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=256, num_hidden_layers=4,
                           intermediate_size=512, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=VOCAB, num_key_value_heads=kv_heads)
    return _finish(qwen2.Model(args), dtype)


def tiny_deepseek_v41(seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """An 8-layer DeepSeek V4.1 (mlx-lm 0.32 and later) with random weights:
    a window of 8 tokens in every layer; two layers that pool 16 tokens into
    one and four that pool 4. Layers 1, 3 and 6 keep the compressed KV (and
    the open group), 1 and 3 also index keys, and 3 picks candidate blocks
    for the index readers after it. Every field of its ``LayerCache`` is in use.
    The layers sharing an index have one ratio, as the model expects (a
    ratio-16 layer reading a ratio-4 index gathers rows past the end: NaN now
    and then). float32: MLX on the CPU runs experts (GatherMM) in float32 only."""
    from mlx_lm.models import deepseek_v41

    mx.random.seed(seed)
    args = deepseek_v41.ModelArgs(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2,
        sliding_window=8, compress_ratios=(0, 16, 16, 4, 4, 4, 4, 0),
        kv_source_layer_ids=(1, 3, 6), index_source_layer_ids=(1, 3, 4),
        index_n_heads=2, index_head_dim=16, index_topk=3, candidate_source_layer_id=3,
        candidate_topk_blocks=2, candidate_block_size=2, max_position_embeddings=4096)
    return _finish(deepseek_v41.Model(args), dtype)


def prompt(n: int, seed: int = 0) -> list[int]:
    """n deterministic token ids in the tiny vocabulary."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


def prefill(model: nn.Module, tokens: Sequence[int], cache: list[Any]) -> mx.array:
    """Run the prompt through the model into `cache`; return the last position's logits."""
    logits = model(mx.array([list(tokens)]), cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits


def greedy_decode(model: nn.Module, cache: list[Any], first_token: int, n: int) -> list[int]:
    """Feed `first_token`, then n-1 argmax tokens, one step at a time; return the n argmax tokens.

    Every step is evaluated before the next one, like a real generation loop,
    so MLX gets the chance to update cache buffers in place.
    """
    out: list[int] = []
    token = first_token
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        token = int(mx.argmax(logits).item())
        out.append(token)
    return out


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def arrays_from_snapshot(snapshot: Any) -> dict[str, mx.array]:
    """Rebuild a CacheSnapshot's tensors as fresh MLX arrays (copies of the joined runs).

    What a reader gets back from the file the daemon writes, without the daemon.
    """
    from kvkeeper.client.codec import mlx_dtype

    out: dict[str, mx.array] = {}
    for t in snapshot.tensors:
        dtype = mlx_dtype(t.dtype)
        raw = np.frombuffer(b"".join(t.runs), dtype=_UINT[dtype.size]).copy()
        out[t.name] = mx.array(raw).view(dtype).reshape(t.shape)
    return out
