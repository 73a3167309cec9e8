"""``rollplex bench``: workloads measured side by side in one process on the GPU."""
