"""Small models for the tests: transformers GPT-2/BERT/T5 from configs (no downloads) and
adversarial ones that stress storage identity."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB = 128
SEQ = 16
BATCH = 4


def gpt2(num_layers: int = 3) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=num_layers, n_head=4,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )
    return GPT2LMHeadModel(config)


def bert(num_layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return BertForMaskedLM(config)


def t5(num_layers: int = 2) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=num_layers,
        num_decoder_layers=num_layers, num_heads=4, dropout_rate=0.1, decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def lm_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def t5_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)
    return {"input_ids": ids, "labels": labels}


def vector_batch(seed: int, features: int = 16, rows: int = BATCH * 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=g)


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Stack(nn.Module):
    """Embedding, N residual MLP blocks, head: a model where activations dominate."""

    def __init__(self, num_blocks: int = 6, width: int = 64, features: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


class Chain(nn.Module):
    """Embedding, then ``num_blocks`` of a test's own ``block(width)`` one after another (no
    head), loss ``mean(h**2)``: Stack's layout around a block that does something odd."""

    def __init__(self, block: Callable[[int], nn.Module], num_blocks: int, width: int = 32,
                 features: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


class FusedAttention(nn.Module):
    """Attention from one fused qkv projection, then MLP blocks: compiled, AOTAutograd's
    partitioner saves q, k^T and v, three views of one storage (plus views of other
    activations), for tba's compiled path to store once."""

    def __init__(self, width: int = 32, num_blocks: int = 3, features: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + (q @ k.transpose(-2, -1)).softmax(-1) @ v
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def sequence_batch(seed: int, features: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, features, generator=g)


class HighRank(nn.Module):
    """Saves a rank-5 activation (a cumulative sum that ``sin`` saves for backward) whose
    sizes and strides together multiply past 2**63 (sizes 1, 2, 2, 2, 2048 and strides
    2**14 .. 1), as GPT-2's ``(batch, seq, hidden)`` activations do at scale: a shape carrier
    made with contiguous strides cannot exist (Note [Keys and shape carriers])."""

    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(features, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(self.up(x).view(-1, 2, 2, 2, 2048), dim=-1)
        return torch.sin(y).mean()
