"""The run directory on the shared filesystem, read and written by both sides: layout and
lock, staged data, checkpoint commit records, DCP I/O, checksums, manifests, metrics.
Imports config only."""
