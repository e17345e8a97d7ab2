"""Random test weights for a param tree: norm scales and LaX gates near their init, matrices
scaled by 1/sqrt(fan-in), so every code path sees well-conditioned, non-trivial values."""

import jax
import numpy as np


def random_weights(tree, seed=0, dtype=None):
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        v = rng.normal(size=x.shape)
        if name in ("scale", "latent_scale"):
            v = 1.0 + 0.1 * v
        elif name == "g":
            v = np.eye(x.shape[-1]) + 0.1 * v
        else:
            v = v / np.sqrt(x.shape[-2] if x.ndim > 1 else 1.0)
        return np.asarray(v, dtype or x.dtype)

    return jax.tree_util.tree_map_with_path(fill, tree)
