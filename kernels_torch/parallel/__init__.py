"""Parallel layouts of the torch path, kept beside the model (``kernels_torch.model`` has no process-group code):
``context`` (context parallelism: sequence shards, the KDA state/conv hand-off, the MLA/DSA latent all-gather) and
``fsdp`` (FSDP2 and the 2-D device mesh)."""
