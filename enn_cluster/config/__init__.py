"""Both sides: the run config (parsed, checked, documented) and the values derived from it
once and passed on (mesh plan, batch plan, NCCL profile tables). Imports nothing else of ours
but errors."""
