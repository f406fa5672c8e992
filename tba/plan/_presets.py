"""Shapes of public checkpoints (no weights are needed); private, import ``tba.plan.PRESETS``."""

from __future__ import annotations

from tba.plan._types import ModelShape

__all__ = ["PRESETS"]


def _gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 50257) -> ModelShape:
    return ModelShape(arch="gpt", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq,
                      vocab_size=vocab)


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> ModelShape:
    return ModelShape(arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                      ffn_size=ffn, vocab_size=vocab, seq_len=seq)


PRESETS: dict[str, ModelShape] = {
    "gpt2": _gpt(12, 768, 12, 1024),
    "gpt2-medium": _gpt(24, 1024, 16, 1024),
    "gpt2-large": _gpt(36, 1280, 20, 1024),
    "gpt2-xl": _gpt(48, 1600, 25, 1024),
    "gpt3-2.7b": _gpt(32, 2560, 32),
    "gpt3-13b": _gpt(40, 5120, 40),
    "gpt3-175b": _gpt(96, 12288, 96),
    "bert-base": ModelShape(arch="bert", num_layers=12, hidden_size=768, num_heads=12, seq_len=512, vocab_size=30522),
    "bert-large": ModelShape(arch="bert", num_layers=24, hidden_size=1024, num_heads=16, seq_len=512,
                             vocab_size=30522),
    "t5-small": ModelShape(arch="t5", num_layers=6, hidden_size=512, num_heads=8, seq_len=512, vocab_size=32128),
    "t5-base": ModelShape(arch="t5", num_layers=12, hidden_size=768, num_heads=12, seq_len=512, vocab_size=32128),
    "t5-large": ModelShape(arch="t5", num_layers=24, hidden_size=1024, num_heads=16, seq_len=512, vocab_size=32128),
    "t5-3b": ModelShape(arch="t5", num_layers=24, hidden_size=1024, num_heads=32, head_dim=128, ffn_size=16384,
                        seq_len=512, vocab_size=32128),
    # Llama-style decoders (RMSNorm, rotary, grouped-query attention, SwiGLU) at their
    # pre-training sequence length.
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, 4096),  # sliding window 4096 = seq: full attention
    "qwen2.5-0.5b": _llama(24, 896, 14, 2, 4864, 151936, 4096),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, 4096),
    "qwen2.5-72b": _llama(80, 8192, 64, 8, 29568, 152064, 4096),
}
