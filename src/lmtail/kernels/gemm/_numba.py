"""The "numba" backend of gemm_bf16's chain order (kernels.gemm.bf16 imports this module only when
that backend runs, so `import lmtail` never imports numba). The same chain as gemm_chain.c:
per output element acc = fl32(acc + a*w) for h = 0..H-1 from +0.0 (a*w exact in float64,
one rounding to fp32 per step: an fma), NaN stored as the canonical quiet NaN."""
from __future__ import annotations

import numba
import numpy as np
import torch

_NUMBA_TILE = 64


@numba.njit(parallel=True, cache=True)
def _chain_numba(aT, w16, out):  # aT [H, M] f32, w16 [H, V] u16, out [M, V] f32 (a view)
    H, M = aT.shape
    V = w16.shape[1]
    for t in numba.prange((V + _NUMBA_TILE - 1) // _NUMBA_TILE):
        c0 = t * _NUMBA_TILE
        nc = min(V - c0, _NUMBA_TILE)
        bits = np.empty((H, nc), np.uint32)  # [H, nc]
        for h in range(H):
            for c in range(nc):  # bf16 -> fp32 is exact: the bits shifted left by 16
                bits[h, c] = np.uint32(w16[h, c0 + c]) << np.uint32(16)
        wt = bits.view(np.float32)  # [H, nc]
        acc = np.empty(nc, np.float32)
        for m in range(M):
            acc[:] = 0.0
            for h in range(H):
                am = np.float64(aT[h, m])
                for c in range(nc):  # fma32 = round32(acc + a*w): a*w exact in float64
                    acc[c] = np.float32(np.float64(acc[c]) + am * np.float64(wt[h, c]))
            for c in range(nc):
                out[m, c0 + c] = np.float32(np.nan) if np.isnan(acc[c]) else acc[c]


def chain(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[:, :] = the chain of a [M, H] bf16 and w [H, V] bf16 (validated by the caller)."""
    aT = a.detach().float().t().contiguous()  # [H, M] fp32, exact widening
    _chain_numba(aT.numpy(), w.detach().view(torch.int16).numpy().view(np.uint16), out.detach().numpy())
