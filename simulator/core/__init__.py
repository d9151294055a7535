"""The engine's core: its meaning written once (docs/architecture.md, "The core").

* :mod:`daopsim.simulator.core.ops`: operations, counters and run statistics;
* :mod:`daopsim.simulator.core.resources`: lanes, the shared host CPU, the host thread, residency;
* :mod:`daopsim.simulator.core.machine`: the resources of one run, named, with their bound costs;
* :mod:`daopsim.simulator.core.apply`: a checked plan into operations;
* :mod:`daopsim.simulator.core.executor`: the queueing rule and each layer's GPU streams;
* :mod:`daopsim.simulator.core.loop`: the step loop over sequences, steps and layers.
"""
