"""The fault soak: harness runs under injected faults (killed workers, routers, drivers) and the process-tree
watch that checks nothing is left behind."""
