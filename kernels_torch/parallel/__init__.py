"""Parallel layouts of the torch path, kept beside the model (``kernels_torch.model`` has no process-group code):
``context`` (context parallelism: sequence shards, the KDA state/conv hand-off, the MLA/DSA latent all-gather),
``fsdp`` (FSDP2 and the 2-D device mesh) and ``expert`` (expert parallelism of the MoE: all-to-all dispatch and
combine)."""
