"""What drives allocator models with events: replay, what-ifs, the step workload, templates,
the simulator and its time model, the job of many ranks, sweeps and the executors they run on.
"""
