"""Pallas (Triton) kernels for BTP: fused Online-RMSNorm and grouped projections.

Use the dispatch functions; they pick Pallas or the XLA twin from `parallel.kernels`.
"""

from boost_jax.pallas.dispatch import (  # noqa: F401
    KINDS,
    concat_down,
    grouped_up,
    interpret_mode,
    norm_matmul,
    online_rmsnorm,
    online_rmsnorm_matmul,
    resolve,
    shard_map_check_vma,
)
from boost_jax.pallas.rmsnorm import online_rmsnorm_finish, online_rmsnorm_partial  # noqa: F401
