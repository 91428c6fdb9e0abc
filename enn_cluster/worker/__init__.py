"""Compute-node side: every task runs `python -m enn_cluster.worker` (or submitit calls
`slurm_entry.worker_entry`): environment, lanes, mesh, model, training, prediction and
checkpoint writing. Imports storage and config only."""
