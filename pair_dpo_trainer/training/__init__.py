"""One run's step machinery: the checks collected at start, accumulation, the objective at run time (step contexts,
state, the step-boundary callback), pair log-probs from the model's outputs.

The trainer calls these; they hold the run's maths and bookkeeping so that ``trainer.py`` only orchestrates.
"""
