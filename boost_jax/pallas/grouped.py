"""Grouped projections as Pallas (Triton) kernels, each with an XLA reference.

(a) `grouped_up`: batched up-projection z [G,T,r] × B [G,r,n] -> [G,T,n] (q|k|v, gate|up).
    GQA (k/v narrower than q): pass B as a list of [r, n_g]; it is zero-padded to max n_g and
    the kernel skips (writes zeros for) column tiles past each group's own n_g, so the padding
    costs a weight copy but no FLOPs; outputs come back as a list of [T, n_g].
(b) `concat_down`: x [T,d] @ [A_1|A_2|…] -> [x@A_1, x@A_2, …] as ONE GEMM. Store the weights
    pre-concatenated (pass one array + `sizes`) to avoid a concat per step.
(c) `norm_matmul`: fused Online-RMSNorm + down-projection, one pass over x producing the
    TP payload [u | s] = [(x⊙γ)@A | Σx²] ([T, r+1]; see rmsnorm.py for the math). The bf16
    rounding of x⊙γ before the MMA has the same relative error as BOOST's local normalisation
    (rounding is scale-invariant), so no separate x̂ pass or rms rescale is needed.
All backwards are Pallas GEMMs too (custom_vjp). Masks cover every ragged edge; tiles are
powers of two >= 16 so the kernels lower to Triton (checked by tests via jax.export).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from boost_jax.pallas.common import F32, align_vma, flat, mm, pow2, sds, triton_params


def _blocks(M, N, K):
    """Tiles (bm, bn, bk) and num_warps: 128-wide tiles once a dim is large (Triton-tutorial
    sizes; 3 stages of 128x32 + 32x128 bf16 tiles fit any A100/H100 shared memory)."""
    bm, bn = (128 if M >= 1024 else 64), (128 if N >= 1024 else 64)
    bm, bn, bk = min(bm, pow2(M)), min(bn, pow2(N)), min(32, pow2(K))
    return bm, bn, bk, (8 if bm * bn >= 128 * 128 else 4)


# ---------------------------------------------------------------- batched GEMM kernel
def _bmm_kernel(a_ref, b_ref, o_ref, *, M, N, K, bm, bn, bk, ta, tb, n_sizes, cdt):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = i * bm + jnp.arange(bm), j * bn + jnp.arange(bn)
    n_lim = N
    if n_sizes is not None:  # this group's true width (static table, selected by scalar ops)
        n_lim = jnp.int32(n_sizes[-1])
        for q in range(len(n_sizes) - 1):
            n_lim = jnp.where(g == q, jnp.int32(n_sizes[q]), n_lim)
    rm, cm = rows < M, cols < n_lim

    def body(k, acc):
        km = k * bk + jnp.arange(bk) < K
        kd = pl.ds(k * bk, bk)
        if ta:  # a stored [K, M]
            a = plt.load(a_ref.at[kd, :], mask=km[:, None] & rm[None, :], other=0)
        else:
            a = plt.load(a_ref.at[:, kd], mask=rm[:, None] & km[None, :], other=0)
        if tb:  # b stored [N, K]
            b = plt.load(b_ref.at[:, kd], mask=cm[:, None] & km[None, :], other=0)
        else:
            b = plt.load(b_ref.at[kd, :], mask=km[:, None] & cm[None, :], other=0)
        return acc + mm(a.astype(cdt), b.astype(cdt), ((0 if ta else 1,), (1 if tb else 0,)))

    nk = pl.cdiv(K, bk)
    if n_sizes is not None:  # column tile wholly past n_g: no K loop, store zeros
        nk = jnp.where(j * bn < n_lim, nk, 0)
    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), F32))
    plt.store(o_ref, acc.astype(o_ref.dtype), mask=rm[:, None] & (cols < N)[None, :])


def bmm(a, b, *, ta=False, tb=False, out_dtype=None, n_sizes=None, interpret=False):
    """Batched GEMM [G,M,K]×[G,K,N] (a stored [G,K,M] if ta, b stored [G,N,K] if tb)."""
    G = a.shape[0]
    K, M = (a.shape[1], a.shape[2]) if ta else (a.shape[2], a.shape[1])
    N = b.shape[1] if tb else b.shape[2]
    bm, bn, bk, nw = _blocks(M, N, K)
    Kp = pl.cdiv(K, bk) * bk
    a_spec = (pl.BlockSpec((None, Kp, bm), lambda g, i, j: (g, 0, i)) if ta else
              pl.BlockSpec((None, bm, Kp), lambda g, i, j: (g, i, 0)))
    b_spec = (pl.BlockSpec((None, bn, Kp), lambda g, i, j: (g, j, 0)) if tb else
              pl.BlockSpec((None, Kp, bn), lambda g, i, j: (g, 0, j)))
    cdt = jnp.promote_types(a.dtype, b.dtype)
    out_dtype = out_dtype or cdt
    return pl.pallas_call(
        partial(_bmm_kernel, M=M, N=N, K=K, bm=bm, bn=bn, bk=bk, ta=ta, tb=tb,
                n_sizes=n_sizes, cdt=cdt),
        out_shape=sds((G, M, N), out_dtype, a),
        grid=(G, pl.cdiv(M, bm), pl.cdiv(N, bn)),
        in_specs=[a_spec, b_spec],
        out_specs=pl.BlockSpec((None, bm, bn), lambda g, i, j: (g, i, j)),
        compiler_params=triton_params(nw, 3), interpret=interpret, name="grouped_gemm",
    )(a, b)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gmm(z, b, n_sizes, interpret):
    return bmm(z, b, n_sizes=n_sizes, interpret=interpret)


def _gmm_fwd(z, b, n_sizes, interpret):
    return _gmm(z, b, n_sizes, interpret), (z, b)


def _gmm_bwd(n_sizes, interpret, res, gy):
    z, b = res
    dz = bmm(gy, b, tb=True, out_dtype=z.dtype, interpret=interpret)  # [G,T,n]·[G,r,n]^T
    db = bmm(z, gy, ta=True, out_dtype=b.dtype, n_sizes=n_sizes, interpret=interpret)
    return dz, db


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# ---------------------------------------------------------------- (a) grouped up-projection
def _stack_groups(z, b):
    """-> z [G,T,r], b [G,r,nmax], n_sizes (None if uniform), lead dims, is_list."""
    z = jnp.stack(list(z)) if isinstance(z, (list, tuple)) else z
    lead = z.shape[1:-1]
    z = z.reshape(z.shape[0], -1, z.shape[-1])
    if not isinstance(b, (list, tuple)):
        return z, b, None, lead, False
    ns = tuple(int(w.shape[-1]) for w in b)
    nmax = max(ns)
    b = jnp.stack([jnp.pad(w, ((0, 0), (0, nmax - w.shape[-1]))) for w in b])
    return z, b, (None if len(set(ns)) == 1 else ns), lead, True


def _unstack(y, b_in, lead, is_list):
    if not is_list:
        return y.reshape(y.shape[0], *lead, y.shape[-1])
    return [y[q, :, : w.shape[-1]].reshape(*lead, w.shape[-1]) for q, w in enumerate(b_in)]


def grouped_up(z, b, *, interpret: bool = False):
    """Pallas. z [G, ..., r] (or list of G [..., r]); b [G, r, n] -> [G, ..., n], or b a list of
    G [r, n_g] (n_g may differ, GQA) -> list of G [..., n_g]."""
    zz, bb, ns, lead, is_list = _stack_groups(z, b)
    zz, bb = align_vma(zz, bb)
    return _unstack(_gmm(zz, bb, ns, bool(interpret)), b, lead, is_list)


def xla_mm(a, b):
    """The XLA twins' 2-D GEMM (concat_down_ref, rmsnorm.norm_matmul_ref; grouped_up_ref's
    einsum keeps the same rules): output in the inputs' dtype (accumulated in fp32 all the
    same), so autodiff's backward GEMMs stay in that dtype; an fp32 output would hand them an
    fp32 cotangent and make them fp32 GEMMs. fp32 inputs use IEEE (no TF32), as mm."""
    prec = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=a.dtype)


def grouped_up_ref(z, b, *, interpret: bool = False):
    """XLA reference (einsum over the stacked group axis), same signature as grouped_up."""
    del interpret
    zz, bb, _, lead, is_list = _stack_groups(z, b)
    cdt = jnp.promote_types(zz.dtype, bb.dtype)
    prec = lax.Precision.HIGHEST if cdt == F32 else None
    # output in cdt (the GEMM still accumulates in fp32): an fp32 output would make the
    # backward's cotangent fp32 and both backward GEMMs fp32 ones
    y = jnp.einsum("gtr,grn->gtn", zz.astype(cdt), bb.astype(cdt), precision=prec,
                   preferred_element_type=cdt)
    return _unstack(y, b, lead, is_list)


# ---------------------------------------------------------------- (b) concatenated down-projection
def _concat(a_list, sizes):
    if isinstance(a_list, (list, tuple)):
        return jnp.concatenate(list(a_list), axis=-1), [int(w.shape[-1]) for w in a_list]
    return a_list, list(sizes or [a_list.shape[-1]])


def _split(y, sizes, lead):
    offs = [sum(sizes[:q]) for q in range(len(sizes))]
    return [y[:, o:o + s].reshape(*lead, s) for o, s in zip(offs, sizes)]


def concat_down(x, a_list, sizes: Optional[Sequence[int]] = None, *, interpret: bool = False):
    """Pallas. x [..., d] @ [A_1|A_2|…] (list of [d, r_k], or one [d, Σr_k] with sizes)
    -> list of [..., r_k], computed as one GEMM."""
    a, sizes = _concat(a_list, sizes)
    x, a = align_vma(x, a)
    y = _gmm(flat(x)[None], a[None], None, bool(interpret))[0]
    return _split(y, sizes, x.shape[:-1])


def concat_down_ref(x, a_list, sizes: Optional[Sequence[int]] = None, *,
                    interpret: bool = False):
    del interpret
    a, sizes = _concat(a_list, sizes)
    cdt = jnp.promote_types(x.dtype, a.dtype)
    y = xla_mm(flat(x).astype(cdt), a.astype(cdt))
    return _split(y, sizes, x.shape[:-1])


# ---------------------------------------------------------------- (c) fused norm + down-projection
def _nm_fwd_kernel(x_ref, g_ref, a_ref, o_ref, *, T, d, r, bm, bn, bk, cdt):
    j = pl.program_id(1)
    rows, cols = pl.program_id(0) * bm + jnp.arange(bm), j * bn + jnp.arange(bn)
    rm, cm = rows < T, cols < r

    def body(k, carry):
        acc, ss = carry
        km = k * bk + jnp.arange(bk) < d
        kd = pl.ds(k * bk, bk)
        x = plt.load(x_ref.at[:, kd], mask=rm[:, None] & km[None, :], other=0).astype(F32)
        g = plt.load(g_ref.at[kd], mask=km, other=0).astype(F32)
        a = plt.load(a_ref.at[kd, :], mask=km[:, None] & cm[None, :], other=0)
        xg = (x * g[None, :]).astype(cdt)
        return acc + mm(xg, a.astype(cdt)), ss + jnp.sum(x * x, axis=1)

    acc, ss = lax.fori_loop(0, pl.cdiv(d, bk), body,
                            (jnp.zeros((bm, bn), F32), jnp.zeros((bm,), F32)))
    plt.store(o_ref.at[:, pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
              mask=rm[:, None] & cm[None, :])
    # the s column, written once; a [bm, 1] slice (int indices break masked stores in interpret)
    plt.store(o_ref.at[:, pl.ds(r, 1)], ss[:, None].astype(o_ref.dtype),
              mask=(rm & (j == 0))[:, None])


def _nm_dx_kernel(x_ref, g_ref, a_ref, gp_ref, dx_ref, dg_ref, *, T, d, r, bm, bn, bk, cdt):
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    cols = pl.program_id(1) * bn + jnp.arange(bn)  # over d
    rm, cm = rows < T, cols < d

    def body(k, acc):  # d(x⊙γ) = gu @ A^T, K = r
        km = k * bk + jnp.arange(bk) < r
        kd = pl.ds(k * bk, bk)
        gu = plt.load(gp_ref.at[:, kd], mask=rm[:, None] & km[None, :], other=0)
        a = plt.load(a_ref.at[:, kd], mask=cm[:, None] & km[None, :], other=0)
        return acc + mm(gu.astype(cdt), a.astype(cdt), ((1,), (1,)))

    dxg = lax.fori_loop(0, pl.cdiv(r, bk), body, jnp.zeros((bm, bn), F32))
    m = rm[:, None] & cm[None, :]
    x = plt.load(x_ref, mask=m, other=0).astype(F32)
    g = plt.load(g_ref, mask=cm, other=0).astype(F32)
    gs = plt.load(gp_ref.at[:, pl.ds(r, 1)], mask=rm[:, None], other=0).astype(F32)  # [bm, 1]
    plt.store(dx_ref, (dxg * g[None, :] + 2.0 * x * gs).astype(dx_ref.dtype), mask=m)
    plt.store(dg_ref, jnp.sum(dxg * x, axis=0), mask=cm)  # per-token-block partial of dγ


def _nm_da_kernel(x_ref, g_ref, gp_ref, da_ref, *, T, d, r, bm, bn, bk, cdt):
    drow = pl.program_id(0) * bm + jnp.arange(bm)
    rcol = pl.program_id(1) * bn + jnp.arange(bn)
    dm, cm = drow < d, rcol < r
    g = plt.load(g_ref, mask=dm, other=0).astype(F32)

    def body(k, acc):  # dA = (x⊙γ)^T @ gu, K = T
        tm = k * bk + jnp.arange(bk) < T
        kd = pl.ds(k * bk, bk)
        x = plt.load(x_ref.at[kd, :], mask=tm[:, None] & dm[None, :], other=0).astype(F32)
        gu = plt.load(gp_ref.at[kd, :], mask=tm[:, None] & cm[None, :], other=0)
        return acc + mm((x * g[None, :]).astype(cdt), gu.astype(cdt), ((0,), (0,)))

    acc = lax.fori_loop(0, pl.cdiv(T, bk), body, jnp.zeros((bm, bn), F32))
    plt.store(da_ref, acc.astype(da_ref.dtype), mask=dm[:, None] & cm[None, :])


def _nm_call(x, g, a, out_dtype, interpret):
    (T, d), r = x.shape, a.shape[1]
    bm, bn, bk, nw = _blocks(T, r, d)
    dp, pp = pl.cdiv(d, bk) * bk, pow2(r + 1)
    return pl.pallas_call(
        partial(_nm_fwd_kernel, T=T, d=d, r=r, bm=bm, bn=bn, bk=bk,
                cdt=jnp.promote_types(x.dtype, a.dtype)),
        out_shape=sds((T, r + 1), out_dtype, x),
        grid=(pl.cdiv(T, bm), pl.cdiv(r, bn)),
        in_specs=[pl.BlockSpec((bm, dp), lambda i, j: (i, 0)),
                  pl.BlockSpec((dp,), lambda i, j: (0,)),
                  pl.BlockSpec((dp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, pp), lambda i, j: (i, 0)),
        compiler_params=triton_params(nw, 3), interpret=interpret, name="norm_matmul_fwd",
    )(x, g, a)


def _nm_bwd_call(x, g, a, gp, interpret):
    (T, d), r = x.shape, a.shape[1]
    pp = pow2(r + 1)
    bm, bn, bk, nw = _blocks(T, d, r)
    nb = pl.cdiv(T, bm)
    rp = pl.cdiv(r, bk) * bk
    dx, dgp = pl.pallas_call(
        partial(_nm_dx_kernel, T=T, d=d, r=r, bm=bm, bn=bn, bk=bk,
                cdt=jnp.promote_types(gp.dtype, a.dtype)),
        out_shape=(sds((T, d), x.dtype, x), sds((nb, d), F32, x)),
        grid=(nb, pl.cdiv(d, bn)),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                  pl.BlockSpec((bn,), lambda i, j: (j,)),
                  pl.BlockSpec((bn, rp), lambda i, j: (j, 0)),
                  pl.BlockSpec((bm, pp), lambda i, j: (i, 0))],
        out_specs=(pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                   pl.BlockSpec((None, bn), lambda i, j: (i, j))),
        compiler_params=triton_params(nw, 3), interpret=interpret, name="norm_matmul_bwd_dx",
    )(x, g, a, gp)
    bm, bn, bk, nw = _blocks(d, r, T)
    tp = pl.cdiv(T, bk) * bk
    da = pl.pallas_call(
        partial(_nm_da_kernel, T=T, d=d, r=r, bm=bm, bn=bn, bk=bk,
                cdt=jnp.promote_types(x.dtype, gp.dtype)),
        out_shape=sds((d, r), a.dtype, x),
        grid=(pl.cdiv(d, bm), pl.cdiv(r, bn)),
        in_specs=[pl.BlockSpec((tp, bm), lambda i, j: (0, i)),
                  pl.BlockSpec((bm,), lambda i, j: (i,)),
                  pl.BlockSpec((tp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(nw, 3), interpret=interpret, name="norm_matmul_bwd_da",
    )(x, g, gp)
    return dx, jnp.sum(dgp, axis=0).astype(g.dtype), da


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm_matmul(x, g, a, out_dtype, interpret):
    return _nm_call(x, g, a, out_dtype, interpret)


def _norm_matmul_fwd(x, g, a, out_dtype, interpret):
    return _nm_call(x, g, a, out_dtype, interpret), (x, g, a)


def _norm_matmul_bwd(out_dtype, interpret, res, gp):
    return _nm_bwd_call(*res, gp, interpret)


_norm_matmul.defvjp(_norm_matmul_fwd, _norm_matmul_bwd)


def norm_matmul(x, gamma, a, *, out_dtype=None, interpret: bool = False):
    """Pallas, fused: x [..., d_i], γ [d_i], A [d_i, r] -> payload [..., r+1] = [(x⊙γ)@A | Σx²]
    in out_dtype (default x.dtype). XLA twin: rmsnorm.norm_matmul_ref."""
    x, gamma, a = align_vma(x, gamma, a)
    p = _norm_matmul(flat(x), gamma, a, jnp.dtype(out_dtype or x.dtype), bool(interpret))
    return p.reshape(*x.shape[:-1], p.shape[-1])
