"""A decode step from five hand-written Triton kernels per layer, for small batches: GPT-2's
(`TritonDecodeStep`) and the Llama family's (`TritonLlamaDecodeStep`, below).

Why: on the H200 the Inductor-compiled step spends ~410 us of GPU time per token at
batch 1, 227 us of it in 48 cuBLAS GEMV-shaped GEMMs (tiny grids: one 64-column tile per
CTA, 36 CTAs for a 2304-wide output, plus split-K reduce kernels) and 70 us in 12 cuDNN
attention calls. Reading the weights once costs ~58 us. These kernels are GEMVs shaped
for the memory system instead: many CTAs each streaming a few contiguous weight rows.

Per layer: [LN1 + QKV + bias + k/v cache write] [attention over the slot's cache]
[O-proj + bias + residual] [LN2 + FC + bias + GELU] [proj + bias + residual]; then
[LN_f + lm_head + per-block argmax] and [final argmax + token/position update]. The
residual stream stays fp32; weights and the KV cache keep the model dtype.

On sm_90 and later the kernels are chained by programmatic dependent launch: each may
start while the one before finishes, loads what no recent kernel writes (its weights,
earlier steps' cache rows), then waits for the previous kernel's output. At batch 1 a
step is latency, not bandwidth: 63 kernels of a few microseconds, so overlapping each
kernel's start and weight loads with the previous one's tail took a 32+128-token
generation from 36.5 to 23.8 ms on the H200 (docs/performance.md#on-the-gpu).

Semantics equal `DecodeStep(StaticKVGPT2)`: same cache layout and scratch column, same
active-row rule, same attended length (key_range), greedy argmax with the lowest index
winning ties. Rows re-read the weights (from L2) per batch row, so this is for small B;
the runner falls back to the general step above `fast_max_width`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from torch import Tensor

from components.runtime.static_kv import GPT2Shape, LlamaShape, StaticShape


@triton.jit
def _after_previous_kernel(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): this kernel may start while the previous one
    finishes; wait until that one's writes are visible, then let the next one start. The
    next one can thus start only once this one's predecessors have all finished: what a
    kernel reads before this call must come from two or more kernels back (weights, older
    cache rows, the step's position), never from the kernel just before."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _embed_kernel(tok_ptr, pos_ptr, wte_ptr, wpe_ptr, x_ptr, E: tl.constexpr, E_POW2: tl.constexpr, NPOS: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    _after_previous_kernel(USE_PDL)
    tok = tl.load(tok_ptr + b)
    pos = tl.minimum(tl.load(pos_ptr + b), NPOS - 1)  # scratch positions clamp, as in the model
    offs = tl.arange(0, E_POW2)
    m = offs < E
    x = tl.load(wte_ptr + tok * E + offs, mask=m, other=0.0).to(tl.float32)
    x += tl.load(wpe_ptr + pos * E + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(x_ptr + b * E + offs, x, mask=m)


@triton.jit
def _ln_gemv_kernel(
    x_ptr, lnw_ptr, lnb_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    # MODE 1 (QKV): k/v cache views of this layer, (S, H, T+1, D), and positions
    kc_ptr, vc_ptr, pos_ptr, stride_s, stride_h, stride_t,
    # MODE 2 (lm_head): per-block max and argmax
    pval_ptr, pidx_ptr, NB,
    N, eps,
    K: tl.constexpr, K_POW2: tl.constexpr, E: tl.constexpr, D: tl.constexpr,
    HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr, MODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[b, n] = epilogue(sum_k LN(x[b])[k] * w[n, k]), w row-major (N, K).

    Grid (cdiv(N, BLOCK_N), B). Each CTA recomputes the LayerNorm statistics of its row
    (K floats, L2-resident) so the norm needs no kernel of its own. The first weight tile
    is loaded before waiting for the previous kernel: no kernel writes weights, so under
    programmatic dependent launch that load overlaps the previous kernel's tail.
    """
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_row = x_ptr + b * K
    first_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + offs_n[:, None] * K + first_k[None, :], mask=mask_n[:, None] & (first_k < K)[None, :], other=0.0)
    _after_previous_kernel(USE_PDL)
    if BLOCK_K >= K:
        # One tile holds the whole row: x is read once, for the LayerNorm and the product.
        mask_k = first_k < K
        xk = tl.load(x_row + first_k, mask=mask_k, other=0.0)
        if HAS_LN:
            mean = tl.sum(xk, axis=0) / K
            diff = tl.where(mask_k, xk - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / K + eps)
            g = tl.load(lnw_ptr + first_k, mask=mask_k, other=0.0).to(tl.float32)
            be = tl.load(lnb_ptr + first_k, mask=mask_k, other=0.0).to(tl.float32)
            xk = tl.where(mask_k, diff * rstd * g + be, 0.0)
        acc = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    else:
        if HAS_LN:
            offs = tl.arange(0, K_POW2)
            mk = offs < K
            xr = tl.load(x_row + offs, mask=mk, other=0.0)
            mean = tl.sum(xr, axis=0) / K
            diff = tl.where(mk, xr - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0)
            if HAS_LN:
                g = tl.load(lnw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                be = tl.load(lnb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                xk = tl.where(mask_k, (xk - mean) * rstd * g + be, 0.0)
            if k0 > 0:
                w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if GELU:  # tanh GELU: 0.5 * (1 + tanh(u)) == sigmoid(2u)
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * u)
    if HAS_RES:
        acc += tl.load(res_ptr + b * N + offs_n, mask=mask_n, other=0.0)
    if MODE == 0:
        tl.store(out_ptr + b * N + offs_n, acc, mask=mask_n)
    elif MODE == 1:
        # q -> out (B, E); k, v -> the slot's cache row at the row's position.
        tl.store(out_ptr + b * E + offs_n, acc, mask=mask_n & (offs_n < E))
        pos = tl.load(pos_ptr + b)
        kv = tl.where(offs_n >= 2 * E, offs_n - 2 * E, offs_n - E)
        addr = b * stride_s + (kv // D) * stride_h + pos * stride_t + kv % D
        val = acc.to(kc_ptr.dtype.element_ty)
        tl.store(kc_ptr + addr, val, mask=mask_n & (offs_n >= E) & (offs_n < 2 * E))
        tl.store(vc_ptr + addr, val, mask=mask_n & (offs_n >= 2 * E))
    else:
        vals = tl.where(mask_n, acc, float("-inf"))
        tl.store(pval_ptr + b * NB + pid_n, tl.max(vals, axis=0))
        tl.store(pidx_ptr + b * NB + pid_n, (pid_n * BLOCK_N + tl.argmax(vals, axis=0)).to(tl.int64))


@triton.jit
def _decode_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, scale, stride_s, stride_h, stride_t,
    n_keys: tl.constexpr, H: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_KV: tl.constexpr,
):
    """One (row, query head) per CTA: online softmax over cache positions t < n_keys, t <= pos.
    Query head h reads KV head h // GROUP (grouped-query attention; GROUP 1 for GPT-2).

    n_keys is a compile-time constant: one specialisation per attended-length bucket
    (a handful), and it keeps the loop bound static. BLOCK_T >= n_keys makes it one pass
    (all loads in flight at once); at batch 1 only H CTAs run, so latency, not
    bandwidth, is what a smaller BLOCK_T costs (measured: 7.3 us a call at BLOCK_T=64).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    base = b * stride_s + (h // GROUP) * stride_h
    kv_off = base + offs_t[:, None] * stride_t + offs_d[None, :]
    if EARLY_KV:
        # Keys and values before the row's position come from earlier steps, finished once
        # this kernel may start, so under PDL they load during the QKV kernel's tail; only
        # the row at `pos`, which that kernel writes, is read after the wait. `pos` itself
        # is read before: the previous step's finish kernel wrote it.
        pos = tl.load(pos_ptr + b)
        early = (offs_t < pos) & (offs_t < n_keys)
        k = tl.load(kc_ptr + kv_off, mask=early[:, None], other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + kv_off, mask=early[:, None], other=0.0).to(tl.float32)
        _after_previous_kernel(USE_PDL)
        at_pos = (offs_t == pos)[:, None]
        k = tl.where(at_pos, tl.load(kc_ptr + base + pos * stride_t + offs_d).to(tl.float32)[None, :], k)
        v = tl.where(at_pos, tl.load(vc_ptr + base + pos * stride_t + offs_d).to(tl.float32)[None, :], v)
    else:
        _after_previous_kernel(USE_PDL)
        pos = tl.load(pos_ptr + b)
        mt = (offs_t <= pos) & (offs_t < n_keys)
        k = tl.load(kc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + b * H * D + h * D + offs_d) * scale
    # First block outside the loop: position 0 is always visible, so m and l start finite.
    mt = (offs_t <= pos) & (offs_t < n_keys)
    s = tl.where(mt, tl.sum(k * q[None, :], axis=1), float("-inf"))
    m_i = tl.max(s, axis=0)
    p = tl.exp(s - m_i)
    l_i = tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * v, axis=0)
    for t0 in range(BLOCK_T, n_keys, BLOCK_T):
        t = t0 + offs_t
        mt = (t <= pos) & (t < n_keys)
        kv_off = base + t[:, None] * stride_t + offs_d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
        s = tl.where(mt, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(vc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * H * D + h * D + offs_d, acc / l_i)


@triton.jit
def _finish_kernel(pval_ptr, pidx_ptr, NB, tok_ptr, pos_ptr, act_ptr, nxt_ptr, MAX_POS, NB_POW2: tl.constexpr, USE_PDL: tl.constexpr):
    """Argmax over the lm_head blocks, then advance the row's decode state."""
    b = tl.program_id(0)
    _after_previous_kernel(USE_PDL)
    offs = tl.arange(0, NB_POW2)
    v = tl.load(pval_ptr + b * NB + offs, mask=offs < NB, other=float("-inf"))
    best = tl.argmax(v, axis=0)  # lowest block wins a tie, and blocks hold ascending ids
    nxt = tl.load(pidx_ptr + b * NB + best)
    act = tl.load(act_ptr + b) != 0
    tl.store(nxt_ptr + b, nxt)
    tl.store(tok_ptr + b, tl.where(act, nxt, tl.load(tok_ptr + b)))
    pos = tl.load(pos_ptr + b)
    tl.store(pos_ptr + b, tl.minimum(pos + act.to(tl.int64), MAX_POS))


def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class TritonDecodeStep:
    """Drop-in for DecodeStep: (tokens, positions, active, key_range, k_cache, v_cache) -> next.

    Built from StaticKVGPT2-named parameters (a StaticKVGPT2's or a loaded program's
    named_parameters()); projection weights are copied once into (out, in) layout so each
    CTA streams contiguous rows.
    """

    # (BLOCK_N, BLOCK_K, warps) per GEMV; BLOCK_K None: the whole row (up to MAX_BLOCK_K),
    # so under PDL a CTA's whole weight slice loads before it waits for the previous kernel.
    # Measured on the H200 (docs/performance.md#on-the-gpu; run_device.sh pdl): 32+128
    # tokens at batch 1 take 24.1 ms with these and PDL, 36.5 ms with the earlier tiles
    # ((8,256) (2,256) (8,256) (2,1024) (16,256), 4 warps) and no PDL; narrow tiles
    # with few warps (many small CTAs in flight) won every comparison.
    QKV, OPROJ, FC, MPROJ, HEAD = (4, None, 1), (2, None, 2), (4, None, 1), (2, None, 2), (16, None, 2)
    GEMV_WARPS = 2  # for a tile given as (BLOCK_N, BLOCK_K)
    MAX_BLOCK_K = 4096
    # One pass over the attended keys (BLOCK_T is capped by the attended length). 4 warps
    # measured faster than 8 once the keys before the row's position load before the wait.
    ATTN_BLOCK_T, ATTN_WARPS = 256, 4
    ATTN_EARLY_KV = True

    def __init__(self, params: Mapping[str, Tensor], shape: GPT2Shape, max_context: int, linear_layout: bool = False, pdl: bool | None = None) -> None:
        self.s = shape
        self.max_context = max_context
        # Programmatic dependent launch where the GPU has it (Hopper, sm_90, and later):
        # each of the 63 kernels of a step then starts during the tail of the one before.
        self.pdl = pdl if pdl is not None else _has_pdl(params["wte"].device)

        def rows(name: str) -> Tensor:
            w = params[name]
            return w.contiguous() if linear_layout else w.transpose(-1, -2).contiguous()

        self.w_qkv, self.w_o, self.w_fc, self.w_mp = rows("w_qkv"), rows("w_o"), rows("w_fc"), rows("w_mp")
        self.p = {k: params[k] for k in ("b_qkv", "b_o", "b_fc", "b_mp", "ln1_w", "ln1_b", "ln2_w", "ln2_b", "lnf_w", "lnf_b", "wte", "wpe")}
        self.head = params["lm_head"] if params.get("lm_head") is not None else params["wte"]
        self.scale = 1.0 / math.sqrt(shape.head_dim)

    def _gemv(self, x, w, blocks, N, K, out, *, ln=None, bias=None, res=None, gelu=False, mode=0, qkv=None, argmax=None) -> None:
        BN, BK, warps = (*blocks, self.GEMV_WARPS)[:3]
        BK = BK or min(_pow2(K), self.MAX_BLOCK_K)
        B = x.shape[0]
        kc, vc, pos = qkv if qkv is not None else (out, out, out)
        pval, pidx = argmax if argmax is not None else (out, out)
        nb = pval.shape[-1] if argmax is not None else 1
        stride = kc.stride() if qkv is not None else (0, 0, 0)
        _ln_gemv_kernel[(triton.cdiv(N, BN), B)](
            x, ln[0] if ln else x, ln[1] if ln else x, w, bias if bias is not None else x, res if res is not None else x, out,
            kc, vc, pos, stride[0], stride[1], stride[2],
            pval, pidx, nb,
            N, 1e-5 if ln is None else self.s.eps,
            K=K, K_POW2=_pow2(K), E=self.s.n_embd, D=self.s.head_dim,
            HAS_LN=ln is not None, HAS_BIAS=bias is not None, GELU=gelu, HAS_RES=res is not None, MODE=mode,
            BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, USE_PDL=self.pdl, launch_pdl=self.pdl,
        )

    def __call__(self, tokens: Tensor, positions: Tensor, active: Tensor, key_range: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        s, p = self.s, self.p
        B, E, H, D, I, V = tokens.shape[0], s.n_embd, s.n_head, s.head_dim, s.n_inner, s.vocab_size
        dev = tokens.device
        x = torch.empty(B, E, device=dev, dtype=torch.float32)
        q = torch.empty(B, E, device=dev, dtype=torch.float32)
        o = torch.empty(B, E, device=dev, dtype=torch.float32)
        hid = torch.empty(B, I, device=dev, dtype=torch.float32)
        nb = triton.cdiv(V, self.HEAD[0])
        pval = torch.empty(B, nb, device=dev, dtype=torch.float32)
        pidx = torch.empty(B, nb, device=dev, dtype=torch.int64)
        nxt = torch.empty(B, device=dev, dtype=torch.int64)
        _embed_kernel[(B,)](tokens, positions, p["wte"], p["wpe"], x, E=E, E_POW2=_pow2(E), NPOS=s.n_positions, USE_PDL=self.pdl, launch_pdl=self.pdl)
        n_keys = key_range.shape[0]
        for layer in range(s.n_layer):
            kc, vc = k_cache[layer], v_cache[layer]
            self._gemv(x, self.w_qkv[layer], self.QKV, 3 * E, E, q, ln=(p["ln1_w"][layer], p["ln1_b"][layer]), bias=p["b_qkv"][layer], mode=1, qkv=(kc, vc, positions))
            st = kc.stride()
            _decode_attn_kernel[(B, H)](
                q, kc, vc, positions, o, self.scale, st[0], st[1], st[2],
                n_keys=n_keys, H=H, D=D, GROUP=1, BLOCK_T=min(self.ATTN_BLOCK_T, _pow2(n_keys)), num_warps=self.ATTN_WARPS,
                USE_PDL=self.pdl, EARLY_KV=self.ATTN_EARLY_KV, launch_pdl=self.pdl,
            )
            self._gemv(o, self.w_o[layer], self.OPROJ, E, E, x, bias=p["b_o"][layer], res=x)
            self._gemv(x, self.w_fc[layer], self.FC, I, E, hid, ln=(p["ln2_w"][layer], p["ln2_b"][layer]), bias=p["b_fc"][layer], gelu=True)
            self._gemv(hid, self.w_mp[layer], self.MPROJ, E, I, x, bias=p["b_mp"][layer], res=x)
        self._gemv(x, self.head, self.HEAD, V, E, x, ln=(p["lnf_w"], p["lnf_b"]), mode=2, argmax=(pval, pidx))
        _finish_kernel[(B,)](pval, pidx, nb, tokens, positions, active, nxt, self.max_context, NB_POW2=_pow2(nb), USE_PDL=self.pdl, launch_pdl=self.pdl)
        return nxt


# ---------------------------------------------------------------------------- the Llama family
#
# Per layer: [RMSNorm1 + QKV + bias + rotary + k/v cache write] [attention, query head h on
# KV head h // group] [O-proj + bias + residual] [RMSNorm2 + gate/up + SiLU(gate) * up]
# [down + residual]; then [RMSNorm_f + lm_head + per-block argmax] and the shared finish.
# The rotary halves of a head (i and i + D/2) and a gate row with its up row are computed by
# the same CTA, so the pairing needs no second pass.


@triton.jit
def _llama_embed_kernel(tok_ptr, emb_ptr, x_ptr, E: tl.constexpr, E_POW2: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    _after_previous_kernel(USE_PDL)
    tok = tl.load(tok_ptr + b)
    offs = tl.arange(0, E_POW2)
    m = offs < E
    tl.store(x_ptr + b * E + offs, tl.load(emb_ptr + tok * E + offs, mask=m, other=0.0).to(tl.float32), mask=m)


@triton.jit
def _rms_gemv_kernel(
    x_ptr, nw_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
    # MODE 1 (QKV): this layer's k/v caches (S, KVH, T+1, D), positions, rotary tables (T+1, D/2)
    kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, stride_s, stride_h, stride_t,
    # MODE 2 (lm_head): per-block max and argmax
    pval_ptr, pidx_ptr, NB,
    N, eps,
    K: tl.constexpr, K_POW2: tl.constexpr, D: tl.constexpr, QD: tl.constexpr, KVD: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, MODE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Item n of N per output lane, w row-major (rows, K), x normalised by RMSNorm if asked.

    MODE 0: out[b, n] = w[n] . x (+ bias, + residual). MODE 1: n is a rotary pair of the
    fused q/k/v rows, (head, i) → rows head*D + i and head*D + i + D/2; q goes to out (B, QD),
    k (rotated) and v to the cache at the row's position. MODE 2: lm_head, per-block argmax.
    MODE 3: out[b, n] = silu(w[n] . x) * (w[n + N] . x), gate and up rows of one matrix.
    Grid (cdiv(N, BLOCK_N), B); first weight tiles load before the wait, as _ln_gemv_kernel's.
    """
    PAIRED: tl.constexpr = MODE == 1 or MODE == 3
    HALF: tl.constexpr = D // 2
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if MODE == 1:
        r1 = (offs_n // HALF) * D + offs_n % HALF
        r2 = r1 + HALF
    else:
        r1 = offs_n
        r2 = offs_n + N
    x_row = x_ptr + b * K
    first_k = tl.arange(0, BLOCK_K)
    wmask = mask_n[:, None] & (first_k < K)[None, :]
    w1 = tl.load(w_ptr + r1[:, None] * K + first_k[None, :], mask=wmask, other=0.0)
    if PAIRED:
        w2 = tl.load(w_ptr + r2[:, None] * K + first_k[None, :], mask=wmask, other=0.0)
    _after_previous_kernel(USE_PDL)
    if BLOCK_K >= K:
        mask_k = first_k < K
        xk = tl.load(x_row + first_k, mask=mask_k, other=0.0)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(xk * xk, axis=0) / K + eps)
            xk = xk * rstd * tl.load(nw_ptr + first_k, mask=mask_k, other=0.0).to(tl.float32)
        acc1 = tl.sum(w1.to(tl.float32) * xk[None, :], axis=1)
        if PAIRED:
            acc2 = tl.sum(w2.to(tl.float32) * xk[None, :], axis=1)
    else:
        if HAS_NORM:
            offs = tl.arange(0, K_POW2)
            xr = tl.load(x_row + offs, mask=offs < K, other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / K + eps)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0)
            if HAS_NORM:
                xk = xk * rstd * tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            if k0 > 0:
                wmask = mask_n[:, None] & mask_k[None, :]
                w1 = tl.load(w_ptr + r1[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)
                if PAIRED:
                    w2 = tl.load(w_ptr + r2[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)
            acc1 += tl.sum(w1.to(tl.float32) * xk[None, :], axis=1)
            if PAIRED:
                acc2 += tl.sum(w2.to(tl.float32) * xk[None, :], axis=1)
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + r1, mask=mask_n, other=0.0).to(tl.float32)
        if PAIRED:
            acc2 += tl.load(bias_ptr + r2, mask=mask_n, other=0.0).to(tl.float32)
    if MODE == 0:
        if HAS_RES:
            acc1 += tl.load(res_ptr + b * N + offs_n, mask=mask_n, other=0.0)
        tl.store(out_ptr + b * N + offs_n, acc1, mask=mask_n)
    elif MODE == 1:
        pos = tl.load(pos_ptr + b)
        i = offs_n % HALF
        c = tl.load(cos_ptr + pos * HALF + i, mask=mask_n, other=0.0)
        s = tl.load(sin_ptr + pos * HALF + i, mask=mask_n, other=0.0)
        rotated = r1 < QD + KVD  # q and k heads; v is not rotated
        o1 = tl.where(rotated, acc1 * c - acc2 * s, acc1)
        o2 = tl.where(rotated, acc2 * c + acc1 * s, acc2)
        tl.store(out_ptr + b * QD + r1, o1, mask=mask_n & (r1 < QD))
        tl.store(out_ptr + b * QD + r2, o2, mask=mask_n & (r2 < QD))
        row = b * stride_s + pos * stride_t
        is_k = mask_n & (r1 >= QD) & (r1 < QD + KVD)
        is_v = mask_n & (r1 >= QD + KVD)
        k1, k2 = r1 - QD, r2 - QD
        v1, v2 = r1 - QD - KVD, r2 - QD - KVD
        dt = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + row + (k1 // D) * stride_h + k1 % D, o1.to(dt), mask=is_k)
        tl.store(kc_ptr + row + (k2 // D) * stride_h + k2 % D, o2.to(dt), mask=is_k)
        tl.store(vc_ptr + row + (v1 // D) * stride_h + v1 % D, o1.to(dt), mask=is_v)
        tl.store(vc_ptr + row + (v2 // D) * stride_h + v2 % D, o2.to(dt), mask=is_v)
    elif MODE == 3:
        tl.store(out_ptr + b * N + offs_n, acc1 * tl.sigmoid(acc1) * acc2, mask=mask_n)
    else:
        vals = tl.where(mask_n, acc1, float("-inf"))
        tl.store(pval_ptr + b * NB + pid_n, tl.max(vals, axis=0))
        tl.store(pidx_ptr + b * NB + pid_n, (pid_n * BLOCK_N + tl.argmax(vals, axis=0)).to(tl.int64))


# The fused Llama step: three kernels per layer instead of five, since at batch 1 a step is
# a chain of launches, each costing microseconds whatever it computes (the measurements:
# docs/performance.md#on-the-gpu). The attention of a query head is followed by its
# slice of the O-projection, and the gate/up rows of an intermediate block by their slice
# of the down projection; each CTA adds its share of the output (and one CTA the residual)
# into a zeroed fp32 buffer with atomics. The residual stream thus rotates over three
# buffers per row, (A, B, C) for layer l and (C, A, B) for layer l + 1:
#   [RMSNorm1 + QKV + rotary + cache write]  reads A, clears B
#   [attention + O-proj + residual]           reads A, adds into B, clears C
#   [RMSNorm2 + gate/up + SiLU + down + res.] reads B, adds into C
# A buffer is cleared by a kernel that runs after its last reader has finished and before
# its first writer starts (under programmatic dependent launch, writes come after the wait).
# The sums are the unfused step's, in another order (fp32, as there).


@triton.jit
def _fused_qkv_kernel(
    x_ptr, tok_ptr, emb_ptr, zero_ptr, nw_ptr, w_ptr, bias_ptr, q_ptr,
    kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, stride_s, stride_h, stride_t,
    N, eps,
    K: tl.constexpr, K_POW2: tl.constexpr, D: tl.constexpr, QD: tl.constexpr, KVD: tl.constexpr,
    EMBED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    """_rms_gemv_kernel's MODE 1 over whole rows (K_POW2 at most MAX_BLOCK_K), which also
    clears zero_ptr's row. EMBED (layer 0): x is the token's embedding row, which the CTA of
    item block 0 also writes to x_ptr, the residual the attention kernel adds."""
    HALF: tl.constexpr = D // 2
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    r1 = (offs_n // HALF) * D + offs_n % HALF
    r2 = r1 + HALF
    offs_k = tl.arange(0, K_POW2)
    mask_k = offs_k < K
    wmask = mask_n[:, None] & mask_k[None, :]
    w1 = tl.load(w_ptr + r1[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)
    w2 = tl.load(w_ptr + r2[:, None] * K + offs_k[None, :], mask=wmask, other=0.0)
    nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    _after_previous_kernel(USE_PDL)
    if EMBED:
        tok = tl.load(tok_ptr + b)
        xk = tl.load(emb_ptr + tok * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        tl.store(x_ptr + b * K + offs_k, xk, mask=mask_k & (pid_n == 0))
    else:
        xk = tl.load(x_ptr + b * K + offs_k, mask=mask_k, other=0.0)
    tl.store(zero_ptr + b * K + offs_k, tl.zeros([K_POW2], dtype=tl.float32), mask=mask_k & (pid_n == 0))
    rstd = 1.0 / tl.sqrt(tl.sum(xk * xk, axis=0) / K + eps)
    xk = xk * rstd * nw
    acc1 = tl.sum(w1.to(tl.float32) * xk[None, :], axis=1)
    acc2 = tl.sum(w2.to(tl.float32) * xk[None, :], axis=1)
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + r1, mask=mask_n, other=0.0).to(tl.float32)
        acc2 += tl.load(bias_ptr + r2, mask=mask_n, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + b)
    i = offs_n % HALF
    c = tl.load(cos_ptr + pos * HALF + i, mask=mask_n, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=mask_n, other=0.0)
    rotated = r1 < QD + KVD  # q and k heads; v is not rotated
    o1 = tl.where(rotated, acc1 * c - acc2 * s, acc1)
    o2 = tl.where(rotated, acc2 * c + acc1 * s, acc2)
    tl.store(q_ptr + b * QD + r1, o1, mask=mask_n & (r1 < QD))
    tl.store(q_ptr + b * QD + r2, o2, mask=mask_n & (r2 < QD))
    row = b * stride_s + pos * stride_t
    is_k = mask_n & (r1 >= QD) & (r1 < QD + KVD)
    is_v = mask_n & (r1 >= QD + KVD)
    k1, k2 = r1 - QD, r2 - QD
    v1, v2 = r1 - QD - KVD, r2 - QD - KVD
    dt = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + row + (k1 // D) * stride_h + k1 % D, o1.to(dt), mask=is_k)
    tl.store(kc_ptr + row + (k2 // D) * stride_h + k2 % D, o2.to(dt), mask=is_k)
    tl.store(vc_ptr + row + (v1 // D) * stride_h + v1 % D, o1.to(dt), mask=is_v)
    tl.store(vc_ptr + row + (v2 // D) * stride_h + v2 % D, o2.to(dt), mask=is_v)


@triton.jit
def _attn_oproj_kernel(
    q_ptr, kc_ptr, vc_ptr, pos_ptr, wo_ptr, bo_ptr, x_ptr, out_ptr, zero_ptr, scale, stride_s, stride_h, stride_t,
    n_keys: tl.constexpr, H: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, E: tl.constexpr, E_POW2: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, LATE_CAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (cdiv(E, BLOCK_N), H, B): query head h's attention (as _decode_attn_kernel with
    EARLY_KV, recomputed by each of the head's CTAs: its keys are L2-resident), then
    out[b, n] += w_o[n, h*D:(h+1)*D] . o_h for the CTA's BLOCK_N outputs n; head 0's CTAs add
    the residual x (and the bias). CTA (0, 0) clears zero_ptr's row. LATE_CAST: the keys and
    values loaded before the wait stay in the cache's dtype until used (half the registers)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < E
    wo = tl.load(wo_ptr + offs_n[:, None] * (H * D) + h * D + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    base = b * stride_s + (h // GROUP) * stride_h
    kv_off = base + offs_t[:, None] * stride_t + offs_d[None, :]
    pos = tl.load(pos_ptr + b)
    early = (offs_t < pos) & (offs_t < n_keys)
    k = tl.load(kc_ptr + kv_off, mask=early[:, None], other=0.0)
    v = tl.load(vc_ptr + kv_off, mask=early[:, None], other=0.0)
    if not LATE_CAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    _after_previous_kernel(USE_PDL)
    at_pos = (offs_t == pos)[:, None]
    k = tl.where(at_pos, tl.load(kc_ptr + base + pos * stride_t + offs_d).to(k.dtype)[None, :], k)
    v = tl.where(at_pos, tl.load(vc_ptr + base + pos * stride_t + offs_d).to(v.dtype)[None, :], v)
    q = tl.load(q_ptr + b * H * D + h * D + offs_d) * scale
    mt = (offs_t <= pos) & (offs_t < n_keys)
    s = tl.where(mt, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    m_i = tl.max(s, axis=0)
    p = tl.exp(s - m_i)
    l_i = tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    for t0 in range(BLOCK_T, n_keys, BLOCK_T):
        t = t0 + offs_t
        mt = (t <= pos) & (t < n_keys)
        kv_off = base + t[:, None] * stride_t + offs_d[None, :]
        kt = tl.load(kc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
        s = tl.where(mt, tl.sum(kt * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        vt = tl.load(vc_ptr + kv_off, mask=mt[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m_i = m_new
    o = acc / l_i
    part = tl.sum(wo.to(tl.float32) * o[None, :], axis=1)
    first = h == 0
    part += tl.load(x_ptr + b * E + offs_n, mask=mask_n & first, other=0.0)
    if HAS_BIAS:
        part += tl.load(bo_ptr + offs_n, mask=mask_n & first, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + b * E + offs_n, part, mask=mask_n, sem="relaxed")
    offs_e = tl.arange(0, E_POW2)
    tl.store(zero_ptr + b * E + offs_e, tl.zeros([E_POW2], dtype=tl.float32), mask=(offs_e < E) & first & (pid_n == 0))


@triton.jit
def _mlp_tiles(wgu_ptr, wd_ptr, nw_ptr, offs_j, mask_j, offs_k, mask_k, I, K: tl.constexpr):
    """The gate, up and down weight tiles of intermediate units offs_j over columns offs_k,
    and those columns of the RMSNorm weight."""
    gmask = mask_j[:, None] & mask_k[None, :]
    rows = offs_j[:, None] * K + offs_k[None, :]
    wg = tl.load(wgu_ptr + rows, mask=gmask, other=0.0)
    wu = tl.load(wgu_ptr + I * K + rows, mask=gmask, other=0.0)
    wd = tl.load(wd_ptr + offs_k[:, None] * I + offs_j[None, :], mask=mask_k[:, None] & mask_j[None, :], other=0.0)
    nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return wg, wu, wd, nw


@triton.jit
def _mlp_kernel(
    x_ptr, nw_ptr, wgu_ptr, wd_ptr, out_ptr, I, eps,
    K: tl.constexpr, K_A: tl.constexpr, K_B: tl.constexpr, BLOCK_J: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (cdiv(I, BLOCK_J), B): h_j = silu(gate_j . n) * (up_j . n) for the CTA's BLOCK_J
    intermediate units j (n: x after RMSNorm2), then out[b, :] += w_down[:, j-block] @ h; the
    CTA of block 0 adds the residual x. w_gate_up (2I, K) rows, w_down (K, I) rows: the
    down tile is BLOCK_J contiguous columns of each row (BLOCK_J * 2 bytes: a 32-byte sector
    at 16 fp16 columns).

    The K columns are two tiles of powers of two, [0, K_A) and [K_A, K_A + K_B) (K_B 0: one
    tile), so a hidden size such as 576 = 512 + 64 is not padded to 1024: no masked-off
    lanes in the loads and reductions."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    offs_j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
    mask_j = offs_j < I
    offs_a = tl.arange(0, K_A)
    mask_a = offs_a < K
    wg_a, wu_a, wd_a, nw_a = _mlp_tiles(wgu_ptr, wd_ptr, nw_ptr, offs_j, mask_j, offs_a, mask_a, I, K)
    if K_B > 0:
        offs_b = K_A + tl.arange(0, K_B)
        mask_b = offs_b < K
        wg_b, wu_b, wd_b, nw_b = _mlp_tiles(wgu_ptr, wd_ptr, nw_ptr, offs_j, mask_j, offs_b, mask_b, I, K)
    _after_previous_kernel(USE_PDL)
    x_a = tl.load(x_ptr + b * K + offs_a, mask=mask_a, other=0.0)
    ss = tl.sum(x_a * x_a, axis=0)
    if K_B > 0:
        x_b = tl.load(x_ptr + b * K + offs_b, mask=mask_b, other=0.0)
        ss += tl.sum(x_b * x_b, axis=0)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    xn_a = x_a * rstd * nw_a
    g = tl.sum(wg_a.to(tl.float32) * xn_a[None, :], axis=1)
    u = tl.sum(wu_a.to(tl.float32) * xn_a[None, :], axis=1)
    if K_B > 0:
        xn_b = x_b * rstd * nw_b
        g += tl.sum(wg_b.to(tl.float32) * xn_b[None, :], axis=1)
        u += tl.sum(wu_b.to(tl.float32) * xn_b[None, :], axis=1)
    hid = g * tl.sigmoid(g) * u
    part_a = tl.sum(wd_a.to(tl.float32) * hid[None, :], axis=1) + tl.where(pid == 0, x_a, 0.0)
    tl.atomic_add(out_ptr + b * K + offs_a, part_a, mask=mask_a, sem="relaxed")
    if K_B > 0:
        part_b = tl.sum(wd_b.to(tl.float32) * hid[None, :], axis=1) + tl.where(pid == 0, x_b, 0.0)
        tl.atomic_add(out_ptr + b * K + offs_b, part_b, mask=mask_b, sem="relaxed")


def _split_pow2(k: int) -> tuple[int, int]:
    """Two power-of-two tiles covering k columns with the least padding: (k, 0) for a power
    of two, else the largest power of two below k and the rest rounded up."""
    if k & (k - 1) == 0:
        return k, 0
    a = 1 << (k.bit_length() - 1)
    return a, _pow2(k - a)


class TritonLlamaDecodeStep:
    """Drop-in for DecodeStep(StaticKVLlama): (tokens, positions, active, key_range, k_cache,
    v_cache) -> next. Built from StaticKVLlama-named parameters and its `inv_freq` buffer (a
    StaticKVLlama's or a loaded program's); its weights are already (out, in) rows, so they
    are used as they are. Rotary cos/sin come from a table over the cache's positions
    (scratch included), made once from those frequencies as the model makes them.

    FUSED (the default where the hidden size fits one tile, MAX_BLOCK_K): three kernels per
    layer (see _fused_qkv_kernel above) instead of five; the five-kernel step stays for
    wider models and as the reference the fused one is measured against.
    """

    # (BLOCK_N, BLOCK_K, warps); BLOCK_N counts items: rotary pairs (QKV) and gate/up pairs
    # (GATE_UP) are two weight rows each. BLOCK_K None: the whole row, as TritonDecodeStep.
    QKV, OPROJ, GATE_UP, DOWN, HEAD = (2, None, 1), (2, None, 2), (2, None, 1), (2, None, 2), (16, None, 2)
    GEMV_WARPS = 2
    MAX_BLOCK_K = 4096
    ATTN_BLOCK_T, ATTN_WARPS = 256, 4
    ATTN_EARLY_KV = True
    FUSED = True
    # The fused step's tiles: output rows per attention + O-proj CTA and its warps; the
    # intermediate units per MLP CTA (as elements of a tile of K_POW2 columns) and its warps.
    # The fastest measured on the H200 (docs/performance.md#on-the-gpu): fewer MLP
    # CTAs mean fewer atomic adds into the residual.
    ATTN_O_BLOCK_N, ATTN_O_WARPS = 64, 4
    MLP_TILE, MLP_WARPS = 16384, 8
    # Attention + O-proj: cache positions per pass, and keys/values kept in the cache dtype
    # until used; MLP: the hidden size as two power-of-two tiles instead of one padded tile
    # (both the faster on the H200: docs/performance.md#on-the-gpu).
    ATTN_O_BLOCK_T, ATTN_O_LATE_CAST = 256, True
    MLP_SPLIT_K = True

    def __init__(self, params: Mapping[str, Tensor], shape: LlamaShape, max_context: int, pdl: bool | None = None) -> None:
        self.s = shape
        self.max_context = max_context
        self.pdl = pdl if pdl is not None else _has_pdl(params["embed"].device)
        self.p = {k: params.get(k) for k in ("embed", "ln1_w", "ln2_w", "w_qkv", "b_qkv", "w_o", "b_o", "w_gate_up", "w_down", "lnf_w")}
        self.head = params["lm_head"] if params.get("lm_head") is not None else params["embed"]
        inv_freq = params["inv_freq"]
        freqs = torch.arange(max_context + 1, device=inv_freq.device).float().unsqueeze(-1) * inv_freq
        dtype = params["embed"].dtype
        # As StaticKVLlama._rotary: fp32 angles, scaled, rounded to the model dtype.
        self.cos = (freqs.cos() * shape.rope_scaling).to(dtype).float().contiguous()
        self.sin = (freqs.sin() * shape.rope_scaling).to(dtype).float().contiguous()
        self.scale = 1.0 / math.sqrt(shape.head_dim)

    def _gemv(self, x, w, blocks, N, K, out, *, norm=None, bias=None, res=None, mode=0, qkv=None, argmax=None) -> None:
        s = self.s
        BN, BK, warps = (*blocks, self.GEMV_WARPS)[:3]
        BK = BK or min(_pow2(K), self.MAX_BLOCK_K)
        kc, vc, pos = qkv if qkv is not None else (out, out, out)
        pval, pidx = argmax if argmax is not None else (out, out)
        nb = pval.shape[-1] if argmax is not None else 1
        stride = kc.stride() if qkv is not None else (0, 0, 0)
        _rms_gemv_kernel[(triton.cdiv(N, BN), x.shape[0])](
            x, norm if norm is not None else x, w, bias if bias is not None else x, res if res is not None else x, out,
            kc, vc, pos, self.cos, self.sin, stride[0], stride[1], stride[2],
            pval, pidx, nb,
            N, s.eps,
            K=K, K_POW2=_pow2(K), D=s.head_dim, QD=s.num_heads * s.head_dim, KVD=s.num_kv_heads * s.head_dim,
            HAS_NORM=norm is not None, HAS_BIAS=bias is not None, HAS_RES=res is not None, MODE=mode,
            BLOCK_N=BN, BLOCK_K=BK, num_warps=warps, USE_PDL=self.pdl, launch_pdl=self.pdl,
        )

    def __call__(self, tokens: Tensor, positions: Tensor, active: Tensor, key_range: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        if self.FUSED and _pow2(self.s.hidden_size) <= self.MAX_BLOCK_K:
            return self._fused(tokens, positions, active, key_range, k_cache, v_cache)
        s, p = self.s, self.p
        B, E, H, KVH, D, I, V = tokens.shape[0], s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size, s.vocab_size
        dev = tokens.device
        x = torch.empty(B, E, device=dev, dtype=torch.float32)
        q = torch.empty(B, H * D, device=dev, dtype=torch.float32)
        o = torch.empty(B, H * D, device=dev, dtype=torch.float32)
        hid = torch.empty(B, I, device=dev, dtype=torch.float32)
        nb = triton.cdiv(V, self.HEAD[0])
        pval = torch.empty(B, nb, device=dev, dtype=torch.float32)
        pidx = torch.empty(B, nb, device=dev, dtype=torch.int64)
        nxt = torch.empty(B, device=dev, dtype=torch.int64)
        _llama_embed_kernel[(B,)](tokens, p["embed"], x, E=E, E_POW2=_pow2(E), USE_PDL=self.pdl, launch_pdl=self.pdl)
        n_keys = key_range.shape[0]
        pairs = (H + 2 * KVH) * D // 2
        for layer in range(s.num_layers):
            kc, vc = k_cache[layer], v_cache[layer]
            b_qkv = p["b_qkv"][layer] if p["b_qkv"] is not None else None
            self._gemv(x, p["w_qkv"][layer], self.QKV, pairs, E, q, norm=p["ln1_w"][layer], bias=b_qkv, mode=1, qkv=(kc, vc, positions))
            st = kc.stride()
            _decode_attn_kernel[(B, H)](
                q, kc, vc, positions, o, self.scale, st[0], st[1], st[2],
                n_keys=n_keys, H=H, D=D, GROUP=s.group, BLOCK_T=min(self.ATTN_BLOCK_T, _pow2(n_keys)), num_warps=self.ATTN_WARPS,
                USE_PDL=self.pdl, EARLY_KV=self.ATTN_EARLY_KV, launch_pdl=self.pdl,
            )
            b_o = p["b_o"][layer] if p["b_o"] is not None else None
            self._gemv(o, p["w_o"][layer], self.OPROJ, E, H * D, x, bias=b_o, res=x)
            self._gemv(x, p["w_gate_up"][layer], self.GATE_UP, I, E, hid, norm=p["ln2_w"][layer], mode=3)
            self._gemv(hid, p["w_down"][layer], self.DOWN, E, I, x, res=x)
        self._gemv(x, self.head, self.HEAD, V, E, x, norm=p["lnf_w"], mode=2, argmax=(pval, pidx))
        _finish_kernel[(B,)](pval, pidx, nb, tokens, positions, active, nxt, self.max_context, NB_POW2=_pow2(nb), USE_PDL=self.pdl, launch_pdl=self.pdl)
        return nxt

    def _fused(self, tokens: Tensor, positions: Tensor, active: Tensor, key_range: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """The same step in 3 kernels per layer + lm_head + finish (92 launches for 30 layers)."""
        s, p = self.s, self.p
        B, E, H, KVH, D, I, V = tokens.shape[0], s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size, s.vocab_size
        dev = tokens.device
        E_POW2 = _pow2(E)
        xs = torch.empty(3, B, E, device=dev, dtype=torch.float32)  # the residual stream's three buffers
        q = torch.empty(B, H * D, device=dev, dtype=torch.float32)
        nb = triton.cdiv(V, self.HEAD[0])
        pval = torch.empty(B, nb, device=dev, dtype=torch.float32)
        pidx = torch.empty(B, nb, device=dev, dtype=torch.int64)
        nxt = torch.empty(B, device=dev, dtype=torch.int64)
        n_keys = key_range.shape[0]
        pairs = (H + 2 * KVH) * D // 2
        qkv_n, _, qkv_warps = (*self.QKV, self.GEMV_WARPS)[:3]
        block_j = max(1, min(self.MLP_TILE // E_POW2, _pow2(I)))
        k_a, k_b = _split_pow2(E) if self.MLP_SPLIT_K else (E_POW2, 0)
        pdl = {"USE_PDL": self.pdl, "launch_pdl": self.pdl}
        for layer in range(s.num_layers):
            kc, vc = k_cache[layer], v_cache[layer]
            st = kc.stride()
            xa, xb, xc = xs[-layer % 3], xs[(1 - layer) % 3], xs[(2 - layer) % 3]
            b_qkv = p["b_qkv"][layer] if p["b_qkv"] is not None else xa
            _fused_qkv_kernel[(triton.cdiv(pairs, qkv_n), B)](
                xa, tokens, p["embed"], xb, p["ln1_w"][layer], p["w_qkv"][layer], b_qkv, q,
                kc, vc, positions, self.cos, self.sin, st[0], st[1], st[2],
                pairs, s.eps,
                K=E, K_POW2=E_POW2, D=D, QD=H * D, KVD=KVH * D,
                EMBED=layer == 0, HAS_BIAS=p["b_qkv"] is not None, BLOCK_N=qkv_n, num_warps=qkv_warps, **pdl,
            )
            b_o = p["b_o"][layer] if p["b_o"] is not None else xa
            _attn_oproj_kernel[(triton.cdiv(E, self.ATTN_O_BLOCK_N), H, B)](
                q, kc, vc, positions, p["w_o"][layer], b_o, xa, xb, xc, self.scale, st[0], st[1], st[2],
                n_keys=n_keys, H=H, D=D, GROUP=s.group, E=E, E_POW2=E_POW2, HAS_BIAS=p["b_o"] is not None,
                BLOCK_T=min(self.ATTN_O_BLOCK_T, _pow2(n_keys)), BLOCK_N=self.ATTN_O_BLOCK_N, LATE_CAST=self.ATTN_O_LATE_CAST,
                num_warps=self.ATTN_O_WARPS, **pdl,
            )
            _mlp_kernel[(triton.cdiv(I, block_j), B)](
                xb, p["ln2_w"][layer], p["w_gate_up"][layer], p["w_down"][layer], xc, I, s.eps,
                K=E, K_A=k_a, K_B=k_b, BLOCK_J=block_j, num_warps=self.MLP_WARPS, **pdl,
            )
        x = xs[(2 - (s.num_layers - 1)) % 3]
        self._gemv(x, self.head, self.HEAD, V, E, x, norm=p["lnf_w"], mode=2, argmax=(pval, pidx))
        _finish_kernel[(B,)](pval, pidx, nb, tokens, positions, active, nxt, self.max_context, NB_POW2=_pow2(nb), USE_PDL=self.pdl, launch_pdl=self.pdl)
        return nxt


def triton_decode_step(params: Mapping[str, Tensor], shape: StaticShape, max_context: int) -> TritonDecodeStep | TritonLlamaDecodeStep:
    """The one-row Triton step of the model's family."""
    if isinstance(shape, LlamaShape):
        return TritonLlamaDecodeStep(params, shape, max_context)
    return TritonDecodeStep(params, shape, max_context)
