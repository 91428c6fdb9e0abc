"""enn_cluster: distributed PyTorch training and prediction on Slurm + Pyxis/Enroot.

Importing the package stays cheap (no torch): the CLI must start fast.
"""

__version__ = "0.1.0"
