"""Plan a run at cluster scale before paying for it.

    costmodel  α–β + roofline model of one training step: memory, step time of a plan × TP
    roofline   hardware assumptions and the per-kernel roofline of one decoder block
    collectives  α–β cost of ring collectives per topology level (analytic or measured)
    saved      what the layer stack keeps for its backward without remat, traced with JAX
    dryrun     AOT compile of the real step on simulated CPU devices, with layer/host extrapolation
    search     rank candidate layouts (plan × TP × micro-batch × remat) that fit

Predicted vs published, and the figures: benchmarks/published.py, benchmarks/plots.py.

CLI: python -m boost_jax.plan --config configs/X.yaml --topology frontier --nodes 48 [--search]
"""
