"""Model shape and counting rules of :mod:`tba.plan` (private module; import from ``tba.plan``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelShape", "Accounting"]

Arch = Literal["gpt", "bert", "t5", "llama"]
Activation = Literal["gelu", "gelu_unfused", "relu", "swiglu"]
_ARCHS = ("gpt", "bert", "t5", "llama")
_ACTIVATIONS = ("gelu", "gelu_unfused", "relu", "swiglu")


def problems_error(what: str, problems: list[str]) -> ValueError:
    """One ``ValueError`` listing every problem of ``what``."""
    return ValueError(f"invalid {what}:\n  - " + "\n  - ".join(problems))


def _llama_ffn(hidden_size: int) -> int:
    # Llama's rule: 2/3 of 4h, rounded up to a multiple of 256.
    return -(-(8 * hidden_size // 3) // 256) * 256


@dataclass(frozen=True, kw_only=True, init=False)
class ModelShape:
    """Shape of a transformer; defaults follow the usual conventions.

    The optional arguments (``None``: the default) are resolved when the shape is made, so
    every attribute holds a number (``num_decoder_layers`` and ``decoder_seq_len`` are 0
    outside T5).

    Attributes:
        arch: ``"gpt"`` (pre-LN decoder, LM head), ``"bert"`` (post-LN encoder, MLM head),
            ``"t5"`` (RMSNorm encoder-decoder; ``num_layers`` encoder + ``num_decoder_layers``)
            or ``"llama"``: the decoder current LLMs use (Llama 2/3, Mistral, Qwen2): pre-norm
            RMSNorm, rotary position embedding, grouped-query attention (``num_kv_heads``),
            SwiGLU MLP, no biases that matter, untied LM head.
        ffn_size: feed-forward width ``f``; default ``4 * hidden_size`` (llama: ``8h/3``
            rounded up to a multiple of 256).
        head_dim: per-head width; default ``hidden_size // num_heads``.
        num_kv_heads: llama only: key/value heads (grouped-query attention); default
            ``num_heads`` (multi-head attention). Must divide ``num_heads``.
        num_decoder_layers, decoder_seq_len: T5 only; default ``num_layers`` and ``seq_len``.
        activation: ``"gelu"`` (one kernel, saves its input), ``"gelu_unfused"`` (HF's
            ``gelu_new``: the tanh formula op by op, three more ``T*f`` tensors), ``"relu"``
            (saves its output) or ``"swiglu"`` (``down(silu(gate(x)) * up(x))``, llama's and
            only llama's); default gelu for gpt/bert, relu for t5, swiglu for llama.
    """

    arch: Arch
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    ffn_size: int
    head_dim: int
    num_kv_heads: int
    num_decoder_layers: int
    decoder_seq_len: int
    activation: Activation

    def __init__(self, *, arch: Arch, num_layers: int, hidden_size: int, num_heads: int, seq_len: int,
                 vocab_size: int, ffn_size: int | None = None, head_dim: int | None = None,
                 num_kv_heads: int | None = None, num_decoder_layers: int | None = None,
                 decoder_seq_len: int | None = None, activation: Activation | None = None) -> None:
        problems = []
        if arch not in _ARCHS:
            problems.append(f"arch must be one of {', '.join(map(repr, _ARCHS))}, got {arch!r}")
        required = {"num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
                    "seq_len": seq_len, "vocab_size": vocab_size}
        for name, value in required.items():
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive int, got {value!r}")
        if head_dim is None and not problems and hidden_size % num_heads:
            problems.append(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}: pass head_dim")
        if activation not in (None, *_ACTIVATIONS):
            problems.append(f"activation must be one of {', '.join(map(repr, _ACTIVATIONS))}, got {activation!r}")
        elif activation is not None and (activation == "swiglu") != (arch == "llama"):
            problems.append(f"activation {activation!r} does not fit arch {arch!r}: llama blocks use "
                            "'swiglu', the others 'gelu', 'gelu_unfused' or 'relu'")
        if arch != "t5" and (num_decoder_layers or decoder_seq_len):
            problems.append("num_decoder_layers/decoder_seq_len apply to arch='t5' only")
        if num_kv_heads is not None:
            if arch != "llama":
                problems.append("num_kv_heads (grouped-query attention) applies to arch='llama' only")
            elif not isinstance(num_kv_heads, int) or num_kv_heads < 1 or (
                    isinstance(num_heads, int) and num_heads % num_kv_heads):
                problems.append(f"num_kv_heads must be a positive int dividing num_heads {num_heads}, "
                                f"got {num_kv_heads!r}")
        if problems:
            raise problems_error("ModelShape", problems)
        llama, t5 = arch == "llama", arch == "t5"
        default_activation: Activation = "relu" if t5 else "swiglu" if llama else "gelu"
        resolved: dict[str, object] = {
            "arch": arch, "num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
            "seq_len": seq_len, "vocab_size": vocab_size,
            "ffn_size": ffn_size or (_llama_ffn(hidden_size) if llama else 4 * hidden_size),
            "head_dim": head_dim or hidden_size // num_heads,
            "num_kv_heads": (num_kv_heads or num_heads) if llama else num_heads,
            "num_decoder_layers": (num_decoder_layers or num_layers) if t5 else 0,
            "decoder_seq_len": (decoder_seq_len or seq_len) if t5 else 0,
            "activation": activation or default_activation,
        }
        for name, resolved_value in resolved.items():
            object.__setattr__(self, name, resolved_value)

    @property
    def attention_width(self) -> int:
        """``num_heads * head_dim`` (the ``i`` of the formulas)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """``num_kv_heads * head_dim`` (``i_kv``: keys and values under grouped-query attention)."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Approximate parameter count (matmul weights and embeddings; norms and biases omitted)."""
        h, i, f = self.hidden_size, self.attention_width, self.ffn_size
        if self.arch == "llama":  # q, o: h*i; k, v: h*i_kv; gate, up, down: h*f; embedding and LM head
            return self.num_layers * (2 * h * i + 2 * h * self.kv_width + 3 * h * f) + 2 * self.vocab_size * h
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

    The defaults describe how decoder LLMs are trained today: bf16 weights and activations
    (fp32 master weights live in the optimizer, not in the activations), flash/SDPA attention,
    no dropout, fused norms. The fp32 islands of mixed precision are counted at 4 bytes: norm
    statistics, the attention log-sum-exp, the eager softmax of llama blocks, the loss.

    Attributes:
        dtype_bytes: bytes per activation element (2 for fp16/bf16, 4 for fp32).
        dropout: whether dropout is active. With eager attention it adds masks and the dropped
            attention probabilities; a flash kernel saves only its RNG state (not counted). Llama
            blocks have attention dropout only.
        dropout_mask_bytes: bytes per mask element: 1 on CUDA (``native_dropout`` saves a bool
            mask); on CPU PyTorch saves a noise tensor of the activation dtype.
        softmax_bytes: bytes per element of the saved eager softmax output; default
            ``dtype_bytes``, but 4 for llama blocks (they run softmax in fp32; the cast copy is
            then counted too).
        attention: ``"flash"`` (fused kernel, PyTorch SDPA's flash/memory-efficient backends or
            flash-attn: q, k, v, output and a fp32 log-sum-exp; no ``s^2`` term; grouped-query
            keys/values at their own width) or ``"eager"`` (scores materialised: ``a*s^2*b``
            terms; llama repeats keys/values to every head first).
        norm_stats: count norm statistics (fp32, ``T`` each): small, left out by Korthikanti.
        fused_norm: RMSNorm as one kernel (input + rstd) or op by op as HF T5/Llama do (fp32
            copy of the input, the normalised tensor and rstd).
        loss_bytes: bytes per element of the log-softmax the loss saves (4: losses upcast).
        include_head: count embeddings, final norm, LM/MLM head and loss (``model.*`` terms).
        autocast: fp32 weights under ``torch.autocast`` to the ``dtype_bytes`` type (what HF
            Trainer's ``bf16=True`` does) instead of bf16 weights: the residual stream and norms
            stay fp32, each projection saves its own cast of its input, and every weight's cast
            copy is saved once per forward (see Note [autocast saves cast copies]). Llama blocks
            with flash attention only.
    """

    dtype_bytes: int = 2
    dropout: bool = False
    dropout_mask_bytes: int = 1
    softmax_bytes: int | None = None
    attention: Literal["eager", "flash"] = "flash"
    norm_stats: bool = True
    fused_norm: bool = True
    loss_bytes: int = 4
    include_head: bool = True
    autocast: bool = False

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
        if self.autocast and self.dtype_bytes != 2:
            problems.append(f"autocast casts to bf16/fp16: dtype_bytes must be 2, got {self.dtype_bytes!r}")
        if problems:
            raise problems_error("Accounting", problems)

    @classmethod
    def korthikanti(cls) -> Accounting:
        """Korthikanti et al.'s per-layer count: ``34*s*b*h + 5*a*s^2*b`` bytes for a GPT layer."""
        return cls(dtype_bytes=2, dropout=True, dropout_mask_bytes=1, attention="eager",
                   norm_stats=False, include_head=False)

    @classmethod
    def pytorch_cpu(cls, *, dtype_bytes: int = 4, dropout: bool = True, include_head: bool = True,
                    attention: Literal["eager", "flash"] = "eager", autocast: bool = False) -> Accounting:
        """Eager PyTorch on CPU as transformers runs it (``attn_implementation="eager"``, or
        ``"sdpa"`` without dropout, which runs CPU's flash kernel: ``attention="flash"``)."""
        return cls(dtype_bytes=dtype_bytes, dropout=dropout, dropout_mask_bytes=dtype_bytes,
                   attention=attention, norm_stats=True, fused_norm=False, include_head=include_head,
                   autocast=autocast)
