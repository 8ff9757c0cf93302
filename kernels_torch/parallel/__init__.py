"""Parallel layouts of the torch path, kept beside the model (``kernels_torch.model`` has no process-group code):
``mesh`` (one device mesh of pipeline, data, context and expert parallelism, after torchtitan's ``ParallelDims``),
``context`` (context parallelism: sequence shards, the KDA state/conv hand-off, the MLA/DSA latent all-gather),
``fsdp`` (FSDP2 over the mesh, DCP checkpoints), ``expert`` (expert parallelism of the MoE: DTensor expert stacks,
all-to-all dispatch and combine), ``pipeline`` (pipeline stages at AttnRes block boundaries through
``torch.distributed.pipelining``), ``load`` (each rank reads only its shards of a checkpoint into a model built on
``meta``) and ``export`` (each rank writes its own files of the safetensors export)."""
