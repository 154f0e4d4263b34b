"""Tensor parallelism over torch.distributed: shard.py cuts a checkpoint per rank, group.py joins
the ranks, relay.py sends each step from rank 0 to the others, launch.py starts them."""
