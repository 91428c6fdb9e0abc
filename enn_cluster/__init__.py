"""enn_cluster: distributed PyTorch training and prediction on Slurm + Pyxis/Enroot.

Importing the package stays cheap (no torch): the CLI must start fast.
"""

__version__ = "0.1.0"

__all__ = ["train", "predict", "export", "Run"]


def __getattr__(name):
    """`enn_cluster.train/predict/export/Run` load on first use, keeping `import enn_cluster` light."""
    if name in ("train", "predict", "export"):
        from enn_cluster.client import api

        return getattr(api, name)
    if name == "Run":
        from enn_cluster.client.run_handle import Run

        return Run
    raise AttributeError(f"module 'enn_cluster' has no attribute {name!r}")
