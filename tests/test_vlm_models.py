"""mlx-vlm's text models whose prompt caches are not plain KVCache lists
(classes of their own, PoolingCache, CacheList, ...), as real tiny models
with random weights: a cache saved after a chunked prefill and a few decode
steps restores to one that gives the same logits, and a capture taken
mid-generation without a copy holds the cache as it was then. A survey of
mlx-vlm 0.7.10's model families on 2026-12-03 found these faithful, and
diffusion_gemma's static cache (below) not, until the codec mended it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from kvkeeper.client import codec
from kvkeeper.client.codec import capture_cache, encode_capture, restore_cache, snapshot_cache
from kvkeeper.integrations import length_mismatch, plan_reuse

from .tiny import arrays_from_snapshot

VOCAB = 64


def _randomized(model: Any, seed: int = 0) -> Any:
    # Weights loud enough that the logits depend on the attention over the cache.
    mx.random.seed(seed)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.2)
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def _deepseek_v4() -> Any:  # PoolingCache inside CacheList, RotatingKVCache
    from mlx_vlm.models.deepseek_v4.config import ModelConfig
    from mlx_vlm.models.deepseek_v4.language import LanguageModel

    return LanguageModel(ModelConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32, qk_rope_head_dim=8,
        head_dim=32, compress_ratios=[0, 4, 128, 4], hc_mult=2, hc_sinkhorn_iters=3,
        num_hash_layers=1, sliding_window=8, o_groups=2, o_lora_rank=32, index_n_heads=2,
        index_head_dim=16, index_topk=3, index_block=4, index_keep=2))


def _glm5_next() -> Any:  # ArraysCache; CacheList(KVCache, KVCache, PoolingCache, KVCache)
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import LanguageModel

    return LanguageModel(TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=0,
        v_head_dim=16, qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
        layer_types=["linear_attention", "deepseek_sparse_attention",
                     "deepseek_sparse_attention", "linear_attention"],
        index_topk_pattern="FFSF", linear_head_dim=16, linear_num_heads=4, hc_mult=2,
        hc_sinkhorn_iters=3, index_kpool=4, first_k_dense_replace=1, pad_token_id=0))


def _deepseek_v41() -> Any:  # one DeepseekV41Cache for every layer
    from mlx_vlm.models.deepseek_v41.config import ModelConfig
    from mlx_vlm.models.deepseek_v41.engram import NgramHashState
    from mlx_vlm.models.deepseek_v41.language import LanguageModel

    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8,
        q_lora_rank=32, o_lora_rank=32, o_groups=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, sliding_window=4, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4, 6], index_n_heads=2,
        index_head_dim=32, index_topk=3, candidate_source_layer_id=4, candidate_topk_blocks=4,
        candidate_block_size=2, hc_mult=2, hc_sinkhorn_iters=3, engram_layer_ids=[1, 5],
        engram_num_embeddings=[2000, 2000], engram_max_ngram_size=3, engram_vocab_size=101,
        engram_n_heads=2, engram_head_dim=8, image_token_id=63,
        engram_compressed_vocab_size=64)
    model = LanguageModel(cfg)
    if model.layout is not None:
        model.engram_hash = NgramHashState(cfg, model.layout, token_map=list(range(VOCAB)))
    return model


def _minimax_m3() -> Any:  # MiniMaxM3KVCache (index keys) beside KVCache
    from mlx_vlm.models.minimax_m3_vl.config import TextConfig
    from mlx_vlm.models.minimax_m3_vl.language import LanguageModel

    return LanguageModel(TextConfig(
        hidden_size=64, intermediate_size=32, dense_intermediate_size=64,
        shared_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        moe_layer_freq=[0, 1, 1],
        layer_types=["minimax_m3_full", "minimax_m3_sparse", "minimax_m3_sparse"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1))


def _qwen4_exp() -> Any:  # QSAKVCache (block index) beside ArraysCache
    from mlx_vlm.models.qwen4_exp.config import ModelConfig, TextConfig, VisionConfig
    from mlx_vlm.models.qwen4_exp.language import LanguageModel

    cfg = TextConfig(
        model_type="qwen4_exp", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=32, moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2,
        max_position_embeddings=4096, hc_count=2, hc_lowrank=8, head_dim=32,
        full_attention_interval=2, ple_embed_dim=64, heads_per_ngram=2, indexer_n_heads=2,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters={"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 10000,
                         "partial_rotary_factor": 0.25})
    return LanguageModel(cfg, ModelConfig(
        text_config=cfg, vision_config=VisionConfig(), model_type="qwen4_exp",
        image_token_id=62, video_token_id=61, vision_start_token_id=60,
        vision_end_token_id=59, vocab_size=VOCAB))


def _hy_v4() -> Any:  # HyV4KVCache inside CacheList (an indexer cache 0 values wide)
    from mlx_vlm.models.hy_v4.config import ModelConfig
    from mlx_vlm.models.hy_v4.language import LanguageModel

    return LanguageModel(ModelConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, n_routed_experts=4,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        v_head_dim=32, qk_nope_head_dim=32, index_head_dim=32, index_n_heads=2, index_topk=4,
        hc_mult=2))


def _z1t() -> Any:  # Z1TCache
    from mlx_vlm.models.z1t.config import ModelConfig
    from mlx_vlm.models.z1t.language import LanguageModel

    return LanguageModel(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     aft_heads=4, aft_ksize=4, max_position_embeddings=64))


def _unlimited_ocr() -> Any:  # RingSlidingKVCache, wrapped
    from mlx_vlm.models.unlimited_ocr.config import TextConfig
    from mlx_vlm.models.unlimited_ocr.language import LanguageModel

    return LanguageModel(TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, v_head_dim=16, sliding_window_size=4,
        sliding_window=4))


MODELS: dict[str, Callable[[], Any]] = {
    "deepseek_v4": _deepseek_v4, "glm5_next": _glm5_next, "deepseek_v41": _deepseek_v41,
    "minimax_m3_vl": _minimax_m3, "qwen4_exp": _qwen4_exp, "hy_v4": _hy_v4, "z1t": _z1t,
    "unlimited_ocr": _unlimited_ocr,
}


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB - 4) for _ in range(n)]


def _logits(model: Any, ids: list[int], cache: list[Any]) -> mx.array:
    out = model(mx.array([ids]), cache=cache)
    out = getattr(out, "logits", out)
    mx.eval(out)
    return out


def _restored(snap: codec.CacheSnapshot) -> list[Any]:
    return restore_cache(arrays_from_snapshot(snap), snap.layers)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_restored_cache_gives_the_same_logits(family: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The capture below shares the cache's buffers, as a large cache's does.
    monkeypatch.setattr(codec, "CAPTURE_COPY_MAX_BYTES", 0)
    model = _randomized(MODELS[family]())
    cache = model.make_cache()
    for i, n in enumerate((6, 7, 3)):  # a chunked prefill, then decode steps
        _logits(model, _ids(n, i), cache)
    for t in (5, 6):
        _logits(model, [t], cache)
    restored = _restored(snapshot_cache(cache))
    captured = capture_cache(cache)
    as_captured = _restored(snapshot_cache(cache))
    for step in ([7, 3, 11, 5, 2], [9], [4], [13]):
        assert mx.array_equal(_logits(model, step, restored), _logits(model, step, cache)).item()
    # The original went on after the capture: the capture did not.
    later = _restored(encode_capture(captured))
    for step in ([7, 3, 11, 5, 2], [9]):
        assert mx.array_equal(_logits(model, step, later), _logits(model, step, as_captured)).item()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_each_familys_cache_is_taken_for_the_tokens_it_was_fed(family: str) -> None:
    """DeepSeek V4's and GLM-5 Next's PoolingCache counts pooled tokens
    (offsets 0, 4 and 18 for 18 tokens): comparing every layer's offset
    refused both caches at every write-behind step and ran every session
    cold (a review of 839399c). Only the classes whose offset counts every
    token are compared with one another."""
    model = _randomized(MODELS[family]())
    cache = model.make_cache()
    ids: list[int] = []
    for i, n in enumerate((6, 7, 3, 1, 1)):
        step = _ids(n, i)
        _logits(model, step, cache)
        ids += step
    assert length_mismatch(cache, len(ids)) is None
    assert length_mismatch(cache, len(ids) - 1) is not None
    plan = plan_reuse(cache, ids, [*ids, 1, 2])
    assert (plan.action, plan.reused) == ("extend", len(ids))


def test_mllamas_unfed_cross_attention_layers_do_not_disagree() -> None:
    """Llama 3.2 Vision has no make_cache: its cross-attention layers are
    plain KVCaches never fed, at offset 0 beside 10 (the review of
    250fc71): compared with the others, every step refused the cache and
    every session ran cold. Layers that hold nothing are left out."""
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.models.mllama.config import TextConfig
    from mlx_vlm.models.mllama.language import LanguageModel

    lm = _randomized(LanguageModel(TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3])))
    cache = make_prompt_cache(lm)
    ids = _ids(8, 0)
    lm(mx.array([ids]), cache=cache, cross_attention_states=mx.random.normal((1, 10, 64)))
    for t in (5, 6):
        lm(mx.array([[t]]), cache=cache)
        ids.append(t)
    assert [c.offset for c in cache] == [10, 0, 10, 0]
    assert length_mismatch(cache, len(ids)) is None
    plan = plan_reuse(cache, ids, [*ids, 1, 2])
    assert (plan.action, plan.reused) == ("extend", len(ids))


def _diffusion_gemma() -> Any:
    from mlx_vlm.models.diffusion_gemma.config import TextConfig
    from mlx_vlm.models.diffusion_gemma.language import LanguageModel

    return _randomized(LanguageModel(TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_global_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_experts=4, top_k_experts=2)))


@pytest.mark.parametrize("trim", [0, 3])
def test_a_static_prefix_cache_restores_its_whole_allocation(trim: int) -> None:
    """mlx-vlm's StaticPrefixKVCache (diffusion_gemma's static decoder path,
    make_cache(max_size=...)) gives its rows up to the offset as its state,
    and its setter took those rows as the whole allocation. The decoder
    attends over all max_size rows with a mask as wide: restored short, the
    mask hid the prompt's keys, and the decoder's logits differed with no
    error. Restored, it holds max_size rows, the empty ones zeros."""
    from mlx_vlm.models.cache import StaticPrefixKVCache

    model, max_size, canvas = _diffusion_gemma(), 32, [63] * 6
    cache = model.make_cache(max_size=max_size)
    assert all(type(c) is StaticPrefixKVCache for c in cache)
    model.diffusion_update_cache(mx.array([list(range(3, 16))]), cache=cache)
    for c in cache:
        c.trim(trim)
    n = 13 - trim
    got = _restored(snapshot_cache(cache))

    def decode(c: list[Any]) -> mx.array:
        mask = mx.zeros((1, max_size + len(canvas)), dtype=mx.bool_)
        mask[:, :n] = True
        mask[:, max_size:] = True
        return model.diffusion_decoder_logits(mx.array([canvas]), cache=c,
                                              decoder_attention_mask=mask)

    for r, c in zip(got, cache, strict=True):
        keys, values = r.decoder_state
        assert keys.shape == c.decoder_state[0].shape and values.shape == c.decoder_state[1].shape
        assert mx.array_equal(keys[..., :n, :], c.keys[..., :n, :]).item()
        assert not mx.any(keys[..., n:, :]).item()  # what the cache makes them
        assert r.meta_state == c.meta_state
    assert mx.array_equal(decode(got), decode(cache)).item()
    # Both go on alike: one more prompt token, then the decoder again.
    for c in (cache, got):
        model.diffusion_update_cache(mx.array([[9]]), cache=c)
    n += 1
    assert mx.array_equal(decode(got), decode(cache)).item()
