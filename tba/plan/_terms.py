"""The tensors autograd saves in one training step of a GPT, BERT, T5 or Llama, term by term.

Private helper of :mod:`tba.plan`. Every term names one saved tensor (or one group of saved
tensors of identical size), so the accounting can be read, checked against what tba's cache
measures (``tests/plan``) and argued about. Sizes are bytes of *distinct storages*: a tensor
saved by several ops (the output of ``softmax`` saved by both ``softmax`` and the next
``matmul``) counts once, the way tba's cache writes it once. Parameters and their views are
never counted.

Notation: ``b`` micro-batch, ``s`` sequence length, ``T = b*s`` tokens, ``h`` hidden size,
``f`` feed-forward size, ``i = heads*head_dim`` attention width, ``i_kv = kv_heads*head_dim``
key/value width (grouped-query attention), ``a`` heads, ``d`` head_dim, ``D`` bytes per
activation element, ``M`` bytes per dropout-mask element, ``S`` bytes per softmax-output
element, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from tba.plan._types import Accounting, ModelShape

__all__ = ["ActivationTerm", "model_terms"]

_INT64_BYTES = 8
_FP32_BYTES = 4


@dataclass(frozen=True)
class ActivationTerm:
    """One saved tensor (or group) of a step.

    Attributes:
        name: dotted name, ``<scope>.<module>.<tensor>``, e.g. ``layer.mlp.act_input``.
        bytes_each: bytes of one instance.
        count: instances per step (the number of layers for per-layer terms).
        formula: the size in the notation of this module's docstring.
    """

    name: str
    bytes_each: int
    count: int
    formula: str

    @property
    def total_bytes(self) -> int:
        return self.bytes_each * self.count


class _Builder:
    def __init__(self, acc: Accounting, softmax_bytes: int) -> None:
        self.acc = acc
        self.D = acc.dtype_bytes
        self.M = acc.dropout_mask_bytes
        self.S = acc.softmax_bytes if acc.softmax_bytes is not None else softmax_bytes
        self.terms: list[ActivationTerm] = []
        self.scope = "model"
        self.count = 1

    def add(self, name: str, num_bytes: int, formula: str) -> None:
        if num_bytes:
            self.terms.append(ActivationTerm(f"{self.scope}.{name}", int(num_bytes), self.count, formula))

    def norm(self, name: str, T: int, h: int, kind: str) -> None:
        if kind == "layernorm":
            self.add(f"{name}.input", T * h * self.D, "T*h*D")
            if self.acc.norm_stats:
                self.add(f"{name}.mean_rstd", 2 * T * _FP32_BYTES, "2*T*4")
        elif self.acc.fused_norm:  # rmsnorm, fused kernel: input and rstd
            self.add(f"{name}.input", T * h * self.D, "T*h*D")
            if self.acc.norm_stats:
                self.add(f"{name}.rstd", T * _FP32_BYTES, "T*4")
        else:  # HF T5LayerNorm/LlamaRMSNorm, op by op: x.float() (pow, mul), x*rsqrt (weight*), rsqrt
            self.add(f"{name}.input_fp32", T * h * _FP32_BYTES, "T*h*4")
            self.add(f"{name}.normalized", T * h * self.D, "T*h*D")
            if self.acc.norm_stats:
                self.add(f"{name}.rstd", T * _FP32_BYTES, "T*4")

    def dropout_mask(self, name: str, num_elements: int, formula: str) -> None:
        if self.acc.dropout:
            self.add(f"{name}.dropout_mask", num_elements * self.M, f"{formula}*M")

    def attention(self, name: str, b: int, s_q: int, s_kv: int, shape: ModelShape, *, q_input: bool = True,
                  kv_input: bool = True) -> None:
        """Attention of ``s_q`` queries over ``s_kv`` keys; ``*_input`` says whether the
        inputs of the projections are counted here (not when shared with another term)."""
        D, i, a, h = self.D, shape.attention_width, shape.num_heads, shape.hidden_size
        Tq, Tkv = b * s_q, b * s_kv
        if q_input:
            self.add(f"{name}.qkv_input" if kv_input else f"{name}.q_input", Tq * h * D, "T*h*D")
        elif kv_input:
            self.add(f"{name}.kv_input", Tkv * h * D, "T_kv*h*D")
        self.add(f"{name}.q", Tq * i * D, "T*i*D")
        grouped = shape.kv_width != i
        if grouped and self.acc.attention == "flash":  # the kernel reads each key/value head once
            self.add(f"{name}.k", Tkv * shape.kv_width * D, "T_kv*i_kv*D")
            self.add(f"{name}.v", Tkv * shape.kv_width * D, "T_kv*i_kv*D")
        else:  # eager attention repeats grouped keys/values to every head (a copy) before matmul
            suffix = "_repeated" if grouped else ""
            self.add(f"{name}.k{suffix}", Tkv * i * D, "T_kv*i*D")
            self.add(f"{name}.v{suffix}", Tkv * i * D, "T_kv*i*D")
        scores = b * a * s_q * s_kv
        f_scores = "a*s*s_kv*b" if s_q != s_kv else "a*s^2*b"
        if self.acc.attention == "flash":
            self.add(f"{name}.logsumexp", b * a * s_q * _FP32_BYTES, "a*T*4")
        else:
            self.add(f"{name}.softmax_output", scores * self.S, f"{f_scores}*S")
            if self.acc.dropout:
                self.add(f"{name}.probs_dropout_mask", scores * self.M, f"{f_scores}*M")
                self.add(f"{name}.probs_after_dropout", scores * D, f"{f_scores}*D")
            elif self.S != D:
                self.add(f"{name}.probs_cast", scores * D, f"{f_scores}*D")
        self.add(f"{name}.out_proj_input", Tq * i * D, "T*i*D")

    def mlp(self, name: str, T: int, shape: ModelShape) -> None:
        D, h, f = self.D, shape.hidden_size, shape.ffn_size
        self.add(f"{name}.fc1_input", T * h * D, "T*h*D")
        act = shape.activation
        if act == "swiglu":  # down(silu(gate(x)) * up(x)): silu saves its input, mul both factors
            self.add(f"{name}.gate_output", T * f * D, "T*f*D")
            self.add(f"{name}.silu_output", T * f * D, "T*f*D")
            self.add(f"{name}.up_output", T * f * D, "T*f*D")
            self.add(f"{name}.down_input", T * f * D, "T*f*D")
            return
        if act == "gelu":
            self.add(f"{name}.act_input", T * f * D, "T*f*D")
        elif act == "gelu_unfused":
            self.add(f"{name}.act_input", T * f * D, "T*f*D")
            self.add(f"{name}.act_intermediates", 3 * T * f * D, "3*T*f*D")
        if shape.arch == "t5" and self.acc.dropout:  # relu -> dropout -> wo
            self.add(f"{name}.act_output", T * f * D, "T*f*D")
            self.dropout_mask(f"{name}.act", T * f, "T*f")
        self.add(f"{name}.fc2_input", T * f * D, "T*f*D")

    def loss(self, T: int, shape: ModelShape) -> None:
        self.add("lm_head.input", T * shape.hidden_size * self.D, "T*h*D")
        self.add("loss.log_softmax", T * shape.vocab_size * self.acc.loss_bytes, "T*V*4")
        self.add("loss.labels", T * _INT64_BYTES, "T*8")


def model_terms(shape: ModelShape, batch_size: int, acc: Accounting) -> list[ActivationTerm]:
    """Every term of one forward pass of ``shape`` at micro-batch ``batch_size``."""
    B = _Builder(acc, _FP32_BYTES if shape.arch == "llama" else acc.dtype_bytes)
    b, s, h = batch_size, shape.seq_len, shape.hidden_size
    T = b * s
    if acc.autocast and (shape.arch != "llama" or acc.attention != "flash"):
        raise ValueError(f"autocast is modelled for llama blocks with flash attention only, got arch "
                         f"{shape.arch!r} with {acc.attention} attention: count the model in pure "
                         "dtype_bytes=2 (bf16 weights) or dtype_bytes=4 for an upper bound")
    if shape.arch == "llama":
        (_llama_autocast_terms if acc.autocast else _llama_terms)(B, shape, b)
        return B.terms
    if shape.arch in ("gpt", "bert"):
        B.scope, B.count = "layer", shape.num_layers
        if shape.arch == "gpt":  # pre-LN: x + attn(ln_1(x)); x + mlp(ln_2(x))
            B.norm("ln_1", T, h, "layernorm")
            B.attention("attn", b, s, s, shape)
            B.dropout_mask("attn.out", T * h, "T*h")
            B.norm("ln_2", T, h, "layernorm")
            B.mlp("mlp", T, shape)
            B.dropout_mask("mlp.out", T * h, "T*h")
        else:  # post-LN: ln_1(x + attn(x)); ln_2(y + mlp(y)); the attention input is the layer input
            B.attention("attn", b, s, s, shape)
            B.dropout_mask("attn.out", T * h, "T*h")
            B.norm("ln_1", T, h, "layernorm")
            B.mlp("mlp", T, shape)
            B.dropout_mask("mlp.out", T * h, "T*h")
            B.norm("ln_2", T, h, "layernorm")
        if acc.include_head:
            B.scope, B.count = "model", 1
            B.add("embed.token_ids", T * _INT64_BYTES, "T*8")
            B.add("embed.position_ids", s * _INT64_BYTES, "s*8")
            if shape.arch == "gpt":
                B.dropout_mask("embed", T * h, "T*h")
                B.norm("ln_f", T, h, "layernorm")
            else:
                B.add("embed.token_type_ids", T * _INT64_BYTES, "T*8")
                B.norm("embed_ln", T, h, "layernorm")
                B.dropout_mask("embed", T * h, "T*h")
                B.add("mlm_head.dense_input", T * h * B.D, "T*h*D")
                B.add("mlm_head.act_input", T * h * B.D, "T*h*D")
                B.norm("mlm_head.ln", T, h, "layernorm")
            B.loss(T, shape)
        return B.terms

    # t5: encoder layers over s, decoder layers over s_dec (self + cross attention)
    s_dec = shape.decoder_seq_len
    T_dec = b * s_dec
    B.scope, B.count = "enc_layer", shape.num_layers
    B.norm("ln_attn", T, h, "rmsnorm")
    B.attention("attn", b, s, s, shape)
    B.dropout_mask("attn.out", T * h, "T*h")
    B.norm("ln_mlp", T, h, "rmsnorm")
    B.mlp("mlp", T, shape)
    B.dropout_mask("mlp.out", T * h, "T*h")
    B.scope, B.count = "dec_layer", shape.num_decoder_layers
    B.norm("ln_attn", T_dec, h, "rmsnorm")
    B.attention("attn", b, s_dec, s_dec, shape)
    B.dropout_mask("attn.out", T_dec * h, "T_dec*h")
    B.norm("ln_cross", T_dec, h, "rmsnorm")
    B.attention("cross", b, s_dec, s, shape, kv_input=False)  # k/v input: the encoder output, once
    B.dropout_mask("cross.out", T_dec * h, "T_dec*h")
    B.norm("ln_mlp", T_dec, h, "rmsnorm")
    B.mlp("mlp", T_dec, shape)
    B.dropout_mask("mlp.out", T_dec * h, "T_dec*h")
    B.scope, B.count = "model", 1
    B.add("enc.output", T * h * B.D, "T*h*D")  # saved by the k/v projections of every cross attention
    if acc.include_head:
        B.scope, B.count = "model", 1
        B.add("enc.token_ids", T * _INT64_BYTES, "T*8")
        B.add("enc.position_buckets", s * s * _INT64_BYTES, "s^2*8")
        B.dropout_mask("enc.embed", T * h, "T*h")
        B.norm("enc.ln_f", T, h, "rmsnorm")
        B.dropout_mask("enc.out", T * h, "T*h")
        B.add("dec.token_ids", T_dec * _INT64_BYTES, "T_dec*8")
        B.add("dec.position_buckets", s_dec * s_dec * _INT64_BYTES, "s_dec^2*8")
        B.dropout_mask("dec.embed", T_dec * h, "T_dec*h")
        B.norm("dec.ln_f", T_dec, h, "rmsnorm")
        B.dropout_mask("dec.out", T_dec * h, "T_dec*h")
        B.loss(T_dec, shape)
    return B.terms


def _llama_terms(B: _Builder, shape: ModelShape, b: int) -> None:
    """Pre-norm decoder: x + attn(rmsnorm(x)); x + mlp(rmsnorm(x)); rotary q/k; no residual dropout."""
    s, h = shape.seq_len, shape.hidden_size
    T = b * s
    B.scope, B.count = "layer", shape.num_layers
    B.norm("attn_norm", T, h, "rmsnorm")
    # Rotary q*cos + rotate_half(q)*sin: the rotated q and k are what attention saves (counted
    # there); the projections' outputs are not saved. cos/sin are shared by every layer.
    B.attention("attn", b, s, s, shape)
    B.norm("mlp_norm", T, h, "rmsnorm")
    B.mlp("mlp", T, shape)
    B.scope, B.count = "model", 1
    B.add("rotary.cos_sin", 2 * s * shape.head_dim * B.D, "2*s*d*D")
    if B.acc.include_head:
        B.add("embed.token_ids", T * _INT64_BYTES, "T*8")
        B.norm("final_norm", T, h, "rmsnorm")
        B.loss(T, shape)


# Note [autocast saves cast copies]
# Autocast runs each matmul on cast copies: the residual stream and the norms stay fp32, every
# projection casts its own input (q, k and v three times, gate and up twice), and each weight
# is cast once per forward (autocast's weight cache). Those copies are what the linear layers
# save; they are not parameters, so tba's cache offloads them like any activation: the weight
# casts add about ``num_parameters * D`` bytes per forward. Rotary promotes q and k to fp32
# (fp32 cos/sin); attention saves its own casts of them. Tested by
# tests/plan/test_llm.py::test_estimate_matches_cache[*-sdpa-autocast-bf16].


def _llama_autocast_terms(B: _Builder, shape: ModelShape, b: int) -> None:
    """Llama blocks with fp32 weights under ``torch.autocast``, flash attention (see the Note above)."""
    s, h, i, i_kv, f, V = (shape.seq_len, shape.hidden_size, shape.attention_width, shape.kv_width,
                           shape.ffn_size, shape.vocab_size)
    T, D = b * s, B.D

    def fp32_norm(name: str) -> None:
        B.D = _FP32_BYTES
        B.norm(name, T, h, "rmsnorm")
        B.D = D

    B.scope, B.count = "layer", shape.num_layers
    fp32_norm("attn_norm")
    for proj in ("q", "k", "v"):
        B.add(f"attn.{proj}_proj_input_cast", T * h * D, "T*h*D")
    B.add("attn.q", T * i * D, "T*i*D")
    B.add("attn.k", T * i_kv * D, "T*i_kv*D")
    B.add("attn.v", T * i_kv * D, "T*i_kv*D")
    B.add("attn.logsumexp", b * shape.num_heads * s * _FP32_BYTES, "a*T*4")
    B.add("attn.out_proj_input", T * i * D, "T*i*D")
    B.add("attn.weight_casts", (2 * h * i + 2 * h * i_kv) * D, "(2*h*i+2*h*i_kv)*D")
    fp32_norm("mlp_norm")
    for proj in ("gate", "up"):
        B.add(f"mlp.{proj}_proj_input_cast", T * h * D, "T*h*D")
    for tensor in ("gate_output", "silu_output", "up_output", "down_input"):
        B.add(f"mlp.{tensor}", T * f * D, "T*f*D")
    B.add("mlp.weight_casts", 3 * h * f * D, "3*h*f*D")
    B.scope, B.count = "model", 1
    B.add("rotary.cos_sin", 2 * s * shape.head_dim * _FP32_BYTES, "2*s*d*4")
    if B.acc.include_head:
        B.add("embed.token_ids", T * _INT64_BYTES, "T*8")
        fp32_norm("final_norm")
        B.add("lm_head.input_cast", T * h * D, "T*h*D")
        B.add("lm_head.weight_cast", V * h * D, "V*h*D")
        B.add("loss.log_softmax", T * V * B.acc.loss_bytes, "T*V*4")
        B.add("loss.labels", T * _INT64_BYTES, "T*8")
