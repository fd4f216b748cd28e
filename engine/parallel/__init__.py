"""Tensor parallelism: the head split, sharded layers and loading, the step broadcast,
and the ranks of a group."""
