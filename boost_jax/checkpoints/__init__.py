"""Checkpoints, written by train/ and read by infer/ through the public names here.

    store       save/restore with orbax (Checkpointer), checksums, unusable steps moved aside
    seal        CRC-32 of every file of a step, written before it is renamed into place
    restage     restore a checkpoint saved under another pipeline stage count
    run_config  what a resumed run may change, and the history of the configs a run used
"""
