"""Login-node side of Slurm: the job spec, Pyxis/Enroot flags, site config, images and the
submission through submitit. Pure renderers (scripts, flags) sit apart from `submit_slurm`
and `image`, which run commands. Imports storage and config (and the one function each
Slurm task runs, `worker.slurm_entry`)."""
