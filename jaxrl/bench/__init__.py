"""`jaxrl bench`: the programs `jaxrl train` runs, timed on the hardware at hand and set beside
its limits (jaxrl/commands/bench.py is the command; subject.py builds the model under test,
limits.py counts a decode step's bytes and FLOPs, runs.py times sample, step and engine)."""
