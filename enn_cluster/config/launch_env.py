"""Names of the environment variables our launchers set for their workers: the one contract
between the client side (local launcher, submitit path) and the worker, kept where both
import it so that neither imports the other."""
SIM_NODES_VAR = "ENN_SIM_NODES"  # local launcher: how many nodes the processes pretend to be
LOCK_HELD_VAR = "ENN_LOCK_HELD"  # the launcher holds the run lock for its workers
LAUNCHER_PID_VAR = "ENN_LAUNCHER_PID"  # workers die with the local launcher
LAUNCH_ID_VAR = "ENN_LAUNCH_ID"  # one id per local launch: names its log directory
SUBMISSION_VAR = "ENN_SUBMISSION"  # enn-submit on Slurm: the token its claim on run.lock names
