"""The scale simulator: the real controller, replay queue and worker policy driven on a virtual clock by timed
stand-ins for the vLLM engines and the learner (simulation.py), with its scenario and stand-in workload
(scenario.py), the tool model of multi-turn samples (tools.py) and length-aware dispatch's engine queues
(dispatch.py). It loads no Ray, vLLM or DeepSpeed: benchmarks/simulate_async.py and control_plane.py and the tests
run hundreds of engines in one process."""
