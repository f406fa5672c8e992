"""Value types of :mod:`tba.plan` (private module; import them from ``tba.plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelShape", "Accounting", "Drive"]

Arch = Literal["gpt", "bert", "t5"]
Activation = Literal["gelu", "gelu_unfused", "relu"]


def _problems_error(what: str, problems: list[str]) -> ValueError:
    return ValueError(f"invalid {what}:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Shape of a transformer; defaults follow the usual conventions.

    Attributes:
        arch: ``"gpt"`` (pre-LN decoder, LM head), ``"bert"`` (post-LN encoder, MLM head) or
            ``"t5"`` (RMSNorm encoder-decoder; ``num_layers`` encoder + ``num_decoder_layers``).
        ffn_size: feed-forward width ``f``; default ``4 * hidden_size``.
        head_dim: per-head width; default ``hidden_size // num_heads``.
        num_decoder_layers, decoder_seq_len: T5 only; default ``num_layers`` and ``seq_len``.
        activation: ``"gelu"`` (one kernel, saves its input), ``"gelu_unfused"`` (HF's
            ``gelu_new``: the tanh formula op by op, three more ``T*f`` tensors) or ``"relu"``
            (saves its output); default gelu for gpt/bert, relu for t5.
    """

    arch: Arch
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    ffn_size: int | None = None
    head_dim: int | None = None
    num_decoder_layers: int | None = None
    decoder_seq_len: int | None = None
    activation: Activation | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ("gpt", "bert", "t5"):
            problems.append(f"arch must be 'gpt', 'bert' or 't5', got {self.arch!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.head_dim is None and not problems and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                            f"{self.num_heads}: pass head_dim")
        if self.activation not in (None, "gelu", "gelu_unfused", "relu"):
            problems.append(f"activation must be 'gelu', 'gelu_unfused' or 'relu', got {self.activation!r}")
        if self.arch != "t5" and (self.num_decoder_layers or self.decoder_seq_len):
            problems.append("num_decoder_layers/decoder_seq_len apply to arch='t5' only")
        if problems:
            raise _problems_error("ModelShape", problems)
        resolved = {
            "ffn_size": self.ffn_size or 4 * self.hidden_size,
            "head_dim": self.head_dim or self.hidden_size // self.num_heads,
            "num_decoder_layers": (self.num_decoder_layers or self.num_layers) if self.arch == "t5" else 0,
            "decoder_seq_len": (self.decoder_seq_len or self.seq_len) if self.arch == "t5" else 0,
            "activation": self.activation or ("relu" if self.arch == "t5" else "gelu"),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def attention_width(self) -> int:
        """``num_heads * head_dim`` (the ``i`` of the formulas)."""
        return self.num_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Approximate parameter count (matmul weights and embeddings; norms and biases omitted)."""
        h, i, f = self.hidden_size, self.attention_width, self.ffn_size
        per_layer = 4 * h * i + 2 * h * f
        total = self.num_layers * per_layer + self.vocab_size * h
        if self.arch == "t5":
            total += self.num_decoder_layers * (per_layer + 4 * h * i)
        elif self.arch == "gpt":
            total += self.seq_len * h
        else:
            total += self.seq_len * h + h * h
        return total


@dataclass(frozen=True, kw_only=True)
class Accounting:
    """Which saved tensors are counted, and how wide each is.

    Attributes:
        dtype_bytes: bytes per activation element (2 for fp16/bf16, 4 for fp32).
        dropout: whether dropout is active (adds masks and the dropped attention probabilities).
        dropout_mask_bytes: bytes per mask element: 1 on CUDA (``native_dropout`` saves a bool
            mask); on CPU PyTorch saves a noise tensor of the activation dtype.
        softmax_bytes: bytes per element of the saved softmax output; default ``dtype_bytes``
            (4 under autocast, which runs softmax in fp32; then the cast copy is counted too).
        attention: ``"eager"`` (scores materialised: ``a*s^2*b`` terms) or ``"flash"`` (fused
            kernel: q, k, v, output and a fp32 log-sum-exp; no ``s^2`` term).
        norm_stats: count layer-norm mean/rstd (fp32, ``T`` each): small, left out by Korthikanti.
        fused_norm: RMSNorm as one kernel (input + rstd) or op by op as HF T5 does (fp32 copy
            of the input, the normalised tensor and rstd).
        loss_bytes: bytes per element of the log-softmax the loss saves (4: losses upcast).
        include_head: count embeddings, final norm, LM/MLM head and loss (``model.*`` terms).
    """

    dtype_bytes: int = 2
    dropout: bool = True
    dropout_mask_bytes: int = 1
    softmax_bytes: int | None = None
    attention: Literal["eager", "flash"] = "eager"
    norm_stats: bool = True
    fused_norm: bool = True
    loss_bytes: int = 4
    include_head: bool = True

    def __post_init__(self) -> None:
        problems = []
        for name in ("dtype_bytes", "loss_bytes"):
            if getattr(self, name) not in (1, 2, 4, 8):
                problems.append(f"{name} must be 1, 2, 4 or 8, got {getattr(self, name)!r}")
        if self.softmax_bytes not in (None, 1, 2, 4, 8):
            problems.append(f"softmax_bytes must be None, 1, 2, 4 or 8, got {self.softmax_bytes!r}")
        if not isinstance(self.dropout_mask_bytes, int) or self.dropout_mask_bytes < 0:
            problems.append(f"dropout_mask_bytes must be an int >= 0, got {self.dropout_mask_bytes!r}")
        if self.attention not in ("eager", "flash"):
            problems.append(f"attention must be 'eager' or 'flash', got {self.attention!r}")
        if problems:
            raise _problems_error("Accounting", problems)

    @classmethod
    def korthikanti(cls) -> Accounting:
        """Korthikanti et al.'s per-layer count: ``34*s*b*h + 5*a*s^2*b`` bytes for a GPT layer."""
        return cls(dtype_bytes=2, dropout=True, dropout_mask_bytes=1, attention="eager",
                   norm_stats=False, include_head=False)

    @classmethod
    def pytorch_cpu(cls, *, dtype_bytes: int = 4, dropout: bool = True, include_head: bool = True) -> Accounting:
        """Eager PyTorch on CPU as transformers runs it (``attn_implementation="eager"``)."""
        return cls(dtype_bytes=dtype_bytes, dropout=dropout, dropout_mask_bytes=dtype_bytes,
                   attention="eager", norm_stats=True, fused_norm=False, include_head=include_head)


@dataclass(frozen=True, kw_only=True)
class Drive:
    """An SSD's endurance rating. Give ``pbw`` (petabytes written) or ``dwpd`` (drive writes
    per day over the warranty); ``write_bytes_per_s`` is its sequential write speed, if known."""

    name: str
    capacity_bytes: int
    warranty_years: float
    pbw: float | None = None
    dwpd: float | None = None
    write_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if (self.pbw is None) == (self.dwpd is None):
            problems.append("give exactly one of pbw and dwpd")
        if self.capacity_bytes <= 0 or self.warranty_years <= 0:
            problems.append("capacity_bytes and warranty_years must be positive")
        if problems:
            raise _problems_error(f"Drive {self.name!r}", problems)

    @property
    def endurance_bytes(self) -> float:
        """Rated bytes written over the drive's life."""
        if self.pbw is not None:
            return self.pbw * 1e15
        return self.dwpd * self.capacity_bytes * 365 * self.warranty_years

