"""Launch a training run on a cluster.

    slurm   a ready sbatch script from a config and a topology profile (boost_jax/mesh.py)

CLI: python -m boost_jax.launch slurm --config X.yaml --topology frontier --nodes 48 \\
         --account abc123 --time 02:00:00 --out job.sbatch [key=value ...]
"""
