"""`python -m enn_cluster.worker`: the entry point every launcher starts on every task."""
from enn_cluster.worker.entry import exit_now, main

exit_now(main())
