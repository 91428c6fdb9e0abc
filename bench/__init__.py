"""`make bench`: enn_cluster against same-run baselines (see bench/README.md).

Every figure is a ratio to a baseline measured in the same run on the same machine:
the median over repeats decides pass/miss, min and max show the noise.
"""
