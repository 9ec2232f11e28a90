"""GPT-2 and the Llama family over a static, slot-indexed KV cache, with CUDA-graph-captured decode.

The pieces, bottom up:

* `StaticKVGPT2`, `StaticKVLlama` (Llama, Qwen2, Mistral) — the model as one pure function of (tokens, positions, attention bias,
  picked, k_cache, v_cache). It writes the new tokens' keys and values into the
  caches in place and returns logits for the picked positions of each row. The same `forward` serves
  prefill (P tokens per row) and decode (P = 1), so a single `torch.export` program is the
  whole engine, and it runs unchanged on CPU in fp32 (what the CPU test compares with HF).
* `StaticKVRunner` — owns the caches and the per-slot state on the device, captures
  prefill and k-step decode into CUDA graphs, and runs continuous batching over slots.

Conventions that the rest relies on:

* Cache layout (layers, slots, kv_heads, max_context + 1, head_dim), one tensor for k and
  one for v (kv_heads = the query heads for GPT-2, num_key_value_heads for the Llama family). The extra last position (index `max_context`) is a scratch column: a row
  whose writes must be discarded (padding, rows not being prefilled) writes there, and
  attention never reads it because `attn_len <= max_context`. This keeps every write
  branch-free, which is what makes the step graph-capturable and exportable.
* Batch row b of a call is slot b: a call of width B reads and writes slots 0..B-1.
  Reading `k_cache[layer, :B]` is then a view, not a gather (a gather would copy the
  cache every layer). The runner allocates the lowest free slot so rows stay compact.
* Prompts are right-padded: each sequence starts at position 0 of its slot, so a slot's
  position is just its token count and decode needs no per-row offset. Pad tokens carry
  position `max_context` (scratch) and `picked` names each row's last real token (decode,
  prefill) or every token (kiln's gates score all positions).
* Greedy only: argmax runs inside the captured graph; sampling would need graph-safe RNG
  state and is left to the integration.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

NEG_INF = float("-inf")


@dataclass(frozen=True)
class GPT2Shape:
    """The few config values the static model needs (from a HF GPT2Config)."""

    n_layer: int
    n_head: int
    n_embd: int
    n_inner: int
    vocab_size: int
    n_positions: int
    eps: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    # The names new_cache and the runner read for every family.
    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def cache_heads(self) -> int:
        return self.n_head

    @property
    def max_positions(self) -> int:
        return self.n_positions

    @classmethod
    def from_hf_config(cls, config) -> GPT2Shape:
        # Refuse variants this forward does not implement instead of silently diverging.
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            raise ValueError(f"activation {config.activation_function!r} is not the tanh GELU this model implements")
        if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
            raise ValueError("only the standard 1/sqrt(head_dim) attention scaling is implemented")
        if getattr(config, "add_cross_attention", False):
            raise ValueError("cross-attention GPT-2 variants are not supported")
        return cls(
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_embd=config.n_embd,
            n_inner=config.n_inner or 4 * config.n_embd,
            vocab_size=config.vocab_size,
            n_positions=config.n_positions,
            eps=config.layer_norm_epsilon,
        )


def _on(device: torch.device | str, dtype: torch.dtype, t: Tensor) -> Tensor:
    """A source weight on the device in the program's dtype. Weights are cast one at a time
    before they are stacked, so the host holds the source model and no stacked copy of it."""
    return t.detach().to(device=device, dtype=dtype)


class StaticKVGPT2(nn.Module):
    """GPT-2 as a pure function over caller-owned static KV caches.

    Weights are stacked per kind, (n_layer, ...), in HF Conv1D layout (in, out), so
    `addmm(bias, x, W)` is the layer and no transpose copy is made at load.
    """

    def __init__(
        self,
        shape: GPT2Shape,
        state_dict: Mapping[str, Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fused_gelu: bool = False,
        linear_layout: bool = False,
    ) -> None:
        super().__init__()
        self.shape = shape
        # Storage layout of the four projection weights: HF Conv1D's (in, out) by default;
        # linear_layout stores nn.Linear's (out, in) and multiplies by a transposed view
        # (cuBLAS takes either without a copy; which GEMV is faster is measured, not assumed).
        self.linear_layout = linear_layout
        # cuBLASLt's GELU epilogue is the tanh GELU on CUDA, but the CPU kernel of
        # _addmm_activation applies the exact GELU: only enable it on CUDA.
        self.fused_gelu = fused_gelu and torch.device(device).type == "cuda"
        state = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
        L = shape.n_layer

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(_on(device, dtype, t).contiguous(), requires_grad=False)

        def weight(t: Tensor) -> nn.Parameter:
            return param(t.transpose(-1, -2) if linear_layout else t)

        def stacked(suffix: str) -> Tensor:
            return torch.stack([_on(device, dtype, state[f"h.{i}.{suffix}"]) for i in range(L)])

        self.wte = param(state["wte.weight"])
        self.wpe = param(state["wpe.weight"])
        self.ln1_w, self.ln1_b = param(stacked("ln_1.weight")), param(stacked("ln_1.bias"))
        self.ln2_w, self.ln2_b = param(stacked("ln_2.weight")), param(stacked("ln_2.bias"))
        self.w_qkv, self.b_qkv = weight(stacked("attn.c_attn.weight")), param(stacked("attn.c_attn.bias"))
        self.w_o, self.b_o = weight(stacked("attn.c_proj.weight")), param(stacked("attn.c_proj.bias"))
        self.w_fc, self.b_fc = weight(stacked("mlp.c_fc.weight")), param(stacked("mlp.c_fc.bias"))
        self.w_mp, self.b_mp = weight(stacked("mlp.c_proj.weight")), param(stacked("mlp.c_proj.bias"))
        self.lnf_w, self.lnf_b = param(state["ln_f.weight"]), param(state["ln_f.bias"])
        lm_head = state.get("lm_head.weight")
        # GPT-2 ties lm_head to wte: keep one copy (77 MB in fp16 at GPT-2-small size).
        self.tied = lm_head is None or lm_head.data_ptr() == state["wte.weight"].data_ptr() or torch.equal(lm_head, state["wte.weight"])
        self.lm_head = None if self.tied else param(lm_head)
        # Index helpers for the branch-free cache write; non-persistent so a state_dict
        # holds weights only. Created here because making tensors from Python scalars
        # inside a captured graph would be a host-to-device copy, which capture forbids.
        self.register_buffer("layer_ids", torch.arange(L, device=device), persistent=False)
        self.register_buffer("head_ids", torch.arange(shape.n_head, device=device), persistent=False)

    @classmethod
    def from_hf(cls, model: nn.Module, **kwargs) -> StaticKVGPT2:
        return cls(GPT2Shape.from_hf_config(model.config), model.state_dict(), **kwargs)

    def new_cache(self, num_slots: int, max_context: int) -> tuple[Tensor, Tensor]:
        return new_cache(self.shape, num_slots, max_context, self.wte.dtype, self.wte.device)

    def _w(self, stacked: Tensor, layer: int) -> Tensor:
        """Layer weight as an (in, out) matrix, a view in either storage layout."""
        return stacked[layer].t() if self.linear_layout else stacked[layer]

    def forward(
        self,
        input_ids: Tensor,  # (B, P) int64
        positions: Tensor,  # (B, P) int64; max_context (scratch) for tokens to discard
        attn_bias: Tensor,  # (B, 1, P, A) model dtype, 0 or -inf; A = attended cache length
        picked: Tensor,  # (B, K) int64: which of the P tokens give logits (K = 1 to generate, P to score)
        k_cache: Tensor,  # (L, S, H, T+1, D), written in place, S >= B
        v_cache: Tensor,
    ) -> Tensor:
        """Logits (B, K, vocab) of the picked tokens, after writing all B*P tokens' k/v.

        One signature for generating (K = 1) and scoring (K = P), so that one exported
        program is the whole engine: what the gates score is what the server runs.
        """
        s = self.shape
        B, P = input_ids.shape
        A = attn_bias.shape[-1]
        H, D, E = s.n_head, s.head_dim, s.n_embd
        # Scratch positions are past the embedding table; clamp only for the lookup.
        pos_emb = F.embedding(positions.clamp(max=s.n_positions - 1), self.wpe)
        x = (F.embedding(input_ids, self.wte) + pos_emb).view(B * P, E)
        rows = torch.arange(B, device=input_ids.device).view(B, 1, 1)
        heads = self.head_ids.view(1, 1, H)
        write_pos = positions.view(B, P, 1)
        for layer in range(s.n_layer):
            a = F.layer_norm(x, (E,), self.ln1_w[layer], self.ln1_b[layer], s.eps)
            qkv = torch.addmm(self.b_qkv[layer], a, self._w(self.w_qkv, layer)).view(B, P, 3, H, D)
            # One index_put per cache on the cache tensor itself (not on a view of it):
            # functionalization then sees a plain input mutation, which Inductor turns
            # back into an in-place scatter instead of copying the cache.
            index = (self.layer_ids[layer], rows, heads, write_pos)
            k_cache.index_put_(index, qkv[:, :, 1])
            v_cache.index_put_(index, qkv[:, :, 2])
            q = qkv[:, :, 0].transpose(1, 2)  # (B, H, P, D)
            keys = k_cache[layer, :B, :, :A]  # a view: rows are slots 0..B-1
            values = v_cache[layer, :B, :, :A]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_bias)
            x = x + torch.addmm(self.b_o[layer], o.transpose(1, 2).reshape(B * P, E), self._w(self.w_o, layer))
            a = F.layer_norm(x, (E,), self.ln2_w[layer], self.ln2_b[layer], s.eps)
            if self.fused_gelu:
                f = torch._addmm_activation(self.b_fc[layer], a, self._w(self.w_fc, layer), use_gelu=True)
            else:
                f = F.gelu(torch.addmm(self.b_fc[layer], a, self._w(self.w_fc, layer)), approximate="tanh")
            x = x + torch.addmm(self.b_mp[layer], f, self._w(self.w_mp, layer))
        # Logits only for the one position per row that is needed.
        x_last = x.view(B, P, E)[torch.arange(B, device=x.device).view(B, 1), picked]
        x_last = F.layer_norm(x_last, (E,), self.lnf_w, self.lnf_b, s.eps)
        return F.linear(x_last, self.wte if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits of every position, (B, P, vocab), for kiln's left-padded batches.

        What kiln's quality gates need (teacher-forced next-token logits). Uses a
        throw-away cache sized to the batch; positions follow kiln's convention
        (cumsum of the mask - 1), pad tokens write to the scratch column and are never
        attended. Rows that are all padding give unspecified logits, as in kiln.
        """
        B, P = input_ids.shape
        kc, vc = new_cache(self.shape, B, P, self.wte.dtype, self.wte.device)
        pos = left_padded_positions(attention_mask, scratch=P)
        bias = causal_bias(pos, torch.arange(P, device=input_ids.device), self.wte.dtype)
        return self(input_ids, pos, bias, torch.arange(P, device=input_ids.device).expand(B, P), kc, vc)


