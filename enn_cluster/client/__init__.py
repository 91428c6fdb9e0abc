"""Client side: runs on the login node or in a notebook. The CLI and the Python API call the
same functions here; they prepare run directories, launch (locally or through `cluster`),
watch, collect and plot. Imports cluster, storage and config; nothing imports the client."""