# Rotary variants whose frequencies are fixed at build time (transformers' "dynamic" and
# "longrope" change them with the sequence length, which a static program cannot follow).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA_FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class LlamaShape:
    """The config values the static Llama-family model needs (Llama, Qwen2, Mistral)."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    eps: float
    qkv_bias: bool  # Qwen2; Llama with attention_bias
    o_bias: bool  # Llama with attention_bias
    rope_scaling: float = 1.0  # transformers' attention_scaling: the factor on cos and sin

    @property
    def cache_heads(self) -> int:
        return self.num_kv_heads

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config) -> LlamaShape:
        family = config.model_type
        if family not in LLAMA_FAMILIES:
            raise ValueError(f"model_type {family!r} is not one of the Llama family ({', '.join(LLAMA_FAMILIES)})")
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not the SiLU (SwiGLU) this model implements")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not implemented")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f"{config.num_attention_heads} query heads do not divide into {config.num_key_value_heads} KV heads")
        attention_bias = bool(getattr(config, "attention_bias", False)) and family == "llama"
        _, scaling = rotary_frequencies(config)
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            eps=config.rms_norm_eps,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            rope_scaling=float(scaling),
        )


def rotary_frequencies(config) -> tuple[Tensor, float]:
    """(inv_freq (head_dim // 2,) fp32, attention scaling), computed as transformers does for
    the config's `rope_parameters` (`rope_scaling` in older configs): its own init function
    for a scaled variant, the plain 1 / theta^(2i/d) otherwise."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not one a static program implements ({', '.join(STATIC_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not implemented")
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.float(), float(scaling)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite magnitude
WEIGHT_FORMATS = ("dense", "fp8", "int4")
INT4_GROUP = 128  # weights per scale and zero point along the input
INT4_INNER_K_TILES = 8  # the CUDA kernel's packed layout (tinygemm, as gpt-fast and torchao pack it)


def fp8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """`w` (..., N, K) in e4m3 with one fp32 scale per output row (..., N): each row's largest
    magnitude maps to 448, so a row of small weights keeps e4m3's whole precision."""
    wide = w.float()
    scale = wide.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (wide / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) @ w (N, K)ᵀ in one FP8 GEMM: x quantized to e4m3 row by row as it comes
    (dynamic scales), both scales applied in the GEMM's epilogue, the result in x's dtype."""
    x_scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out + bias


def int4_groups(w: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """`w` (N, K) as 4-bit codes (N, K) int32, with a bf16 scale and zero point per `group`
    weights of a row, (K / group, N, 2): w ≈ (code - 8) × scale + zero, the codes spanning each
    group's range (asymmetric). The scales are rounded to bf16 before the codes are chosen,
    so the codes are the best for the scales the kernel reads."""
    N, K = w.shape
    groups = w.float().reshape(N, K // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low).clamp(min=1e-6) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = ((groups - (zero - 8 * scale).unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    return codes, torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4_packed(codes: Tensor) -> Tensor:
    """The codes in the layout of the int4 kernel of their device (CUDA's tinygemm, or CPU's)."""
    if codes.device.type == "cuda":
        return torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), INT4_INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES)


def int4_linear(x: Tensor, packed: Tensor, scales_zeros: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) bf16 @ the packed 4-bit weight: weight-only, dequantized in the kernel."""
    mm = torch.ops.aten._weight_int4pack_mm if x.device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
    out = mm(x, packed, INT4_GROUP, scales_zeros)
    return out if bias is None else out + bias


def _int4_kernel_form(w: Tensor) -> tuple[Tensor, Tensor]:
    codes, scales_zeros = int4_groups(w)
    return int4_packed(codes), scales_zeros


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: statistics and scaling in fp32, the weight in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' apply_rotary_pos_emb on (B, P, heads, D): halves, not interleaved pairs."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class StaticKVLlama(nn.Module):
    """The Llama family (Llama 2/3, SmolLM, Qwen2, Mistral) over caller-owned static KV
    caches, with StaticKVGPT2's forward signature and conventions.

    Weights keep nn.Linear's (out, in) layout, stacked per kind (n_layer, ...), with q, k, v
    fused into one (H + 2 KVH) * D-row matrix and gate, up into one 2I-row matrix (one GEMM
    each). The cache holds the KV heads only; `gqa` picks how a group of query heads meets
    its KV head: "fold" (the group's queries become rows of one attention call per KV head,
    the cache is read as it is), "sdpa" (SDPA's enable_gqa) or "repeat" (repeat_interleave).

    `weights="fp8"` keeps the four projections of every layer in e4m3 with a scale per output
    row (`fp8_rows`), multiplied by `fp8_linear`; `weights="int4"` in 4-bit codes with a scale
    and zero point per 128 inputs (`int4_groups`), multiplied by `int4_linear`. Embeddings,
    norms and the lm_head stay in `dtype` (bf16: what both kernels take and write).
    """

    GQA_MODES = ("fold", "sdpa", "repeat")

    def __init__(
        self,
        shape: LlamaShape,
        state_dict: Mapping[str, Tensor],
        inv_freq: Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        gqa: str = "fold",
        weights: str = "dense",
    ) -> None:
        super().__init__()
        if gqa not in self.GQA_MODES:
            raise ValueError(f"gqa {gqa!r} is not one of {', '.join(self.GQA_MODES)}")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
        self.shape, self.gqa = shape, gqa
        state = {k.removeprefix("model."): v for k, v in state_dict.items()}
        L = shape.num_layers

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(_on(device, dtype, t).contiguous(), requires_grad=False)

        def stacked(*suffixes: str) -> Tensor:
            return torch.stack([torch.cat([_on(device, dtype, state[f"layers.{i}.{s}"]) for s in suffixes]) for i in range(L)])

        def projection(*suffixes: str) -> tuple[nn.Parameter, nn.Parameter | None]:
            """A projection's stacked weight, and its row scales where it is FP8 (quantized
            layer by layer on the device, so no stacked copy in `dtype` is ever made)."""
            if weights == "dense":
                return param(stacked(*suffixes)), None
            convert = fp8_rows if weights == "fp8" else _int4_kernel_form
            rows = [convert(torch.cat([_on(device, dtype, state[f"layers.{i}.{s}"]) for s in suffixes])) for i in range(L)]
            frozen = (nn.Parameter(torch.stack(t), requires_grad=False) for t in zip(*rows, strict=True))
            return next(frozen), next(frozen)

        self.embed = param(state["embed_tokens.weight"])
        self.ln1_w = param(stacked("input_layernorm.weight"))
        self.ln2_w = param(stacked("post_attention_layernorm.weight"))
        self.w_qkv, self.s_qkv = projection("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        self.b_qkv = param(stacked("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")) if shape.qkv_bias else None
        self.w_o, self.s_o = projection("self_attn.o_proj.weight")
        self.b_o = param(stacked("self_attn.o_proj.bias")) if shape.o_bias else None
        self.w_gate_up, self.s_gate_up = projection("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.w_down, self.s_down = projection("mlp.down_proj.weight")
        self.lnf_w = param(state["norm.weight"])
        lm_head = state.get("lm_head.weight")
        embed = state["embed_tokens.weight"]
        self.tied = lm_head is None or lm_head.data_ptr() == embed.data_ptr() or torch.equal(lm_head, embed)
        self.lm_head = None if self.tied else param(lm_head)
        # Persistent: the frequencies were computed at build time (llama3 scaling and all),
        # and the program and the Triton step read them from here. Kept fp32 in every dtype.
        self.register_buffer("inv_freq", inv_freq.detach().to(device=device, dtype=torch.float32).contiguous())
        self.register_buffer("layer_ids", torch.arange(L, device=device), persistent=False)
        self.register_buffer("head_ids", torch.arange(shape.num_kv_heads, device=device), persistent=False)

    @classmethod
    def from_hf(cls, model: nn.Module, **kwargs) -> StaticKVLlama:
        inv_freq, _ = rotary_frequencies(model.config)
        return cls(LlamaShape.from_hf_config(model.config), model.state_dict(), inv_freq, **kwargs)

    def new_cache(self, num_slots: int, max_context: int) -> tuple[Tensor, Tensor]:
        return new_cache(self.shape, num_slots, max_context, self.embed.dtype, self.embed.device)

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (B, P, 1, D) as transformers makes them: fp32 angles, cast to the model dtype.
        Scratch positions need no clamp: the angle is computed, not looked up."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.shape.rope_scaling, emb.sin() * self.shape.rope_scaling
        return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)

    @staticmethod
    def _project(x: Tensor, weight: Tensor, scale: Tensor | None, layer: int, bias: Tensor | None = None) -> Tensor:
        """x through one layer's projection: dense, FP8 with its row scales, or int4 packed
        with its group scales and zero points."""
        bias = None if bias is None else bias[layer]
        if scale is None:
            return F.linear(x, weight[layer], bias)
        return (fp8_linear if weight.dtype == FP8 else int4_linear)(x, weight[layer], scale[layer], bias)

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
        """q (B, P, H, D), keys/values (B, KVH, A, D) → (B, P, H * D); query head h reads KV
        head h // group, as transformers' repeat_kv pairs them."""
        B, P, H, D = q.shape
        KVH, G = self.shape.num_kv_heads, self.shape.group
        if self.gqa == "fold":
            # (B, KVH, G * P, D): each KV head's group as extra query rows; `bias` is the
            # per-step mask already repeated G times along the query axis.
            qf = q.view(B, P, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * P, D)
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=bias)
            return o.view(B, KVH, G, P, D).permute(0, 3, 1, 2, 4).reshape(B, P, H * D)
        if self.gqa == "repeat":
            keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=bias, enable_gqa=self.gqa == "sdpa")
        return o.transpose(1, 2).reshape(B, P, H * D)

    def forward(
        self,
        input_ids: Tensor,  # (B, P) int64
        positions: Tensor,  # (B, P) int64; max_context (scratch) for tokens to discard
        attn_bias: Tensor,  # (B, 1, P, A) model dtype, 0 or -inf; A = attended cache length
        picked: Tensor,  # (B, K) int64: which of the P tokens give logits
        k_cache: Tensor,  # (L, S, KVH, T+1, D), written in place, S >= B
        v_cache: Tensor,
    ) -> Tensor:
        """Logits (B, K, vocab) of the picked tokens, after writing all B*P tokens' k/v."""
        s = self.shape
        B, P = input_ids.shape
        A = attn_bias.shape[-1]
        H, KVH, D, E, I = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size, s.intermediate_size
        x = F.embedding(input_ids, self.embed).view(B * P, E)
        cos, sin = self._rotary(positions, x.dtype)
        if self.gqa == "fold" and s.group > 1:
            attn_bias = attn_bias.unsqueeze(2).expand(B, 1, s.group, P, A).reshape(B, 1, s.group * P, A)
        rows = torch.arange(B, device=input_ids.device).view(B, 1, 1)
        heads = self.head_ids.view(1, 1, KVH)
        write_pos = positions.view(B, P, 1)
        for layer in range(s.num_layers):
            a = _rms_norm(x, self.ln1_w[layer], s.eps)
            qkv = self._project(a, self.w_qkv, self.s_qkv, layer, self.b_qkv).view(B, P, H + 2 * KVH, D)
            q = _rotate(qkv[:, :, :H], cos, sin)
            k = _rotate(qkv[:, :, H : H + KVH], cos, sin)
            # As in StaticKVGPT2: one index_put per cache on the cache tensor itself.
            index = (self.layer_ids[layer], rows, heads, write_pos)
            k_cache.index_put_(index, k)
            v_cache.index_put_(index, qkv[:, :, H + KVH :])
            o = self._attend(q, k_cache[layer, :B, :, :A], v_cache[layer, :B, :, :A], attn_bias)
            x = x + self._project(o.view(B * P, H * D), self.w_o, self.s_o, layer, self.b_o)
            a = _rms_norm(x, self.ln2_w[layer], s.eps)
            gate_up = self._project(a, self.w_gate_up, self.s_gate_up, layer)
            x = x + self._project(F.silu(gate_up[:, :I]) * gate_up[:, I:], self.w_down, self.s_down, layer)
        x_last = x.view(B, P, E)[torch.arange(B, device=x.device).view(B, 1), picked]
        x_last = _rms_norm(x_last, self.lnf_w, s.eps)
        return F.linear(x_last, self.embed if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def score(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits of every position, (B, P, vocab), for kiln's left-padded batches (as StaticKVGPT2.score)."""
        B, P = input_ids.shape
        kc, vc = self.new_cache(B, P)
        pos = left_padded_positions(attention_mask, scratch=P)
        bias = causal_bias(pos, torch.arange(P, device=input_ids.device), self.embed.dtype)
        return self(input_ids, pos, bias, torch.arange(P, device=input_ids.device).expand(B, P), kc, vc)


StaticShape = GPT2Shape | LlamaShape


def static_shape(config) -> StaticShape:
    """The static model's shape for a transformers config of any family kiln builds."""
    return GPT2Shape.from_hf_config(config) if config.model_type == "gpt2" else LlamaShape.from_hf_config(config)


def static_shape_from_json(text: str) -> StaticShape:
    """The shape an engine recorded (`asdict` as JSON); GPT-2's names no family, as before the Llama family."""
    fields = json.loads(text)
    return LlamaShape(**fields) if fields.get("family", "gpt2") != "gpt2" else GPT2Shape(**fields)


def static_model_from_hf(model: nn.Module, **kwargs) -> StaticKVGPT2 | StaticKVLlama:
    """The static-KV model of a transformers causal LM, by family."""
    return (StaticKVGPT2 if model.config.model_type == "gpt2" else StaticKVLlama).from_hf(model, **kwargs)


def new_cache(
    shape: StaticShape, num_slots: int, max_context: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """k and v caches (layers, slots, kv_heads, max_context + 1, head_dim); +1 is the scratch column."""
    if max_context > shape.max_positions:
        raise ValueError(f"max_context {max_context} exceeds the model's {shape.max_positions} positions")
    size = (shape.num_layers, num_slots, shape.cache_heads, max_context + 1, shape.head_dim)
    return torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device)


def left_padded_positions(attention_mask: Tensor, scratch: int) -> Tensor:
    """Positions of left-padded rows: real tokens count from 0 (kiln's convention, the mask's
    cumsum - 1); padding gets `scratch`, the cache column that is written and never read."""
    mask = attention_mask.bool()
    return torch.where(mask, (mask.long().cumsum(-1) - 1).clamp(min=0), scratch)


def causal_bias(positions: Tensor, key_range: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, 1, P, A) additive bias: token at position p sees cache positions 0..p.

    Built once per step and shared by all layers; additive rather than boolean so SDPA
    does not convert it again in every layer.
    """
    visible = key_range.view(1, 1, -1) <= positions.unsqueeze(-1)
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(visible, zero, torch.full((), NEG_INF, dtype=dtype, device=positions.device)).unsqueeze(1)


Core = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class DecodeStep(nn.Module):
    """One greedy decode step for rows 0..B-1, state advanced in place.

    Written as a module so `torch.compile` sees bias, model, argmax and the state update
    as one graph (Inductor fuses the small ops), and so a k-step CUDA graph is just k
    calls of it. Inactive rows keep their token and position; their k/v writes land at
    their own unchanged position, which the next real step overwrites before reading.
    """

    def __init__(self, core: Core, max_context: int) -> None:
        super().__init__()
        self.core = core
        self.max_context = max_context

    def forward(self, tokens: Tensor, positions: Tensor, active: Tensor, key_range: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        pos = positions.unsqueeze(1)
        bias = causal_bias(pos, key_range, k_cache.dtype)
        logits = self.core(tokens.unsqueeze(1), pos, bias, torch.zeros_like(pos), k_cache, v_cache)
        nxt = logits[:, 0].argmax(-1)
        tokens.copy_(torch.where(active, nxt, tokens))
        positions.copy_((positions + active.long()).clamp(max=self.max_context))
        return nxt


class SampleStep(nn.Module):
    """One decode step for rows 0..B-1 that samples each row on the device: the logits
    (B, vocab) and the picked tokens. A module for the reason DecodeStep is one: compiled,
    Inductor fuses the sampler's elementwise work with the model's last ops."""

    def __init__(self, core: Core) -> None:
        super().__init__()
        self.core = core

    def forward(
        self, ids: Tensor, positions: Tensor, picked: Tensor, key_range: Tensor, temperature: Tensor, top_p: Tensor, keys: Tensor, counters: Tensor,
        k_cache: Tensor, v_cache: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        from components.runtime.torch_sampling import sample_rows

        logits = self.core(ids, positions, causal_bias(positions, key_range, k_cache.dtype), picked, k_cache, v_cache)[:, 0]
        return logits, sample_rows(logits, temperature, top_p, keys, counters)


class PrefillStep(nn.Module):
    """Prefill new sequences into their slots; other rows write only to scratch.

    `packed` is (B, 2P + 3) int64: ids | positions | last_index | is_new | length, so a
    prefill costs one host-to-device copy. New rows get their first generated token and
    position in the decode state and become active; other rows' state is untouched.
    """

    def __init__(self, core: Core, prompt_width: int) -> None:
        super().__init__()
        self.core = core
        self.P = prompt_width

    def forward(
        self, packed: Tensor, tokens: Tensor, positions: Tensor, active: Tensor, key_range: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        P = self.P
        ids, pos = packed[:, :P], packed[:, P : 2 * P]
        last, is_new, length = packed[:, 2 * P], packed[:, 2 * P + 1].bool(), packed[:, 2 * P + 2]
        logits = self.core(ids, pos, causal_bias(pos, key_range, k_cache.dtype), last.unsqueeze(1), k_cache, v_cache)
        first = logits[:, 0].argmax(-1)
        tokens.copy_(torch.where(is_new, first, tokens))
        positions.copy_(torch.where(is_new, length, positions))
        active.copy_(active | is_new)
        return first


class LogitsStepGraphs:
    """One decode step that hands its logits to the host (kiln serve samples each request
    with its own settings there), for rows 0..B-1 of a runner's cache; on CUDA captured in
    a graph per (row width, attended length), both bucketed so that few are ever captured.

    Rows past B up to the width are free slots: their token writes to the scratch column.
    """

    def __init__(self, runner: StaticKVRunner, vocab_size: int) -> None:
        self.runner = runner
        S, device = runner.S, runner.device
        self.ids = torch.zeros(S, 1, dtype=torch.long, device=device)
        self.positions = torch.full((S, 1), runner.T, dtype=torch.long, device=device)
        self.picked = torch.zeros(S, 1, dtype=torch.long, device=device)
        self.logits = torch.zeros(S, vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if runner.use_graphs else None

    def __call__(self, next_ids: Sequence[int], positions: Sequence[int]) -> Tensor:
        """Logits (B, vocab) on the host, fp32, after writing each row's token at its position."""
        return self.on_device(next_ids, positions).to("cpu", copy=True)  # a copy: on a CPU device .cpu() is the buffer the next step overwrites

    @torch.no_grad()
    def on_device(self, next_ids: Sequence[int], positions: Sequence[int]) -> Tensor:
        """The same logits left on the device: the graphs' output buffer, which the next step
        overwrites (read or copy it before)."""
        runner, B = self.runner, len(next_ids)
        width = runner._width(B - 1)
        attended = runner._attn_len(max(positions) + 1)
        self.ids[:B, 0].copy_(torch.as_tensor(next_ids))
        self.positions[:B, 0].copy_(torch.as_tensor(positions))
        self.positions[B:width].fill_(runner.T)  # free slots: scratch
        if not runner.use_graphs:
            self._body(width, attended)
        else:
            graph = self._graphs.get((width, attended))
            if graph is None:
                graph = self._graphs[(width, attended)] = self._capture(width, attended)
            graph.replay()
        return self.logits[:B]

    def _body(self, width: int, attended: int) -> None:
        runner = self.runner
        positions = self.positions[:width]
        bias = causal_bias(positions, runner.key_range[:attended], runner.dtype)
        logits = runner.model(self.ids[:width], positions, bias, self.picked[:width], runner.k_cache, runner.v_cache)
        self.logits[:width].copy_(logits[:, 0])

    def _capture(self, width: int, attended: int) -> torch.cuda.CUDAGraph:
        # The eager warm-up run computes this very step; the replay that follows writes the
        # same keys and values again.
        return captured(lambda: self._body(width, attended), self._pool)


class PrefillGraphs:
    """Prompts into their slots and each row's last-position logits to the host (fp32), on
    CUDA one graph per (row width, prompt width): kiln serve's admissions at the speed of
    `generate`'s prefill (eagerly, the program's Python costs ~10 ms for GPT-2-small on an
    H200). `ids` and `positions` are (width, prompt width) on the host; rows that are not
    prompts write to the scratch column.
    """

    def __init__(self, runner: StaticKVRunner, vocab_size: int) -> None:
        self.runner = runner
        self.logits = torch.zeros(runner.S, vocab_size, dtype=torch.float32, device=runner.device)
        self._inputs: dict[tuple[int, int], Tensor] = {}
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if runner.use_graphs else None

    @torch.no_grad()
    def __call__(self, ids: Tensor, positions: Tensor, rows: slice | None = None, attended: int | None = None) -> Tensor:
        """The logits of `rows` (default: all) on the host: a newcomer beside running rows
        brings back its own row, not the batch's (50,257 floats a row for GPT-2). The prompts
        attend to the cache's first `attended` columns (default: the prompt width; more where
        they continue a prefix already in their slots, a bucket of `runner._attn_len`)."""
        runner, shape = self.runner, tuple(ids.shape)
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = torch.zeros(2, *shape, dtype=torch.long, device=runner.device)
        inputs.copy_(torch.stack([ids, positions]), non_blocking=True)
        attended = attended or shape[1]
        if not runner.use_graphs:
            self._body(inputs, attended)
        else:
            graph = self._graphs.get((*shape, attended))
            if graph is None:
                graph = self._graphs[(*shape, attended)] = captured(lambda: self._body(inputs, attended), self._pool)
            graph.replay()
        return self.logits[: shape[0]][rows or slice(None)].to("cpu", copy=True)  # its own, as the step's logits

    def _body(self, inputs: Tensor, attended: int) -> None:
        runner, (width, prompt) = self.runner, inputs.shape[1:]
        last = runner.key_range[prompt - 1 : prompt].expand(width, 1)
        bias = causal_bias(inputs[1], runner.key_range[:attended], runner.dtype)
        logits = runner.prefill_core(inputs[0], inputs[1], bias, last, runner.k_cache, runner.v_cache)
        self.logits[:width].copy_(logits[:, 0])


class SampledStepGraphs:
    """k decode steps for rows 0..B-1 of a runner's cache, each row sampling its next token
    on the device with its own temperature, top-p and counter-based stream
    (runtime.torch_sampling), log probabilities computed there where asked; on CUDA one
    graph per (row width, attended length, k, with log probabilities), so only token ids
    (and asked-for log probabilities) cross to the host, once per k steps.

    Rows past B up to the width are free slots: their token writes to the scratch column.
    """

    MAX_TOP = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs)

    def __init__(self, runner: StaticKVRunner) -> None:
        self.runner = runner
        S, K, device = runner.S, runner.max_chunk, runner.device
        self.ids = torch.zeros(S, 1, dtype=torch.long, device=device)
        self.positions = torch.full((S, 1), runner.T, dtype=torch.long, device=device)
        self.picked = torch.zeros(S, 1, dtype=torch.long, device=device)
        self.keys = torch.zeros(S, dtype=torch.long, device=device)
        self.counters = torch.zeros(S, dtype=torch.long, device=device)
        self.temperature = torch.zeros(S, dtype=torch.float32, device=device)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.out = torch.zeros(S, K, dtype=torch.long, device=device)
        self.chosen_logprob = torch.zeros(S, K, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(S, K, self.MAX_TOP, dtype=torch.long, device=device)
        self.top_logprob = torch.zeros(S, K, self.MAX_TOP, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if runner.use_graphs else None
        # Compiled where the runner's greedy step is: eagerly the program's ~150 kernels a
        # step made a sampled request 5.8x `generate` on an H200.
        step = SampleStep(runner.model)
        self.step = torch.compile(step, fullgraph=True) if runner.compiled else step

    @torch.no_grad()
    def __call__(
        self, next_ids: Sequence[int], positions: Sequence[int], settings: Sequence[tuple[float, float, int, int]], steps: int, logprobs: bool
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """Tokens (B, steps) on the host, and with `logprobs` (chosen (B, steps), top ids and
        values (B, steps, MAX_TOP)); `settings`: each row's (temperature, top_p, key, draws so far)."""
        runner, B = self.runner, len(next_ids)
        width, attended = runner._width(B - 1), runner._attn_len(max(positions) + steps)
        temperature, top_p, keys, counters = zip(*settings, strict=True)
        longs = torch.tensor([list(next_ids), list(positions), list(keys), list(counters)], dtype=torch.long)
        floats = torch.tensor([temperature, top_p], dtype=torch.float32)
        longs, floats = longs.to(runner.device, non_blocking=True), floats.to(runner.device, non_blocking=True)
        self.ids[:B, 0].copy_(longs[0])
        self.positions[:B, 0].copy_(longs[1])
        self.keys[:B].copy_(longs[2])
        self.counters[:B].copy_(longs[3])
        self.temperature[:B].copy_(floats[0])
        self.top_p[:B].copy_(floats[1])
        self.positions[B:width].fill_(runner.T)  # free slots: scratch
        self.temperature[B:width].zero_()
        key = (width, attended, steps, logprobs)
        if not runner.use_graphs:
            self._body(*key)
        else:
            graph = self._graphs.get(key)
            if graph is None:
                saved = (self.ids.clone(), self.positions.clone())
                graph = self._graphs[key] = captured(lambda: self._body(*key), self._pool)
                self.ids.copy_(saved[0])  # the warm-up and capture advanced them
                self.positions.copy_(saved[1])
            graph.replay()
        tokens = self.out[:B, :steps].cpu().numpy()
        if not logprobs:
            return tokens, None
        return tokens, (self.chosen_logprob[:B, :steps].cpu().numpy(), self.top_ids[:B, :steps].cpu().numpy(), self.top_logprob[:B, :steps].cpu().numpy())

    def _body(self, width: int, attended: int, steps: int, logprobs: bool) -> None:
        from components.runtime.torch_sampling import top_logprobs

        runner = self.runner
        ids, positions, keys, counters = self.ids[:width], self.positions[:width], self.keys[:width], self.counters[:width]
        temperature, top_p, picked, key_range = self.temperature[:width], self.top_p[:width], self.picked[:width], runner.key_range[:attended]
        if runner.compiled:
            for t in (ids, positions, keys, counters, temperature, top_p, picked, key_range):
                torch._dynamo.maybe_mark_dynamic(t, 0)  # one compile for every width and attended length
        for i in range(steps):
            logits, tokens = self.step(ids, positions, picked, key_range, temperature, top_p, keys, counters + i, runner.k_cache, runner.v_cache)
            self.out[:width, i].copy_(tokens)
            if logprobs:
                chosen, top_ids, top_values = top_logprobs(logits, tokens, self.MAX_TOP)
                self.chosen_logprob[:width, i].copy_(chosen)
                self.top_ids[:width, i].copy_(top_ids)
                self.top_logprob[:width, i].copy_(top_values)
            ids[:, 0].copy_(tokens)
            positions.copy_((positions + 1).clamp(max=runner.T))  # free slots stay on the scratch column


def _compiled_for_any_prompt(core: Core) -> Core:
    """`core` compiled once for every row width, prompt width and attended length (the
    prefill graphs' buckets), not once per combination: each compile takes tens of seconds."""
    compiled = torch.compile(core, fullgraph=True)

    def prefill(ids: Tensor, positions: Tensor, bias: Tensor, picked: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        for tensor, dims in ((ids, (0, 1)), (positions, (0, 1)), (bias, (0, 2, 3)), (picked, (0,))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(ids, positions, bias, picked, k_cache, v_cache)

    return prefill


def captured(body: Callable[[], None], pool=None) -> torch.cuda.CUDAGraph:
    """`body` captured in a CUDA graph, after the one eager run on a side stream that capture
    needs (it compiles kernels and creates cuBLAS handles); graphs sharing `pool` share memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class _TurnOutput:
    """A decode turn's tokens on their way to the host: a copy into pinned memory queued
    behind the turn, read when `done` has passed, so the host can queue more first."""

    tokens: Tensor  # (rows, steps) on the host
    done: torch.cuda.Event | None

    def read(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.tokens.numpy().copy()  # the buffer takes a later turn's tokens


@dataclass
class _QueuedTurn:
    """A turn launched before the host read the turn before it (`decode_rows`'s `room`):
    valid for a call that feeds the same rows what that turn produced, with nothing run
    on the slots in between (`drop_queued`)."""

    next_ids: list[int]
    positions: list[int]
    output: _TurnOutput


@dataclass
class _Sequence:
    index: int  # position in the caller's prompt list
    slot: int
    prompt_len: int
    remaining: int  # tokens still to generate
    # (log column) per generated token, read back once at the next flush.
    columns: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class StaticKVRunner:
    """Continuous batching over a static slot cache, decode captured as k-step CUDA graphs.

    Graphs are keyed by (row width B, attended length A, steps k) for decode and
    (B, prompt width P, A) for prefill and captured lazily on first use; they share one
    memory pool (they never run concurrently, and outputs that outlive a replay live in
    buffers allocated outside the pool). Host bookkeeping (positions, remaining tokens)
    mirrors the device state exactly, so with no stop token the host never waits for the
    device until the final read-back; with a stop token it reads once per chunk.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_slots: int,
        max_context: int,
        shape: StaticShape | None = None,
        decode_core: Core | None = None,
        prefill_core: Core | None = None,
        compile_step: bool = False,
        decode_step: Callable[..., Tensor] | None = None,
        fast_step: Callable[..., Tensor] | None = None,
        fast_max_width: int = 1,
        use_graphs: bool | None = None,
        max_chunk: int = 32,
        attn_bucket: int = 64,
        prompt_bucket: int = 16,
        log_capacity: int = 1024,
    ) -> None:
        # `model` is a StaticKVGPT2, a StaticKVLlama or anything with their forward signature,
        # such as a loaded ExportedProgram's .module() (then `shape` must be given).
        self.model = model
        weight = next(iter(model.parameters()))
        self.device, self.dtype = weight.device, weight.dtype
        self.S, self.T = num_slots, max_context
        self.k_cache, self.v_cache = new_cache(shape or model.shape, num_slots, max_context, self.dtype, self.device)
        decode_core = decode_core or model
        prefill_core = prefill_core or model
        self.compiled = compile_step or decode_step is not None
        if decode_step is not None:
            # A step compiled once and shared by runners of the same model and context
            # (compiling is the expensive part of start-up).
            self.decode_step: Callable[..., Tensor] = decode_step
        else:
            self.decode_step = DecodeStep(decode_core, max_context)
            if compile_step:
                # Default Inductor mode: the CUDA graph is ours (k steps per graph), so
                # Inductor's cudagraph trees ("reduce-overhead") would only get in the way.
                self.decode_step = torch.compile(self.decode_step, fullgraph=True)
        # An alternative step for narrow calls (e.g. TritonDecodeStep, whose GEMVs re-read
        # the weights per row and so only pay off for a few rows).
        self.fast_step, self.fast_max_width = fast_step, fast_max_width
        # Inductor-fused on the GPU: the exported program runs ~40 aten kernels a layer, which
        # made one admission's prefill graph 3.5 ms for SmolLM2-135M on the H200 (1.2 fused).
        self.prefill_core = _compiled_for_any_prompt(prefill_core) if compile_step else prefill_core
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.max_chunk = max_chunk
        self.attn_bucket = attn_bucket
        self.prompt_bucket = prompt_bucket
        # Device-side decode state for every slot.
        self.tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.positions = torch.full((num_slots,), max_context, dtype=torch.long, device=self.device)
        self.active = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        self.key_range = torch.arange(max_context + 1, device=self.device)
        self.out = torch.zeros(num_slots, max_chunk, dtype=torch.long, device=self.device)
        self.first = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.log = torch.zeros(num_slots, log_capacity, dtype=torch.long, device=self.device)
        self.log_used = 0
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._prefill_inputs: dict[tuple[int, int], Tensor] = {}
        self._prefill_steps: dict[int, PrefillStep] = {}
        self._staging: dict[tuple[int, int], tuple[Tensor, torch.cuda.Event | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.widths = sorted({min(1 << i, num_slots) for i in range(num_slots.bit_length() + 1)})
        # Two pinned buffers a turn's tokens land in: one being read while the next fills.
        self._host_out = [torch.zeros(num_slots * max_chunk, dtype=torch.long, pin_memory=self.device.type == "cuda") for _ in range(2)]
        self._next_host_out = 0
        self._queued: _QueuedTurn | None = None
        # Queue the next turn before reading this one only where the device runs
        # asynchronously (on the CPU it would compute tokens that may be thrown away).
        self.run_ahead = self.device.type == "cuda"
        self.stats = {"decode_graphs": 0, "prefill_graphs": 0, "replays": 0, "syncs": 0}

    # ------------------------------------------------------------------ sizes

    def _width(self, highest_slot: int) -> int:
        return next(w for w in self.widths if w > highest_slot)

    def _attn_len(self, needed: int) -> int:
        # Bucketed so few graphs are needed; multiples of 64 keep the bias aligned for
        # the memory-efficient SDPA kernel. attn_bucket <= 0 means always the full cache.
        if self.attn_bucket <= 0:
            return self.T
        return min(_round_up(needed, self.attn_bucket), self.T)

    # ------------------------------------------------------------------ graph plumbing

    def _run(
        self, key: tuple, body: Callable[[], None], freeze: Callable[[], None], load: Callable[[], None] | None = None
    ) -> None:
        """Run `body` directly, or replay its CUDA graph, capturing it on first use.

        Capture needs one eager warm-up run (compiles kernels, creates cuBLAS handles);
        `freeze` first puts the state into a form on which running the body changes
        nothing that matters, and the state is restored afterwards. `load` fills the
        graph's input buffers, after any capture and before the run.
        """
        if not self.use_graphs:
            if load is not None:
                load()
            body()
            return
        graph = self._graphs.get(key)
        if graph is None:
            saved = [t.clone() for t in (self.tokens, self.positions, self.active)]
            freeze()
            graph = captured(body, self._pool)
            for t, s in zip((self.tokens, self.positions, self.active), saved):
                t.copy_(s)
            self._graphs[key] = graph
            self.stats["decode_graphs" if key[0] == "decode" else "prefill_graphs"] += 1
        if load is not None:
            load()
        graph.replay()
        self.stats["replays"] += 1

    def _decode_chunk(self, B: int, A: int, k: int) -> None:
        tok, pos, act = self.tokens[:B], self.positions[:B], self.active[:B]
        keys = self.key_range[:A]
        step = self.fast_step if self.fast_step is not None and B <= self.fast_max_width else self.decode_step
        if self.compiled and step is self.decode_step:
            # Compile once for every attended length and row width, instead of a static
            # compile followed by an automatic-dynamic recompile (width 1 stays special).
            for t in (tok, pos, act, keys):
                torch._dynamo.maybe_mark_dynamic(t, 0)

        def body() -> None:
            for i in range(k):
                nxt = step(tok, pos, act, keys, self.k_cache, self.v_cache)
                self.out[:B, i].copy_(nxt)

        # Frozen rows keep token and position; their k/v writes at unchanged positions
        # are rewritten by the next real step before anything reads them.
        self._run(("decode", B, A, k), body, freeze=self.active.zero_)

    @torch.no_grad()
    def decode_rows(self, next_ids: Sequence[int], positions: Sequence[int], steps: int, room: int = 0, most: int | None = None) -> np.ndarray:
        """Greedy steps for rows 0..B-1 fed `next_ids` at `positions` (kiln serve's
        sequences, whose prompts were prefilled into those slots): the same k-step graphs
        as `generate`. Their tokens (B, steps) on the host.

        `room`: how many steps these rows may all take before the batch changes (0: it
        changes after this turn). Where more than `steps`, the next turn (as many steps as
        fit, at most `most` or `max_chunk`, a power of two) is queued on the device before this
        one's tokens are read, so the device works while the host handles them; the call
        that feeds those rows what this turn produced gets that turn's tokens, whatever
        its `steps` (the queued turn's own length)."""
        next_ids, positions = list(next_ids), list(positions)
        queued = self._queued
        if queued is not None and (queued.next_ids, queued.positions) == (next_ids, positions):
            self._queued, output = None, queued.output
            steps = output.tokens.shape[1]
        else:
            self.drop_queued()
            B = len(next_ids)
            state = torch.tensor([next_ids, positions], dtype=torch.long).to(self.device, non_blocking=True)
            self.tokens[:B].copy_(state[0])
            self.positions[:B].copy_(state[1])
            self.active[:B].fill_(True)
            self.active[B : self._width(B - 1)].fill_(False)
            self.positions[B : self._width(B - 1)].fill_(self.T)  # free slots: scratch
            output = self._launch_turn(B, max(positions), steps)
        if self.run_ahead and room > steps:
            ahead = min(room - steps, most or self.max_chunk)
            after = [p + steps for p in positions]
            launched = self._launch_turn(len(next_ids), max(after), 1 << (ahead.bit_length() - 1))
        tokens = output.read()
        if self.run_ahead and room > steps:
            self._queued = _QueuedTurn(tokens[:, -1].tolist(), after, launched)
        else:
            self.active.zero_()
        return tokens

    def _launch_turn(self, rows: int, last_position: int, steps: int) -> _TurnOutput:
        """Queue `steps` steps of the active rows 0..rows-1 (the device state as it stands)
        and the copy of their tokens to the host."""
        self._decode_chunk(self._width(rows - 1), self._attn_len(last_position + steps), steps)
        host = self._host_out[self._next_host_out][: rows * steps].view(rows, steps)
        self._next_host_out ^= 1
        host.copy_(self.out[:rows, :steps], non_blocking=self.device.type == "cuda")
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        return _TurnOutput(host, done)

    @property
    def turn_queued(self) -> bool:
        return self._queued is not None

    def drop_queued(self) -> None:
        """Anything else run on the slots (a prefill, slots moved, scoring) makes a queued
        turn's tokens stale: it finishes on the device, and nobody reads it."""
        if self._queued is not None:
            self._queued = None
            self.active.zero_()

    def _prefill(self, B: int, P: int, A: int, packed_host: Tensor) -> None:
        packed = self._prefill_inputs.get((B, P))
        if packed is None:
            packed = self._prefill_inputs[(B, P)] = torch.zeros(B, 2 * P + 3, dtype=torch.long, device=self.device)
        step = self._prefill_steps.setdefault(P, PrefillStep(self.prefill_core, P))
        keys = self.key_range[:A]

        def body() -> None:
            first = step(packed, self.tokens[:B], self.positions[:B], self.active[:B], keys, self.k_cache, self.v_cache)
            self.first[:B].copy_(first)

        def freeze() -> None:
            # No row is new and every token writes to the scratch column.
            packed.zero_()
            packed[:, P : 2 * P] = self.T

        # One small host-to-device copy per prefill, from pinned staging so it is truly
        # asynchronous (a pageable copy may wait for the decode work queued before it).
        staging, done = self._staging.get((B, P), (None, None))
        if staging is None:
            staging = packed_host.pin_memory() if self.device.type == "cuda" else packed_host.clone()
            done = torch.cuda.Event() if self.device.type == "cuda" else None
            self._staging[(B, P)] = (staging, done)
        else:
            if done is not None:
                done.synchronize()  # the previous copy out of this buffer (long finished in practice)
            staging.copy_(packed_host)

        def load() -> None:
            packed.copy_(staging, non_blocking=True)
            if done is not None:
                done.record()

        self._run(("prefill", B, P, A), body, freeze, load)

    # ------------------------------------------------------------------ log of generated tokens

    def _log_columns(self, n: int, seqs: list[_Sequence]) -> int:
        if self.log_used + n > self.log.shape[1]:
            self._flush(seqs)
        start = self.log_used
        self.log_used += n
        return start

    def _flush(self, seqs: list[_Sequence]) -> None:
        """Read the device log back (the only device->host sync) and resolve tokens."""
        if self.log_used == 0:
            return
        host = self.log[:, : self.log_used].cpu()
        self.stats["syncs"] += 1
        for seq in seqs:
            if seq.columns:
                row = host[seq.slot]
                seq.tokens.extend(row[seq.columns].tolist())
                seq.columns = []
        self.log_used = 0

    # ------------------------------------------------------------------ public API

    def warm_up(self, batch_sizes: Sequence[int], prompt_len: int, max_new_tokens: int) -> None:
        """Capture the graphs a workload of these shapes will need (and compile, if asked)."""
        for b in batch_sizes:
            self.generate([[0] * prompt_len] * b, max_new_tokens)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        greedy: bool = True,
        stop_token: int | Collection[int] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations (without the prompt), continuous batching over the slots.

        Prompts beyond the slot count wait and are admitted as slots free up. A sequence
        stops after max_new_tokens, or after emitting a stop token (included) if given: one
        id, or several (Llama 3 ends on either of two).
        """
        stops = {stop_token} if isinstance(stop_token, int) else set(stop_token or ())
        if not greedy:
            raise NotImplementedError("only greedy decoding is captured; sampling needs graph-safe RNG")
        for p in prompts:
            if not 1 <= len(p) or len(p) + max_new_tokens > self.T:
                raise ValueError(f"prompt of {len(p)} tokens + {max_new_tokens} new exceeds the cache's {self.T} positions")
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        self.drop_queued()
        waiting = list(range(len(prompts)))[::-1]
        running: dict[int, _Sequence] = {}  # slot -> sequence
        finished: list[_Sequence] = []
        host_pos = [self.T] * self.S  # mirrors self.positions for running slots
        self.active.zero_()
        self.log_used = 0

        def all_seqs() -> list[_Sequence]:
            return list(running.values()) + finished

        def check_stop() -> None:
            # Needs the tokens on the host: one read-back per chunk when a stop token is set.
            self._flush(all_seqs())
            for seq in running.values():
                end = next((i for i, t in enumerate(seq.tokens) if t in stops), None)
                if end is not None:
                    seq.tokens = seq.tokens[: end + 1]
                    seq.remaining = 0

        def retire() -> None:
            for slot in [s for s, q in running.items() if q.remaining <= 0]:
                finished.append(running.pop(slot))
                self.active[slot] = False  # a fill kernel: no host-device copy, no sync

        while waiting or running:
            # Admit into free slots, lowest first, so the row width stays small.
            free = [s for s in range(self.S) if s not in running]
            admitted: list[_Sequence] = []
            while waiting and free:
                i = waiting.pop()
                seq = _Sequence(i, free.pop(0), len(prompts[i]), max_new_tokens)
                running[seq.slot] = seq
                admitted.append(seq)
            if admitted:
                B = self._width(max(running))
                P = min(_round_up(max(s.prompt_len for s in admitted), self.prompt_bucket), self.T)
                packed = torch.zeros(B, 2 * P + 3, dtype=torch.long)
                packed[:, P : 2 * P] = self.T
                for seq in admitted:
                    n = seq.prompt_len
                    packed[seq.slot, :n] = torch.tensor(list(prompts[seq.index]), dtype=torch.long)
                    packed[seq.slot, P : P + n] = torch.arange(n)
                    packed[seq.slot, 2 * P] = n - 1
                    packed[seq.slot, 2 * P + 1] = 1
                    packed[seq.slot, 2 * P + 2] = n
                    host_pos[seq.slot] = n
                self._prefill(B, P, self._attn_len(P), packed)
                col = self._log_columns(1, all_seqs())
                self.log[:B, col].copy_(self.first[:B])
                for seq in admitted:
                    seq.columns.append(col)
                    seq.remaining -= 1
                if stops:
                    check_stop()
                retire()
            if not running:
                continue
            # One chunk: as many steps as every running sequence still needs, capped and
            # rounded down to a power of two so few distinct graphs are ever captured.
            steps = min(min(q.remaining for q in running.values()), self.max_chunk)
            k = 1 << (steps.bit_length() - 1)
            B = self._width(max(running))
            A = self._attn_len(max(host_pos[s] for s in running) + k)
            self._decode_chunk(B, A, k)
            start = self._log_columns(k, all_seqs())
            self.log[:B, start : start + k].copy_(self.out[:B, :k])
            for seq in running.values():
                seq.columns.extend(range(start, start + k))
                seq.remaining -= k
                host_pos[seq.slot] += k
            if stops:
                check_stop()
            retire()
        self._flush(finished)
        self.active.zero_()
        result: list[list[int]] = [[] for _ in prompts]
        for seq in finished:
            result[seq.index] = seq.tokens[:max_new_tokens]
        return result


def randomize_biases(model: nn.Module, std: float = 0.02) -> None:
    """N(0, std) on every bias, from the global RNG (the benchmark seeds it first).

    HF initialises biases to zero, and a parity test over zero biases would miss a
    wrong bias layout; the benchmark's random model therefore has non-zero ones.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, std)


def bytes_of_weights(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = [
    "DecodeStep",
    "GPT2Shape",
    "LlamaShape",
    "LogitsStepGraphs",
    "PrefillStep",
    "StaticKVGPT2",
    "StaticKVLlama",
    "StaticKVRunner",
    "StaticShape",
    "bytes_of_weights",
    "fp8_linear",
    "fp8_rows",
    "int4_groups",
    "int4_linear",
    "int4_packed",
    "causal_bias",
    "left_padded_positions",
    "new_cache",
    "randomize_biases",
    "rotary_frequencies",
    "static_model_from_hf",
    "static_shape",
    "static_shape_from_json",
]
